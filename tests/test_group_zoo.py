"""The exact rescaling group of the networks people train (manifolds._group_discovery), checked on a zoo.

For each model: the group's dimension equals a count made by hand; random group elements preserve the
outputs to 1e-12 (float64); the node- and layer-wise measures equal dense ``torch.func.hessian`` references
built from the formulas (log-coordinate Hessian, conformal Levi-Civita terms) and stay unchanged under
group elements while the Euclidean measure moves.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from manifolds import analyze, buffer_group, random_rescale
from sharpness import Objective, Solver, dense_hessian, dense_riemannian_hessian, measure_sharpness
from sharpness._resnet import BasicBlock  # the post-activation block of the built-in ResNet-20

TIGHT = Solver(tol=1e-12)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.layer1 = BasicBlock(4, 4, 1)
        self.layer2 = BasicBlock(4, 6, 2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class PreActResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1, self.conv1 = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn, self.fc = nn.BatchNorm2d(4), nn.Linear(4, 3)

    def forward(self, x):
        x = self.conv(x)
        out = self.conv1(F.relu(self.bn1(x)))
        x = x + self.conv2(F.relu(self.bn2(out)))
        return self.fc(F.relu(self.bn(x)).mean((2, 3)))


def vgg():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3),
    )  # fmt: skip


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0, self.conv1, self.conv2 = (
            nn.Conv2d(3, 4, 3, padding=1),
            nn.Conv2d(4, 2, 3, padding=1),
            nn.Conv2d(6, 2, 1),
        )
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h0 = F.relu(self.conv0(x))
        h1 = F.relu(self.conv1(h0))
        h2 = F.relu(self.conv2(torch.cat([h0, h1], dim=1)))
        return self.fc(F.adaptive_avg_pool2d(torch.cat([h0, h1, h2], 1), 1).view(x.size(0), -1))


class ResidualMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.fc1, self.fc2, self.out = nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = F.relu(h + self.fc2(F.relu(self.fc1(h))))
        return self.out(h)


def norm_mlp():
    return nn.Sequential(
        nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4), nn.ReLU(),
        nn.Linear(4, 3),
    )  # fmt: skip


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        x = F.relu(self.inp(x))
        x = F.relu(self.shared(x))
        x = F.relu(self.shared(x))
        return self.out(x)


def grouped():
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=6, padding=1), nn.ReLU(),
        nn.Conv2d(6, 3, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3),
    )  # fmt: skip


def adaptive():
    return nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(), nn.Linear(20, 3))


# name -> (builder, input shape, node-wise dimension, layer-wise dimension), counted by hand:
ZOO = {
    # stream of 4 (stem BN, layer1.bn2) + layer1.bn1 4 + layer2.bn1 6 + stream of 6 (layer2.bn2, shortcut BN)
    "resnet": (ResNet, (3, 6, 6), 20, 4),
    # the stem conv feeds a BatchNorm, so the residual stream is pinned; bn1, bn2, bn outputs are free
    "preact_resnet": (PreActResNet, (3, 5, 5), 12, 3),
    # both BatchNorm outputs and the hidden Linear
    "vgg_bn": (vgg, (3, 6, 6), 15, 3),
    # conv0, conv1, conv2 outputs; the concatenations merge all three into one layer-wise scale
    "densenet": (Dense, (3, 5, 5), 8, 1),
    # the residual ties inp and fc2 outputs (5) + fc1 (6)
    "residual_mlp": (ResidualMLP, (4,), 11, 2),
    # LayerNorm's affine output (6) + the Linear after GELU (4); GELU pins the Linear before it
    "layernorm_gelu": (norm_mlp, (4,), 10, 2),
    # one set of scales for the shared module, tied to its input
    "shared": (Shared, (4,), 4, 1),
    # grouped (6) + depthwise (6) + pointwise (3)
    "grouped": (grouped, (4, 6, 6), 15, 3),
    # 5 channels, each feeding 4 flattened features
    "adaptive_pool": (adaptive, (3, 5, 5), 5, 1),
}


def build(name: str, seed: int = 0):
    builder, shape, node_dim, layer_dim = ZOO[name]
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = builder().double()
    with torch.no_grad():  # away from initialisation: no zero block, BatchNorm statistics that matter
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=g, dtype=torch.float64))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=torch.float64))
    model.eval()
    x = torch.randn(10, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    return model, x, y, node_dim, layer_dim


def dense_node(obj, group):
    return float(torch.linalg.eigvalsh(dense_riemannian_hessian(obj, "node", group))[-1])


def dense_layer(obj, group):
    return float(torch.linalg.eigvalsh(dense_riemannian_hessian(obj, "layer", group))[-1])


@pytest.fixture(params=list(ZOO))
def zoo(request):
    return request.param, *build(request.param)


def test_group_dimension_is_the_hand_count(zoo):
    name, model, x, _, node_dim, layer_dim = zoo
    structure = analyze(model, example_input=x)
    assert structure.group.dim == node_dim, structure.group.describe()
    assert structure.layer_group.dim == layer_dim
    assert not structure.group.unknown


@pytest.mark.parametrize("kind", ["node", "layer"])
def test_random_group_elements_preserve_outputs(zoo, kind):
    name, model, x, *_ = zoo
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = random_rescale(model, kind, scale=1.0, generator=torch.Generator().manual_seed(3), example_input=x)
    torch.testing.assert_close(twin(x), model(x), rtol=1e-12, atol=1e-12)
    pairs = zip(twin.parameters(), model.parameters(), strict=True)
    moved = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert moved > 0.1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model is untouched


def test_measures_equal_dense_references_and_are_invariant(zoo):
    name, model, x, y, *_ = zoo
    loss = nn.CrossEntropyLoss()
    obj = Objective(model, loss, (x, y))
    structure = obj.structure
    node = measure_sharpness(model, loss, (x, y), "node", solver=TIGHT, objective=obj, progress=False)
    layer = measure_sharpness(model, loss, (x, y), "layer", solver=TIGHT, objective=obj, progress=False)
    euclid = measure_sharpness(model, loss, (x, y), "euclidean", solver=TIGHT, objective=obj, progress=False)
    assert node.value == pytest.approx(dense_node(obj, structure.group), rel=1e-8)
    assert layer.value == pytest.approx(dense_layer(obj, structure.layer_group), rel=1e-8)

    g = torch.Generator().manual_seed(7)
    for group, invariant in ((structure.group, ("node",)), (structure.layer_group, ("node", "layer"))):
        twin = obj.with_params(group.act(obj.params, group.random_log_scales(1.0, g)))
        values = {m: measure_sharpness(model, loss, (x, y), m, solver=TIGHT, objective=twin, progress=False).value
                  for m in ("node", "layer", "euclidean")}  # fmt: skip
        for m in invariant:
            assert values[m] == pytest.approx({"node": node, "layer": layer}[m].value, rel=1e-8), m
        assert abs(values["euclidean"] / euclid.value - 1) > 1e-3


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("resnet", 20 + 30),  # the six BatchNorm inputs: stem 4, layer1 4 + 4, layer2 6 + 6 + shortcut 6
        ("preact_resnet", 12 + 8),  # the residual stream (4) and conv1's output (4)
        ("vgg_bn", 15 + 10),  # both convolutions' outputs
    ],
)
def test_batchnorm_statistics_rescale_too(name, dim):
    model, x, y, *_ = build(name)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-14
    group = buffer_group(model, x)
    assert group.dim == dim
    assert any(a.role == "buffer" and a.name.endswith("running_var") and a.power == 2 for a in group.actions)
    twin = random_rescale(model, "node", scale=1.0, generator=torch.Generator().manual_seed(4), buffers=True,
                          example_input=x)  # fmt: skip
    torch.testing.assert_close(twin(x), model(x), rtol=1e-12, atol=1e-12)
    if name == "resnet":  # the stem BatchNorm's statistics follow its input channels
        ratio = twin.bn.running_var / model.bn.running_var
        torch.testing.assert_close(ratio, (twin.conv.weight / model.conv.weight)[:, 0, 0, 0] ** 2, rtol=1e-12, atol=0)
    loss = nn.CrossEntropyLoss()
    before, after = (
        {m: measure_sharpness(net, loss, (x, y), m, solver=TIGHT, progress=False).value for m in ("node", "euclidean")}
        for net in (model, twin)
    )
    assert after["node"] == pytest.approx(before["node"], rel=1e-8)
    assert abs(after["euclidean"] / before["euclidean"] - 1) > 1e-2


def test_report_names_pins_with_reasons():
    model, x, *_ = build("resnet")
    group = analyze(model, example_input=x).group
    text = group.describe()
    assert "input of module 'layer1.bn1' (BatchNorm2d): 4 channel(s), BatchNorm2d in eval mode" in text
    assert "the network's output is the loss's input" in text
    stream = next(c for c in group.classes if "output of module 'bn' (BatchNorm2d)[0]" in c)
    assert "output of module 'layer1.bn2' (BatchNorm2d)[0]" in stream


def test_unknown_operation_is_pinned_and_listed():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.roll(F.relu(self.a(x)), 1, dims=1))

    group = analyze(Odd(), example_input=torch.randn(2, 3)).group
    assert group.dim == 0
    assert group.unknown == ("function 'roll' (graph node 'roll')",)


def test_frozen_parameters_stay_fixed():
    """Scales acting on a frozen tensor are left out: the node measure is invariant under what remains."""
    model, x, y, *_ = build("resnet")
    model.bn.weight.requires_grad_(False)
    model.bn.bias.requires_grad_(False)
    loss = nn.CrossEntropyLoss()
    obj = Objective(model, loss, (x, y))
    assert "bn.weight" not in obj.params
    group = obj.structure.group.restricted(obj.params)
    assert group.dim == 20 - 4  # the stem BatchNorm's stream (tied to layer1.bn2) is pinned
    node = measure_sharpness(model, loss, (x, y), "node", solver=TIGHT, objective=obj, progress=False)
    assert node.value == pytest.approx(dense_node(obj, group), rel=1e-8)
    twin = obj.with_params(group.act(obj.params, group.random_log_scales(1.0, torch.Generator().manual_seed(2))))
    again = measure_sharpness(model, loss, (x, y), "node", solver=TIGHT, objective=twin, progress=False)
    assert again.value == pytest.approx(node.value, rel=1e-8)


class _Untraceable(nn.Module):
    """Data-dependent control flow: fx cannot trace it, so the rescaling group is unknown."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) if h.sum() > -1e9 else h)


def test_node_measure_without_a_graph_is_unprojected_and_says_so():
    torch.manual_seed(0)
    model = _Untraceable().double().eval()
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    loss = nn.CrossEntropyLoss()
    obj = Objective(model, loss, (x, y))
    assert obj.structure.group is None
    result = measure_sharpness(model, loss, (x, y), "node", solver=TIGHT, objective=obj, progress=False)
    assert "torch.fx cannot trace" in result.info["projection"]
    w = obj.layout.flatten(obj.params)
    log_hessian = w.abs()[:, None] * dense_hessian(obj) * w.abs()[None, :] + torch.diag(w * obj.gradient())
    top = float(torch.linalg.eigvalsh(log_hessian)[-1])
    assert top > 0 and result.value == pytest.approx(top, rel=1e-8)
    # the traceable twin (same weights) projects, and its positive top eigenvalue is the same
    twin = nn.Sequential(model.a, nn.ReLU(), model.b).eval()
    projected = measure_sharpness(twin, loss, (x, y), "node", solver=TIGHT, progress=False)
    assert "projection" not in projected.info and projected.value == pytest.approx(result.value, rel=1e-8)
