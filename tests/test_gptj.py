"""`sharpness.GPTJ` against HuggingFace's ``GPTJForCausalLM`` (GPT-J-6B's layout): the logits of two tiny random
checkpoints that ``transformers`` 5.24 wrote (``tests/data/make_gptj_tiny_hf.py``: 8 of each head's 16 features turned
in interleaved pairs, tanh GELU; all of them turned, exact GELU), older checkpoints' keys, the symmetry group read off
the model (interleaved rotary pairs, GL on the unturned features), its R-operator products, the command line's
``--model gptj:config=PATH`` and ``from_transformers``."""

from __future__ import annotations

import pytest
import torch
from decoder_twins import DATA, check_command_line, check_r_operator_products
from decoder_twins import fixture_config as _config
from decoder_twins import load_fixture as _checkpoint
from test_from_transformers import _stand_in
from test_gpt2 import check_a_random_element

import manifolds
from sharpness import GPTJ, from_transformers

PART, FULL = "gptj_tiny_hf", "gptj_tiny_full_hf"  # width 32, 2 heads of 16, 2 blocks
LAYERS, WIDTH, HD, HEADS = 2, 32, 16, 2


def _model(stem: str, classes_last: bool = True, state=None) -> GPTJ:
    return GPTJ.from_config(_config(stem), _checkpoint(stem)[0] if state is None else state, classes_last)


@pytest.mark.parametrize("stem", [PART, FULL])
def test_the_logits_are_huggingface_s(stem):
    """transformers computes the eager scores in float32 even in a float64 model: the logits agree to float32's
    rounding (measured 1.1e-6 and 4.1e-7 of logits up to 4.8 and 6.6); pairs turned as halves (``rotate_half``) instead
    of interleaved, or a rotary share read wrong, move them by far more."""
    state, ids, logits = _checkpoint(stem)
    model = _model(stem)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(_model(stem, classes_last=False)(ids), logits.transpose(1, 2), rtol=0, atol=1e-5)
        halves = _model(stem)
        for block in halves.transformer.h:
            block.attn._turned = lambda t, cos, sin, r=block.attn.rotary_dim: torch.cat(
                (t[..., :r] * cos + torch.cat((-t[..., r // 2 : r], t[..., : r // 2]), -1) * sin, t[..., r:]), -1)
        assert float((halves(ids) - logits).abs().max()) > 1e-2
    assert model.transformer.h[0].attn.rotary_dim == (8 if stem == PART else 16)
    assert model.lm_head.bias is not None and model.lm_head.weight is not model.transformer.wte.weight


def test_older_checkpoint_keys_load_the_same_model():
    """``GPTJModel``'s keys (no ``transformer.`` prefix) and the causal-mask buffers older checkpoints saved."""
    state, ids, logits = _checkpoint(PART)
    older = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(LAYERS):
        older[f"h.{i}.attn.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool)
        older[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e9)
    with torch.no_grad():
        torch.testing.assert_close(GPTJ.from_config(_config(PART), older)(ids), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stem, turned", [(PART, 8), (FULL, 16)])
def test_the_group_keeps_gl_on_the_unturned_features(stem, turned):
    """Per block and head: the interleaved rotary pairs commute with ``a I + b J`` on each pair (2 per pair) and all of
    GL acts on the ``hd - turned`` unturned features; GL(hd) on value/output; the block's LayerNorm traded against q, k,
    v and ``fc_in`` together, the final one against the untied head. GELU pins the MLP's units. A random element keeps
    the logits and the symmetry measure and moves Euclidean sharpness."""
    state, ids, _ = _checkpoint(stem)
    model = _model(stem, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    query_key = turned + (HD - turned) ** 2
    assert sym.dim == LAYERS * (HEADS * (query_key + HD * HD) + WIDTH) + WIDTH, sym.describe()
    check_a_random_element(model, sym, ids)


@pytest.mark.parametrize("stem", [PART, FULL])
def test_the_products_are_the_r_operator_s(stem):
    check_r_operator_products(_model(stem, classes_last=False), _checkpoint(stem)[1])


def test_the_command_line_reads_the_checkpoint_and_its_config(tmp_path, capsys):
    state, _, _ = _checkpoint(PART)
    check_command_line(tmp_path, capsys, state, "gptj", DATA / (PART + ".json"), _model(PART, classes_last=False))



@pytest.mark.parametrize("changed, fragment", [
    ({"activation_function": "gelu_fast"}, "activation_function is 'gelu_fast'"),
    ({"rotary_dim": 7}, "rotary_dim must be a positive even number up to the head size 16"),
    ({"rotary_dim": 32}, "rotary_dim must be a positive even number up to the head size 16"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings is true but lm_head.weight differs"),
    ({"n_embd": 64}, "n_embd is 64 but the checkpoint's tensors hold 32"),
    ({"n_layer": 1}, "n_layer is 1"),
    ({"n_inner": 48}, "n_inner is 48"),
    ({"n_head": 3}, "not a multiple of heads=3"),
    ({"n_positions": 0}, "n_positions must be positive integers"),
    ({"rotary_dim": None}, "rotary_dim is null, which transformers reads as all 32 features"),
])  # fmt: skip
def test_a_config_the_model_cannot_compute_is_refused(changed, fragment):
    state, _, _ = _checkpoint(PART)
    with pytest.raises(ValueError, match=fragment):
        GPTJ.from_config({**_config(PART), **changed}, state)


def test_sequences_longer_than_the_positions_are_refused():
    model = _model(PART)
    with pytest.raises(ValueError, match="longer than its 16 positions"):
        model.check_tokens(torch.zeros(1, 17, dtype=torch.int64))


def test_from_transformers_reads_a_gptj_causal_lm():
    state, ids, logits = _checkpoint(FULL)
    twin = from_transformers(_stand_in("GPTJForCausalLM", _config(FULL), state))
    assert isinstance(twin, GPTJ)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"reads \*GPTJForCausalLM"):
        from_transformers(_stand_in("GPTJModel", _config(FULL), state))
