"""`sharpness.GPT2` against HuggingFace's ``GPT2LMHeadModel``: the logits of a tiny random checkpoint that the
``transformers`` library wrote (``tests/data/make_gpt2_tiny_hf.py``), the checkpoint's key forms, and the symmetry
group the toolkit reads off the model (per head GL(hd) on query/key and value/output, the LayerNorm trades)."""

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
from sharpness import GPT2, euclidean_sharpness
from sharpness._cli import main as sharpness_main

CHECKPOINT = Path(__file__).parent / "data" / "gpt2_tiny_hf.safetensors"
HEADS, HD, LAYERS, WIDTH = 2, 8, 2, 16


def _checkpoint():
    state = load_file(str(CHECKPOINT))
    return state, state.pop("__input_ids"), state.pop("__logits")


def test_the_logits_are_huggingface_s():
    state, ids, logits = _checkpoint()
    model = GPT2.from_state_dict(state, heads=HEADS)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-12)
        # the same logits classes second, as nn.CrossEntropyLoss reads them against (N, T) targets
        across = GPT2.from_state_dict(state, heads=HEADS, classes_last=False)(ids)
        torch.testing.assert_close(across, logits.transpose(1, 2), rtol=0, atol=1e-12)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_checkpoint_key_forms():
    state, ids, logits = _checkpoint()
    bare = {k.removeprefix("transformer."): v for k, v in state.items()}  # GPT2Model's keys
    bare["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # an older checkpoint's causal mask: dropped
    with_head = dict(state, **{"lm_head.weight": state["transformer.wte.weight"].clone()})
    for form in (bare, with_head):
        with torch.no_grad():
            torch.testing.assert_close(GPT2.from_state_dict(form, heads=HEADS)(ids), logits, rtol=0, atol=1e-12)
    untied = dict(state, **{"lm_head.weight": state["transformer.wte.weight"] + 1})
    with pytest.raises(ValueError, match="untied"):
        GPT2.from_state_dict(untied, heads=HEADS)
    short = {k: v for k, v in state.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(ValueError, match="missing"):
        GPT2.from_state_dict(short, heads=HEADS)
    with pytest.raises(ValueError, match="no 'transformer.wpe.weight'"):
        GPT2.from_state_dict({k: v for k, v in state.items() if "wpe" not in k}, heads=HEADS)


def test_the_group_and_the_invariant_measure():
    state, ids, _ = _checkpoint()
    model = GPT2.from_state_dict(state, heads=HEADS, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    labels = [f.label for f in sym.factors]
    # per block and head GL(hd) on query/key and on value/output; both LayerNorms traded; the final one is read by
    # the output layer, which shares the embedding's weight, and GELU pins the MLP's units
    assert sum("query/key" in la for la in labels) == sum("value/output" in la for la in labels) == LAYERS * HEADS
    assert sym.dim == 2 * LAYERS * HEADS * HD * HD + 2 * LAYERS * WIDTH, sym.describe()
    moved = {b.name for f in sym.factors for b in f.blocks}
    assert not moved & {"lm_head.weight", "transformer.wte.weight", "transformer.ln_f.weight"}, sym.describe()
    check_a_random_element(model, sym, ids)


def check_a_random_element(model: nn.Module, sym, ids: torch.Tensor) -> None:
    """A random element of ``sym`` keeps the logits of the token model (logits ``(N, V, T)``) to 1e-10 and its symmetry
    measure on next-token targets to 1e-8, while Euclidean sharpness moves by more than 1.5x."""
    loss, data = nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1))
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        assert (moved(ids) - model(ids)).abs().max() < 1e-10
    before, after = measure_value(model, loss, data)[0], measure_value(moved, loss, data)[0]
    assert abs(after - before) <= 1e-8 * abs(before), (before, after)
    e0 = euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    e1 = euclidean_sharpness(moved, loss, data, dtype=torch.float64, progress=False).value
    assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """The fixture as a ``GPT2Model`` checkpoint (keys without the ``transformer.`` prefix) and token data: ids ``X``
    and next tokens ``y``, ``(N, T)`` integers; float ids, and ids outside the vocabulary."""
    d = tmp_path_factory.mktemp("gpt2cli")
    state, _, _ = _checkpoint()
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, str(d / "gpt2.safetensors"))
    X = torch.randint(0, 23, (12, 8), generator=torch.Generator().manual_seed(0))
    y = torch.roll(X, -1, dims=1)
    np.savez(d / "tokens.npz", X=X.numpy(), y=y.numpy())
    np.savez(d / "floats.npz", X=X.float().numpy(), y=y.numpy())
    np.savez(d / "outside.npz", X=(X + 30).numpy(), y=y.numpy())
    return d


def test_the_command_line_measures_a_gpt2_checkpoint_on_token_data(cli_files, tmp_path):
    out = tmp_path / "r.json"
    argv = ["compute", "--model", "gpt2:heads=2", "--checkpoint", str(cli_files / "gpt2.safetensors"), "--data",
            str(cli_files / "tokens.npz"), "--metric", "euclidean", "--metric", "symmetry", "--quiet", "--json",
            str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["measures"]["symmetry"]["value"] > 0 and report["measures"]["euclidean"]["value"] > 0
    # the same value as the library's measure of the model the checkpoint gives
    state, _, _ = _checkpoint()
    model = GPT2.from_state_dict(state, heads=HEADS, classes_last=False)
    data = np.load(cli_files / "tokens.npz")
    expected = measure_value(model, nn.CrossEntropyLoss(), (torch.from_numpy(data["X"]), torch.from_numpy(data["y"])))
    assert report["measures"]["symmetry"]["value"] == pytest.approx(float(expected[0]), rel=1e-6)


@pytest.mark.parametrize("model, data, fragment", [
    ("gpt2:heads=2", "floats.npz", "give integer ids"),
    ("gpt2:heads=2", "outside.npz", "outside its vocabulary 0..22"),
    ("gpt2", "tokens.npz", "number of heads"),
    ("gpt2:heads=3", "tokens.npz", "not a multiple of heads=3"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, capsys, model, data, fragment):
    argv = ["compute", "--model", model, "--checkpoint", str(cli_files / "gpt2.safetensors"), "--data",
            str(cli_files / data), "--quiet"]  # fmt: skip
    assert sharpness_main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_the_command_line_reads_older_checkpoints_and_refuses_odd_ones(cli_files, tmp_path, capsys):
    state, _, _ = _checkpoint()
    old = dict(state)
    old["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.uint8))  # an older mask buffer
    save_file(old, str(tmp_path / "old.safetensors"))
    flat = dict(state, **{"transformer.wpe.weight": torch.zeros(())})
    save_file(flat, str(tmp_path / "flat.safetensors"))
    tokens = str(cli_files / "tokens.npz")
    common = ["--data", tokens, "--metric", "euclidean", "--quiet"]
    assert sharpness_main(["compute", "--model", "gpt2:heads=2", "--checkpoint", str(tmp_path / "old.safetensors"),
                           *common]) == 0  # fmt: skip
    for model, checkpoint, fragment in [("gpt2:heads=2", "flat.safetensors", "embeddings are matrices"),
                                        ("gpt2:heads=2,eps=inf", "old.safetensors", "positive finite number")]:
        capsys.readouterr()
        assert sharpness_main(["compute", "--model", model, "--checkpoint", str(tmp_path / checkpoint), *common]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err


def test_the_command_line_reads_the_checkpoint_s_config(cli_files, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"n_head": HEADS, "layer_norm_epsilon": 1e-5,
                                                      "activation_function": "gelu_new"}))  # fmt: skip
    common = ["--checkpoint", str(cli_files / "gpt2.safetensors"), "--data", str(cli_files / "tokens.npz"), "--metric",
              "euclidean", "--quiet", "--json"]  # fmt: skip
    values = []
    for spec in (f"gpt2:config={tmp_path / 'config.json'}", "gpt2:heads=2"):
        out = tmp_path / f"{len(values)}.json"
        assert sharpness_main(["compute", "--model", spec, *common, str(out)]) == 0
        values.append(json.loads(out.read_text())["measures"]["euclidean"]["value"])
    assert values[0] == values[1]
    for bad, fragment in [({"n_embd": 16}, "n_head must be a positive integer"),
                          ({"n_head": 2, "scale_attn_by_inverse_layer_idx": True}, "does not compute"),
                          ({"n_head": 2, "scale_attn_weights": False}, "does not compute")]:  # fmt: skip
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        capsys.readouterr()
        assert sharpness_main(["compute", "--model", f"gpt2:config={tmp_path / 'bad.json'}", *common[:-1]]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err
