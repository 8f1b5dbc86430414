"""A traceable twin of a model object of HuggingFace's ``transformers``: its config and weights read into the toolkit's
own class for its family (`sharpness.Llama`, `sharpness.GPT2`, `sharpness.GPTNeoX`, `sharpness.GPTJ`, `sharpness.OPT`,
`sharpness.Phi`, `sharpness.Bert`, `sharpness.Roberta`, `sharpness.Electra`, `sharpness.DistilBert`,
`sharpness.HFViT`, `sharpness.HFDeiT`).

transformers' classes do not trace with ``torch.fx`` (their mask builders call ``torch.finfo`` on a traced dtype and
their layers unpack traced tuples), so no symmetry group or R-operator product can be read off them; the twin computes
the same function (to the float32 rounding of transformers' RMSNorm and softmax) with the same parameter names, from
the object the user already holds. ``transformers`` itself is not imported: the object is read through
``config.to_dict()`` and ``state_dict()``.
"""

from __future__ import annotations

from torch import nn

from sharpness._bert import Bert
from sharpness._distilbert import DistilBert
from sharpness._electra import Electra
from sharpness._gpt2 import GPT2
from sharpness._gptj import GPTJ
from sharpness._hfvit import HFDeiT, HFViT
from sharpness._llama import Llama
from sharpness._neox import GPTNeoX
from sharpness._opt import OPT
from sharpness._phi import Phi
from sharpness._roberta import Roberta

# the classes read, by model type: (the endings of the class names accepted, the twin's loader of a config, a state
# dict and classes_last)
_LLAMA_FAMILY = ("llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "phi3", "gemma", "gemma2",
                 "gemma3_text")
_CLASSES = {
    **{kind: ("ForCausalLM", Llama.from_config) for kind in _LLAMA_FAMILY},
    "gpt2": ("GPT2LMHeadModel", GPT2.from_config),
    "gpt_neox": ("GPTNeoXForCausalLM", GPTNeoX.from_config),
    "gptj": ("GPTJForCausalLM", GPTJ.from_config),
    "opt": ("OPTForCausalLM", OPT.from_config),
    "phi": ("PhiForCausalLM", Phi.from_config),
    "bert": ("BertForSequenceClassification", lambda config, state, _: Bert.from_config(config, state)),
    **{kind: (f"{prefix}ForSequenceClassification", lambda config, state, _: Roberta.from_config(config, state))
       for kind, prefix in (("roberta", "Roberta"), ("xlm-roberta", "XLMRoberta"), ("camembert", "Camembert"))},
    "electra": ("ElectraForSequenceClassification", lambda config, state, _: Electra.from_config(config, state)),
    "distilbert": ("DistilBertForSequenceClassification",
                   lambda config, state, _: DistilBert.from_config(config, state)),
    "vit": ("ViTForImageClassification", lambda config, state, _: HFViT.from_config(config, state)),
    "deit": (("DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"),
             lambda config, state, _: HFDeiT.from_config(config, state)),
}


def from_transformers(model: nn.Module, classes_last: bool = True) -> nn.Module:
    """The toolkit's twin of a transformers model object, in eval mode, in the dtype and on the device of its weights
    (a half-precision Gemma: float32, since transformers computes its norm gains in float32).

    Reads ``model.config.to_dict()`` and ``model.state_dict()`` into the class of its family:

    - ``LlamaForCausalLM`` and the LLaMA family's other causal LMs (Mistral, Ministral, Qwen2, Qwen3, OLMo 2, Phi-3,
      Gemma, Gemma 2, Gemma 3's text-only ``Gemma3ForCausalLM``) -> [`Llama`][sharpness.Llama] (`Llama.from_config`;
      Gemma's RMSNorm weights ``w`` become the gains ``1 + w`` the norms multiply by, see
      [`LlamaLayout`][sharpness.LlamaLayout]);
    - ``GPT2LMHeadModel`` -> [`GPT2`][sharpness.GPT2];
    - ``GPTNeoXForCausalLM`` (Pythia) -> [`GPTNeoX`][sharpness.GPTNeoX];
    - ``GPTJForCausalLM`` -> [`GPTJ`][sharpness.GPTJ];
    - ``OPTForCausalLM`` -> [`OPT`][sharpness.OPT];
    - ``PhiForCausalLM`` (phi-1, phi-1.5, phi-2) -> [`Phi`][sharpness.Phi];
    - ``BertForSequenceClassification`` -> [`Bert`][sharpness.Bert];
    - ``RobertaForSequenceClassification``, ``XLMRobertaForSequenceClassification`` and
      ``CamembertForSequenceClassification`` -> [`Roberta`][sharpness.Roberta];
    - ``ElectraForSequenceClassification`` -> [`Electra`][sharpness.Electra];
    - ``DistilBertForSequenceClassification`` -> [`DistilBert`][sharpness.DistilBert];
    - ``ViTForImageClassification`` -> [`HFViT`][sharpness.HFViT];
    - ``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher`` -> [`HFDeiT`][sharpness.HFDeiT].

    Args:
        model: the transformers object (``AutoModelForCausalLM.from_pretrained(...)``, say).
        classes_last: for the decoders, logits ``(N, T, V)`` as transformers returns them (``True``), or ``(N, V,
            T)``, the layout ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets.

    Returns:
        The twin: the same function of token ids (or images), the same parameter names as ``model``'s state dict
            (the same values but for Gemma's norm gains).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` with a ``config`` that has ``to_dict()``.
        ValueError: a model type or class the toolkit has no twin for (a base model without its head, an
            encoder-decoder), or a config the twin's loader refuses (named in the message).
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"from_transformers expects a transformers model object (an nn.Module with a config), got "
                        f"{type(model).__name__}")  # fmt: skip
    settings = config.to_dict()
    kind, name = settings.get("model_type"), type(model).__name__
    if kind not in _CLASSES:
        families = ", ".join(sorted(_CLASSES))
        raise ValueError(f"no twin for transformers' model type {kind!r} ({name}); the toolkit reads {families}")
    accepted, load = _CLASSES[kind]
    if not name.endswith(accepted):
        accepted = " or *".join((accepted,) if isinstance(accepted, str) else accepted)
        raise ValueError(f"no twin for {name}: for model type {kind!r} the toolkit reads *{accepted} (a model with its "
                         "head; a base model's outputs are hidden states, another function)")  # fmt: skip
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):
        raise ValueError(f"{name}'s weights are on the meta device (not loaded): load them before making its twin")
    twin = load(settings, state, classes_last)
    first = next(iter(state.values()), None)
    return twin if first is None else twin.to(first.device)


__all__ = ["from_transformers"]
