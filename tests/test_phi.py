"""`sharpness.Phi` against HuggingFace's ``PhiForCausalLM`` (phi-1, phi-1.5, phi-2): the logits of two tiny random
checkpoints that ``transformers`` 5.24 wrote (``tests/data/make_phi_tiny_hf.py``: phi-2's layout with 40% of each
head's features rotated, here one key/value head for two query heads; per-head query/key LayerNorms, half rotated,
exact GELU and a head tied to the token table), the checkpoint's key forms, the symmetry group read off the model, its
R-operator products, the command line's ``--model phi:config=PATH`` and ``from_transformers``."""

from __future__ import annotations

import pytest
import torch
from decoder_twins import DATA, check_command_line, check_r_operator_products
from decoder_twins import fixture_config as _config
from decoder_twins import load_fixture as _checkpoint
from test_from_transformers import _stand_in
from test_gpt2 import check_a_random_element

import manifolds
from sharpness import Phi, from_transformers

GQA, QK = "phi_tiny_hf", "phi_tiny_qk_hf"  # width 32, 2 query heads of 16, 2 blocks, MLP 40
LAYERS, WIDTH, HD = 2, 32, 16


def _model(stem: str, classes_last: bool = True, state=None) -> Phi:
    return Phi.from_config(_config(stem), _checkpoint(stem)[0] if state is None else state, classes_last)


@pytest.mark.parametrize("stem", [GQA, QK])
def test_the_logits_are_huggingface_s(stem):
    """transformers' eager softmax computes in float32 even in a float64 model: the logits agree to float32's rounding
    (measured 5.7e-7 and 3.1e-7 of logits up to 6.0 and 5.5); a rotary share, key/value head count, query/key norm or
    head bias read wrong moves them by far more."""
    state, ids, logits = _checkpoint(stem)
    model = _model(stem)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(_model(stem, classes_last=False)(ids), logits.transpose(1, 2), rtol=0, atol=1e-5)
    attention = model.model.layers[0].self_attn
    assert (attention.kv_heads, attention.rotary_dims, attention.qk_layernorm) == (
        (1, 6, False) if stem == GQA else (2, 8, True))  # fmt: skip
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (stem == QK)
    assert model.lm_head.bias is not None
    with torch.no_grad():  # the head's bias is read
        moved = _model(stem)
        moved.lm_head.bias.add_(1.0)
        assert float((moved(ids) - logits).abs().max()) > 0.5


def test_other_key_forms_load_the_same_model():
    """``PhiModel``'s keys (no ``model.`` prefix) and a config with the older top-level ``partial_rotary_factor`` and
    ``rope_theta`` (phi-2's own file): the same logits."""
    state, ids, logits = _checkpoint(GQA)
    bare = {k.removeprefix("model."): v for k, v in state.items()}
    older = {k: v for k, v in _config(GQA).items() if k != "rope_parameters"}
    older.update(partial_rotary_factor=0.4, rope_theta=10000.0)
    with torch.no_grad():
        torch.testing.assert_close(Phi.from_config(_config(GQA), bare)(ids), logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(Phi.from_config(older, state)(ids), logits, rtol=0, atol=1e-5)
        moved = Phi.from_config({**older, "partial_rotary_factor": 0.5}, state)(ids)
        assert float((moved - logits).abs().max()) > 1e-3


@pytest.mark.parametrize("stem, query_key", [
    (GQA, 2 * 3 + 10 * 10),  # per key/value head: the 3 turned pairs (a I + b J each) and GL on the 10 unturned
    (QK, 8 + 4),  # the query/key LayerNorms, shared by the heads: a scale per unturned feature and per turned pair
])  # fmt: skip
def test_the_group_holds_the_heads_factors_and_the_layer_norm_trades(stem, query_key):
    """Per block: the query/key factor of each key/value head (shared by its group of query heads), GL(hd) on
    value/output per key/value head, the block's one LayerNorm traded against q, k, v and ``fc1`` together; the final
    LayerNorm against the untied head (pinned where the head's weight is the token table). GELU pins the MLP's units. A
    random element keeps the logits and the symmetry measure and moves Euclidean sharpness."""
    state, ids, _ = _checkpoint(stem)
    model = _model(stem, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    kv_heads = model.model.layers[0].self_attn.kv_heads
    final = 0 if stem == QK else WIDTH
    assert sym.dim == LAYERS * (query_key + kv_heads * HD * HD + WIDTH) + final, sym.describe()
    check_a_random_element(model, sym, ids)


@pytest.mark.parametrize("stem", [GQA, QK])
def test_the_products_are_the_r_operator_s(stem):
    check_r_operator_products(_model(stem, classes_last=False), _checkpoint(stem)[1])


def test_the_command_line_reads_the_checkpoint_and_its_config(tmp_path, capsys):
    state, _, _ = _checkpoint(GQA)
    check_command_line(tmp_path, capsys, state, "phi", DATA / (GQA + ".json"), _model(GQA, classes_last=False))



@pytest.mark.parametrize("changed, fragment", [
    ({"hidden_act": "gelu_fast"}, "hidden_act is 'gelu_fast'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "must turn a positive even number"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "depends on the sequence's length"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings is true but lm_head.weight differs"),
    ({"qk_layernorm": True}, "qk_layernorm is True but the checkpoint's tensors hold False"),
    ({"num_key_value_heads": 2}, "num_key_value_heads is 2 but the checkpoint's tensors hold 1"),
    ({"head_dim": 8}, "head_dim is 8 but the checkpoint's tensors hold 16"),
    ({"hidden_size": 64}, "does not describe this checkpoint"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1"),
    ({"intermediate_size": 48}, "intermediate_size is 48"),
    ({"num_attention_heads": 3}, "no whole number of heads"),
    ({"layer_norm_eps": 0}, "layer_norm_eps a positive number"),
])  # fmt: skip
def test_a_config_the_model_cannot_compute_is_refused(changed, fragment):
    state, _, _ = _checkpoint(GQA)
    with pytest.raises(ValueError, match=fragment):
        Phi.from_config({**_config(GQA), **changed}, state)


def test_from_transformers_reads_a_phi_causal_lm():
    state, ids, logits = _checkpoint(QK)
    twin = from_transformers(_stand_in("PhiForCausalLM", _config(QK), state))
    assert isinstance(twin, Phi)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"reads \*PhiForCausalLM"):
        from_transformers(_stand_in("PhiModel", _config(QK), state))
