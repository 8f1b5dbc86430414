"""A projection's bias put together in the forward (timm's BEiT, EVA-02 and its rotary ViTs): one bias-free ``qkv``
Linear whose weight is read directly, ``F.linear(input=x, weight=qkv.weight, bias=torch.cat((q_bias, k_bias,
v_bias)))``, the key's bias a buffer of zeros. The query and value biases are parameters the attention's GL factors
move with their rows. The key's is not read by the output at all (`test_key_bias`), so no factor moves it; a buffer
piece a factor would have to move must be zero there, which stays zero (``B^T 0 = 0``).

Checked on a tiny float64 block with references that share none of the library's code: outputs and the measure under
a hand-built element, the measure against the dense generalized eigenproblem of `test_transformer_quotient`, products
against autograd's; and where the pieces cannot be moved, the pin says why.
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
from sharpness import Objective, euclidean_sharpness

D, H, HD, FF = 8, 2, 4, 12


class Attention(nn.Module):
    """BEiT's attention: the bias of the bias-free ``qkv`` Linear concatenated from pieces in the forward."""

    def __init__(
        self,
        key_bias: str = "zero",
        pieces: tuple[int, ...] = (D, D, D),
        read_twice: bool = False,
        value_buffer: bool = False,
    ):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.key_bias, self.read_twice = key_bias, read_twice
        if pieces == (D, D, D):
            self.q_bias = nn.Parameter(torch.randn(D))
            if value_buffer:  # a fixed value bias, which the value/output factors would have to move
                self.register_buffer("v_bias", torch.ones(D), persistent=False)
            else:
                self.v_bias = nn.Parameter(torch.randn(D))
            self.register_buffer("k_bias", torch.zeros(D) if key_bias == "zero" else torch.ones(D), persistent=False)
            self.pieces = None
        else:  # parameters cut across the heads' rows
            self.pieces = nn.ParameterList([nn.Parameter(torch.randn(n)) for n in pieces])

    def forward(self, x):
        b, t, _ = x.shape
        if self.pieces is None:
            bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        else:
            bias = torch.cat(tuple(self.pieces))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=bias)
        q, k, v = qkv.reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))
        return out + bias.sum() if self.read_twice else out


class Net(nn.Module):
    """One pre-LayerNorm block (attention, ReLU MLP) and a head on the tokens' mean."""

    def __init__(self, **options):
        super().__init__()
        self.ln1, self.ln2, self.norm = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.fc1, self.fc2, self.head = (
            Attention(**options),
            nn.Linear(D, FF),
            nn.Linear(FF, D),
            nn.Linear(D, 3),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        return self.head(self.norm(x).mean(dim=1))


def _make(**options):
    torch.manual_seed(0)
    return token_classification(Net(**options), D)


def _attention(sym) -> list:
    return [f for f in sym.factors if f.label.startswith("attention at")]


def _hand_element(model, g) -> dict:
    """Per head ``A`` on query/key and ``B`` on value/output, written on the state dict: the rows of ``qkv.weight``
    and of the query and value biases, and the output projection's columns."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    weight, proj = sd["attn.qkv.weight"].clone(), sd["attn.proj.weight"].clone()
    for h in range(H):
        # far from the identity, so that Euclidean sharpness moves
        a, b = (
            c * (torch.eye(HD, dtype=torch.float64) + 0.5 * torch.randn(HD, HD, generator=g, dtype=torch.float64))
            for c in (4.0, 0.25)
        )
        head = slice(h * HD, (h + 1) * HD)
        for role, m in enumerate((a.T, torch.linalg.inv(a), b.T)):
            rows = slice(role * D + h * HD, role * D + (h + 1) * HD)
            weight[rows] = m @ weight[rows]
        sd["attn.q_bias"][head] = a.T @ sd["attn.q_bias"][head]
        sd["attn.v_bias"][head] = b.T @ sd["attn.v_bias"][head]
        proj[:, head] = proj[:, head] @ torch.linalg.inv(b).T
    sd["attn.qkv.weight"], sd["attn.proj.weight"] = weight, proj
    return sd


def test_the_query_and_value_pieces_move_with_their_rows_and_the_zero_key_bias_stays():
    model, loss, data = _make()
    sym = manifolds.transformer_symmetry(model, data[0])
    factors = _attention(sym)
    assert len(factors) == 2 * H, sym.describe()
    blocks = {(b.name, tuple(b.index)) for f in factors for b in f.blocks if b.name.endswith("_bias")}
    assert blocks == {(f"attn.{r}_bias", tuple(range(h * HD, (h + 1) * HD))) for r in "qv" for h in range(H)}
    # the LayerNorm before it trades its scale against the columns of the weight read directly
    (ln1,) = [f for f in sym.factors if "'ln1'" in f.label]
    assert {b.name for b in ln1.blocks} == {"ln1.weight", "ln1.bias", "attn.qkv.weight"}
    assert "attention" not in sym.describe().partition("pinned:")[2], sym.describe()
    assert_keeps_outputs(model, sym, data[0], seed=1)


def test_a_hand_built_element_keeps_the_outputs_and_the_measure_while_euclidean_sharpness_moves():
    model, loss, data = _make()
    twin = _moved(model, _hand_element(model, torch.Generator().manual_seed(2)))
    fresh = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        assert (twin(fresh) - model(fresh)).abs().max() < 1e-12
    assert np.allclose(measure_value(twin, loss, data, k=2), measure_value(model, loss, data, k=2), rtol=1e-8, atol=0)
    euclidean = [euclidean_sharpness(m, loss, data, dtype=torch.float64, progress=False).value for m in (model, twin)]
    assert euclidean[1] / euclidean[0] > 10, euclidean


def test_the_measure_equals_the_dense_reference():
    model, loss, data = _make()
    sym = manifolds.transformer_symmetry(model, data[0])
    assert_quotient_matches_dense(model, loss, data, sym, torch.Generator().manual_seed(4))


@pytest.mark.parametrize("options,pinned,why", [
    ({"value_buffer": True}, "value/output", "holds the buffer 'attn.v_bias', nonzero at rows a factor would move"),
    ({"pieces": (6, 18)}, "query/key", "the rows one factor moves span two pieces of the bias"),
    ({"read_twice": True}, "query/key", "is also read elsewhere"),
])  # fmt: skip
def test_pieces_that_cannot_move_with_the_rows_pin_with_the_reason(options, pinned, why):
    model, _, (x, _) = _make(**options)
    sym = manifolds.transformer_symmetry(model, x)
    assert not [f for f in _attention(sym) if pinned in f.label], sym.describe()
    assert why in sym.describe(), sym.describe()
    assert_keeps_outputs(model, sym, x, seed=5)


def test_a_nonzero_value_buffer_keeps_the_query_key_factors():
    model, _, (x, _) = _make(value_buffer=True)
    assert len([f for f in _attention(manifolds.transformer_symmetry(model, x)) if "query/key" in f.label]) == H


@pytest.mark.parametrize("options", [{}, {"pieces": (6, 18)}])
def test_the_r_operator_reads_the_keyword_call_and_the_concatenated_bias(options):
    model, loss, data = _make(**options)
    obj = Objective(model, loss, data, dtype=torch.float64)
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    assert torch.allclose(obj.hvp(v, "rop"), reference, rtol=0, atol=1e-12 * float(reference.abs().max()))
