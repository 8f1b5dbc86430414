"""Writes ``deit_tiny_hf.safetensors`` and ``deit_teacher_tiny_hf.safetensors`` with their ``config.json``
(``deit_tiny_hf.json``): tiny random ``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher``
made by HuggingFace's ``transformers`` from one config (float64, eager attention, parameters moved off the
initialization; 8x8 one-channel images in 2x2 patches, the class and distillation tokens, 2 pre-LayerNorm blocks of
width 16 with 2 heads, 10 classes), with images ``__images`` (N, 1, 8, 8) and the logits each model gives for them
(``__logits``). HuggingFace's eager attention computes the softmax in float32 even in a float64 model, so the logits
are float32-accurate. ``tests/test_deit.py`` checks `sharpness.HFDeiT` against them. Needs ``transformers`` (not a
dependency of this project): ``python tests/data/make_deit_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher

torch.manual_seed(0)
cfg = DeiTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=24, num_labels=10, layer_norm_eps=1e-6, attn_implementation="eager")  # fmt: skip
images = torch.randn(5, 1, 8, 8, dtype=torch.float64)
out = Path(sys.argv[1])
for cls, stem in ((DeiTForImageClassification, "deit_tiny_hf"), (DeiTForImageClassificationWithTeacher,
                                                                  "deit_teacher_tiny_hf")):  # fmt: skip
    m = cls(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
        logits = m(pixel_values=images).logits
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    sd["__images"], sd["__logits"] = images, logits
    generator = f"transformers {transformers.__version__} {cls.__name__}, eager attention, float64"
    save_file(sd, str(out / f"{stem}.safetensors"), metadata={"generator": generator})
    print(stem, tuple(logits.shape), float(logits.abs().max()), sorted(k for k in sd if "classifier" in k))
cfg.to_json_file(str(out / "deit_tiny_hf.json"))
