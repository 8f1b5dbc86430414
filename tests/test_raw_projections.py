"""Transformers whose projections are functions of parameters read directly, not ``nn.Linear`` modules: HuggingFace's
GPT-2 ``Conv1D`` (``torch.addmm(b, x.view(-1, nx), W)`` with ``W`` stored ``(in, out)``), ``x @ W + b``, ``x @ W`` and
``F.linear(x, W, b)``. Their attention, normalization and unit factors are found like those of ``nn.Linear`` layers,
act on the stored layout, and the quotient measure equals a dense float64 reference and is unchanged under group
elements built here by hand on the state dict.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_attention_symmetry import check_orbit_derivative
from test_rop_graph import _check
from test_transformer_quotient import _form, _gl, _params, _scales, dense_quotient_spectrum, measure_value
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import manifolds

D, H, HD, FF, T, N = 8, 2, 4, 12, 4, 5  # width, heads, head size, MLP width, tokens, samples


class Conv1D(nn.Module):
    """HuggingFace's ``transformers.pytorch_utils.Conv1D`` as GPT-2 uses it: ``x W + b``, ``W`` stored ``(in, out)``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    """GPT-2's eager attention as HuggingFace writes it: a fused ``c_attn`` cut by ``split``, heads split by ``view``
    and ``permute``, a causal mask from a buffer, and ``c_proj``; or ``F.scaled_dot_product_attention``."""

    def __init__(self, sdpa: bool = False):
        super().__init__()
        self.sdpa = sdpa
        self.c_attn, self.c_proj = Conv1D(3 * D, D), Conv1D(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T))

    @staticmethod
    def split_heads(t):
        return t.view(t.size()[:-1] + (H, HD)).permute(0, 2, 1, 3)

    def forward(self, x):
        query, key, value = self.c_attn(x).split(D, dim=2)
        query, key, value = self.split_heads(query), self.split_heads(key), self.split_heads(value)
        if self.sdpa:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        else:
            weights = torch.matmul(query, key.transpose(-1, -2)) / (value.size(-1) ** 0.5)
            weights = weights.masked_fill(~self.bias, float("-inf")).softmax(dim=-1)
            out = torch.matmul(weights, value)
        out = out.permute(0, 2, 1, 3).contiguous()
        return self.c_proj(out.view(out.size()[:-2] + (D,)))


class GPT2Block(nn.Module):
    def __init__(self, sdpa: bool = False):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = GPT2Attention(sdpa)
        self.c_fc, self.c_proj = Conv1D(FF, D), Conv1D(D, FF)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(torch.relu(self.c_fc(self.ln_2(x))))


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm as HuggingFace writes it: the scale ``weight * hidden_states`` read directly by the forward."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), 1e-6

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class RawBlock(nn.Module):
    """Every projection a function of parameters: ``x @ W + b`` (query, key, value; ``W`` stored ``(in, out)``),
    ``F.linear`` (output and the MLP's first layer; ``(out, in)``) and a bias-free ``x @ W`` (the MLP's second);
    LayerNorms, or RMSNorms written by hand (``rms``)."""

    def __init__(self, rms: bool = False):
        super().__init__()
        self.ln_1, self.ln_2 = (RMSNorm(D), RMSNorm(D)) if rms else (nn.LayerNorm(D), nn.LayerNorm(D))
        for role in "qkv":
            setattr(self, f"w_{role}", nn.Parameter(torch.randn(D, D) * 0.3))
            setattr(self, f"b_{role}", nn.Parameter(torch.zeros(D)))
        self.w_o, self.b_o = nn.Parameter(torch.randn(D, D) * 0.3), nn.Parameter(torch.zeros(D))
        self.w_1, self.b_1 = nn.Parameter(torch.randn(FF, D) * 0.3), nn.Parameter(torch.zeros(FF))
        self.w_2 = nn.Parameter(torch.randn(FF, D) * 0.3)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.ln_1(x)
        q, k, v = ((y @ w + bias).view(b, t, H, HD).transpose(1, 2)
                   for w, bias in ((self.w_q, self.b_q), (self.w_k, self.b_k), (self.w_v, self.b_v)))  # fmt: skip
        a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, D), self.w_o, self.b_o)
        return x + torch.relu(F.linear(self.ln_2(x), self.w_1, self.b_1)) @ self.w_2


class Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block, self.head = block, nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.block(x).mean(dim=1))


CASES = {"gpt2": lambda: GPT2Block(), "gpt2_sdpa": lambda: GPT2Block(sdpa=True), "raw": RawBlock,
         "raw_rms": lambda: RawBlock(rms=True)}
# per head GL(HD) on query/key and on value/output, both LayerNorm trades, the ReLU units
DIM = 2 * H * HD * HD + 2 * D + FF


def make(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Net(CASES[name]()).double().eval()
    with torch.no_grad():  # away from the initialization (unit LayerNorm scales, zero biases)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, T, D, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))


# -- hand-built elements, written on the stored tensors (`_gl`, `_scales`: the quotient tests', same head size) --------
def _columns(sd, name, cols, m):
    """``W[:, cols] <- W[:, cols] m`` on a weight stored ``(in, out)`` (a bias: the row vector ``b[cols] m``)."""
    t = sd[name].clone()
    t[..., cols] = t[..., cols] @ m
    sd[name] = t


def hand_element(model: Net, g: torch.Generator, wrong_key: bool = False) -> dict:
    """``q -> q A``, ``k -> k A^-T`` (``A`` instead where ``wrong_key``), ``v -> v B`` and the output projection's
    inputs ``<- B^-1`` per head, the LayerNorm scales ``c`` traded against their readers' inputs, the ReLU units."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    gpt2 = isinstance(model.block, GPT2Block)
    p = "block."
    for h in range(H):
        a, b = _gl(g), _gl(g)
        head = slice(h * HD, (h + 1) * HD)
        key = a if wrong_key else torch.linalg.inv(a).T
        for role, m in enumerate((a, key, b)):
            if gpt2:
                cols = slice(role * D + h * HD, role * D + (h + 1) * HD)
                _columns(sd, p + "attn.c_attn.weight", cols, m)
                if role != 1:  # the key bias is not read (the softmax ignores the shift it adds): unmoved
                    _columns(sd, p + "attn.c_attn.bias", cols, m)
            else:
                _columns(sd, f"{p}w_{'qkv'[role]}", head, m)
                if role != 1:
                    _columns(sd, f"{p}b_{'qkv'[role]}", head, m)
        inv = torch.linalg.inv(b)
        if gpt2:  # c_proj stored (in, out): its input rows of head h
            w = sd[p + "attn.c_proj.weight"].clone()
            w[head] = inv @ w[head]
            sd[p + "attn.c_proj.weight"] = w
        else:  # F.linear's weight stored (out, in): its input columns of head h
            w = sd[p + "w_o"].clone()
            w[:, head] = w[:, head] @ inv.T
            sd[p + "w_o"] = w
    units = _scales(g, FF)
    if gpt2:
        sd[p + "c_fc.weight"] = sd[p + "c_fc.weight"] * units
        sd[p + "c_fc.bias"] = sd[p + "c_fc.bias"] * units
        sd[p + "c_proj.weight"] = sd[p + "c_proj.weight"] / units[:, None]
    else:
        sd[p + "w_1"] = sd[p + "w_1"] * units[:, None]
        sd[p + "b_1"] = sd[p + "b_1"] * units
        sd[p + "w_2"] = sd[p + "w_2"] / units[:, None]
    readers = {"ln_1": ["attn.c_attn.weight"], "ln_2": ["c_fc.weight"]} if gpt2 else {
        "ln_1": ["w_q", "w_k", "w_v"], "ln_2": ["w_1"]}  # fmt: skip
    for ln, names in readers.items():
        c = _scales(g, D)
        sd[f"{p}{ln}.weight"] = sd[f"{p}{ln}.weight"] * c
        if f"{p}{ln}.bias" in sd:  # an RMSNorm has none
            sd[f"{p}{ln}.bias"] = sd[f"{p}{ln}.bias"] * c
        for r in names:  # the input axis: rows of an (in, out) weight, columns of F.linear's (out, in)
            stored_in = sd[p + r].shape[0] == D if r != "w_1" else False
            sd[p + r] = sd[p + r] / (c[:, None] if stored_in else c)
    return sd


def _with(model, sd):
    twin = copy.deepcopy(model)
    twin.load_state_dict(sd, strict=False)
    return twin


def _analyzed(build):
    """``build()`` (seeded) in float64 eval mode, ``N`` random ``(T, D)`` samples and its group."""
    torch.manual_seed(0)
    model = build().double().eval()
    x = torch.randn(N, T, D, dtype=torch.float64)
    return model, x, manifolds.transformer_symmetry(model, x)


def _moved_keeping_the_function(sym, model, x, g: torch.Generator, draws: int = 1):
    """``draws`` random elements of ``sym`` (from ``g``) applied to ``model``, each leaving its outputs on ``x`` to
    1e-10; the last copy."""
    with torch.no_grad():
        for _ in range(draws):
            moved = sym.transformed(model, sym.random_element(1.0, g))
            assert (moved(x) - model(x)).abs().max() < 1e-10
    return moved


# -- the group ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_the_group_is_found_on_the_stored_layout(name):
    model, _, (x, _) = make(name)
    sym = manifolds.transformer_symmetry(model, x)
    assert sym.dim == DIM, sym.describe()
    kinds = sorted(f.label.split(": ")[-1].split(" (")[0] if "attention" in f.label else f.label.split(" ")[0]
                   for f in sym.factors)  # fmt: skip
    assert kinds.count("query/key") == H and kinds.count("value/output") == H, sym.describe()
    text = sym.describe()
    if name.startswith("gpt2"):  # q -> q A reads on the stored (in, out) weight as W A: no transpose
        assert "block.attn.c_attn.weight columns 0:4 <- (.) A\n" in text, text
        assert "block.attn.c_attn.weight columns 8:12 <- (.) A^-T\n" in text, text
        assert "block.attn.c_proj.weight rows 0:4 <- B^-1 (.)\n" in text, text
        assert "block.attn.c_attn.weight rows 0:8 <- diag(c)^-1 (.)\n" in text, text
    else:
        assert "block.w_q columns 0:4 <- (.) A\n" in text and "block.w_o columns 0:4 <- (.) B^-T\n" in text, text
    if name == "raw_rms":  # the hand-written scale traded against the three projections reading it
        assert "elementwise scale 'block.ln_1.weight'" in text and "block.w_k rows 0:8 <- diag(c)^-1 (.)" in text, text


@pytest.mark.parametrize("name", list(CASES))
def test_random_and_hand_built_elements_keep_the_function_and_a_wrong_one_does_not(name):
    model, _, (x, _) = make(name)
    sym = manifolds.transformer_symmetry(model, x)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):
            moved = sym.transformed(model, sym.random_element(1.0, g))
            assert (moved(x) - ref).abs().max() < 1e-10
            assert max((p - q).abs().max() for p, q in zip(model.parameters(), moved.parameters())) > 0.1
        assert (_with(model, hand_element(model, g))(x) - ref).abs().max() < 1e-10
        assert (_with(model, hand_element(model, g, wrong_key=True))(x) - ref).abs().max() > 1e-3


def test_vertical_tangents_are_the_orbit_derivative_on_transposed_weights():
    model, _, (x, _) = make("gpt2")
    sym = manifolds.transformer_symmetry(model, x)
    params = _params(model)
    check_orbit_derivative(sym, params, torch.randn(sym.dim, generator=torch.Generator().manual_seed(3),
                                                    dtype=torch.float64))  # fmt: skip
    basis = sym.vertical_basis(params)
    assert torch.linalg.matrix_rank(basis) == sym.dim


# -- the products ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_products_are_the_r_operator_s_and_equal_the_dense_hessian(name):
    # Conv1D's view(-1, nx), addmm and view back are read as one layer of the token sequence; F.linear and x @ W + b
    # as they are. Kept state and streamed in chunks of 3 samples.
    model, _, (x, y) = make(name)
    with sdpa_kernel(SDPBackend.MATH):  # the dense reference differentiates twice
        _check(model, x, y)


# -- the quotient ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "raw", "raw_rms"])
def test_metric_is_invariant_under_random_and_hand_built_elements(name):
    model, _, (x, _) = make(name)
    sym = manifolds.transformer_symmetry(model, x)
    params = _params(model)
    layout = manifolds.ParamLayout.from_tensors(params)
    metric = manifolds.symmetry_metric(sym, params)
    g = torch.Generator().manual_seed(4)
    xi, eta = ({n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2))
    before = _form(metric, layout, params, xi, eta)
    element = sym.random_element(1.0, g)
    after = _form(metric, layout, sym.act(params, element), sym.act(xi, element), sym.act(eta, element))
    assert abs(after - before) <= 1e-10 * abs(before), (before, after)

    def hand(tangent):  # the element is linear in the parameters: its differential is itself
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(tangent[n])
        return hand_element(twin, torch.Generator().manual_seed(5))

    after = _form(metric, layout, hand(params), hand(xi), hand(eta))
    assert abs(after - before) <= 1e-10 * abs(before), (before, after)


@pytest.mark.parametrize("name", ["gpt2", "raw", "raw_rms"])
def test_measure_equals_the_dense_reference_and_is_unchanged_under_a_hand_built_element(name):
    model, loss, data = make(name)
    sym = manifolds.transformer_symmetry(model, data[0])
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, _params(model)), sym)
    value = measure_value(model, loss, data, k=2)
    assert np.allclose(value, reference[::-1][:2], rtol=1e-8, atol=0), (value, reference[::-1][:3])
    twin = _with(model, hand_element(model, torch.Generator().manual_seed(6)))
    after = measure_value(twin, loss, data, k=1)
    assert abs(float(after[0]) - float(value[0])) <= 1e-8 * abs(float(value[0])), (value, after)


# -- what pins ---------------------------------------------------------------------------------------------------------
class TwiceCalled(nn.Module):
    """One Conv1D projects both query and key (its weight is read by two calls): no query/key factor."""

    def __init__(self):
        super().__init__()
        self.qk, self.v, self.o = Conv1D(D, D), Conv1D(D, D), Conv1D(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.qk, self.qk, self.v))
        a = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return x + self.o(a.transpose(1, 2).reshape(b, t, D))


class TiedRaw(nn.Module):
    """The value weight is also read by a second product outside attention: no value/output factor."""

    def __init__(self):
        super().__init__()
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Parameter(torch.randn(D, D) * 0.3) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = ((x @ w).view(b, t, H, HD).transpose(1, 2) for w in (self.w_q, self.w_k, self.w_v))
        a = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return x + a.transpose(1, 2).reshape(b, t, D) @ self.w_o + x @ self.w_v


@pytest.mark.parametrize("kind,pinned", [(TwiceCalled, "query/key"), (TiedRaw, "value/output")])
def test_a_weight_read_twice_pins_its_factor_and_what_is_claimed_still_holds(kind, pinned):
    model, x, sym = _analyzed(kind)
    labels = [f.label for f in sym.factors]
    assert not any(pinned in label for label in labels), sym.describe()
    assert "also read elsewhere" in sym.describe() or "called more than once" in sym.describe(), sym.describe()
    other = "value/output" if pinned == "query/key" else "query/key"
    assert sum(other in label for label in labels) == H, sym.describe()
    _moved_keeping_the_function(sym, model, x, torch.Generator().manual_seed(7))


# -- elementwise scales read directly ----------------------------------------------------------------------------------
class Scaled(nn.Module):
    """``h * w`` with ``w`` a parameter vector: read by a Linear alone (traded), or also by a residual addition, or with
    ``w`` read again, or as Gemma's ``(1 + w) * h`` (no trade: pinned or not a plain parameter)."""

    def __init__(self, case: str):
        super().__init__()
        self.case, self.w = case, nn.Parameter(torch.rand(D) + 0.5)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.case == "gemma":
            y = (1 + self.w) * h
        else:
            y = h * self.w
        if self.case == "residual":
            y = y + h
        if self.case == "read_twice":
            y = y + self.w
        return self.b(y)


@pytest.mark.parametrize("case", ["traded", "residual", "read_twice", "gemma"])
def test_an_elementwise_scale_is_traded_only_where_linear_layers_alone_read_it(case):
    model, x, sym = _analyzed(lambda: Scaled(case))
    traded = [f for f in sym.factors if f.label.startswith("elementwise scale")]
    assert len(traded) == (1 if case == "traded" else 0), sym.describe()
    if case in ("residual", "read_twice"):
        assert "its elementwise scale cannot be traded" in sym.describe(), sym.describe()
    moved = _moved_keeping_the_function(sym, model, x, torch.Generator().manual_seed(8))
    with torch.no_grad():
        if case == "traded":  # by hand: w -> c w, the reader's columns / c
            c = _scales(torch.Generator().manual_seed(9), D)
            sd = {n: p.detach().clone() for n, p in model.named_parameters()}
            sd["w"], sd["b.weight"] = sd["w"] * c, sd["b.weight"] / c
            assert (_with(model, sd)(x) - model(x)).abs().max() < 1e-12
            assert max((p - q).abs().max() for p, q in zip(model.parameters(), moved.parameters())) > 0.1


class OddBias(nn.Module):
    """A "bias" that is no vector of the output features: ``(T, FF)`` in ``addmm`` and ``F.linear`` (one per token),
    ``(1,)`` broadcast over every feature, and ``(T,)`` added to an ``(N, T, 1)`` product broadcasting it to ``T``
    features. None may be moved as a bias of the layer's units."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        width = 1 if case == "broadcast_by_bias" else FF
        self.w1 = nn.Parameter(torch.randn(D, width) * 0.5 if case != "linear_2d" else torch.randn(width, D) * 0.5)
        shape = {"addmm_2d": (T, FF), "linear_2d": (T, FF), "scalar": (1,), "broadcast_by_bias": (T,)}[case]
        self.b1 = nn.Parameter(torch.randn(shape))
        self.w2 = nn.Parameter(torch.randn(FF if case != "broadcast_by_bias" else T, 3) * 0.5)

    def forward(self, x):
        x0 = x.mean(0)  # (T, D): one sequence, so a (T, FF) bias adds one row per token
        if self.case == "addmm_2d":
            h = torch.addmm(self.b1, x0, self.w1)
        elif self.case == "linear_2d":
            h = F.linear(x0, self.w1, self.b1)
        else:
            h = x @ self.w1 + self.b1
        return torch.relu(h) @ self.w2


@pytest.mark.parametrize("case", ["addmm_2d", "linear_2d", "scalar", "broadcast_by_bias"])
def test_a_bias_that_is_no_vector_of_the_output_features_pins_the_units(case):
    model, x, sym = _analyzed(lambda: OddBias(case))
    assert "b1" not in sym.names, sym.describe()
    _moved_keeping_the_function(sym, model, x, torch.Generator().manual_seed(10))


class ScaleCases(nn.Module):
    """``h *= w`` on a tensor also read by a residual (fx records the product out of place; at ``w = 1`` only the
    trace's check at moved parameters tells); a scale after gated ReLU units, whose factor already divides the
    reader's columns."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.w = nn.Parameter(torch.ones(D) if case == "aliased" else torch.rand(D) + 0.5)
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        if self.case == "aliased":
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            r = h
            h *= self.w
            return self.l2(h).mean(1) + r.sum((1, 2))[:, None]
        return self.l2(torch.relu(self.l1(x)) * self.w).mean(1)


def test_a_scale_updating_an_alias_in_place_leaves_no_graph():
    model = ScaleCases("aliased").double().eval()
    x = torch.randn(N, T, D, dtype=torch.float64)
    with pytest.raises(manifolds.UnsupportedModelError, match="in-place update"):
        manifolds.transformer_symmetry(model, x)


@pytest.mark.parametrize("case", ["after_units"])
def test_a_scale_read_after_units_is_not_traded_twice(case):
    model, x, sym = _analyzed(lambda: ScaleCases(case))
    assert not any(f.label.startswith("elementwise scale") for f in sym.factors), sym.describe()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        model.w.add_(0.5 * torch.rand(D, generator=g, dtype=torch.float64))  # away from 1, where h *= w is no-op
    moved = _moved_keeping_the_function(sym, model, x, g)
    if case == "after_units":  # the units' factor keeps the columns, and the measure runs and is invariant
        assert any(f.label.startswith("units") for f in sym.factors), sym.describe()
        loss, data = nn.MSELoss(), (x, torch.randn(N, 3, dtype=torch.float64))
        before, after = measure_value(model, loss, data)[0], measure_value(moved, loss, data)[0]
        assert abs(after - before) <= 1e-8 * abs(before), (before, after)


class FlatRead(nn.Module):
    """A Conv1D-style ``x.view(-1, nx)`` whose shape is also read downstream."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(D, 6) * 0.5), nn.Parameter(torch.randn(6) * 0.1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        flat = x.view(-1, D)
        out = torch.addmm(self.b, flat, self.w).view(x.shape[0], x.shape[1], 6)
        return self.head(torch.tanh(out)).mean(1) * (flat.size(1) / 3)


def test_a_merged_view_read_for_its_shape_runs_r_operator_products():
    """The samples' axis merged with the tokens' and split again (a view, linear whatever its axes): R-operator
    products, equal to the dense Hessian's (autograd's before views merging the samples' axis were read)."""
    torch.manual_seed(0)
    model = FlatRead().double().eval()
    x, y = torch.randn(N, T, D, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    _check(model, x, y, strategy="rop")


class TransposedRaw(nn.Module):
    """Weights stored ``(out, in)`` and read through a transpose: ``x @ W.T + b`` (query), ``x @ W.t()`` (key),
    ``x @ W.transpose(0, 1)`` (value), ``F.linear(x, W.mT)`` with ``W`` stored ``(in, out)`` (output), and a chain
    ``(relu(x @ W1.T) @ W2.T)`` whose first product is read by the second as its input."""

    def __init__(self):
        super().__init__()
        self.w_q, self.w_k, self.w_v = (nn.Parameter(torch.randn(D, D) * 0.3) for _ in range(3))
        self.b_q, self.w_o = nn.Parameter(torch.randn(D) * 0.1), nn.Parameter(torch.randn(D, D) * 0.3)
        self.w_1, self.w_2 = nn.Parameter(torch.randn(FF, D) * 0.3), nn.Parameter(torch.randn(D, FF) * 0.3)

    def forward(self, x):
        b, t, _ = x.shape
        q = (x @ self.w_q.T + self.b_q).view(b, t, H, HD).transpose(1, 2)
        k = (x @ self.w_k.t()).view(b, t, H, HD).transpose(1, 2)
        v = (x @ self.w_v.transpose(0, 1)).view(b, t, H, HD).transpose(1, 2)
        a = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, D), self.w_o.mT)
        return (x + torch.relu(x @ self.w_1.T) @ self.w_2.T).mean(1)


def test_weights_read_through_a_transpose_keep_their_factors():
    model, x, sym = _analyzed(TransposedRaw)
    labels = [f.label for f in sym.factors]
    assert sum("query/key" in la for la in labels) == H and sum("value/output" in la for la in labels) == H, labels
    assert any(la.startswith("units") for la in labels), sym.describe()  # relu(x @ W1.T) @ W2.T: W1's units
    text = sym.describe()
    assert "w_q rows 0:4 <- A^T (.)" in text and "w_o rows 0:4 <- B^-1 (.)" in text, text  # (out, in) / (in, out)
    _moved_keeping_the_function(sym, model, x, torch.Generator().manual_seed(12), draws=2)


def test_products_through_transposed_weights_are_the_r_operator_s_and_equal_the_dense_hessian():
    torch.manual_seed(0)
    model = TransposedRaw().double().eval()
    x, y = torch.randn(N, T, D, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    _check(model, x, y)


class TransposeReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        wt = self.w.T
        return self.head(torch.relu(x @ wt)).mean(1) + wt[0, :3]


def test_a_transpose_read_elsewhere_pins():
    _, _, sym = _analyzed(TransposeReadTwice)
    assert "w" not in sym.names and "also read elsewhere" in sym.describe(), sym.describe()


class OwnInput(nn.Module):
    """A transposed weight read by one layer as its weight and as its input (fx records a single reader)."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.w, self.u = nn.Parameter(torch.randn(D, D) * 0.5), nn.Parameter(torch.randn(D, D) * 0.5)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        wt = self.w.T
        inner = F.linear(wt, wt) if self.functional else wt @ wt
        return self.head(x @ (torch.relu(inner) @ self.u)).mean(1)


@pytest.mark.parametrize("functional", [False, True])
def test_a_weight_that_is_its_own_input_is_no_layer(functional):
    model, x, sym = _analyzed(lambda: OwnInput(functional))
    assert "w" not in sym.names, sym.describe()
    _moved_keeping_the_function(sym, model, x, torch.Generator().manual_seed(13))
