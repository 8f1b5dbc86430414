"""`sharpness.GPTNeoX` against HuggingFace's ``GPTNeoXForCausalLM`` (EleutherAI's Pythia layout): the logits of two tiny
random checkpoints that ``transformers`` 5.24 wrote (``tests/data/make_neox_tiny_hf.py``: parallel residuals with a
quarter of each head rotated; sequential residuals with half of it rotated, no attention biases, GELU's tanh
approximation), the checkpoint's key forms, the symmetry group read off the model (partial rotary embeddings keep
``GL`` on the unturned features), its R-operator products, the command line's ``--model neox:config=PATH`` and
``from_transformers``."""

from __future__ import annotations

import pytest
import torch
from decoder_twins import DATA, check_command_line, check_r_operator_products
from decoder_twins import fixture_config as _config
from decoder_twins import load_fixture as _checkpoint
from test_from_transformers import _stand_in
from test_gpt2 import check_a_random_element

import manifolds
from sharpness import GPTNeoX, from_transformers

PARALLEL, SEQUENTIAL = "neox_tiny_hf", "neox_tiny_sequential_hf"  # width 32, 2 heads of 16, 2 blocks, MLP 40
LAYERS, WIDTH, HD = 2, 32, 16


def _model(stem: str, classes_last: bool = True, state=None) -> GPTNeoX:
    return GPTNeoX.from_config(_config(stem), _checkpoint(stem)[0] if state is None else state, classes_last)


@pytest.mark.parametrize("stem", [PARALLEL, SEQUENTIAL])
def test_the_logits_are_huggingface_s(stem):
    """transformers' eager softmax computes in float32 even in a float64 model: the logits agree to float32's rounding
    (measured 4.0e-7 and 4.6e-7 of logits up to 6.4); a residual layout, rotary share or activation read wrong moves
    them by far more."""
    state, ids, logits = _checkpoint(stem)
    model = _model(stem)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(_model(stem, classes_last=False)(ids), logits.transpose(1, 2), rtol=0, atol=1e-5)
    layer = model.gpt_neox.layers[0]
    assert (layer.parallel, layer.attention.rotary_dims, layer.mlp.activation) == (
        (True, 4, "gelu") if stem == PARALLEL else (False, 8, "gelu_new"))  # fmt: skip
    assert (layer.attention.query_key_value.bias is not None) == (stem == PARALLEL)
    assert model.lm_head.weight is not model.gpt_neox.embed_in.weight


def test_older_checkpoint_keys_and_config_fields_load_the_same_model():
    """Older Pythia checkpoints name the head ``embed_out``, keep the causal-mask and ``inv_freq`` buffers, may drop
    the ``gpt_neox.`` prefix, and their configs say ``rotary_pct`` and ``rotary_emb_base``: the same logits."""
    state, ids, logits = _checkpoint(PARALLEL)
    renamed = {"lm_head.weight": "embed_out.weight"}
    older = {renamed.get(k, k.removeprefix("gpt_neox.")): v for k, v in state.items()}
    for i in range(LAYERS):
        older[f"layers.{i}.attention.bias"] = torch.ones(1, 1, 9, 9, dtype=torch.bool)
        older[f"layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    config = {k: v for k, v in _config(PARALLEL).items() if k != "rope_parameters"}
    config.update(rotary_pct=0.25, rotary_emb_base=10000)
    with torch.no_grad():
        torch.testing.assert_close(GPTNeoX.from_config(config, older)(ids), logits, rtol=0, atol=1e-5)
        default = {k: v for k, v in config.items() if k not in ("rotary_pct", "rotary_emb_base")}  # their defaults
        torch.testing.assert_close(GPTNeoX.from_config(default, older)(ids), logits, rtol=0, atol=1e-5)
        moved = GPTNeoX.from_config({**config, "rotary_pct": 0.5}, older)(ids)
        assert float((moved - logits).abs().max()) > 1e-3


@pytest.mark.parametrize("stem, rotated", [(PARALLEL, 4), (SEQUENTIAL, 8)])
def test_the_group_keeps_gl_on_the_unturned_features(stem, rotated):
    """Per block and head: on query/key, the rotary maps turn ``rotated`` features in pairs (``a I + b J`` on each pair
    commutes with them: 2 per pair) and pass the other ``hd - rotated`` as they are, where all of ``GL`` acts; GL(hd)
    on value/output; both LayerNorms traded (q, k, v's columns; the MLP's), the final one against the untied head.
    GELU pins the MLP's units. A random element keeps the logits and the symmetry measure (1e-10, 1e-8) and moves
    Euclidean sharpness."""
    state, ids, _ = _checkpoint(stem)
    model = _model(stem, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    free = HD - rotated
    query_key = rotated + free * free  # rotated // 2 pairs of 2, then GL(free)
    assert sym.dim == LAYERS * 2 * (query_key + HD * HD) + (2 * LAYERS + 1) * WIDTH, sym.describe()
    assert sum("query/key" in f.label for f in sym.factors) == sum("value/output" in f.label for f in sym.factors) == 4
    check_a_random_element(model, sym, ids)


@pytest.mark.parametrize("stem", [PARALLEL, SEQUENTIAL])
def test_the_products_are_the_r_operator_s(stem):
    check_r_operator_products(_model(stem, classes_last=False), _checkpoint(stem)[1])


def test_the_command_line_reads_the_checkpoint_and_its_config(tmp_path, capsys):
    state, _, _ = _checkpoint(PARALLEL)
    model = _model(PARALLEL, classes_last=False)
    check_command_line(tmp_path, capsys, state, "neox", DATA / (PARALLEL + ".json"), model)



@pytest.mark.parametrize("changed, fragment", [
    ({"hidden_act": "gelu_fast"}, "hidden_act is 'gelu_fast'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "must turn a positive even number"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.25}},
     "depends on the sequence's length"),
    ({"use_parallel_residual": "yes"}, "use_parallel_residual must be true or false"),
    ({"hidden_act": ["gelu"]}, "hidden_act is \\['gelu'\\]"),
    ({"hidden_size": 64}, "does not describe this checkpoint"),
    ({"head_dim": 8}, "head_dim is 8 but the checkpoint's tensors hold 16"),  # transformers would rotate 2 of 16
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but the checkpoint's tensors hold 2"),
    ({"attention_bias": False}, "attention_bias is False but the checkpoint's tensors hold True"),
    ({"intermediate_size": 48}, "intermediate_size is 48"),
    ({"vocab_size": 30}, "vocab_size is 30"),
    ({"num_attention_heads": 3}, "not a multiple of heads=3"),
])  # fmt: skip
def test_a_config_the_model_cannot_compute_is_refused(changed, fragment):
    state, _, _ = _checkpoint(PARALLEL)
    with pytest.raises(ValueError, match=fragment):
        GPTNeoX.from_config({**_config(PARALLEL), **changed}, state)


def test_from_transformers_reads_a_gpt_neox_causal_lm():
    state, ids, logits = _checkpoint(SEQUENTIAL)
    twin = from_transformers(_stand_in("GPTNeoXForCausalLM", _config(SEQUENTIAL), state))
    assert isinstance(twin, GPTNeoX)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"reads \*GPTNeoXForCausalLM"):
        from_transformers(_stand_in("GPTNeoXModel", _config(SEQUENTIAL), state))


def test_rope_scaling_is_taken_whole_in_place_of_rope_parameters_and_an_absent_head_is_refused():
    """As transformers reads a config: a ``rope_scaling`` beside ``rope_parameters`` replaces it (before, the twin read
    ``rope_parameters`` and was 3.7 off); without ``tie_word_embeddings`` the head is untied, so a checkpoint without
    one is refused rather than read as tied."""
    state, ids, _ = _checkpoint(PARALLEL)
    config = _config(PARALLEL)
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    with torch.no_grad():
        both = GPTNeoX.from_config({**config, "rope_scaling": scaled}, state)(ids)
        alone = GPTNeoX.from_config({**config, "rope_parameters": scaled}, state)(ids)
        assert torch.equal(both, alone)
        assert float((both - _model(PARALLEL)(ids)).abs().max()) > 1e-3
    headless = {k: v for k, v in state.items() if k != "lm_head.weight"}
    untold = {k: v for k, v in config.items() if k != "tie_word_embeddings"}
    with pytest.raises(ValueError, match="tie_word_embeddings is false but the state dict has no lm_head.weight"):
        GPTNeoX.from_config(untold, headless)
