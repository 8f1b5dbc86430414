"""The value bias of softmax attention against the output bias: every row of the attention weights sums to one, so
``bv_h <- bv_h + u`` with ``bo <- bo - Wo_h u`` keeps the function. No matrix factor expresses this translation, so
the symmetry measure is taken where its orbit has zero value biases (``bo + Wo_h bv_h`` in the output bias; the same
function), and is unchanged by it: before, a shift of ``3 N(0, 1)`` per entry moved the measure from 10.56 to 64.9 on
``hand_pre`` and from 58.1 to 324 on ``mha_pre``.

The shifts are written by hand on the state dict; the dense reference of `test_transformer_quotient` is taken at that
point by its own code (`representative`). Where the weights do not sum to one (no softmax, an appended value of
zeros), or the output bias is frozen, nothing is absorbed and a shift moves the outputs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from cases import moved_copy, token_classification
from test_transformer_quotient import CASES, D, _params, _with, dense_quotient_spectrum, make, measure_value
from torch import nn

import manifolds
from landscape import DirectionSpec, Grid, loss_plane
from manifolds._absorption import absorbed, random_shifts, shifted
from sharpness import MEASURES, Objective, Solver, geodesic_sharpness
from sharpness.measures import Ascent
from sharpness.measures._draws import Draws

H = 2


def _pairs(model: nn.Module) -> list[tuple[str, slice, str, str]]:
    """``(value bias, its entries, output weight, output bias)`` of every attention of ``model`` (as the test models
    name them)."""
    found = []
    for module, m in model.named_modules():
        name = f"{module}." if module else ""
        if isinstance(m, nn.MultiheadAttention):
            found.append((f"{name}in_proj_bias", slice(2 * D, 3 * D), f"{name}out_proj.weight",
                          f"{name}out_proj.bias"))  # fmt: skip
        elif hasattr(m, "qkv") and hasattr(m, "proj"):
            found.append((f"{name}qkv.bias", slice(2 * D, 3 * D), f"{name}proj.weight", f"{name}proj.bias"))
        elif hasattr(m, "v") and hasattr(m, "o"):
            found.append((f"{name}v.bias", slice(None), f"{name}o.weight", f"{name}o.bias"))
    return found


def _shifted(model: nn.Module, seed: int, scale: float = 3.0) -> nn.Module:
    """``bv <- bv + u``, ``bo <- bo - Wo u`` with ``u = scale N(0, 1)``, in every attention."""

    def move(params, g):
        for value, where, weight, output in _pairs(model):
            u = scale * torch.randn(D, generator=g, dtype=torch.float64)
            params[value][where] += u
            params[output] -= params[weight] @ u

    return moved_copy(model, seed, move)


def _symmetry(model, loss, data):
    obj = Objective(model, loss, data, dtype=torch.float64)
    return MEASURES["symmetry"].sharpness(obj, k=2, solver=Solver(tol=1e-12), progress=False)


@pytest.mark.parametrize("name", list(CASES))
def test_a_translation_of_the_value_bias_keeps_the_outputs_and_the_measure(name):
    model, loss, data = make(name)
    twin = _shifted(model, seed=1)
    with torch.no_grad():
        assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
    before, after = measure_value(model, loss, data, k=2), measure_value(twin, loss, data, k=2)
    assert np.allclose(after, before, rtol=1e-8, atol=0), (before, after)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert all(f.absorption is not None for f in sym.factors if "value/output" in f.label), sym.describe()


def test_the_eigenvectors_are_carried_to_each_point_of_the_orbit():
    """Both points' eigenvectors come from the same one at the representative, carried by the translation's
    differential ``dbo <- dbo - dWo bv``: between the two points they differ by ``dbo <- dbo - dWo d``, ``d`` the
    shift between them, and agree everywhere else."""
    model, loss, data = make("hand_pre")
    twin = _shifted(model, seed=2)
    results = [_symmetry(m, loss, data) for m in (model, twin)]
    assert all(r.info.get("value_biases_absorbed") for r in results)
    layout = manifolds.ParamLayout.from_tensors(_params(model))
    xi, xi_twin = (layout.unflatten(r.eigenvectors[0]) for r in results)
    d = dict(twin.named_parameters())["blocks.0.v.bias"] - dict(model.named_parameters())["blocks.0.v.bias"]
    sign = float(torch.sign((xi["blocks.0.q.weight"] * xi_twin["blocks.0.q.weight"]).sum()))
    for name in xi:
        expected = xi[name] - (xi["blocks.0.o.weight"] @ d.detach() if name == "blocks.0.o.bias" else 0.0)
        assert torch.allclose(sign * xi_twin[name], expected, rtol=0, atol=1e-8), name


class Weights(nn.Module):
    """Attention whose weights need not sum to one: the scores as they are (``"linear"``) or through a sigmoid
    (``"sigmoid"``); or ``nn.MultiheadAttention`` with a value of zeros appended (``"zero_attn"``), which a value bias
    does not reach."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        if how == "zero_attn":
            self.attn = nn.MultiheadAttention(D, H, batch_first=True, add_zero_attn=True)
        else:
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        if self.how == "zero_attn":
            return self.head(torch.tanh(self.attn(x, x, x, need_weights=False)[0]).mean(1))
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        s = q @ k.transpose(-2, -1) * 0.5
        a = (s if self.how == "linear" else torch.sigmoid(s)) @ v
        return self.head(torch.tanh(self.o(a.transpose(1, 2).reshape(b, t, D))).mean(1))


@pytest.mark.parametrize("how", ["linear", "sigmoid", "zero_attn"])
def test_where_the_weights_need_not_sum_to_one_nothing_is_absorbed(how):
    torch.manual_seed(0)
    model, loss, data = token_classification(Weights(how), D)
    with torch.no_grad():
        assert (_shifted(model, seed=3)(data[0]) - model(data[0])).abs().max() > 1e-3  # no symmetry
    sym = manifolds.transformer_symmetry(model, data[0])
    vo = [f for f in sym.factors if "value/output" in f.label]
    assert len(vo) == H and all(f.absorption is None for f in vo), sym.describe()
    assert "value_biases_absorbed" not in _symmetry(model, loss, data).info


def test_a_frozen_output_bias_stays_as_it_is():
    model, loss, data = make("hand_pre")
    model.blocks[0].o.bias.requires_grad_(False)
    result = _symmetry(model, loss, data)
    assert "value_biases_absorbed" not in result.info
    params = _params(model)  # the trainable ones: the measure is the one at the point itself
    sym = manifolds.transformer_symmetry(model, data[0]).restricted(params)
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    assert np.allclose(result.eigenvalues, reference[::-1][:2], rtol=1e-8, atol=0), (result.eigenvalues, reference)


def test_geodesic_sharpness_on_the_symmetry_metric_is_unchanged_by_the_translation():
    model, loss, data = make("hand_pre")
    values = [geodesic_sharpness(m, loss, data, 0.05, metric="symmetry", ascent=Ascent(steps=3, restarts=0),
                                 dtype=torch.float64, progress=False).value
              for m in (model, _shifted(model, seed=4))]  # fmt: skip
    assert values[0] > 0 and values[1] == pytest.approx(values[0], rel=1e-6), values


class FirstToken(nn.Module):
    """The output projection read by the head through the first token alone: a Linear after a Linear, whose units
    could be traded, but the value/output factors already move the output projection's inputs."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.head(self.o(a.transpose(1, 2).reshape(b, t, D))[:, 0])


def test_an_output_projection_read_by_a_linear_keeps_its_factors_and_is_measured():
    """Before, its units were traded too, and the metric refused the tensor moved on both sides."""
    torch.manual_seed(0)
    model, loss, data = token_classification(FirstToken(), D)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert len([f for f in sym.factors if "value/output" in f.label]) == H, sym.describe()
    assert "its inputs are moved by a GL factor (attention's value/output" in sym.describe(), sym.describe()
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, _params(model)), sym)
    assert np.allclose(_symmetry(model, loss, data).eigenvalues, reference[::-1][:2], rtol=1e-8, atol=0)


def test_verify_draws_the_biases_translations_with_the_attention_factors():
    """`verify_invariance`'s attention copies add random translations of the value bias against the output bias and
    of the unread key bias: the outputs and the symmetry measure stay, each translated bias moves."""
    model, loss, data = make("hand_pre")
    sym = manifolds.transformer_symmetry(model, data[0])
    params = _params(model)
    shifts = random_shifts(sym, params, 1.0, torch.Generator().manual_seed(5), torch.float64)
    assert len(shifts) == 2 * H  # a value head and a key head each, per head
    twin = _with(model, shifted(sym, params, shifts))
    moved = dict(twin.named_parameters())
    for name in ("blocks.0.v.bias", "blocks.0.k.bias", "blocks.0.o.bias"):
        assert (moved[name] - params[name]).abs().min() > 1e-3, name
    with torch.no_grad():
        assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
    assert np.allclose(measure_value(twin, loss, data, k=2), measure_value(model, loss, data, k=2), rtol=1e-8, atol=0)
    draws = Draws(manifolds.analyze(model, data[0]), params, ("attention",))  # what verify_invariance draws from
    drawn = draws.draw("attention", params, 1.0, torch.Generator().manual_seed(6), lambda t: None)
    assert (drawn["blocks.0.k.bias"] - params["blocks.0.k.bias"]).abs().min() > 1e-3  # no factor moves it
    with torch.no_grad():
        assert (_with(model, drawn)(data[0]) - model(data[0])).abs().max() < 1e-12


def _absorbed_outputs_differ(model: nn.Module, x: torch.Tensor) -> tuple[int, float]:
    """How many value/output factors record an absorption, and how far the outputs at `absorbed`'s point are from
    the model's own (the same function where the claim holds)."""
    sym = manifolds.transformer_symmetry(model, x)
    params = {n: p.detach() for n, p in model.named_parameters()}
    moved = absorbed(sym, params)
    count = sum(f.absorption is not None for f in sym.factors)
    if moved is None:
        return count, 0.0
    with torch.no_grad():
        return count, float((torch.func.functional_call(model, moved, (x,)) - model(x)).abs().max())


def _models():
    from test_concatenated_bias import _make as concatenated
    from test_raw_projections import make as raw
    from test_timm_layout import _small

    yield from ((f"quotient {name}", *make(name)[::2]) for name in CASES)
    yield from ((f"raw {name}", *raw(name)[::2]) for name in ("gpt2", "gpt2_sdpa", "raw", "raw_rms"))
    yield "BEiT's concatenated bias", *concatenated()[::2]
    yield "timm's layout", *_small(qkv_bias=True)


@pytest.mark.parametrize("case", range(12))
def test_the_absorbed_point_is_the_same_function(case):
    name, model, data = list(_models())[case]
    x = data[0] if isinstance(data, tuple) else data
    count, difference = _absorbed_outputs_differ(model, x)
    assert count > 0 and difference < 1e-12, (name, count, difference)


class Scaled(nn.Module):
    """Softmax attention with a constant factor on the value (``"value"``) or on the heads' output (``"output"``), a
    softmax computed in a dtype of its own and cast back (``"cast"``, as HuggingFace's eager attention), weights cast to
    integers (``"int"``), or by SDPA with a boolean mask (``"mask"``: a query that sees no key, whose output SDPA makes
    zeros; ``"kept"``: every query sees a key) or with dropout."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 3)
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        if how == "mask":
            mask[0] = False
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.how in ("mask", "kept"):
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        elif self.how == "dropout":
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        elif self.how == "cast":  # HuggingFace's eager attention: the softmax in a dtype of its own, cast back
            a = torch.nn.functional.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float64).to(q.dtype) @ v
        elif self.how == "int":  # weights rounded to integers (zeros here): their rows need not sum to one
            a = (q @ k.transpose(-2, -1)).softmax(-1).to(torch.int64).to(q.dtype) @ v
        else:
            a = (q @ k.transpose(-2, -1)).softmax(-1) @ (v * 2.0 if self.how == "value" else v)
            a = a * 3.0 if self.how == "output" else a
        return self.head(torch.tanh(self.o(a.transpose(1, 2).reshape(b, t, D))).mean(1))


@pytest.mark.parametrize("how,absorbs", [("value", False), ("output", False), ("mask", False), ("dropout", False),
                                         ("kept", True), ("cast", True), ("int", False)])  # fmt: skip
def test_no_absorption_where_the_value_bias_reaches_the_output_otherwise(how, absorbs):
    torch.manual_seed(0)
    model, _, (x, _) = token_classification(Scaled(how), D)
    count, difference = _absorbed_outputs_differ(model, x)
    assert count == (H if absorbs else 0) and difference < 1e-12, (count, difference)
    if how not in ("dropout", "int"):  # a translation there changes the outputs (int: zero weights, no outputs)
        with torch.no_grad():
            moved = _shifted(model, seed=7)(x) - model(x)
        assert (moved.abs().max() < 1e-12) == absorbs


def test_a_softmax_in_float32_inside_a_float64_model_absorbs_to_float32_s_rounding():
    """HuggingFace's eager attention computes the softmax in float32 whatever the model's dtype: its rows sum to one to
    float32's rounding, so in a float64 model the translation (and the representative) keeps the outputs to that
    rounding only (measured 2.5e-8), as the attention factors do there; the same softmax in float64 keeps them to
    1e-12 (`test_no_absorption_where_the_value_bias_reaches_the_output_otherwise`)."""

    class Float32Softmax(Scaled):
        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (m(x).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
            p = torch.nn.functional.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32).to(q.dtype)
            return self.head(torch.tanh(self.o((p @ v).transpose(1, 2).reshape(b, t, D))).mean(1))

    torch.manual_seed(0)
    model, _, (x, _) = token_classification(Float32Softmax("cast"), D)
    count, difference = _absorbed_outputs_differ(model, x)
    assert count == H and 1e-12 < difference < 1e-6, (count, difference)


@pytest.mark.parametrize("path", ["straight", "geodesic"])
def test_planes_along_the_symmetry_eigenvectors_are_the_same_on_the_orbit(path):
    """The eigenvectors are the representative's carried to each point, and geodesic planes follow the
    representative's geodesics carried back: the surfaces of a point and of its translation agree (before, the
    geodesic ones differed by up to 0.45)."""
    model, loss, data = make("hand_pre")
    spec = DirectionSpec(kind="invariant-eigen", metric="symmetry", path=path)
    a, b = (np.asarray(loss_plane(m, loss, data, spec, grid=Grid(span=0.5, steps=3), dtype=torch.float64,
                                  progress=False).loss) for m in (model, _shifted(model, seed=3)))  # fmt: skip
    assert np.allclose(a, b, rtol=1e-10, atol=1e-12), np.abs(a - b).max()


def test_a_model_in_training_mode_is_warned_about_once():
    """The representative is the objective at other parameters: it does not repeat the objective's warning."""
    model, loss, data = make("hand_pre")
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _symmetry(model, loss, data)
    assert result.info.get("value_biases_absorbed") and model.training
    assert sum("is in training mode" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
