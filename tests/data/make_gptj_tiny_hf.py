"""Writes ``gptj_tiny_hf.safetensors`` and ``gptj_tiny_full_hf.safetensors``, with their ``config.json``
(``gptj_tiny_hf.json``, ...): tiny random GPT-J decoders (EleutherAI's GPT-J-6B layout, CodeGen's blocks) made by
HuggingFace's ``transformers`` (float64, eager attention, parameters moved off the initialization), each with an input
and the logits the model gives for it (keys ``__input_ids``, ``__logits``).

- The first turns the first 8 of each head's 16 features by interleaved rotary pairs (``rotary_dim=8``), GELU's tanh
  approximation, an MLP of 40.
- The second turns all of them (``rotary_dim=16``), exact GELU, the default MLP width (4 times the model's).

transformers computes the eager scores in float32 even in a float64 model, so its float64 logits are float32-accurate.
``tests/test_gptj.py`` checks `sharpness.GPTJ` against them. Needs ``transformers`` (not a dependency of this project):
``python tests/data/make_gptj_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPTJConfig, GPTJForCausalLM

CONFIGS = {
    "gptj_tiny_hf.safetensors": dict(rotary_dim=8, n_inner=40),
    "gptj_tiny_full_hf.safetensors": dict(rotary_dim=16, activation_function="gelu"),
}

for seed, (name, options) in enumerate(CONFIGS.items()):
    torch.manual_seed(seed)
    cfg = GPTJConfig(
        **{
            **dict(vocab_size=29, n_embd=32, n_layer=2, n_head=2, n_positions=16, attn_implementation="eager"),
            **options,
        }
    )
    m = GPTJForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 29, (3, 9))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    sd["__input_ids"], sd["__logits"] = ids, logits
    generator = f"transformers {transformers.__version__} GPTJForCausalLM, eager attention, float64"
    save_file(sd, str(Path(sys.argv[1]) / name), metadata={"generator": generator})
    cfg.to_json_file(str(Path(sys.argv[1]) / name.replace(".safetensors", ".json")))
    print(name, tuple(logits.shape), float(logits.abs().max()), len(sd))
