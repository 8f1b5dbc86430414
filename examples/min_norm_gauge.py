"""Reproduce Fig. 2 of the minimum-norm gauge paper: convergence of the gauge-fixing updates.

Three randomly initialized ReLU networks with 200 inputs, 3750 hidden units in 2, 4 or 5 hidden
layers, and 10 outputs (200-2500-1250-10, 200-2000-1000-500-250-10, 200-1000-750-750-500-250-10;
He initialization, zero biases) are brought to their minimum-l_p-norm gauge with the multiplicative
updates of Algorithm 1 (:func:`manifolds.min_norm_gauge`), for p = 2 and p = 1. The figure shows the
objective ``||W||_{p,p}^p`` (left) and the largest imbalance ``gamma`` of eq. (20) over hidden units
(right, log scale) per update; rows are p = 2 (top) and p = 1 (bottom), as in the paper.

Run:  python examples/min_norm_gauge.py [--out DIR] [--tol 1e-10] [--quick]
Writes ``DIR/min_norm_gauge.png``, ``.pdf`` and ``.json`` and prints, per network and p, the updates needed,
the objective before and after, and the largest change of the network outputs (a gauge
transformation must not change the function). Checks (exit status 1 when one fails): every run
reaches the tolerance; the objective never increases by more than 1e-12 of its start between updates
(Lemma 2.3 of the paper); the outputs change by less than 1e-12 (relative); and on a tiny network of the same
kind the Hessians at the gauge equal a dense float64 reference (:func:`reference_checks`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from landscape import save_figure
from manifolds import GaugeHistory, min_norm_gauge
from sharpness.io import write_atomic

NETWORKS = (
    (200, 2500, 1250, 10),
    (200, 2000, 1000, 500, 250, 10),
    (200, 1000, 750, 750, 500, 250, 10),
)
# --quick (what `reproduction_table.py --check` re-runs): the same depths with every hidden layer 10x narrower.
QUICK_NETWORKS = tuple((w[0], *(h // 10 for h in w[1:-1]), w[-1]) for w in NETWORKS)
P_VALUES = (2.0, 1.0)  # rows of the figure, top to bottom
INCREASE_TOL = 1e-12  # the largest increase of the objective between updates, relative to its start
OUTPUT_TOL = 1e-12  # the largest relative change of the outputs under the gauge transformation
REFERENCE_NETWORK = (6, 5, 4, 3)  # a tiny instance of the paper's networks for the dense float64 reference
REFERENCE_TOL = 1e-8  # top eigenvalues against the dense reference, relative to the largest
REFERENCE_K = 3


def he_mlp(widths: tuple[int, ...], generator: torch.Generator) -> nn.Sequential:
    """ReLU MLP with zero biases and ``N(0, 2 / fan_in)`` weights (He et al., 2015), float64."""
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        linear = nn.Linear(fan_in, fan_out, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(fan_out, fan_in, generator=generator, dtype=torch.float64))
            linear.weight.mul_((2.0 / fan_in) ** 0.5)
            linear.bias.zero_()
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # linear output units


def output_change(model: nn.Module, gauged: nn.Module, generator: torch.Generator) -> float:
    """Largest relative change of the outputs on random inputs (rounding only, for a gauge transformation)."""
    x = torch.randn(256, model[0].in_features, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        return float((gauged(x) - ref).abs().max() / ref.abs().max())


def plot(histories: dict[tuple[float, tuple[int, ...]], GaugeHistory], tol: float, out: Path,
         networks: tuple[tuple[int, ...], ...] = NETWORKS) -> list[Path]:  # fmt: skip
    """The 2 x 2 figure: objective and imbalance per update, p = 2 (top) and p = 1 (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(P_VALUES), 2, figsize=(10, 7.2), constrained_layout=True)
    colors = plt.get_cmap("tab10").colors
    for row, p in enumerate(P_VALUES):
        ax_obj, ax_gamma = axes[row]
        for k, widths in enumerate(networks):
            history = histories[(p, widths)]
            steps = np.arange(len(history.objective))
            label = f"{'-'.join(map(str, widths))} ({len(widths) - 2} hidden layers)"
            ax_obj.plot(steps, history.objective, color=colors[k], lw=1.6, label=label)
            ax_gamma.semilogy(steps, history.max_imbalance, color=colors[k], lw=1.6, label=label)
        ax_obj.set_ylabel(rf"objective $\|W\|_{{{p:g},{p:g}}}^{{{p:g}}}$")
        ax_obj.set_title(rf"$\ell_{{{p:g}}}$-norm gauge: objective")
        ax_gamma.set_ylabel(r"max imbalance $\gamma$, eq. (20)")
        ax_gamma.set_title(rf"$\ell_{{{p:g}}}$-norm gauge: imbalance")
        for ax in (ax_obj, ax_gamma):
            ax.set_xlabel("update")
            ax.set_xlim(left=0)
            ax.grid(True, which="major", alpha=0.3)
        ax_obj.legend(frameon=False, fontsize=8)
    mantissa, exponent = f"{tol:.1e}".split("e")
    tol_tex = ("" if float(mantissa) == 1 else rf"{float(mantissa):g} \times ") + rf"10^{{{int(exponent)}}}"
    fig.suptitle(
        "Min-norm gauge paper, Fig. 2: multiplicative gauge-fixing updates (Algorithm 1)\n"
        rf"on He-initialized ReLU networks, stopped when $\mathrm{{max}}_i\,|a_i - 1| < {tol_tex}$",
        fontsize=11,
    )
    out.mkdir(parents=True, exist_ok=True)
    names = ", ".join("-".join(map(str, widths)) for widths in networks)
    description = (
        "Redraws Fig. 2 of 'The Minimum-Norm Gauge for Deep Learning': objective and largest imbalance gamma per "
        f"update of Algorithm 1 (manifolds.min_norm_gauge) for p = 2 and p = 1, on networks {names} with "
        f"He-initialized weights and zero biases; tolerance {tol:g}."
    )
    paths = save_figure(fig, out / "min_norm_gauge", ("png", "pdf"), dpi=150, description=description)
    plt.close(fig)
    return paths


def checks(runs: list[dict]) -> list[dict]:
    """The verdicts on the runs' numbers: each a dict with ``check``, ``value``, ``bound``, ``passed``."""
    out = []
    for r in runs:
        name = f"{'-'.join(map(str, r['network']))}, p={r['p']:g}"
        out += [
            {"check": f"{name}: reached the tolerance (1 = yes)", "value": float(r["converged"]), "bound": 1.0,
             "passed": bool(r["converged"])},
            {"check": f"{name}: largest objective increase / start", "value": r["largest_increase"],
             "bound": INCREASE_TOL, "passed": bool(r["largest_increase"] <= INCREASE_TOL)},
            {"check": f"{name}: largest relative output change", "value": r["output_change"], "bound": OUTPUT_TOL,
             "passed": bool(r["output_change"] <= OUTPUT_TOL)},
        ]  # fmt: skip
    return out


def reference_checks(seed: int = 0) -> list[dict]:
    """The Hessians at the gauge against dense float64 references, on a tiny He-initialized network of the same kind.

    Random inputs and labels (cross-entropy), so the point is not critical and the connection terms count. The
    network is gauged by Algorithm 1 as in the run; at the original and the gauged weights the node-wise and
    layer-wise measures must equal :func:`sharpness.dense_spectrum` (and the node-wise one be the same at both,
    the gauge being a node-wise rescaling), and the ``minnorm`` measure the Euclidean Hessian at the weights
    Algorithm 1 found. Unlike the paper's, the biases are small and nonzero: the layer-wise metric does not
    exist on a zero tensor, and the node-wise measure's horizontal projection is exact only where no weight is
    zero (with zero biases it is 4e-6 off the exact reference here)."""
    from sharpness import Objective, Solver, dense_spectrum, get_measure

    generator = torch.Generator().manual_seed(seed)
    model = he_mlp(REFERENCE_NETWORK, generator).eval()
    with torch.no_grad():
        for layer in model[::2]:
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(32, REFERENCE_NETWORK[0], generator=generator, dtype=torch.float64)
    y = torch.randint(0, REFERENCE_NETWORK[-1], (32,), generator=generator)
    gauged = min_norm_gauge(model, p=2.0, tol=1e-13, max_iter=100_000)[0].eval()
    solver, loss = Solver(tol=1e-12, max_iter=300, seed=seed), nn.CrossEntropyLoss()
    name = "-".join(map(str, REFERENCE_NETWORK))
    cases = [(measure, where, point, point) for measure in ("node", "layer")
             for where, point in (("original", model), ("gauged", gauged))]  # fmt: skip
    cases.append(("minnorm", "original", model, gauged))
    out, values = [], {}
    for measure, where, measured, reference_at in cases:
        ours = get_measure(measure).sharpness(Objective(measured, loss, (x, y)), REFERENCE_K, solver, False)
        reference_measure = "euclidean" if measure == "minnorm" else measure
        reference = dense_spectrum(Objective(reference_at, loss, (x, y)), reference_measure)[:REFERENCE_K]
        values[(measure, where)] = ours.eigenvalues
        error = float(relative(ours.eigenvalues, reference))
        out.append({"check": f"{name} tiny, {where}: {measure} top {REFERENCE_K} eigenvalues against the dense float64 "
                    f"{'Euclidean Hessian at the gauge' if measure == 'minnorm' else 'Riemannian Hessian'} (relative)",
                    "value": error, "bound": REFERENCE_TOL, "passed": bool(error <= REFERENCE_TOL)})  # fmt: skip
    change = float(relative(values[("node", "gauged")], values[("node", "original")]))
    out.append({"check": f"{name} tiny: node top {REFERENCE_K} eigenvalues, gauged against original (relative)",
                "value": change, "bound": REFERENCE_TOL, "passed": bool(change <= REFERENCE_TOL)})  # fmt: skip
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest entry-wise difference of two spectra, relative to the largest magnitude of ``b``."""
    return (a - b).abs().max() / b.abs().max()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/min_norm_gauge"), help="output folder")
    parser.add_argument("--tol", type=float, default=1e-10, help="stop when max |a_i - 1| < TOL (default 1e-10)")
    parser.add_argument("--max-iter", type=int, default=10000, help="most updates per run (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--quick", action="store_true", help="hidden layers 10x narrower (seconds; the same checks)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    histories, runs = {}, []
    print(
        f"{'network':<36} {'p':>3} {'updates':>8} {'objective before -> after':>28} {'reduction':>9} "
        f"{'gamma':>8} {'max |df|/|f|':>12}"
    )
    networks = QUICK_NETWORKS if args.quick else NETWORKS
    for widths in networks:
        model = he_mlp(widths, generator)
        for p in P_VALUES:
            gauged, history = min_norm_gauge(model, p=p, tol=args.tol, max_iter=args.max_iter)
            histories[(p, widths)] = history
            increase = max(0.0, float(np.max(np.diff(history.objective), initial=0.0))) / history.objective[0]
            before, after = history.objective[0], history.objective[-1]
            updates = f"{history.iterations}" + ("" if history.converged else "*")
            change = output_change(model, gauged, generator)
            runs.append({"network": list(widths), "p": p, "updates": history.iterations, "converged": history.converged,
                         "objective_before": before, "objective_after": after, "gamma": history.gamma,
                         "largest_increase": increase, "output_change": change})  # fmt: skip
            print(
                f"{'-'.join(map(str, widths)):<36} {p:>3g} {updates:>8} {before:>13.1f} -> {after:>11.1f} "
                f"{1 - after / before:>9.1%} {history.gamma:>8.1e} "
                f"{change:>12.1e}"
            )
    paths = plot(histories, args.tol, args.out, networks)
    settings = {"tol": args.tol, "max_iter": args.max_iter, "seed": args.seed, "quick": args.quick}
    verdicts = checks(runs) + reference_checks(args.seed)
    record = {"example": "min_norm_gauge", "settings": settings, "runs": runs, "checks": verdicts,
              "passed": all(c["passed"] for c in verdicts), "seconds": time.perf_counter() - start,
              "torch_threads": torch.get_num_threads()}  # fmt: skip
    json_path = args.out / "min_norm_gauge.json"
    write_atomic(json_path, json.dumps(record, indent=1))
    paths.append(json_path)
    if not all(h.converged for h in histories.values()):
        print(f"* did not reach the tolerance in {args.max_iter} updates")
    failed = [c for c in verdicts if not c["passed"]]
    for c in failed:
        print(f"FAIL {c['check']}: {c['value']:.2e} > {c['bound']:.2e}")
    print(
        f"{len(verdicts) - len(failed)}/{len(verdicts)} checks pass (every run converged, objective increases at most "
        f"{INCREASE_TOL:g}, output changes at most {OUTPUT_TOL:g}); wrote {', '.join(map(str, paths))} in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
