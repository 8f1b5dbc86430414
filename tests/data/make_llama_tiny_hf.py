"""Writes ``llama_tiny_hf.safetensors``, ``llama_tiny_tied_hf.safetensors``, ``llama_tiny_rope_hf.safetensors``,
``mistral_tiny_hf.safetensors``, ``qwen2_tiny_hf.safetensors``, ``ministral_tiny_hf.safetensors``,
``qwen3_tiny_hf.safetensors``, ``olmo2_tiny_hf.safetensors`` and ``phi3_tiny_hf.safetensors``: tiny random
decoders made by HuggingFace's ``transformers`` (float64, eager attention, parameters moved off the initialization),
each with an input and the logits the model gives for it (keys ``__input_ids``, ``__logits``).

- The first has grouped-query attention (4 query heads sharing 2 key/value heads), rope_theta 500 and an untied head.
- The second 2 heads of 8, biases on every attention projection (``attention_bias``) and the MLP (``mlp_bias``), and
  the head tied to the token table (no ``lm_head.weight`` key).
- The third LLaMA 3.1's scaled rotary embeddings (``rope_type="llama3"``).
- The fourth is a ``MistralForCausalLM`` whose attention sees a sliding window of 3 tokens.
- YaRN, dynamic NTK and LongRoPE scalings (``llama_tiny_yarn_hf``, ``llama_tiny_dynamic_hf``,
  ``llama_tiny_longrope_hf``), each also with the logits of the first 5 tokens (``__short_logits``).
- The fifth a ``Qwen2ForCausalLM`` (query/key/value biases) with that window on its second block only
  (``use_sliding_window``, ``max_window_layers=1``), the sixth a ``MinistralForCausalLM`` with it on its first block
  only (``layer_types``), the seventh a ``Qwen3ForCausalLM`` (query/key RMSNorms per head, heads of 12 features on a
  width of 16), the eighth an ``Olmo2ForCausalLM`` (query/key RMSNorms over the whole width, norms on the blocks'
  branches' outputs), the ninth a ``Phi3ForCausalLM`` (fused ``qkv_proj`` and ``gate_up_proj``, grouped-query
  attention, a sliding window of 3 tokens).
- ``gemma_tiny_hf``, a ``GemmaForCausalLM``, and ``gemma2_tiny_hf`` and ``gemma2_nocap_tiny_hf``, two
  ``Gemma2ForCausalLM`` (with and without the attention scores' soft cap), ``gemma3_tiny_hf``, a
  ``Gemma3ForCausalLM``: see ``CONFIGS`` below.

All but the first two have their ``config.json`` beside them (``llama_tiny_rope_hf.json``, ...). HuggingFace's RMSNorm
and softmax compute in float32 even in a float64 model, so its float64 logits are float32-accurate.
``tests/test_llama.py`` checks `sharpness.Llama` against them. Needs ``transformers`` (not a dependency of this
project): ``python tests/data/make_llama_tiny_hf.py OUT_DIR [FILE ...]`` (the files named, or all).
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CONFIGS = {
    "llama_tiny_hf.safetensors": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0,
                                      tie_word_embeddings=False),
    "llama_tiny_tied_hf.safetensors": dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True,
                                           mlp_bias=True, tie_word_embeddings=True),
    # LLaMA 3.1's scaled rotary embeddings: heads of 8 have wavelengths 6.3, 63, 628 and 6283 positions, so with an
    # original context of 64 the first is kept, the second blended and the last two divided by the factor
    "llama_tiny_rope_hf.safetensors": dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}),
}

# Mistral: LLaMA's keys and layers, its attention limited to a sliding window of 3 tokens (the inputs have 9)
MISTRAL = "mistral_tiny_hf.safetensors"
CONFIGS[MISTRAL] = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=3)
# Qwen2 (query/key/value biases) with the window on the second block only (max_window_layers=1), and Ministral with
# the window on the first block only (layer_types)
QWEN2, MINISTRAL = "qwen2_tiny_hf.safetensors", "ministral_tiny_hf.safetensors"
# after the scaled ones below (each file's seed is its place in CONFIGS)
QWEN3, OLMO2, PHI3 = "qwen3_tiny_hf.safetensors", "olmo2_tiny_hf.safetensors", "phi3_tiny_hf.safetensors"
CONFIGS[QWEN2] = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=3,
                      use_sliding_window=True, max_window_layers=1)
CONFIGS[MINISTRAL] = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=3,
                          layer_types=["sliding_attention", "full_attention"], head_dim=8)  # its config has no default
CLASSES = {MISTRAL: (MistralConfig, MistralForCausalLM), QWEN2: (Qwen2Config, Qwen2ForCausalLM),
           MINISTRAL: (MinistralConfig, MinistralForCausalLM), QWEN3: (Qwen3Config, Qwen3ForCausalLM),
           OLMO2: (Olmo2Config, Olmo2ForCausalLM), PHI3: (Phi3Config, Phi3ForCausalLM)}
# the rope scalings that depend on the sequence's length or scale cos and sin: YaRN (original context 4 of 16),
# dynamic NTK (the base grows past max_position_embeddings=6) and LongRoPE (long factors past an original context of 6);
# each also with the logits of the first 5 tokens (keys __short_logits), under 6 positions
SCALED = {"llama_tiny_yarn_hf.safetensors": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 4}),
          "llama_tiny_dynamic_hf.safetensors": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                                    max_position_embeddings=6),
          "llama_tiny_longrope_hf.safetensors": dict(rope_scaling={"rope_type": "longrope",
                                                                   "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                                   "long_factor": [1.0, 2.0, 4.0, 8.0],
                                                                   "original_max_position_embeddings": 6},
                                                     max_position_embeddings=24)}
for name, options in SCALED.items():
    CONFIGS[name] = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, **options)
# Qwen3: an RMSNorm over each head's features on the queries and on the keys (q_norm, k_norm) before the rotary
# embedding, and heads of 12 features, not the width over the heads
CONFIGS[QWEN3] = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, head_dim=12)
# OLMo 2: RMSNorms of the queries and of the keys over all their features, before the heads are split, and the blocks'
# norms on the branches' outputs (post_attention_layernorm, post_feedforward_layernorm)
CONFIGS[OLMO2] = dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
# Phi-3: one fused query/key/value projection (qkv_proj, cut by slices) and one fused gate/up projection (gate_up_proj,
# cut by chunk), 4 query heads sharing 2 key/value heads, a sliding window of 3 tokens on every block
CONFIGS[PHI3] = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=3,
                     pad_token_id=28)  # the last token pads (Phi-3's is 32000 of 32064)
# Gemma: RMSNorms by 1 + w, a GeGLU MLP (tanh-approximated GELU), embeddings times sqrt(16) = 4, heads of 12 on a
# width of 16, the head tied to the token table; Gemma 2: besides, a norm before and after each branch, scores over
# sqrt(query_pre_attn_scalar), soft caps on the scores and the logits (small, so that tanh bends them), a window of 3
# on the first block (layer_types' default); its twin without the score cap (transformers' eager attention either
# way; the toolkit's SDPA where there is no cap)
GEMMA, GEMMA2 = "gemma_tiny_hf.safetensors", "gemma2_tiny_hf.safetensors"
GEMMA2_NOCAP = "gemma2_nocap_tiny_hf.safetensors"
CLASSES.update({GEMMA: (GemmaConfig, GemmaForCausalLM), GEMMA2: (Gemma2Config, Gemma2ForCausalLM),
                GEMMA2_NOCAP: (Gemma2Config, Gemma2ForCausalLM)})
CONFIGS[GEMMA] = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=12, tie_word_embeddings=True)
GEMMA2_SIZES = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                    query_pre_attn_scalar=10, sliding_window=3, final_logit_softcapping=3.0)
CONFIGS[GEMMA2] = dict(**GEMMA2_SIZES, attn_logit_softcapping=2.0)
CONFIGS[GEMMA2_NOCAP] = dict(**GEMMA2_SIZES, attn_logit_softcapping=None)
# Gemma 3 (text): besides Gemma 2's blocks, query/key RMSNorms per head (by 1 + w), no soft caps, and a rotary
# embedding per kind of block: base 50 on the sliding block 0, base 1000 scaled linearly by 2 on the full block 1
GEMMA3 = "gemma3_tiny_hf.safetensors"
CLASSES[GEMMA3] = (Gemma3TextConfig, Gemma3ForCausalLM)
CONFIGS[GEMMA3] = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                       query_pre_attn_scalar=10, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
WRITE = set(sys.argv[2:]) or set(CONFIGS)  # the files to write (default: all)

for seed, (name, options) in enumerate(CONFIGS.items()):
    torch.manual_seed(seed)
    theta = options.pop("rope_theta", 10000.0)
    rope = {"rope_type": "default", "rope_theta": theta, **options.pop("rope_scaling", {})}
    make_config, make_model = CLASSES.get(name, (LlamaConfig, LlamaForCausalLM))
    cfg = make_config(**{**dict(vocab_size=29, hidden_size=16, num_hidden_layers=2, intermediate_size=24,
                                rms_norm_eps=1e-5, max_position_embeddings=16, attn_implementation="eager",
                                rope_parameters=rope), **options})
    m = make_model(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # RMSNorm weights off 1, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if cfg.tie_word_embeddings:
        assert m.lm_head.weight is m.model.embed_tokens.weight
        del sd["lm_head.weight"]
    ids = torch.randint(0, 29, (3, 9))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    sd["__input_ids"], sd["__logits"] = ids, logits
    if name in SCALED:
        with torch.no_grad():
            sd["__short_logits"] = m(input_ids=ids[:, :5]).logits
    if name not in WRITE:
        continue
    generator = f"transformers {transformers.__version__} {make_model.__name__}, eager attention, float64"
    save_file(sd, str(Path(sys.argv[1]) / name), metadata={"generator": generator,
              "num_attention_heads": str(cfg.num_attention_heads), "rope_theta": str(theta)})
    if rope["rope_type"] != "default" or name in CLASSES:  # its config.json too, as the library writes it
        cfg.to_json_file(str(Path(sys.argv[1]) / name.replace(".safetensors", ".json")))
    print(name, tuple(logits.shape), float(logits.abs().max()))
