"""The rescaling symmetry of an elementwise product of two parameters (manifolds._group_discovery, product rule).

``p * q`` is unchanged by ``p -> p c``, ``q -> q / c`` (``c > 0`` entry-wise) exactly when the product is the only
way ``p`` and ``q`` reach the output. Checked: the group found for the forms people write, its elements preserving
the outputs to 1e-10 (float64), the node measure against the dense float64 reference (1e-8) and its invariance, and
every case where the symmetry does not exist refused with its reason.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from manifolds import analyze, random_rescale
from sharpness import Objective, Solver, dense_riemannian_hessian, measure_sharpness

D = 4


class Product(nn.Module):
    """``forward`` picks one way of writing a network that reads ``u`` and ``v`` (and ``w``) through products."""

    def __init__(self, form: str, shapes=((D,), (D,))):
        super().__init__()
        self.form = form
        self.u = nn.Parameter(torch.randn(shapes[0], dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(shapes[1], dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(3, D, dtype=torch.float64))
        self.first, self.lin = nn.Linear(D, 3).double(), nn.Linear(3, 1).double()
        self.register_buffer("b", torch.randn(D, dtype=torch.float64))

    def forward(self, x):
        u, v, w = self.u, self.v, self.w
        match self.form:
            case "matmul":  # the diagonal network f(x) = x^T (u * v)
                return x @ (u * v)[:, None]
            case "torch.mul":
                return (x @ torch.mul(u, v)).unsqueeze(1)
            case "method":
                return x @ u.mul(v)[:, None]
            case "left":  # the product on the left of a matmul
                return ((u * v)[None, :] @ x.T).T
            case "linear":  # a Linear's weight written as a product (u, v of shape (3, D))
                return F.linear(x, u * v)
            case "broadcast":  # u (3, 1), v (3, D): one scale per row
                return F.linear(x, u * v)
            case "scalar":  # u (1,), v (D,): one scale
                return x @ (u * v)[:, None]
            case "with_layer":  # a ReLU layer's hidden units and the product's entries, side by side
                return self.lin(F.relu(self.first(x))) + x @ (u * v)[:, None]
            # the symmetry does not exist: each must give no product scale
            case "used_twice":
                return x @ (u * v)[:, None] + u.sum()
            case "added":
                return x @ (u * v + u)[:, None]
            case "squared":
                return x @ (u * u)[:, None] + v.sum()
            case "three":
                return x @ (u * v * u)[:, None]
            case "buffer":
                return x @ (u * self.b)[:, None] + v.sum()
            case "input":
                return (x * u) @ v[:, None]
            case "module":  # the Linear's weight also in a product
                return self.lin(F.relu(self.first(x))) + x @ (self.first.weight * w).sum(0)[:, None]
            case "returned":
                return x @ (u * v)[:, None], u
            case "zero_dim":  # u (), v (D,): refused, with the fix in the reason
                return x @ (u * v)[:, None]
        raise ValueError(self.form)


FOUND = {  # form: (shapes of u and v, dimension of the node group, of the layer group)
    "matmul": (((D,), (D,)), D, 1),
    "torch.mul": (((D,), (D,)), D, 1),
    "method": (((D,), (D,)), D, 1),
    "left": (((D,), (D,)), D, 1),
    "linear": (((3, D), (3, D)), 3 * D, 1),
    "broadcast": (((3, 1), (3, D)), 3, 1),
    "scalar": (((1,), (D,)), 1, 1),
    "with_layer": (((D,), (D,)), D + 3, 2),
}
REFUSED = ["used_twice", "added", "squared", "three", "buffer", "input", "module", "returned", "zero_dim"]
SHAPES = {"zero_dim": ((), (D,))}


def build(form: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Product(form, FOUND[form][0] if form in FOUND else SHAPES.get(form, ((D,), (D,)))).eval()
    x = torch.randn(6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return model, x


@pytest.mark.parametrize("form", list(FOUND))
def test_product_scales_are_found_and_preserve_the_outputs(form):
    model, x = build(form)
    _, node_dim, layer_dim = FOUND[form]
    structure = analyze(model, x)
    assert (structure.group.dim, structure.layer_group.dim) == (node_dim, layer_dim), structure.group.describe()
    assert "traded entry by entry, 'u' <- 'u' e^s, 'v' <- 'v' e^-s" in structure.describe()
    for kind in ("node", "layer", "group"):
        twin = random_rescale(model, kind, 1.0, torch.Generator().manual_seed(1), example_input=x)
        with torch.no_grad():
            torch.testing.assert_close(twin(x), model(x), rtol=0, atol=1e-10)
            assert float((twin.u - model.u).abs().max()) > 0.1
            torch.testing.assert_close(twin.u * twin.v, model.u * model.v, rtol=1e-13, atol=0)


@pytest.mark.parametrize("form", ["matmul", "left", "with_layer"])
def test_a_weight_product_is_not_examined_as_attention(form):
    """A product of the input with weights is no attention candidate (attention multiplies two activations), so
    the description carries no attention-finder entry for it; the rotary model of the attention tests keeps its."""
    model, x = build(form)
    text = analyze(model, x).describe()
    assert "no attention factor" not in text and "0 GL factor(s)" in text, text


@pytest.mark.parametrize("form", REFUSED)
def test_no_product_scale_where_the_symmetry_does_not_exist(form):
    model, x = build(form)
    group = analyze(model, x).group
    moved = {a.name for a in group.parameter_actions if any(
        i is not None and bool((i < group.dim).any()) for i in (a.plus, a.minus))}  # fmt: skip
    assert not moved & {"u", "v", "w", "first.weight"}, group.describe()
    assert not group.products
    if form != "input":  # there a parameter meets data: no product of two tensors, no pin of one
        reason = {"buffer": "'b' is not a parameter", "squared": "'u' times itself",
                  "zero_dim": "'u' has no axis (0-dim); give it shape (1,)",
                  "module": "'first.weight' is also used"}.get(form, "'u' is also used")  # fmt: skip
        assert any(reason in p.reason for p in group.pins), group.describe()


def test_node_measure_equals_the_dense_reference_and_is_invariant():
    model, x = build("with_layer")
    y = torch.randn(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    loss, tight = nn.MSELoss(), Solver(tol=1e-12)
    obj = Objective(model, loss, (x, y))
    group = obj.structure.group
    node = measure_sharpness(model, loss, (x, y), "node", solver=tight, objective=obj, progress=False)
    euclid = measure_sharpness(model, loss, (x, y), "euclidean", solver=tight, objective=obj, progress=False)
    dense = float(torch.linalg.eigvalsh(dense_riemannian_hessian(obj, "node", group))[-1])
    assert node.value == pytest.approx(dense, rel=1e-8)
    twin = obj.with_params(group.act(obj.params, group.random_log_scales(1.0, torch.Generator().manual_seed(2))))
    moved = {m: measure_sharpness(model, loss, (x, y), m, solver=tight, objective=twin, progress=False).value
             for m in ("node", "euclidean")}  # fmt: skip
    assert moved["node"] == pytest.approx(node.value, rel=1e-8)
    assert abs(moved["euclidean"] / euclid.value - 1) > 1e-2
