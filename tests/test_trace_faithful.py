"""A traced graph stands for the model only where it computes the model's forward (manifolds._graph).

Every case here passes the plain comparison at the model's own parameters, so each would have claimed a symmetry
the model does not have (the outputs of a "group element" moved by 0.3 to 2.2 in the review that found them): the
graph is refused with the reason instead, and everything built on it refuses or falls back to autograd.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import manifolds
from sharpness import Objective, dense_hessian

D = 4


class AliasScaled(nn.Module):
    """``h *= w`` on a view of ``y`` that another layer reads: the forward scales ``y`` too; fx records ``h * w``."""

    def __init__(self, spelling: str, norm: bool = False):
        super().__init__()
        self.spelling, self.norm = spelling, nn.LayerNorm(D) if norm else None
        self.w = nn.Parameter(torch.ones(D))
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        y = self.norm(x) if self.norm is not None else torch.tanh(x)
        h = {"view": lambda: y.view(y.shape), "contiguous": y.contiguous, "index": lambda: y[...]}[self.spelling]()
        h *= self.w
        return self.a(h).sum(-1, keepdim=True) + self.b(y)


@pytest.mark.parametrize("spelling,norm", [("view", False), ("contiguous", False), ("index", True)])
def test_an_in_place_update_through_an_alias_is_refused_even_where_it_changes_nothing_yet(spelling, norm):
    model = AliasScaled(spelling, norm).double().eval()
    x = torch.randn(3, D, dtype=torch.float64)
    traced = manifolds.trace_network(model, x)
    assert traced.graph is None and "computes something else than the forward itself" in traced.failure
    with pytest.raises(manifolds.UnsupportedModelError, match="in-place update"):
        manifolds.transformer_symmetry(model, x)
    # the products fall back to autograd's, which run the forward itself
    y = torch.randn(3, D, dtype=torch.float64)
    obj = Objective(model, nn.MSELoss(), (x, y))
    v = torch.randn(obj.layout.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert obj.hvp_strategy() != "rop"
    torch.testing.assert_close(obj.hvp(v), dense_hessian(obj) @ v, rtol=1e-10, atol=1e-12)


def test_the_same_update_on_a_tensor_nothing_else_reads_is_kept():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.a = nn.Parameter(torch.ones(D)), nn.Linear(D, D)

        def forward(self, x):
            h = torch.tanh(x)
            h *= self.w
            return self.a(h)

    x = torch.randn(3, D, dtype=torch.float64)
    traced = manifolds.trace_network(Scaled().double(), x)
    assert traced.failure is None and traced.has_shapes


def test_a_forward_replaced_on_a_layer_is_refused_with_the_module_named():
    class Patched(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.l = nn.LayerNorm(D), nn.Linear(D, D)
            self.l.forward = types.MethodType(lambda m, x: F.linear(torch.tanh(x), m.weight, m.bias), self.l)

        def forward(self, x):
            return self.l(self.ln(x))

    traced = manifolds.trace_network(Patched(), torch.randn(3, D))
    assert traced.graph is None and "module 'l' has its forward replaced on the instance" in traced.failure


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_hooks_on_the_model_itself_are_refused_and_traced_once_wrapped():
    model = Chain()
    # max-norm rows at 3 (idle at the initialization, active once a rescaling grows a row): no rescaling symmetry
    model.register_forward_pre_hook(lambda m, args: [w.data.copy_(torch.renorm(w.data, 2, 0, 3.0))
                                                     for w in (m.a.weight, m.b.weight)] and None)  # fmt: skip
    x = torch.randn(3, D)
    traced = manifolds.trace_network(model, x)
    assert traced.graph is None and "forward hooks on the model itself" in traced.failure

    class Wrapper(nn.Module):  # fx runs a submodule's hooks: wrapped, the hook is traced with the rest
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    doubled = Chain()
    doubled.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    graph = manifolds.trace_network(Wrapper(doubled), x).graph
    assert graph is not None and any(n.target is __import__("operator").mul for n in graph.nodes)


def test_list_and_dict_outputs_trace():
    class Outputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, 2)

        def forward(self, x):
            return [self.a(x), {"b": self.b(x)}]

    traced = manifolds.trace_network(Outputs(), torch.randn(3, D))
    assert traced.failure is None and traced.has_shapes


def test_a_fixed_batch_size_is_named_as_the_reason():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)

        def forward(self, x):
            return self.a(x).view(3, 2, 2)

    traced = manifolds.trace_network(Fixed(), torch.randn(3, D))
    assert "fails on the first two samples of the example input but not on all 3" in traced.failure
    assert "any number of samples" in traced.failure


class Spare(AliasScaled):
    """`AliasScaled` with a LayerNorm the forward never calls (its constant parameters are moved too)."""

    def __init__(self):
        super().__init__("view")
        self.spare = nn.LayerNorm(D)


def test_a_module_the_forward_never_calls_does_not_turn_the_check_off():
    model = Spare().double().eval()
    traced = manifolds.trace_network(model, torch.randn(3, D, dtype=torch.float64))
    assert traced.graph is None and "computes something else" in traced.failure


def test_a_scale_within_rounding_of_its_constant_is_moved_too():
    model = AliasScaled("view").double().eval()
    with torch.no_grad():
        model.w.add_(1e-7 * torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    traced = manifolds.trace_network(model, torch.randn(3, D, dtype=torch.float64))
    assert traced.graph is None and "computes something else" in traced.failure


def test_faithful_models_with_noise_ordered_outputs_or_their_own_forward_bound_again_trace():
    from collections import OrderedDict

    class Noisy(nn.Module):  # noise scaled by a weight that is zero at the initialization (StyleGAN's injection)
        def __init__(self):
            super().__init__()
            self.a, self.noise = nn.Linear(D, D), nn.Parameter(torch.zeros(D))

        def forward(self, x):
            h = self.a(x)
            return OrderedDict(out=h + self.noise * torch.randn_like(h), logits=torch.relu(h))

    noisy = Noisy()
    rebound = Chain()
    rebound.forward = rebound.forward  # the class's own forward, bound to the instance
    for model in (noisy, rebound):
        traced = manifolds.trace_network(model, torch.randn(3, D))
        assert traced.failure is None and traced.has_shapes, traced.failure


class Guarded(AliasScaled):
    """`AliasScaled` whose forward fails, or turns to NaN, once its parameters move far (a Cholesky factor, a square
    root): a smaller move still shows the alias."""

    def __init__(self, guard: str):
        super().__init__("view")
        self.guard = guard
        self.cov = nn.Parameter(torch.eye(D) + 0.01)
        self.temp = nn.Parameter(torch.ones(D))

    def forward(self, x):
        if self.guard == "cholesky":
            return super().forward(x @ torch.linalg.cholesky(self.cov))
        # NaN once temp moves 0.05 from 1 (the check's first move shifts it by about 0.15, its smaller one by 0.003)
        return super().forward(x * torch.sqrt(1 - 20 * (self.temp - 1).abs()))


@pytest.mark.parametrize("guard", ["cholesky", "sqrt"])
def test_a_forward_that_fails_off_its_values_is_checked_with_a_smaller_move(guard):
    model = Guarded(guard).double().eval()
    traced = manifolds.trace_network(model, torch.randn(3, D, dtype=torch.float64))
    assert traced.graph is None and "computes something else" in traced.failure, traced.failure


def test_integer_parameters_global_hooks_rng_and_hook_computed_weights():
    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)
            self.idx = nn.Parameter(torch.tensor([2, 0, 1, 3]), requires_grad=False)
            self.mask = nn.Parameter(torch.tensor([True, False, True, True]), requires_grad=False)

        def forward(self, x):
            return self.a(x)[:, self.idx] * self.mask

    assert manifolds.trace_network(Indexed(), torch.randn(3, D)).failure is None

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        traced = manifolds.trace_network(Chain(), torch.randn(3, D))
        assert traced.graph is None and "forward hooks are registered for every module" in traced.failure
    finally:
        handle.remove()

    with pytest.warns(FutureWarning):  # the old weight_norm: a forward pre-hook computes `weight` from g and v
        normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(D, D)), nn.ReLU(), nn.Linear(D, 2))
    weight, x = normed[0].weight, torch.randn(3, D)
    before, state = weight.clone(), torch.get_rng_state()
    assert manifolds.trace_network(normed, x).failure is None
    assert normed[0].weight is weight and torch.equal(weight, before)  # the hook's weight, not one of moved values
    assert torch.equal(torch.get_rng_state(), state)  # the random generator as it was


class Stopped(nn.Module):
    """A product with one factor held constant, by `torch.no_grad()` (which fx does not record) or `.detach()`."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                h = torch.tanh(self.a(x))
        else:
            h = torch.tanh(self.a(x)).detach()
        return self.b(h * torch.tanh(self.a(x)))


def test_a_gradient_stopped_by_no_grad_is_refused_and_by_detach_is_read():
    x, y = torch.randn(5, D, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    for how in ("no_grad", "detach"):
        model = Stopped(how).double().eval()
        traced = manifolds.trace_network(model, x)
        if how == "no_grad":  # before, the R-operator's products were another function's (1.2 off against 2.0)
            assert traced.graph is None and "other derivatives" in traced.failure and "no_grad" in traced.failure
        else:
            assert traced.failure is None
        obj = Objective(model, nn.MSELoss(), (x, y))
        v = torch.randn(obj.layout.size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(obj.hvp(v), dense_hessian(obj) @ v, rtol=1e-10, atol=1e-12)


def test_the_fast_comparison_of_outputs_says_what_allclose_says():
    """`manifolds._graph._close` (one pass for finite tensors) against its definition, ``torch.allclose`` with
    ``atol = 1e-5 max|b|``, on pairs within, at and beyond the tolerance, and with nan and inf on either side."""
    from manifolds._graph import _close

    g = torch.Generator().manual_seed(0)
    b = torch.randn(1000, generator=g, dtype=torch.float64)
    scale = float(b.abs().max())
    cases = []
    for step in (0.0, 1e-7, 0.5e-5, 2e-5, 1e-3):  # the entry 17 moved by step (x the tolerance's scale below)
        a = b.clone()
        a[17] += step * (1.0 + scale)
        cases.append((a, b))
    nan, inf = float("nan"), float("inf")
    for x, y in [(nan, nan), (nan, 1.0), (1.0, nan), (inf, inf), (inf, -inf), (inf, 1.0), (1.0, inf)]:
        a, c = b.clone(), b.clone()
        a[3], c[3] = x, y
        cases.append((a, c))
    cases += [(torch.zeros(0), torch.zeros(0)), (torch.zeros(3), torch.zeros(3)), (torch.ones(2), torch.zeros(2))]
    verdicts = []
    for a, c in cases:
        top = c.abs().max() if c.numel() else torch.tensor(nan)
        atol = 1e-5 * float(top) if bool(torch.isfinite(top)) else 1e-5
        want = torch.allclose(a, c, rtol=1e-5, atol=atol, equal_nan=True)
        assert _close(a, c) == want, (a[:20], c[:20])
        verdicts.append(want)
    assert verdicts[:5] == [True, True, True, False, False] and True in verdicts[5:] and False in verdicts[5:]
    with pytest.raises(RuntimeError):  # outputs of two dtypes: allclose raises, and so does the fast path
        _close(b.float(), b)


class Autocast(nn.Module):
    """A forward under bfloat16 autocast: its output is bfloat16, fx's graph (which drops the context) float32."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.a(x)


def test_a_graph_whose_outputs_have_another_dtype_is_unfaithful_not_a_failing_forward():
    with torch.no_grad():
        model = Autocast().float().eval()  # float32: autocast casts it to bfloat16 (the suite's default is float64)
        model.a.weight.copy_(torch.randint(-2, 3, model.a.weight.shape))
        model.a.bias.zero_()
    x = torch.randint(-2, 3, (5, D)).float()  # exact in bfloat16: only the dtype differs
    traced = manifolds.trace_network(model, x)
    assert traced.failure is not None and "computes something else than the forward itself" in traced.failure


def test_a_hooked_relu_between_token_wise_layers_pins_their_units():
    """A forward pre-hook on the ReLU of a token-wise MLP (``(N, T, features)``) shifts its input: ``relu(c h + 0.3)``
    is not ``c relu(h + 0.3)``, so the units are pinned. Before, only forward hooks were looked at there, the units
    were claimed, and a random element moved the outputs by 1.1."""

    class TokenMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.r, self.b = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(self.r(self.a(x)))

    torch.manual_seed(0)
    x = torch.randn(5, 6, 4)
    plain = TokenMLP().eval()
    assert manifolds.transformer_symmetry(plain, x).dim == 8  # the hidden units, found on the last axis
    plain.r.register_forward_pre_hook(lambda m, args: (args[0] + 0.3,))
    assert manifolds.transformer_symmetry(plain, x).dim == 0


def test_the_symmetry_report_names_the_operations_the_rescaling_rules_do_not_know():
    """A network whose diagonal group is empty because of an operation the rules do not know says so, and where to
    read which (before, its report showed dimension 0 and the output layer's pin alone)."""

    class Odd(nn.BatchNorm1d):  # a normalization whose forward is its own: nothing known of it
        def forward(self, x):
            return torch.relu(super().forward(x)) + 0.0 * x

    model = nn.Sequential(nn.Linear(4, 6), Odd(6), nn.Linear(6, 2)).eval()
    sym = manifolds.transformer_symmetry(model, torch.randn(5, 4))
    report = sym.describe()
    assert "pins the inputs and outputs of 1 operation(s) its rules do not know: see .diagonal.describe()" in report
    assert "module '1' (Odd)" in sym.diagonal.describe(), sym.diagonal.describe()
