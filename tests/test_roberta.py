"""`sharpness.Roberta` against HuggingFace's ``RobertaForSequenceClassification``: the logits of a tiny random
checkpoint that the ``transformers`` library wrote (``tests/data/make_roberta_tiny_hf.py``: 2 post-LayerNorm blocks of
width 16 with 2 heads of 8, 3 classes, padding id 1), on token ids alone (the padding id inside sequences) and on
padded batches with an attention mask; the symmetry group the toolkit reads off it (checked with elements built here
by hand), its R-operator products, and the command line's ``--model roberta:config=PATH``."""

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
    move_by_hand,
)
from torch import nn

import manifolds
from sharpness import GPT2, Bert, DataError, DistilBert, HFViT, Objective, Roberta, measure_sharpness

DATA = Path(__file__).parent / "data"
CHECKPOINT, CONFIG = DATA / "roberta_tiny_hf.safetensors", DATA / "roberta_tiny_hf.json"
LABELS = torch.tensor([0, 2, 1, 1])


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    fixtures = {k: state.pop(k) for k in ("__input_ids", "__logits", "__pairs", "__pair_logits")}
    return state, fixtures


def _model(state=None, **change) -> Roberta:
    state = _checkpoint()[0] if state is None else state
    return Roberta.from_config({**json.loads(CONFIG.read_text()), **change}, state)


def test_the_logits_are_huggingface_s_on_ids_and_on_padded_batches():
    _, f = _checkpoint()
    model = _model()
    ids, pairs = f["__input_ids"], f["__pairs"]
    assert int((ids[:, 1:] == 1).sum()) == 2 and pairs[:, 2].sum(1).tolist() == [9, 6, 4, 7]  # inner pads; padding
    with torch.no_grad():
        torch.testing.assert_close(model(ids), f["__logits"], rtol=0, atol=1e-12)
        torch.testing.assert_close(model(pairs), f["__pair_logits"], rtol=0, atol=1e-12)
        # the positions follow the padding id: BERT's positions 0..T-1 give other logits
        plain = _model()
        plain.roberta.embeddings.padding = None
        assert (plain(ids) - f["__logits"]).abs().max() > 0.05
        # the mask matters, and a padded token's id does not reach the classifier where the mask leaves it out
        unmasked = pairs.clone()
        unmasked[:, 2] = 1
        assert (model(unmasked) - f["__pair_logits"]).abs().max() > 0.1
        # the padding id numbers the positions: another pad_token_id is another function
        assert (_model(pad_token_id=0)(ids) - f["__logits"]).abs().max() > 0.05


def test_config_and_state_dict_forms():
    state, f = _checkpoint()
    old = dict(state, **{"roberta.embeddings.position_ids": torch.arange(12)[None]})  # older checkpoints' buffer
    with torch.no_grad():
        torch.testing.assert_close(Roberta.from_state_dict(old, heads=2)(f["__pairs"]), f["__pair_logits"], rtol=0,
                                   atol=1e-12)  # fmt: skip
    headless = {k: v for k, v in state.items() if not k.startswith("classifier.out_proj")}
    with pytest.raises(ValueError, match="RobertaForSequenceClassification"):
        Roberta.from_state_dict(headless, heads=2)
    config = json.loads(CONFIG.read_text())
    for change, fragment in [({"position_embedding_type": "relative_key"}, "position_embedding_type"),
                             ({"hidden_act": "silu"}, "hidden_act"), ({"num_attention_heads": 3}, "multiple of heads"),
                             ({"is_decoder": True}, "is_decoder"), ({"pad_token_id": 11}, "pad_token_id=11"),
                             ({"pad_token_id": None}, "pad_token_id must be an integer"),
                             ({"max_position_embeddings": 514}, "max_position_embeddings is 514"),
                             ({"num_labels": 2}, "num_labels is 2")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Roberta.from_config({**config, **change}, state)
    model = _model()
    for bad, fragment in [(torch.zeros(4, 11, dtype=torch.long), "longer than its 10 positions"),
                          (f["__input_ids"] + 40, "token ids run"), (f["__pairs"].float(), "RoBERTa takes"),
                          (f["__pairs"] + torch.tensor([0, 1, 0])[None, :, None], "token types run")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            model.check_tokens(bad)
    model.check_tokens(torch.zeros(4, 10, dtype=torch.long))  # 12 rows less the padding's and the one before


def _hand_built(model: Roberta, g: torch.Generator) -> Roberta:
    """A copy moved by `test_bert.move_by_hand` in the second block, the last LayerNorm traded against the head's
    first layer's columns, through ``x[:, 0]``."""
    moved = Roberta.from_state_dict(model.state_dict(), heads=HEADS)
    move_by_hand(moved.roberta, moved.classifier.dense, 1, g)
    return moved


def test_the_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and on value/output (dimension 2 * 2 * 2 * 64 = 512), and the last
    LayerNorm traded against the head's dense layer through the first token (16); the embeddings' LayerNorm and the
    blocks' others feed residual sums, GELU pins the MLP's units and tanh the head's. A random element and one built
    by hand keep the logits and the symmetry measure, while Euclidean sharpness moves."""
    _, f = _checkpoint()
    model, pairs = _model(), f["__pairs"]
    sym = manifolds.transformer_symmetry(model, pairs)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + WIDTH, sym.describe()
    moved_names = {b.name for fac in sym.factors for b in fac.blocks}
    assert "classifier.dense.weight" in moved_names and "classifier.out_proj.weight" not in moved_names
    assert not any(n.startswith("roberta.embeddings") for n in moved_names)
    g = torch.Generator().manual_seed(0)
    check_invariance(model, [sym.transformed(model, sym.random_element(1.0, g)), _hand_built(model, g)],
                     (pairs, LABELS))  # fmt: skip
    # ReLU MLP units add their scalings (24 per block)
    assert manifolds.transformer_symmetry(_model(hidden_act="relu"), pairs).dim == sym.dim + LAYERS * MLP


def test_the_products_are_the_r_operator_s():
    _, f = _checkpoint()
    check_rop_products(_model(), (f["__input_ids"], LABELS))  # ids with the padding id inside sequences


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """The fixture as a checkpoint, and padded data: ``X`` (N, 3, T) ids, token types and mask, ``y`` (N,)."""
    d = tmp_path_factory.mktemp("robertacli")
    state, f = _checkpoint()
    save_file(state, str(d / "roberta.safetensors"))
    np.savez(d / "pairs.npz", X=f["__pairs"].numpy(), y=LABELS.numpy())
    return d


@pytest.mark.parametrize("spec", [f"roberta:config={CONFIG}", "roberta:heads=2", "roberta:heads=2,pad=1,eps=1e-5"])
def test_the_command_line_measures_a_roberta_checkpoint(cli_files, tmp_path, spec):
    check_command_line(spec, cli_files / "roberta.safetensors", cli_files / "pairs.npz", _model(), tmp_path / "r.json")


@pytest.mark.parametrize("model, data, fragment", [
    ("roberta", "pairs", "number of heads"),
    ("roberta:heads=2,pad=x", "pairs", "heads and pad are integers"),
    ("roberta:heads=2,pad=40", "pairs", "pad_token_id=40"),
    ("roberta:heads=2,cls=0", "pairs", "the other options are eps, act, pad"),
    ("roberta:heads=2", "long", "longer than its 10 positions"),
    ("bert:heads=2", "pairs", "bert.embeddings.word_embeddings.weight"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, tmp_path, capsys, model, data,
                                                                    fragment):  # fmt: skip
    path = cli_files / "pairs.npz"
    if data == "long":
        path = tmp_path / "long.npz"
        np.savez(path, X=np.zeros((4, 3, 11), dtype=np.int64) + np.array([0, 0, 1])[None, :, None],
                 y=LABELS.numpy())  # fmt: skip
    check_refusal(model, cli_files / "roberta.safetensors", path, fragment, capsys)


def _token_models():
    torch.manual_seed(0)
    return {
        "roberta": Roberta(vocab=40, positions=12, dim=8, layers=1, heads=2),
        "bert": Bert(vocab=40, positions=12, dim=8, layers=1, heads=2),
        "distilbert": DistilBert(vocab=40, positions=12, dim=8, layers=1, heads=2),
        "gpt2": GPT2(vocab=40, positions=12, dim=8, layers=1, heads=2),
        "hfvit": HFViT(image=8, patch=4, dim=8, layers=1, heads=2, classes=3),
    }


@pytest.mark.parametrize("name, inputs, fragment", [
    ("roberta", torch.randint(2, 40, (2, 11)), "longer than its 10 positions"),
    ("roberta", torch.stack([torch.randint(2, 40, (2, 5)), torch.ones(2, 5, dtype=torch.long),
                             torch.ones(2, 5, dtype=torch.long)], 1), "token types run from 1 to 1"),
    ("bert", torch.randint(2, 40, (2, 5)).to(torch.uint8), r"int64 \(or int32\) token ids"),
    ("distilbert", torch.stack([torch.randint(2, 40, (2, 5)), 2 * torch.ones(2, 5, dtype=torch.long)], 1),
     "attention mask values run"),
    ("gpt2", torch.randint(40, 50, (2, 5)), "token ids run from"),
    ("hfvit", torch.randn(2, 3, 12, 12), r"takes images \(N, 3, 8, 8\), not \(2, 3, 12, 12\)"),
])  # fmt: skip
def test_the_library_refuses_inputs_a_model_does_not_take_in_one_sentence(name, inputs, fragment):
    """The Python boundary asks the model's ``check_tokens`` (``check_inputs``), as the command line does: the measures
    (building the objective) and the group analysis refuse in its sentence, where the embedding raised a bare
    IndexError or RuntimeError (and a ViT given images of another size failed in a reshape)."""
    model, labels = _token_models()[name].double().eval(), torch.zeros(2, dtype=torch.long)
    inputs = inputs.double() if inputs.is_floating_point() else inputs
    loss = nn.CrossEntropyLoss() if name != "gpt2" else (lambda out, y: out.sum())
    with pytest.raises(DataError, match=fragment):
        measure_sharpness(model, loss, (inputs, labels), "euclidean", progress=False)
    with pytest.raises(ValueError, match=fragment):
        manifolds.analyze(model, inputs)


@pytest.mark.parametrize("size", ["classes", "types", "layers", "dim", "hidden", "vocab"])
def test_the_encoders_refuse_sizes_that_are_not_positive(size):
    with pytest.raises(ValueError, match=f"{size}=0 must be a positive integer"):
        Roberta(**{**dict(vocab=40, positions=12, dim=8, layers=1, heads=2), size: 0})


def test_a_stream_s_later_batch_is_checked_too():
    """A DataLoader whose second batch holds an id outside the vocabulary, and a stream whose second batch of images
    has another size with as many patches (which would run, on other patches): refused in the model's sentence
    before any forward, as a list of the same batches is."""
    models = _token_models()
    ids, labels = torch.randint(2, 40, (6, 5)), torch.zeros(6, dtype=torch.long)
    ids[4, 0] = 99
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=3)
    with pytest.raises(DataError, match="token ids run from 2 to 99"):
        measure_sharpness(models["distilbert"].double().eval(), nn.CrossEntropyLoss(), loader, "euclidean",
                          progress=False)  # fmt: skip
    images = [(torch.randn(4, 3, 8, 8, dtype=torch.float64), labels[:4]),
              (torch.randn(4, 3, 4, 16, dtype=torch.float64), labels[:4])]  # fmt: skip

    class Stream:
        def __iter__(self):
            return iter(images)

    for data in (Stream(), images):
        with pytest.raises(DataError, match=r"takes images \(N, 3, 8, 8\), not \(4, 3, 4, 16\)"):
            measure_sharpness(models["hfvit"].double().eval(), nn.CrossEntropyLoss(), data, "euclidean",
                              progress=False)  # fmt: skip


def test_one_token_sequences_keep_their_label_column():
    """Next-token labels ``(n, 1)`` for one-token sequences against logits ``(n, V, 1)``: the label column is squeezed
    only for a model whose outputs are ``(n, C)`` (it was squeezed here, and the labels refused)."""
    model = GPT2(vocab=20, positions=8, dim=8, layers=1, heads=2, classes_last=False).double().eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (6, 1), generator=g), torch.randint(0, 20, (6, 1), generator=g)
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    with torch.no_grad():
        assert float(obj.value()) == pytest.approx(float(nn.CrossEntropyLoss()(model(x), y)), rel=1e-12)
    mlp = nn.Linear(4, 3).double().eval()  # a classifier's (n, 1) label column, as pandas gives it
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5, 1), generator=g)
    with torch.no_grad():
        expected = float(nn.CrossEntropyLoss()(mlp(x), y[:, 0]))
        assert float(Objective(mlp, nn.CrossEntropyLoss(), (x, y)).value()) == pytest.approx(expected, rel=1e-12)
