"""Writes ``timm_vit_tiny.safetensors``, ``timm_vit_tiny_ls_avg``, ``timm_deit_tiny_distilled``,
``timm_vit_tiny_reg_gap``, ``timm_vit_tiny_qknorm``, ``timm_vit_tiny_map`` and ``timm_vit_tiny_map_prefix``: tiny
random vision transformers made by timm (float64, parameters moved off the initialization; 8x8 one-channel images in
2x2 patches, 2 pre-LayerNorm blocks of width 16 with 2 heads, 10 classes): the first as ``vit_tiny_patch16_224`` is
configured (class token, final LayerNorm), the second with LayerScale (``init_values=0.5``) and the tokens' mean
(``global_pool="avg"``, ``fc_norm``), the third DeiT's distilled model (a distillation token and a second head), the
fourth with two register tokens, positions for the patches alone, the mean after the final LayerNorm and no
query/key/value bias (as timm's ``*_reg4_gap_*`` models), the fifth with the query and key normalized per head
(``qk_norm=True``), the sixth pooling by attention (``global_pool="map"``, no class token, as SigLIP's models: a
learned latent query attends to the tokens, then a projection and a LayerNorm'd MLP), the seventh so with a class
token, two registers (which timm's pooling leaves out) and no query/key/value bias in the blocks (the pool's keep
theirs). Each holds images ``__images`` (N, 1, 8, 8) and timm's logits for them (``__logits``);
``tests/test_timm_layout.py`` checks ``tests/timm_like.py`` and `sharpness.TimmViT` against them.

Needs timm (not a dependency of this project): ``python tests/data/make_timm_vit_tiny.py OUT_DIR``. timm imports
torchvision when it loads, and calls none of it for a ViT; where torchvision has no build (this project's CPU-only
machines), ``--stand-in-torchvision`` puts empty modules in its place first.
"""

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty ``torchvision.*`` modules whose every attribute is an inert class (what timm imports, never calls)."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        class Inert(type):
            def __getattr__(cls, name):
                return Inert(name, (), {})

        def inert(name):
            if name.startswith("__"):  # a module's own attributes (__file__ ...): absent, as inspect expects
                raise AttributeError(name)
            return Inert(name, (), {"__init__": lambda self, *a, **k: None})

        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = inert
        return module

    def exec_module(self, module):
        pass


if "--stand-in-torchvision" in sys.argv:
    sys.argv.remove("--stand-in-torchvision")
    sys.meta_path.insert(0, _StandIn())

import timm  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

out = Path(sys.argv[1])
sizes = dict(pretrained=False, img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2)
VARIANTS = (
    ("timm_vit_tiny", "vit_tiny_patch16_224", {}),
    ("timm_vit_tiny_ls_avg", "vit_tiny_patch16_224", {"init_values": 0.5, "global_pool": "avg"}),
    ("timm_deit_tiny_distilled", "deit_tiny_distilled_patch16_224", {}),
    ("timm_vit_tiny_reg_gap", "vit_tiny_patch16_224",  # as vit_base_patch16_reg4_gap_256
     {"reg_tokens": 2, "no_embed_class": True, "global_pool": "avg", "fc_norm": False, "qkv_bias": False}),
    ("timm_vit_tiny_qknorm", "vit_tiny_patch16_224", {"qk_norm": True}),
    ("timm_vit_tiny_map", "vit_tiny_patch16_224",  # as SigLIP's vit_base_patch16_siglip_224: attention pooling
     {"class_token": False, "global_pool": "map", "fc_norm": False}),
    ("timm_vit_tiny_map_prefix", "vit_tiny_patch16_224",  # attention pooling of the tokens after a class token and
     {"global_pool": "map", "fc_norm": False, "reg_tokens": 2, "qkv_bias": False}),  # two registers
)
for name, architecture, extra in VARIANTS:
    torch.manual_seed(0)
    m = timm.create_model(architecture, **sizes, **extra).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, a class token off 0, larger weights
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    images = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        logits = m(images)
    sd["__images"], sd["__logits"] = images, logits
    generator = f"timm {timm.__version__} {architecture} {extra}, float64"
    save_file(sd, str(out / f"{name}.safetensors"), metadata={"generator": generator})
    print(name, tuple(logits.shape), float(logits.abs().max()))
