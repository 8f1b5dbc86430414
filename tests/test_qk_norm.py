"""Query/key normalization (timm's ``qk_norm``, ViT-22B, OLMo 2's full-width norms): the normalization breaks the
query/key GL(h) of the heads, and leaves a trade between the two normalizations' affine scales (``LN_q``'s scale and
shift times ``c``, ``LN_k``'s over ``c``) wherever feature ``j`` of every query row meets feature ``j`` of every key
row. Checked on tiny float64 models, written with ``F.scaled_dot_product_attention`` and with ``q @ k^T``: outputs
under hand-built and random elements, the metric's invariance, the measure against the dense quotient reference; the
cases without the trade say why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases import token_classification
from test_transformer_quotient import _with as _moved
from test_transformer_quotient import assert_keeps_outputs, assert_quotient_matches_dense, measure_value
from torch import nn

import manifolds

D, H, HD = 8, 2, 4


class Attention(nn.Module):
    """Fused ``qkv``; ``norms``: ``"head"`` (one LayerNorm per role over a head's features), ``"width"`` (over all
    features, before the heads are split), ``"shared"`` (one LayerNorm for both), ``"query"`` (the query alone),
    ``"plain"`` (no affine parameters)."""

    def __init__(self, form: str, norms: str):
        super().__init__()
        self.form, self.norms = form, norms
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        size = D if norms == "width" else HD
        self.q_norm = nn.LayerNorm(size, elementwise_affine=norms != "plain")
        self.k_norm = self.q_norm if norms == "shared" else nn.LayerNorm(size, elementwise_affine=norms != "plain")

    def forward(self, x):
        b, t, _ = x.shape
        if self.norms == "width":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = (z.reshape(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
        else:
            q, k, v = self.qkv(x).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
            q = self.q_norm(q)
            k = k if self.norms == "query" else self.k_norm(k)
        if self.form == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = (q * HD**-0.5 @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.proj(a.transpose(1, 2).reshape(b, t, D))


class Net(nn.Module):
    def __init__(self, form: str = "sdpa", norms: str = "head", **rotary):
        super().__init__()
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, 3)
        self.attn = Rotary(**rotary) if rotary else Attention(form, norms)

    def forward(self, x):
        return self.head((x + self.attn(self.ln(x))).mean(dim=1))


def _make(seed: int = 0, **options):
    torch.manual_seed(seed)
    return token_classification(Net(**options), D, seed)


def _traded(sym) -> list:
    return [f for f in sym.factors if "query/key normalization scales" in f.label]


@pytest.mark.parametrize("form", ["sdpa", "matmul"])
@pytest.mark.parametrize("norms", ["head", "width"])
def test_the_normalizations_scales_are_traded_and_keep_the_outputs(form, norms):
    model, _, (x, _) = _make(form=form, norms=norms)
    sym = manifolds.transformer_symmetry(model, x)
    (factor,) = _traded(sym)
    size = D if norms == "width" else HD
    assert factor.size == size and {b.name for b in factor.blocks} == {
        f"attn.{r}_norm.{p}" for r in "qk" for p in ("weight", "bias")
    }, sym.describe()
    assert not [f for f in sym.factors if "query/key:" in f.label]  # the heads' GL(h) is gone
    # by hand: q_norm's scale and shift times c, k_norm's over c
    g = torch.Generator().manual_seed(1)
    c = torch.exp(0.7 * torch.randn(size, generator=g, dtype=torch.float64))
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in ("weight", "bias"):
        sd[f"attn.q_norm.{p}"], sd[f"attn.k_norm.{p}"] = sd[f"attn.q_norm.{p}"] * c, sd[f"attn.k_norm.{p}"] / c
    fresh = torch.randn(3, 4, D, generator=g, dtype=torch.float64)
    for twin in (_moved(model, sd), sym.transformed(model, sym.random_element(1.0, g))):
        with torch.no_grad():
            assert (twin(fresh) - model(fresh)).abs().max() < 1e-12


@pytest.mark.parametrize("form", ["sdpa", "matmul"])
def test_the_metric_is_invariant_and_the_measure_equals_the_dense_reference(form):
    model, loss, data = _make(form=form)
    sym = manifolds.transformer_symmetry(model, data[0])
    got, element = assert_quotient_matches_dense(model, loss, data, sym, torch.Generator().manual_seed(3))
    moved = sym.transformed(model, element)
    assert np.allclose(measure_value(moved, loss, data, k=2), got, rtol=1e-8, atol=0)


@pytest.mark.parametrize("norms,why", [
    ("shared", "as normalized query and key: module 'attn.q_norm' (LayerNorm) is called more than once"),
    ("plain", "as normalized query and key: the query and key normalizations are not two with affine scales"),
    ("query", "as normalized query and key: the key 'unbind' (graph node 'unbind') is also read elsewhere"),
])  # fmt: skip
def test_no_trade_without_two_affine_normalizations_meeting_feature_by_feature(norms, why):
    model, _, (x, _) = _make(norms=norms)
    sym = manifolds.transformer_symmetry(model, x)
    assert _traded(sym) == [] and why in sym.describe(), sym.describe()
    assert_keeps_outputs(model, sym, x, seed=4)


class GroupedQuery(nn.Module):
    """4 query heads reading 2 key/value heads (SDPA's ``enable_gqa``), each side normalized per head."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, 4 * 2), nn.Linear(D, 2 * 2 * 2), nn.Linear(4 * 2, D)
        self.q_norm, self.k_norm, self.head = nn.LayerNorm(2), nn.LayerNorm(2), nn.Linear(D, 3)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, 4, 2).transpose(1, 2))
        k, v = self.kv(x).view(b, t, 2, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, self.k_norm(k), v, enable_gqa=True)
        return self.head((x + self.o(a.transpose(1, 2).reshape(b, t, 8))).mean(1))


def test_grouped_query_heads_share_the_normalizations_trade():
    torch.manual_seed(0)
    model = GroupedQuery().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(3, 5, D, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert [f.size for f in _traded(sym)] == [2] and sym.dim == 2 * 2 * 2 + 2, sym.describe()  # 2 value/output GL(2)
    assert_keeps_outputs(model, sym, x, seed=1)


class RMSQueryKey(nn.Module):
    """timm's layout with per-head ``nn.RMSNorm`` (no shift) on the query and the key."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, 3)
        self.q_norm, self.k_norm = nn.RMSNorm(HD), nn.RMSNorm(HD)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.head((x + self.proj(a.transpose(1, 2).reshape(b, t, D))).mean(1))


def test_rms_norms_trade_their_scales_unless_one_is_zero_where_the_metric_is_undefined():
    model, loss, data = token_classification(RMSQueryKey(), D)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert [f.size for f in _traded(sym)] == [HD], sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(2)))
    assert np.allclose(measure_value(twin, loss, data), measure_value(model, loss, data), rtol=1e-8, atol=0)
    with torch.no_grad():
        model.k_norm.weight[1] = 0.0  # the trade still keeps the outputs; its metric divides by the scale
    sym = manifolds.transformer_symmetry(model, data[0])
    assert _traded(sym) == [] and "has 1 feature(s) of zero scale and shift" in sym.describe(), sym.describe()
    assert bool(torch.isfinite(measure_value(model, loss, data)).all())


class VectorKey(nn.Module):
    """A normalized query against one normalized key vector (attention pooling by hand): no heads, no trade."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.v, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.q_norm, self.k_norm = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x):
        k = self.k_norm(self.b(x[:, 0]))[0]  # (D,)
        return self.head(((self.q_norm(self.a(x)) @ k).softmax(-1)[..., None] * self.v(x)).sum(1))


def test_a_key_of_one_axis_pins_with_the_reason():
    model, _, (x, _) = token_classification(VectorKey(), D)
    sym = manifolds.transformer_symmetry(model, x)  # was an IndexError from the probe's transpose
    assert _traded(sym) == [] and "fewer than two axes" in sym.describe(), sym.describe()


def test_verify_draws_the_normalizations_trade_as_a_normalization_rescaling():
    """The trade moves normalization scales entry by entry, so `verify`'s "normalization" kind draws it (before, a
    network whose only normalization trade is this one had nothing to draw there), and adaptive sharpness, which claims
    that kind, holds under it."""
    from sharpness import Rescalings, Solver, verify_invariance  # noqa: PLC0415

    model, loss, data = token_classification(RMSQueryKey(), D)
    rep = verify_invariance(model, loss, data, ["symmetry"], balls=0.05,
                            rescalings=Rescalings(("normalization",), trials=1), solver=Solver(tol=1e-9),
                            progress=False)  # fmt: skip
    assert rep.kinds == ("normalization",) and rep.group["normalization_factors"] >= 1, rep.table()
    for m in ("symmetry", "geodesic", "adaptive"):
        assert rep.verdict(m, "normalization") == "invariant", rep.table()
    assert rep.outcome == "passed"


class Rotary(nn.Module):
    """Qwen3's layout written by hand: per-head LayerNorms of the query and the key (``affine``, or RMSNorms without
    a shift: ``"rms"``), then rotary embeddings on each head's features, turned in pairs ``(j, j + hd/2)``
    (``"half"``, LLaMA's ``rotate_half``) or ``(2j, 2j + 1)`` (``"pairs"``, GPT-J's), then SDPA; heads of 4 features
    (``partial``: only the first 2 of them rotated, the others left as they are)."""

    def __init__(self, style: str = "half", norm: str = "layer", partial: bool = False):
        super().__init__()
        self.style, self.partial = style, partial
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        make = (lambda: nn.RMSNorm(HD)) if norm == "rms" else (lambda: nn.LayerNorm(HD))
        self.q_norm, self.k_norm = make(), make()
        width = 2 if partial else HD
        self.register_buffer("freq", 10000.0 ** (-torch.arange(0, width, 2.0) / width))

    def _turned(self, u):
        angles = torch.arange(u.shape[-2], dtype=u.dtype)[:, None] * self.freq  # the sequence's positions
        cos, sin = angles.cos(), angles.sin()
        if self.partial:
            return torch.cat([self._pairs(u[..., :2], cos, sin), u[..., 2:]], dim=-1)
        return self._pairs(u, cos, sin)

    def _pairs(self, u, cos, sin):
        if self.style == "half":
            half = u.shape[-1] // 2
            turned = torch.cat((-u[..., half:], u[..., :half]), dim=-1)
            return u * torch.cat((cos, cos), -1) + turned * torch.cat((sin, sin), -1)
        turned = torch.stack((-u[..., 1::2], u[..., ::2]), dim=-1).flatten(-2)  # GPT-J's rotate_every_two
        return u * cos.repeat_interleave(2, -1) + turned * sin.repeat_interleave(2, -1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self._turned(self.q_norm(q)), self._turned(self.k_norm(k))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.proj(a.transpose(1, 2).reshape(b, t, D))


def _scaled_pairs(model: nn.Module, c: torch.Tensor) -> nn.Module:
    """``model`` with ``q_norm``'s scale (and shift) times ``c`` and ``k_norm``'s over ``c``, written by hand."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name in [n for n in sd if ".q_norm." in n]:
        sd[name], other = sd[name] * c, name.replace(".q_norm.", ".k_norm.")
        sd[other] = sd[other] / c
    return _moved(model, sd)


@pytest.mark.parametrize("style,pairs", [("half", ((0, 2), (1, 3))), ("pairs", ((0, 1), (2, 3)))])
def test_rotary_embeddings_tie_the_normalizations_scales_in_their_rotated_pairs(style, pairs):
    """``(q C R_t)(k C^-1 R_s)^T = q R_t R_s^T k^T`` for every pair of positions exactly when ``C`` commutes with the
    rotations: one scale per rotated pair. A scale differing within a pair moves the outputs."""
    model, loss, data = _make(style=style)
    x = data[0]
    sym = manifolds.transformer_symmetry(model, x)
    (factor,) = _traded(sym)
    assert factor.size == 2 and "tied in sets of 2" in factor.label, sym.describe()
    moved = {(b.name, b.index) for b in factor.blocks}
    assert moved == {(f"attn.{r}_norm.{p}", tuple(pair[i] for pair in pairs)) for r in "qk" for p in ("weight", "bias")
                     for i in (0, 1)}, moved  # fmt: skip
    g = torch.Generator().manual_seed(7)
    fresh = torch.randn(3, 4, D, generator=g, dtype=torch.float64)
    c = torch.exp(0.7 * torch.randn(2, generator=g, dtype=torch.float64))
    tied = torch.empty(HD, dtype=torch.float64)
    for value, pair in zip(c, pairs):
        tied[list(pair)] = value
    untied = tied.clone()
    untied[pairs[0][0]] *= 2.0
    with torch.no_grad():
        assert (_scaled_pairs(model, tied)(fresh) - model(fresh)).abs().max() < 1e-12
        assert (_scaled_pairs(model, untied)(fresh) - model(fresh)).abs().max() > 1e-3
    assert_keeps_outputs(model, sym, x, seed=8)


def test_rotary_normalization_trade_metric_is_invariant_and_the_measure_equals_the_dense_reference():
    model, loss, data = _make(style="half", norm="rms")
    sym = manifolds.transformer_symmetry(model, data[0])
    assert [f.size for f in _traded(sym)] == [2], sym.describe()
    got, element = assert_quotient_matches_dense(model, loss, data, sym, torch.Generator().manual_seed(9))
    moved = sym.transformed(model, element)
    assert np.allclose(measure_value(moved, loss, data, k=2), got, rtol=1e-8, atol=0)


def test_features_no_rotation_touches_keep_a_scale_each():
    """Partial rotary: the rotated pair shares one scale, the two features left as they are one each."""
    model, _, (x, _) = _make(style="half", partial=True)
    sym = manifolds.transformer_symmetry(model, x)
    sizes = sorted((f.size, len(f.blocks)) for f in _traded(sym))
    assert sizes == [(1, 8), (2, 4)], sym.describe()  # one tied pair (2 blocks a tensor), two free features
    assert_keeps_outputs(model, sym, x, seed=10)


def test_an_example_of_one_token_tells_nothing_of_the_rotations_and_the_trade_is_left_out():
    """At one token every rotary map is the identity, which every diagonal commutes with; tokens beyond the example
    would untie nothing the trade may move. Before, the trade was claimed feature by feature and moved a longer input's
    outputs by 0.96 (review, session 33). With two tokens the pairs are read."""
    model, _, (x, _) = _make(style="half")
    sym = manifolds.transformer_symmetry(model, x[:, :1])
    assert _traded(sym) == [] and "mix no features" in sym.describe(), sym.describe()
    sym = manifolds.transformer_symmetry(model, x[:, :2])
    assert [f.size for f in _traded(sym)] == [2], sym.describe()
    assert_keeps_outputs(model, sym, x, seed=11)


class ScaledRows(Rotary):
    """The rotary maps times a constant per head and position, ``1e13`` for one of them: ties are read relative to
    each row's own map (before, relative to the largest map, which hid every other row's rotation)."""

    def __init__(self):
        super().__init__()
        scale = torch.ones(H, 4, 1)
        scale[1, 0] = 1e13
        self.register_buffer("scale", scale)

    def _turned(self, u):
        return super()._turned(u) * self.scale  # examples of 4 tokens


def test_ties_are_read_relative_to_each_row_s_map():
    torch.manual_seed(0)
    model, _, (x, _) = token_classification(Net(), D)
    model.attn = ScaledRows().double().eval()
    with torch.no_grad():
        for p in model.attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    sym = manifolds.transformer_symmetry(model, x)
    assert [f.size for f in _traded(sym)] == [2], sym.describe()
    assert_keeps_outputs(model, sym, x, seed=12)


class WidthGrouped(nn.Module):
    """OLMo 2's layout with grouped-query attention: 4 query heads of 2 features sharing 2 key/value heads, the
    queries and keys each normalized over all their features (8 and 4) before the heads are split."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, 4 * 2), nn.Linear(D, 2 * 2 * 2), nn.Linear(4 * 2, D)
        self.q_norm, self.k_norm, self.head = nn.LayerNorm(8), nn.LayerNorm(4), nn.Linear(D, 3)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x)).view(b, t, 4, 2).transpose(1, 2)
        k, v = self.kv(x).chunk(2, dim=-1)
        k, v = self.k_norm(k).view(b, t, 2, 2).transpose(1, 2), v.reshape(b, t, 2, 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.head((x + self.o(a.transpose(1, 2).reshape(b, t, 8))).mean(1))


def test_norms_of_different_widths_trade_over_the_key_s_features_and_match_the_dense_reference():
    """Key feature ``j`` meets the same feature of the two query heads sharing its head: one scale per key feature (4),
    moving both query features; the metric stays invariant and the measure equals the dense quotient reference."""
    model, loss, data = token_classification(WidthGrouped(), D)
    sym = manifolds.transformer_symmetry(model, data[0])
    (factor,) = _traded(sym)
    assert factor.size == 4, sym.describe()
    assert {(b.name, b.index) for b in factor.blocks if b.name == "q_norm.weight"} == {
        ("q_norm.weight", (0, 1, 4, 5)), ("q_norm.weight", (2, 3, 6, 7))}, sym.describe()
    assert_quotient_matches_dense(model, loss, data, sym, torch.Generator().manual_seed(13))
