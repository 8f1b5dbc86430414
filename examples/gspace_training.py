"""Validation loss vs learning rate for SGD, G-SGD, Adam and G-Adam: thesis Fig. 4.1 under the thesis's protocol.

The protocol is the one the thesis's code (``main.py``, ``utils/Training.py``, ``utils/Optimizer.py``,
``optimizers/GOptimizer.py``, ``parameterSpaces/GSpace.py``) sets, wherever the data allows:

- network: four bias-free hidden ReLU layers of 64 units, 10 logits (the thesis's MNIST network);
- data: scikit-learn's 8x8 digits (64 inputs, 1797 images, shipped with scikit-learn) instead of MNIST, which
  the project does not ship; pixels mapped to [-1, 1] as the thesis's ``Normalize((0.5,), (0.5,))`` does;
  a fixed 80/20 split stands in for MNIST's test set, which the thesis code validates on;
- batch size 64, reshuffled every epoch, last batch kept (``DataLoader(shuffle=True)``); cross-entropy;
  the validation loss is the mean of the per-batch (64) mean losses, and the loss before training counts as
  epoch 0, as the thesis code computes them;
- optimizers: ``torch.optim.SGD(lr)`` and ``torch.optim.Adam(lr)`` with PyTorch's defaults (no momentum, no
  weight decay, betas (0.9, 0.999)); G-SGD and G-Adam run the same classes on the G-space coordinates.
  The thesis code's ``GOptimizer`` builds a new ``optimizer_class([g_space], lr)`` at every step, so its
  G-Adam keeps no moments: every step is Adam's first, ``lr * g / (|g| + eps)``, a sign-like step. ``G-Adam``
  here does exactly that; ``G-Adam (moments kept)`` (not in the thesis) is Adam with its state kept, as
  `manifolds.GModel` gives it, to measure what that choice does. For plain SGD a fresh optimizer per
  step changes nothing;
- initialization (``--init thesis``, default): PyTorch's default for SGD and Adam; for G-SGD and G-Adam the
  same weights with every skeleton weight and every first-layer weight that starts a chain set to 1, which
  the thesis code's ``GSpace`` does when the G-optimizer is built (``GModel(model, init="gsgd")`` here, the
  same entries). ``--init one`` starts all of them from the latter;
- learning rates 1e-1 ... 1e-5, 150 epochs, 10 runs (seeds 0-9) per configuration; a configuration's score is
  the lowest value over the epochs of the validation loss averaged over the runs (the thesis picks "the
  learning rate that gives the best validation performance at any epoch", "the mean is used").

The seeds of one configuration train as one batched model (the G-space map vectorized with
``torch.func.vmap``), exactly as separate runs would: SGD and Adam act elementwise and each seed's loss
depends on its own weights only. A run whose training loss becomes non-finite stops there (the thesis code
has no guard; its mean would be NaN from then on): the mean curve ends at the first such epoch, and the
count is recorded.

Run:  python examples/gspace_training.py [--out DIR] [--epochs 150] [--seeds 10] [--init thesis]
      python examples/gspace_training.py --quick   # 2 epochs, 2 seeds, lr 1e-1 and 1e-2: seconds
      python examples/gspace_training.py --grid-epochs 30   # the grid 30 epochs, each best rate on to 150
      python examples/gspace_training.py --init one --optimizers SGD Adam --epochs 30   # the page's control
The full protocol takes about 6 minutes of CPU time (22 minutes of wall time on two cores shared with others).
Writes ``DIR/gspace_training.png``, ``.pdf`` and ``.json`` and prints the table behind the figure. A full run
also runs the quick protocol and records its values (``quick``), which ``reproduction_table.py --check``
compares with a fresh quick run. Exit status 1 when a check fails: G-space on a tiny instance of the network
against a dense float64 reference (`reference_checks`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from landscape import save_figure
from manifolds import GModel, gsgd_init_
from sharpness.io import write_atomic

LEARNING_RATES = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5)  # the thesis's grid 10^-a, a = 1..5
EPOCHS, SEEDS, BATCH = 150, 10, 64  # the thesis's protocol
QUICK = {"epochs": 2, "seeds": 2, "learning_rates": LEARNING_RATES[:2]}  # --quick: the same runs, fewer, shorter
QUICK_TOL = 1e-3  # reproduction_table.py --check: a fresh quick run against the record's (relative)
OPTIMIZERS = {  # label: (torch optimizer, train in G-space, a new optimizer every step as the thesis code builds)
    "SGD": (torch.optim.SGD, False, False),
    "G-SGD": (torch.optim.SGD, True, False),  # stateless: a new SGD every step is the same
    "Adam": (torch.optim.Adam, False, False),
    "G-Adam": (torch.optim.Adam, True, True),
    "G-Adam (moments kept)": (torch.optim.Adam, True, False),
}
THESIS = ("SGD", "G-SGD", "Adam", "G-Adam")  # the optimizers of thesis Fig. 4.1
STYLE = {"SGD": ("tab:blue", "-"), "G-SGD": ("tab:blue", "--"), "Adam": ("tab:red", "-"),
         "G-Adam": ("tab:red", "--"), "G-Adam (moments kept)": ("tab:gray", ":")}  # fmt: skip
REFERENCE_WIDTHS = (6, 4, 4, 4, 4, 3)  # a tiny instance of the thesis network (four bias-free hidden ReLU layers)
REFERENCE_TOL = 1e-8  # G-space gradient and top eigenvalues against the dense float64 reference (relative)
REFERENCE_K = 3


def digits(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """8x8 digits mapped to [-1, 1], split 80/20 with a fixed permutation: ``(X_train, y_train, X_val, y_val)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    X = torch.tensor(data.data / 16.0 * 2.0 - 1.0, dtype=torch.float32)  # as Normalize((0.5,), (0.5,)) on [0, 1]
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return X[order[:cut]], y[order[:cut]], X[order[cut:]], y[order[cut:]]


def network(seed: int, widths: tuple[int, ...] = (64, 64, 64, 64, 64, 10)) -> nn.Sequential:
    """The thesis network: a bias-free ReLU MLP of these layer widths (default 64-64-64-64-64-10) in float32 with
    PyTorch's default initialization, drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(fan_in, fan_out, bias=False, dtype=torch.float32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1], bias=False, dtype=torch.float32))


def _start(label: str, seeds: list[int], init: str) -> tuple[list[Tensor], object]:
    """The stacked starting parameters ``(seeds, ...)`` of every seed, and the map to weights (None: identity).

    In G-space the parameters are the coordinates of ``GModel(init="gsgd")`` and the map is its G-space's
    ``w(v)``, vectorized over the seeds: one G-space serves them all, as every seed's skeleton weights are 1."""
    _, in_gspace, _ = OPTIMIZERS[label]
    models = [network(seed) for seed in seeds]
    if not in_gspace:
        if init == "one":
            for m in models:
                gsgd_init_(m)
        tensors = [[p.detach() for p in m.parameters()] for m in models]
        return [torch.stack(ps).clone() for ps in zip(*tensors)], None
    gmodels = [GModel(m, init="gsgd", fused=False) for m in models]
    gspace = gmodels[0].gspace
    for g in gmodels[1:]:  # the one G-space below holds seed 0's skeleton: all must be equal (all 1)
        assert all(torch.equal(a, b) for a, b in zip(gspace.buffers(), g.gspace.buffers()))
    coords = [torch.stack(cs).detach().clone() for cs in zip(*(list(g.coordinates) for g in gmodels))]
    order = [gspace.names.index(n) for n, _ in models[0].named_parameters()]

    def weights(*c: Tensor) -> tuple[Tensor, ...]:
        w = list(gspace.weights(list(c), check=False).values())  # no check: the thesis code has none either
        return tuple(w[k] for k in order)

    return coords, torch.func.vmap(weights)


def _logits(weights: list[Tensor], x: Tensor) -> Tensor:
    """The bias-free ReLU MLP of every seed at once: ``x`` ``(seeds, batch, 64)`` -> ``(seeds, batch, 10)``."""
    for w in weights[:-1]:
        x = torch.relu(torch.bmm(x, w.transpose(1, 2)))
    return torch.bmm(x, weights[-1].transpose(1, 2))


def _val_loss(weights: list[Tensor], X: Tensor, y: Tensor) -> Tensor:
    """Per seed, the mean over validation batches of 64 of each batch's mean cross-entropy (the thesis code's)."""
    with torch.no_grad():
        logits = _logits(weights, X.expand(weights[0].shape[0], *X.shape))
        losses = nn.functional.cross_entropy(logits.transpose(1, 2), y.expand(logits.shape[0], -1), reduction="none")
        return torch.stack([chunk.mean(1) for chunk in losses.split(BATCH, dim=1)], 1).mean(1)


def _epochs(label: str, lr: float, data, seeds: list[int], init: str):
    """Train one configuration for every seed at once, epoch after epoch, for as long as asked.

    Yields every seed's validation loss ``(seeds,)`` before training, then after each epoch; NaN from a
    seed's first non-finite training or validation loss on (that seed then stops)."""
    optimizer_class, _, fresh = OPTIMIZERS[label]
    X, y, X_val, y_val = data
    params, to_weights = _start(label, seeds, init)
    params = [p.requires_grad_(True) for p in params]
    weights = (lambda: list(to_weights(*params))) if to_weights else (lambda: params)
    optimizer = optimizer_class(params, lr=lr)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    alive = torch.ones(len(seeds), dtype=torch.bool)
    val = _val_loss(weights(), X_val, y_val)
    while True:
        alive &= torch.isfinite(val)
        yield torch.where(alive, val, math.nan)
        if not alive.any():
            continue
        order = torch.stack([torch.randperm(len(y), generator=g) for g in generators])
        for batch in order.split(BATCH, dim=1):
            logits = _logits(weights(), X[batch])
            loss = nn.functional.cross_entropy(logits.transpose(1, 2), y[batch], reduction="none").mean(1)
            if fresh:
                optimizer = optimizer_class(params, lr=lr)  # as the thesis's GOptimizer: no state survives a step
            optimizer.zero_grad()
            loss.sum().backward()  # each seed's gradient is its own loss's: the seeds share nothing
            optimizer.step()
            alive &= torch.isfinite(loss.detach())
        val = _val_loss(weights(), X_val, y_val)


def train(label: str, lr: float, data, epochs: int, seeds: list[int], init: str = "thesis") -> dict:
    """Train one configuration for every seed at once for ``epochs`` epochs.

    Returns ``val_loss``: ``(seeds, epochs + 1)`` validation losses, epoch 0 before training, NaN from a
    seed's first non-finite loss on; ``diverged``: per seed, that epoch or None."""
    run = _epochs(label, lr, data, seeds, init)
    history = torch.stack([next(run) for _ in range(epochs + 1)], 1)
    return {"val_loss": history, "diverged": _diverged(history)}


def _diverged(history: Tensor) -> list[int | None]:
    return [int(row.isnan().nonzero()[0]) if row.isnan().any() else None for row in history]


def summarize(val_loss: Tensor) -> dict:
    """The score of one configuration from its ``(seeds, epochs + 1)`` validation losses.

    ``mean``: the seed-mean curve (NaN from the first epoch at which a seed has diverged); ``best``: its lowest
    value, at ``best_epoch``; ``at_best``: every seed's loss at that epoch (the spread behind the mean);
    ``std``: their standard deviation (ddof 1; 0 for one seed)."""
    mean = val_loss.double().mean(0)
    if not torch.isfinite(mean).any():
        return {"mean": mean.tolist(), "best": math.nan, "best_epoch": None, "at_best": [], "std": math.nan}
    epoch = int(torch.nan_to_num(mean, nan=math.inf).argmin())
    at_best = val_loss[:, epoch].double()
    std = float(at_best.std()) if len(at_best) > 1 else 0.0
    return {"mean": mean.tolist(), "best": float(mean[epoch]), "best_epoch": epoch, "at_best": at_best.tolist(),
            "std": std}  # fmt: skip


def run_protocol(
    epochs: int,
    seeds: int,
    learning_rates,
    init: str,
    grid_epochs: int | None = None,
    progress: bool = False,
    labels=tuple(OPTIMIZERS),
) -> tuple[dict, dict]:
    """Every optimizer at every learning rate for ``grid_epochs`` epochs; then each optimizer's best rate on to
    ``epochs`` (the same runs continued, so the first ``grid_epochs`` epochs are those of the grid).

    Returns ``{label: {"lr": summary | {"diverged": [...]}}}`` and ``{label: the rate continued to epochs}``
    (empty when ``grid_epochs`` is ``epochs``: every configuration ran them all)."""
    grid_epochs = epochs if grid_epochs is None else min(grid_epochs, epochs)
    data = digits()
    results: dict[str, dict[str, dict]] = {label: {} for label in labels}
    runs, histories = {}, {}
    jobs = [(label, lr) for label in labels for lr in learning_rates]
    for label, lr in tqdm(jobs, desc="configurations", disable=not progress):
        runs[label, lr] = _epochs(label, lr, data, list(range(seeds)), init)
        histories[label, lr] = [next(runs[label, lr]) for _ in range(grid_epochs + 1)]
        if grid_epochs == epochs:
            del runs[label, lr]  # nothing to continue: free its state

    def store(label: str, lr: float) -> None:
        history = torch.stack(histories[label, lr], 1)
        results[label][f"{lr:g}"] = summarize(history) | {"diverged": _diverged(history)}

    for label, lr in jobs:
        store(label, lr)
    extended = {}
    if grid_epochs < epochs:
        for label in tqdm(labels, desc=f"best rates to {epochs} epochs", disable=not progress):
            best = _best_lr(results, label)
            if best is None:
                continue
            lr = next(r for r in learning_rates if f"{r:g}" == best)
            histories[label, lr] += [next(runs[label, lr]) for _ in range(epochs - grid_epochs)]
            store(label, lr)
            extended[label] = best
    return results, extended


def reference_checks(seed: int = 0) -> list[dict]:
    """G-space, as the G-optimizers train in it, against a dense float64 reference on a tiny thesis network.

    For both initializations of the run (``one``: :class:`manifolds.GModel` with ``init="gsgd"``; ``default``)
    and random data, the gradient the G-optimizers step along (``GModel``'s, by backpropagation through
    ``w(v)``) and the top eigenvalues of the G-space Hessian (measure ``"gspace"``) must equal
    :func:`sharpness.dense_gspace_hessian`, which differentiates only the path values ``v(w)`` (never the
    inverse ``w(v)``): a basis path with the wrong sign, or a wrong factor in either map, fails here.
    Returns one verdict dict (``check``, ``value``, ``bound``, ``passed``) per comparison."""
    from sharpness import Objective, Solver, dense_gspace_hessian, dense_spectrum, get_measure

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(24, REFERENCE_WIDTHS[0], generator=generator, dtype=torch.float64)
    y = torch.randint(0, REFERENCE_WIDTHS[-1], (24,), generator=generator)
    loss_fn, out = nn.CrossEntropyLoss(), []
    name = "-".join(map(str, REFERENCE_WIDTHS))
    for init in ("one", "default"):
        model = network(seed, REFERENCE_WIDTHS).double().eval()
        gmodel = GModel(model, init="gsgd" if init == "one" else "model")
        if init == "one":
            gsgd_init_(model)  # the same weights as GModel's: the reference is taken there
        loss_fn(gmodel(x), y).backward()
        ours = torch.cat([p.grad.reshape(-1) for p in gmodel.parameters()])
        objective = Objective(model, loss_fn, (x, y))
        _, gradient = dense_gspace_hessian(objective)
        error = float((ours - gradient).norm() / gradient.norm())
        out.append({"check": f"{name} tiny, init {init}: GModel's G-space gradient against the dense float64 "
                    "reference (relative)", "value": error, "bound": REFERENCE_TOL})  # fmt: skip
        reference = dense_spectrum(objective, "gspace")[:REFERENCE_K]
        solver = Solver(tol=1e-12, max_iter=300, seed=seed)
        values = get_measure("gspace").sharpness(objective, REFERENCE_K, solver, False).eigenvalues
        error = float((values - reference).abs().max() / reference[0].abs())
        out.append({"check": f"{name} tiny, init {init}: gspace top {REFERENCE_K} eigenvalues against the dense "
                    "float64 reference (relative)", "value": error, "bound": REFERENCE_TOL})  # fmt: skip
    for c in out:
        c["passed"] = bool(c["value"] <= c["bound"])  # a NaN fails
    return out


def _best_lr(results: dict, label: str) -> str | None:
    """The learning rate (key) with ``label``'s lowest score, or None when every one diverged at once."""
    finite = {lr: s["best"] for lr, s in results[label].items() if math.isfinite(s["best"])}
    return min(finite, key=finite.get) if finite else None


def _score(results: dict, label: str, lr: str | None = None) -> str:
    s = results[label][lr or _best_lr(results, label)]
    n = len(s["at_best"])
    return f"{s['best']:.3f} ± {s['std']:.3f}" + (f" ({n} seeds)" if n else "")


def _lower(results: dict, a: str, b: str) -> tuple[float, bool]:
    """``a``'s best score minus ``b``'s (each at its best rate), and whether it exceeds twice the standard error."""
    sa, sb = (results[x][_best_lr(results, x)] for x in (a, b))
    se = math.sqrt(sum(s["std"] ** 2 / max(len(s["at_best"]), 1) for s in (sa, sb)))
    diff = sa["best"] - sb["best"]
    return diff, abs(diff) > 2 * se


def _first_below(mean: list[float], level: float) -> int | None:
    return next((e for e, v in enumerate(mean) if v == v and v <= level), None)


ROBUST_FACTOR = 2.0  # "performs well at a rate": the score there is at most this multiple of the best of the four
FAST_LEVEL = math.log(10) / 2  # "converges": the seed-mean validation loss falls below half the chance level


def claims(results: dict, settings: dict) -> list[dict]:
    """Each qualitative claim of thesis Section 4.1 against the measured ``results`` (``run_protocol``'s).

    Returns one dict per claim: ``claim`` (a short quote), ``measure`` (what is compared), ``outcome``
    (the numbers) and ``verdict`` (``"agrees"``, ``"does not agree"`` or ``"cannot be tested here"``)."""
    out = []
    best = {label: _best_lr(results, label) for label in OPTIMIZERS}
    mark = {True: "agrees", False: "does not agree"}

    def at(label: str) -> str:
        return f"{label} {_score(results, label)} at lr {best[label]}"

    pairs = [("G-SGD", "SGD"), ("G-Adam", "Adam")]
    diffs = {p: _lower(results, *p) for p in pairs}
    improves = [f"{g} - {b} = {d:+.3f} ({'beyond' if sig else 'within'} 2 standard errors)"
                for (g, b), (d, sig) in diffs.items()]  # fmt: skip
    out.append({
        "claim": "\"both G-space based methods do not significantly improve the loss compared to their "
                 "counterparts in the parameter space\"",
        "measure": "best score over the rates (mean over seeds, ± seed standard deviation at the best epoch); "
                   "an improvement counts when the G-method is lower by more than twice the standard error",
        "outcome": "; ".join([at("G-SGD"), at("SGD"), at("G-Adam"), at("Adam")]) + ". " + "; ".join(improves),
        "verdict": mark[not any(d < 0 and sig for d, sig in diffs.values())],
    })  # fmt: skip
    others = [label for label in ("SGD", "G-SGD", "Adam")]
    worst_rates = sum(
        all(results["G-Adam"][lr]["best"] >= results[o][lr]["best"] for o in others)
        for lr in results["G-Adam"]
        if math.isfinite(results["G-Adam"][lr]["best"])
    )
    rates = len(results["G-Adam"])
    worst = all(results["G-Adam"][best["G-Adam"]]["best"] > results[o][best[o]]["best"] for o in others)
    out.append({
        "claim": "\"G-Adam consistently underperforms relative to the other optimizers\"",
        "measure": "G-Adam's best score against the best of SGD, G-SGD and Adam; and at how many rates G-Adam "
                   "is the worst of the four",
        "outcome": f"{at('G-Adam')}; the others' best: "
                   + ", ".join(f"{o} {results[o][best[o]]['best']:.3f}" for o in others)
                   + f". G-Adam is the worst of the four at {worst_rates} of {rates} rates",
        "verdict": mark[worst],
    })  # fmt: skip
    top = min(results[label][best[label]]["best"] for label in THESIS)
    works = {label: [lr for lr, s in results[label].items() if s["best"] <= ROBUST_FACTOR * top]  # NaN: False
             for label in THESIS}  # fmt: skip
    out.append({
        "claim": "\"G-SGD seems to be less sensitive to the choice of learning rate [...] stable across a broader "
                 "range\"",
        "measure": f"the rates at which an optimizer performs well: its score within {ROBUST_FACTOR:g}x the best "
                   f"score of the four ({top:.3f})",
        "outcome": "; ".join(f"{label}: {len(works[label])} ({', '.join(works[label]) or 'none'})" for label in THESIS),
        "verdict": mark[len(works["G-SGD"]) > len(works["SGD"])],
    })  # fmt: skip
    out.append({
        "claim": "\"standard Adam only performs well for smaller learning rates and SGD for larger ones\"",
        "measure": "the best rate of Adam against that of SGD",
        "outcome": f"Adam's best rate {best['Adam']}, SGD's {best['SGD']}",
        "verdict": mark[float(best["Adam"]) < float(best["SGD"])],
    })  # fmt: skip
    small = [lr for lr in results["SGD"] if float(lr) <= 1e-3]
    span = min((len(results[label][lr]["mean"]) - 1 for label in ("SGD", "G-SGD") for lr in small), default=0)
    drop = {label: {lr: results[label][lr]["mean"][0] - results[label][lr]["mean"][span] for lr in small}
            for label in ("SGD", "G-SGD")}  # fmt: skip
    reach = {label: {lr: _first_below(results[label][lr]["mean"][: span + 1], FAST_LEVEL) for lr in small}
             for label in ("SGD", "G-SGD")}  # fmt: skip

    def epoch(e: int | None) -> str:
        return "not reached" if e is None else f"reached at epoch {e}"

    out.append({
        "claim": "\"G-SGD converges much faster than standard SGD for smaller choices of learning rates\"",
        "measure": f"at each rate <= 1e-3: how far the seed-mean validation loss falls in the first {span} epochs "
                   f"(from epoch 0, each from its own start), and when it first is below {FAST_LEVEL:.2f} (half the "
                   "loss of uniform guessing, ln 10)",
        "outcome": "; ".join(f"lr {lr}: G-SGD falls {drop['G-SGD'][lr]:.3f} ({epoch(reach['G-SGD'][lr])}), SGD "
                             f"{drop['SGD'][lr]:.3f} ({epoch(reach['SGD'][lr])})" for lr in small),
        "verdict": mark[all(drop["G-SGD"][lr] > drop["SGD"][lr] for lr in small)] if small else "cannot be tested here",
    })  # fmt: skip
    adam_wins = {g: _lower(results, "Adam", g) for g in ("G-SGD", "G-Adam")}
    out.append({
        "claim": "\"Ultimately however, Adam still performs better than our G-space based methods\"",
        "measure": "Adam's best score against G-SGD's and G-Adam's; better counts when lower by more than twice the "
                   "standard error",
        "outcome": "; ".join(f"Adam - {g} = {d:+.3f} ({'beyond' if sig else 'within'} 2 standard errors)"
                             for g, (d, sig) in adam_wins.items()),
        "verdict": mark[all(d < 0 and sig for d, sig in adam_wins.values())],
    })  # fmt: skip
    d, sig = _lower(results, "G-Adam", "Adam")
    kept = _lower(results, "G-Adam (moments kept)", "Adam")
    out.append({
        "claim": "\"Adam performed notably worse on the G-space\" (conclusion)",
        "measure": "G-Adam's best score against Adam's, significant beyond twice the standard error; beside it "
                   "G-Adam with its moments kept (not in the thesis)",
        "outcome": f"G-Adam - Adam = {d:+.3f} ({'beyond' if sig else 'within'} 2 standard errors); "
                   f"{at('G-Adam (moments kept)')}, minus Adam = {kept[0]:+.3f}",
        "verdict": mark[d > 0 and sig],
    })  # fmt: skip
    out.append(
        {
            "claim": "every statement about the CIFAR-10 panel",
            "measure": "-",
            "outcome": "no CIFAR-10 here: the project ships no CIFAR-10 and the runs have no download",
            "verdict": "cannot be tested here",
        }
    )
    return out


def plot(results: dict, settings: dict, out: Path) -> list[Path]:
    """(a) the score against the learning rate (thesis Fig. 4.1), (b) the seed-mean validation loss per epoch at
    each optimizer's best rate (thesis Fig. 4.2)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    seeds, epochs = settings["seeds"], settings["epochs"]
    grid = settings.get("grid_epochs", epochs)
    span = f"{epochs} epochs" if grid == epochs else f"{grid} epochs (each optimizer's best rate: {epochs})"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.6), constrained_layout=True)
    for label, per_lr in results.items():
        color, line = STYLE[label]
        rates = [float(lr) for lr in per_lr]
        values = [s["best"] for s in per_lr.values()]
        stds = [s["std"] for s in per_lr.values()]
        marker, fill = (
            ("o", color) if label in ("SGD", "Adam") else ("s" if label != "G-Adam (moments kept)" else "^", "white")
        )
        ax.errorbar(rates, values, yerr=stds, ls=line, color=color, marker=marker, mfc=fill, lw=1.8, elinewidth=1,
                    capsize=3, label=label)  # fmt: skip
        if label in settings.get("extended", {}):  # this rate went on to all the epochs: a star
            lr = settings["extended"][label]
            ax.plot(float(lr), per_lr[lr]["best"], "*", color=color, ms=13, mec="black", mew=0.6)
        for lr, s in zip(rates, per_lr.values()):
            n = sum(d is not None for d in s["diverged"])
            if n and math.isfinite(s["best"]):
                ax.annotate(f"{n}/{seeds} diverged", (lr, s["best"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)  # fmt: skip
        lr = _best_lr(results, label)
        if lr is not None:
            mean = per_lr[lr]["mean"]
            bx.plot(range(len(mean)), mean, line, color=color, lw=1.6, label=f"{label}, lr {lr}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    low = [v["best"] - v["std"] for per_lr in results.values() for v in per_lr.values() if v["best"] - v["std"] > 0]
    if low:  # room below the lowest bar for the legend
        ax.set_ylim(bottom=min(low) / 4)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("best validation loss over the epochs (cross-entropy)")
    stars = f"; stars: {epochs} epochs" if grid != epochs else ""
    ax.set_title(f"(a) score per learning rate: mean of {seeds} seeds, bars ± seed std{stars}", fontsize=9)
    bx.set_yscale("log")
    bx.set_xlabel("epoch (0: before training)")
    bx.set_ylabel("validation loss, mean over seeds")
    bx.set_title("(b) each optimizer at its best learning rate", fontsize=9)
    for a, where in ((ax, "lower left"), (bx, "upper right")):  # (a): below the small rates' scores
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8, loc=where)
    start = ("PyTorch default (SGD, Adam); skeleton and chain-start weights 1 (G-methods)"
             if settings["init"] == "thesis" else "skeleton and chain-start weights 1 (all)")  # fmt: skip
    fig.suptitle(
        f"Like thesis Fig. 4.1 and 4.2: 8x8 digits, 64-64x4-10 bias-free ReLU, batch {BATCH}, {span}\ninit: {start}",
        fontsize=10,
    )
    description = (
        "Fig. 4.1 of C. Jestaedt, Scale invariant parameter spaces for ReLU networks (bachelor thesis, "
        "Tuebingen, 2025), and its Fig. 4.2, under the protocol of the thesis's code on scikit-learn's 8x8 digits "
        f"instead of MNIST: best validation loss over {span} (mean over {seeds} seeds) against the learning "
        "rate for SGD, G-SGD, Adam and G-Adam (a new Adam every step, as the thesis code builds it), and G-Adam "
        f"with its moments kept; batch {BATCH}, network 64-64-64-64-64-10 without biases; init: {start}."
    )
    paths = save_figure(fig, out / "gspace_training", ("png", "pdf"), dpi=150, description=description)
    plt.close(fig)
    return paths


def _table(results: dict, title: str) -> str:
    rates = list(next(iter(results.values())))
    lines = [title, f"{'optimizer':24s}" + "".join(f"{f'lr={lr}':>18s}" for lr in rates)]
    for label, per_lr in results.items():
        cells = []
        for s in per_lr.values():
            n = sum(d is not None for d in s["diverged"])
            cells.append(f"{s['best']:.4f}" + (f" ({n} div)" if n else ""))
        lines.append(f"{label:24s}" + "".join(f"{c:>18s}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="SGD vs G-SGD vs Adam vs G-Adam on 8x8 digits: best validation loss vs learning rate "
        "(thesis Fig. 4.1 under the thesis code's protocol).",
    )
    parser.add_argument("--out", type=Path, default=Path("gspace-out"), help="output folder (default: gspace-out)")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default: {EPOCHS}, --quick {QUICK['epochs']})")
    parser.add_argument(
        "--seeds", type=int, help=f"runs per configuration (default: {SEEDS}, --quick {QUICK['seeds']})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test, seconds: learning rates 1e-1 and 1e-2, {QUICK['epochs']} epochs, {QUICK['seeds']} seeds",
    )
    parser.add_argument(
        "--init",
        choices=("thesis", "one"),
        default="thesis",
        help="'thesis' (default): PyTorch's init for SGD and Adam, skeleton and chain-start weights 1 for the "
        "G-methods, as the thesis code; 'one': all four from the latter",
    )
    parser.add_argument(
        "--grid-epochs",
        type=int,
        help="epochs of every configuration of the learning-rate grid; each optimizer's best rate then goes on to "
        "--epochs (default: --epochs, every configuration for all of them, the thesis's protocol)",
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        metavar="NAME",
        help=f"train only these (default: all of {', '.join(OPTIMIZERS)}); the claims need all",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK["epochs"] if args.quick else EPOCHS
    if args.seeds is None:
        args.seeds = QUICK["seeds"] if args.quick else SEEDS
    learning_rates = QUICK["learning_rates"] if args.quick else LEARNING_RATES
    if args.epochs < 1 or args.seeds < 1 or (args.grid_epochs is not None and args.grid_epochs < 1):
        print("error: --epochs, --grid-epochs and --seeds must be at least 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # a tiny network: thread hand-offs cost more than they save
    # From PyTorch's initialization the activations of this deep narrow network shrink into subnormal floats,
    # which make SGD's steps about 15x slower on CPUs; flushing them to 0 changes no recorded digit.
    torch.set_flush_denormal(True)

    start, cpu = time.perf_counter(), time.process_time()
    progress = not args.no_progress and sys.stderr.isatty()
    labels = [label for label in OPTIMIZERS if label in (args.optimizers or OPTIMIZERS)]
    results, extended = run_protocol(
        args.epochs, args.seeds, learning_rates, args.init, args.grid_epochs, progress, labels
    )
    settings = vars(args) | {
        "out": str(args.out),
        "learning_rates": list(learning_rates),
        "batch": BATCH,
        "grid_epochs": min(args.grid_epochs or args.epochs, args.epochs),
        "extended": extended,
    }
    print(_table(results, f"best validation loss over {args.epochs} epochs, mean over {args.seeds} seeds "
                          f"(init: {args.init})"))  # fmt: skip
    record = {"settings": settings, "results": results}
    every = labels == list(OPTIMIZERS)
    if not args.quick and every:  # the quick protocol's values, for reproduction_table.py --check to compare with
        record["quick"] = run_protocol(QUICK["epochs"], QUICK["seeds"], QUICK["learning_rates"], args.init)[0]
    record["claims"] = claims(results, settings) if every else []
    verdicts = reference_checks()
    record |= {"checks": verdicts, "passed": all(c["passed"] for c in verdicts),
               "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}  # fmt: skip
    paths = plot(results, settings, args.out)
    json_path = args.out / "gspace_training.json"
    write_atomic(json_path, json.dumps(record, indent=1))
    for c in record["claims"]:
        print(f"[{c['verdict']}] {c['claim']}: {c['outcome']}")
    for c in verdicts:
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['check']}: {c['value']:.2e} <= {c['bound']:.2e}")
    print(f"wrote {', '.join(str(p) for p in [*paths, json_path])} in {record['wall_s']:.0f} s")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
