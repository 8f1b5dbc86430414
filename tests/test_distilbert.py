"""`sharpness.DistilBert` against HuggingFace's ``DistilBertForSequenceClassification``: the logits of a tiny random
checkpoint that the ``transformers`` library wrote (``tests/data/make_distilbert_tiny_hf.py``: 2 post-LayerNorm blocks
of width 16 with 2 heads of 8, an MLP of 24, 3 classes), on token ids alone and on padded batches with an attention
mask; the symmetry group the toolkit reads off it (checked with elements built here by hand), its R-operator products,
and the command line's ``--model distilbert:config=PATH``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bert import (
    HD,
    HEADS,
    LAYERS,
    MLP,
    WIDTH,
    check_command_line,
    check_invariance,
    check_refusal,
    check_rop_products,
    move_heads,
)

import manifolds
from sharpness import DistilBert

DATA = Path(__file__).parent / "data"
CHECKPOINT, CONFIG = DATA / "distilbert_tiny_hf.safetensors", DATA / "distilbert_tiny_hf.json"
LABELS = torch.tensor([0, 2, 1, 1])


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    fixtures = {k: state.pop(k) for k in ("__input_ids", "__logits", "__masked", "__masked_logits")}
    return state, fixtures


def _model(state=None, **change) -> DistilBert:
    state = _checkpoint()[0] if state is None else state
    return DistilBert.from_config({**json.loads(CONFIG.read_text()), **change}, state)


def test_the_logits_are_huggingface_s_on_ids_and_on_padded_batches():
    _, f = _checkpoint()
    model, masked = _model(), f["__masked"]
    assert masked[:, 1].sum(1).tolist() == [9, 6, 4, 7]
    with torch.no_grad():
        torch.testing.assert_close(model(f["__input_ids"]), f["__logits"], rtol=0, atol=1e-12)
        torch.testing.assert_close(model(masked), f["__masked_logits"], rtol=0, atol=1e-12)
        # the mask matters, and a padded token's id does not reach the classifier
        assert (model(masked[:, 0]) - f["__masked_logits"]).abs().max() > 0.1
        other = masked.clone()
        other[:, 0] = torch.where(other[:, 1] == 1, other[:, 0], 7)
        torch.testing.assert_close(model(other), f["__masked_logits"], rtol=0, atol=1e-12)


def test_config_and_state_dict_forms():
    state, f = _checkpoint()
    old = dict(state, **{"distilbert.embeddings.position_ids": torch.arange(12)[None]})  # older checkpoints' buffer
    with torch.no_grad():
        torch.testing.assert_close(DistilBert.from_state_dict(old, heads=2)(f["__masked"]), f["__masked_logits"],
                                   rtol=0, atol=1e-12)  # fmt: skip
    with pytest.raises(ValueError, match="DistilBertForSequenceClassification"):
        DistilBert.from_state_dict({k: v for k, v in state.items() if not k.startswith("classifier")}, heads=2)
    for change, fragment in [({"n_heads": 3}, "multiple of heads"), ({"n_heads": None}, "n_heads must be"),
                             ({"activation": "silu"}, "activation is 'silu'"), ({"dim": 32}, "config's dim is 32"),
                             ({"n_layers": 3}, "config's n_layers is 3")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            _model(**change)
    model = _model()
    no_cls = f["__masked"].clone()
    no_cls[2, 1, 0] = 0
    for bad, fragment in [(torch.zeros(4, 13, dtype=torch.long), "longer than its 12 positions"),
                          (f["__input_ids"] + 40, "token ids run"), (f["__masked"].float(), "DistilBERT takes"),
                          (torch.zeros(4, 3, 5, dtype=torch.long), r"\(N, 2, T\)"),
                          (f["__masked"] * torch.tensor([1, 2])[None, :, None], "attention mask values run"),
                          (no_cls, r"first token \(\[CLS\]")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            model.check_tokens(bad)


def _hand_built(model: DistilBert, g: torch.Generator) -> DistilBert:
    """A copy moved by an element built here, not by the toolkit: per head of the first block ``A`` on query/key and
    ``B`` on value/output, the last LayerNorm's scale and shift times ``c > 0`` traded against the first classifier
    layer's columns through ``x[:, 0]``, and that layer's ReLU units times ``s > 0`` traded against the classifier's
    columns."""
    moved = DistilBert.from_state_dict(model.state_dict(), heads=HEADS)
    attn = moved.distilbert.transformer.layer[0].attention
    move_heads(attn.q_lin, attn.k_lin, attn.v_lin, attn.out_lin, g)
    with torch.no_grad():
        c, s = (torch.rand(WIDTH, generator=g, dtype=torch.float64) * 3 + 0.2 for _ in range(2))
        last = moved.distilbert.transformer.layer[-1].output_layer_norm
        last.weight.mul_(c), last.bias.mul_(c)
        pre = moved.pre_classifier
        pre.weight.copy_(s[:, None] * pre.weight / c), pre.bias.mul_(s)
        moved.classifier.weight.div_(s)
    return moved


def test_the_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and on value/output (dimension 2 * 2 * 2 * 64 = 512), the last LayerNorm
    traded against the first classifier layer through the first token (16) and that layer's ReLU units (16); the
    other LayerNorms feed residual sums, GELU pins the MLP's units. A random element and one built by hand keep the
    logits and the symmetry measure, while Euclidean sharpness moves."""
    _, f = _checkpoint()
    model, masked = _model(), f["__masked"]
    sym = manifolds.transformer_symmetry(model, masked)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + 2 * WIDTH, sym.describe()
    g = torch.Generator().manual_seed(0)
    check_invariance(model, [sym.transformed(model, sym.random_element(1.0, g)), _hand_built(model, g)],
                     (masked, LABELS))  # fmt: skip
    assert manifolds.transformer_symmetry(_model(activation="relu"), masked).dim == sym.dim + LAYERS * MLP


def test_the_products_are_the_r_operator_s():
    _, f = _checkpoint()
    check_rop_products(_model(), (f["__masked"], LABELS))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """The fixture as a checkpoint, and padded data: ``X`` (N, 2, T) ids and mask, ``y`` (N,)."""
    d = tmp_path_factory.mktemp("distilbertcli")
    state, f = _checkpoint()
    save_file(state, str(d / "distilbert.safetensors"))
    np.savez(d / "masked.npz", X=f["__masked"].numpy(), y=LABELS.numpy())
    return d


@pytest.mark.parametrize("spec", [f"distilbert:config={CONFIG}", "distilbert:heads=2,act=gelu"])
def test_the_command_line_measures_a_distilbert_checkpoint(cli_files, tmp_path, spec):
    check_command_line(spec, cli_files / "distilbert.safetensors", cli_files / "masked.npz", _model(),
                       tmp_path / "r.json")  # fmt: skip


@pytest.mark.parametrize("model, fragment", [
    ("distilbert", "number of heads (n_heads)"),
    ("distilbert:heads=2,act=silu", "activation 'silu'"),
    ("distilbert:heads=3", "not a multiple of heads=3"),
    ("distilbert:heads=2,pad=1", "the other options are eps, act"),
    ("roberta:heads=2", "roberta.embeddings.word_embeddings.weight"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, capsys, model, fragment):
    check_refusal(model, cli_files / "distilbert.safetensors", cli_files / "masked.npz", fragment, capsys)
