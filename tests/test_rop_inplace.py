"""In-place updates, tied first-layer weights and 0-dimensional parameters in the products (review of the R-operator
of hand-written attention). The products read every call out of place, and fx records ``x += y`` as ``x + y``, so:

- an in-place call whose input is read again after it (``att.masked_fill_(mask, -inf)`` then ``att.softmax(-1)``,
  ``h.mul_(2.0)`` as a statement) makes the R-operator refuse the model (products by autograd, exact);
- a graph that computes something else than the forward (an alias of ``x`` read after ``x += y``) is no graph of the
  model at all: `manifolds.trace_network` refuses it (no symmetry group, products by autograd);
- an in-place call on a tensor nothing else reads (``out += identity`` in torchvision's ResNet) stays on the
  R-operator;
- the data-span coordinates of the first layer are not used when its weight is read elsewhere too;
- a 0-dimensional parameter (a learned temperature) is flattened and unflattened like any other.

Every product is checked in float64 against ``jvp`` of ``grad`` to 1e-12 relative.
"""

import torch
import torch.nn.functional as F
from test_rop_graph import _data, _perturbed
from test_rop_transformer import CE, _exact
from torch import nn
from torch.func import functional_call, grad, jvp

from manifolds import analyze, trace_network
from sharpness import Objective, dense_hessian, euclidean_sharpness


def _reference(obj: Objective, model: nn.Module, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = {k: t.detach() for k, t in obj.params.items()}
    gradient = grad(lambda p: CE(functional_call(model, p, (x,)), y))
    return v, obj.layout.flatten(jvp(gradient, (params,), (obj.layout.unflatten(v),))[1])


def _autograd_exact(model: nn.Module, x, y) -> Objective:
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() != "rop"
    v, ref = _reference(obj, model, x, y)
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    torch.testing.assert_close(obj.value(), CE(model(x), y), rtol=1e-14, atol=0)
    return obj


class InPlace(nn.Module):
    """Scores by hand with an in-place statement between them and the softmax (nanoGPT writes the mask so)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.q, self.k, self.v, self.head = nn.Linear(2, 4), nn.Linear(2, 4), nn.Linear(2, 4), nn.Linear(4, 3)
        self.register_buffer("mask", torch.triu(torch.ones(3, 3, dtype=torch.bool), 1))

    def forward(self, x):
        h = x.unflatten(1, (3, 2))
        q, k = self.q(h), self.k(h)
        if self.form == "add_":
            q.add_(k)
        att = q @ k.transpose(-1, -2)
        if self.form == "masked_fill_":
            att.masked_fill_(self.mask, float("-inf"))
        elif self.form == "div_":
            att.div_(2.0)
        return self.head((att.softmax(-1) @ self.v(h)).mean(1))


class Mlp(nn.Module):
    def __init__(self, statement: bool):
        super().__init__()
        self.statement = statement
        self.fc, self.out = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.statement:
            h.mul_(2.0)  # h is read again below: the update must be seen
            return self.out(torch.relu(h))
        h += x[:, :5]  # torchvision's `out += identity`: nothing else reads h
        return self.out(torch.relu(h))


class Alias(nn.Module):
    """``r = q; q += t`` then ``r`` read: fx's graph reads the old ``q`` there, the forward the new one."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.head = nn.Linear(2, 4), nn.Linear(2, 4), nn.Linear(2, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = x.unflatten(1, (3, 2))
        q = self.q(h)
        r = q
        q += torch.tanh(self.k(h))
        return self.head((F.softmax(r @ q.transpose(-1, -2), -1) @ self.v(h)).mean(1))


def test_in_place_updates_read_again_leave_the_r_operator_exactly():
    x, y = _data((6,), n=5)
    for form in ("masked_fill_", "div_", "add_"):
        _autograd_exact(_perturbed(InPlace(form)), x, y)
    _autograd_exact(_perturbed(Mlp(statement=True)), x, y)
    _exact(_perturbed(Mlp(statement=False)), x, y)  # an update nothing else reads: still the R-operator


def test_a_graph_computing_something_else_than_the_forward_is_refused():
    x, y = _data((6,), n=5)
    model = _perturbed(Alias())
    structure = analyze(model, example_input=x)
    assert structure.group is None and "computes something else than the forward" in structure.group_failure
    _autograd_exact(model, x, y)


class Tied(nn.Module):
    """The first Linear's weight also read by a product with an activation (weight tying)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(12, 4), nn.Linear(12, 3)

    def forward(self, x):
        t = torch.tanh(self.inp(x)).unflatten(1, (2, 2))
        a = torch.softmax(t @ t.transpose(1, 2), -1) @ t
        return self.head(a.flatten(1) @ self.inp.weight)


def test_a_first_layer_weight_read_elsewhere_is_not_solved_in_the_data_span():
    """Fewer samples than inputs would put the first layer's weight in the data's span; read elsewhere too, it must
    stay whole (the solve crashed, or with one sample broadcast silently)."""
    for n in (5, 1):
        x, y = _data((12,), n=n)
        model = _perturbed(Tied())
        top = float(torch.linalg.eigvalsh(dense_hessian(Objective(model, CE, (x, y))))[-1])
        value = euclidean_sharpness(model, CE, (x, y), progress=False).value
        assert abs(value - top) <= 1e-8 * abs(top), (n, value, top)


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.head = nn.Linear(2, 4), nn.Linear(4, 3)
        self.t = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = self.q(x.unflatten(1, (3, 2)))
        return self.head((torch.softmax(h @ h.transpose(1, 2) * self.t, -1) @ h).mean(1))


def test_a_zero_dimensional_parameter_is_flattened_like_any_other():
    """A temperature multiplying the scores: a product with a 0-dim parameter, its error summed to a scalar."""
    x, y = _data((6,), n=5)
    model = _perturbed(Temperature())
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop" and obj.layout.shapes[obj.layout.names.index("t")] == ()
    v, ref = _reference(obj, model, x, y)
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)  # fx's tracing runs this on the real buffer, and so do the shape pass and the check
        return self.fc(x)


def test_tracing_leaves_buffers_a_forward_updates_as_they_were():
    model = Counter()
    buffer = model.calls
    traced = trace_network(model, _data((6,), n=5)[0])
    assert traced.graph is not None and model.calls is buffer and float(buffer) == 0.0
