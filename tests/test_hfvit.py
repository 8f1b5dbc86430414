"""`sharpness.HFViT` against HuggingFace's ``ViTForImageClassification``: the logits of a tiny random checkpoint that
the ``transformers`` library wrote (``tests/data/make_hfvit_tiny_hf.py``: 8x8 one-channel images in 2x2 patches, 2
pre-LayerNorm blocks of width 16 with 2 heads, 10 classes), under transformers 5's keys and the older ones; the
symmetry group the toolkit reads off it, its products by every strategy against the dense Hessian, and the command
line's ``--model hfvit:config=PATH``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_transformer_quotient import measure_value
from torch import nn

import manifolds
from sharpness import HFViT, Objective, euclidean_sharpness
from sharpness._cli import main as sharpness_main
from sharpness.products._reference import dense_hessian

DATA = Path(__file__).parent / "data"
CHECKPOINT, CONFIG = DATA / "hfvit_tiny_hf.safetensors", DATA / "hfvit_tiny_hf.json"
LAYERS, WIDTH, HEADS, HD = 2, 16, 2, 8
LABELS = torch.tensor([0, 3, 9, 3, 1])
# transformers 5's keys -> those of transformers 4 (the checkpoints on the Hub)
OLD = ((r"\.layers\.", ".encoder.layer."), (r"\.attention\.(q|k|v)_proj\.", None),
       (r"\.attention\.o_proj\.", ".attention.output.dense."), (r"\.mlp\.fc1\.", ".intermediate.dense."),
       (r"\.mlp\.fc2\.", ".output.dense."))  # fmt: skip
FULL = {"q": "query", "k": "key", "v": "value"}


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    return state, state.pop("__images"), state.pop("__logits")


def _model(state=None) -> HFViT:
    return HFViT.from_config(json.loads(CONFIG.read_text()), _checkpoint()[0] if state is None else state)


def _old_keys(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        for pattern, name in OLD:
            key = re.sub(pattern, name or (lambda m: f".attention.attention.{FULL[m.group(1)]}."), key)
        out[key] = value
    return out


def test_the_logits_are_huggingface_s_under_either_key_form():
    """HuggingFace's eager attention (the fixture's) computes the softmax in float32 even in a float64 model, so the
    logits agree to float32's rounding (measured 9e-8 of logits up to 1.6)."""
    state, images, logits = _checkpoint()
    old = _old_keys(state)
    assert {"vit.encoder.layer.1.attention.attention.query.weight", "vit.encoder.layer.0.output.dense.bias"} <= set(old)
    for model in (_model(), _model(old), HFViT.from_state_dict(old, heads=HEADS, eps=1e-6)):
        with torch.no_grad():
            torch.testing.assert_close(model(images), logits, rtol=0, atol=1e-6)
    with torch.no_grad():  # a wrong eps or head count moves them
        for heads, eps in ((HEADS, 0.1), (4, 1e-6)):
            wrong = HFViT.from_state_dict(state, heads=heads, eps=eps)
            assert (wrong(images) - logits).abs().max() > 1e-4


def test_what_does_not_fit_is_refused_with_the_reason():
    state, _, _ = _checkpoint()
    config = json.loads(CONFIG.read_text())
    for change, fragment in [({"hidden_act": "silu"}, "hidden_act"),
                             ({"image_size": 16}, "does not give the checkpoint's 4 x 4 patches of 2"),
                             ({"image_size": [8, 16]}, "square images"),
                             ({"num_attention_heads": 3}, "multiple of heads"), ({"qkv_bias": False}, "qkv_bias"),
                             ({"num_hidden_layers": 3}, "num_hidden_layers is 3"),
                             ({"num_labels": 5}, "num_labels is 5")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            HFViT.from_config({**config, **change}, state)
    with pytest.raises(ValueError, match="ViTModel"):
        HFViT.from_state_dict({k.removeprefix("vit."): v for k, v in state.items() if "classifier" not in k}, heads=2)
    # sizes as transformers also writes them, and an image side the stride does not divide (the last row and column
    # left out, as transformers' convolution leaves them)
    images = torch.randn(2, 1, 9, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    model, nine = _model(), HFViT.from_config({**config, "image_size": 9, "patch_size": [2, 2]}, state)
    with torch.no_grad():
        torch.testing.assert_close(nine(images), model(images[..., :8, :8]), rtol=0, atol=0)
    for bad in (images, torch.zeros(2, 1, 4, 16, dtype=torch.float64)):  # the second has 8 x 8's 16 patches
        with pytest.raises(ValueError, match=r"takes images \(N, 1, 8, 8\)"):
            model.check_inputs(bad)
    nine.check_inputs(images)
    headless = {k: v for k, v in state.items() if not k.startswith("classifier")}
    with pytest.raises(ValueError, match="ViTForImageClassification"):
        HFViT.from_state_dict(headless, heads=HEADS)
    with pytest.raises(ValueError, match="unknown"):
        HFViT.from_state_dict({**state, "vit.pooler.dense.weight": torch.zeros(16, 16)}, heads=HEADS)


def test_the_group_and_the_invariant_measure():
    """Per block and head GL(8) on query/key and value/output (512), and every LayerNorm traded (pre-LayerNorm:
    against the query, key and value projections, the first MLP layer, and the last against the classifier through the
    class token, ``x[:, 0]``): 5 x 16. A random element keeps the logits and the symmetry measure; Euclidean sharpness
    moves."""
    _, images, _ = _checkpoint()
    model = _model()
    sym = manifolds.transformer_symmetry(model, images)
    assert sym.dim == LAYERS * HEADS * 2 * HD * HD + (2 * LAYERS + 1) * WIDTH, sym.describe()
    assert "classifier.weight" in {b.name for f in sym.factors for b in f.blocks}
    loss, data = nn.CrossEntropyLoss(), (images, LABELS)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        fresh = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        assert (moved(fresh) - model(fresh)).abs().max() < 1e-10
    before, after = float(measure_value(model, loss, data)[0]), float(measure_value(moved, loss, data)[0])
    assert abs(after - before) <= 1e-8 * abs(before), (before, after)
    e0 = euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    e1 = euclidean_sharpness(moved, loss, data, dtype=torch.float64, progress=False).value
    assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


def test_every_product_strategy_is_the_dense_hessian_s():
    """The patch embedding is a convolution of the data, which the autograd strategies take through a path of their
    own (`sharpness.products._data_conv`); before, that path ran the attention through a fused kernel without second
    derivatives and "graph" and "double_backward" failed on a ViT."""
    _, images, _ = _checkpoint()
    obj = Objective(_model(), nn.CrossEntropyLoss(), (images, LABELS))
    assert obj.hvp_strategy() == "rop" and obj._data_conv is not None
    H = dense_hessian(obj)
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = H @ v
    for strategy in ("auto", "graph", "double_backward", "jvp"):
        torch.testing.assert_close(obj.hvp(v, strategy), ref, rtol=0, atol=1e-11 * float(ref.abs().max()))


def test_the_command_line_measures_a_vit_checkpoint(tmp_path, capsys):
    state, images, _ = _checkpoint()
    save_file(_old_keys(state), str(tmp_path / "vit.safetensors"))  # as the Hub's checkpoints name them
    np.savez(tmp_path / "images.npz", X=images.numpy(), y=LABELS.numpy())
    out = tmp_path / "r.json"
    argv = ["compute", "--model", f"hfvit:config={CONFIG}", "--checkpoint", str(tmp_path / "vit.safetensors"),
            "--data", str(tmp_path / "images.npz"), "--metric", "symmetry", "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    expected = measure_value(_model(), nn.CrossEntropyLoss(), (images, LABELS))
    assert json.loads(out.read_text())["measures"]["symmetry"]["value"] == pytest.approx(float(expected[0]), rel=1e-6)
    np.savez(tmp_path / "flat.npz", X=images.reshape(5, -1).numpy(), y=LABELS.numpy())
    np.savez(tmp_path / "wide.npz", X=images.reshape(5, 1, 4, 16).numpy(), y=LABELS.numpy())  # as many patches
    for name in ("flat", "wide"):
        argv[argv.index("--data") + 1] = str(tmp_path / f"{name}.npz")
        assert sharpness_main(argv[:-2]) == 2
        err = capsys.readouterr().err
        assert "the model takes images (N, 1, 8, 8)" in err and "Traceback" not in err, err
