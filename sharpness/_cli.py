"""``python -m sharpness``: compute, verify, density and study from the command line.

Bad input gets one sentence on stderr naming the problem and the fix, exit code 2, no traceback,
and no output file (outputs are written atomically, and only after the work succeeded). Under ``torchrun``
the processes share the data (`sharpness._launch`); process 0 prints and writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from manifolds import UnsupportedModelError
from sharpness._launch import (
    DEFAULT_TIMEOUT_S,
    confirm_inputs,
    join_processes,
    launch_rank,
    launched_processes,
    leave_processes,
    process_device,
    quiet_process,
)
from sharpness._progress import progress_phase
from sharpness._results import EigenResult, figure_bytes, jsonable, write_atomic, write_text_atomic
from sharpness._specs import SpecError, build_model, check_labels, load_checkpoint, load_data, load_state_dict
from sharpness._stdio import READER_GONE_STATUS, guarded_streams, require_text
from sharpness.measures._adaptive import KINDS as ADAPTIVE_KINDS
from sharpness.measures._adaptive import adaptive_sharpness
from sharpness.measures._claims import (
    describe_group,
    detail_lines,
    first_line,
    lower_first,
    skip_entry,
    skip_notes,
)
from sharpness.measures._epsilon import epsilon_sharpness, second_order
from sharpness.measures._geodesic import geodesic_sharpness
from sharpness.measures._registry import MEASURES, get_measure
from sharpness.measures._verify import Rescalings, verify_invariance
from sharpness.products._data import DataError
from sharpness.products._distributed import Communicator, DistributedError
from sharpness.products._objective import Objective
from sharpness.solvers._density import hessian_spectral_density
from sharpness.solvers._solve import SOLVERS, STARTS, Solver

# Errors that mean "bad input": one sentence on stderr, exit code 2, no traceback.
# FloatingPointError: a radius so large that the loss overflows, said in a sentence that names the fix.
USER_ERRORS = (SpecError, DataError, UnsupportedModelError, ValueError, OSError, FloatingPointError)
LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# What `compute` measures without --metric: the three metric measures (the others are coordinate-dependent and
# slower; `--metric all` adds them).
DEFAULT_COMPUTE = ("euclidean", "layer", "node")


def add_model_arguments(parser: argparse.ArgumentParser, *, default_dtype: str = "float64") -> None:
    """``--model``, ``--checkpoint``, ``--data``, ``--loss``, ``--dtype``, ``--device``, ``--timeout``: shared
    with ``python -m landscape``.

    ``default_dtype`` is the ``--dtype`` default (and what its help says): float64 for curvature, while
    ``python -m landscape`` passes float32 (a grid evaluates thousands of points)."""
    if default_dtype not in DTYPES:
        raise ValueError(f"default_dtype must be one of {', '.join(sorted(DTYPES))}, got {default_dtype!r}")
    parser.add_argument(
        "--model",
        required=True,
        help="mlp:IN-...-OUT, lenet, resnet:DEPTH[,width=W] (CIFAR ResNet-20/32/56 whose 16, 32 and 64 channels per "
        "stage W multiplies; default W=1), vit[:dim=D,heads=H,depth=L,attn=mha|hand] (a small vision transformer for "
        "8x8 digits), gpt2:config=PATH, llama:config=PATH, neox:config=PATH, gptj:config=PATH, opt:config=PATH or "
        "phi:config=PATH (GPT-2, a LLaMA-family decoder, GPT-NeoX/Pythia, GPT-J, OPT or Phi-1/1.5/2, from a "
        "HuggingFace checkpoint's "
        "config.json and in the sizes of its tensors; "
        "without the "
        "config: gpt2:heads=H[,eps=E], "
        "llama:heads=H[,eps=E,theta=T]; data: integer token ids X (N, T) and next tokens y (N, T), --loss ce), "
        "bert:config=PATH or bert:heads=H[,eps=E,act=A] (a BERT sequence classifier from a HuggingFace checkpoint; "
        "data: integer X (N, T) token ids, or (N, 3, T) ids, token types and attention mask ((N, 2, T) without the "
        "mask), and labels y (N,)), "
        "roberta:config=PATH or roberta:heads=H[,eps=E,act=A,pad=ID] (a RoBERTa, XLM-RoBERTa or CamemBERT sequence "
        "classifier from a HuggingFace checkpoint; data as bert's), "
        "electra:config=PATH or electra:heads=H[,eps=E,act=A] (an ELECTRA discriminator's sequence classifier from a "
        "HuggingFace checkpoint; data as bert's), "
        "distilbert:config=PATH or distilbert:heads=H[,act=A] (a DistilBERT sequence classifier from a HuggingFace "
        "checkpoint; data: integer X (N, T) token ids, or (N, 2, T) ids and attention mask, and labels y (N,)), "
        "hfvit:config=PATH or hfvit:heads=H[,eps=E,act=A] (a HuggingFace ViTForImageClassification checkpoint; data: "
        "images X (N, C, H, W)), "
        "deit:config=PATH or deit:heads=H[,eps=E,act=A] (a HuggingFace DeiTForImageClassification(WithTeacher) "
        "checkpoint; data as hfvit's), "
        "timmvit:heads=H,pool=token|avg[,eps=E,act=A] (a timm VisionTransformer checkpoint, DeiT's included, read "
        "without timm; data: images X (N, C, H, W)), "
        "path/file.py:factory or pkg.mod:factory",
    )
    parser.add_argument("--checkpoint", required=True, help="state_dict as .pt/.pth (weights only) or .safetensors")
    parser.add_argument(
        "--data", required=True, help="digits, synthetic:n=500,dim=784,classes=10,seed=0, or a .npz/.pt with X and y"
    )
    parser.add_argument("--loss", choices=sorted(LOSSES), default="ce", help="loss (default: ce)")
    add_evaluation_arguments(parser, default_dtype=default_dtype)


def add_evaluation_arguments(
    parser: argparse.ArgumentParser, *, default_dtype: str = "float64", timeout_help: str | None = None
) -> None:
    """``--dtype``, ``--device``, ``--timeout``: how and where a model is evaluated, for every subcommand that
    evaluates one (``timeout_help`` replaces the default wording of ``--timeout``'s help)."""
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=default_dtype,
        help=f"evaluation dtype (default: {default_dtype}). float64 costs more on convolutional networks (CPU time, "
        "one thread, float64 over float32: LeNet 1.7x a forward pass and 1.8x the node measure, ResNet-8 5.7x and "
        "4.2x); float32 resolves eigenvalues to about sqrt(n_params) 1e-7, so verify checks float32 to that floor, "
        "not to --rtol",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu",
        help="where to evaluate: cpu (default), cuda, cuda:1, mps ...; the model moves there, the data are moved "
        "chunk by chunk; under torchrun, cuda is each process's own GPU (cuda:LOCAL_RANK)",
    )  # fmt: skip
    timeout_help = timeout_help or (
        "how long a process waits for the others at each exchange before the run stops with an error"
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help=f"under torchrun: {timeout_help} (default: {DEFAULT_TIMEOUT_S:.0f})",
    )  # fmt: skip


def add_solver_arguments(parser: argparse.ArgumentParser) -> None:
    """``--k``, ``--tol``, ``--method``, ``--memory-mib``: the eigen-solver's options (compute and study)."""
    parser.add_argument("--k", type=int, default=1, help="eigenvalues per measure (default: 1)")
    parser.add_argument("--tol", type=float, default=1e-6, help="relative residual tolerance (default: 1e-6)")
    parser.add_argument(
        "--method", choices=SOLVERS, default="lanczos",
        help="eigen-solver: lanczos (default; keeps its Krylov basis, one parameter vector per iteration), "
        "low-memory-lanczos (three parameter vectors, about twice the Hessian-vector products) or power",
    )  # fmt: skip
    parser.add_argument(
        "--memory-mib", type=float, default=None,
        help="memory budget for activations in MiB, per process: above it, Hessian-vector products stream the data "
        "in chunks instead of keeping their state for the whole data set (default: 2048 on the CPU, half the free "
        "memory of a GPU)",
    )  # fmt: skip


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bars and no phase lines."""
    parser.add_argument("--quiet", action="store_true", help="no progress (bars, or lines without a terminal)")


def parse_device(text: str) -> torch.device:
    """``--device`` as a `torch.device`, refused in one sentence when it does not exist on this machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise SpecError(f"--device {text!r} is not a device name; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SpecError(f"--device {text}: no CUDA device is available on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise SpecError(f"--device {text}: this machine has {count} CUDA device(s), numbered from 0")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise SpecError(f"--device {text}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise SpecError(f"--device {text}: only cpu, cuda and mps are supported")
    return process_device(device)


# More than any machine has (1 EiB): a larger --memory-mib is a typo, and its bytes would not fit an integer.
MAX_MEMORY_MIB = 2**40


def memory_budget(mib: float | None) -> int | None:
    """``--memory-mib`` as bytes (``None``: the objective's default for its device), refused in one sentence unless
    it is a positive finite number of at most 1 EiB."""
    if mib is None:
        return None
    if not (isinstance(mib, (int, float)) and math.isfinite(mib) and 0 < mib <= MAX_MEMORY_MIB):
        raise SpecError(f"--memory-mib must be a positive number of MiB, at most {MAX_MEMORY_MIB} (1 EiB), got {mib:g}")
    return int(mib * 2**20)


def start_objective(args: argparse.Namespace, model: nn.Module, loss_fn: nn.Module, data, **options) -> Objective:
    """The objective of a command, after every check of its arguments: under ``torchrun`` the processes share
    the data (see `join`); ``options`` go to [`Objective`][sharpness.Objective]."""
    return Objective(model, loss_fn, data, distributed=join(args), **options)


def join(args: argparse.Namespace) -> Communicator:
    """Under ``torchrun``, the group of the processes (joined by `load_problem`), once every process has
    confirmed that its inputs are usable (`confirm_inputs`); else one process."""
    comm = _join_group(args)
    confirm_inputs()
    return comm


def _join_group(args: argparse.Namespace) -> Communicator:
    """Under ``torchrun``, join the other processes (each waiting at most ``--timeout`` seconds for the others at
    each exchange); else one process."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise SpecError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    return join_processes(parse_device(args.device), args.timeout)


def command_inputs(args: argparse.Namespace) -> tuple[str | None, ...]:
    """The files a command reads (checkpoints and a data file), which no output may replace."""
    return (args.checkpoint, args.data, getattr(args, "to", None))


def load_problem(args: argparse.Namespace) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Model (checkpoint loaded, eval mode, in ``--dtype``), loss and data from the shared arguments. Under
    ``torchrun`` the processes join their group first, so that one whose files fail here makes every process
    stop (`confirm_inputs`, in `join` and [`run_command`][sharpness.cli.run_command])."""
    _join_group(args)
    model = load_model(args.model, args.checkpoint, args.dtype)
    data = load_data(args.data)
    model = model.to(parse_device(args.device))
    check_model_dtype(model, args.dtype)
    return model, LOSSES[args.loss](), prepare_data(model, data, args.data, args.dtype, args.loss)


def _checkpoint_family(name: str) -> tuple[Callable[[str], bool], Callable] | None:
    """For a model family built in the sizes of its checkpoint's tensors (the HuggingFace ones): the keys older
    checkpoints saved that the model builds itself (dropped), and ``build(spec, state)``; else ``None``."""
    from sharpness._bert import Bert, encoder_from_spec, is_index_buffer
    from sharpness._distilbert import DistilBert, is_distilbert_buffer
    from sharpness._electra import Electra
    from sharpness._gpt2 import gpt2_from_spec, is_mask_buffer
    from sharpness._gptj import gptj_from_spec, is_gptj_buffer
    from sharpness._hfvit import HFDeiT, HFViT
    from sharpness._llama import is_rotary_buffer, llama_from_spec
    from sharpness._neox import is_neox_buffer, neox_from_spec
    from sharpness._opt import opt_from_spec
    from sharpness._phi import phi_from_spec
    from sharpness._roberta import Roberta
    from sharpness._timmvit import timmvit_from_spec

    families = {
        "gpt2": (is_mask_buffer, gpt2_from_spec),
        "llama": (is_rotary_buffer, llama_from_spec),
        "neox": (is_neox_buffer, neox_from_spec),
        "gptj": (is_gptj_buffer, gptj_from_spec),
        "opt": (lambda key: False, opt_from_spec),
        "phi": (lambda key: False, phi_from_spec),
        "bert": (is_index_buffer, functools.partial(encoder_from_spec, family="bert", model=Bert)),
        "roberta": (is_index_buffer, functools.partial(encoder_from_spec, family="roberta", model=Roberta)),
        "electra": (is_index_buffer, functools.partial(encoder_from_spec, family="electra", model=Electra)),
        "distilbert": (is_distilbert_buffer,
                       functools.partial(encoder_from_spec, family="distilbert", model=DistilBert)),
        "hfvit": (lambda key: False, functools.partial(encoder_from_spec, family="hfvit", model=HFViT)),
        "deit": (lambda key: False, functools.partial(encoder_from_spec, family="deit", model=HFDeiT)),
        "timmvit": (lambda key: False, timmvit_from_spec),
    }
    return families.get(name)


def load_model(spec: str, checkpoint: str, dtype: str) -> nn.Module:
    """The model of a model SPEC with ``checkpoint`` loaded (eval mode), in ``dtype`` (a key of `DTYPES`).

    Raises:
        SpecError: the spec does not build or the checkpoint does not fit it.
    """
    family = _checkpoint_family(spec.partition(":")[0])
    if family is not None:  # its sizes are the checkpoint's
        dropped, build = family
        state = {k: v for k, v in load_state_dict(checkpoint).items() if not dropped(k)}
        bad = [k for k, v in state.items() if not v.is_floating_point() or not bool(torch.isfinite(v).all())]
        if bad:
            raise SpecError(f"checkpoint {checkpoint}: tensor {bad[0]} is not finite floating point; the checkpoint is "
                            "unusable")  # fmt: skip
        return build(spec, state).to(DTYPES[dtype])
    # Built in the dtype before loading: a float64 checkpoint is not rounded through a float32 model on the way.
    model = build_model(spec).to(DTYPES[dtype])
    load_checkpoint(model, checkpoint)
    return model


def check_model_dtype(model: nn.Module, dtype: str) -> None:
    """Refuse a model whose tensors overflow in ``dtype``: finite in the checkpoint's own dtype (checked on
    loading) is not enough, a cast to float32 can overflow."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecError(f"checkpoint tensor {name} overflows in {dtype}; use --dtype float64")


def prepare_data(
    model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], spec: str, dtype: str, loss: str,
    pairing: str = "--model and --data",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``data`` (as `sharpness._specs.load_data` returns it for the data SPEC ``spec``) in ``dtype``,
    checked against ``model`` and the loss named ``loss``: finite, targets of the loss's kind, labels in the
    model's output range, inputs the model takes (``pairing`` names what to check in that sentence).

    Raises:
        SpecError: one sentence naming the problem.
    """
    X, y = data
    if getattr(model, "takes_token_ids", False):  # token ids stay integers (sharpness.GPT2, .Llama, .Bert, ...)
        if X.is_floating_point() or X.dtype == torch.bool:
            raise SpecError(f"the model takes token ids, but X of {spec} holds {str(X.dtype).removeprefix('torch.')} "
                            "values; give integer ids (N, T)")  # fmt: skip
        X = X.long()
        try:
            model.check_tokens(X)
        except ValueError as failure:
            raise SpecError(f"the data {spec} do not fit the model: {failure}") from None
    else:
        X = X.to(DTYPES[dtype])
        if hasattr(model, "check_inputs"):  # a model that says which inputs it takes (sharpness.HFViT)
            try:
                model.check_inputs(X)
            except ValueError as failure:
                raise SpecError(f"the data {spec} do not fit the model: {failure}") from None
    if not bool(torch.isfinite(X).all()):
        raise SpecError(f"the data {spec} overflow in {dtype}; use --dtype float64")
    if loss == "mse":
        if not y.is_floating_point():
            raise SpecError("--loss mse needs real-valued targets y; use --loss ce for class labels")
        y = y.to(DTYPES[dtype])
    elif y.is_floating_point():
        raise SpecError("--loss ce needs integer class labels y; use --loss mse for real-valued targets")
    try:
        check_labels(model, X, y)
    except RuntimeError as exc:
        raise SpecError(
            f"the model cannot take inputs of shape {tuple(X.shape[1:])} ({str(exc).splitlines()[0]}); "
            f"check that {pairing} match"
        ) from None
    return X, y


def check_outputs(
    outputs: list[tuple[str, str | os.PathLike | None]], inputs: tuple[str | None, ...] = (), new_folder: bool = False
) -> None:
    """Refuse, before any work, output paths that cannot be written or would destroy something: a folder that
    does not exist or cannot be written, a name longer than the file system allows, an existing path that is
    not a regular file (a folder, a device, a pipe), a path that is (or links to) one of the ``inputs``, and
    two outputs that are the same file. ``outputs``: ``(what, path or None)`` pairs, ``what`` naming the output
    in messages (``"--json"``);
    ``new_folder``: the outputs' folder may not exist yet (it is created later; its creation is checked apart)."""
    given = [(flag, os.fspath(path)) for flag, path in outputs if path is not None]
    sources = {os.path.realpath(path) for path in inputs if path is not None and os.path.exists(path)}
    seen: dict[str, str] = {}
    for flag, path in given:
        target = os.path.realpath(path)
        folder, name = os.path.split(target)
        existing = folder
        while new_folder and not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not new_folder and (not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK)):
            raise SpecError(f"cannot write {flag} {path}: the folder {folder} does not exist or is not writable")
        if len(os.fsencode(name)) > os.pathconf(existing, "PC_NAME_MAX"):
            raise SpecError(f"cannot write {flag} {path}: the file name is longer than the file system allows")
        if os.path.lexists(target) and not os.path.isfile(target):
            raise SpecError(f"cannot write {flag} {path}: it exists and is not a regular file")
        if target in sources:
            raise SpecError(f"{flag} {path} is one of the inputs; writing it would destroy that input")
        if target in seen:
            raise SpecError(f"{seen[target]} and {flag} name the same file {path}; give them different names")
        seen[target] = flag


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit code 2), like every other refusal."""

    def print_help(self, file=None):
        if not quiet_process():  # once, under torchrun
            super().print_help(file)

    def error(self, message: str):
        if quiet_process():  # the same command line fails alike in process 0, which says so (see run_command)
            self.exit(0)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def run_command(command, args, user_errors: tuple[type[BaseException], ...] = USER_ERRORS) -> int:
    """``command(args)``'s exit code, with bad input as one sentence on stderr and exit code 2, and Ctrl-C as
    ``interrupted`` and exit code 130 (no traceback; outputs are only written atomically at the end). Parse the
    command line inside ``command``, so that Ctrl-C there is caught too. ``args``, the command line (``None``:
    ``sys.argv[1:]``), must be UTF-8 text; a reader of stdout that goes away does not stop the command, whose exit
    code is then 141 unless it failed (see `sharpness._stdio`).

    Under ``torchrun`` process 0 says what went wrong. The others stay silent on what every process found
    alike (bad input, checked the same way on the same files, and failures that
    [`check_together`][sharpness.Communicator.check_together] shared, such as a process's missing
    data file found after joining: `confirm_inputs`), and name themselves on a
    failure of their own; a process left waiting for another that failed ends with
    [`DistributedError`][sharpness.DistributedError], exit code 1."""
    with guarded_streams() as streams:
        code = _run(command, args, user_errors)
    return READER_GONE_STATUS if code == 0 and any(s.reader_gone for s in streams) else code


def _run(command, args, user_errors: tuple[type[BaseException], ...]) -> int:
    """[`run_command`][sharpness.cli.run_command] without the guard of the standard streams."""
    try:
        if args is None or isinstance(args, (list, tuple)):
            require_text(sys.argv[1:] if args is None else args)
        try:
            return command(args)
        except user_errors as exc:
            confirm_inputs(exc)  # joined but not yet confirmed: every process learns of it and stops (raises)
            raise
    except user_errors as exc:
        shared = not dist.is_initialized() or getattr(exc, "shared_by_all_processes", False)
        if quiet_process() and shared:
            # Process 0 found the same, says so and sets the run's exit status; a failing exit here could make
            # torchrun stop process 0 before it has said why.
            return 0
        _report(exc)
        return 2
    except DistributedError as exc:
        if not quiet_process():  # the process that failed said why
            _report(exc)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        leave_processes()


def _report(exc: BaseException) -> None:
    """``exc`` in one line on stderr (under ``torchrun``, naming the process unless it is process 0)."""
    message = lower_first(first_line(exc))  # one style: "error: cannot ...", whatever the library's sentence case
    who = f"process {launch_rank()} of {launched_processes()}: " if quiet_process() else ""
    print(f"error: {who}{message}", file=sys.stderr)


def _measures(names: list[str] | None) -> list[str] | None:
    """The measures named by repeated ``--metric`` options (``None``: the command's default; ``all``: every
    registered measure)."""
    if not names:
        return None
    if "all" in names:
        return list(MEASURES)
    unknown = [n for n in names if n not in MEASURES]
    if unknown:
        raise SpecError(f"unknown metric {unknown[0]!r}; choose from {', '.join([*MEASURES, 'all'])}")
    return list(dict.fromkeys(names))


def _versions() -> dict:
    import geoopt
    import numpy
    import scipy

    return {
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "geoopt": geoopt.__version__,
        "python": sys.version.split()[0],
    }


def measure_entry(
    objective: Objective, name: str, k: int, solver: Solver, progress: bool | None, skip_unsupported: bool
) -> tuple[dict, EigenResult | None]:
    """One registered measure at ``objective``'s point as ``compute`` reports it: ``(entry, result)``, the entry
    being the result's JSON form plus the measure's description. A measure that does not apply is, with
    ``skip_unsupported``, recorded with its reason (`sharpness.measures._claims.skip_entry`) and no result.

    Raises:
        UnsupportedModelError: the measure does not apply and ``skip_unsupported`` is false.
    """
    measure = get_measure(name)
    try:
        with progress_phase(f"measuring {name}", progress):  # names the measure in the progress lines
            res = measure.sharpness(objective, k, solver, progress)
    except UnsupportedModelError as err:
        if not skip_unsupported:
            raise
        return {**skip_entry(err), "measure": measure.to_dict()}, None
    return {**res.to_dict(), "measure": measure.to_dict()}, res


def _geodesic_metric(choice: str, objective: Objective) -> str:
    """``--geodesic-metric``: ``auto`` is the symmetry metric where the network's group has attention or
    normalization factors (the node metric would leave them in the ball) and the node metric otherwise."""
    if choice != "auto":
        return choice
    symmetry = objective.structure.symmetry  # None where the group is unknown
    return "symmetry" if symmetry is not None and symmetry.restricted(objective.params).factors else "node"


def _compute(args: argparse.Namespace) -> int:
    names = _measures(args.metric) or list(DEFAULT_COMPUTE)
    if args.k < 1:
        raise SpecError(f"--k must be at least 1, got {args.k}")
    if args.epsilon is not None and not (math.isfinite(args.epsilon) and args.epsilon > 0):
        raise SpecError(f"--epsilon must be positive and finite, got {args.epsilon}")
    if args.adaptive is not None and not (math.isfinite(args.adaptive) and args.adaptive > 0):
        raise SpecError(f"--adaptive must be a positive and finite relative radius, got {args.adaptive}")
    if args.geodesic is not None and not (math.isfinite(args.geodesic) and args.geodesic > 0):
        raise SpecError(f"--geodesic must be a positive and finite radius, got {args.geodesic}")
    budget = memory_budget(args.memory_mib)
    if not (math.isfinite(args.tol) and args.tol > 0):
        raise SpecError(f"--tol must be a positive number, got {args.tol}")
    solver = Solver(method=args.method, tol=args.tol, start=args.start)
    check_outputs([("--json", args.json)], command_inputs(args))
    model, loss_fn, data = load_problem(args)
    progress = False if args.quiet else None
    # One objective for every measure and epsilon ball: the data are prepared and the product state kept once.
    objective = start_objective(args, model, loss_fn, data, memory_budget=budget)
    measures, eigen_results = {}, {}
    # Measures asked for by name must apply; by default or with `all`, one that does not is recorded with its reason.
    skip_unsupported = not args.metric or "all" in args.metric
    for name in names:
        measure = get_measure(name)
        entry, res = measure_entry(objective, name, args.k, solver, progress, skip_unsupported)
        if res is None:
            measures[name] = entry
            continue
        eigen_results[name] = res
        if args.epsilon is not None:
            if measure.has_ball:
                eps = epsilon_sharpness(None, None, None, args.epsilon, measure, eigen=res, objective=objective,
                                        progress=progress)  # fmt: skip
                entry["epsilon"] = eps.to_dict(with_eigen=False)
            else:
                entry["epsilon"] = {"epsilon": args.epsilon, "second_order": second_order(res.value, args.epsilon,
                                    res.info["loss"]), "measured": None}  # fmt: skip
        measures[name] = entry
    adaptive = None
    if args.adaptive is not None:
        eigen = eigen_results.get("node")
        adaptive = {
            kind: adaptive_sharpness(None, None, None, args.adaptive, kind, eigen=eigen, objective=objective,
                                     progress=progress).to_dict()  # fmt: skip
            for kind in ADAPTIVE_KINDS
        }
    groups = [m["group"] for m in measures.values() if "group" in m]
    geodesic = None
    if args.geodesic is not None:  # both orders, so the Christoffel term's effect is visible
        metric = _geodesic_metric(args.geodesic_metric, objective)
        geodesic = {
            f"order{order}": geodesic_sharpness(None, None, None, args.geodesic, metric=metric, order=order,
                                                eigen=eigen_results.get(metric), objective=objective,
                                                progress=progress).to_dict()  # fmt: skip
            for order in (2, 1)
        }
    report = {
        **objective.facts(),
        "group": groups[0] if groups else None,
        "measures": measures,
        "adaptive": adaptive,
        "geodesic": geodesic,
        "solver": solver.to_dict(),
        "k": args.k,
        "model": args.model,
        "checkpoint": args.checkpoint,
        "data": args.data,
        "dtype": args.dtype,
        "memory_mib": objective.memory_budget / 2**20,
        "epsilon": args.epsilon,
        "versions": _versions(),
    }
    if objective.comm.is_main:
        print(_table(report, args.json))
        if args.json:
            write_text_atomic(args.json, json.dumps(jsonable(report), indent=2))
    return 0


def _table(report: dict, json_path: str | None = None) -> str:
    """``compute``'s report as text: a header, one row per measure, and the notes under the table (``json_path``:
    where the report was written, which the notes on skipped measures point to)."""
    shared = f"   processes {report['processes']}" if report.get("processes") else ""
    lines = [f"loss {report['loss']:.6g}   parameters {report['n_params']}   data {report['data']}{shared}"]
    if report.get("group"):
        lines.append(describe_group(report["group"]))
    lines.append("")
    eps = report["epsilon"] is not None
    head = f"{'measure':<10} {'top eigenvalue':>15} {'HVPs':>6} {'converged':>9} {'seconds':>8} {'params':>9}"
    if eps:
        head += f" {'eps (2nd order)':>16} {'eps (measured)':>15}"
    head += "   invariant under"
    lines += [head, "-" * len(head)]
    skipped = {name: m for name, m in report["measures"].items() if "skipped" in m}
    where = f"measures.NAME.skipped in {json_path}" if json_path else "add --json FILE and read measures.NAME.skipped"
    tags, details = skip_notes(skipped, where)
    for name, m in report["measures"].items():
        if name in tags:  # a tag in the table, the reason below it
            lines.append(f"{name:<10} {tags[name]}")
            continue
        details += detail_lines(name, m)
        params = str(m["n_params"]) if not m["n_dropped"] else f"{m['n_measured']}/{m['n_params']}"
        row = (f"{name:<10} {m['value']:>15.6g} {m['n_hvp']:>6} {str(m['converged']):>9} {m['seconds']:>8.2f} "
               f"{params:>9}")  # fmt: skip
        if eps:
            measured = m["epsilon"]["measured"]
            shown = "-" if measured is None else format(measured, ".4g")
            row += f" {m['epsilon']['second_order']:>16.4g} {shown:>15}"
        lines.append(row + "   " + (", ".join(m["invariant_under"]) or "nothing"))
    if details:
        lines += ["", *details]
    if report.get("adaptive"):
        rho = report["adaptive"]["l2"]["rho"]
        lines += ["", f"adaptive sharpness, rho = {rho:g} (loss increase over the |w|-scaled ball; invariant):"]
        for kind, a in report["adaptive"].items():
            error = f" +- {a['standard_error']:.2g}" if a["standard_error"] is not None else ""
            lines.append(f"  {kind:<8} {a['value']:.6g}{error}")
    if report.get("geodesic"):
        second = report["geodesic"]["order2"]
        under = ", ".join(second["invariant_under"]) or "nothing here"
        lines += ["", f"geodesic sharpness, rho = {second['rho']:g} ({second['metric']} metric, horizontal geodesic "
                      f"ball; invariant under {under}):"]  # fmt: skip
        lines += [f"  order {g['order']}  {g['value']:.6g}" for g in report["geodesic"].values()]
    lines += ["", *(f"warning: {w}" for w in report["warnings"])] if report.get("warnings") else []
    return "\n".join(lines)


def _verify(args: argparse.Namespace) -> int:
    # `all` skips what does not apply, as no --metric does; measures named one by one must apply
    metrics = None if args.metric and "all" in args.metric else _measures(args.metric)
    if args.trials < 1:
        raise SpecError(f"--trials must be at least 1, got {args.trials}")
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise SpecError(f"--scale must be a positive number, got {args.scale}")
    if not (math.isfinite(args.rtol) and args.rtol > 0):
        raise SpecError(f"--rtol must be a positive number, got {args.rtol}")
    if args.geodesic is not None and not (math.isfinite(args.geodesic) and args.geodesic > 0):
        raise SpecError(f"--geodesic must be a positive and finite radius, got {args.geodesic}")
    check_outputs([("--json", args.json)], command_inputs(args))
    model, loss_fn, data = load_problem(args)
    kinds = {"both": ("node", "layer"), "all": None}.get(args.kind, (args.kind,))
    report = verify_invariance(
        model,
        loss_fn,
        data,
        metrics,
        rescalings=Rescalings(kinds=kinds, trials=args.trials, scale=args.scale),
        rtol=args.rtol,
        dtype=DTYPES[args.dtype],
        progress=False if args.quiet else None,
        distributed=join(args),
        balls=args.geodesic,
    )
    if not quiet_process():
        print(report.table())
        if args.json:
            report.save_json(args.json)
    return VERIFY_EXIT[report.outcome]


# verify's exit status: every claimed invariance held, one failed, or nothing could be checked (no measure that
# applies claims an invariance under a rescaling this network has, e.g. a GELU network whose group is trivial)
VERIFY_EXIT = {"passed": 0, "FAILED": 1, "nothing to verify": 3}

PLOT_FORMATS = (".png", ".pdf", ".svg")


def _density(args: argparse.Namespace) -> int:
    if args.probes < 1:
        raise SpecError(f"--probes must be at least 1, got {args.probes}")
    if args.steps < 1:
        raise SpecError(f"--steps must be at least 1, got {args.steps}")
    if args.sigma is not None and not (math.isfinite(args.sigma) and args.sigma > 0):
        raise SpecError(f"--sigma must be positive, got {args.sigma}")
    if args.plot is not None and os.path.splitext(args.plot)[1].lower() not in PLOT_FORMATS:
        raise SpecError(f"--plot must end in {', '.join(PLOT_FORMATS)}, got {args.plot}")
    check_outputs([("--json", args.json), ("--plot", args.plot)], command_inputs(args))
    model, loss_fn, data = load_problem(args)
    objective = start_objective(args, model, loss_fn, data)
    result = hessian_spectral_density(
        None, None, None, n_probes=args.probes, n_steps=args.steps, seed=args.seed, objective=objective,
        progress=False if args.quiet else None,
    )  # fmt: skip
    if not objective.comm.is_main:
        return 0
    mean, stderr = result.moment(1)
    nodes = torch.cat(result.nodes)
    steps = max(t.numel() for t in result.nodes)
    print(
        f"loss {result.info['loss']:.6g}   parameters {result.info['n_params']}   data {args.data}\n"
        f"{result.n_probes} probes x up to {steps} Lanczos steps, {result.n_matvec} HVPs, {result.seconds:.2f} s\n"
        f"eigenvalue range seen [{float(nodes.min()):.6g}, {float(nodes.max()):.6g}]   mean eigenvalue {mean:.6g}"
        + ("" if stderr is None else f" +- {stderr:.2g}") + " (trace / n)"
    )
    figure = None
    if args.plot:  # rendered before anything is written: a failure leaves no file behind
        title = (f"Hessian eigenvalue density: {args.model} ({os.path.basename(args.checkpoint)}), data {args.data}, "
                 f"loss {args.loss}")  # fmt: skip
        ax = result.plot(sigma=args.sigma, title=textwrap.fill(title, 64))
        fmt = os.path.splitext(args.plot)[1][1:].lower()
        about = "spectral density by stochastic Lanczos quadrature (as in Ghorbani, Krishnan and Xiao 2019)"
        figure = figure_bytes(ax.figure, fmt, 150, title, about, software="python -m sharpness density")
    if args.json:
        report = {**result.to_dict(), "model": args.model, "checkpoint": args.checkpoint, "data": args.data,
                  "dtype": args.dtype, "versions": _versions()}  # fmt: skip
        write_text_atomic(args.json, json.dumps(jsonable(report), indent=2))
    if figure is not None:
        write_atomic(args.plot, figure)
    return 0


def _study(args: argparse.Namespace) -> int:
    # imported here: the study package uses this module's loaders
    from sharpness.study._runner import run_study

    if args.builtin == (args.manifest is not None):
        raise SpecError("give a manifest, or --builtin for the built-in population (not both)")
    if args.quick and not args.builtin:
        raise SpecError("--quick applies to --builtin only")
    progress = False if args.quiet else None
    if args.builtin and (args.hyper or args.color_by):
        raise SpecError("--hyper and --color-by apply to a manifest; the built-in studies choose their own")
    studies = (_builtin_studies(args.out, args.quick, progress) if args.builtin
               else [(args.manifest, args.out, {"hyper_columns": args.hyper, "color_by": args.color_by})])  # fmt: skip
    for manifest, out, report_options in studies:
        result = run_study(
            manifest, out, args.metric, args.jobs, progress, k=args.k, tol=args.tol, method=args.method,
            dtype=args.dtype, device=args.device, memory_mib=args.memory_mib, timeout=args.timeout, **report_options,
        )  # fmt: skip
        if not quiet_process():
            print(_study_lines(result))
    return 0


def _builtin_studies(out: str, quick: bool, progress: bool | None) -> list[tuple[str, str, dict]]:
    """Train the built-in population (resumably) under ``out/population``; the studies of its two manifests
    (as trained, and with half the checkpoints randomly rescaled): manifest, output folder and the options of
    each (`sharpness.study._builtin.builtin_studies`)."""
    if launched_processes() > 1:
        raise SpecError("--builtin trains its population in one process; run it without torchrun")
    try:
        from sharpness.study._builtin import builtin_studies
    except ModuleNotFoundError as exc:
        if exc.name != "sharpness.study._builtin":
            raise
        raise SpecError("this installation has no built-in population (sharpness.study._builtin); give a manifest "
                        "instead") from None  # fmt: skip
    return [(os.fspath(manifest), os.fspath(folder), options)
            for manifest, folder, options in builtin_studies(out, quick=quick, progress=progress)]  # fmt: skip


def _study_lines(result) -> str:
    """What ``study`` prints: the rows measured and reused, the outputs, the skipped measures and the summary."""
    n = len(result.table)
    lines = [f"{n} checkpoints: {len(result.computed)} measured now, {n - len(result.computed)} read from "
             f"{os.path.join(result.out_dir, 'rows')}"]  # fmt: skip
    lines += [f"wrote {path}" for path in result.files]
    counts: dict[str, int] = {}
    for reasons in result.skipped.values():
        for name in reasons:
            counts[name] = counts.get(name, 0) + 1
    lines += [f"{name}: skipped on {count} of {n} checkpoints (reasons in skipped.json)"
              for name, count in counts.items()]  # fmt: skip
    if result.summary is None:
        lines.append("no statistics or report: this installation lacks sharpness.study._stats and _report")
    else:
        lines += ["", result.summary.to_string(index=False, float_format=lambda v: f"{v:.3f}")]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m sharpness", description="Scale-invariant sharpness of ReLU networks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    compute = sub.add_parser(
        "compute",
        help="sharpness measures of a checkpoint",
        description=(
            "Top Hessian eigenvalues of the loss over the whole data set under each metric: euclidean (not invariant), "
            "layer (invariant under layer-wise rescaling), node (invariant under every positive rescaling), and the "
            "other registered metrics."
        ),
    )
    add_model_arguments(compute)
    compute.add_argument(
        "--metric",
        action="append",
        help=f"repeatable; one of {', '.join(MEASURES)}, or all (default: {', '.join(DEFAULT_COMPUTE)})",
    )
    compute.add_argument("--epsilon", type=float, help="also report epsilon-sharpness for this radius")
    compute.add_argument(
        "--adaptive", type=float, metavar="RHO",
        help="also report adaptive sharpness (l2 and l-infinity worst case, average case) for this relative "
        "radius, e.g. 0.05",
    )  # fmt: skip
    compute.add_argument(
        "--geodesic", type=float, metavar="RHO",
        help="also report geodesic sharpness (second- and first-order geodesics) for this radius, e.g. 0.05",
    )  # fmt: skip
    compute.add_argument(
        "--geodesic-metric", choices=("auto", "node", "layer", "symmetry"), default="auto",
        help="the metric of --geodesic's ball: auto (default) is symmetry where the network has attention or "
        "normalization symmetries (the whole group, as da Silva et al. define it) and node otherwise",
    )  # fmt: skip
    add_solver_arguments(compute)
    compute.add_argument(
        "--start", choices=STARTS, default="random",
        help="the eigen-solver's start vector: random (default) or gradient (a random unit vector plus the loss's "
        "gradient at unit length, which the top eigenvectors lean towards away from a minimum: fewer products, but "
        "it can stop on another eigenvalue close to the top one that the gradient leans towards)",
    )  # fmt: skip
    compute.add_argument("--json", help="write the results to this JSON file")
    add_quiet_argument(compute)

    verify = sub.add_parser(
        "verify",
        help="check invariance under random function-preserving rescalings",
        description="Recompute every measure on randomly rescaled, function-identical copies of the network, drawn "
        "from the rescaling group found on it. Each row is checked to --rtol or to its noise floor where that is "
        "higher (the eigen-solver's residuals and the dtype's rounding; the report's header says which): float32 "
        "cannot resolve 1e-6. Exit status: 0 if every claimed invariance holds to --rtol, 1 if a "
        "measure that claims invariance changes by more than --rtol, 3 if there is nothing to verify (no measure "
        "that applies claims an invariance under a rescaling this network has, e.g. a network whose rescaling "
        "group has dimension 0, or every claim is within a noise floor above 1e-2), 2 on bad input.",
    )
    add_model_arguments(verify)
    verify.add_argument(
        "--metric", action="append",
        help=f"repeatable; one of {', '.join(MEASURES)}, or all (default: every measure that applies to the model)",
    )  # fmt: skip
    verify.add_argument("--trials", type=int, default=3, help="rescaled copies per kind (default: 3)")
    verify.add_argument(
        "--kind", choices=["node", "layer", "attention", "normalization", "group", "both", "all"], default="all",
        help="which random elements of the symmetry group: node- or layer-wise rescalings (both: the two), attention "
        "heads' GL(h) factors, normalization scale trades, the whole group at once, or all (default: all, that is "
        "node, layer and each of the others this network has)",
    )
    verify.add_argument("--scale", type=float, default=1.0, help="std of the log rescaling factors (default: 1)")
    verify.add_argument("--rtol", type=float, default=1e-6,
                        help="invariance tolerance (default: 1e-6; a row's noise floor where higher)")
    verify.add_argument(
        "--geodesic", type=float, metavar="RHO",
        help="also recompute geodesic sharpness (symmetry metric, second order) and adaptive sharpness at this "
        "radius on every copy",
    )  # fmt: skip
    verify.add_argument("--json", help="write the report to this JSON file")
    add_quiet_argument(verify)

    density = sub.add_parser(
        "density",
        help="Hessian eigenvalue density of a checkpoint (stochastic Lanczos quadrature)",
        description="Eigenvalue density of the Hessian of the loss over the whole data set by stochastic Lanczos "
        "quadrature (Rademacher probes, fully reorthogonalized Lanczos): prints the range and mean, writes the "
        "quadratures as JSON and the smoothed density as a figure.",
    )
    add_model_arguments(density)
    density.add_argument("--probes", type=int, default=10, help="random probes (default: 10)")
    density.add_argument("--steps", type=int, default=64, help="Lanczos steps per probe (default: 64)")
    density.add_argument("--seed", type=int, default=0, help="seed of the probes (default: 0)")
    density.add_argument("--sigma", type=float, help="Gaussian width of the plotted density (default: 1%% of range)")
    density.add_argument("--json", help="write the quadratures and moments to this JSON file")
    density.add_argument("--plot", help="write the density figure here (.png, .pdf or .svg)")
    add_quiet_argument(density)

    study = sub.add_parser(
        "study",
        help="every measure over a population of checkpoints, with the generalization gap (resumable, parallel)",
        description="Measure every checkpoint of a manifest (CSV or JSON: columns id, model, checkpoint, train, test "
        "and any hyperparameter columns): every requested measure on the training data, the training and held-out "
        "loss and error, and the gap; writes OUT/table.csv, OUT/skipped.json and one file per checkpoint under "
        "OUT/rows (a rerun measures only new or changed rows), then the statistics and report where installed. "
        "Under torchrun the processes share the rows.",
    )
    study.add_argument(
        "manifest", nargs="?", help="the manifest (.csv or .json); paths in it are relative to its folder"
    )
    study.add_argument("--out", required=True, help="output folder (created if missing; reused to resume)")
    study.add_argument(
        "--builtin", action="store_true",
        help="train the built-in digits population under OUT/population and study it, as trained (OUT/study) and "
        "with half the checkpoints randomly rescaled (OUT/study_rescaled)",
    )  # fmt: skip
    study.add_argument("--quick", action="store_true", help="with --builtin: a tiny population (a smoke test)")
    study.add_argument(
        "--metric", action="append",
        help=f"repeatable; one of {', '.join(MEASURES)}, or all (default: all; what does not apply is skipped)",
    )  # fmt: skip
    study.add_argument(
        "--hyper", action="append", metavar="COLUMN",
        help="repeatable: the manifest columns that are hyperparameters of the granulated tau (default: every "
        "column besides id, model, checkpoint, train, test; the others are kept in the table as labels)",
    )  # fmt: skip
    study.add_argument("--color-by", metavar="COLUMN", help="the manifest column colouring the scatter plots "
                       "(default: the first hyperparameter with 2 to 10 values)")  # fmt: skip
    study.add_argument("--jobs", type=int, default=1, help="worker processes measuring rows at once (default: 1)")
    add_solver_arguments(study)
    add_evaluation_arguments(study, timeout_help="how long a process waits for the others, their rows included")
    add_quiet_argument(study)

    return parser


def main(argv: list[str] | None = None) -> int:
    def parse_and_run(argv: list[str] | None) -> int:
        args = _parser().parse_args(argv)
        return {"compute": _compute, "verify": _verify, "density": _density, "study": _study}[args.command](args)

    return run_command(parse_and_run, argv)
