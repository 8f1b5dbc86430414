"""Writes ``neox_tiny_hf.safetensors`` and ``neox_tiny_sequential_hf.safetensors``, with their ``config.json``
(``neox_tiny_hf.json``, ...): tiny random GPT-NeoX decoders made by HuggingFace's ``transformers`` (float64, eager
attention, parameters moved off the initialization), each with an input and the logits the model gives for it (keys
``__input_ids``, ``__logits``).

- The first is Pythia's layout: parallel residuals, the rotary embedding on a quarter of each head's 16 features
  (``partial_rotary_factor=0.25``: 4 of them), an untied head.
- The second adds the branches one after the other (``use_parallel_residual=False``), turns half of each head's
  features with base 500, has no attention biases (``attention_bias=False``) and GELU's tanh approximation.

transformers computes the eager softmax in float32 even in a float64 model, so its float64 logits are float32-accurate.
``tests/test_neox.py`` checks `sharpness.GPTNeoX` against them. Needs ``transformers`` (not a dependency of this
project): ``python tests/data/make_neox_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

CONFIGS = {
    "neox_tiny_hf.safetensors": dict(
        use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "neox_tiny_sequential_hf.safetensors": dict(
        use_parallel_residual=False,
        attention_bias=False,
        hidden_act="gelu_new",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    ),
}

for seed, (name, options) in enumerate(CONFIGS.items()):
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        **{
            **dict(
                vocab_size=29,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=40,
                layer_norm_eps=1e-5,
                max_position_embeddings=16,
                tie_word_embeddings=False,
                attn_implementation="eager",
            ),
            **options,
        }
    )
    m = GPTNeoXForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 29, (3, 9))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    sd["__input_ids"], sd["__logits"] = ids, logits
    generator = f"transformers {transformers.__version__} GPTNeoXForCausalLM, eager attention, float64"
    save_file(sd, str(Path(sys.argv[1]) / name), metadata={"generator": generator})
    cfg.to_json_file(str(Path(sys.argv[1]) / name.replace(".safetensors", ".json")))
    print(name, tuple(logits.shape), float(logits.abs().max()))
