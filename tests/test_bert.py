"""`sharpness.Bert` against HuggingFace's ``BertForSequenceClassification``: the logits of a tiny random checkpoint that
the ``transformers`` library wrote (``tests/data/make_bert_tiny_hf.py``: 2 post-LayerNorm blocks of width 16 with 2
heads of 8, 3 classes), on token ids alone and on sentence pairs with token types and padding; the symmetry group the
toolkit reads off it (checked with elements built here by hand), its R-operator products, and the command line's
``--model bert:config=PATH``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_transformer_quotient import measure_value
from torch import nn

import manifolds
from sharpness import Bert, Objective, euclidean_sharpness
from sharpness._cli import main as sharpness_main
from sharpness.products._reference import dense_hessian

DATA = Path(__file__).parent / "data"
CHECKPOINT, CONFIG = DATA / "bert_tiny_hf.safetensors", DATA / "bert_tiny_hf.json"
LAYERS, WIDTH, HEADS, HD, MLP = 2, 16, 2, 8, 24
LABELS = torch.tensor([0, 2, 1, 1])


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    fixtures = {k: state.pop(k) for k in ("__input_ids", "__logits", "__pairs", "__pair_logits")}
    return state, fixtures


def _model(state=None, act: str | None = None) -> Bert:
    state = _checkpoint()[0] if state is None else state
    config = json.loads(CONFIG.read_text())
    return Bert.from_config(config if act is None else {**config, "hidden_act": act}, state)


def test_the_logits_are_huggingface_s_on_ids_and_on_padded_sentence_pairs():
    _, f = _checkpoint()
    model = _model()
    assert f["__pairs"][:, 2].sum(1).tolist() == [9, 6, 4, 7] and int(f["__pairs"][:, 1].sum()) > 0  # padding, types
    with torch.no_grad():
        torch.testing.assert_close(model(f["__input_ids"]), f["__logits"], rtol=0, atol=1e-12)
        torch.testing.assert_close(model(f["__pairs"]), f["__pair_logits"], rtol=0, atol=1e-12)
        # the token types and the mask matter: without them the logits move
        assert (model(f["__pairs"][:, 0]) - f["__pair_logits"]).abs().max() > 0.1
        unmasked = f["__pairs"].clone()
        unmasked[:, 2] = 1
        assert (model(unmasked) - f["__pair_logits"]).abs().max() > 0.1
        # ids and token types without a mask: every token attended
        every = torch.cat((f["__pairs"][:, :2], torch.ones_like(f["__pairs"][:, 2:])), dim=1)
        torch.testing.assert_close(model(f["__pairs"][:, :2]), model(every), rtol=0, atol=0)
        assert (model(every) - f["__pair_logits"]).abs().max() > 0.1
        # what a padded token holds does not reach the classifier
        other = f["__pairs"].clone()
        other[:, 0] = torch.where(other[:, 2] == 1, other[:, 0], 7)
        torch.testing.assert_close(model(other), f["__pair_logits"], rtol=0, atol=1e-12)


def test_config_and_state_dict_forms():
    state, f = _checkpoint()
    # old checkpoints saved the index buffers; the keys without a class head are refused with the reason
    old = dict(state, **{"bert.embeddings.position_ids": torch.arange(12)[None]})
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in old.items()}  # names of checkpoints converted from TensorFlow
    assert "bert.encoder.layer.1.output.LayerNorm.gamma" in old
    with torch.no_grad():
        torch.testing.assert_close(Bert.from_state_dict(old, heads=2, eps=1e-5)(f["__pairs"]), f["__pair_logits"],
                                   rtol=0, atol=1e-12)  # fmt: skip
    headless = {k: v for k, v in state.items() if not k.startswith("classifier")}
    with pytest.raises(ValueError, match="BertForSequenceClassification"):
        Bert.from_state_dict(headless, heads=2)
    config = json.loads(CONFIG.read_text())
    for change, fragment in [({"position_embedding_type": "relative_key"}, "position_embedding_type"),
                             ({"hidden_act": "silu"}, "hidden_act"), ({"num_attention_heads": 3}, "multiple of heads"),
                             ({"is_decoder": True}, "is_decoder"), ({"type_vocab_size": 1}, "type_vocab_size is 1"),
                             ({"num_hidden_layers": 12}, "num_hidden_layers is 12")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Bert.from_config({**config, **change}, state)
    model = _model()
    types_off = f["__pairs"][:, :2] * torch.tensor([1, 0])[None, :, None] + torch.tensor([0, 5])[None, :, None]
    for bad, fragment in [(f["__pairs"].repeat(1, 2, 1)[:, :4], r"\(N, 3, T\)"),
                          (f["__input_ids"] + 40, "token ids run"),
                          (torch.zeros(4, 13, dtype=torch.long), "longer than its 12 positions"),
                          (torch.zeros(4, 3, 0, dtype=torch.long), "hold no tokens"),
                          (torch.zeros(0, 5, dtype=torch.long), "hold no tokens"),
                          (f["__input_ids"].to(torch.uint16), "uint16"), (types_off, "token types run")]:
        with pytest.raises(ValueError, match=fragment):
            model.check_tokens(bad)
    with pytest.raises(ValueError, match="hidden_act"):
        Bert.from_config({**config, "hidden_act": ["gelu"]}, state)
    no_cls = f["__pairs"].clone()
    no_cls[1, 2, 0] = 0
    with pytest.raises(ValueError, match=r"first token \(\[CLS\]"):
        model.check_tokens(no_cls)


@torch.no_grad()
def move_heads(q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, g: torch.Generator) -> None:
    """Move one attention block's projections in place by an element built here, not by the toolkit: per head (of
    `HD` features), ``A`` on query/key (``W_Q -> A^T W_Q``, ``W_K -> A^-1 W_K``, their biases alike) and ``B`` on
    value/output (``W_V -> B^T W_V``, ``W_O[:, h] -> W_O[:, h] B^-T``)."""
    for h in range(q.out_features // HD):
        rows = slice(h * HD, (h + 1) * HD)
        A, B = (torch.eye(HD, dtype=torch.float64) + 0.4 * torch.randn(HD, HD, generator=g, dtype=torch.float64)
                for _ in range(2))  # fmt: skip
        for lin, M in ((q, A.T), (k, torch.linalg.inv(A)), (v, B.T)):
            lin.weight[rows] = M @ lin.weight[rows]
            lin.bias[rows] = M @ lin.bias[rows]
        o.weight[:, rows] = o.weight[:, rows] @ torch.linalg.inv(B).T


@torch.no_grad()
def move_by_hand(body: nn.Module, reader: nn.Linear, block: int, g: torch.Generator) -> None:
    """Move an encoder (`sharpness._bert.BertBody`) in place by an element built here, not by the toolkit: `move_heads`
    in block ``block``, and the last LayerNorm's scale and shift times ``c > 0`` traded against the columns of
    ``reader`` (``/ c``), which reads the first token's state alone."""
    attn = body.encoder.layer[block].attention
    move_heads(attn.self.query, attn.self.key, attn.self.value, attn.output.dense, g)
    c = torch.rand(WIDTH, generator=g, dtype=torch.float64) * 3 + 0.2
    last = body.encoder.layer[-1].output.LayerNorm
    last.weight.mul_(c), last.bias.mul_(c)
    reader.weight.div_(c)


def _hand_built(model: Bert, g: torch.Generator) -> Bert:
    """A copy moved by `move_by_hand` in the first block, the last LayerNorm traded through the pooler's ``x[:, 0]``."""
    moved = Bert.from_state_dict(model.state_dict(), heads=HEADS, eps=1e-5)
    move_by_hand(moved.bert, moved.bert.pooler.dense, 0, g)
    return moved


def check_invariance(model: nn.Module, moved: list[nn.Module], data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Each of ``moved`` computes ``model``'s logits and symmetry measure (to 1e-8, float64), while Euclidean sharpness
    moves by more than 1.5x."""
    loss = nn.CrossEntropyLoss()
    before = float(measure_value(model, loss, data)[0])
    e0 = euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    for other in moved:
        with torch.no_grad():
            assert (other(data[0]) - model(data[0])).abs().max() < 1e-10
        after = float(measure_value(other, loss, data)[0])
        assert abs(after - before) <= 1e-8 * abs(before), (before, after)
        e1 = euclidean_sharpness(other, loss, data, dtype=torch.float64, progress=False).value
        assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


def check_rop_products(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``"auto"`` picks the R-operator, whose products are the dense float64 Hessian's to 1e-11."""
    obj = Objective(model, nn.CrossEntropyLoss(), data)
    assert obj.hvp_strategy() == "rop"
    H = dense_hessian(obj)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        v = torch.randn(obj.layout.size, generator=g, dtype=torch.float64)
        ref = H @ v
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-11 * float(ref.abs().max()))


def test_the_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and on value/output (dimension 2 * 2 * 2 * 64 = 512), and the last
    LayerNorm traded against the pooler through the [CLS] selection (16); the other LayerNorms feed residual sums (post
    LayerNorm), GELU pins the MLP's units and tanh the pooler's. A random element and one built by hand keep the
    logits and the symmetry measure, while Euclidean sharpness moves."""
    _, f = _checkpoint()
    model, pairs = _model(), f["__pairs"]
    sym = manifolds.transformer_symmetry(model, pairs)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + WIDTH, sym.describe()
    moved_names = {b.name for fac in sym.factors for b in fac.blocks}
    assert "bert.pooler.dense.weight" in moved_names
    assert "bert.encoder.layer.0.output.LayerNorm.weight" not in moved_names
    g = torch.Generator().manual_seed(0)
    check_invariance(model, [sym.transformed(model, sym.random_element(1.0, g)), _hand_built(model, g)],
                     (pairs, LABELS))  # fmt: skip
    # ReLU MLP units add their scalings (24 per block)
    assert manifolds.transformer_symmetry(_model(act="relu"), pairs).dim == sym.dim + LAYERS * MLP


def test_a_token_selection_keeps_features_only_for_constant_rows():
    """The last LayerNorm is traded through ``x[:, 0]`` and ``x.mean(1)``, but not through a selection of features
    (``x[..., :8]``) or of rows given by the data (``x[range, ids.argmax]``), which the analysis cannot see for every
    input, nor into a Linear that is called again elsewhere."""

    class Pool(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how, self.emb, self.norm = how, nn.Embedding(11, 8), nn.LayerNorm(8)
            self.head = nn.Linear(8 if how != "features" else 4, 3)

        def forward(self, ids):
            x = self.norm(self.emb(ids))
            if self.how == "first":
                return self.head(x[:, 0])
            if self.how == "mean":
                return self.head(x.mean(1))
            if self.how == "features":
                return self.head(x[..., :4])
            if self.how == "twice":  # the head read again, on other features: no trade can answer both
                return self.head(x[:, 0]) + self.head(self.emb(ids)[:, 1])
            return self.head(x[torch.arange(ids.size(0)), ids.argmax(1)])

    ids = torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(0))
    ways = ("first", "mean", "features", "data", "twice")
    dims = {how: manifolds.transformer_symmetry(Pool(how).double(), ids).dim for how in ways}
    assert dims == {"first": 8, "mean": 8, "features": 0, "data": 0, "twice": 0}, dims


def test_the_products_are_the_r_operator_s():
    _, f = _checkpoint()
    check_rop_products(_model(), (f["__pairs"], LABELS))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """The fixture as a checkpoint, and sentence-pair data: ``X`` (N, 3, T) ids, token types and mask, ``y`` (N,)."""
    d = tmp_path_factory.mktemp("bertcli")
    state, f = _checkpoint()
    save_file(state, str(d / "bert.safetensors"))
    np.savez(d / "pairs.npz", X=f["__pairs"].numpy(), y=LABELS.numpy())
    return d


def check_command_line(spec: str, checkpoint: Path, data: Path, model: nn.Module, out: Path) -> None:
    """``compute --model spec`` on ``checkpoint`` and ``data`` (a ``.npz`` with ``X`` and ``y``) measures ``model``'s
    symmetry sharpness (to 1e-6) and a positive Euclidean one."""
    argv = ["compute", "--model", spec, "--checkpoint", str(checkpoint), "--data", str(data), "--metric",
            "euclidean", "--metric", "symmetry", "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    report = json.loads(out.read_text())
    with np.load(data) as arrays:
        expected = measure_value(model, nn.CrossEntropyLoss(), (torch.from_numpy(arrays["X"]),
                                                                torch.from_numpy(arrays["y"])))  # fmt: skip
    assert report["measures"]["symmetry"]["value"] == pytest.approx(float(expected[0]), rel=1e-6)
    assert report["measures"]["euclidean"]["value"] > 0


def check_refusal(spec: str, checkpoint: Path, data: Path, fragment: str, capsys) -> None:
    """``compute --model spec`` exits with 2 and one sentence holding ``fragment``, no traceback."""
    argv = ["compute", "--model", spec, "--checkpoint", str(checkpoint), "--data", str(data), "--quiet"]
    assert sharpness_main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_the_command_line_measures_a_bert_checkpoint_on_sentence_pairs(cli_files, tmp_path):
    check_command_line(f"bert:config={CONFIG}", cli_files / "bert.safetensors", cli_files / "pairs.npz", _model(),
                       tmp_path / "r.json")  # fmt: skip


@pytest.mark.parametrize("model, data, fragment", [
    ("bert", "pairs", "number of heads"),
    ("bert:heads=3", "pairs", "not a multiple of heads=3"),
    ("bert:heads=2,act=swish", "pairs", "hidden_act 'swish'"),
    ("bert:heads=2", "long", "ids, token types and attention mask"),
    ("bert:heads=2", "empty", "hold no tokens"),
    ("bert:heads=2", "nocls", "leaves out a sequence's first token"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, tmp_path, capsys, model, data,
                                                                    fragment):  # fmt: skip
    _, f = _checkpoint()
    bad = {"long": f["__pairs"].repeat(1, 2, 1)[:, :4], "nocls": f["__pairs"].clone(),
           "empty": torch.zeros(4, 3, 0, dtype=torch.long)}
    bad["nocls"][0, 2, 0] = 0
    path = cli_files / "pairs.npz"
    if data in bad:
        path = tmp_path / f"{data}.npz"
        np.savez(path, X=bad[data].numpy(), y=LABELS.numpy())
    check_refusal(model, cli_files / "bert.safetensors", path, fragment, capsys)
