"""LayerScale (``y = h * gamma`` added to the residual stream, CaiT / DeiT III / timm's ``init_values``): the scale is
traded against the rows and bias of the layer that computes ``h``, also where that layer's columns are moved by the
value/output GL factors of attention (an output projection) or divided by ReLU units (an MLP's second layer).

Checked on tiny float64 blocks with references that share none of the library's code: outputs under hand-built and
random group elements, the metric's value under hand-built elements (moved with the point and the tangents), and the
measure against the dense generalized eigenproblem of `test_transformer_quotient`; and what is not traded says why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import token_classification
from test_transformer_quotient import _with as _moved
from test_transformer_quotient import assert_keeps_outputs, assert_quotient_matches_dense, measure_value
from torch import nn

import manifolds

D, H, HD, FF = 8, 2, 4, 12


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.drop = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Dropout(0.0)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(dim=-1) @ v
        return self.drop(self.proj(a.transpose(1, 2).reshape(b, t, D)))


class Block(nn.Module):
    """Pre-LayerNorm, attention and a ReLU MLP, each branch scaled by its own ``gamma`` before the residual sum."""

    def __init__(self, shared: bool = False, leak: bool = False):
        super().__init__()
        self.leak = leak
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.gamma1 = nn.Parameter(torch.full((D,), 0.5))
        self.gamma2 = self.gamma1 if shared else nn.Parameter(torch.full((D,), 0.5))

    def forward(self, x):
        h = self.attn(self.ln1(x))
        x = x + h * self.gamma1 + (h.mean(-1, keepdim=True) if self.leak else 0.0)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x)))) * self.gamma2


class Net(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.block, self.norm, self.head = Block(**options), nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.norm(self.block(x)).mean(dim=1))


def _make(seed: int = 0, **options):
    torch.manual_seed(seed)
    return token_classification(Net(**options), D, seed)


def _hand_element(model: Net, g: torch.Generator) -> dict:
    """``gamma1 * c``, ``proj`` rows and bias ``/ c``; ``gamma2 * d``, ``fc2`` rows and bias ``/ d``; per head ``B`` on
    the value rows of ``qkv`` and ``B^-T`` on ``proj``'s head columns; ReLU units ``u`` on ``fc1`` rows, ``fc2`` columns
    ``/ u``."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}

    def positive(k):
        return torch.exp(0.7 * torch.randn(k, generator=g, dtype=torch.float64))

    for gamma, layer in (("block.gamma1", "block.attn.proj"), ("block.gamma2", "block.fc2")):
        c = positive(D)
        sd[gamma] = sd[gamma] * c
        sd[f"{layer}.weight"], sd[f"{layer}.bias"] = sd[f"{layer}.weight"] / c[:, None], sd[f"{layer}.bias"] / c
    for h in range(H):
        b = torch.eye(HD, dtype=torch.float64) + 0.5 * torch.randn(HD, HD, generator=g, dtype=torch.float64)
        rows, cols = slice(2 * D + h * HD, 2 * D + (h + 1) * HD), slice(h * HD, (h + 1) * HD)
        for t in ("weight", "bias"):
            sd[f"block.attn.qkv.{t}"][rows] = b.T @ sd[f"block.attn.qkv.{t}"][rows]
        sd["block.attn.proj.weight"][:, cols] = sd["block.attn.proj.weight"][:, cols] @ torch.linalg.inv(b).T
    u = positive(FF)
    sd["block.fc1.weight"], sd["block.fc1.bias"] = sd["block.fc1.weight"] * u[:, None], sd["block.fc1.bias"] * u
    sd["block.fc2.weight"] = sd["block.fc2.weight"] / u
    return sd


def _layer_scales(sym) -> list[str]:
    return [f.label for f in sym.factors if f.label.startswith("layer scale")]


def test_both_layer_scales_are_traded_and_elements_keep_the_outputs():
    model, _, (x, _) = _make()
    sym = manifolds.transformer_symmetry(model, x)
    assert len(_layer_scales(sym)) == 2, sym.describe()
    moved = {b.name for f in sym.factors if f.label.startswith("layer scale") for b in f.blocks}
    assert moved == {"block.gamma1", "block.attn.proj.weight", "block.attn.proj.bias", "block.gamma2",
                     "block.fc2.weight", "block.fc2.bias"}  # fmt: skip
    # 2 heads x (query/key + value/output) GL(4), 3 LayerNorm trades (the last one through the mean), 2 layer scales,
    # the ReLU units
    assert sym.dim == 4 * HD * HD + 3 * D + 2 * D + FF, sym.describe()
    fresh = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    for twin in (_moved(model, _hand_element(model, g)), sym.transformed(model, sym.random_element(1.0, g))):
        with torch.no_grad():
            assert (twin(fresh) - model(fresh)).abs().max() < 1e-12


def test_the_metric_is_invariant_and_the_measure_equals_the_dense_reference():
    model, loss, data = _make()
    sym = manifolds.transformer_symmetry(model, data[0])
    g = torch.Generator().manual_seed(3)
    got, _ = assert_quotient_matches_dense(model, loss, data, sym, g)
    moved = _moved(model, _hand_element(model, g))
    assert np.allclose(measure_value(moved, loss, data, k=2), got, rtol=1e-8, atol=0)


def test_a_layer_output_read_elsewhere_or_a_shared_gamma_is_not_traded_and_says_why():
    model, _, (x, _) = _make(leak=True)  # proj's output also feeds a mean added to the residual stream
    sym = manifolds.transformer_symmetry(model, x)
    assert [label.split(" at ")[0] for label in _layer_scales(sym)] == ["layer scale 'block.gamma2'"], sym.describe()
    assert "elementwise scale cannot be traded: the scaled tensor is read elsewhere too" in sym.describe()
    model, _, (x, _) = _make(shared=True)  # one gamma for both branches: no trade may move it for one alone
    sym = manifolds.transformer_symmetry(model, x)
    assert _layer_scales(sym) == [], sym.describe()
    assert sym.describe().count("its layer scale cannot be traded: the parameter 'block.gamma") == 2, sym.describe()
    assert sym.describe().count("is also read elsewhere") == 2, sym.describe()
    for options in ({"leak": True}, {"shared": True}):  # what is found still holds
        model, _, (x, _) = _make(**options)
        sym = manifolds.transformer_symmetry(model, x)
        assert_keeps_outputs(model, sym, x, seed=4)


def test_a_zero_initialised_layer_scale_is_not_traded_and_the_measure_is_defined():
    """gamma = 0 (ReZero, adaLN-zero at initialization): the trade still keeps the outputs, but its metric (weights
    gamma^2) is undefined there; the factor is pinned with the reason and the measure is taken on the rest."""
    model, loss, data = _make()
    with torch.no_grad():
        model.block.gamma1.zero_()
    sym = manifolds.transformer_symmetry(model, data[0])
    assert [label.split(" at ")[0] for label in _layer_scales(sym)] == ["layer scale 'block.gamma2'"], sym.describe()
    assert "'block.gamma1' has 8 zero entries (a zero-initialised scale)" in sym.describe()
    value = measure_value(model, loss, data)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(5)))
    assert bool(torch.isfinite(value).all()) and np.allclose(measure_value(moved, loss, data), value, rtol=1e-8, atol=0)


class Conv1DBlock(nn.Module):
    """GPT-2's ``Conv1D`` (``addmm`` on the flattened tokens, viewed back) scaled by ``gamma`` into the residual."""

    def __init__(self):
        super().__init__()
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, 3)
        self.weight, self.bias = nn.Parameter(torch.randn(D, D)), nn.Parameter(torch.randn(D))
        self.gamma = nn.Parameter(torch.full((D,), 0.5))

    def forward(self, x):
        h = self.ln(x)
        h = torch.addmm(self.bias, h.view(-1, D), self.weight).view(x.shape)
        return self.head((x + h * self.gamma).mean(dim=1))


def test_a_conv1d_layer_viewed_back_takes_the_trade_on_its_stored_columns():
    torch.manual_seed(0)
    model = Conv1DBlock().double().eval()
    x = torch.randn(5, 4, D, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    (factor,) = [f for f in sym.factors if f.label.startswith("layer scale")]
    weight = next(b for b in factor.blocks if b.name == "weight")
    assert weight.transposed and weight.stored_axis == 1, sym.describe()  # W stored (in, out): its columns move
    assert_keeps_outputs(model, sym, x, seed=6)


class MHABlock(nn.Module):
    """A pre-LN block whose attention is ``nn.MultiheadAttention`` (its ``out_proj`` inside the module), scaled by a
    LayerScale ``gamma`` before the residual sum; ``weights``: the attention weights are returned too (and unread)."""

    def __init__(self, weights: bool = False):
        super().__init__()
        self.weights = weights
        self.ln, self.attn = nn.LayerNorm(D), nn.MultiheadAttention(D, 2, batch_first=True)
        self.gamma, self.head = nn.Parameter(torch.rand(D) + 0.5), nn.Linear(D, 3)

    def forward(self, x):
        h = self.ln(x)
        out = self.attn(h, h, h, need_weights=self.weights)[0]
        return self.head((x + out * self.gamma).mean(1))


def test_a_layer_scale_on_multihead_attention_trades_against_its_output_projection_s_rows():
    """``gamma * c`` with ``out_proj``'s rows and bias ``/ c``: by hand and by random elements, the metric's invariance
    and the measure against the dense quotient reference (``out_proj``'s columns are moved by the value/output
    factors too). Before, the scale was pinned: it is read by the residual sum."""
    for weights in (False, True):
        model, loss, data = token_classification(MHABlock(weights), D)
        sym = manifolds.transformer_symmetry(model, data[0])
        (factor,) = [f for f in sym.factors if f.label.startswith("layer scale")]
        assert {(b.name, b.axis, b.how) for b in factor.blocks} == {
            ("gamma", 0, "T"), ("attn.out_proj.weight", 0, "inv"), ("attn.out_proj.bias", 0, "inv")}, sym.describe()
        c = torch.exp(torch.randn(D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        sd["gamma"], sd["attn.out_proj.bias"] = sd["gamma"] * c, sd["attn.out_proj.bias"] / c
        sd["attn.out_proj.weight"] = sd["attn.out_proj.weight"] / c[:, None]
        with torch.no_grad():
            assert (_moved(model, sd)(data[0]) - model(data[0])).abs().max() < 1e-12
        assert_keeps_outputs(model, sym, data[0], seed=2)
    got, element = assert_quotient_matches_dense(model, loss, data, sym, torch.Generator().manual_seed(3))
    moved = sym.transformed(model, element)
    assert np.allclose(measure_value(moved, loss, data, k=2), got, rtol=1e-8, atol=0)


class MHAOutProjCalled(MHABlock):
    """The attention's ``out_proj`` also called on its own: its rows are read there, so no layer scale trades them."""

    def forward(self, x):
        h = self.ln(x)
        y = x + self.attn(h, h, h, need_weights=False)[0] * self.gamma
        return self.head((y + self.attn.out_proj(x)).mean(1))


def test_a_multihead_attention_whose_out_proj_is_also_called_alone_keeps_its_layer_scale_pinned():
    model, _, (x, _) = token_classification(MHAOutProjCalled(), D)
    sym = manifolds.transformer_symmetry(model, x)
    assert not [f for f in sym.factors if f.label.startswith("layer scale")], sym.describe()
    assert_keeps_outputs(model, sym, x, seed=4)


class MHAReadTwice(MHABlock):
    """The attention's output read twice: scaled (``how="twice"``: by two ``[0]`` of one call) or once scaled and once
    as it is through ``out_proj``'s weight used outside the module (``how="shared"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        h = self.ln(x)
        r = self.attn(h, h, h, need_weights=False)
        if self.how == "twice":
            return self.head((x + r[0] * self.gamma + r[0]).mean(1))
        extra = torch.nn.functional.linear(x, self.attn.out_proj.weight, self.attn.out_proj.bias)
        return self.head((x + r[0] * self.gamma + extra).mean(1))


@pytest.mark.parametrize("how", ["twice", "shared"])
def test_a_multihead_attention_output_read_unscaled_too_keeps_its_layer_scale_pinned(how):
    """Before: two reads claimed the trade (logits moved by 2.5); a shared out_proj raised an internal error."""
    model, _, (x, _) = token_classification(MHAReadTwice(how), D)
    sym = manifolds.transformer_symmetry(model, x)
    assert not [f for f in sym.factors if f.label.startswith("layer scale")], sym.describe()
    assert_keeps_outputs(model, sym, x, seed=5)
