"""Writes ``phi_tiny_hf.safetensors`` and ``phi_tiny_qk_hf.safetensors``, with their ``config.json``
(``phi_tiny_hf.json``, ...): tiny random Phi decoders (Microsoft's phi-1, phi-1.5 and phi-2 layout) made by
HuggingFace's ``transformers`` (float64, eager attention, parameters moved off the initialization), each with an input
and the logits the model gives for it (keys ``__input_ids``, ``__logits``).

- The first is phi-2's layout: one LayerNorm read by attention and the MLP side by side, the rotary embedding on 40% of
  each head's 16 features (``partial_rotary_factor=0.4``: 6 of them), GELU's tanh approximation, a head with a bias;
  here also one key/value head for two query heads.
- The second normalizes each head's queries and keys by LayerNorms (``qk_layernorm``), turns half of each head's
  features with base 500, exact GELU, and ties the head's weight to the token table.

transformers computes the eager softmax in float32 even in a float64 model, so its float64 logits are float32-accurate.
``tests/test_phi.py`` checks `sharpness.Phi` against them. Needs ``transformers`` (not a dependency of this project):
``python tests/data/make_phi_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import PhiConfig, PhiForCausalLM

CONFIGS = {
    "phi_tiny_hf.safetensors": dict(
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4},
    ),
    "phi_tiny_qk_hf.safetensors": dict(
        qk_layernorm=True,
        hidden_act="gelu",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    ),
}

for seed, (name, options) in enumerate(CONFIGS.items()):
    torch.manual_seed(seed)
    cfg = PhiConfig(
        **{
            **dict(
                vocab_size=29,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=40,
                layer_norm_eps=1e-5,
                max_position_embeddings=16,
                attn_implementation="eager",
            ),
            **options,
        }
    )
    m = PhiForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if cfg.tie_word_embeddings:  # as checkpoints of tied models are saved: the head's weight left out
        sd.pop("lm_head.weight", None)
    ids = torch.randint(0, 29, (3, 9))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    sd["__input_ids"], sd["__logits"] = ids, logits
    generator = f"transformers {transformers.__version__} PhiForCausalLM, eager attention, float64"
    save_file(sd, str(Path(sys.argv[1]) / name), metadata={"generator": generator})
    cfg.to_json_file(str(Path(sys.argv[1]) / name.replace(".safetensors", ".json")))
    print(name, tuple(logits.shape), float(logits.abs().max()), len(sd))
