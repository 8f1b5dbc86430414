"""Models, data and checkpoints named on the command line, loaded safely.

Model SPEC: ``mlp:784-300-100-10`` (``nn.Sequential`` of Linear/ReLU: keys ``0.weight``, ``0.bias``,
``2.weight`` ...), ``lenet`` (the flatness paper's C1 on 1x28x28 inputs), ``resnet:20`` (a CIFAR-style
ResNet-20/32/56 with BatchNorm on 3x32x32 inputs; options ``width=``, ``classes=``, ``channels=``, e.g.
``resnet:20,width=2``), ``vit`` (a small vision transformer on 8x8 one-channel images, 2x2 patches, inputs
``(N, 64)`` or ``(N, 1, 8, 8)``; options ``dim=``, ``heads=``, ``depth=``, ``mlp=``, ``classes=``,
``norm=pre|post``, ``act=relu|gelu``, ``attn=mha|hand``, e.g. ``vit:dim=32,heads=4``; keys in
`sharpness._vit`), ``gpt2:heads=H`` (GPT-2 with the sizes of its checkpoint, HuggingFace's keys; token ids
``(N, T)`` in, logits ``(N, V, T)`` out; `sharpness._gpt2`; or ``gpt2:config=PATH``, the checkpoint's
``config.json``), ``llama:heads=H[,eps=E,theta=T]`` or ``llama:config=PATH`` (a LLaMA-family decoder with the sizes
of its checkpoint, the same way; `sharpness._llama`), ``neox:config=PATH`` (GPT-NeoX, EleutherAI's Pythia, the same
way; `sharpness._neox`), ``gptj:config=PATH`` (GPT-J, the same way; `sharpness._gptj`), ``opt:config=PATH`` (OPT,
the same way; `sharpness._opt`), ``phi:config=PATH`` (Phi-1, 1.5
and 2, the same way; `sharpness._phi`), ``bert:heads=H[,eps=E,act=A]`` or
``bert:config=PATH`` (a
BERT sequence classifier, the same way; token ids ``(N, T)`` or ids, token types and attention mask ``(N, 3, T)``
in, logits ``(N, C)`` out; `sharpness._bert`), ``roberta:heads=H[,eps=E,act=A,pad=ID]`` or ``roberta:config=PATH``
(a RoBERTa, XLM-RoBERTa or CamemBERT sequence classifier, the same way and on the same inputs; `sharpness._roberta`),
``electra:heads=H[,eps=E,act=A]`` or ``electra:config=PATH`` (an ELECTRA discriminator's sequence classifier, the
same way and on the same inputs; `sharpness._electra`), ``distilbert:heads=H[,act=A]`` or
``distilbert:config=PATH`` (a DistilBERT sequence classifier, the same way; token ids ``(N, T)`` or ids and attention
mask ``(N, 2, T)`` in; `sharpness._distilbert`),
``hfvit:heads=H[,eps=E,act=A]`` or ``hfvit:config=PATH`` (HuggingFace's
``ViTForImageClassification``, the same way; images ``(N, C, H, W)`` in; `sharpness._hfvit`),
``deit:heads=H[,eps=E,act=A]`` or ``deit:config=PATH`` (HuggingFace's ``DeiTForImageClassification`` and
``DeiTForImageClassificationWithTeacher``, the same way and on the same inputs; `sharpness._hfvit`),
``timmvit:heads=H,pool=token|avg[,eps=E,act=A]`` (timm's ``VisionTransformer``, DeiT's included, the same way;
`sharpness._timmvit`), or
``path/to/file.py:factory``
/ ``package.module:factory`` (a function returning an ``nn.Module``).

Data SPEC: ``digits`` (scikit-learn's 8x8 digits, shipped with it), ``synthetic:n=500,dim=784,classes=10,seed=0``
(or ``shape=1x28x28`` instead of ``dim``), or a path to ``.npz`` (arrays ``X``, ``y``) or ``.pt`` (a dict of
tensors ``X``, ``y``, read with ``weights_only=True``).

Checkpoints: a state_dict in ``.pt``/``.pth`` (also wrapped in a dict under ``state_dict`` or
``model_state_dict``), read with ``torch.load(..., weights_only=True)``, or ``.safetensors``. Nothing in a
checkpoint is ever executed: a pickled module or any other object is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import pickle
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from sharpness._resnet import resnet


class SpecError(ValueError):
    """A model, data or checkpoint argument that cannot be used; the message says how to fix it."""


SAVE_HINT = "save a state_dict instead: torch.save(model.state_dict(), 'model.pt') or safetensors' save_file"
DATA_SAVE_HINT = "save a dictionary instead: torch.save({'X': X, 'y': y}, 'data.pt'), or np.savez('data.npz', X=X, y=y)"


def mlp(widths: list[int], bias: bool = True) -> nn.Sequential:
    """``nn.Sequential`` of Linear and ReLU for ``widths = [in, hidden..., out]``."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1], bias=bias))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def lenet() -> nn.Sequential:
    """C1 of Rangamani et al.: conv5x5(10) relu maxpool2 conv5x5(20) relu maxpool2 FC 320-120-84-10."""
    return nn.Sequential(
        nn.Conv2d(1, 10, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(10, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(320, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )  # fmt: skip


def _resnet(spec: str) -> nn.Module:
    """``resnet:DEPTH[,width=W,classes=C,channels=I]``, e.g. ``resnet:20`` or ``resnet:56,width=2``."""
    head, _, rest = spec.partition(",")
    depth_text = head[len("resnet:") :] if head.startswith("resnet:") else "20"
    options = _parse_options(rest, spec)
    unknown = set(options) - {"width", "classes", "channels"}
    if unknown:
        names = ", ".join(sorted(unknown))
        raise SpecError(f"model spec {spec!r}: unknown option(s) {names}; use width, classes, channels")
    try:
        depth = int(depth_text or 20)
        values = {k: int(v) for k, v in options.items()}
    except ValueError:
        raise SpecError(
            f"model spec {spec!r}: depth, width, classes and channels are integers, e.g. resnet:20,width=2"
        ) from None
    try:
        return resnet(depth, values.get("width", 1), values.get("classes", 10), values.get("channels", 3))
    except ValueError as err:
        raise SpecError(f"model spec {spec!r}: {err}") from None


def build_model(spec: str) -> nn.Module:
    """An ``nn.Module`` from a model SPEC (see the module docstring)."""
    if spec.startswith("mlp:"):
        try:
            widths = [int(w) for w in spec[4:].split("-")]
        except ValueError:
            widths = []
        if len(widths) < 2 or min(widths) < 1:
            raise SpecError(f"model spec {spec!r} is not of the form mlp:IN-HIDDEN-...-OUT, e.g. mlp:784-300-100-10")
        return mlp(widths)
    if spec == "lenet":
        return lenet()
    if spec == "resnet" or spec.startswith("resnet:"):
        return _resnet(spec)
    if spec == "vit" or spec.startswith("vit:"):
        from sharpness._vit import vit_from_spec  # imported here: _vit uses this module's SpecError

        return vit_from_spec(spec)
    if spec.partition(":")[0] in ("gpt2", "llama", "neox", "gptj", "opt", "phi", "bert", "roberta", "electra",
                                  "distilbert", "hfvit", "deit", "timmvit"):  # fmt: skip
        raise SpecError(f"model spec {spec!r} is built from its checkpoint's tensors; pass --checkpoint")
    if ":" in spec:
        where, factory_name = spec.rsplit(":", 1)
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise SpecError(f"model file {where} does not exist; give path/to/file.py:factory")
            module_spec = importlib.util.spec_from_file_location(f"_user_model_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(module_spec)
            _call_user_code(f"model file {where}", module_spec.loader.exec_module, module)
        else:
            try:
                module = importlib.import_module(where)
            except ImportError as exc:
                raise SpecError(f"cannot import module {where!r} for model spec {spec!r}: {exc}") from None
        factory = getattr(module, factory_name, None)
        if not callable(factory):
            raise SpecError(f"{where} has no function {factory_name!r}; the model spec is FILE.py:FUNCTION")
        model = _call_user_code(f"model factory {spec}", factory)
        if not isinstance(model, nn.Module):
            raise SpecError(f"{spec} returned {type(model).__name__}, not an nn.Module")
        return model
    raise SpecError(
        f"unknown model spec {spec!r}; use mlp:IN-...-OUT, lenet, resnet:20, vit, gpt2:heads=H, llama:heads=H, "
        "bert:heads=H, roberta:heads=H, electra:heads=H, distilbert:heads=H, hfvit:heads=H, deit:heads=H, "
        "timmvit:heads=H,pool=token, path/to/file.py:factory or package.module:factory"
    )


def _call_user_code(what: str, fn, *args):
    """``fn(*args)`` for code the user wrote (a model file, a factory): its exception, or its ``sys.exit``, is
    reported as one sentence naming it instead of a traceback or a silent exit."""
    try:
        return fn(*args)
    except SystemExit as exc:
        raise SpecError(f"{what} called sys.exit({exc.code!r}) instead of returning a model") from None
    except Exception as exc:  # any error in user code is bad input here
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SpecError(f"{what} raised {type(exc).__name__}{': ' + detail if detail else ''}") from None


def _require_regular_file(path: str, what: str) -> None:
    """Refuse a path that is missing, a folder, or not a regular file (a pipe would block the read for ever)."""
    if not os.path.exists(path):
        raise SpecError(f"{what} {path} does not exist")
    if os.path.isdir(path):
        raise SpecError(f"{what} {path} is a folder; give the file")
    if not os.path.isfile(path):
        raise SpecError(f"{what} {path} is not a regular file (a pipe, a device or a socket); give a file")


def _parse_options(text: str, spec: str) -> dict[str, str]:
    options = {}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise SpecError(f"spec {spec!r}: option {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        if key.strip() in options:
            raise SpecError(f"spec {spec!r}: option {key.strip()!r} is given twice")
        options[key.strip()] = value.strip()
    return options


def _synthetic(spec: str) -> tuple[Tensor, Tensor]:
    options = _parse_options(spec[len("synthetic:") :] if spec.startswith("synthetic:") else "", spec)
    known = {"n", "dim", "shape", "classes", "seed"}
    if set(options) - known:
        raise SpecError(f"data spec {spec!r}: unknown option(s) {', '.join(sorted(set(options) - known))}")
    try:
        n = int(options.get("n", 500))
        classes = int(options.get("classes", 10))
        seed = int(options.get("seed", 0))
        shape = tuple(int(s) for s in options.get("shape", options.get("dim", "784")).split("x"))
    except ValueError:
        raise SpecError(f"data spec {spec!r}: n, dim, classes and seed are integers, shape is like 1x28x28") from None
    if n < 1 or classes < 1 or min(shape) < 1:
        raise SpecError(f"data spec {spec!r}: n, classes and dimensions must be positive")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _from_file(path: str) -> tuple[Tensor, Tensor]:
    _require_regular_file(path, "data file")
    if path.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
        except (ValueError, OSError) as exc:
            raise SpecError(f"{path} is not a readable .npz file ({exc})") from None
    elif path.endswith((".pt", ".pth")):
        arrays = _torch_load(path, "data file", DATA_SAVE_HINT, expected="a dictionary with tensors X and y")
    else:
        raise SpecError(f"data file {path} must end in .npz or .pt")
    missing = [k for k in ("X", "y") if k not in arrays]
    if missing:
        raise SpecError(f"data file {path} has no {' or '.join(missing)}; it must hold arrays named X and y")
    return _numeric_tensor(arrays["X"], "X", path), _numeric_tensor(arrays["y"], "y", path)


def _numeric_tensor(value: object, name: str, path: str) -> Tensor:
    """``value`` as a dense tensor of real numbers, or a sentence saying what it is instead."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":  # text, dates, durations, objects, complex numbers
            raise SpecError(f"array {name} in {path} holds {value.dtype} values; X and y must be numbers")
        return torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, Tensor):
        raise SpecError(f"entry {name} in {path} is a {type(value).__name__}, not a tensor; save torch tensors")
    if value.layout != torch.strided:
        raise SpecError(f"tensor {name} in {path} is {value.layout} (sparse); save it dense with .to_dense()")
    if value.is_complex():
        raise SpecError(f"tensor {name} in {path} holds complex numbers; X and y must be real")
    return value


def load_data(spec: str) -> tuple[Tensor, Tensor]:
    """``(X, y)`` tensors from a data SPEC, checked: same length, non-empty, finite."""
    if spec == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        X, y = torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)
    elif spec == "synthetic" or spec.startswith("synthetic:"):
        X, y = _synthetic(spec)
    else:
        X, y = _from_file(spec)
    if X.shape[0] != y.shape[0]:
        raise SpecError(f"X has {X.shape[0]} samples but y has {y.shape[0]}; give one label per sample")
    if X.shape[0] == 0:
        raise SpecError(f"the data set {spec} is empty; give at least one sample")
    if X.is_floating_point() and not bool(torch.isfinite(X).all()):
        raise SpecError(f"the data set {spec} contains NaN or Inf in X; clean the data first")
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise SpecError(f"the data set {spec} contains NaN or Inf in y; clean the data first")
    return X, y


def _torch_load(path: str, what: str, hint: str = SAVE_HINT, expected: str = "a dictionary of tensors") -> dict:
    """The dictionary a ``.pt`` file holds (read without unpickling objects), or a sentence naming what it holds
    instead and how to save it (``hint``)."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing: one message is enough
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SpecError(
            f"{what} {path} holds a pickled Python object (such as a whole model), which is never unpickled "
            f"here; {hint}"
        ) from None
    except Exception as exc:  # any other failure to parse an untrusted file means it is not a checkpoint
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"{what} {path} is not a PyTorch file ({detail})") from None
    if not isinstance(obj, Mapping):
        raise SpecError(f"{what} {path} holds a {type(obj).__name__}, not {expected}; {hint}")
    return dict(obj)


def load_state_dict(path: str) -> dict[str, Tensor]:
    """A state_dict from ``.pt``/``.pth`` (weights_only) or ``.safetensors``, never unpickling objects."""
    _require_regular_file(path, "checkpoint")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError) as exc:
            raise SpecError(f"checkpoint {path} is not a readable safetensors file ({exc})") from None
    state = _torch_load(path, what="checkpoint")
    for key in ("state_dict", "model_state_dict"):
        if isinstance(state.get(key), Mapping):
            state = dict(state[key])
            break
    bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if bad:
        raise SpecError(
            f"checkpoint {path} is not a state_dict: entry {bad[0]!r} is a {type(state[bad[0]]).__name__}, "
            f"not a tensor; {SAVE_HINT}"
        )
    return state


def load_checkpoint(model: nn.Module, path: str) -> nn.Module:
    """Load ``path`` into ``model`` strictly. Returns ``model`` in eval mode.

    Raises:
        SpecError: keys or shapes that do not fit (summarized by `describe_mismatch`), integer, bool or
            complex values where the model has floating point (and the reverse), or non-finite tensors.
    """
    state = load_state_dict(path)
    expected = model.state_dict()
    mismatch = describe_mismatch(expected, state)
    if mismatch:
        raise SpecError(f"checkpoint {path} does not fit the model: {mismatch}")
    for k, v in state.items():
        if v.is_complex() or v.is_floating_point() != expected[k].is_floating_point():
            have, want = str(v.dtype).removeprefix("torch."), str(expected[k].dtype).removeprefix("torch.")
            raise SpecError(
                f"checkpoint {path}: tensor {k} holds {have} values where the model has {want}; casting them would "
                "change what they mean, so save the model's own state_dict"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise SpecError(f"checkpoint {path}: tensor {k} contains NaN or Inf; the checkpoint is unusable")
    model.load_state_dict(state)
    return model.eval()


def describe_mismatch(expected: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> str | None:
    """How a checkpoint's ``state`` differs from a model's ``expected`` state_dict in keys and shapes, in one
    short clause ending in the fix (``None`` when they fit): a prefix that one side adds to every key (such as
    ``module.`` from DataParallel), else counts and the first few missing keys, unexpected keys and shapes that
    differ. A list of every key would be hundreds of names on one line."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    added = _added_prefix(unexpected, missing)
    if (
        added is not None
        and all(k.startswith(added) for k in state)
        and {k.removeprefix(added) for k in state} == set(expected)
    ):
        return (
            f"every one of its {len(state)} keys starts with {added!r}, which the model's keys lack (a prefix that "
            f"a wrapper such as DataParallel or torch.compile adds); save the inner module's state_dict, or strip the "
            f"prefix: {{k.removeprefix({added!r}): v for k, v in state.items()}}"
        )
    lacking = _added_prefix(missing, unexpected)
    if lacking is not None and {lacking + k for k in state} == set(expected):
        return (
            f"every one of the model's {len(expected)} keys starts with {lacking!r}, which the checkpoint's keys lack "
            f"(it was saved from the inner module {lacking[:-1]!r}); load it into that module, or add the prefix: "
            f"{{{lacking!r} + k: v for k, v in state.items()}}"
        )
    shapes = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    parts = []
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        parts.append(f"{len(missing)} of the model's {len(expected)} keys {verb} missing ({_first(missing)})")
    if unexpected:
        verb = "is" if len(unexpected) == 1 else "are"
        parts.append(f"{len(unexpected)} of the checkpoint's {len(state)} keys {verb} not in the model "
                     f"({_first(unexpected)})")  # fmt: skip
    if shapes:
        first = shapes[0]
        parts.append(
            f"{len(shapes)} tensor(s) differ in shape (first {first!r}: {tuple(state[first].shape)} in the checkpoint, "
            f"{tuple(expected[first].shape)} in the model)"
        )
    if not parts:
        return None
    if added is not None or lacking is not None:
        which = f"the checkpoint adds {added!r}" if added is not None else f"the model adds {lacking!r}"
        parts.append(f"some keys differ only by a prefix ({which})")
    return "; ".join(parts) + "; check the --model spec (depth, widths, classes) against the checkpoint's model"


def _first(names: list[str], limit: int = 3) -> str:
    """``'a', 'b', 'c', ...``: the first few of a list whose length is said beside it."""
    return ", ".join(map(repr, names[:limit])) + ", ..." * (len(names) > limit)


def _added_prefix(longer: list[str], shorter: list[str]) -> str | None:
    """The most common prefix (ending in ``.``) that turns a key of ``shorter`` into one of ``longer``, if it does
    so for at least half of ``shorter`` (a coincidence such as ``0.weight`` inside ``block.0.weight`` is not a
    prefix)."""
    targets = set(shorter)
    counts: dict[str, int] = {}
    for key in longer:
        for i, char in enumerate(key):
            if char == "." and key[i + 1 :] in targets:
                counts[key[: i + 1]] = counts.get(key[: i + 1], 0) + 1
    best = max(counts, key=counts.get, default=None)
    return best if best is not None and 2 * counts[best] >= len(shorter) else None


def check_labels(model: nn.Module, X: Tensor, y: Tensor) -> None:
    """Refuse class labels outside the model's output range (for integer targets)."""
    if y.is_floating_point():
        return
    first = next(model.parameters())
    with torch.no_grad():  # integer inputs (token ids) stay integers
        out = model(X[:1].to(first.device, first.dtype if X.is_floating_point() else None))
    n_out = out.shape[1] if out.dim() > 1 else out.shape[-1]  # nn.CrossEntropyLoss's class axis: 1 (per token too)
    labels = y.to(torch.int64) if y.dtype in (torch.uint16, torch.uint32) else y  # no min/max for those in torch
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= n_out:
        raise SpecError(
            f"labels range over [{lo}, {hi}] but the model has {n_out} outputs; labels must be in [0, {n_out - 1}]"
        )


# the integer dtypes an embedding table is read at (torch.nn.functional.embedding refuses the others)
TOKEN_DTYPES = (torch.int64, torch.int32)


def check_token_ids(input_ids: Tensor, vocab: int, positions: int | None, model: str) -> None:
    """Raises ``ValueError`` (one sentence) unless ``input_ids`` are ``(N, T)`` integer ids (int64 or int32, the
    dtypes an embedding reads), ``T >= 1`` (at most ``positions`` where the model has a position table), below the
    vocabulary size ``vocab``. ``model`` names the model in the message."""
    if input_ids.dim() != 2 or input_ids.dtype not in TOKEN_DTYPES:
        raise ValueError(f"{model} takes int64 (or int32) token ids of shape (N, T), not {tuple(input_ids.shape)} "
                         f"{str(input_ids.dtype).removeprefix('torch.')} values")  # fmt: skip
    if input_ids.shape[1] == 0:
        raise ValueError("the sequences hold no tokens; give at least one token per sequence")
    if positions is not None and input_ids.shape[1] > positions:
        raise ValueError(f"sequences of {input_ids.shape[1]} tokens are longer than its {positions} positions")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"token ids run from {int(input_ids.min())} to {int(input_ids.max())}, outside its "
                         f"vocabulary 0..{vocab - 1}")  # fmt: skip


def positive_integer(value: object) -> bool:
    """Whether ``value`` is an ``int`` (not a bool) of at least 1: a head count read from a config."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def checkpoint_spec(spec: str, family: str) -> tuple[dict[str, str], dict | None]:
    """The options of a ``family:...`` model SPEC built from its checkpoint, and the ``config.json`` its
    ``config=PATH`` names (`read_config`; then the only option), else ``None``.

    Raises:
        SpecError: a malformed or repeated option, ``config`` beside other options, or an unreadable config.
    """
    options = _parse_options(spec[len(family) + 1 :] if spec.startswith(f"{family}:") else "", spec)
    if "config" not in options:
        return options, None
    if set(options) != {"config"}:
        raise SpecError(f"model spec {spec!r}: with config=, the config.json gives every other option")
    return options, read_config(options["config"])


def positive_number(value: object) -> bool:
    """Whether ``value`` is a real number (not a bool), positive and finite: what a size-free model option must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)


def output_head(tensors: dict[str, Tensor], table: Tensor, tied: bool | None) -> tuple[bool, Tensor | None]:
    """``(tied, head)`` of a decoder's checkpoint, ``lm_head.weight`` popped from ``tensors`` (``None`` where absent):
    ``tied`` (the config's ``tie_word_embeddings``) ``None`` reads it off the tensors, tied where the head is absent or
    equal to the token ``table``.

    Raises:
        SpecError: ``tied`` true with a head other than the table, or false without a head.
    """
    head = tensors.pop("lm_head.weight", None)
    same = head is None or (head.shape == table.shape and torch.equal(head, table))
    if tied is None:
        return same, head
    if tied and not same:
        raise SpecError("tie_word_embeddings is true but lm_head.weight differs from the token table")
    if not tied and head is None:
        raise SpecError("tie_word_embeddings is false but the state dict has no lm_head.weight")
    return tied, head


def load_decoder(build: Callable[[], nn.Module], tensors: dict[str, Tensor], head: Tensor | None, tied: bool,
                 what: str, like: str) -> nn.Module:  # fmt: skip
    """The decoder twin ``build()`` makes (its ``ValueError`` raised as a `SpecError`), with ``tensors`` loaded
    (`load_fitting`): the output head `output_head` popped is put back where it is untied, and filled by the token
    table ``like`` where tied."""
    try:
        model = build()
    except ValueError as failure:
        raise SpecError(str(failure)) from None
    if not tied:
        tensors["lm_head.weight"] = head
    return load_fitting(model, tensors, what, {"lm_head.weight"} if tied else set(), like)


def load_fitting(model: nn.Module, tensors: Mapping[str, Tensor], what: str, tied: set[str], like: str) -> nn.Module:
    """``model`` (eval mode, in the dtype of ``tensors[like]``) with ``tensors`` loaded, after checking that they are
    its keys exactly (but the ``tied`` keys, which another tensor fills) and of its shapes.

    Raises:
        SpecError: a key missing or unknown, or a shape that differs, named in the message.
    """
    own = {k: v for k, v in model.state_dict().items() if k not in tied}
    missing, unknown = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
    if missing or unknown:
        raise SpecError(f"the state dict does not fit {what}: missing {missing[:3]}, unknown {unknown[:3]}")
    wrong = [k for k in own if tuple(own[k].shape) != tuple(tensors[k].shape)]
    if wrong:
        raise SpecError(f"{wrong[0]} has shape {tuple(tensors[wrong[0]].shape)}, {what} needs "
                        f"{tuple(own[wrong[0]].shape)}")  # fmt: skip
    model = model.to(tensors[like].dtype)
    model.load_state_dict(tensors, strict=False)  # the tied keys are their tables'
    return model.eval()


def read_config(path: str) -> dict:
    """A HuggingFace ``config.json`` as a dict (JSON only: nothing in it runs).

    Raises:
        SpecError: the file is missing, unreadable, or not a JSON object.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as failure:
        raise SpecError(f"cannot read the config {path}: {failure.strerror or failure}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as failure:
        raise SpecError(f"the config {path} is not JSON: {failure}") from None
    if not isinstance(config, dict):
        raise SpecError(f"the config {path} is not a JSON object")
    return config


def check_config_sizes(config: Mapping[str, object], held: Mapping[str, object], note: str = "") -> None:
    """Raises `SpecError` where ``config`` gives a size or flag (``hidden_size``, ``attention_bias``, ...) other than
    the one the checkpoint's tensors hold (``held``; ``note`` adds what the reading assumed): the config describes
    another checkpoint. A field the config leaves out is not checked."""
    for name, value in held.items():
        given = config.get(name)
        if given is not None and given != value:
            raise SpecError(f"the config's {name} is {given!r} but the checkpoint's tensors hold {value!r}{note}; the "
                            "config does not describe this checkpoint")  # fmt: skip


def decoder_from_config_spec(spec: str, state: Mapping[str, Tensor], family: str, from_config: Callable,
                             held: str) -> nn.Module:  # fmt: skip
    """The model of a ``family:config=PATH`` SPEC (the checkpoint's ``config.json``, read by ``from_config(config,
    state, classes_last=False)``) from its checkpoint's ``state``: logits ``(N, V, T)`` for ``nn.CrossEntropyLoss``
    against next-token targets. ``held``: what the config holds that no tensor shows (named when it is missing).

    Raises:
        SpecError: another option, an unreadable config, or a state dict that does not fit.
    """
    options, config = checkpoint_spec(spec, family)
    if config is None:
        raise SpecError(f"model spec {spec!r}: give the checkpoint's config.json, {family}:config=PATH ({held} are "
                        "there, in no tensor)")  # fmt: skip
    try:
        return from_config(config, state, classes_last=False)
    except ValueError as failure:
        raise SpecError(f"model spec {spec!r}: {failure}") from None
