"""Validation loss vs learning rate for SGD, G-SGD, Adam and G-Adam, like Fig. 4.1 of the thesis.

The thesis's MNIST network shape (four bias-free hidden ReLU layers of 64 units, 10 logits) on
scikit-learn's 8x8 digits (64 inputs, 1797 images, no download): 80 % training, 20 % validation,
batch size 64. Every optimizer starts from the same network and is run for each learning rate in
{1e-1, 1e-2, 1e-3, 1e-4}; like the thesis, each run is scored by its best validation loss over the
epochs, averaged over seeds. G-SGD and G-Adam are ``torch.optim.SGD`` and ``torch.optim.Adam`` on the
G-space coordinates of :class:`manifolds.GModel` (the optimizer state, Adam's moments included,
persists across steps; :class:`manifolds.GOptimizer` gives the same updates on the model itself).

``--init one`` (default) starts from the G-SGD paper's initialization: PyTorch's default weights with
every skeleton weight, and every first-layer weight that starts a chain to the input, set to 1
(``gsgd_init_(model)`` for SGD and Adam, ``GModel(model, init="gsgd")`` for G-SGD and G-Adam, which gives
the same weights, so the four optimizers start from the same function). ``--init default``
keeps PyTorch's initialization: the basis-path values are then tiny, G-space gradients huge, and
G-SGD needs far smaller learning rates (a run that pushes a chain value through 0 stops with
:class:`manifolds.GSpaceSingularityError` and is marked as diverged, keeping its best epoch so far).

Run:  python examples/gspace_training.py [--out DIR] [--epochs 15] [--seeds 3] [--init one]
      python examples/gspace_training.py --quick   # 2 epochs, 1 seed, lr 1e-1 and 1e-2: a few seconds
Writes ``DIR/gspace_training.png``, ``.pdf`` and ``.json`` and prints the table behind the figure. Exit status 1
when a check fails: G-space on a tiny instance of the network against a dense float64 reference
(:func:`reference_checks`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from landscape import save_figure
from manifolds import GModel, GSpaceSingularityError, gsgd_init_

LEARNING_RATES = (1e-1, 1e-2, 1e-3, 1e-4)
QUICK_LEARNING_RATES = LEARNING_RATES[:2]  # --quick: the same runs, fewer of them and shorter
OPTIMIZERS = {  # label: (torch optimizer, train in G-space)
    "SGD": (torch.optim.SGD, False),
    "G-SGD": (torch.optim.SGD, True),
    "Adam": (torch.optim.Adam, False),
    "G-Adam": (torch.optim.Adam, True),
}
STYLE = {"SGD": ("tab:blue", "-"), "G-SGD": ("tab:blue", "--"), "Adam": ("tab:red", "-"), "G-Adam": ("tab:red", "--")}
REFERENCE_WIDTHS = (6, 4, 4, 4, 4, 3)  # a tiny instance of the thesis network (four bias-free hidden ReLU layers)
REFERENCE_TOL = 1e-8  # G-space gradient and top eigenvalues against the dense float64 reference (relative)
REFERENCE_K = 3


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8x8 digits scaled to [0, 1], split 80/20 with a fixed permutation: ``(X_train, y_train, X_val, y_val)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    X = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return X[order[:cut]], y[order[:cut]], X[order[cut:]], y[order[cut:]]


def network(seed: int) -> nn.Sequential:
    """64-64-64-64-64-10 bias-free ReLU MLP with PyTorch's default initialization."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for fan_in in (64, 64, 64, 64):
        layers += [nn.Linear(fan_in, 64, bias=False), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10, bias=False))


def train(model: nn.Module, label: str, lr: float, data, epochs: int, seed: int, init: str = "one") -> dict:
    """Train one configuration; returns the validation loss per epoch and whether (when) it diverged.

    ``init="one"`` starts from the G-SGD initialization: ``gsgd_init_`` on the model, or the same through
    ``GModel(model, init="gsgd")`` in G-space."""
    optimizer_class, in_gspace = OPTIMIZERS[label]
    X, y, X_val, y_val = data
    if in_gspace:
        net = GModel(model, init="gsgd" if init == "one" else "model")
    else:
        net = gsgd_init_(model) if init == "one" else model
    optimizer = optimizer_class(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)
    history: list[float] = []
    diverged = None
    for epoch in range(epochs):
        try:
            for batch in torch.randperm(len(y), generator=generator).split(64):
                optimizer.zero_grad()
                loss = loss_fn(net(X[batch]), y[batch])
                if not torch.isfinite(loss):
                    raise FloatingPointError("non-finite training loss")
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                val = loss_fn(net(X_val), y_val).item()
        except (GSpaceSingularityError, FloatingPointError) as err:
            diverged = {"epoch": epoch, "reason": type(err).__name__}
            break
        if not math.isfinite(val):
            diverged = {"epoch": epoch, "reason": "non-finite validation loss"}
            break
        history.append(val)
    return {"val_loss": history, "diverged": diverged}


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
        torch.manual_seed(seed)
        model = nn.Sequential(*[m for a, b in zip(REFERENCE_WIDTHS[:-1], REFERENCE_WIDTHS[1:])
                                for m in (nn.Linear(a, b, bias=False), nn.ReLU())][:-1]).double().eval()  # fmt: skip
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


def plot(
    summary: dict[str, list[float]],
    counts: dict[str, list[int]],
    seeds: int,
    init: str,
    out: Path,
    learning_rates: tuple[float, ...] = LEARNING_RATES,
) -> list[Path]:
    """Best validation loss (mean over seeds) vs learning rate, one line per optimizer (like thesis Fig. 4.1)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), constrained_layout=True)
    for label, values in summary.items():
        color, line = STYLE[label]
        ax.plot(learning_rates, values, line, color=color, marker="o", lw=1.8, label=label)
        for lr, value, n in zip(learning_rates, values, counts[label]):
            if n < seeds and math.isfinite(value):  # some seeds diverged: mean over the rest
                ax.annotate(f"{n}/{seeds}", (lr, value), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("best validation loss (cross-entropy)")
    start = "skeleton and chain-start weights 1 (G-SGD)" if init == "one" else "PyTorch default"
    ax.set_title(f"Like thesis Fig. 4.1: 8x8 digits, 64-64x4-10 bias-free ReLU\ninit: {start}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    description = (
        "Like Fig. 4.1 of C. Jestaedt, Scale invariant parameter spaces for ReLU networks (bachelor thesis, "
        "Tuebingen, 2025), scaled down: best validation loss over the epochs (mean over "
        f"{seeds} seed(s)) against the learning rate for SGD, G-SGD, Adam and G-Adam on scikit-learn's 8x8 digits "
        f"(80/20 split, batch 64), network 64-64-64-64-64-10 without biases; init: {start}."
    )
    paths = save_figure(fig, out / "gspace_training", ("png", "pdf"), dpi=150, description=description)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="SGD vs G-SGD vs Adam vs G-Adam on 8x8 digits: best validation loss vs learning rate "
        "(thesis Fig. 4.1 setting, scaled down).",
    )
    parser.add_argument("--out", type=Path, default=Path("gspace-out"), help="output folder (default: gspace-out)")
    parser.add_argument("--epochs", type=int, help="epochs per run (default: 15, --quick 2)")
    parser.add_argument("--seeds", type=int, help="runs per configuration, averaged (default: 3, --quick 1)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test, a few seconds: learning rates 1e-1 and 1e-2 only, 2 epochs, 1 seed",
    )
    parser.add_argument(
        "--init",
        choices=("one", "default"),
        default="one",
        help="'one': skeleton and chain-start weights set to 1 as in G-SGD (default); 'default': PyTorch's init",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 15
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    learning_rates = QUICK_LEARNING_RATES if args.quick else LEARNING_RATES
    if args.epochs < 1 or args.seeds < 1:
        print("error: --epochs and --seeds must be at least 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # a tiny network: thread hand-offs cost more than they save

    data = digits()
    start = time.perf_counter()
    runs = {label: {lr: [] for lr in learning_rates} for label in OPTIMIZERS}
    jobs = [(seed, label, lr) for seed in range(args.seeds) for label in OPTIMIZERS for lr in learning_rates]
    for seed, label, lr in tqdm(jobs, desc="runs", disable=args.no_progress or not sys.stderr.isatty()):
        runs[label][lr].append(train(network(seed), label, lr, data, args.epochs, seed, args.init))

    summary: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    print(f"best validation loss over {args.epochs} epochs, mean over {args.seeds} seeds (init: {args.init})")
    print(f"{'optimizer':10s}" + "".join(f"{f'lr={lr:g}':>16s}" for lr in learning_rates))
    for label in OPTIMIZERS:
        summary[label], counts[label], cells = [], [], []
        for lr in learning_rates:
            best = [min(r["val_loss"]) for r in runs[label][lr] if r["val_loss"]]
            diverged = sum(r["diverged"] is not None for r in runs[label][lr])
            value = float(np.mean(best)) if best else float("nan")
            summary[label].append(value)
            counts[label].append(len(best))
            cells.append(f"{value:.4f}" + (f" ({diverged} div)" if diverged else ""))
        print(f"{label:10s}" + "".join(f"{c:>16s}" for c in cells))
    paths = plot(summary, counts, args.seeds, args.init, args.out, learning_rates)
    verdicts = reference_checks()
    record = {
        "settings": vars(args) | {"out": str(args.out), "learning_rates": learning_rates},
        "best_val_loss_mean": summary,
        "runs": {label: {f"{lr:g}": v for lr, v in per_lr.items()} for label, per_lr in runs.items()},
        "checks": verdicts,
        "passed": all(c["passed"] for c in verdicts),
    }
    json_path = args.out / "gspace_training.json"
    json_path.write_text(json.dumps(record, indent=1))
    for c in verdicts:
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['check']}: {c['value']:.2e} <= {c['bound']:.2e}")
    print(f"wrote {', '.join(str(p) for p in [*paths, json_path])} in {time.perf_counter() - start:.0f} s")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
