"""`sharpness.HFDeiT` against HuggingFace's ``DeiTForImageClassification`` and
``DeiTForImageClassificationWithTeacher``: the logits of tiny random checkpoints that the ``transformers`` library wrote
(``tests/data/make_deit_tiny_hf.py``: 8x8 one-channel images in 2x2 patches after the class and distillation tokens, 2
pre-LayerNorm blocks of width 16 with 2 heads, 10 classes), under transformers 5's keys and the older ones; the
symmetry group the toolkit reads off them (with the teacher's two heads, the final LayerNorm traded against both
through their tokens), checked with elements built here by hand; the command line's ``--model deit:config=PATH``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bert import check_command_line, check_invariance, check_refusal, move_heads
from test_hfvit import _old_keys

import manifolds
from sharpness import HFDeiT, from_transformers

DATA = Path(__file__).parent / "data"
CONFIG = DATA / "deit_tiny_hf.json"
STEMS = {"plain": "deit_tiny_hf", "teacher": "deit_teacher_tiny_hf"}
LAYERS, WIDTH, HEADS, HD = 2, 16, 2, 8
LABELS = torch.tensor([0, 3, 9, 3, 1])


def _checkpoint(kind: str):
    state = load_file(str(DATA / f"{STEMS[kind]}.safetensors"))
    return state, state.pop("__images"), state.pop("__logits")


def _model(kind: str, state=None) -> HFDeiT:
    return HFDeiT.from_config(json.loads(CONFIG.read_text()), _checkpoint(kind)[0] if state is None else state)


@pytest.mark.parametrize("kind", STEMS)
def test_the_logits_are_huggingface_s_under_either_key_form(kind):
    """HuggingFace's eager attention (the fixtures') computes the softmax in float32 even in a float64 model: the
    logits agree to float32's rounding (measured 1.3e-7 and 2.4e-7 of logits up to 2.8)."""
    state, images, logits = _checkpoint(kind)
    old = _old_keys(state)
    assert "deit.encoder.layer.1.attention.attention.query.weight" in old
    for model in (_model(kind), _model(kind, old), HFDeiT.from_state_dict(old, heads=HEADS, eps=1e-6)):
        assert hasattr(model, "cls_classifier") == (kind == "teacher")
        with torch.no_grad():
            torch.testing.assert_close(model(images), logits, rtol=0, atol=1e-6)
    with torch.no_grad():  # the distillation token matters: without it the positions do not fit
        plain = _model(kind)
        plain.deit.embeddings.distillation_token.zero_()
        assert (plain(images) - logits).abs().max() > 1e-3


def test_what_does_not_fit_is_refused_with_the_reason():
    state, _, _ = _checkpoint("teacher")
    with pytest.raises(ValueError, match=r"DeiTForImageClassification\(WithTeacher\) checkpoint has one"):
        HFDeiT.from_state_dict({k: v for k, v in state.items() if "classifier" not in k}, heads=HEADS)
    with pytest.raises(ValueError, match="DeiTModel"):
        HFDeiT.from_state_dict({k.removeprefix("deit."): v for k, v in state.items()}, heads=HEADS)
    vit = {k.replace("deit.", "vit."): v for k, v in state.items() if "distillation" not in k}
    with pytest.raises(ValueError, match="no 4-axis tensor deit.embeddings"):
        HFDeiT.from_state_dict(vit, heads=HEADS)
    with pytest.raises(ValueError, match="num_labels is 5"):
        HFDeiT.from_config({**json.loads(CONFIG.read_text()), "num_labels": 5}, state)


def _hand_built(model: HFDeiT, g: torch.Generator) -> HFDeiT:
    """A copy moved by an element built here: per head of the second block ``A`` on query/key and ``B`` on
    value/output, and the final LayerNorm's scale and shift times ``c > 0`` traded against both heads' columns (the
    class token's and the distillation token's)."""
    moved = HFDeiT.from_state_dict(model.state_dict(), heads=HEADS, eps=1e-6)
    attn = moved.deit.layers[1].attention
    move_heads(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, g)
    with torch.no_grad():
        c = torch.rand(WIDTH, generator=g, dtype=torch.float64) * 3 + 0.2
        moved.deit.layernorm.weight.mul_(c), moved.deit.layernorm.bias.mul_(c)
        for head in (moved.cls_classifier, moved.distillation_classifier):
            head.weight.div_(c)
    return moved


def test_the_teacher_s_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and on value/output (512), and every LayerNorm traded (pre-LayerNorm
    blocks: 4 x 16, and the final one against both heads, 16). A random element and one built by hand keep the
    logits and the symmetry measure, while Euclidean sharpness moves."""
    _, images, _ = _checkpoint("teacher")
    model = _model("teacher")
    sym = manifolds.transformer_symmetry(model, images)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + (2 * LAYERS + 1) * WIDTH, sym.describe()
    final = [f for f in sym.factors if "deit.layernorm'" in f.label]
    assert len(final) == 1 and {b.name for b in final[0].blocks} >= {"cls_classifier.weight",
                                                                     "distillation_classifier.weight"}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    check_invariance(model, [sym.transformed(model, sym.random_element(1.0, g)), _hand_built(model, g)],
                     (images, LABELS))  # fmt: skip


class _Config:
    def __init__(self, settings: dict):
        self.settings = settings

    def to_dict(self) -> dict:
        return dict(self.settings)


@pytest.mark.parametrize("kind, name", [("plain", "DeiTForImageClassification"),
                                        ("teacher", "DeiTForImageClassificationWithTeacher")])  # fmt: skip
def test_from_transformers_reads_both_classes(kind, name):
    state, images, logits = _checkpoint(kind)
    stand_in = type(name, (torch.nn.Module,), {})()
    stand_in.config, stand_in.state_dict = _Config(json.loads(CONFIG.read_text())), lambda: dict(state)
    with torch.no_grad():
        torch.testing.assert_close(from_transformers(stand_in)(images), logits, rtol=0, atol=1e-6)
    base = type("DeiTModel", (torch.nn.Module,), {})()
    base.config, base.state_dict = stand_in.config, stand_in.state_dict
    with pytest.raises(ValueError, match=r"reads \*DeiTForImageClassification or \*DeiTForImageClassificationWith"):
        from_transformers(base)


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("deitcli")
    state, images, _ = _checkpoint("teacher")
    save_file(state, str(d / "deit.safetensors"))
    np.savez(d / "images.npz", X=images.numpy(), y=LABELS.numpy())
    return d


def test_the_command_line_measures_a_deit_checkpoint(cli_files, tmp_path):
    check_command_line(f"deit:config={CONFIG}", cli_files / "deit.safetensors", cli_files / "images.npz",
                       _model("teacher"), tmp_path / "r.json")  # fmt: skip


@pytest.mark.parametrize("model, fragment", [("deit", "number of heads"), ("hfvit:heads=2", "no 4-axis tensor vit.")])
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, capsys, model, fragment):
    check_refusal(model, cli_files / "deit.safetensors", cli_files / "images.npz", fragment, capsys)
