"""Structure discovery and rescalings (manifolds._structure), the symmetry operator J (_node_symmetry)."""

import math

import pytest
import torch
import torch.nn.functional as F
from cases import make_case, mlp, small_cnn
from torch import nn

from manifolds import (
    NodeSymmetry,
    ParamLayout,
    UnsupportedModelError,
    analyze,
    layer_factors,
    random_factors,
    random_rescale,
    rescale_model,
    rescale_parameters,
)
from sharpness import Objective


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in model.named_parameters()}


# ---------------------------------------------------------------- rescaling preserves the function


@pytest.mark.parametrize("kind", ["node", "layer"])
def test_random_rescale_preserves_function(rescalable_case, kind):
    model, X = rescalable_case.model, rescalable_case.X
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rescaled = random_rescale(model, kind, scale=1.0, generator=torch.Generator().manual_seed(0))

    assert rel_err(rescaled(X), model(X)) < 1e-12
    new, old = params_of(rescaled), params_of(model)
    log_norm_ratio = {k: (new[k].norm() / old[k].norm()).log().abs().item() for k in old}
    assert max(log_norm_ratio.values()) > 1.0
    if kind == "node":  # every weight tensor touches some rescaled unit
        assert all(rel_err(new[k], old[k]) > 0.1 for k in old if k.endswith("weight"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_random_rescale_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown rescaling kind 'channel'"):
        random_rescale(mlp([3, 4, 2]), kind="channel")


def test_layer_kind_matches_flatness_paper_formula():
    model = make_case("mlp_bias").model
    structure = analyze(model)
    factors = random_factors(structure, "layer", scale=1.0, generator=torch.Generator().manual_seed(0))
    old = params_of(model)
    new = rescale_parameters(old, structure, factors)

    lambdas = []
    for layer in structure.layers:
        ratio = new[layer.weight] / old[layer.weight]
        lambdas.append(ratio.flatten()[0].item())
        torch.testing.assert_close(ratio, torch.full_like(ratio, lambdas[-1]), rtol=1e-13, atol=0)
    assert math.prod(lambdas) == pytest.approx(1.0, rel=1e-12)
    assert max(abs(math.log(lam)) for lam in lambdas) > 0.5
    cumulative = 1.0
    for layer, lam in zip(structure.layers, lambdas, strict=True):
        cumulative *= lam  # b_i -> (lambda_1 ... lambda_i) b_i
        torch.testing.assert_close(new[layer.bias], cumulative * old[layer.bias], rtol=1e-13, atol=0)

    # random_rescale's layer kind: one free scale per hidden layer, every tensor scaled by one number
    assert structure.layer_group.dim == len(structure.layers) - 1
    rescaled = random_rescale(model, "layer", scale=1.0, generator=torch.Generator().manual_seed(0))
    for name, value in params_of(rescaled).items():
        ratio = value / old[name]
        torch.testing.assert_close(ratio, torch.full_like(ratio, ratio.flatten()[0].item()), rtol=1e-13, atol=0)


def test_layer_factors_reproduce_paper_example():
    model = make_case("mlp_bias").model  # 3 layers
    structure = analyze(model)
    factors = layer_factors(structure, (5, 4, 1 / 20))
    assert [f.tolist() for f in factors] == [[5.0] * 4, [20.0] * 6]
    old = params_of(model)
    new = params_of(rescale_model(model, factors))
    expected = {
        "0.weight": 5 * old["0.weight"],
        "0.bias": 5 * old["0.bias"],
        "2.weight": 4 * old["2.weight"],
        "2.bias": 20 * old["2.bias"],
        "4.weight": old["4.weight"] / 20,
        "4.bias": old["4.bias"],
    }
    for name, value in expected.items():
        torch.testing.assert_close(new[name], value, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    ("lambdas", "message"),
    [((5, 4, 1 / 19), "product 1"), ((5, 1 / 5), "expected 3"), ((-1, -1, 1), "positive")],
)
def test_layer_factors_validate(lambdas, message):
    with pytest.raises(ValueError, match=message):
        layer_factors(analyze(mlp([3, 4, 5, 2])), lambdas)


def test_rescale_parameters_is_functional_and_groups_columns():
    model = small_cnn()
    structure = analyze(model)
    factors = random_factors(structure, "node", generator=torch.Generator().manual_seed(0))
    old = params_of(model)
    snapshot = {k: v.clone() for k, v in old.items()}
    new = rescale_parameters(old, structure, factors)
    assert all(torch.equal(old[k], snapshot[k]) for k in old)

    f0, f1, f2 = factors
    # conv after conv: rows by the current channel factor, input channels divided by the previous one
    expected_conv = old["3.weight"] * f1[:, None, None, None] / f0[None, :, None, None]
    torch.testing.assert_close(new["3.weight"], expected_conv, rtol=1e-15, atol=0)
    # Linear after Flatten of 3 channels x 4 positions: column channel * 4 + pos divided by f1[channel]
    expected_linear = old["6.weight"] * f2[:, None] / f1.repeat_interleave(4)[None, :]
    torch.testing.assert_close(new["6.weight"], expected_linear, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda fs: fs[:-1], "expected 2 factor tensors"),
        (lambda fs: [fs[0][:-1], fs[1]], r"factors\[0\] must have shape \(4,\)"),
        (lambda fs: [fs[0], -fs[1]], r"factors\[1\] must be positive"),
    ],
)
def test_rescale_parameters_validates_factors(bad, message):
    model = mlp([5, 4, 6, 3])
    structure = analyze(model)
    factors = random_factors(structure, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        rescale_parameters(params_of(model), structure, bad(factors))


# ---------------------------------------------------------------------------- structure discovery


class Reversed(nn.Module):
    """Layers registered in reverse order of use; functional ReLU and flatten in forward."""

    def __init__(self):
        super().__init__()
        self.fc3 = nn.Linear(6, 2)
        self.fc2 = nn.Linear(8, 6)
        self.conv = nn.Conv2d(1, 2, 3)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)  # (B, 2, 2, 2)
        x = torch.flatten(x, 1)
        x = x.view(x.size(0), -1).reshape(x.shape[0], 8)  # size/shape feed only the target shape
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def test_analyze_follows_forward_order_and_functional_ops():
    model = Reversed()
    assert [name for name, _ in model.named_children()] == ["fc3", "fc2", "conv"]
    structure = analyze(model)
    assert structure.problems == ()
    assert [layer.name for layer in structure.layers] == ["conv", "fc2", "fc3"]
    assert [layer.module_type for layer in structure.layers] == ["Conv2d", "Linear", "Linear"]
    assert structure.operations == (("ReLU", "MaxPool2d", "Flatten", "Flatten", "Flatten"), ("ReLU",))
    assert structure.hidden_units == (2, 6)
    assert structure.n_hidden == 8
    assert structure.layers[1].in_group == 4
    X = torch.randn(7, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    rescaled = random_rescale(model, generator=torch.Generator().manual_seed(1))
    assert rel_err(rescaled(X), model(X)) < 1e-12
    assert rel_err(rescaled.conv.weight, model.conv.weight) > 0.1


def test_cnn_structure_and_in_group():
    structure = analyze(make_case("cnn").model)
    assert [(layer.name, layer.in_units, layer.in_group) for layer in structure.layers] == [
        ("0", 1, 1),
        ("3", 2, 1),
        ("6", 12, 4),
        ("8", 4, 1),
    ]
    assert structure.operations == (("ReLU", "MaxPool2d"), ("ReLU", "Flatten"), ("ReLU",))
    assert [layer.bias for layer in structure.layers] == ["0.bias", "3.bias", "6.bias", "8.bias"]


def test_linear_network_without_activation_is_rescalable():
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 2, bias=False))
    structure = analyze(model)
    assert structure.rescalable and structure.operations == ((),)
    assert [layer.bias for layer in structure.layers] == [None, None]
    bare = analyze(nn.Linear(3, 2))
    assert bare.rescalable and bare.hidden_units == () and bare.operations == ()
    assert (bare.layers[0].weight, bare.layers[0].bias) == ("weight", "bias")


def test_head_after_last_layer_keeps_symmetry():
    # Rescaling leaves the last layer's output unchanged, so a non-homogeneous head cannot break it.
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Sigmoid())
    assert analyze(model).problems == ()
    X = torch.randn(9, 3, generator=torch.Generator().manual_seed(0))
    rescaled = random_rescale(model, generator=torch.Generator().manual_seed(1))
    assert rel_err(rescaled(X), model(X)) < 1e-12


class Between(nn.Module):
    """``fc2(between(relu(fc1(x))))`` for a plain function ``between``."""

    def __init__(self, between):
        super().__init__()
        self.fc1, self.fc2, self.between = nn.Linear(3, 4), nn.Linear(4, 2), between

    def forward(self, x):
        return self.fc2(self.between(F.relu(self.fc1(x))))


@pytest.mark.parametrize(
    ("between", "operations", "problem"),
    [
        (lambda h: 2.0 * h / 3, ("ReLU", "Scale", "Scale"), None),
        (lambda h: 1.0 / h, ("ReLU", "truediv"), "function 'truediv' (graph node 'truediv')"),
        (lambda h: h * h, ("ReLU", "mul"), "function 'mul' (graph node 'mul')"),
        (lambda h: h + 1.0, ("ReLU", "add"), "function 'add' (graph node 'add')"),
    ],
)
def test_scaling_by_constants_is_homogeneous(between, operations, problem):
    structure = analyze(Between(between))
    assert structure.operations == (operations,)
    if problem is None:
        assert structure.problems == ()
    else:
        assert len(structure.problems) == 1 and structure.problems[0].startswith(problem)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = h + F.relu(self.fc2(h))
        return self.fc3(h)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        x = F.relu(self.inp(x))
        x = F.relu(self.shared(x))
        x = F.relu(self.shared(x))
        return self.out(x)


class FunctionalGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], dim=1))


class ReturnsHidden(FunctionalGelu):
    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(h), h


class FunctionalLinear(FunctionalGelu):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.eye(4))

    def forward(self, x):
        return self.fc2(F.linear(F.relu(self.fc1(x)), self.mix))


def _conv_bn():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(32, 2))


# name -> (builder, fragment naming the offending module, layers in forward order, number of problems)
BROKEN = {
    "gelu": (lambda: mlp([3, 4, 2], activation=nn.GELU), "module '1' (GELU)", ("0", "2"), 1),
    "sigmoid": (lambda: mlp([3, 4, 2], activation=nn.Sigmoid), "module '1' (Sigmoid)", ("0", "2"), 1),
    "tanh": (lambda: mlp([3, 4, 2], activation=nn.Tanh), "module '1' (Tanh)", ("0", "2"), 1),
    "batchnorm1d": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)),
        "module '1' (BatchNorm1d) normalizes",
        ("0", "3"),
        1,
    ),
    "batchnorm2d": (_conv_bn, "module '1' (BatchNorm2d) normalizes", ("0", "4"), 1),
    "residual": (Residual, "function 'add' (graph node 'add') combines", ("fc1", "fc2", "fc3"), 2),
    "sigmoid_between": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)),
        "module '3' (Sigmoid)",
        ("0", "2", "4"),
        1,
    ),
    "weight_sharing": (
        Shared,
        "module 'shared' (Linear) is called more than once",
        ("inp", "shared", "out"),
        1,
    ),
    "functional_gelu": (FunctionalGelu, "function 'gelu'", ("fc1", "fc2"), 1),
    "prelu": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)),
        "module '1' (PReLU) has parameters",
        ("0", "2"),
        1,
    ),
    "returns_hidden": (
        ReturnsHidden,
        "the model returns the output of function 'relu' (graph node 'relu')",
        ("fc1", "fc2"),
        2,
    ),
    "functional_linear": (
        FunctionalLinear,
        "function 'linear' (graph node 'linear') uses the parameter(s) 'mix' directly",
        ("fc1", "fc2"),
        1,
    ),
    "branches": (
        Branches,
        "module 'b' (Linear) does not take the output of the previous layer",
        ("a", "b", "out"),
        2,
    ),
}


@pytest.mark.parametrize("case_name", list(BROKEN))
def test_problems_name_the_offending_module(case_name):
    build, fragment, layer_names, n_problems = BROKEN[case_name]
    model = build()
    structure = analyze(model)
    assert not structure.rescalable
    assert tuple(layer.name for layer in structure.layers) == layer_names
    assert len(structure.problems) == n_problems, structure.problems
    assert sum(fragment in p for p in structure.problems) == 1, structure.problems
    with pytest.raises(UnsupportedModelError) as info:
        structure.require_rescalable("the G-space parametrization")
    message = str(info.value)
    assert message.startswith("Cannot build the G-space parametrization, which is defined for chains")
    assert fragment in message
    assert "The node, layer, minnorm and euclidean measures remain available" in message
    # Not a chain, but the exact group still exists and random elements of it preserve the function.
    model = model.double().eval()
    shape = next(n for n in structure.traced.graph.nodes if n.op == "placeholder").meta["shape"]
    x = torch.randn(6, *shape[1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for kind in ("node", "layer"):
        twin = random_rescale(model, kind, generator=torch.Generator().manual_seed(1))
        for a, b in zip(_outputs(twin(x)), _outputs(model(x)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def test_non_chain_details():
    residual = analyze(Residual()).problems
    assert "the output of function 'relu' (graph node 'relu') feeds 2 operations (fc2, add)" in residual[1]
    branches = analyze(Branches()).problems
    assert "function 'cat' (graph node 'cat') combines" in branches[1]


# --------------------------------------------------------------------------- fallbacks without fx


class Gate(nn.Module):
    """ReLU written with data-dependent control flow, which torch.fx cannot trace."""

    def forward(self, x):
        if x.sum() > 0:
            return F.relu(x)
        return F.relu(x)


class DynamicNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.late, self.early, self.gate = nn.Linear(4, 2), nn.Linear(3, 4), Gate()

    def forward(self, x):
        return self.late(self.gate(F.relu(self.early(x))))


def test_untraceable_model_needs_example_input():
    with pytest.raises(UnsupportedModelError, match="pass example_input"):
        analyze(DynamicNet())


def test_hook_fallback_records_forward_order():
    model = DynamicNet()
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    structure = analyze(model, example_input=X)
    assert [layer.name for layer in structure.layers] == ["early", "late"]
    assert structure.problems == (
        "module 'gate' (Gate) is not a known positively homogeneous operation "
        "(f(c x) = c f(x) for c > 0), so scaling the units feeding it changes the "
        "function",
    )


def test_hook_fallback_runs_the_example_where_the_model_is():
    # A float32 model and a float64 batch stand for a GPU model and a CPU batch (the objective's first chunk).
    model = DynamicNet().float().eval()
    X = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert [layer.name for layer in analyze(model, example_input=X).layers] == ["early", "late"]
    obj = Objective(model, nn.CrossEntropyLoss(), (X, torch.tensor([0, 1, 1, 0, 1])), dtype=torch.float64)
    v = torch.ones(obj.layout.size, dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v, "double_backward"), obj.hvp(v, "jvp"), rtol=1e-10, atol=1e-12)


def test_sequential_fallback_flattens_nested_sequentials():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), Gate(), nn.Linear(4, 2))
    structure = analyze(model)
    assert [layer.name for layer in structure.layers] == ["0.0", "2"]
    assert structure.operations == (("ReLU", "Gate"),)
    assert len(structure.problems) == 1 and "module '1' (Gate)" in structure.problems[0]


class DynamicBatchNormNet(DynamicNet):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.late(self.gate(self.norm(self.early(x))))


def test_hook_fallback_leaves_batchnorm_statistics_alone():
    model = DynamicBatchNormNet().train()
    structure = analyze(model, example_input=torch.randn(6, 3, generator=torch.Generator().manual_seed(0)))
    assert [layer.name for layer in structure.layers] == ["early", "late"]
    assert structure.operations == (("BatchNorm1d", "Gate"),)
    assert torch.equal(model.norm.running_mean, torch.zeros(4))
    assert model.norm.num_batches_tracked.item() == 0


# ------------------------------------------------------------------------------- node symmetry J


def _symmetry(case_name):
    model = make_case(case_name).model
    structure = analyze(model)
    # An extra parameter outside the layers, placed first so that layer offsets are non-trivial.
    tensors = {"extra": torch.randn(3, generator=torch.Generator().manual_seed(9)), **params_of(model)}
    layout = ParamLayout.from_tensors(tensors)
    return structure, layout, tensors, NodeSymmetry(structure.group, layout)


def _dense_j(sym: NodeSymmetry) -> torch.Tensor:
    return sym.apply(torch.eye(sym.dim)).T  # (n, H)


@pytest.mark.parametrize("case_name", ["mlp_bias", "mlp_nobias", "cnn"])
def test_node_symmetry_adjoint_and_gram(case_name):
    structure, layout, _, sym = _symmetry(case_name)
    g = torch.Generator().manual_seed(1)
    c = torch.randn(3, sym.dim, generator=g)
    v = torch.randn(3, layout.size, generator=g)
    assert sym.apply(c).shape == (3, layout.size) and sym.apply(c[0]).shape == (layout.size,)
    assert sym.apply_transpose(v).shape == (3, sym.dim)
    lhs = (sym.apply(c) * v).sum(-1)
    rhs = (c * sym.apply_transpose(v)).sum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=0)
    torch.testing.assert_close(sym.apply_transpose(v[1]), sym.apply_transpose(v)[1], rtol=0, atol=0)

    J = _dense_j(sym)
    assert sym.dim == structure.n_hidden
    assert set(J.unique().tolist()) == {-1.0, 0.0, 1.0}
    assert torch.equal(J[:3], torch.zeros(3, sym.dim))  # "extra"
    assert torch.linalg.matrix_rank(J).item() == sym.dim
    assert torch.equal(sym.gram(), J.T @ J)
    assert sym.gram().dtype == torch.float64
    torch.testing.assert_close(sym.apply_transpose(v), v @ J, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case_name", ["mlp_bias", "mlp_nobias", "cnn"])
def test_node_symmetry_is_derivative_of_log_weights(case_name):
    structure, layout, tensors, sym = _symmetry(case_name)
    c = torch.randn(sym.dim, generator=torch.Generator().manual_seed(2))
    t = 0.7
    offsets = [0, *torch.tensor(structure.hidden_units).cumsum(0).tolist()]
    factors = [torch.exp(t * c[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    rescaled = rescale_parameters(tensors, structure, factors)
    # On a chain the group's free scales are the hidden units in forward order, so both agree.
    acted = structure.group.act(tensors, t * c)
    for name, value in rescaled.items():
        torch.testing.assert_close(acted[name], value, rtol=1e-14, atol=0)
    log_diff = (layout.flatten(rescaled).abs().log() - layout.flatten(tensors).abs().log()) / t
    torch.testing.assert_close(sym.apply(c), log_diff, rtol=0, atol=1e-10)
    assert sym.apply(c).abs().max() > 0.5


@pytest.mark.parametrize("case_name", ["mlp_bias", "mlp_nobias", "cnn"])
def test_node_symmetry_projection(case_name):
    _, layout, _, sym = _symmetry(case_name)
    v = torch.randn(4, layout.size, generator=torch.Generator().manual_seed(3))
    p = sym.project_out(v)
    scale = v.norm()
    assert sym.apply_transpose(p).abs().max() < 1e-12 * scale  # orthogonal to range(J)
    torch.testing.assert_close(sym.project_out(p), p, rtol=0, atol=1e-12 * scale)
    J = _dense_j(sym)
    reference = v - (J @ torch.linalg.lstsq(J, v.T).solution).T
    torch.testing.assert_close(p, reference, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(sym.project_out(v[2]), p[2], rtol=0, atol=1e-14 * scale)
    assert (v - p).norm() > 0.1 * scale
    assert sym.project_out(v.float()).dtype == torch.float32
