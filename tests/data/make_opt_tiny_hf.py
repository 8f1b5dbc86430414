"""Writes ``opt_tiny_hf.safetensors``, ``opt_tiny_post_hf.safetensors`` and ``opt_tiny_plain_hf.safetensors``, with
their ``config.json`` (``opt_tiny_hf.json``, ...): tiny random OPT decoders made by HuggingFace's ``transformers``
(float64, eager attention, parameters moved off the initialization), each with an input and the logits the model gives
for it (keys ``__input_ids``, ``__logits``).

- The first is the layout of OPT-125m and the larger ones: LayerNorms before the branches and a final one, ReLU, biases,
  the head tied to the token table, ``pad_token_id`` 1.
- The second is OPT-350m's: LayerNorms after the residual sums and no final one, token embeddings of width 24 projected
  in to the blocks' 32 and out again (``project_in``, ``project_out``); here also untied, exact GELU, no biases.
- The third has LayerNorms without affine parameters (``layer_norm_elementwise_affine=False``), no final LayerNorm
  (``_remove_final_layer_norm``) and GELU's tanh approximation.

transformers computes the eager softmax in float32 even in a float64 model, so its float64 logits are float32-accurate.
``tests/test_opt.py`` checks `sharpness.OPT` against them. Needs ``transformers`` (not a dependency of this project):
``python tests/data/make_opt_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import OPTConfig, OPTForCausalLM

CONFIGS = {
    "opt_tiny_hf.safetensors": dict(),
    "opt_tiny_post_hf.safetensors": dict(
        do_layer_norm_before=False,
        word_embed_proj_dim=24,
        tie_word_embeddings=False,
        activation_function="gelu",
        enable_bias=False,
    ),
    "opt_tiny_plain_hf.safetensors": dict(
        layer_norm_elementwise_affine=False,
        _remove_final_layer_norm=True,
        activation_function="gelu_new",
    ),
}

for seed, (name, options) in enumerate(CONFIGS.items()):
    torch.manual_seed(seed)
    cfg = OPTConfig(
        **{
            **dict(
                vocab_size=29,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=40,
                max_position_embeddings=16,
                attn_implementation="eager",
            ),
            **options,
        }
    )
    m = OPTForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if cfg.tie_word_embeddings:  # as checkpoints of tied models are saved: the head left out
        sd.pop("lm_head.weight", None)
    ids = torch.randint(0, 29, (3, 9))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    sd["__input_ids"], sd["__logits"] = ids, logits
    generator = f"transformers {transformers.__version__} OPTForCausalLM, eager attention, float64"
    save_file(sd, str(Path(sys.argv[1]) / name), metadata={"generator": generator})
    cfg.to_json_file(str(Path(sys.argv[1]) / name.replace(".safetensors", ".json")))
    print(name, tuple(logits.shape), float(logits.abs().max()), sorted(sd)[:3], len(sd))
