"""`sharpness.Llama` against HuggingFace's ``LlamaForCausalLM``: the logits of two tiny random checkpoints that the
``transformers`` library wrote (``tests/data/make_llama_tiny_hf.py``: grouped-query attention with rope_theta 500 and
an untied head; biases everywhere and a head tied to the token table), the checkpoint's key forms, the symmetry group
the toolkit reads off the model, its R-operator products, and the command line's ``--model llama:heads=H``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gpt2 import check_a_random_element
from test_transformer_quotient import measure_value
from torch import nn

import manifolds
from sharpness import Llama, Objective, euclidean_sharpness
from sharpness._cli import main as sharpness_main
from sharpness._llama import LlamaLayout, llama_from_spec, rotary_frequencies

DATA = Path(__file__).parent / "data"
# file, query heads, rope_theta; both: vocabulary 29, width 16, 2 blocks, MLP 24, rms_norm_eps 1e-5
GQA, TIED = ("llama_tiny_hf.safetensors", 4, 500.0), ("llama_tiny_tied_hf.safetensors", 2, 10000.0)
ROPE = ("llama_tiny_rope_hf.safetensors", 2, 10000.0)  # LLaMA 3.1's scaled rotary embeddings; its config.json beside
MISTRAL = ("mistral_tiny_hf.safetensors", 2, 10000.0)  # a sliding window of 3 tokens on inputs of 9; its config.json
QWEN2 = ("qwen2_tiny_hf.safetensors", 2, 10000.0)  # the window on the second block only; query/key/value biases
MINISTRAL = ("ministral_tiny_hf.safetensors", 2, 10000.0)  # the window on the first block only (layer_types)
QWEN3 = ("qwen3_tiny_hf.safetensors", 2, 10000.0)  # query/key RMSNorms per head; heads of 12 on a width of 16
OLMO2 = ("olmo2_tiny_hf.safetensors", 2, 10000.0)  # query/key RMSNorms over the width; norms on the branches' outputs
PHI3 = ("phi3_tiny_hf.safetensors", 4, 10000.0)  # fused qkv_proj and gate_up_proj; a window of 3; token 28 pads
# Gemma: norms by 1 + w, GeGLU, embeddings times 4, heads of 12, a tied head; Gemma 2: 4 heads of 8 sharing 2, a norm
# before and after each branch, scores over sqrt(10), soft caps 2 (scores) and 3 (logits), a window of 3 on block 0
GEMMA, GEMMA2 = ("gemma_tiny_hf.safetensors", 2, 10000.0), ("gemma2_tiny_hf.safetensors", 4, 10000.0)
GEMMA2_NOCAP = ("gemma2_nocap_tiny_hf.safetensors", 4, 10000.0)  # no cap on the scores (the toolkit's SDPA)
# Gemma 3: Gemma 2's blocks, query/key RMSNorms per head, no caps, rotary base 50 on the sliding block 0 and 1000
# (scaled linearly by 2) on the full block 1
GEMMA3 = ("gemma3_tiny_hf.safetensors", 2, 1000.0)
GEMMAS = (GEMMA, GEMMA2, GEMMA2_NOCAP, GEMMA3)
WINDOWED = (ROPE, MISTRAL, QWEN2, MINISTRAL, QWEN3, OLMO2, PHI3, *GEMMAS)  # with a config.json
EPS, LAYERS, WIDTH, MLP = 1e-5, 2, 16, 24


def _checkpoint(which):
    state = load_file(str(DATA / which[0]))
    return state, state.pop("__input_ids"), state.pop("__logits")


def _model(which, classes_last: bool = True, state=None) -> Llama:
    state = _checkpoint(which)[0] if state is None else state
    if which in WINDOWED:
        return Llama.from_config(_config(which), state, classes_last=classes_last)
    return Llama.from_state_dict(state, heads=which[1], eps=EPS, theta=which[2], classes_last=classes_last)


def _config(which=ROPE) -> dict:
    return json.loads((DATA / which[0].replace(".safetensors", ".json")).read_text())


@pytest.mark.parametrize("which", [GQA, TIED, ROPE, MISTRAL, QWEN2, MINISTRAL, QWEN3, OLMO2, PHI3, *GEMMAS],
                         ids=["gqa", "tied", "llama3_rope", "mistral_window", "qwen2_window", "ministral_window",
                              "qwen3", "olmo2", "phi3", "gemma", "gemma2", "gemma2_nocap", "gemma3"])  # fmt: skip
def test_the_logits_are_huggingface_s(which):
    """HuggingFace computes its RMSNorm and softmax in float32 even in a float64 model, so the logits agree to float32's
    rounding (measured 8e-7 of logits up to 4.6); a wrong rope_theta, eps or key/value grouping moves them by 6e-4 to
    5."""
    state, ids, logits = _checkpoint(which)
    model = _model(which)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)
        across = _model(which, classes_last=False)(ids)
        torch.testing.assert_close(across, logits.transpose(1, 2), rtol=0, atol=1e-5)
    gemma = which in GEMMAS
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (which is TIED or gemma)
    attention = model.model.layers[0].self_attn
    sizes = {GQA[0]: (4, 2, 4), TIED[0]: (2, 2, 8), QWEN3[0]: (2, 1, 12), OLMO2[0]: (2, 2, 8), PHI3[0]: (4, 2, 4),
             GEMMA[0]: (2, 1, 12), GEMMA2[0]: (4, 2, 8), GEMMA2_NOCAP[0]: (4, 2, 8)}.get(which[0], (2, 1, 8))
    norms = {QWEN3[0]: "head", OLMO2[0]: "width", GEMMA3[0]: "head"}.get(which[0])
    assert (attention.heads, attention.kv_heads, attention.head_dim, attention.qk_norm) == (*sizes, norms)
    assert model.model.layers[0].post_norms == (which is OLMO2)
    assert attention.fused == model.model.layers[0].mlp.fused == (which is PHI3)
    assert model.model.embed_tokens.padding_idx == {OLMO2[0]: 1, PHI3[0]: 28}.get(which[0], 0 if gemma else None)
    queries, up = (attention.qkv_proj, model.model.layers[0].mlp.gate_up_proj) if which is PHI3 else (
        attention.q_proj, model.model.layers[0].mlp.up_proj)
    biased = (queries.bias is not None, up.bias is not None)
    assert biased == (which is TIED or which is QWEN2, which is TIED)
    windows = {MISTRAL[0]: [3, 3], QWEN2[0]: [None, 3], MINISTRAL[0]: [3, None], PHI3[0]: [3, 3], GEMMA2[0]: [3, None],
               GEMMA2_NOCAP[0]: [3, None], GEMMA3[0]: [3, None]}.get(which[0], [None, None])
    assert [layer.self_attn.window for layer in model.model.layers] == windows


def test_sliding_windows_are_read_from_the_config_as_transformers_reads_them():
    """Without its windows each windowed fixture's 9-token logits move by more than 0.5, and with the window on the
    wrong blocks too. Mistral's class reads no layer_types (a window on every block), Qwen2 reads one only where
    use_sliding_window is true (from max_window_layers on, or by layer_types), LLaMA's none."""
    for which, wrong in ((MISTRAL, [None, 3]), (QWEN2, [3, None]), (MINISTRAL, [None, 3])):
        state, ids, logits = _checkpoint(which)
        with torch.no_grad():
            for windows in (None, wrong):
                moved = Llama.from_state_dict(state, heads=2, eps=EPS, sliding_window=windows)(ids)
                assert float((moved - logits).abs().max()) > 0.5, (which, windows)
    state, ids, logits = _checkpoint(MISTRAL)
    config = _config(MISTRAL)
    mixed, qwen = ["sliding_attention", "full_attention"], {"use_sliding_window": True, "max_window_layers": 1}
    no_key = {k: v for k, v in config.items() if k != "sliding_window"}  # transformers' default window: 4096
    windows = [  # configs, the windows per block
        ({**config, "model_type": "qwen2", **qwen}, [None, 3]),
        ({**config, "model_type": "qwen2", **qwen, "max_window_layers": 0}, [3, 3]),
        ({**config, "model_type": "qwen2", "use_sliding_window": False}, [None, None]),
        ({**config, "model_type": "ministral", "layer_types": mixed}, [3, None]),
        ({**config, "model_type": "mistral", "layer_types": mixed}, [3, 3]),
        ({**config, "model_type": "llama"}, [None, None]),
        ({**config, "model_type": "mistral", "use_sliding_window": False}, [3, 3]),  # only Qwen's classes read it
        ({**config, "model_type": "ministral", "use_sliding_window": False, "layer_types": mixed}, [3, None]),
        ({**no_key, "model_type": "qwen2", **qwen}, [None, 4096]),
        ({**no_key, "model_type": "mistral", **qwen}, [4096, 4096]),
    ]
    for given, expected in windows:
        model = Llama.from_config(given, state)
        assert [layer.self_attn.window for layer in model.model.layers] == expected, given
    for change, fragment in [({"sliding_window": 0}, "sliding_window must be a positive integer"),
                             ({"model_type": "ministral", "layer_types": ["sliding"] * 2}, "layer_types must list"),
                             ({"model_type": "ministral", "layer_types": ["full_attention"]},
                              "has 1 entries for its 2 blocks"),
                             ({"model_type": "ministral", "layer_types": [{}, "full_attention"]},
                              "layer_types must list"),
                             ({"model_type": "qwen2", "use_sliding_window": "false"}, "must be true or false")]:
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config({**config, **change}, state)
    with pytest.raises(ValueError, match="1 sliding windows are given for 2 blocks"):
        Llama(29, 16, 2, 2, sliding_window=[3])


def test_llama3_rotary_scaling_is_read_from_either_config_format():
    """transformers 5 writes ``rope_parameters`` (the fixture's config); older configs ``rope_theta`` and
    ``rope_scaling``. Without the scaling the logits move by 2.3: the fixture's wavelengths are kept, blended and
    divided."""
    state, ids, logits = _checkpoint(ROPE)
    old = dict(_config())
    parameters = dict(old.pop("rope_parameters"))
    old["rope_theta"], old["rope_scaling"] = parameters.pop("rope_theta"), parameters
    with torch.no_grad():
        torch.testing.assert_close(Llama.from_config(old, state)(ids), logits, rtol=0, atol=1e-5)
        plain = Llama.from_state_dict(state, heads=2, eps=EPS)(ids)
    assert float((plain - logits).abs().max()) > 1.0
    frequencies = rotary_frequencies(8, 10000.0, parameters)  # wavelengths 6.3 (kept), 63 (blended), 628, 6283 (/8)
    plain_frequencies = rotary_frequencies(8, 10000.0)
    assert frequencies[0] == plain_frequencies[0] and torch.allclose(frequencies[2:], plain_frequencies[2:] / 8)
    assert plain_frequencies[1] / 8 < frequencies[1] < plain_frequencies[1]
    older = {**old, "rope_scaling": {"type": "llama3", **{k: v for k, v in parameters.items() if k != "rope_type"}}}
    with torch.no_grad():  # the key older transformers wrote: "type"
        torch.testing.assert_close(Llama.from_config(older, state)(ids), logits, rtol=0, atol=1e-5)
    context = {k: v for k, v in parameters.items() if k != "original_max_position_embeddings"}
    fallback = {**old, "rope_scaling": context,
                "max_position_embeddings": parameters["original_max_position_embeddings"]}  # fmt: skip
    top = {**old, "rope_scaling": context, "max_position_embeddings": 8192,
           "original_max_position_embeddings": parameters["original_max_position_embeddings"]}  # fmt: skip
    with torch.no_grad():  # without the original context, transformers takes the top-level one, else the model's
        for config in (fallback, top):
            torch.testing.assert_close(Llama.from_config(config, state)(ids), logits, rtol=0, atol=1e-5)
    for bad, fragment in [({**old, "rope_scaling": {"rope_type": "proportional"}}, "rope_type 'proportional' is not"),
                          ({**_config(), "rope_parameters": "linear"}, "rope_parameters must be an object"),
                          ({**old, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs a positive number"),
                          ({**old, "hidden_act": "gelu"}, "gates with silu"),
                          ({**old, "num_attention_heads": 0}, "positive integer"),
                          ({**old, "tie_word_embeddings": True}, "differs from the token table")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config(bad, state)


SCALED = ("yarn", "dynamic", "longrope")


@pytest.mark.parametrize("kind", SCALED)
def test_yarn_dynamic_and_longrope_scalings_are_huggingface_s(kind):
    """YaRN (original context 4, factor 4: frequencies blended by a ramp, cos and sin times 1.14), dynamic NTK (factor 2
    past 6 positions: the base grows with the length) and LongRoPE (short factors up to 6 tokens, long ones past,
    cos and sin times 1.26), each on 9 tokens and on the first 5: HuggingFace's logits to float32's rounding (measured
    1e-6 to 3e-6), while the unscaled embedding moves them by 1.2 to 4.4 (on 5 tokens dynamic NTK is the plain
    embedding). The group (the rotary commutant per key head: the tables are scaled rotations) keeps the logits and
    the symmetry measure, and the products are the R-operator's."""
    state = load_file(str(DATA / f"llama_tiny_{kind}_hf.safetensors"))
    ids, logits, short = state.pop("__input_ids"), state.pop("__logits"), state.pop("__short_logits")
    config = json.loads((DATA / f"llama_tiny_{kind}_hf.json").read_text())
    model, plain = Llama.from_config(config, state), Llama.from_state_dict(state, heads=2, eps=EPS)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(ids[:, :5]), short, rtol=0, atol=1e-5)
        assert float((plain(ids) - logits).abs().max()) > 1.0
        assert (float((plain(ids[:, :5]) - short).abs().max()) > 1.0) == (kind != "dynamic")
    across = Llama.from_config(config, state, classes_last=False)
    sym = manifolds.transformer_symmetry(across, ids)
    assert sym.dim == LAYERS * (8 + 64) + LAYERS * (2 * WIDTH + MLP) + WIDTH, sym.describe()
    check_a_random_element(across, sym, ids)
    obj = Objective(across, nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1)))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = obj.hvp(v, "jvp")
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def test_scaled_rope_parameters_are_checked():
    config = json.loads((DATA / "llama_tiny_longrope_hf.json").read_text())
    state = load_file(str(DATA / "llama_tiny_longrope_hf.safetensors"))
    for key in ("__input_ids", "__logits", "__short_logits"):
        state.pop(key)
    scaling = config["rope_parameters"]
    for change, fragment in [({"short_factor": [1.0, 2.0]}, "short_factor, 4 positive numbers"),
                             ({"long_factor": [1.0, 0.0, 1.0, 1.0]}, "long_factor, 4 positive numbers"),
                             ({"rope_type": "dynamic", "factor": -1}, "positive number factor"),
                             ({"rope_type": "yarn", "factor": 4.0, "attention_factor": "x"}, "number attention_factor"),
                             ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config({**config, "rope_parameters": {**scaling, **change}}, state)
    with pytest.raises(ValueError, match="needs the config's max_position_embeddings"):
        Llama(29, 16, 2, 2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
    for change, fragment in [({"beta_fast": "32"}, "positive number beta_fast"), ({"mscale": float("nan")}, "mscale"),
                             ({"rope_theta": 1.0}, "rope_theta above 1"),
                             ({"original_max_position_embeddings": 0.5}, "positive integer original")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config({**config, "rope_parameters": {**yarn, **change}}, state)
    with pytest.raises(ValueError, match="partial_rotary_factor"):  # transformers moves a top-level one into it
        Llama.from_config({**config, "rope_parameters": yarn, "partial_rotary_factor": 0.5}, state)
    # LongRoPE over one token of original context: its default attention factor divides by log 1, a given one does not
    one = {**scaling, "original_max_position_embeddings": 1}
    with pytest.raises(ValueError, match="needs an attention_factor"):
        Llama.from_config({**config, "rope_parameters": one}, state)
    Llama.from_config({**config, "rope_parameters": {**one, "attention_factor": 1.0}}, state)


def test_the_rotary_frequencies_stay_float32():
    """Cast to bfloat16 and back (a checkpoint shipped in bfloat16), the frequencies keep their float32 values, as
    transformers keeps them (before: rounded, a logit moved by 1.2 at 600 tokens with YaRN); a float32 model measured
    in float64 computes its angles in float32 in the R-operator's products too (before: 1.6e-6 off autograd's)."""
    config = json.loads((DATA / "llama_tiny_yarn_hf.json").read_text())
    state = load_file(str(DATA / "llama_tiny_yarn_hf.safetensors"))
    ids = state.pop("__input_ids")
    state.pop("__logits"), state.pop("__short_logits")
    model = Llama.from_config(config, state, classes_last=False)
    before = [b.clone() for k, b in model.named_buffers() if k.endswith("inv_freq")]
    model.to(torch.bfloat16).to(torch.float64)
    after = [b for k, b in model.named_buffers() if k.endswith("inv_freq")]
    assert len(after) == LAYERS and all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(after, before))
    single = Llama.from_config(config, state, classes_last=False).float()
    obj = Objective(single, nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1)), dtype=torch.float64)
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = obj.hvp(v, "jvp")
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it():
    """transformers takes ``rope_scaling`` whole in place of ``rope_parameters``, with its own ``rope_theta``, else
    the top-level one, else 10000 (Qwen's advice adds ``rope_scaling`` to a config that has ``rope_parameters``)."""
    config = json.loads((DATA / "llama_tiny_yarn_hf.json").read_text())
    state = load_file(str(DATA / "llama_tiny_yarn_hf.safetensors"))
    ids, logits = state.pop("__input_ids"), state.pop("__logits")
    state.pop("__short_logits")
    scaling = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    both = {**config, "rope_parameters": {**config["rope_parameters"], "rope_theta": 500.0}, "rope_scaling": scaling}
    with torch.no_grad():
        torch.testing.assert_close(Llama.from_config(both, state)(ids), logits, rtol=0, atol=1e-5)  # theta 10000


def test_checkpoint_key_forms():
    state, ids, logits = _checkpoint(GQA)
    bare = {k.removeprefix("model."): v for k, v in state.items()}  # LlamaModel's keys, with the head
    bare["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # an older checkpoint's buffer: dropped
    with torch.no_grad():
        torch.testing.assert_close(_model(GQA, state=bare)(ids), logits, rtol=0, atol=1e-5)
    tied_state, _, _ = _checkpoint(TIED)
    same = dict(tied_state, **{"lm_head.weight": tied_state["model.embed_tokens.weight"].clone()})  # saved tied
    model = _model(TIED, state=same)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    short = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing"):
        _model(GQA, state=short)
    with pytest.raises(ValueError, match="not a multiple of heads=3"):
        Llama.from_state_dict(state, heads=3)
    with pytest.raises(ValueError, match="cannot share 3 key/value heads"):
        Llama.from_state_dict({**state, **{f"model.layers.{i}.self_attn.k_proj.weight": torch.zeros(12, WIDTH)
                                           for i in range(LAYERS)}}, heads=4)  # fmt: skip
    with pytest.raises(ValueError, match="no token table"):
        Llama.from_state_dict({k: v for k, v in state.items() if "embed" not in k}, heads=4)
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        Llama.from_state_dict(state, heads=0)
    empty = {**state, **{f"model.layers.{i}.self_attn.q_proj.weight": torch.zeros(0, WIDTH) for i in range(LAYERS)}}
    with pytest.raises(ValueError, match="must have rows"):
        Llama.from_state_dict(empty, heads=4)


@pytest.mark.parametrize("which", [GQA, TIED, MISTRAL, QWEN2], ids=["gqa", "tied", "mistral_window", "qwen2_window"])
def test_the_group_and_the_invariant_measure(which):
    """Per block and key/value head: on query/key the subgroup of GL(hd) commuting with the rotary maps (one ``a I + b
    J`` per rotated pair: dimension hd), moving the query heads that share the key head together; GL(hd) on
    value/output; the two RMSNorms of each block traded, and the SwiGLU units. The final RMSNorm is traded against an
    untied head and pinned by a head that shares the token table. Grouped-query fixture: 2 key/value heads of 4 per
    block, each read by 2 query heads; tied fixture: 2 heads of 8; Mistral fixture: one key/value head of 8 read by
    both query heads, under a sliding window (a constant mask, which the group leaves alone)."""
    state, ids, _ = _checkpoint(which)
    model = _model(which, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    kv_heads, hd = {GQA[0]: (2, 4), TIED[0]: (2, 8)}.get(which[0], (1, 8))
    labels = [f.label for f in sym.factors]
    assert sum("query/key" in la for la in labels) == sum("value/output" in la for la in labels) == LAYERS * kv_heads
    final = 0 if which is TIED else WIDTH  # the final RMSNorm traded against an untied head
    assert sym.dim == LAYERS * kv_heads * (hd + hd * hd) + LAYERS * (2 * WIDTH + MLP) + final, sym.describe()
    if which is not TIED:  # each key and value head moves with the two query heads reading it
        assert all(sum(b.name.endswith("q_proj.weight") for b in f.blocks) == 2 for f in sym.factors
                   if "query/key" in f.label)  # fmt: skip
        assert all(sum(b.name.endswith("o_proj.weight") for b in f.blocks) == 2 for f in sym.factors
                   if "value/output" in f.label)  # fmt: skip
    moved = {b.name for f in sym.factors for b in f.blocks}
    assert ("model.norm.weight" in moved) == (which is not TIED) and "model.embed_tokens.weight" not in moved
    check_a_random_element(model, sym, ids)


@pytest.mark.parametrize("which, pairs", [(QWEN3, [tuple(range(6))]), (OLMO2, [(0, 1, 2, 3), (8, 9, 10, 11)]),
                                          (GEMMA3, [(0, 1, 2, 3)])], ids=["qwen3", "olmo2", "gemma3"])
def test_query_key_norms_are_traded_in_rotated_pairs(which, pairs):
    """Qwen3 normalizes each head's queries and keys (an RMSNorm of 12 features, shared by the heads), OLMo 2 the
    queries and the keys over all their features before the heads are split; then both turn them by the rotary
    embedding. The query/key GL(hd) is gone, and the two norms' scales trade, ``q_norm * c`` against ``k_norm / c``,
    with ``c`` one number per pair of features ``rotate_half`` turns together (``j`` and ``j + hd/2`` of a head): 6
    per block for Qwen3, 8 for OLMo 2's two heads of 8, 4 for Gemma 3's heads of 8 (whose norm gains are ``1 + w``,
    and whose two blocks rotate with different bases). Value/output keeps GL(hd) per key/value head. By hand: a ``c``
    constant on the pairs keeps the logits, one that is not moves them."""
    state, ids, _ = _checkpoint(which)
    model = _model(which, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    traded = [f for f in sym.factors if "query/key normalization scales" in f.label]
    hd = model.model.layers[0].self_attn.head_dim
    firsts = tuple(i for block in pairs for i in block)  # the first feature of each pair
    assert [f.size for f in traded] == [len(firsts)] * LAYERS
    assert not [f for f in sym.factors if "query/key:" in f.label]
    expected = {(n, index) for n in ("q_norm", "k_norm") for index in (firsts, tuple(i + hd // 2 for i in firsts))}
    assert all({(b.name.rsplit(".", 2)[-2], b.index) for b in f.blocks} == expected for f in traded), sym.describe()
    kv_heads, final = model.model.layers[0].self_attn.kv_heads, WIDTH
    norms = 0 if which is OLMO2 else 2 * WIDTH  # OLMo 2's block norms sit on the branches' outputs: pinned
    final = 0 if which is GEMMA3 else final  # Gemma 3's head is the token table
    assert sym.dim == LAYERS * (len(firsts) + kv_heads * hd * hd + norms + MLP) + final, sym.describe()
    g = torch.Generator().manual_seed(2)
    size = model.model.layers[0].self_attn.q_norm.weight.numel()
    c = torch.ones(size, dtype=torch.float64)
    for i in firsts:
        c[i] = c[i + hd // 2] = float(torch.exp(0.5 * torch.randn((), generator=g, dtype=torch.float64)))
    params = dict(model.named_parameters())
    for tied, limit in ((c, 1e-10), (c * torch.linspace(0.5, 1.5, size, dtype=torch.float64), None)):
        twin = _model(which, classes_last=False)
        with torch.no_grad():
            for i in range(LAYERS):
                attn = twin.model.layers[i].self_attn
                attn.q_norm.weight.copy_(params[f"model.layers.{i}.self_attn.q_norm.weight"] * tied)
                attn.k_norm.weight.copy_(params[f"model.layers.{i}.self_attn.k_norm.weight"] / tied)
            moved = float((twin(ids) - model(ids)).abs().max())
        assert moved < limit if limit else moved > 1e-3, moved
    check_a_random_element(model, sym, ids)


def test_phi3_s_fused_projections_keep_llama_s_group():
    """Phi-3 computes the queries, keys and values by one ``qkv_proj`` cut by slices of its last axis, and the gate and
    up projections by one ``gate_up_proj`` cut by ``chunk``: the group is a LLaMA's of the same sizes, read on rows of
    the fused matrices. Per block and key/value head: the rotary commutant on query/key (dimension hd, moving both query
    heads that share the key head), GL(hd) on value/output; the two RMSNorms traded; the up projection's units (rows
    24:48 of ``gate_up_proj``, gated by a product with the other half, which holds the gate's rows); the final RMSNorm
    against the untied head."""
    state, ids, _ = _checkpoint(PHI3)
    model = _model(PHI3, classes_last=False)
    sym = manifolds.transformer_symmetry(model, ids)
    kv_heads, hd = 2, 4
    assert sym.dim == LAYERS * kv_heads * (hd + hd * hd) + LAYERS * (2 * WIDTH + MLP) + WIDTH, sym.describe()
    units = [f for f in sym.factors if f.label.startswith("units of")]
    assert [{(b.name.rsplit(".", 2)[-2], b.axis, b.index) for b in f.blocks} for f in units] == [
        {("gate_up_proj", 0, tuple(range(MLP, 2 * MLP))), ("down_proj", 1, tuple(range(MLP)))}] * LAYERS, sym.describe()
    qk = [f for f in sym.factors if "query/key" in f.label]
    assert all(sum(b.name.endswith("qkv_proj.weight") for b in f.blocks) == 3 for f in qk)  # two query heads, a key
    check_a_random_element(model, sym, ids)


@pytest.mark.parametrize("which", [GQA, TIED, MISTRAL, QWEN2, QWEN3, OLMO2, PHI3, *GEMMAS],
                         ids=["gqa", "tied", "mistral_window", "qwen2_window", "qwen3", "olmo2", "phi3", "gemma",
                              "gemma2", "gemma2_nocap", "gemma3"])  # fmt: skip
def test_the_products_are_the_r_operator_s(which):
    state, ids, _ = _checkpoint(which)
    obj = Objective(_model(which, classes_last=False), nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1)))
    assert obj.hvp_strategy() == "rop"
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        v = torch.randn(obj.layout.size, generator=g, dtype=torch.float64)
        ref = obj.hvp(v, "double_backward")  # (not jvp: a padding row is held fixed by autograd only)
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """The grouped-query fixture as a checkpoint, and token data: ids ``X`` and next tokens ``y``, ``(N, T)``."""
    d = tmp_path_factory.mktemp("llamacli")
    state, _, _ = _checkpoint(GQA)
    save_file(state, str(d / "llama.safetensors"))
    X = torch.randint(0, 29, (10, 7), generator=torch.Generator().manual_seed(0))
    np.savez(d / "tokens.npz", X=X.numpy(), y=torch.roll(X, -1, dims=1).numpy())
    return d


def test_the_command_line_measures_a_llama_checkpoint_on_token_data(cli_files, tmp_path):
    out = tmp_path / "r.json"
    argv = ["compute", "--model", "llama:heads=4,eps=1e-5,theta=500", "--checkpoint",
            str(cli_files / "llama.safetensors"), "--data", str(cli_files / "tokens.npz"), "--metric", "euclidean",
            "--metric", "symmetry", "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["measures"]["euclidean"]["value"] > 0
    data = np.load(cli_files / "tokens.npz")
    expected = measure_value(_model(GQA, classes_last=False), nn.CrossEntropyLoss(),
                             (torch.from_numpy(data["X"]), torch.from_numpy(data["y"])))  # fmt: skip
    assert report["measures"]["symmetry"]["value"] == pytest.approx(float(expected[0]), rel=1e-6)


@pytest.mark.parametrize("which", [ROPE, QWEN3, OLMO2, PHI3, GEMMA2, GEMMA3],
                         ids=["llama3_rope", "qwen3", "olmo2", "phi3", "gemma2", "gemma3"])
def test_the_command_line_reads_the_checkpoint_s_config(tmp_path, which):
    state, _, _ = _checkpoint(which)
    save_file(state, str(tmp_path / "model.safetensors"))
    X = torch.randint(0, 29, (6, 7), generator=torch.Generator().manual_seed(0))
    np.savez(tmp_path / "tokens.npz", X=X.numpy(), y=torch.roll(X, -1, dims=1).numpy())
    out = tmp_path / "r.json"
    argv = ["compute", "--model", f"llama:config={DATA / which[0].replace('.safetensors', '.json')}", "--checkpoint",
            str(tmp_path / "model.safetensors"), "--data", str(tmp_path / "tokens.npz"), "--metric", "euclidean",
            "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    data = (X, torch.roll(X, -1, dims=1))
    expected = euclidean_sharpness(_model(which, classes_last=False), nn.CrossEntropyLoss(), data,
                                   dtype=torch.float64, progress=False).value  # fmt: skip
    assert json.loads(out.read_text())["measures"]["euclidean"]["value"] == pytest.approx(expected, rel=1e-6)


def test_the_command_line_refuses_sequences_without_tokens(cli_files, tmp_path, capsys):
    np.savez(tmp_path / "empty.npz", X=np.zeros((4, 0), dtype=np.int64), y=np.zeros((4, 0), dtype=np.int64))
    argv = ["compute", "--model", "llama:heads=4", "--checkpoint", str(cli_files / "llama.safetensors"), "--data",
            str(tmp_path / "empty.npz"), "--quiet"]  # fmt: skip
    assert sharpness_main(argv) == 2
    err = capsys.readouterr().err
    assert "the sequences hold no tokens" in err and "Traceback" not in err, err


@pytest.mark.parametrize("model, fragment", [
    ("llama", "number of query heads"),
    ("llama:heads=4,heads=2", "given twice"),
    ("llama:config=missing.json", "cannot read the config"),
    ("llama:config=x.json,heads=4", "gives every other option"),
    ("llama:heads=3", "not a multiple of heads=3"),
    ("llama:heads=4,theta=-1", "positive finite numbers"),
    ("llama:heads=4,rope=2", "number of query heads"),
])  # fmt: skip
def test_the_command_line_refuses_what_does_not_fit_in_one_sentence(cli_files, capsys, model, fragment):
    argv = ["compute", "--model", model, "--checkpoint", str(cli_files / "llama.safetensors"), "--data",
            str(cli_files / "tokens.npz"), "--quiet"]  # fmt: skip
    assert sharpness_main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_full_width_query_key_norms_with_grouped_query_attention_trade_over_the_key_s_features():
    """OLMo 2's layout with 4 query heads sharing 2 key/value heads: ``q_norm`` has 16 features, ``k_norm`` 8. Key
    feature ``j`` meets the same feature of both query heads sharing its head, so the trade has one scale per key
    feature, tied in rotated pairs (4 per block): ``k_norm / c`` and the two query features ``* c``. By hand and by
    random elements; an untied ``c`` moves the logits."""
    torch.manual_seed(0)
    model = Llama(29, WIDTH, LAYERS, 4, kv_heads=2, head_dim=4, hidden=MLP,
                  layout=LlamaLayout(qk_norm="width", post_norms=True), classes_last=False).double().eval()  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 29, (3, 7), generator=torch.Generator().manual_seed(1))
    sym = manifolds.transformer_symmetry(model, ids)
    traded = [f for f in sym.factors if "query/key normalization scales" in f.label]
    assert [f.size for f in traded] == [4] * LAYERS, sym.describe()
    g = torch.Generator().manual_seed(2)
    c = torch.exp(0.5 * torch.randn(4, generator=g, dtype=torch.float64))
    on_keys = c[[0, 1, 0, 1, 2, 3, 2, 3]]  # pairs (0, 2), (1, 3) of key head 0, (4, 6), (5, 7) of key head 1
    on_queries = on_keys.view(2, 1, 4).expand(2, 2, 4).reshape(16)  # query heads 0, 1 read key head 0; 2, 3 head 1
    for untie in (False, True):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for layer in twin.model.layers:
                layer.self_attn.q_norm.weight.mul_(on_queries * (1.5 if untie else 1.0) ** torch.arange(16.0).eq(0))
                layer.self_attn.k_norm.weight.div_(on_keys)
            moved = float((twin(ids) - model(ids)).abs().max())
        assert moved > 1e-3 if untie else moved < 1e-10, (untie, moved)
    check_a_random_element(model, sym, ids)


def test_a_config_the_tensors_contradict_or_a_partial_rotary_factor_is_refused():
    """Phi-3 rotates ``partial_rotary_factor`` of each head (in the rope parameters, or at the config's top level in
    older files): ``Llama`` rotates whole heads, so the factor is refused, not dropped (before, a factor of 0.5 with the
    default rope type was dropped and the logits were 5.5 off). The head counts read off the tensors must be the
    config's: 8 query heads on the fixture fit its shapes, but not its 2 key/value heads of 4 features."""
    state, _, _ = _checkpoint(PHI3)
    config = _config(PHI3)
    for changed in ({"rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.5}},
                    {"partial_rotary_factor": 0.75, "rope_parameters": None, "rope_theta": 10000.0}):  # fmt: skip
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            Llama.from_config({**config, **changed}, state)
    with pytest.raises(ValueError, match="num_key_value_heads is 2 but the checkpoint's tensors hold 4"):
        Llama.from_config({**config, "num_attention_heads": 8}, state)
    # transformers builds what the config says and drops the tensors it has no place for (a block less: logits 5 off)
    for name, value in (("num_hidden_layers", 1), ("hidden_size", 32), ("vocab_size", 30), ("intermediate_size", 48)):
        with pytest.raises(ValueError, match=f"{name} is {value} but the checkpoint's tensors hold"):
            Llama.from_config({**config, name: value}, state)


def test_a_bias_for_a_projection_the_layout_does_not_build_is_refused():
    with pytest.raises(ValueError, match="name projections this layout does not build"):
        Llama(29, WIDTH, 1, 2, bias={"q_proj": True}, layout=LlamaLayout(fused=True))
    with pytest.raises(ValueError, match="name projections this layout does not build"):
        Llama(29, WIDTH, 1, 2, bias={"qkv_proj": True})
    assert Llama(29, WIDTH, 1, 2, bias={"qkv_proj": True}, layout=LlamaLayout(fused=True)).model.layers[
        0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("which", [GEMMA, GEMMA2, GEMMA2_NOCAP], ids=["gemma", "gemma2", "gemma2_nocap"])
def test_gemma_s_norms_hold_their_gains_and_keep_llama_s_group(which):
    """The twin's RMSNorm weights are Gemma's gains ``1 + w`` (the checkpoint's ``w`` plus one), so each norm's scale
    trades as LLaMA's does. Per block and key/value head: the rotary commutant on query/key (dimension hd) and GL(hd) on
    value/output, whatever soft cap bends the scores (the scores themselves are unchanged); the norm before attention
    against q, k and v, the norm before the MLP against its gate and up columns (Gemma's ``post_attention_layernorm``,
    Gemma 2's ``pre_feedforward_layernorm``), the GeGLU's up units. Gemma 2's norms after each branch feed the residual
    stream and pin; the final norm pins against the tied head."""
    state, ids, _ = _checkpoint(which)
    model = _model(which, classes_last=False)
    params = dict(model.named_parameters())
    norms = [k for k in state if k.endswith("norm.weight")]
    assert len(norms) == (2 * LAYERS + 1 if which is GEMMA else 4 * LAYERS + 1)
    for key in norms:
        torch.testing.assert_close(params[key], state[key] + 1, rtol=0, atol=0)
    sym = manifolds.transformer_symmetry(model, ids)
    kv_heads, hd = (1, 12) if which is GEMMA else (2, 8)
    assert sym.dim == LAYERS * (kv_heads * (hd + hd * hd) + (2 * WIDTH + MLP)), sym.describe()
    moved = {b.name.rsplit(".", 2)[-2] for f in sym.factors for b in f.blocks if "norm" in b.name}
    before_mlp = "post_attention_layernorm" if which is GEMMA else "pre_feedforward_layernorm"
    assert moved == {"input_layernorm", before_mlp}, sym.describe()
    check_a_random_element(model, sym, ids)


def test_gemma_s_config_is_read_as_transformers_reads_it():
    """Gemma's legacy ``hidden_act="gelu"`` is its tanh approximation (transformers reads it so); another activation
    and bidirectional attention are refused; Gemma 2's config without ``layer_types`` slides on blocks 0, 2, ...; a
    cap read from the config must be a positive number."""
    state, ids, logits = _checkpoint(GEMMA)
    config = _config(GEMMA)
    with torch.no_grad():
        torch.testing.assert_close(Llama.from_config({**config, "hidden_act": "gelu"}, state)(ids), logits, rtol=0,
                                   atol=1e-5)  # fmt: skip
    for changed, fragment in (({"hidden_act": "silu"}, "gelu_pytorch_tanh"),
                              ({"use_bidirectional_attention": True}, "attends causally")):  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config({**config, **changed}, state)
    state2, _, _ = _checkpoint(GEMMA2)
    config2 = _config(GEMMA2)
    without = {k: v for k, v in config2.items() if k != "layer_types"}
    assert [layer.self_attn.window for layer in Llama.from_config(without, state2).model.layers] == [3, None]
    for name, value in (("attn_logit_softcapping", -1.0), ("final_logit_softcapping", "30"),
                        ("query_pre_attn_scalar", 0)):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be a positive number"):
            Llama.from_config({**config2, name: value}, state2)
    with pytest.raises(ValueError, match="hidden_activation is 'gelu'"):
        Llama.from_config({**config2, "hidden_activation": "gelu"}, state2)  # Gemma 2 reads it as exact GELU


def test_a_half_precision_gemma_checkpoint_becomes_a_float32_model_with_transformers_gains():
    """transformers computes Gemma's gains ``1 + w`` in float32 whatever the weights' dtype; in bfloat16 they would
    round (by up to 2^-9), so a bfloat16 checkpoint becomes a float32 model (every tensor converted exactly) whose
    gains are float32's sums. The head stays tied to the token table."""
    state, ids, _ = _checkpoint(GEMMA2)
    config = _config(GEMMA2)
    half = {k: v.to(torch.bfloat16) for k, v in state.items()}
    model = Llama.from_config(config, half)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for key, value in half.items():
        expected = value.float() + 1 if key.endswith("norm.weight") else value.float()
        assert torch.equal(params[key].detach(), expected), key
    assert not torch.equal(half["model.norm.weight"].float() + 1, (half["model.norm.weight"] + 1).float())
    single = {k: v.float() for k, v in state.items()}  # float32 weights keep their dtype, gains in float32
    gain = Llama.from_config(config, single).model.norm.weight
    assert gain.dtype == torch.float32 and torch.equal(gain.detach(), single["model.norm.weight"] + 1)


def test_gemma_configs_other_than_those_read_are_refused_and_defaults_are_transformers():
    """A config of another Gemma (Gemma 3's multimodal one, Gemma 3n) or with Gemma's ``hidden_activation`` but no
    model type is refused: read as a LLaMA's, its activation and gains would be wrong (logits 4.5 off). Absent keys
    take the configs' defaults: Gemma 2's caps 50 and 30, Gemma's ``pad_token_id`` 0. Without its config, a checkpoint
    with Gemma 2's blocks is refused by the command line's ``llama:heads=H``."""
    state, _, _ = _checkpoint(GEMMA2)
    config = _config(GEMMA2)
    for changed in ({"model_type": "gemma3"}, {"model_type": "gemma3n_text"}, {"model_type": None}):
        with pytest.raises(ValueError, match="sharpness.Llama reads Gemma's model types"):
            Llama.from_config({**config, **changed}, state)
    bare = {k: v for k, v in config.items()
            if k not in ("attn_logit_softcapping", "final_logit_softcapping", "pad_token_id")}  # fmt: skip
    model = Llama.from_config(bare, state)
    assert (model.model.layers[0].self_attn.softcap, model.logit_softcap) == (50.0, 30.0)
    assert model.model.embed_tokens.padding_idx == 0
    with pytest.raises(ValueError, match="give it, llama:config=PATH"):
        llama_from_spec("llama:heads=4", state)


def test_layout_fields_are_checked():
    for fields, fragment in (({"post_norms": True, "sandwich_norms": True}, "choose one"),
                             ({"activation": "relu"}, "activation must be one of"),
                             ({"norm_offset": 2.0}, "norm_offset must be 0 or 1"),
                             ({"attn_softcap": 0.0}, "attn_softcap must be a positive"),
                             ({"query_pre_attn_scalar": float("inf")}, "query_pre_attn_scalar must be a positive")):
        with pytest.raises(ValueError, match=fragment):
            LlamaLayout(**fields)
    state, _, _ = _checkpoint(GQA)
    with pytest.raises(ValueError, match="unknown layout options"):
        Llama.from_state_dict(state, 4, options={"softcap": 2.0})


def test_gemma3_s_rotary_bases_and_config_forms_are_read_as_transformers_reads_them():
    """Gemma 3's sliding blocks rotate with their own base: the twin gives block 0 (sliding) base 50 and block 1 (full)
    base 1000 scaled linearly by 2, as the config's ``rope_parameters`` keyed by block kind say; one base for both moves
    the logits. Older files' ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` give the same model, and
    without ``layer_types`` the blocks slide but for each ``sliding_window_pattern``-th. Rope parameters keyed
    otherwise, or sliding blocks without a window, are refused."""
    state, ids, logits = _checkpoint(GEMMA3)
    config = _config(GEMMA3)
    model = _model(GEMMA3)
    frequencies = [layer.self_attn.inv_freq for layer in model.model.layers]
    torch.testing.assert_close(frequencies[0], rotary_frequencies(8, 50.0), rtol=0, atol=0)
    torch.testing.assert_close(frequencies[1], rotary_frequencies(8, 1000.0) / 2, rtol=0, atol=0)
    older = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    older.update(rope_theta=1000.0, rope_local_base_freq=50.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                 sliding_window_pattern=2)  # fmt: skip
    one_base = {**config, "rope_parameters": {"full_attention": config["rope_parameters"]["full_attention"],
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}
    with torch.no_grad():
        torch.testing.assert_close(Llama.from_config(older, state)(ids), logits, rtol=0, atol=1e-5)
        assert float((Llama.from_config(one_base, state)(ids) - logits).abs().max()) > 1e-3
    default = {k: v for k, v in config.items() if k != "layer_types"}  # every block but each 6th slides
    assert [layer.self_attn.window for layer in Llama.from_config(default, state).model.layers] == [3, 3]
    for changed, fragment in (({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed by"),
                              ({"sliding_window": None}, "sliding blocks without a sliding_window")):  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            Llama.from_config({**config, **changed}, state)
    with pytest.raises(ValueError, match="local_rope_scaling needs local_theta"):
        Llama(29, WIDTH, 1, 2, local_rope_scaling={"rope_type": "linear", "factor": 2.0})
