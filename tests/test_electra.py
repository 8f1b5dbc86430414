"""`sharpness.Electra` against HuggingFace's ``ElectraForSequenceClassification``: the logits of a tiny random
checkpoint that the ``transformers`` library wrote (``tests/data/make_electra_tiny_hf.py``: embeddings of width 8
widened to 2 post-LayerNorm blocks of width 16 by ``embeddings_project``, 2 heads of 8, 3 classes), on token ids alone
and on padded sentence pairs; the symmetry group the toolkit reads off it (checked with elements built here by hand),
its R-operator products, and the command line's ``--model electra:config=PATH``."""

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
    WIDTH,
    check_command_line,
    check_invariance,
    check_refusal,
    check_rop_products,
    move_by_hand,
)

import manifolds
from sharpness import Electra

DATA = Path(__file__).parent / "data"
CHECKPOINT, CONFIG = DATA / "electra_tiny_hf.safetensors", DATA / "electra_tiny_hf.json"
EMBEDDING = 8
LABELS = torch.tensor([0, 2, 1, 1])


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    fixtures = {k: state.pop(k) for k in ("__input_ids", "__logits", "__pairs", "__pair_logits")}
    return state, fixtures


def _model(state=None, **change) -> Electra:
    state = _checkpoint()[0] if state is None else state
    return Electra.from_config({**json.loads(CONFIG.read_text()), **change}, state)


def test_the_logits_are_huggingface_s_on_ids_and_on_padded_sentence_pairs():
    _, f = _checkpoint()
    model = _model()
    assert model.electra.embeddings_project.weight.shape == (WIDTH, EMBEDDING)
    with torch.no_grad():
        torch.testing.assert_close(model(f["__input_ids"]), f["__logits"], rtol=0, atol=1e-12)
        torch.testing.assert_close(model(f["__pairs"]), f["__pair_logits"], rtol=0, atol=1e-12)
        assert (model(f["__pairs"][:, 0]) - f["__pair_logits"]).abs().max() > 0.1  # the types and the mask matter


def test_config_and_state_dict_forms():
    state, f = _checkpoint()
    old = dict(state, **{"electra.embeddings.position_ids": torch.arange(12)[None]})  # older checkpoints' buffer
    with torch.no_grad():
        torch.testing.assert_close(Electra.from_state_dict(old, heads=2, eps=1e-5)(f["__pairs"]), f["__pair_logits"],
                                   rtol=0, atol=1e-12)  # fmt: skip
    with pytest.raises(ValueError, match="ElectraForSequenceClassification"):
        Electra.from_state_dict({k: v for k, v in state.items() if "out_proj" not in k}, heads=2)
    # the blocks' width read off the projection: the missing head's key named, at the blocks' width
    with pytest.raises(ValueError, match=r"width 16: missing \['classifier.dense.weight'\], unknown \[\]"):
        Electra.from_state_dict({k: v for k, v in state.items() if k != "classifier.dense.weight"}, heads=2)
    without = {k: v for k, v in state.items() if "embeddings_project" not in k}
    with pytest.raises(ValueError, match=r"missing \['electra.embeddings_project.bias'"):
        Electra.from_state_dict(without, heads=2)
    for change, fragment in [({"embedding_size": 16}, "config's embedding_size is 16"),
                             ({"hidden_size": 8}, "config's hidden_size is 8"), ({"is_decoder": True}, "is_decoder"),
                             ({"hidden_act": "silu"}, "hidden_act"),
                             ({"num_hidden_layers": 3}, "num_hidden_layers is 3"),
                             ({"intermediate_size": 99}, "intermediate_size is 99"), ({"vocab_size": 32}, "vocab_size"),
                             ({"id2label": {"0": "a"}}, "num_labels is 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            _model(**change)
    # embeddings as wide as the blocks: no projection, the keys of a BERT under another prefix
    square = Electra(vocab=31, positions=12, dim=16, layers=1, heads=2, classes=3)
    assert not hasattr(square.electra, "embeddings_project")
    assert Electra.from_state_dict(square.state_dict(), heads=2).electra.embeddings.word_embeddings.embedding_dim == 16


def _hand_built(model: Electra, g: torch.Generator) -> Electra:
    """A copy moved by `test_bert.move_by_hand` in the first block (the last LayerNorm traded against the head's
    first layer), and the embeddings' LayerNorm's scale and shift times ``e > 0`` traded against the projection's
    columns (``/ e``)."""
    moved = Electra.from_state_dict(model.state_dict(), heads=HEADS, eps=1e-5)
    move_by_hand(moved.electra, moved.classifier.dense, 0, g)
    e = torch.rand(EMBEDDING, generator=g, dtype=torch.float64) * 3 + 0.2
    with torch.no_grad():
        norm = moved.electra.embeddings.LayerNorm
        norm.weight.mul_(e), norm.bias.mul_(e)
        moved.electra.embeddings_project.weight.div_(e)
    return moved


def test_the_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and on value/output (512), the embeddings' LayerNorm traded against the
    projection that alone reads it (8) and the last LayerNorm against the head's first layer (16); GELU pins the
    MLP's and the head's units. A random element and one built by hand keep the logits and the symmetry measure,
    while Euclidean sharpness moves."""
    _, f = _checkpoint()
    model, pairs = _model(), f["__pairs"]
    sym = manifolds.transformer_symmetry(model, pairs)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + EMBEDDING + WIDTH, sym.describe()
    moved_names = {b.name for fac in sym.factors for b in fac.blocks}
    assert {"electra.embeddings.LayerNorm.weight", "electra.embeddings_project.weight"} <= moved_names
    g = torch.Generator().manual_seed(0)
    check_invariance(model, [sym.transformed(model, sym.random_element(1.0, g)), _hand_built(model, g)],
                     (pairs, LABELS))  # fmt: skip


def test_the_products_are_the_r_operator_s():
    _, f = _checkpoint()
    check_rop_products(_model(), (f["__pairs"], LABELS))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("electracli")
    state, f = _checkpoint()
    save_file(state, str(d / "electra.safetensors"))
    np.savez(d / "pairs.npz", X=f["__pairs"].numpy(), y=LABELS.numpy())
    return d


@pytest.mark.parametrize("spec", [f"electra:config={CONFIG}", "electra:heads=2,eps=1e-5"])
def test_the_command_line_measures_an_electra_checkpoint(cli_files, tmp_path, spec):
    check_command_line(spec, cli_files / "electra.safetensors", cli_files / "pairs.npz", _model(), tmp_path / "r.json")


@pytest.mark.parametrize("model, fragment", [
    ("electra", "number of heads"),
    ("electra:heads=3", "not a multiple of heads=3"),
    ("bert:heads=2", "bert.embeddings.word_embeddings.weight"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, capsys, model, fragment):
    check_refusal(model, cli_files / "electra.safetensors", cli_files / "pairs.npz", fragment, capsys)
