"""Vision transformers as HuggingFace's ``ViTForImageClassification`` computes them (eval mode: no dropout), and
DeiT's as ``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher`` do (`HFDeiT`: the same body
with a distillation token after the class token, keys ``deit.`` for ``vit.``), written so that ``torch.fx`` traces
them: HuggingFace's own classes do not trace, so the toolkit cannot read them. The module names and state-dict keys are
those of ``transformers`` 5, and the older keys (``encoder.layer.i.attention.attention.query`` ...), which the
checkpoints on the Hub still have, are renamed on loading as transformers renames them
(`HFViT.from_state_dict`).

The image ``(N, C, H, W)`` is cut into ``p x p`` patches embedded by a convolution of stride ``p`` (row-major over the
patch grid), a learned class token is put first and a learned position embedding added; each block is pre-LayerNorm
(``x + o(attn(LN(x)))``, then ``x + fc2(act(fc1(LN(x))))``), attention projects queries, keys and values with separate
Linears and attends over all tokens with scale ``hd^-1/2``; the classifier reads the final LayerNorm's state of the
class token.

HuggingFace's eager attention computes the softmax in float32 whatever the model's dtype, so a float64
``ViTForImageClassification`` is float32-accurate; `HFViT` computes in the dtype it is given.

State-dict keys (``i`` the block index; ``D`` the width, ``C`` the channels, ``P`` the patches, ``F`` the MLP's width,
``K`` the classes)::

    vit.embeddings.cls_token (1, 1, D), vit.embeddings.position_embeddings (1, P + 1, D)
    vit.embeddings.patch_embeddings.projection.weight (D, C, p, p), .bias (D,)
    vit.layers.i.layernorm_before.weight, .bias (D,); vit.layers.i.layernorm_after.weight, .bias (D,)
    vit.layers.i.attention.{q,k,v}_proj.weight (D, D), .bias (D,); vit.layers.i.attention.o_proj.weight, .bias
    vit.layers.i.mlp.fc1.weight (F, D), .bias (F,); vit.layers.i.mlp.fc2.weight (D, F), .bias (D,)
    vit.layernorm.weight, .bias (D,); classifier.weight (K, D), .bias (K,)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._bert import ACTIVATIONS, encoder_config
from sharpness._specs import SpecError, load_fitting, positive_integer, positive_number

# transformers 4's keys -> transformers 5's, in the order transformers 5 renames them (its ViTModel conversion)
_RENAMES = ((r"\.encoder\.layer\.", ".layers."), (r"\.attention\.attention\.(q|k|v)[a-z]*\.", r".attention.\1_proj."),
            (r"\.attention\.output\.dense\.", ".attention.o_proj."), (r"\.intermediate\.dense\.", ".mlp.fc1."),
            (r"\.output\.dense\.", ".mlp.fc2."))  # fmt: skip


def renamed(key: str) -> str:
    """A ``ViTForImageClassification`` key as transformers 5 names it (older keys renamed, newer kept)."""
    for pattern, name in _RENAMES:
        key = re.sub(pattern, name, key)
    return key


def check_vit_options(image: int, patch: int, dim: int, heads: int, eps: float, act: str, act_name: str) -> None:
    """Raises ``ValueError`` (one sentence) unless a vision transformer's sizes and options fit: ``heads`` divides the
    width, the image holds at least one patch, ``act`` (the option ``act_name``) is known and ``eps`` positive."""
    if not positive_integer(heads) or dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
    if not positive_integer(patch) or not positive_integer(image) or image < patch:
        raise ValueError(f"the image side {image} and the patch side {patch} must be positive, the image at least one "
                         "patch")  # fmt: skip
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"{act_name} {act!r} is not one of {', '.join(ACTIVATIONS)}")
    if not positive_number(eps):
        raise ValueError(f"eps={eps} must be a positive finite number")


def check_images(images: Tensor, channels: int, side: int) -> None:
    """Raises ``ValueError`` (one sentence) unless ``images`` are ``(N, channels, side, side)``: a vision transformer's
    inputs (other sizes whose patch grid has as many patches would run, and mean something else)."""
    if images.dim() != 4 or tuple(images.shape[1:]) != (channels, side, side):
        raise ValueError(f"the model takes images (N, {channels}, {side}, {side}), not {tuple(images.shape)}")


class ViTPatchEmbeddings(nn.Module):
    def __init__(self, channels: int, patch: int, dim: int):
        super().__init__()
        self.projection = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, images: Tensor) -> Tensor:
        return self.projection(images).flatten(2).transpose(1, 2)


class ViTEmbeddings(nn.Module):
    """Patches embedded, after the class token (and DeiT's distillation token, ``distilled``), plus the positions."""

    def __init__(self, channels: int, patch: int, patches: int, dim: int, distilled: bool = False):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        if distilled:
            self.distillation_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.position_embeddings = nn.Parameter(torch.zeros(1, patches + 1 + distilled, dim))
        self.patch_embeddings = ViTPatchEmbeddings(channels, patch, dim)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embeddings(images)
        tokens = [self.cls_token.expand(x.size(0), -1, -1)]
        if hasattr(self, "distillation_token"):
            tokens.append(self.distillation_token.expand(x.size(0), -1, -1))
        return torch.cat((*tokens, x), dim=1) + self.position_embeddings


class ViTAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=bias), nn.Linear(dim, dim)

    def _split(self, t: Tensor) -> Tensor:
        return t.view(t.size(0), t.size(1), self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape))


class ViTMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), act

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class ViTLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act: str, bias: bool):
        super().__init__()
        self.attention, self.mlp = ViTAttention(dim, heads, bias), ViTMLP(dim, hidden, act)
        self.layernorm_before, self.layernorm_after = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.layernorm_before(x))
        return x + self.mlp(self.layernorm_after(x))


class ViTBody(nn.Module):
    def __init__(self, channels: int, patch: int, patches: int, dim: int, layers: int, heads: int, hidden: int,
                 eps: float, act: str, bias: bool, distilled: bool = False):  # fmt: skip
        super().__init__()
        self.embeddings = ViTEmbeddings(channels, patch, patches, dim, distilled)
        self.layers = nn.ModuleList(ViTLayer(dim, heads, hidden, eps, act, bias) for _ in range(layers))
        self.layernorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embeddings(images)
        for layer in self.layers:
            x = layer(x)
        return self.layernorm(x)


class _HFVisionTransformer(nn.Module):
    """What `HFViT` and `HFDeiT` share: the body (``vit`` or ``deit``), the input check, and the loading of a
    checkpoint; the subclass sets ``prefix``, ``distilled`` (DeiT's distillation token), ``checkpoint`` (transformers'
    class, and its base model's, for messages) and its own heads."""

    prefix, distilled, checkpoint, base = "vit", False, "ViTForImageClassification", "ViTModel"

    def _build(self, image: int, patch: int, dim: int, layers: int, heads: int, channels: int, hidden: int | None,
               eps: float, act: str, qkv_bias: bool) -> None:  # fmt: skip
        check_vit_options(image, patch, dim, heads, eps, act, "hidden_act")
        self.image = image
        setattr(self, self.prefix, ViTBody(channels, patch, (image // patch) ** 2, dim, layers, heads,
                                           4 * dim if hidden is None else hidden, eps, act, qkv_bias,
                                           self.distilled))  # fmt: skip

    def _body(self) -> ViTBody:
        return getattr(self, self.prefix)

    def _heads(self) -> list[nn.Linear]:
        """The classifiers the subclass built (``classifier``, or DeiT's teacher's two)."""
        names = ("classifier", "cls_classifier", "distillation_classifier")
        return [getattr(self, name) for name in names if hasattr(self, name)]

    def check_inputs(self, images: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``images`` are ``(N, C, image, image)`` with the model's
        channels, as HuggingFace's classes refuse other sizes (other sizes whose patch grid has as many patches would
        run, and mean something else)."""
        check_images(images, self._body().embeddings.patch_embeddings.projection.in_channels, self.image)

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor]) -> _HFVisionTransformer:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-12) and ``hidden_act`` (default ``gelu``); the image and patch sizes, the
        channels and ``qkv_bias`` are read off the tensors (and checked against the config where it gives them).

        Raises:
            ValueError: a field missing or of the wrong kind, or what `from_state_dict` raises.
        """
        name = f"sharpness.{cls.__name__}"
        heads, eps, act = encoder_config(config, name)
        sizes = {}
        for key in ("image_size", "patch_size"):  # an int, or [H, W] (transformers takes either)
            value = config.get(key)
            if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
                value = value[0]
            if value is not None and not positive_integer(value):
                raise SpecError(f"the config's {key} is {config[key]!r}; {name} takes square images and patches of a "
                                "positive integer side")  # fmt: skip
            sizes[key] = value
        model = cls.from_state_dict(state, heads, eps, act, sizes["image_size"])
        body = model._body()
        patch, layers = body.embeddings.patch_embeddings.projection, body.layers
        read = {"patch_size": patch.kernel_size[0], "num_channels": patch.in_channels, "num_hidden_layers": len(layers),
                "hidden_size": patch.out_channels, "num_labels": model._heads()[0].out_features,
                "intermediate_size": layers[0].mlp.fc1.out_features if len(layers) else None,
                "qkv_bias": layers[0].attention.q_proj.bias is not None if len(layers) else None}  # fmt: skip
        for key, value in read.items():
            given = sizes.get(key, config.get(key))
            if key == "num_labels" and "num_labels" not in config and "id2label" in config:
                given = len(config["id2label"])  # transformers writes the labels' names, not their number
            if given is not None and value is not None and given != value:
                raise SpecError(f"the config's {key} is {given!r} but the checkpoint's tensors give {value!r}")
        return model

    @classmethod
    def _head_keys(cls, tensors: Mapping[str, Tensor]) -> tuple[str, dict[str, object]]:
        """The key of the head's weight the classes are read from, and the constructor's options the heads found in
        ``tensors`` set."""
        return "classifier.weight", {}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-12, act: str = "gelu",
                        image: int | None = None) -> _HFVisionTransformer:  # fmt: skip
        """The model of a checkpoint's state dict (transformers 5's keys, or the older ones, renamed as transformers
        renames them), its sizes read off the tensors (square images: the side from the number of patches, unless
        ``image`` gives it, a side the stride does not divide); ``heads`` (``num_attention_heads``), ``eps``
        (``layer_norm_eps``) and ``act`` (``hidden_act``) are in its ``config.json``, which no shape holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``heads`` does not divide the width.
        """
        p, family = cls.prefix, cls.__name__.removeprefix("HF")
        tensors = {renamed(k): v for k, v in state.items()}
        if f"{p}.embeddings.cls_token" not in tensors and "embeddings.cls_token" in tensors:
            raise SpecError(f"the state dict is a {cls.base}'s (keys without the {p}. prefix, no classifier); give a "
                            f"{cls.checkpoint} checkpoint")  # fmt: skip
        head, options = cls._head_keys(tensors)
        projection = f"{p}.embeddings.patch_embeddings.projection.weight"
        positions = f"{p}.embeddings.position_embeddings"
        for key, dims in {projection: 4, positions: 3, head: 2}.items():
            if tensors.get(key, torch.empty(0)).dim() != dims:
                owner = f" (a {cls.checkpoint} checkpoint has one)" if key == head else ""
                raise SpecError(f"the {family} state dict has no {dims}-axis tensor {key}{owner}")
        dim, channels, patch, other = tensors[projection].shape
        prefixed = 1 + cls.distilled  # the class token, and DeiT's distillation token
        side = math.isqrt(max(tensors[positions].shape[1] - prefixed, 0))
        if patch != other or side * side + prefixed != tensors[positions].shape[1]:
            raise SpecError(f"the {family} state dict's patches are not square, or its positions not a square grid "
                            f"plus {prefixed} token(s): sharpness.{cls.__name__} takes square images")  # fmt: skip
        if image is not None and (not positive_integer(image) or image // patch != side):
            raise SpecError(f"the image side {image!r} does not give the checkpoint's {side} x {side} patches of "
                            f"{patch}")  # fmt: skip
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(rf"{p}\.layers\.(\d+)\.", k))})
        fc1 = tensors.get(f"{p}.layers.0.mlp.fc1.weight", torch.empty(0))
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        try:
            image_side = side * patch if image is None else image
            model = cls(image_side, patch, dim, layers, heads, tensors[head].shape[0], channels,
                        fc1.shape[0] if fc1.dim() == 2 else 4 * dim, eps, act,
                        f"{p}.layers.0.attention.q_proj.bias" in tensors or not layers, **options)  # fmt: skip
        except ValueError as failure:
            raise SpecError(str(failure)) from None
        return load_fitting(model, tensors, f"{family} with {layers} blocks of width {dim}", set(), projection)


class HFViT(_HFVisionTransformer):
    """A vision transformer with its classifier, as HuggingFace's ``ViTForImageClassification`` computes it in eval
    mode (see the module's docstring).

    Args:
        image: the image's side ``H = W`` (``image_size``), at least ``patch``; the convolution's stride leaves out
            the last ``image % patch`` rows and columns, as HuggingFace's does.
        patch: the patches' side ``p`` (``patch_size``).
        dim: width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block (``num_attention_heads``).
        classes: the classifier's outputs ``K`` (``num_labels``).
        channels: the image's channels ``C`` (``num_channels``).
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 * dim``.
        eps: the LayerNorms' epsilon (``layer_norm_eps``).
        act: the MLP's activation (``hidden_act``): ``"gelu"``, ``"relu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.
        qkv_bias: whether the query, key and value projections have biases (``qkv_bias``).

    Inputs are images ``(N, C, image, image)`` (`check_inputs`); outputs are logits ``(N, K)``.
    """

    def __init__(self, image: int, patch: int, dim: int, layers: int, heads: int, classes: int = 1000,
                 channels: int = 3, hidden: int | None = None, eps: float = 1e-12, act: str = "gelu",
                 qkv_bias: bool = True):  # fmt: skip
        super().__init__()
        self._build(image, patch, dim, layers, heads, channels, hidden, eps, act, qkv_bias)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.vit(images)[:, 0])


class HFDeiT(_HFVisionTransformer):
    """A data-efficient image transformer (DeiT) as HuggingFace's ``DeiTForImageClassification`` (``teacher=False``:
    one classifier on the class token) or ``DeiTForImageClassificationWithTeacher`` (``teacher=True``: the mean of
    ``cls_classifier`` on the class token and ``distillation_classifier`` on the distillation token) computes it in
    eval mode. The body is `HFViT`'s (keys ``deit.`` for ``vit.``), with a learned distillation token after the class
    token (``deit.embeddings.distillation_token (1, 1, D)``; positions ``(1, P + 2, D)``).

    Args: those of `HFViT`, and ``teacher`` (the heads, above).

    Inputs are images ``(N, C, image, image)`` (`check_inputs`); outputs are logits ``(N, K)``.
    """

    prefix, distilled, checkpoint, base = "deit", True, "DeiTForImageClassification(WithTeacher)", "DeiTModel"

    def __init__(self, image: int, patch: int, dim: int, layers: int, heads: int, classes: int = 1000,
                 channels: int = 3, hidden: int | None = None, eps: float = 1e-12, act: str = "gelu",
                 qkv_bias: bool = True, teacher: bool = False):  # fmt: skip
        super().__init__()
        self._build(image, patch, dim, layers, heads, channels, hidden, eps, act, qkv_bias)
        if teacher:
            self.cls_classifier, self.distillation_classifier = nn.Linear(dim, classes), nn.Linear(dim, classes)
        else:
            self.classifier = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        h = self.deit(images)
        if hasattr(self, "classifier"):
            return self.classifier(h[:, 0])
        return (self.cls_classifier(h[:, 0]) + self.distillation_classifier(h[:, 1])) / 2

    @classmethod
    def _head_keys(cls, tensors: Mapping[str, Tensor]) -> tuple[str, dict[str, object]]:
        if "cls_classifier.weight" in tensors:
            return "cls_classifier.weight", {"teacher": True}
        return "classifier.weight", {}
