"""The quotient by a transformer's whole symmetry group (manifolds.symmetry_metric, manifolds.SymmetryQuotient, the
"symmetry" measure) on tiny float64 transformers.

Checked against references that share none of the library's code path: the metric's invariance on random and
hand-built group elements, and the top eigenvalue against a dense generalized eigenproblem built from
``torch.func.hessian`` of the loss, the dense metric matrix, its Jacobian (the Christoffel contraction) and the
dense vertical basis.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import manifolds
import sharpness
from manifolds._connection import Metric
from sharpness import MEASURES, Objective, Solver

D, H, HD, FF, T, N = 8, 2, 4, 12, 4, 5  # width, heads, head size, MLP width, tokens, samples


class MHABlock(nn.Module):
    def __init__(self, pre_ln: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        if self.pre_ln:
            y = self.ln1(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        x = self.ln1(x + self.attn(x, x, x, need_weights=False)[0])
        return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))


class HandBlock(nn.Module):
    """Attention written by hand: explicit scores, softmax and product with the values."""

    def __init__(self, pre_ln: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def attend(self, y):
        b, t, _ = y.shape
        q, k, v = (m(y).view(b, t, H, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(dim=-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, D))

    def forward(self, x):
        if self.pre_ln:
            x = x + self.attend(self.ln1(x))
            return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        x = self.ln1(x + self.attend(x))
        return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))


class FusedBlock(nn.Module):
    """One Linear projects query, key and value; its output is cut into heads and pieces by ``unbind``."""

    def __init__(self, pre_ln: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def attend(self, y):
        b, t, _ = y.shape
        q, k, v = self.qkv(y).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(dim=-1) @ v
        return self.proj(a.transpose(1, 2).reshape(b, t, D))

    forward = HandBlock.forward


class Net(nn.Module):
    """Blocks, mean pooling over the tokens, a linear head (regression or classification)."""

    def __init__(self, blocks, out: int):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(D, out)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


CASES = {  # name: (blocks, task)
    "mha_pre": ([("mha", True)], "regression"),
    "mha_post": ([("mha", False)], "classification"),
    "hand_pre": ([("hand", True)], "classification"),
    "hand_post": ([("hand", False)], "regression"),
    "two_blocks": ([("mha", True), ("hand", False)], "classification"),
    "fused_pre": ([("fused", True)], "regression"),
}
BLOCKS = {"mha": MHABlock, "hand": HandBlock, "fused": FusedBlock}


def make(name: str, seed: int = 0):
    spec, task = CASES[name]
    torch.manual_seed(seed)
    blocks = [BLOCKS[kind](pre) for kind, pre in spec]
    model = Net(blocks, 2 if task == "regression" else 3).double().eval()
    with torch.no_grad():  # away from the default initialization (unit LayerNorm scales, zero biases)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, T, D, dtype=torch.float64)
    if task == "regression":
        return model, nn.MSELoss(), (x, torch.randn(N, 2, dtype=torch.float64))
    return model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))


def _params(model):
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}  # frozen ones stay as they are


def _with(model, params):
    twin = copy.deepcopy(model)
    twin.load_state_dict(params, strict=False)
    return twin


# -- hand-built group elements, written on the state dict ------------------------------------------------------
def _gl(g):
    return torch.eye(HD, dtype=torch.float64) + 0.5 * torch.randn(HD, HD, generator=g, dtype=torch.float64)


def _scales(g, k):
    return torch.exp(0.7 * torch.randn(k, generator=g, dtype=torch.float64))


def _rows(sd, name, rows, m):
    t = sd[name].clone()
    t[rows] = m @ t[rows] if t.dim() == 2 else m @ t[rows]
    sd[name] = t


def hand_element(model, g) -> dict:
    """Per head ``A`` on query/key (the key bias left alone) and ``B`` on value/output, the pre-LN LayerNorm trades
    and the ReLU units."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}."
        for h in range(H):
            a, b = _gl(g), _gl(g)
            head = slice(h * HD, (h + 1) * HD)
            if isinstance(block, (MHABlock, FusedBlock)):  # packed: query, key and value rows one after another
                packed = "attn.in_proj_" if isinstance(block, MHABlock) else "qkv."
                for role, m in enumerate((a.T, torch.linalg.inv(a), b.T)):
                    rows = slice(role * D + h * HD, role * D + (h + 1) * HD)
                    _rows(sd, p + packed + "weight", rows, m)
                    if role != 1:  # the key bias is not read (the softmax ignores the shift it adds): unmoved
                        _rows(sd, p + packed + "bias", rows, m)
                out = p + ("attn.out_proj.weight" if isinstance(block, MHABlock) else "proj.weight")
            else:
                for role, m in zip("qkv", (a.T, torch.linalg.inv(a), b.T)):
                    _rows(sd, f"{p}{role}.weight", head, m)
                    if role != "k":
                        _rows(sd, f"{p}{role}.bias", head, m)
                out = p + "o.weight"
            w = sd[out].clone()
            w[:, head] = w[:, head] @ torch.linalg.inv(b).T
            sd[out] = w
        units = _scales(g, FF)  # ReLU units: rows of fc1 (and bias) times c, columns of fc2 divided by c
        sd[p + "fc1.weight"] = sd[p + "fc1.weight"] * units[:, None]
        sd[p + "fc1.bias"] = sd[p + "fc1.bias"] * units
        sd[p + "fc2.weight"] = sd[p + "fc2.weight"] / units
        if block.pre_ln:  # the LayerNorm scales traded against every layer reading them
            first = {MHABlock: ["attn.in_proj_weight"], FusedBlock: ["qkv.weight"]}.get(type(block), ["q.weight",
                                                                                             "k.weight", "v.weight"])
            for ln, readers in (("ln1", first), ("ln2", ["fc1.weight"])):
                c = _scales(g, D)
                sd[f"{p}{ln}.weight"] = sd[f"{p}{ln}.weight"] * c
                sd[f"{p}{ln}.bias"] = sd[f"{p}{ln}.bias"] * c
                for r in readers:
                    sd[p + r] = sd[p + r] / c
    return sd


# -- dense reference ---------------------------------------------------------------------------------------------
def _loss_fn(model, loss, data, layout):
    x, y = data

    def f(w):
        return loss(torch.func.functional_call(model, layout.unflatten(w), (x,)), y)

    return f


def representative(model, symmetry):
    """A copy of ``model`` with the value biases of the factors recording one (``Factor.absorption``) moved into the
    output bias, ``bo <- bo + Wo_h bv_h``, ``bv_h <- 0``: where the symmetry measure is taken (the same function)."""
    params = _params(model)
    sd = {n: p.clone() for n, p in params.items()}
    for f in symmetry.factors:
        if f.absorption is None or f.absorption[0].name not in params or f.absorption[1] not in params:
            continue
        (value, output), rows = f.absorption, list(f.absorption[0].index)
        for b in f.blocks:
            if b.axis == 1:  # the output projection's columns reading the head, as the (out, in) matrix
                w = params[b.name].T if b.transposed else params[b.name]
                sd[output] = sd[output] + w[:, list(b.index)] @ params[value.name][rows]
        sd[value.name][rows] = 0.0
    return _with(model, sd)


def dense_quotient_spectrum(model, loss, data, metric: Metric, symmetry) -> np.ndarray:
    """Eigenvalues of ``xi^T (H - B) xi`` relative to ``G`` on the ``G``-orthogonal complement of the orbit, at the
    point with the value biases absorbed (`representative`), where the measure is taken.

    ``B_ij = g_k Gamma^k_ij = 1/2 (d_i (G u)_j + d_j (G u)_i - (d_u G)_ij)`` with ``u = G^-1 g``: the first two
    from the Jacobian of ``w -> G(w) u``, the last the derivative of the dense ``G(w)`` along ``u``."""
    model = representative(model, symmetry)
    params = _params(model)
    layout = manifolds.ParamLayout.from_tensors(params)
    w = layout.flatten(params)
    n = w.numel()
    f = _loss_fn(model, loss, data, layout)
    with sdpa_kernel(SDPBackend.MATH):
        # reverse over reverse: torch.func.hessian (forward over reverse) returns an asymmetric, wrong Hessian
        # through nn.MultiheadAttention here (off by 0.2 against finite differences of the gradient)
        hess = torch.func.jacrev(torch.func.grad(f))(w)
        grad = torch.func.grad(f)(w)
    assert torch.allclose(hess, hess.T, rtol=0, atol=1e-10)
    eye = torch.eye(n, dtype=w.dtype)

    def dense_metric(p):
        return torch.stack([metric.apply(p, e) for e in eye])

    g_mat = dense_metric(w)
    u = torch.linalg.solve(g_mat, grad)
    jac = torch.func.jacfwd(lambda p: metric.apply(p, u))(w)  # jac[j, i] = d_i (G u)_j
    dg_u = torch.func.jvp(dense_metric, (w,), (u,))[1]
    b = 0.5 * (jac + jac.T - dg_u)
    riem = (hess - b).numpy()
    v = symmetry.vertical_basis(params)
    horizontal = scipy.linalg.null_space((v.T @ g_mat).numpy())
    a = horizontal.T @ riem @ horizontal
    m = horizontal.T @ g_mat.numpy() @ horizontal
    return scipy.linalg.eigh((a + a.T) / 2, (m + m.T) / 2, eigvals_only=True)


def measure_value(model, loss, data, k: int = 1) -> float:
    obj = Objective(model, loss, data, dtype=torch.float64)
    return MEASURES["symmetry"].sharpness(obj, k=k, solver=Solver(tol=1e-12), progress=False).eigenvalues


# -- (a) the metric is invariant, and the alternatives are not -------------------------------------------------
def _form(metric, layout, params, xi, eta):
    return float(layout.flatten(xi) @ metric.apply(layout.flatten(params), layout.flatten(eta)))


def _pushed(symmetry, element, tangent):
    return symmetry.act(tangent, element)  # the action is linear in the parameters: it is its own differential


def assert_keeps_outputs(model, symmetry, x, seed: int) -> None:
    """A random element of ``symmetry`` (seeded) moves ``model``'s outputs on ``x`` by less than 1e-12."""
    twin = symmetry.transformed(model, symmetry.random_element(1.0, torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12


def assert_quotient_matches_dense(model, loss, data, symmetry, g: torch.Generator):
    """The symmetry metric's form is unchanged (1e-10) when a random element moves the point and two random tangents,
    and the measure's top two eigenvalues equal the dense reference's (1e-8); returns them and the element."""
    params = _params(model)
    layout = manifolds.ParamLayout.from_tensors(params)
    metric = manifolds.symmetry_metric(symmetry, params)
    xi, eta = ({n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2))
    element = symmetry.random_element(1.0, g)
    after = _form(metric, layout, symmetry.act(params, element), _pushed(symmetry, element, xi),
                  _pushed(symmetry, element, eta))  # fmt: skip
    assert after == pytest.approx(_form(metric, layout, params, xi, eta), rel=1e-10)
    reference = dense_quotient_spectrum(model, loss, data, metric, symmetry)
    got = measure_value(model, loss, data, k=2)
    assert np.allclose(got, reference[::-1][:2], rtol=1e-8, atol=0), (got, reference[::-1][:2])
    return got, element


@pytest.mark.parametrize("name", list(CASES))
def test_metric_is_invariant_under_random_and_hand_built_elements(name):
    model, _, (x, _) = make(name)
    sym = manifolds.transformer_symmetry(model, x)
    params = _params(model)
    layout = manifolds.ParamLayout.from_tensors(params)
    metric = manifolds.symmetry_metric(sym, params)
    g = torch.Generator().manual_seed(1)
    xi, eta = ({n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2))
    before = _form(metric, layout, params, xi, eta)
    for _ in range(3):
        element = sym.random_element(1.0, g)
        moved = sym.act(params, element)
        after = _form(metric, layout, moved, _pushed(sym, element, xi), _pushed(sym, element, eta))
        assert abs(after - before) <= 1e-10 * abs(before), (before, after)
    hand = hand_element(model, torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (_with(model, hand)(x) - model(x)).abs().max() < 1e-10
    xi_h, eta_h = _hand_differential(model, xi), _hand_differential(model, eta)
    after = _form(metric, layout, hand, xi_h, eta_h)
    assert abs(after - before) <= 1e-10 * abs(before), (before, after)


def _hand_differential(model, tangent):
    """The hand-built element (seed 2) applied to a tangent: the element is linear in the parameters, so its
    differential is the element itself applied to the tangent in place of the parameters."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(tangent[n])
    return hand_element(twin, torch.Generator().manual_seed(2))


@pytest.mark.parametrize("variant", ["no_norm_weighting", "euclidean"])
def test_metrics_without_the_invariant_weighting_move(variant):
    # The same construction with the LayerNorm weighting of the query/key/value columns dropped (P = 1: the plain
    # balanced metric), or the Euclidean metric: a random element moves their value.
    model, _, (x, _) = make("mha_pre")
    sym = manifolds.transformer_symmetry(model, x)
    params = _params(model)
    layout = manifolds.ParamLayout.from_tensors(params)
    if variant == "euclidean":
        metric = Metric(lambda w, xi: xi)
    else:
        # the LayerNorm factors' column trades removed from the group the metric is built for: the q/k/v and fc1
        # blocks are then weighed by the plain balanced metric tr((X X^T)^-1 xi xi^T)
        kept = tuple(f if f.kind == "GL" or "units" in f.label else
                     manifolds.Factor(f.kind, f.size, tuple(b for b in f.blocks if b.axis == 0), f.label, f.symbol)
                     for f in sym.factors)
        metric = manifolds.symmetry_metric(manifolds.MatrixSymmetry(kept, sym.diagonal, sym.pins), params)
    g = torch.Generator().manual_seed(4)
    xi, eta = ({n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2))
    before = _form(metric, layout, params, xi, eta)
    element = sym.random_element(1.0, g)
    after = _form(metric, layout, sym.act(params, element), sym.act(xi, element), sym.act(eta, element))
    assert abs(after - before) > 0.05 * abs(before), (before, after)


# -- (b) the measure equals a dense reference ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_measure_equals_the_dense_reference(name):
    model, loss, data = make(name)
    sym = manifolds.transformer_symmetry(model, data[0])
    params = _params(model)
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    value = measure_value(model, loss, data, k=2)
    assert np.allclose(value, reference[::-1][:2], rtol=1e-8, atol=0), (value, reference[::-1][:3])


# -- (c) unchanged under the group, while Euclidean and adaptive sharpness move ---------------------------------------
def _euclidean(model, loss, data) -> float:
    with sdpa_kernel(SDPBackend.MATH):  # the default CPU kernel has no second derivative
        return sharpness.euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value


def _adaptive(model, loss, data) -> float:
    with sdpa_kernel(SDPBackend.MATH):
        return sharpness.adaptive_sharpness(model, loss, data, rho=0.01, kind="l2", dtype=torch.float64,
                                            progress=False).value


@pytest.mark.parametrize("name", ["mha_pre", "hand_pre", "two_blocks", "fused_pre"])
def test_measure_is_unchanged_under_the_group_while_euclidean_and_adaptive_move(name):
    model, loss, data = make(name)
    sym = manifolds.transformer_symmetry(model, data[0])
    before = measure_value(model, loss, data)[0]
    moved = [sym.transformed(model, sym.random_element(1.5, torch.Generator().manual_seed(5))),
             _with(model, hand_element(model, torch.Generator().manual_seed(6)))]
    euclidean, adaptive = _euclidean(model, loss, data), _adaptive(model, loss, data)
    for twin in moved:
        with torch.no_grad():
            assert (twin(data[0]) - model(data[0])).abs().max() < 1e-10
        after = measure_value(twin, loss, data)[0]
        assert abs(after - before) <= 1e-8 * abs(before), (before, after)
        e, a = _euclidean(twin, loss, data), _adaptive(twin, loss, data)
        assert max(e, euclidean) / min(e, euclidean) > 1.5, (euclidean, e)
        assert max(a, adaptive) / min(a, adaptive) > 1.5, (adaptive, a)


# -- (d) frozen parameters: the subgroup leaving them unchanged ------------------------------------------------------
def _frozen_hand_element(model, g) -> dict:
    """Per head ``B`` on value/output and the ReLU units: what is left of the group of ``hand_pre`` with the query
    weight and the second LayerNorm's scale frozen (the query/key factors and both LayerNorm trades move them)."""
    sd = _params(model)
    for h in range(H):
        b, head = _gl(g), slice(h * HD, (h + 1) * HD)
        _rows(sd, "blocks.0.v.weight", head, b.T)
        _rows(sd, "blocks.0.v.bias", head, b.T)
        w = sd["blocks.0.o.weight"].clone()
        w[:, head] = w[:, head] @ torch.linalg.inv(b).T
        sd["blocks.0.o.weight"] = w
    units = _scales(g, FF)
    sd["blocks.0.fc1.weight"] = sd["blocks.0.fc1.weight"] * units[:, None]
    sd["blocks.0.fc1.bias"] = sd["blocks.0.fc1.bias"] * units
    sd["blocks.0.fc2.weight"] = sd["blocks.0.fc2.weight"] / units
    return sd


def test_frozen_parameters_leave_the_subgroup_that_keeps_them():
    """With the query weight and a LayerNorm scale frozen, the symmetry measure quotients the subgroup that leaves
    them unchanged (before, it refused the model): equal to the dense float64 reference of that subgroup, unchanged
    under its elements (random ones and ones built by hand), and its dimension counted by hand."""
    model, loss, data = make("hand_pre")
    whole = manifolds.transformer_symmetry(model, data[0])
    model.blocks[0].q.weight.requires_grad_(False)
    model.blocks[0].ln2.weight.requires_grad_(False)
    params = _params(model)
    sym = whole.restricted(params)
    # left: per head GL(4) on value/output (2 x 16) and the 12 ReLU units; gone: query/key (2 x 16, they move
    # q.weight), the ln1 trade (8: it moves q.weight's columns) and the ln2 trade (8)
    assert (whole.dim, sym.dim, sym.diagonal_dim) == (2 * 16 + 2 * 16 + 8 + 8 + 12, 2 * 16 + 12, 0), sym.describe()
    gone = sym.pins[len(whole.pins):]
    assert [pin.reason for pin in gone] == [manifolds._matrix_group.FIXED] * 4, sym.describe()
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    obj = Objective(model, loss, data, dtype=torch.float64)
    result = MEASURES["symmetry"].sharpness(obj, k=2, solver=Solver(tol=1e-12), progress=False)
    assert result.info["symmetry_group_dim"] == sym.dim
    assert np.allclose(result.eigenvalues, reference[::-1][:2], rtol=1e-8, atol=0), (result.eigenvalues, reference)
    moved = [sym.transformed(model, sym.random_element(1.5, torch.Generator().manual_seed(5))),
             _with(model, _frozen_hand_element(model, torch.Generator().manual_seed(6)))]
    for twin in moved:
        for name in ("blocks.0.q.weight", "blocks.0.ln2.weight"):
            assert torch.equal(twin.get_parameter(name), model.get_parameter(name))
            assert not twin.get_parameter(name).requires_grad
        with torch.no_grad():
            assert (twin(data[0]) - model(data[0])).abs().max() < 1e-10
        after = measure_value(twin, loss, data)[0]
        assert abs(after - result.eigenvalues[0]) <= 1e-8 * abs(result.eigenvalues[0]), (result.eigenvalues, after)


def test_frozen_attention_projections_cut_the_attention_claim():
    """Every attention projection frozen: no attention factor is left, so the measure no longer claims invariance
    under attention's GL factors (the ReLU units and LayerNorm trades it keeps)."""
    model, loss, data = make("hand_pre")
    for name in ("q", "k", "v", "o"):
        getattr(model.blocks[0], name).weight.requires_grad_(False)
    obj = Objective(model, loss, data, dtype=torch.float64)
    result = MEASURES["symmetry"].sharpness(obj, k=1, solver=Solver(tol=1e-10), progress=False)
    assert "attention" not in result.info["invariant_under"]
    assert "normalization" in result.info["invariant_under"]


def test_a_factor_s_rows_of_zero_norm_are_refused_naming_them():
    """A query head whose first row and bias are zero: its block's Gram matrix is singular, so the metric is
    undefined there; the refusal names the tensors (it was a raw LinAlgError from the block solve)."""
    model, loss, data = make("hand_pre")
    with torch.no_grad():
        model.blocks[0].q.weight[0].zero_()
        model.blocks[0].q.bias[0] = 0.0
    with pytest.raises(manifolds.UnsupportedModelError, match=r"undefined at this point: blocks\.0\.q\.weight"):
        measure_value(model, loss, data)
