"""The query/key symmetry of attention with rotary position embeddings (manifolds._rotary): the subgroup of GL(hd)
commuting with every position's rotation, found on the graph, acting exactly, and quotiented exactly.

References that share none of the library's code path: the rotations built by hand from the cos/sin tables, group
elements built by hand (``a I + b J`` on each rotated pair, any invertible matrix on features no rotation touches), a
generic GL(hd) element (which must change the function: the group really is smaller), and the dense quotient spectrum
of `test_transformer_quotient`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_transformer_quotient import _adaptive, _euclidean, dense_quotient_spectrum, measure_value
from torch import nn

import manifolds

D, H, HD, FF, T, N = 8, 2, 4, 12, 4, 5  # width, heads, head size, MLP width, tokens, samples
FREQS = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))  # (HD/2,): 1 and 0.01


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RopeBlock(nn.Module):
    """A pre-norm block on ``(N, T, D)``: LayerNorm, attention with rotary embeddings on query and key (biases
    included), output projection, residual, LayerNorm, ReLU MLP, residual.

    ``style``: ``"rotate_half"`` (LLaMA / GPT-NeoX: pairs ``(i, i + hd/2)``, constant cos/sin buffers),
    ``"interleaved"`` (GPT-J: pairs ``(2i, 2i + 1)``), ``"partial"`` (the first half of each head rotated, the rest
    passed through), ``"inline"`` (HuggingFace: the tables computed in the forward from an ``inv_freq`` buffer and the
    positions ``arange(x.shape[1])``), ``"matmul"`` (rotate_half, then scores by ``q @ k.transpose(-2, -1)``),
    ``"tokens_first"`` (rotate_half on ``(N, T, H, hd)`` before the heads move to axis 1), ``"before_split"`` (GPT-J's
    pairs on ``(N, T, D)`` before the heads are split, the tables tiled over the heads: the same function as
    ``"interleaved"``), ``"across_heads"`` (rotate_half over the whole width on ``(N, T, D)``: its pairs
    ``(i, i + D/2)`` join features of different heads).
    """

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        rotated = HD // 2 if style == "partial" else HD
        freqs = 1.0 / (10000 ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated))
        self.register_buffer("inv_freq", freqs)
        angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
        if style in ("interleaved", "before_split"):
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        if style == "before_split":
            self.register_buffer("cos_d", angles.cos().repeat(1, H))
            self.register_buffer("sin_d", angles.sin().repeat(1, H))
        if style == "across_heads":
            wide = torch.outer(torch.arange(T, dtype=torch.float64), 1.0 / (10000 ** (torch.arange(0, D, 2,
                                                                                      dtype=torch.float64) / D)))
            wide = torch.cat((wide, wide), dim=-1)
            self.register_buffer("cos_d", wide.cos())
            self.register_buffer("sin_d", wide.sin())

    def rope(self, t):
        if self.style == "interleaved":
            turned = torch.stack((-t[..., 1::2], t[..., 0::2]), dim=-1).flatten(-2)
            return t * self.cos + turned * self.sin
        if self.style == "partial":
            r = HD // 2
            head, rest = t[..., :r], t[..., r:]
            return torch.cat((head * self.cos + _rotate_half(head) * self.sin, rest), dim=-1)
        if self.style == "inline":
            positions = torch.arange(t.shape[2], dtype=self.inv_freq.dtype, device=t.device)
            emb = torch.outer(positions, self.inv_freq)
            emb = torch.cat((emb, emb), dim=-1)
            return t * emb.cos() + _rotate_half(t) * emb.sin()
        return t * self.cos + _rotate_half(t) * self.sin

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        if self.style in ("before_split", "across_heads"):  # the map on (N, T, D), then the heads
            q, k, v = (m(h) for m in (self.q, self.k, self.v))
            if self.style == "before_split":
                q, k = ((u * self.cos_d + torch.stack((-u[..., 1::2], u[..., 0::2]), dim=-1).flatten(-2) * self.sin_d)
                        for u in (q, k))  # fmt: skip
            else:
                q, k = (u * self.cos_d + _rotate_half(u) * self.sin_d for u in (q, k))
            q, k, v = (u.view(b, t, H, HD).transpose(1, 2) for u in (q, k, v))
        elif self.style == "tokens_first":  # Meta's LLaMA and torchtune: the map on (N, T, H, hd), then the transpose
            q, k, v = (m(h).view(b, t, H, HD) for m in (self.q, self.k, self.v))
            cos, sin = self.cos[:, None, :], self.sin[:, None, :]
            q, k = (u * cos + _rotate_half(u) * sin for u in (q, k))
            q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        else:
            q, k, v = (m(h).view(b, t, H, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
            q, k = self.rope(q), self.rope(k)
        if self.style == "matmul":
            a = torch.softmax(q @ k.transpose(-2, -1) / HD**0.5, dim=-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.blocks = nn.Sequential(RopeBlock(style))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


STYLES = ["rotate_half", "interleaved", "partial", "inline", "matmul", "tokens_first", "before_split"]
PAIRS = {"interleaved": [(0, 1), (2, 3)], "partial": [(0, 1)], "before_split": [(0, 1), (2, 3)]}  # a head's pairs
FREE = {"partial": [2, 3]}  # features no rotation touches: GL among themselves


def classifier_case(build, width: int, seed: int = 0):
    """``build()`` in float64 eval mode with its parameters moved off the initialization, a cross-entropy loss and
    ``N`` random ``(T, width)`` samples with labels in 3 classes."""
    torch.manual_seed(seed)
    model = build().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, T, width, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))


def make(style: str, seed: int = 0):
    return classifier_case(lambda: Net(style), D, seed)


def _analyzed(block: nn.Module, samples: int = N):
    """``nn.Sequential(block)`` in float64 eval mode, ``samples`` random ``(T, D)`` inputs and its symmetry group."""
    torch.manual_seed(0)
    model = nn.Sequential(block).double().eval()
    x = torch.randn(samples, T, D, dtype=torch.float64)
    return model, x, manifolds.transformer_symmetry(model, x)


def _query_key(sym):
    return [f for f in sym.factors if "query/key" in f.label]


def _rotation(style: str, t: int) -> torch.Tensor:
    """The ``(HD, HD)`` map of position ``t`` on a row (``q_t -> q_t R_t``), built from the angles by hand."""
    pairs = PAIRS.get(style, [(i, i + HD // 2) for i in range(HD // 2)])
    r = torch.eye(HD, dtype=torch.float64)
    for (i, j), f in zip(pairs, FREQS if style != "partial" else FREQS[:1]):
        c, s = np.cos(t * float(f)), np.sin(t * float(f))
        r[i, i], r[j, j], r[i, j], r[j, i] = c, c, s, -s  # [x_i, x_j] -> [x_i c - x_j s, x_j c + x_i s]
    return r


@pytest.mark.parametrize("style", STYLES)
def test_the_query_key_factor_is_the_commutant_of_the_rotations(style):
    model, _, (x, _) = make(style)
    sym = manifolds.transformer_symmetry(model, x)
    qk = _query_key(sym)
    assert len(qk) == H, sym.describe()
    pairs = PAIRS.get(style, [(i, i + HD // 2) for i in range(HD // 2)])
    expected = 2 * len(pairs) + len(FREE.get(style, [])) ** 2
    rotations = [_rotation(style, t) for t in range(T)]
    for f in qk:
        assert f.algebra is not None and f.dim == expected, (f.dim, expected)
        basis = f._basis
        for r in rotations:  # every basis element commutes with every position's rotation
            assert torch.allclose(r @ basis, basis @ r, rtol=0, atol=1e-12)
        # and spans the whole commutant: the null space of Omega -> R Omega - Omega R, computed densely
        eye = torch.eye(HD, dtype=torch.float64)
        kron = torch.cat([torch.kron(r, eye) - torch.kron(eye, r.T.contiguous()) for r in rotations])
        assert HD * HD - int(torch.linalg.matrix_rank(kron)) == expected
    # the value/output factors stay the whole GL(hd)
    assert all(f.algebra is None and f.dim == HD * HD for f in sym.factors if "value/output" in f.label)


def _hand_element(model, style: str, g) -> dict:
    """Per head: ``A`` = ``a I + b J`` on each rotated pair (and a random invertible block on free features) moving the
    query rows by ``A^T`` and the key rows by ``A^-1``, and a random ``B`` on value/output."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    pairs = PAIRS.get(style, [(i, i + HD // 2) for i in range(HD // 2)])
    for h in range(H):
        a = torch.zeros(HD, HD, dtype=torch.float64)
        for i, j in pairs:
            s, r = torch.exp(torch.randn(1, generator=g, dtype=torch.float64)), float(torch.rand(1, generator=g))
            c, n = float(s * np.cos(6 * r)), float(s * np.sin(6 * r))
            a[i, i], a[j, j], a[i, j], a[j, i] = c, c, n, -n
        free = FREE.get(style, [])
        if free:
            block = torch.eye(len(free), dtype=torch.float64) + 0.4 * torch.randn(len(free), len(free), generator=g,
                                                                                   dtype=torch.float64)  # fmt: skip
            a[np.ix_(free, free)] = block
        b = torch.eye(HD, dtype=torch.float64) + 2 * torch.randn(HD, HD, generator=g, dtype=torch.float64)
        head = slice(h * HD, (h + 1) * HD)
        for name, m in (("q", a.T), ("k", torch.linalg.inv(a)), ("v", b.T)):
            for part in ("weight", "bias"):
                t = sd[f"blocks.0.{name}.{part}"].clone()
                t[head] = m @ t[head]
                sd[f"blocks.0.{name}.{part}"] = t
        w = sd["blocks.0.o.weight"].clone()
        w[:, head] = w[:, head] @ torch.linalg.inv(b).T
        sd["blocks.0.o.weight"] = w
    return sd


def _with(model, params):
    twin = copy.deepcopy(model)
    twin.load_state_dict(params, strict=False)
    return twin


@pytest.mark.parametrize("style", STYLES)
def test_random_and_hand_built_elements_keep_the_function_and_a_generic_gl_element_does_not(style):
    model, _, (x, _) = make(style)
    sym = manifolds.transformer_symmetry(model, x)
    with torch.no_grad():
        ref = model(x)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            assert (sym.transformed(model, sym.random_element(1.0, g))(x) - ref).abs().max() < 1e-10
        hand = _with(model, _hand_element(model, style, torch.Generator().manual_seed(2)))
        assert (hand(x) - ref).abs().max() < 1e-10
        # a generic A (not commuting with the rotations) on query/key changes the scores
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        a = torch.eye(HD, dtype=torch.float64) + 0.4 * torch.randn(HD, HD, generator=g, dtype=torch.float64)
        sd["blocks.0.q.weight"][:HD] = a.T @ sd["blocks.0.q.weight"][:HD]
        sd["blocks.0.q.bias"][:HD] = a.T @ sd["blocks.0.q.bias"][:HD]
        sd["blocks.0.k.weight"][:HD] = torch.linalg.inv(a) @ sd["blocks.0.k.weight"][:HD]
        sd["blocks.0.k.bias"][:HD] = torch.linalg.inv(a) @ sd["blocks.0.k.bias"][:HD]
        assert (_with(model, sd)(x) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("style", ["rotate_half", "partial", "before_split"])
def test_the_quotient_measure_equals_the_dense_reference(style):
    model, loss, data = make(style)
    sym = manifolds.transformer_symmetry(model, data[0])
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    value = measure_value(model, loss, data, k=2)
    assert np.allclose(value, reference[::-1][:2], rtol=1e-8, atol=0), (value, reference[::-1][:3])


@pytest.mark.parametrize("style", ["interleaved", "matmul"])
def test_the_quotient_measure_is_unchanged_under_the_group_while_euclidean_and_adaptive_move(style):
    model, loss, data = make(style)
    sym = manifolds.transformer_symmetry(model, data[0])
    before = measure_value(model, loss, data)[0]
    euclidean, adaptive = _euclidean(model, loss, data), _adaptive(model, loss, data)
    moved = [sym.transformed(model, sym.random_element(1.5, torch.Generator().manual_seed(5))),
             _with(model, _hand_element(model, style, torch.Generator().manual_seed(6)))]
    for i, twin in enumerate(moved):
        after = measure_value(twin, loss, data)[0]
        assert abs(after - before) <= 1e-8 * abs(before), (before, after)
        e = _euclidean(twin, loss, data)
        assert max(e, euclidean) / min(e, euclidean) > 1.5, (euclidean, e)
        if i == 0:  # the hand-built element moves the heads only, which adaptive sharpness weighs little here
            a = _adaptive(twin, loss, data)
            assert max(a, adaptive) / min(a, adaptive) > 1.5, (adaptive, a)


def type_as(a, b):
    """A user function with a cast's name (wrapped for fx, so it is one call in the graph): not a cast."""
    return torch.tanh(a).to(b.dtype)


torch.fx.wrap("type_as")


class Mapped(RopeBlock):
    """Something other than a constant position-wise linear map between the projections and attention."""

    def __init__(self, case: str):
        super().__init__("rotate_half")
        self.case = case
        if case == "a learned position scale":
            self.scale = nn.Parameter(torch.rand(T, 1, dtype=torch.float64) + 0.5)
        if case == "a complex value cast to real":
            angles = torch.outer(torch.arange(T, dtype=torch.float64), FREQS)
            self.register_buffer("fc", torch.polar(torch.ones_like(angles), angles))
        if case == "a table with an entry per sample":  # for batches of two samples (the test's example)
            self.register_buffer("per_sample", torch.tensor([1.0, 2.0]).reshape(2, 1, 1, 1))

    def rope(self, t):
        if self.case == "a scale per position":  # multiples of the identity: they say nothing about other positions
            return t * self.cos[:, :1]
        r = super().rope(t)
        if self.case == "a learned position scale":
            return r * self.scale
        if self.case == "a nonlinearity":
            return torch.tanh(r)
        if self.case == "a clamp no unit probe reaches":
            return r.clamp(-8.0, 8.0)
        if self.case == "an offset":
            return r + self.sin
        if self.case == "a mix of tokens":
            return r.cumsum(dim=2)
        if self.case == "a mix of tokens by linear operations":
            return r + torch.roll(r, 1, dims=2)
        if self.case == "a table with an entry per sample":
            return r * self.per_sample
        if self.case == "a cast to integers":
            return (4 * r).type(torch.int32).type_as(r)
        if self.case == "a user function named like a cast":
            return type_as(r, r)
        if self.case == "a table computed from the number of samples":  # the same for every sample of one batch
            return r * (1 + (r.shape[0] - 1) * torch.ones_like(self.cos))
        if self.case == "the number of samples from numel":
            return r * (1 + (r.numel() // (H * T * HD) - 1) * torch.ones_like(self.cos))
        if self.case == "the number of samples from a negative axis":
            return r * (1 + (r.shape[-4] - 2) * torch.ones_like(self.cos))
        if self.case == "a complex value cast to real":  # the real part of a rotation, rotated again
            c = torch.view_as_complex(r.reshape(*r.shape[:-1], -1, 2).contiguous()) * self.fc
            return torch.view_as_real(c.to(torch.float64) * self.fc).flatten(-2)
        return r.to(torch.bfloat16).tanh().to(t.dtype)  # "a cast around a nonlinearity"


MAPPED = {
    "a learned position scale": "computed from parameters",
    "a nonlinearity": "not known to be linear",
    "a clamp no unit probe reaches": "not known to be linear",
    "an offset": "not a linear map",
    "a mix of tokens": "not known to be linear",
    "a mix of tokens by linear operations": "not a linear map",
    "a table with an entry per sample": "differs from sample to sample",
    "a scale per position": "multiples of the identity",
    "a cast around a nonlinearity": "not known to be linear",
    "a cast to integers": "casts to torch.int32",
    "a user function named like a cast": "not known to be linear",
    "a table computed from the number of samples": "changes with the number of samples",
    "the number of samples from numel": "changes with the number of samples",
    "the number of samples from a negative axis": "changes with the number of samples",
}


@pytest.mark.parametrize("case", list(MAPPED))
def test_what_is_not_a_constant_position_map_pins_query_key(case):
    _, _, sym = _analyzed(Mapped(case), 2 if case == "a table with an entry per sample" else N)
    assert not _query_key(sym), sym.describe()
    reasons = [p.reason for p in sym.pins if "query/key" in p.where]
    assert reasons and MAPPED[case] in reasons[0], reasons
    assert sum(f.dim for f in sym.factors if "value/output" in f.label) == H * HD * HD  # value/output stay


def test_an_example_of_one_token_pins_rather_than_claiming_the_whole_gl():
    """At position 0 every rotation is the identity: the maps read say nothing about the positions beyond."""
    model, _, (x, _) = make("inline")  # tables built for the input's length
    sym = manifolds.transformer_symmetry(model, x[:, :1])
    assert not _query_key(sym)
    assert any("multiples of the identity" in p.reason for p in sym.pins), sym.describe()


class GroupedQuery(RopeBlock):
    """Grouped-query attention as HuggingFace's ``repeat_kv`` writes it: one key/value head expanded to both query
    heads after the rotary map."""

    def __init__(self):
        super().__init__("rotate_half")
        self.k, self.v = nn.Linear(D, HD), nn.Linear(D, HD)

    def repeat(self, k, v):
        """The key/value head read by both query heads (``repeat_kv``: an ``expand`` merged into the heads' axis)."""
        b, _, t, _ = k.shape
        return tuple(u[:, :, None].expand(b, 1, H, t, HD).reshape(b, H, t, HD) for u in (k, v))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k, v = (m(h).view(b, t, 1, HD).transpose(1, 2) for m in (self.k, self.v))
        q, k = self.rope(q), self.rope(k)
        a = self.attend(q, *self.repeat(k, v))
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


def test_grouped_query_attention_moves_each_key_and_value_head_with_the_query_heads_reading_it():
    """One key/value head read by both query heads: one query/key factor (``A`` moving both query heads' rows by
    ``A^T`` and the key head's by ``A^-1``, ``A`` commuting with the rotations) and one value/output factor (``B`` on
    the value head, ``B^-T`` on both heads' output columns). Checked with elements built by hand, and with elements
    that give the two query heads different matrices, which the repeated key cannot follow."""
    model, x, sym = _analyzed(GroupedQuery())
    (qk,) = _query_key(sym)
    (vo,) = [f for f in sym.factors if "value/output" in f.label]
    assert [(b.name, b.index, b.how) for b in qk.blocks if b.name.endswith("weight")] == [
        ("0.q.weight", tuple(range(HD)), "T"), ("0.q.weight", tuple(range(HD, 2 * HD)), "T"),
        ("0.k.weight", tuple(range(HD)), "inv")]  # fmt: skip
    assert qk.dim == HD and vo.dim == HD * HD, sym.describe()  # rotate_half's commutant: a I + b J per pair
    assert [(b.name, b.axis, b.index) for b in vo.blocks if b.name.endswith("weight")] == [
        ("0.v.weight", 0, tuple(range(HD))), ("0.o.weight", 1, tuple(range(HD))),
        ("0.o.weight", 1, tuple(range(HD, 2 * HD)))]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):
            assert (sym.transformed(model, sym.random_element(1.0, g))(x) - ref).abs().max() < 1e-10

    def moved(a_heads, b_heads):
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        for h, (a, b) in enumerate(zip(a_heads, b_heads)):
            rows = slice(h * HD, (h + 1) * HD)
            sd["0.q.weight"][rows], sd["0.q.bias"][rows] = a.T @ sd["0.q.weight"][rows], a.T @ sd["0.q.bias"][rows]
            sd["0.o.weight"][:, rows] = sd["0.o.weight"][:, rows] @ torch.linalg.inv(b).T
        a, b = a_heads[0], b_heads[0]
        sd["0.k.weight"], sd["0.k.bias"] = torch.linalg.inv(a) @ sd["0.k.weight"], torch.linalg.inv(a) @ sd["0.k.bias"]
        sd["0.v.weight"], sd["0.v.bias"] = b.T @ sd["0.v.weight"], b.T @ sd["0.v.bias"]
        with torch.no_grad():
            return float((_with(model, sd)(x) - ref).abs().max())

    def rotation_commutant():  # a I + b J on each pair (i, i + HD/2), built by hand
        a = torch.zeros(HD, HD, dtype=torch.float64)
        for i in range(HD // 2):
            c, n = (float(v) for v in torch.randn(2, generator=g, dtype=torch.float64))
            a[i, i], a[i + HD // 2, i + HD // 2], a[i, i + HD // 2], a[i + HD // 2, i] = c, c, n, -n
        return a

    a, b = rotation_commutant(), torch.eye(HD, dtype=torch.float64) + torch.randn(HD, HD, generator=g,
                                                                                    dtype=torch.float64)  # fmt: skip
    assert moved([a, a], [b, b]) < 1e-10
    assert moved([a, rotation_commutant()], [b, b]) > 1e-3  # the second query head moved by another matrix
    assert moved([a, a], [b, torch.eye(HD, dtype=torch.float64)]) > 1e-3  # the second head's columns left alone


class GroupedQuerySDPA(GroupedQuery):
    """The same attention with SDPA repeating the key/value head itself (``enable_gqa=True``)."""

    def repeat(self, k, v):
        return k, v

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class GroupedQueryCopied(GroupedQuery):
    """The key/value head copied for both query heads by ``repeat_interleave`` or by ``repeat`` (a copy, not a view)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def repeat(self, k, v):
        if self.how == "repeat_interleave":
            return torch.repeat_interleave(k, H, dim=1), v.repeat_interleave(H, dim=1)
        return k.repeat(1, H, 1, 1), v.repeat(1, H, 1, 1)


@pytest.mark.parametrize("twin_class", [GroupedQuerySDPA, lambda: GroupedQueryCopied("repeat_interleave"),
                                        lambda: GroupedQueryCopied("repeat")],
                         ids=["enable_gqa", "repeat_interleave", "repeat"])  # fmt: skip
def test_other_ways_of_repeating_key_value_heads_get_the_factors_of_repeat_kv(twin_class):
    model, x, sym = _analyzed(GroupedQuery())
    twin = nn.Sequential(twin_class()).double().eval()
    twin.load_state_dict(model.state_dict())
    twin_sym = manifolds.transformer_symmetry(twin, x)
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12  # the same function
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            element = twin_sym.random_element(1.0, g)
            assert (twin_sym.transformed(twin, element)(x) - twin(x)).abs().max() < 1e-10

    def blocks(s):
        return [[(b.name, b.axis, b.index, b.how) for b in f.blocks] for f in s.factors]

    assert blocks(twin_sym) == blocks(sym) and twin_sym.dim == sym.dim, twin_sym.describe()


class GroupedQueryNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(GroupedQuery())
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


def test_the_grouped_query_quotient_measure_equals_the_dense_reference_and_keeps_under_the_group():
    model, loss, data = classifier_case(GroupedQueryNet, D)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert len(_query_key(sym)) == 1, sym.describe()
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    value = measure_value(model, loss, data, k=2)
    assert np.allclose(value, reference[::-1][:2], rtol=1e-8, atol=0), (value, reference[::-1][:3])
    twin = sym.transformed(model, sym.random_element(1.5, torch.Generator().manual_seed(5)))
    after = measure_value(twin, loss, data)[0]
    assert abs(after - value[0]) <= 1e-8 * abs(value[0]), (value[0], after)
    e, e_twin = _euclidean(model, loss, data), _euclidean(twin, loss, data)
    assert max(e, e_twin) / min(e, e_twin) > 1.5, (e, e_twin)


def test_a_long_example_pins_rather_than_reading_huge_maps(monkeypatch):
    import manifolds._rotary as rotary

    monkeypatch.setattr(rotary, "MAX_MAP_ENTRIES", 10)
    model, _, (x, _) = make("rotate_half")
    sym = manifolds.transformer_symmetry(model, x)
    assert not _query_key(sym)
    assert any("pass a shorter example" in p.reason for p in sym.pins)


def test_elements_apply_to_a_bfloat16_model():
    """Inverses are taken in the element's dtype (float64): torch has none in bfloat16."""
    model, _, (x, _) = make("rotate_half")
    sym = manifolds.transformer_symmetry(model, x)
    element = sym.random_element(0.5, torch.Generator().manual_seed(0))
    low = sym.transformed(copy.deepcopy(model).bfloat16(), element)
    high = sym.transformed(model, element)
    with torch.no_grad():
        for (name, a), b in zip(low.named_parameters(), high.parameters()):
            assert torch.allclose(a.double(), b, rtol=1e-2, atol=1e-2 * float(b.abs().max())), name


class ComplexRope(RopeBlock):
    """Meta's LLaMA: pairs ``(2i, 2i + 1)`` read as complex numbers and multiplied by ``exp(i t theta_i)``, on
    ``(N, T, H, hd)`` before the heads move to axis 1."""

    def __init__(self):
        super().__init__("interleaved")
        angles = torch.outer(torch.arange(T, dtype=torch.float64), FREQS)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles)[:, None, :])

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, H, HD) for m in (self.q, self.k, self.v))
        q, k = (torch.view_as_real(torch.view_as_complex(u.reshape(b, t, H, -1, 2)) * self.freqs_cis).flatten(3)
                for u in (q, k))  # fmt: skip
        a = F.scaled_dot_product_attention(*(u.transpose(1, 2) for u in (q, k, v)))
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


def test_complex_rotary_embeddings_keep_the_commutant_of_their_rotations():
    model, x, sym = _analyzed(ComplexRope())
    qk = _query_key(sym)
    assert len(qk) == H and all(f.dim == HD for f in qk), sym.describe()
    rotations = [_rotation("interleaved", t) for t in range(T)]
    for f in qk:
        assert all(torch.allclose(r @ f._basis, f._basis @ r, rtol=0, atol=1e-12) for r in rotations)
    with torch.no_grad():
        twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
        assert (twin(x) - model(x)).abs().max() < 1e-10


class _RealPart(nn.Module):
    """Pairs read as complex numbers, rotated, cast to real (keeping the real part), rotated again."""

    def __init__(self):
        super().__init__()
        self.register_buffer("fc", torch.polar(torch.ones(3, 2, dtype=torch.float64), torch.rand(3, 2) * 3))

    def forward(self, t):  # t: (2, 3, 4) = (samples, tokens, features)
        c = torch.view_as_complex(t.reshape(2, 3, 2, 2)) * self.fc
        return torch.view_as_real(c.to(torch.float64) * self.fc).flatten(-2)


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
def test_a_complex_value_cast_to_real_is_read_as_the_projection_it_is():
    """``.to(float64)`` of a complex tensor keeps its real part: the maps read must reproduce the module, a projection
    followed by a rotation, not the two rotations alone."""
    from manifolds._rotary import Region, position_maps

    module = _RealPart()
    graph = torch.fx.symbolic_trace(module).graph
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    start = next(n for n in graph.nodes if n.op == "placeholder")
    constants = {n: module.fc for n in graph.nodes if n.op == "get_attr"}
    maps = position_maps(Region(start, nodes[-1], tuple(nodes)), (2, 3, 4), constants, module)
    z = torch.randn(2, 3, 4, dtype=torch.float64)
    assert torch.allclose(torch.einsum("nti,tij->ntj", z, maps), module(z), rtol=0, atol=1e-12)


class HuggingFaceStyle(RopeBlock):
    """HuggingFace's LLaMA attention: ``bsz, q_len, _ = x.size()``, tables from ``inv_freq`` and the positions,
    unsqueezed to ``(N, 1, T, hd)``, and ``repeat_kv`` with one key/value head per query head (an expand that
    repeats nothing)."""

    def __init__(self):
        super().__init__("rotate_half")

    def forward(self, x):
        bsz, q_len, _ = x.size()
        h = self.ln1(x)
        q, k, v = (m(h).view(bsz, q_len, H, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
        positions = torch.arange(q_len, dtype=self.inv_freq.dtype, device=x.device)
        emb = torch.outer(positions, self.inv_freq)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = (u[:, :, None, :, :].expand(bsz, H, 1, q_len, HD).reshape(bsz, H, q_len, HD) for u in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(bsz, q_len, D))


def test_huggingface_style_attention_keeps_both_factors():
    model, x, sym = _analyzed(HuggingFaceStyle())
    assert [f.dim for f in _query_key(sym)] == [HD] * H, sym.describe()
    assert [f.dim for f in sym.factors if "value/output" in f.label] == [HD * HD] * H
    with torch.no_grad():
        twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
        for inputs in (x, x[:3, :3]):
            assert (twin(inputs) - model(inputs)).abs().max() < 1e-10 * model(inputs).abs().max()


def test_a_map_before_the_heads_that_joins_two_heads_pins_query_key():
    """rotate_half over the whole width pairs feature ``i`` of one head with ``i + D/2`` of another: no per-head
    matrix commutes with that, so the query/key factor is pinned; value/output stay."""
    model, _, (x, _) = make("across_heads")
    sym = manifolds.transformer_symmetry(model, x)
    assert not _query_key(sym), sym.describe()
    assert any("mixes the features of different heads" in p.reason for p in sym.pins), sym.describe()
    assert sum(f.dim for f in sym.factors if "value/output" in f.label) == H * HD * HD
    with torch.no_grad():
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(3)))
        assert (moved(x) - model(x)).abs().max() < 1e-10


class ScaledLeak(RopeBlock):
    """``before_split`` rotary with head 0's features scaled by ``1e8`` (its query/key weights scaled down to match)
    and ``5e-5`` of head 1's features added into head 0's: next to the large entries the leak is far below any relative
    threshold, yet it moves the scores by ``5e-5``."""

    def __init__(self):
        super().__init__("before_split")
        self.register_buffer("scale", torch.cat((torch.full((HD,), 1e8), torch.ones(D - HD))))
        leak = torch.zeros(D, D)
        leak[HD : 2 * HD, :HD] = 5e-5 * torch.eye(HD)  # row vectors: out = u @ leak
        self.register_buffer("leak", leak)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h) for m in (self.q, self.k, self.v))
        turn = lambda u: torch.stack((-u[..., 1::2], u[..., 0::2]), dim=-1).flatten(-2)  # noqa: E731
        q, k = ((u * self.cos_d + turn(u) * self.sin_d) * self.scale + u @ self.leak for u in (q, k))
        q, k, v = (u.view(b, t, H, HD).transpose(1, 2) for u in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.o(a.transpose(1, 2).reshape(b, t, D))


def test_a_small_leak_between_heads_beside_large_entries_pins_query_key():
    model, x, sym = _analyzed(ScaledLeak())
    with torch.no_grad():
        for lin in (model[0].q, model[0].k):
            lin.weight[:HD] /= 1e8
            lin.bias[:HD] /= 1e8
    sym = manifolds.transformer_symmetry(model, x)
    assert not _query_key(sym), sym.describe()
    assert any("mixes the features of different heads" in p.reason for p in sym.pins), sym.describe()


class PrefixKept(RopeBlock):
    """timm's EVA attention: the first token (a class token) is not rotated (``cat`` of it and the rotated rest along
    the tokens), and the result is cast with ``.type_as(v)``, which reads only the value's dtype."""

    def __init__(self):
        super().__init__("rotate_half")

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, H, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
        cos, sin = self.cos[1:], self.sin[1:]
        q, k = (torch.cat([u[:, :, :1], u[:, :, 1:] * cos + _rotate_half(u[:, :, 1:]) * sin], dim=2).type_as(v)
                for u in (q, k))  # fmt: skip
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


def test_a_cast_to_the_value_s_dtype_and_an_unrotated_prefix_token_keep_the_rotary_factors():
    """``.type_as(v)`` reads the value's dtype, not its entries: the value keeps its factor and the rotary map its
    region (before, both pinned: the value was "read elsewhere"); the unrotated token's map is the identity, which
    every matrix commutes with, so the factor is the commutant of the other tokens' rotations."""
    model, x, sym = _analyzed(PrefixKept())
    qk = _query_key(sym)
    assert len(qk) == H and all(f.dim == HD for f in qk), sym.describe()  # a I + b J per rotated pair
    assert len([f for f in sym.factors if "value/output" in f.label]) == H, sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(3)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
