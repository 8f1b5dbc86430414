"""Writes ``hfvit_tiny_hf.safetensors`` and its ``config.json`` (``hfvit_tiny_hf.json``): a tiny random
``ViTForImageClassification`` made by HuggingFace's ``transformers`` (float64, eager attention, parameters moved off the
initialization; 8x8 one-channel images in 2x2 patches, 2 pre-LayerNorm blocks of width 16 with 2 heads, 10 classes),
with images ``__images`` (N, 1, 8, 8) and the logits the model gives for them (``__logits``). HuggingFace computes the
attention's softmax in float32 even in a float64 model, so the logits are float32-accurate. ``tests/test_hfvit.py``
checks `sharpness.HFViT` against them. Needs ``transformers`` (not a dependency of this project):
``python tests/data/make_hfvit_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import ViTConfig, ViTForImageClassification

torch.manual_seed(0)
cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=24, num_labels=10, layer_norm_eps=1e-6, attn_implementation="eager")
m = ViTForImageClassification(cfg).double().eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
images = torch.randn(5, 1, 8, 8, dtype=torch.float64)
with torch.no_grad():
    logits = m(pixel_values=images).logits
sd["__images"], sd["__logits"] = images, logits
generator = f"transformers {transformers.__version__} ViTForImageClassification, eager attention, float64"
out = Path(sys.argv[1])
save_file(sd, str(out / "hfvit_tiny_hf.safetensors"), metadata={"generator": generator})
cfg.to_json_file(str(out / "hfvit_tiny_hf.json"))
print(tuple(logits.shape), float(logits.abs().max()))
