"""The rescaling symmetry of layers written as functions of parameters read directly (manifolds._group_discovery).

``F.linear(x, W, b)``, ``x @ W``, ``torch.matmul(x, W)`` and ``x @ W + b`` are the same affine maps as ``nn.Linear``,
so a ReLU network written with them has the same node and layer groups as its ``nn.Linear`` twin. Checked: the
groups' dimensions against the twin's, group elements preserving the outputs to 1e-10 (float64), the node measure
against the dense float64 reference (1e-8) and its invariance under a rescaling built by hand; and every form the
rule does not cover (a transposed weight, a weight read elsewhere, a bias broadcast over several axes) pinned.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from manifolds import analyze, random_rescale
from sharpness import Objective, Solver, dense_riemannian_hessian, measure_sharpness

D, H, K = 5, 4, 3


class Functional(nn.Module):
    """A two-layer ReLU network whose affine maps are written by ``form``; ``W1`` and ``W2`` have ``nn.Linear``'s
    layout ``(out, in)`` unless the form multiplies on the right (``x @ W``: ``(in, out)``)."""

    def __init__(self, form: str):
        super().__init__()
        right = form in ("matmul", "torch.matmul", "tokens", "sub", "tied", "pooled_channels", "inplace")
        self.form = form
        self.W1 = nn.Parameter(torch.randn((D, H) if right else (H, D), dtype=torch.float64))
        self.b1 = nn.Parameter(torch.randn(H, dtype=torch.float64))
        self.W2 = nn.Parameter(torch.randn((H, K) if right else (K, H), dtype=torch.float64))
        self.b2 = nn.Parameter(torch.randn(K, dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(H, dtype=torch.float64))  # read by "vector_weight" only

    def forward(self, x):
        W1, b1, W2, b2 = self.W1, self.b1, self.W2, self.b2
        match self.form:
            case "linear":
                return F.linear(F.relu(F.linear(x, W1, b1)), W2, b2)
            case "keywords":
                return F.linear(F.relu(F.linear(x, weight=W1, bias=b1)), weight=W2, bias=b2)
            case "matmul":
                return F.relu(x @ W1 + b1) @ W2 + b2
            case "torch.matmul":
                return torch.matmul(F.relu(b1 + torch.matmul(x, W1)), W2) + b2
            case "sub":
                return F.relu(x @ W1 - b1) @ W2 - b2
            case "inplace":  # the bias added in place: the graph's later reads see the matmul's node
                h = x @ W1
                h.add_(b1)
                return F.relu(h) @ W2 + b2
            case "tokens":  # (batch, tokens, features): token-wise, as a Linear on the last axis
                return (F.relu(x @ W1 + b1) @ W2 + b2).sum(1)
            case "tied":  # W1 read by two calls: its records are tied, one scale per hidden unit still
                return (F.relu(x @ W1 + b1) + F.relu(-x @ W1 + b1)) @ W2 + b2
            # not covered: each pins the hidden units
            case "transposed":
                return F.relu(x @ W1.T + b1) @ W2.T + b2
            case "read_elsewhere":
                return F.linear(F.relu(F.linear(x, W1, b1)), W2, b2) + W1.sum()
            case "user_function":  # `relu` here is the tanh above: not positively homogeneous
                return F.linear(relu(F.linear(x, W1, b1)), W2, b2)
            case "pooled_channels":  # (batch, tokens, hidden): max_pool1d pools over the hidden units themselves
                return (F.max_pool1d(F.relu(x @ W1 + b1), 3, 1, 1) @ W2 + b2).sum(1)
            case "unbatched_pool":  # a 2-D input to max_pool1d is one unbatched (channels, length) signal
                return F.linear(F.max_pool1d(F.relu(F.linear(x, W1, b1)), 3, 1, 1), W2, b2)
            case "vector_weight":  # F.linear with a 1-D weight: a dot product, no rule
                return F.linear(F.relu(F.linear(x, W1, b1)), self.v).unsqueeze(1)
            case "wide_bias":  # b1 of shape (H,) added to a (batch, H, 1) tensor: broadcast over another axis
                return F.linear(F.relu(F.linear(x, W1)[:, :, None] + b1[:, None]).squeeze(2), W2, b2)
        raise ValueError(self.form)


def relu(x):
    """A user's own function that only shares a name with torch's (wrapped below, so tracing keeps it whole)."""
    return torch.tanh(x)


torch.fx.wrap("relu")


class Modules(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H).double(), nn.Linear(H, K).double()

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Convolutions(nn.Module):
    """Conv -> ReLU -> grouped Conv -> ReLU -> spatial mean -> linear, written with ``F.conv2d`` / ``F.linear`` on
    parameters (``functional``) or with modules."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        convs = nn.Conv2d(2, 4, 3, padding=1).double(), nn.Conv2d(4, 6, 3, stride=2, groups=2).double()
        fc = nn.Linear(6, K).double()
        if functional:
            self.W1, self.b1 = convs[0].weight, convs[0].bias
            self.W2, self.b2 = convs[1].weight, convs[1].bias
            self.W3, self.b3 = fc.weight, fc.bias
        else:
            self.c1, self.c2, self.fc = *convs, fc

    def forward(self, x):
        if self.functional:
            h = F.relu(F.conv2d(x, self.W1, self.b1, padding=1))
            h = F.relu(F.conv2d(h, self.W2, self.b2, 2, 0, 1, 2))
            return F.linear(h.mean((2, 3)), self.W3, self.b3)
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).mean((2, 3)))


class OwnLinear(nn.Module):
    """A user's own Linear: torch.fx traces into it, so the graph reads its parameters directly."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(n_out, dtype=torch.float64))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def test_functional_convolutions_and_own_linear_modules_have_the_groups_of_their_module_twins():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 7, 7, dtype=torch.float64)
    model, twin = Convolutions(True).eval(), Convolutions(False).eval()
    found, expected = analyze(model, x), analyze(twin, x)
    assert (found.group.dim, found.layer_group.dim) == (expected.group.dim, expected.layer_group.dim) == (4 + 6, 2)
    own = nn.Sequential(OwnLinear(D, H), nn.ReLU(), OwnLinear(H, H), nn.ReLU(), OwnLinear(H, K))
    found = analyze(own, torch.randn(6, D, dtype=torch.float64))
    assert (found.group.dim, found.layer_group.dim) == (2 * H, 2), found.describe()
    for net, z in ((model, x), (own, torch.randn(6, D, dtype=torch.float64))):
        moved = random_rescale(net, "node", 1.0, torch.Generator().manual_seed(1), example_input=z)
        with torch.no_grad():
            torch.testing.assert_close(moved(z), net(z), rtol=0, atol=1e-10)
            assert max(float((p - q).abs().max()) for p, q in zip(moved.parameters(), net.parameters())) > 0.1


COVERED = ["linear", "keywords", "matmul", "torch.matmul", "sub", "inplace", "tokens", "tied"]
PINNED = ["transposed", "read_elsewhere", "wide_bias", "user_function", "pooled_channels", "unbatched_pool",
          "vector_weight"]


def build(form: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Functional(form).eval()
    shape = (6, 2, D) if form in ("tokens", "pooled_channels") else (6, D)
    return model, torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", COVERED)
def test_functional_layers_have_the_groups_of_their_linear_twin(form):
    model, x = build(form)
    structure = analyze(model, x)
    twin = analyze(Modules(), x)
    assert (structure.group.dim, structure.layer_group.dim) == (twin.group.dim, twin.layer_group.dim) == (H, 1)
    assert not structure.group.unknown, structure.describe()
    for kind in ("node", "layer", "group"):
        moved = random_rescale(model, kind, 1.0, torch.Generator().manual_seed(1), example_input=x)
        with torch.no_grad():
            torch.testing.assert_close(moved(x), model(x), rtol=0, atol=1e-10)
            assert float((moved.W1 - model.W1).abs().max()) > 0.1
            assert float((moved.b1 - model.b1).abs().max()) > 0.1
            torch.testing.assert_close(moved.b2, model.b2, rtol=0, atol=0)  # the output's scale is pinned


@pytest.mark.parametrize("form", PINNED)
def test_forms_the_rule_does_not_cover_pin_the_hidden_units(form):
    model, x = build(form)
    structure = analyze(model, x)
    assert structure.group.dim == 0, structure.describe()
    assert structure.group.pins


def test_a_weight_also_read_directly_gets_no_unit_factor_of_its_module():
    """The whole symmetry's unit scalings of a Linear move its rows alone: not where the forward also reads the
    weight directly (here through F.linear), which would change with them."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(D, H).double(), nn.Linear(H, K).double()

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x))) + F.linear(x, self.fc1.weight)[:, :K]

    torch.manual_seed(0)
    model, x = Both().eval(), torch.randn(6, D, dtype=torch.float64)
    symmetry = analyze(model, x).symmetry
    assert symmetry.dim == 0, symmetry.describe()
    assert "'fc1.weight' is also read outside its module" in symmetry.describe()


def test_node_measure_on_a_functional_network_equals_the_dense_reference_and_is_invariant():
    model, x = build("matmul")
    y = torch.randn(6, K, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    loss, tight = nn.MSELoss(), Solver(tol=1e-12)
    obj = Objective(model, loss, (x, y))
    node = measure_sharpness(model, loss, (x, y), "node", solver=tight, objective=obj, progress=False)
    euclid = measure_sharpness(model, loss, (x, y), "euclidean", solver=tight, objective=obj, progress=False)
    dense = float(torch.linalg.eigvalsh(dense_riemannian_hessian(obj, "node", obj.structure.group))[-1])
    assert node.value == pytest.approx(dense, rel=1e-8)
    # a rescaling of the hidden units built by hand: W1[:, j] c_j, b1[j] c_j, W2[j, :] / c_j
    c = torch.tensor([4.0, 0.25, 3.0, 0.5], dtype=torch.float64)
    params = dict(obj.params)
    params.update(W1=params["W1"] * c, b1=params["b1"] * c, W2=params["W2"] / c[:, None])
    twin = obj.with_params(params)
    torch.testing.assert_close(twin.value(), obj.value(), rtol=1e-12, atol=0)
    moved = {m: measure_sharpness(model, loss, (x, y), m, solver=tight, objective=twin, progress=False).value
             for m in ("node", "euclidean")}  # fmt: skip
    assert moved["node"] == pytest.approx(node.value, rel=1e-8)
    assert abs(moved["euclidean"] / euclid.value - 1) > 1e-1
