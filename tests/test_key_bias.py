"""The key bias of attention is not read by its output: ``b_k -> b_k + u`` adds ``q . u`` to every score of query
``q``, a shift the softmax over the keys ignores. The network's function is unchanged, so invariant sharpness must be
too: the query/key factors leave the key bias unmoved (``q' . k' = q . k + q . A b_k`` is again such a shift), so
neither the metric nor the measure depends on it. Where something else reads the key (a position map, an appended
key of zeros, scores read elsewhere, a softmax over the queries), the bias is read, a shift of it moves the outputs,
and it moves with the factor as before.

The shifts are written by hand on the state dict and the measure compared before and after (1e-8). Euclidean and
adaptive sharpness cannot see such a shift (the loss does not depend on the bias); the measure could while the factors
moved the key bias and weighed it in the metric (10.60 -> 11.75 on ``hand_pre``, 58.2 -> 73.1 on ``mha_pre``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import moved_copy, token_classification
from test_concatenated_bias import Net as ConcatenatedNet
from test_einsum_attention import make as make_einsum
from test_rotary_symmetry import RopeBlock
from test_transformer_quotient import CASES, D, make, measure_value
from torch import nn

import manifolds

H = 2


def _key_biases(model: nn.Module) -> list[tuple[str, slice]]:
    """Where ``model`` keeps its key biases: ``(parameter name, entries)``."""
    found = []
    for name, _ in model.named_parameters():
        if name.endswith("k.bias"):
            found.append((name, slice(None)))
        elif name.endswith(("in_proj_bias", "qkv.bias")):
            found.append((name, slice(D, 2 * D)))
    return found


def _shifted(model: nn.Module, seed: int, scale: float = 3.0) -> nn.Module:
    """Every key bias moved by ``scale N(0, 1)`` per entry."""

    def move(params, g):
        for name, where in _key_biases(model):
            part = params[name][where]
            part.add_(scale * torch.randn(part.shape, generator=g, dtype=part.dtype))

    return moved_copy(model, seed, move)


@pytest.mark.parametrize("name", list(CASES))
def test_a_shift_of_the_key_bias_keeps_the_outputs_and_the_measure(name):
    model, loss, data = make(name)
    twin = _shifted(model, seed=1)
    with torch.no_grad():
        assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
        assert max((a - b).abs().max() for a, b in zip(twin.parameters(), model.parameters())) > 1.0
    before, after = measure_value(model, loss, data, k=2), measure_value(twin, loss, data, k=2)
    assert np.allclose(after, before, rtol=1e-8, atol=0), (before, after)
    sym = manifolds.transformer_symmetry(model, data[0])
    keys = dict(_key_biases(model))  # a packed bias: its key rows start at D
    key_rows = [b for f in sym.factors if "query/key" in f.label for b in f.blocks
                if b.name in keys and (keys[b.name] == slice(None) or b.index[0] >= D)]  # fmt: skip
    assert key_rows == [], key_rows
    assert all("unmoved, since the softmax" in f.label for f in sym.factors if "query/key" in f.label), sym.describe()


def test_scores_stored_transposed_by_an_einsum_leave_the_key_bias_unmoved_too():
    """``bhid,bhjd->bhji``: the softmax is over axis -2, where the product's transpose put the keys."""
    model, x = make_einsum("scores_transposed")
    sym = manifolds.transformer_symmetry(model, x)
    qk = [f for f in sym.factors if "query/key" in f.label]
    assert qk and all("the bias 'k.bias' unmoved" in f.label for f in qk), sym.describe()
    assert not any(b.name == "k.bias" for f in qk for b in f.blocks)


class Hand(nn.Module):
    """Attention by hand whose key bias the output reads: a softmax over the queries, the scores also added to the
    output, masked scores filled with a finite number (which a shift of the others does not move), the bias also
    added to the output; or does not read: the scores transposed to ``(keys, queries)`` before a softmax over the
    keys, masked with ``-inf`` (``masked_fill``, ``torch.where``) or a constant added."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 3)
        self.register_buffer("causal", torch.ones(4, 4).tril().bool())
        self.register_buffer("offset", torch.randn(4, 4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        s = q @ k.transpose(-2, -1)
        s = {"masked_fill 0": lambda: s.masked_fill(~self.causal, 0.0),
             "where -2": lambda: torch.where(self.causal, s, torch.tensor(-2.0, dtype=s.dtype)),
             "masked_fill -inf": lambda: s.masked_fill(~self.causal, float("-inf")),
             "where -inf": lambda: torch.where(self.causal, s, torch.tensor(float("-inf"), dtype=s.dtype)),
             "offset": lambda: s + self.offset}.get(self.how, lambda: s)()  # fmt: skip
        if self.how == "bias read":
            v = v + self.k.bias.view(1, H, 1, D // H)
        if self.how == "transposed":
            a = (s.transpose(-1, -2) * 0.5).softmax(dim=-2).transpose(-2, -1) @ v
        else:
            a = s.softmax(dim=-2 if self.how == "over queries" else -1) @ v
        out = self.o(a.transpose(1, 2).reshape(b, t, D))
        if self.how == "scores read":
            out = out + s.mean(dim=(1, 3))[..., None]
        return self.head(torch.tanh(out[:, 0]))  # (a mean over the tokens would undo a softmax over them)


def test_the_key_bias_read_by_the_output_itself_is_not_claimed_unread():
    torch.manual_seed(0)
    model, _, (x, _) = token_classification(Hand("bias read"), D)
    sym = manifolds.transformer_symmetry(model, x)
    assert not [f for f in sym.factors if "query/key" in f.label], sym.describe()
    assert "the parameter 'k.bias' is also read outside its module" in sym.describe(), sym.describe()


@pytest.mark.parametrize("how", ["transposed", "masked_fill -inf", "where -inf", "offset"])
def test_scores_transposed_masked_or_offset_before_the_softmax_leave_the_key_bias_unmoved(how):
    torch.manual_seed(0)
    model, loss, data = token_classification(Hand(how), D)
    x = data[0]
    with torch.no_grad():
        assert (_shifted(model, seed=2)(x) - model(x)).abs().max() < 1e-12
    sym = manifolds.transformer_symmetry(model, x)
    qk = [f for f in sym.factors if "query/key" in f.label]
    assert len(qk) == H and all("the bias 'k.bias' unmoved" in f.label for f in qk), sym.describe()
    assert {b.name for f in qk for b in f.blocks} == {"q.weight", "q.bias", "k.weight"}
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(3)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    before = measure_value(model, loss, data, k=2)
    for moved in (twin, _shifted(model, seed=4)):
        assert np.allclose(measure_value(moved, loss, data, k=2), before, rtol=1e-8, atol=0)


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = RopeBlock("rotate_half"), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.block(x).mean(dim=1))


class ZeroKey(nn.Module):
    """``nn.MultiheadAttention(add_zero_attn=True)``: a key of zeros appended after the projection, which a shift of
    the key bias does not reach."""

    def __init__(self):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(D, H, batch_first=True, add_zero_attn=True), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(dim=1))


READ = {
    "softmax over the queries": lambda: Hand("over queries"),
    "scores read elsewhere": lambda: Hand("scores read"),
    "masked_fill with 0": lambda: Hand("masked_fill 0"),
    "torch.where with -2": lambda: Hand("where -2"),
    "rotary position map on the key": Rotary,
    "add_zero_attn": ZeroKey,
}


@pytest.mark.parametrize("name", list(READ))
def test_where_the_output_reads_the_key_bias_it_moves_with_the_factor(name):
    torch.manual_seed(0)
    model, _, (x, _) = token_classification(READ[name](), D)
    with torch.no_grad():
        assert (_shifted(model, seed=2)(x) - model(x)).abs().max() > 1e-3  # the bias is read
    sym = manifolds.transformer_symmetry(model, x)
    qk = [f for f in sym.factors if "query/key" in f.label]
    assert len(qk) == H and not any("k.bias' unmoved" in f.label or "in_proj_bias" in f.label for f in qk), \
        sym.describe()  # fmt: skip
    assert all(any(b.name.endswith(("k.bias", "in_proj_bias")) for b in f.blocks) for f in qk), sym.describe()
    if name == "softmax over the queries":  # the softmax runs along the queries' rows: theirs is the unread bias
        assert all("the bias 'q.bias' unmoved" in f.label for f in qk), sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(3)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12


def test_a_concatenated_key_buffer_that_is_not_zero_is_not_read_either():
    """BEiT's layout with a key bias buffer of ones: the buffer is as unread as a parameter would be, so the
    query/key factors stand (with a zero buffer they did already)."""
    torch.manual_seed(0)
    model, _, (x, _) = token_classification(ConcatenatedNet(key_bias="ones"), D)
    sym = manifolds.transformer_symmetry(model, x)
    assert len([f for f in sym.factors if "query/key" in f.label]) == H, sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(4)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    with torch.no_grad():
        before = model(x)
        model.attn.k_bias.normal_()  # any key bias gives the same function
        assert (model(x) - before).abs().max() < 1e-12
