"""`sharpness.OPT` against HuggingFace's ``OPTForCausalLM``: the logits of three tiny random checkpoints that
``transformers`` 5.24 wrote (``tests/data/make_opt_tiny_hf.py``: OPT-125m's layout, LayerNorms before the branches,
ReLU, a tied head; OPT-350m's, LayerNorms after the sums, token embeddings projected in and out, here untied, GELU, no
biases; LayerNorms without affine parameters and no final one), the checkpoint's key forms, the symmetry group read off
the model (GL per head, the LayerNorms' trades, the ReLU units; the head tied to the table pins the last LayerNorm), a
hand-built element of it, its R-operator products, the command line's ``--model opt:config=PATH`` and
``from_transformers``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from decoder_twins import DATA, check_command_line, check_r_operator_products
from decoder_twins import fixture_config as _config
from decoder_twins import load_fixture as _checkpoint
from test_from_transformers import _stand_in
from test_gpt2 import check_a_random_element
from test_transformer_quotient import measure_value
from torch import nn

import manifolds
from sharpness import OPT, euclidean_sharpness, from_transformers
from sharpness._cli import main as sharpness_main

PRE, POST, PLAIN = "opt_tiny_hf", "opt_tiny_post_hf", "opt_tiny_plain_hf"  # width 32, 2 heads of 16, 2 blocks, MLP 40
LAYERS, WIDTH, HD, HEADS, FFN = 2, 32, 16, 2, 40


def _model(stem: str, classes_last: bool = True, state=None) -> OPT:
    return OPT.from_config(_config(stem), _checkpoint(stem)[0] if state is None else state, classes_last)


def _tied_350m(classes_last: bool = False) -> OPT:
    """OPT-350m's layout with its head tied to the token table, as every OPT checkpoint has it: the fixture's weights
    without ``lm_head.weight``."""
    state = {k: v for k, v in _checkpoint(POST)[0].items() if k != "lm_head.weight"}
    return OPT.from_config({**_config(POST), "tie_word_embeddings": True}, state, classes_last)


@pytest.mark.parametrize("stem", [PRE, POST, PLAIN])
def test_the_logits_are_huggingface_s(stem):
    """transformers' eager softmax computes in float32 even in a float64 model: the logits agree to float32's rounding
    (measured 4.8e-7, 6.0e-7 and 1.8e-6 of logits up to 6.4, 6.8 and 48); a LayerNorm layout, projection or activation
    read wrong moves them by far more."""
    state, ids, logits = _checkpoint(stem)
    model = _model(stem)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5 * max(1.0, float(logits.abs().max()) / 8))
        torch.testing.assert_close(_model(stem, classes_last=False)(ids), logits.transpose(1, 2), rtol=0,
                                   atol=1e-5 * max(1.0, float(logits.abs().max()) / 8))  # fmt: skip
    decoder, layer = model.model.decoder, model.model.decoder.layers[0]
    held = (layer.before, decoder.project_in is not None, decoder.final_layer_norm is not None,
            layer.fc1.bias is not None, layer.final_layer_norm.weight is not None, layer.activation,
            model.lm_head.weight is decoder.embed_tokens.weight)  # fmt: skip
    assert held == {PRE: (True, False, True, True, True, "relu", True),
                    POST: (False, True, False, False, True, "gelu", False),
                    PLAIN: (True, False, False, True, False, "gelu_new", True)}[stem]  # fmt: skip
    assert decoder.embed_tokens.padding_idx == 1


def test_other_key_forms_load_the_same_model():
    """``OPTModel``'s keys (no ``model.`` prefix), ``OPTDecoder``'s (no ``model.decoder.``), and a head saved beside
    the table it is tied to: the same logits."""
    state, ids, logits = _checkpoint(PRE)
    config = _config(PRE)
    forms = [{k.removeprefix("model."): v for k, v in state.items()},
             {k.removeprefix("model.decoder."): v for k, v in state.items()},
             {**state, "lm_head.weight": state["model.decoder.embed_tokens.weight"].clone()}]  # fmt: skip
    with torch.no_grad():
        for form in forms:
            torch.testing.assert_close(OPT.from_config(config, form)(ids), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stem, free", [
    (PRE, 2 * (2 * WIDTH + FFN)),  # per block both LayerNorms' trades and the ReLU units
    (POST, WIDTH + 2 * 24 * 24),  # the last final LayerNorm against project_out; GL on the table's and project_out's
    ("tied", WIDTH + 24 * 24),  # the same LayerNorm; one GL on the table's features, project_in, project_out and head
    (PLAIN, 0),
])  # fmt: skip
def test_the_group_holds_gl_per_head_and_the_trades_the_layout_allows(stem, free):
    """Per block and head, GL(hd) on query/key and on value/output; beyond them ``free`` dimensions: OPT-125m's layout
    trades each LayerNorm against the layers reading it and keeps the ReLU units free, its last LayerNorm pinned by the
    head tied to the token table; OPT-350m's trades only the last block's final LayerNorm (its output goes to
    ``project_out`` alone), has GL(24) on the token table's features against ``project_in``'s columns and, with the
    head untied, GL(24) on ``project_out``'s outputs against the head's columns; tied, one GL(24) moves the table's
    columns, ``project_in``'s columns and ``project_out``'s rows. LayerNorms without affine parameters and GELU leave
    nothing. A random element keeps the logits and the symmetry measure and moves Euclidean sharpness."""
    ids = _checkpoint(POST if stem == "tied" else stem)[1]
    model = _tied_350m() if stem == "tied" else _model(stem, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    assert sym.dim == LAYERS * 2 * HEADS * HD * HD + free, sym.describe()
    assert sum("query/key" in f.label for f in sym.factors) == sum("value/output" in f.label for f in sym.factors) == 4
    check_a_random_element(model, sym, ids)


def test_a_hand_built_trade_of_relu_units_and_a_layer_norm_keeps_the_function_and_the_measure():
    """By hand, not by the toolkit: block 0's ReLU units times ``c`` (``fc1``'s rows and bias) and ``fc2``'s columns
    over ``c``, and block 1's attention LayerNorm times ``d`` (weight and bias) with the columns of ``q``, ``k`` and
    ``v`` over ``d``: the logits are unchanged (1e-12 relative) and so is the symmetry measure (1e-8), while Euclidean
    sharpness moves."""
    state, ids, _ = _checkpoint(PRE)
    model = _model(PRE, classes_last=False)
    g = torch.Generator().manual_seed(3)
    c, d = (torch.exp(0.7 * torch.randn(n, generator=g, dtype=torch.float64)) for n in (FFN, WIDTH))
    moved = copy.deepcopy(model)
    with torch.no_grad():
        first, second = moved.model.decoder.layers[0], moved.model.decoder.layers[1]
        first.fc1.weight.mul_(c[:, None])
        first.fc1.bias.mul_(c)
        first.fc2.weight.div_(c)
        second.self_attn_layer_norm.weight.mul_(d)
        second.self_attn_layer_norm.bias.mul_(d)
        for proj in (second.self_attn.q_proj, second.self_attn.k_proj, second.self_attn.v_proj):
            proj.weight.div_(d)
        before, after = model(ids), moved(ids)
        assert float((after - before).abs().max()) <= 1e-12 * float(before.abs().max())
    loss, data = nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1))
    m0, m1 = measure_value(model, loss, data)[0], measure_value(moved, loss, data)[0]
    assert abs(m1 - m0) <= 1e-8 * abs(m0), (m0, m1)
    e0, e1 = (euclidean_sharpness(m, loss, data, dtype=torch.float64, progress=False).value for m in (model, moved))
    assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


@pytest.mark.parametrize("stem", [PRE, POST, PLAIN])
def test_the_products_are_the_r_operator_s(stem):
    check_r_operator_products(_model(stem, classes_last=False), _checkpoint(stem)[1])


def test_the_command_line_reads_the_checkpoint_and_its_config(tmp_path, capsys):
    state, _, _ = _checkpoint(POST)
    check_command_line(tmp_path, capsys, state, "opt", DATA / (POST + ".json"), _model(POST, classes_last=False))
    np.savez(tmp_path / "long.npz", X=torch.zeros(2, 17, dtype=torch.int64).numpy(),
             y=torch.zeros(2, 17, dtype=torch.int64).numpy())  # fmt: skip
    long = ["compute", "--checkpoint", str(tmp_path / "model.safetensors"), "--data", str(tmp_path / "long.npz"),
            "--metric", "euclidean", "--quiet", "--model", f"opt:config={DATA / (POST + '.json')}"]  # fmt: skip
    assert sharpness_main(long) == 2
    err = capsys.readouterr().err
    assert "longer than its 16 positions" in err and "Traceback" not in err, err


@pytest.mark.parametrize("changed, fragment", [
    ({"activation_function": "gelu_fast"}, "activation_function is 'gelu_fast'"),
    ({"activation_function": ["relu"]}, "activation_function is \\['relu'\\]"),
    ({"do_layer_norm_before": "yes"}, "do_layer_norm_before must be true or false"),
    ({"num_attention_heads": 3}, "not a multiple of heads=3"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"hidden_size": 64}, "hidden_size is 64 but the checkpoint's tensors hold 32"),
    ({"word_embed_proj_dim": 24}, "word_embed_proj_dim is 24 but the checkpoint's tensors hold 32"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but the checkpoint's tensors hold 2"),
    ({"ffn_dim": 48}, "ffn_dim is 48"),
    ({"vocab_size": 30}, "vocab_size is 30"),
    ({"max_position_embeddings": 32}, "max_position_embeddings is 32 but the checkpoint's tensors hold 16"),
    ({"enable_bias": False}, "enable_bias is False but the checkpoint's tensors hold True"),
    ({"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine is False"),
    ({"pad_token_id": 29}, "pad_token_id must be a token id in \\[-29, 29\\)"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings is false but the state dict has no lm_head.weight"),
])  # fmt: skip
def test_a_config_the_model_cannot_compute_is_refused(changed, fragment):
    state, _, _ = _checkpoint(PRE)
    with pytest.raises(ValueError, match=fragment):
        OPT.from_config({**_config(PRE), **changed}, state)


def test_a_pad_token_of_null_builds_the_table_without_a_fixed_row():
    state, ids, logits = _checkpoint(PRE)
    model = OPT.from_config({**_config(PRE), "pad_token_id": None}, state)
    assert model.model.decoder.embed_tokens.padding_idx is None
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)


def test_from_transformers_reads_an_opt_causal_lm():
    state, ids, logits = _checkpoint(POST)
    twin = from_transformers(_stand_in("OPTForCausalLM", _config(POST), state))
    assert isinstance(twin, OPT)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"reads \*OPTForCausalLM"):
        from_transformers(_stand_in("OPTModel", _config(POST), state))


def test_the_final_layer_norm_is_read_as_transformers_reads_it():
    """Without affine parameters no tensor shows whether the decoder ends with a LayerNorm: `from_state_dict` asks for
    ``final_norm`` (before, it built one, 0.32 off transformers' logits); `from_config` reads it off the config. A
    checkpoint holding a final LayerNorm the layout does not build (OPT-350m's after-norm blocks) loads without it,
    as transformers ignores those tensors."""
    state, ids, logits = _checkpoint(PLAIN)
    with pytest.raises(ValueError, match="pass final_norm"):
        OPT.from_state_dict(state, heads=HEADS, activation="gelu_new")
    with torch.no_grad():
        twin = OPT.from_state_dict(state, heads=HEADS, activation="gelu_new", final_norm=False)
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=2e-5)
        post, post_ids, post_logits = _checkpoint(POST)
        extra = {**post, "model.decoder.final_layer_norm.weight": torch.ones(WIDTH, dtype=torch.float64),
                 "model.decoder.final_layer_norm.bias": torch.zeros(WIDTH, dtype=torch.float64)}  # fmt: skip
        torch.testing.assert_close(OPT.from_config(_config(POST), extra)(post_ids), post_logits, rtol=0, atol=1e-5)


def test_a_hand_built_basis_change_of_the_tied_table_keeps_the_function_and_the_measure():
    """By hand: the tied table's columns times ``M^T``, ``project_in``'s columns times ``M^-1`` and ``project_out``'s
    rows ``M^-T`` times: the looked-up rows become ``x M^T``, which ``project_in`` reads as before, and the logits
    ``(y M^-1)(E M^T)^T = y E^T``. The logits stay (1e-12 relative) and so does the symmetry measure (1e-8)."""
    model = _tied_350m()
    ids = _checkpoint(POST)[1]
    g = torch.Generator().manual_seed(4)
    m = torch.eye(24, dtype=torch.float64) + 0.3 * torch.randn(24, 24, generator=g, dtype=torch.float64)
    moved = copy.deepcopy(model)
    decoder = moved.model.decoder
    with torch.no_grad():
        decoder.embed_tokens.weight.copy_(decoder.embed_tokens.weight @ m.T)
        decoder.project_in.weight.copy_(decoder.project_in.weight @ torch.linalg.inv(m))
        decoder.project_out.weight.copy_(torch.linalg.inv(m).T @ decoder.project_out.weight)
        assert moved.lm_head.weight is decoder.embed_tokens.weight
        before, after = model(ids), moved(ids)
        assert float((after - before).abs().max()) <= 1e-12 * float(before.abs().max())
    loss, data = nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1))
    m0, m1 = measure_value(model, loss, data)[0], measure_value(moved, loss, data)[0]
    assert abs(m1 - m0) <= 1e-8 * abs(m0), (m0, m1)
