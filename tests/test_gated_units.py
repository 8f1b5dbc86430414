"""Gated units (LLaMA's SwiGLU ``w2(silu(w1 x) * w3 x)``): the units of ``w3`` are free, ``w3``'s rows times ``c`` and
``w2``'s columns divided by ``c``, since ``(c h) g = c (h g)`` for a gate ``g`` computed without ``h``; ``w1`` is pinned
(SiLU is not positively homogeneous), and so is a product whose other factor reads ``h`` itself.

Checked on tiny float64 token models against hand-built elements, the dense quotient spectrum of
`test_transformer_quotient`, and the measure's value under random elements while Euclidean sharpness moves.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_rotary_symmetry import classifier_case
from test_transformer_quotient import _euclidean, dense_quotient_spectrum, measure_value
from torch import nn

import manifolds

D, HID, T, N = 4, 6, 3, 5


class Gated(nn.Module):
    """``LayerNorm``, a gated MLP ``w2(gate(w1 x) * w3 x)`` on ``(N, T, D)`` with a residual sum, mean over tokens and a
    linear head. ``gate`` is SiLU (SwiGLU); ``case`` changes the product for the pinned cases."""

    def __init__(self, case: str = "swiglu"):
        super().__init__()
        self.case = case
        self.norm = nn.LayerNorm(D)
        self.w1, self.w3 = nn.Linear(D, HID), nn.Linear(D, HID)
        self.w2 = nn.Linear(HID, D)
        self.w4 = nn.Linear(D, 1)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.norm(x)
        up = self.w3(h)
        if self.case == "swiglu":
            inner = F.silu(self.w1(h)) * up
        elif self.case == "a square":
            inner = up * up
        elif self.case == "a gate read from the unit itself":
            inner = torch.sigmoid(up) * up
        else:  # "a broadcast unit": one unit's output scales every feature of the gate
            inner = F.silu(self.w1(h)) * self.w4(h)
        return self.head((x + self.w2(inner)).mean(dim=1))


def make(case: str = "swiglu", seed: int = 0):
    return classifier_case(lambda: Gated(case), D, seed)


def _units(sym, name):
    return [f for f in sym.factors if f.label.startswith(f"units of module '{name}'")]


def _hand(model, g) -> nn.Module:
    c = torch.exp(2 * torch.randn(HID, generator=g, dtype=torch.float64))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.w3.weight.mul_(c[:, None])
        twin.w3.bias.mul_(c)
        twin.w2.weight.div_(c)
    return twin


def test_the_units_of_the_gated_linear_are_free_and_the_gate_s_are_pinned():
    model, _, (x, _) = make()
    sym = manifolds.transformer_symmetry(model, x)
    (units,) = _units(sym, "w3")
    assert units.dim == HID
    assert {(b.name, b.axis) for b in units.blocks} == {("w3.weight", 0), ("w3.bias", 0), ("w2.weight", 1)}
    assert not _units(sym, "w1")
    assert any("'w1'" in p.where and "not positively homogeneous" in p.reason for p in sym.pins), sym.describe()
    with torch.no_grad():
        ref = model(x)
        assert (_hand(model, torch.Generator().manual_seed(1))(x) - ref).abs().max() < 1e-12
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            assert (sym.transformed(model, sym.random_element(1.0, g))(x) - ref).abs().max() < 1e-12


@pytest.mark.parametrize("case", ["a square", "a gate read from the unit itself", "a broadcast unit"])
def test_products_that_are_no_gate_pin(case):
    model, _, (x, _) = make(case)
    sym = manifolds.transformer_symmetry(model, x)
    assert not _units(sym, "w3") and not _units(sym, "w4"), sym.describe()
    if case != "a broadcast unit":  # the scaling a gate would allow changes these functions
        with torch.no_grad():
            assert (_hand(model, torch.Generator().manual_seed(1))(x) - model(x)).abs().max() > 1e-3


def test_the_quotient_measure_equals_the_dense_reference_and_ignores_the_gated_units():
    model, loss, data = make()
    sym = manifolds.transformer_symmetry(model, data[0])
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    before = measure_value(model, loss, data, k=2)
    assert np.allclose(before, reference[::-1][:2], rtol=1e-8, atol=0), (before, reference[::-1][:3])
    euclidean = _euclidean(model, loss, data)
    twin = _hand(model, torch.Generator().manual_seed(3))
    after = measure_value(twin, loss, data, k=2)
    assert np.allclose(after, before, rtol=1e-8, atol=0), (before, after)
    e = _euclidean(twin, loss, data)
    assert max(e, euclidean) / min(e, euclidean) > 1.5, (euclidean, e)


class AliasedGate(nn.Module):
    """``gate *= up`` in place while an alias of the gate is read later: fx records a new product, but in eager code the
    alias holds ``gate * up`` and would scale with ``w3``'s units (on samples where ``relu(saved - 2)`` is not zero)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2, self.w6 = nn.Linear(D, HID), nn.Linear(D, HID), nn.Linear(HID, D), nn.Linear(HID, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        up = self.w3(x)
        gate = F.silu(self.w1(x))
        saved = gate
        gate *= up
        return self.head((x + self.w2(gate) + self.w6(F.relu(saved - 2.0))).mean(dim=1))


def test_a_gate_read_elsewhere_pins_the_units():
    torch.manual_seed(0)
    model = AliasedGate().double().eval()
    x = torch.randn(N, T, D, dtype=torch.float64)
    x[:2] *= 0.05  # the two samples the trace check runs on leave the alias's reader at zero: the check passes
    x[2:] *= 20.0
    sym = manifolds.transformer_symmetry(model, x)
    assert not _units(sym, "w3") and not _units(sym, "w1"), sym.describe()


class ReGLU(nn.Module):
    """``w2(relu(w1 h) * w3 h)``: both sides are homogeneous in their own units, and both would divide ``w2``'s
    columns; one factor keeps them (the metric weighs a column by one factor)."""

    def __init__(self, bilinear: bool = False):
        super().__init__()
        self.bilinear = bilinear
        self.norm = nn.LayerNorm(D)
        self.w1, self.w3, self.w2, self.head = nn.Linear(D, HID), nn.Linear(D, HID), nn.Linear(HID, D), nn.Linear(D, 3)

    def forward(self, x):
        h = self.norm(x)
        a = self.w1(h) if self.bilinear else F.relu(self.w1(h))
        return self.head((x + self.w2(a * self.w3(h))).mean(dim=1))


@pytest.mark.parametrize("bilinear", [False, True])
def test_two_homogeneous_sides_of_a_product_keep_one_units_factor_and_the_measure_runs(bilinear):
    model, loss, data = classifier_case(lambda: ReGLU(bilinear), D)
    x = data[0]
    sym = manifolds.transformer_symmetry(model, x)
    assert len(_units(sym, "w1")) == 1 and not _units(sym, "w3"), sym.describe()
    assert any("'w3'" in p.where and "two factors" in p.reason for p in sym.pins)
    before = measure_value(model, loss, data)
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(1)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    assert np.allclose(measure_value(twin, loss, data), before, rtol=1e-8, atol=0)


class Fused(nn.Module):
    """Phi-3's gated MLP: one Linear for the gate and the unit, cut along its features (``chunk``, or ``split`` into
    the sizes of the two halves), ``w2(up * silu(gate))``; ``case`` ``"a gate from the same half"`` reads the unit's
    own half for the gate, ``"a cut along the tokens"`` cuts the tokens instead."""

    def __init__(self, case: str = "chunk"):
        super().__init__()
        self.case = case
        self.norm, self.w13 = nn.LayerNorm(D), nn.Linear(D, 2 * HID)
        self.w2, self.head = nn.Linear(HID, D), nn.Linear(D, 3)

    def forward(self, x):
        both = self.w13(self.norm(x))
        if self.case == "split":
            gate, up = both.split([HID, HID], dim=-1)
        elif self.case == "a cut along the tokens":
            gate, up = both[..., :HID].chunk(2, dim=1)[0], both[..., HID:]
            up = up[:, : gate.shape[1]]
        else:
            gate, up = both.chunk(2, dim=-1)
        if self.case == "a gate from the same half":
            gate = up
        inner = up * F.silu(gate)
        return self.head((x[:, : inner.shape[1]] + self.w2(inner)).mean(dim=1))


@pytest.mark.parametrize("case", ["chunk", "split"])
def test_the_unit_half_of_a_fused_gate_and_up_projection_is_free(case):
    """``w13``'s rows ``HID:2 HID`` (the unit) times ``c`` with ``w2``'s columns over ``c``; the gate's half is pinned
    by SiLU. By hand, and by random elements."""
    model, loss, (x, y) = classifier_case(lambda: Fused(case), D, 0)
    sym = manifolds.transformer_symmetry(model, x)
    (units,) = _units(sym, "w13")
    assert {(b.name, b.axis, b.index) for b in units.blocks} >= {("w13.weight", 0, tuple(range(HID, 2 * HID))),
                                                                  ("w2.weight", 1, tuple(range(HID)))}, sym.describe()
    assert "rows 0:6" in sym.describe() and "'silu'" in sym.describe()
    c = torch.exp(torch.randn(HID, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.w13.weight[HID:] *= c[:, None]
        twin.w13.bias[HID:] *= c
        twin.w2.weight /= c
        assert (twin(x) - model(x)).abs().max() < 1e-12
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(2)))
        assert (moved(x) - model(x)).abs().max() < 1e-12


@pytest.mark.parametrize("case", ["a gate from the same half", "a cut along the tokens"])
def test_a_fused_projection_s_unit_half_is_pinned_where_it_is_not_gated_by_the_other_half(case):
    model, _, (x, _) = classifier_case(lambda: Fused(case), D, 0)
    sym = manifolds.transformer_symmetry(model, x)
    assert _units(sym, "w13") == [], sym.describe()
    with torch.no_grad():
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(3)))
        assert (moved(x) - model(x)).abs().max() < 1e-12


def test_an_empty_piece_of_a_split_has_no_units():
    """``split([8, 0, 8])``: the empty piece is skipped (it raised an IndexError), the others read as usual."""

    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.gu, self.down, self.head = nn.Linear(D, 2 * HID), nn.Linear(HID, D), nn.Linear(D, 3)

        def forward(self, x):
            gate, mid, up = self.gu(x).split([HID, 0, HID], dim=-1)
            return self.head((x + self.down(up * F.silu(gate)) + mid.sum()).mean(1))

    model, _, (x, _) = classifier_case(Empty, D, 0)
    sym = manifolds.transformer_symmetry(model, x)
    assert [f.size for f in _units(sym, "gu")] == [HID], sym.describe()
