"""The built-in study population: small ReLU networks trained on scikit-learn's digits with varied
hyperparameters, and a copy of it where half the networks are replaced by function-preserving rescalings.

The data split is fixed: the 1797 digits (``--data digits``, ``X`` in [0, 1]) are permuted by
``numpy.random.RandomState(0).permutation(1797)`` (the legacy generator, whose stream numpy keeps fixed across
versions); the first `N_TRAIN` rows train (``train.pt``), the other rows are held out (``test.pt``). A small
training set makes the generalization gaps large enough to rank.

Every network is an ``mlp:64-WIDTH-10`` trained by SGD with momentum 0.9 (`sharpness.cli.train_to_loss`)
until its whole-training-set cross-entropy reaches `THRESHOLD`: as in Jiang et al. (2020), the models are
compared at the same training loss, so the measures rank minima rather than how far training went. The
hyperparameters form a full grid (`GRID`), so every granulated-tau group varies exactly one of them.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

import manifolds
from sharpness._progress import progress_bar
from sharpness._results import write_atomic, write_tensors_atomic
from sharpness._specs import build_model, load_data, load_state_dict
from sharpness._training import train_to_loss

N_TRAIN = 300
SPLIT_SEED = 0
THRESHOLD = 0.02
QUICK_THRESHOLD = 0.15
# Full grid: 3 x 2 x 2 x 2 x 3 = 72 networks (together about a minute of one core; measuring every registered
# measure on one of them takes well under a second, so training dominates the built-in study).
GRID: dict[str, tuple] = {
    "width": (8, 16, 32),
    "batch_size": (16, 128),
    "lr": (0.01, 0.1),
    "weight_decay": (0.0, 5e-4),
    "seed": (0, 1, 2),
}
# For tests: 6 networks, trained to a looser loss.
QUICK_GRID: dict[str, tuple] = {
    "width": (8, 16, 32),
    "batch_size": (64,),
    "lr": (0.1, 0.3),
    "weight_decay": (0.0,),
    "seed": (0,),
}
# Standard deviation of the node-wise log-scales of the rescaled copies: about 95% of the factors lie in
# [1/10, 10], a spread of a factor of 100, which moves the Euclidean sharpness by orders of magnitude.
RESCALE_LOG_STD = math.log(10.0) / 2
REQUIRED = ("id", "model", "checkpoint", "train", "test")


def _row_id(values: dict) -> str:
    return (f"w{values['width']}-b{values['batch_size']}-lr{values['lr']:g}-wd{values['weight_decay']:g}"
            f"-s{values['seed']}")  # fmt: skip


def _write_split(out: Path) -> None:
    """``train.pt`` and ``test.pt`` (dictionaries of ``X``, ``y``) of the fixed digits split, unless present."""
    X, y = load_data("digits")
    order = torch.from_numpy(np.random.RandomState(SPLIT_SEED).permutation(X.shape[0]))
    for name, rows in (("train.pt", order[:N_TRAIN]), ("test.pt", order[N_TRAIN:])):
        if not (out / name).exists():
            buffer = io.BytesIO()
            torch.save({"X": X[rows].contiguous(), "y": y[rows].long().contiguous()}, buffer)
            write_atomic(out / name, buffer.getvalue())


def _write_manifest(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())


def _check_settings(out: Path, settings: dict) -> None:
    """Record what the folder's population is; refuse a folder holding one made with other settings (its
    checkpoints would be taken as this population's)."""
    path = out / "population.json"
    text = json.dumps(settings, indent=2, sort_keys=True)
    if path.exists():
        if path.read_text() != text:
            raise ValueError(
                f"{out} holds a population trained with other settings (see {path}); give another folder or "
                "delete that one"
            )
        return
    write_atomic(path, text)


def train_builtin_population(
    out_dir: str | os.PathLike, *, rescaled: bool = False, quick: bool = False, seed: int = 0, progress=None
) -> Path:
    """Train the built-in population on digits and write its checkpoints and manifest.

    Writes into ``out_dir``: ``train.pt`` and ``test.pt`` (the fixed split, see the module docstring),
    ``checkpoints/<id>.safetensors`` (float32 state dicts of ``mlp:64-WIDTH-10``), ``manifest.csv`` (columns
    ``id, model, checkpoint, train, test`` and the hyperparameters ``width, batch_size, lr, weight_decay,
    seed``; paths relative to ``out_dir``) and ``population.json`` (the settings). With ``rescaled``, also
    ``checkpoints/<id>-rescaled.safetensors`` for a random half of the rows: a node-wise rescaling
    (`manifolds.random_rescale`, log-scales ``N(0, (ln 10 / 2)^2)``) of the float64 network, saved in
    float64 so it computes the same function to rounding, and ``manifest_rescaled.csv``: the same ids, those
    rows pointing at the rescaled files, and a last column ``rescaled`` (1 for them, 0 otherwise).

    Files already present are kept (an interrupted call resumes; every file is written atomically). The
    networks, the rescaled half and the rescalings are fixed by ``seed`` (on one machine and PyTorch build).

    Args:
        out_dir: the folder (created if needed).
        rescaled: also write the rescaled population.
        quick: 6 tiny networks trained to a looser loss (`QUICK_GRID`), for tests, instead of the 72 of
            `GRID`.
        seed: seed of the initializations, mini-batch orders, the rescaled half and the rescalings; a row's own
            ``seed`` column picks among its initializations.
        progress: show a progress bar (``None``: when stderr is a terminal).

    Returns:
        The path of ``manifest.csv``.

    Raises:
        ValueError: ``out_dir`` holds a population made with other settings, or ``seed`` is not an integer
            ``>= 0``.
        RuntimeError: a network did not reach the training loss (not expected with these grids).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    out = Path(out_dir)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    grid, threshold = (QUICK_GRID, QUICK_THRESHOLD) if quick else (GRID, THRESHOLD)
    _check_settings(out, {"seed": seed, "grid": grid, "threshold": threshold, "n_train": N_TRAIN,
                          "split_seed": SPLIT_SEED, "rescale_log_std": RESCALE_LOG_STD})  # fmt: skip
    _write_split(out)
    train = torch.load(out / "train.pt", weights_only=True)
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    # One thread: these networks are too small for more to help, and spare threads spin on a busy machine.
    # float32 by default whatever the caller's default: the initializations (and so the networks) depend on it.
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    try:
        rows = _train_rows(out, combos, train, threshold, seed, progress)
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    manifest = out / "manifest.csv"
    _write_manifest(manifest, rows)
    if rescaled:
        _write_rescaled(out, rows, seed)
    return manifest


def _train_rows(out: Path, combos: list[dict], train: dict, threshold: float, seed: int, progress) -> list[dict]:
    """Train (or find) the checkpoint of every combination of hyperparameters; their manifest rows."""
    rows = []
    bar = progress_bar(len(combos), "training the population", progress)
    for values in combos:
        row_id = _row_id(values)
        spec = f"mlp:64-{values['width']}-10"
        path = out / "checkpoints" / f"{row_id}.safetensors"
        if not path.exists():
            # Same init and batch order for rows that differ only in batch size, learning rate or weight decay.
            run_seed = 1000 * seed + values["seed"]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(run_seed)
                model = build_model(spec)
            train_to_loss(model, train["X"], train["y"], values["batch_size"], values["lr"], threshold, run_seed,
                          progress=False, weight_decay=values["weight_decay"])  # fmt: skip
            write_tensors_atomic(path, model.state_dict())
        rows.append({"id": row_id, "model": spec, "checkpoint": f"checkpoints/{path.name}", "train": "train.pt",
                     "test": "test.pt", **values})  # fmt: skip
        bar.update(1)
    bar.close()
    return rows


def _write_rescaled(out: Path, rows: list[dict], seed: int) -> None:
    """The rescaled twins of a random half of ``rows`` and ``manifest_rescaled.csv``."""
    chosen = set(np.random.RandomState(seed).permutation(len(rows))[: len(rows) // 2].tolist())
    twin_rows = []
    for i, row in enumerate(rows):
        if i not in chosen:
            twin_rows.append({**row, "rescaled": 0})
            continue
        path = out / "checkpoints" / f"{row['id']}-rescaled.safetensors"
        if not path.exists():
            model = build_model(row["model"]).double()
            model.load_state_dict(load_state_dict(str(out / row["checkpoint"])))
            generator = torch.Generator().manual_seed(1000 * seed + i)
            twin = manifolds.random_rescale(model, "node", RESCALE_LOG_STD, generator)
            write_tensors_atomic(path, twin.state_dict())
        twin_rows.append({**row, "checkpoint": f"checkpoints/{path.name}", "rescaled": 1})
    _write_manifest(out / "manifest_rescaled.csv", twin_rows)


def builtin_studies(
    out_dir: str | os.PathLike, *, quick: bool = False, seed: int = 0, progress=None
) -> list[tuple[Path, Path, dict]]:
    """Train the built-in population (with its rescaled copy) under ``out_dir/population`` and say how to study it.

    Two studies: the population as trained (``out_dir/study``) and with half the checkpoints randomly rescaled
    (``out_dir/study_rescaled``). The second colours its points by the ``rescaled`` column and leaves that
    column out of the hyperparameters: a rescaling changes no trained network, so the granulated tau must group
    the rows exactly as in the first study, and the invariant measures' statistics then agree between the two.

    Args:
        out_dir: the folder (created if needed).
        quick: the small population of `QUICK_GRID` (for tests).
        seed: as for `train_builtin_population`.
        progress: as for `train_builtin_population`.

    Returns:
        ``[(manifest, output folder, options), ...]``, the options being keyword arguments of
        `sharpness.study.run_study` (``hyper_columns``, ``color_by``).

    Raises:
        ValueError: as `train_builtin_population`.
        RuntimeError: as `train_builtin_population`.
    """
    out = Path(out_dir)
    manifest = train_builtin_population(out / "population", rescaled=True, quick=quick, seed=seed, progress=progress)
    return [
        (manifest, out / "study", {}),
        (manifest.parent / "manifest_rescaled.csv", out / "study_rescaled",
         {"hyper_columns": list(GRID), "color_by": "rescaled"}),
    ]  # fmt: skip
