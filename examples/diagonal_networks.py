"""Sec. 5.1.1 and Fig. 3 of da Silva, Dangel and Oore, "Hide & Seek" (ICML 2025): a population of diagonal linear
networks on synthetic sparse regression, and the rank correlation of each sharpness measure with generalization.

**What the paper states** (Sec. 5.1 and 5.1.1): networks ``f(x) = x^T (u * v)`` with ``u, v`` in ``R^d``; square
loss ``L(u, v) = ||X (u * v) - y||^2``; following Andriushchenko et al. (2023), a randomly distributed data matrix
``X``, a random ground truth ``beta*`` that is 90% sparse, the overparameterized case ``d > n`` (``d = 200``:
Sec. 5.1.1 writes ``I_{d=200}``); 50 networks trained to ``1e-5`` training loss; the generalization gap is the
test loss; Kendall's tau of worst-case adaptive sharpness and of geodesic sharpness with it, under two metrics
(``inv`` = sum of ``xi_u^2 / u^2 + xi_v^2 / v^2``, ``mix`` = sum of ``xi_u^2 v^2 + xi_v^2 u^2``); "all three notions
of sharpness are able to predict generalization", geodesic sharpness "does slightly better" (larger ``|tau|``),
both metrics "roughly the same", and the sign is negative (Sec. 7: "adaptive sharpness anti-correlates with
generalization in our diagonal network setting"). The tau values are printed only inside Fig. 3's image.

**What it leaves open, and what is chosen here.** The paper cites Andriushchenko, Croce, Müller, Hein and
Flammarion (2023) for the setup; the sizes here come from the diagonal-network code of Andriushchenko, Varre,
Pillaud-Vivien and Flammarion (2023), ``n = 80, d = 200`` and 20 non-zero entries (the paper's ``d`` and
sparsity; whether it used that ``n`` is not stated): ``n = 80``
training and 1000 test points, ``X`` standard normal, the 20 non-zero entries of ``beta*`` standard normal over
``sqrt(20)``, noiseless labels; full-batch gradient descent on the mean squared error, stopped when the paper's
sum-of-squares loss is below ``1e-5``; each network draws its initialization scale ``alpha`` (log-uniform in
``[0.01, 0.5]``: small scales learn sparse predictors, large ones dense), its learning rate (log-uniform in
``[0.005, 0.03]``) and its start ``u0, v0`` with independent ``N(0, alpha^2)`` entries from
``numpy.random.default_rng(1000 + index)``; radius ``rho = 0.1`` for both adaptive and geodesic sharpness (the same
ball in the whitened coordinates ``xi / |w|``). A second population (``variant`` in the record) starts every
network from Pesme et al.'s deterministic ``u0 = sqrt(2) alpha``, ``v0 = 0`` with the same ``alpha`` and learning
rates: gradient descent with small steps then follows gradient flow, whose limit depends on ``alpha`` (the step only
perturbs it), so
that population is close to a one-parameter family, which every measure monotone in ``alpha`` ranks alike; it
shows how much the result depends on what the paper leaves open.

**Measures, all the toolkit's:** adaptive sharpness (worst case, l2; `sharpness.adaptive_sharpness`), geodesic
sharpness with the node metric (= the paper's ``inv`` metric; `sharpness.geodesic_sharpness`: horizontal ball,
second-order geodesics), the same with first-order geodesics (the paper's App. G ablation "second-order weight
corrections turned off"), and the top eigenvalues of the Euclidean Hessian and of the node quotient Hessian. Every
value is in mean-squared-error units; the paper's sum of squares multiplies each measure and the gap of every
network by ``n``, which changes no rank. The network is written as the paper writes it, ``x @ (u * v)``; the group
discovery finds the ``d`` scalings ``(u_i, v_i) -> (a u_i, v_i / a)`` of the product.

Run:  python examples/diagonal_networks.py [--out DIR]       # 2 x 50 networks, minutes on one core
      python examples/diagonal_networks.py --quick          # the first 2 networks, compared with the record
Writes ``DIR/diagonal_networks.json``. Exit status 1 when a check fails: the dense float64 references on a tiny
instance (`reference_checks`) and, with ``--quick``, every recomputed network against the committed record
(``docs/reproductions/diagonal_networks.json``) to `QUICK_TOL`.
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

N_TRAIN, N_TEST, DIM, NONZERO = 80, 1000, 200, 20
DATA_SEED = 0
NETWORKS, QUICK_NETWORKS = 50, 2
ALPHAS, LEARNING_RATES = (1e-2, 0.5), (5e-3, 3e-2)  # log-uniform ranges of the population
TRAIN_LOSS = 1e-5  # the paper's stopping loss, in its units: the sum of squared residuals
MAX_STEPS = 2_000_000
RHO = 0.1
QUICK_TOL = 1e-6  # a recomputed network's values against the record's (relative): rounding, not a change
N_BOOT = 1000
RECORD = Path(__file__).resolve().parent.parent / "docs" / "reproductions" / "diagonal_networks.json"
# (column, what it is); the measures whose tau is reported
MEASURES = {
    "adaptive": "worst-case adaptive sharpness (l2)",
    "geodesic": "geodesic sharpness (node metric = the paper's inv metric, second-order geodesics)",
    "geodesic_order1": "geodesic sharpness with first-order geodesics (App. G ablation)",
    "node_top": "top eigenvalue of the node quotient Hessian",
    "euclidean_top": "top eigenvalue of the Euclidean Hessian",
}
PAPER = {
    "networks": 50,
    "claims": [
        "all three notions of sharpness predict generalization (Sec. 5.1.1)",
        "geodesic sharpness does slightly better than adaptive sharpness: larger |tau| (Fig. 3 caption)",
        "both metrics (inv, mix) perform roughly the same",
        "the correlation is negative: adaptive sharpness anti-correlates with generalization (Sec. 7)",
    ],
    "taus": "printed only inside the image of Fig. 3; not in the text",
}
# the tiny instance of the dense references: not a critical point, so the geodesic's second-order term counts
REFERENCE_DIM, REFERENCE_SAMPLES, REFERENCE_RHO = 2, 3, 0.3
REFERENCE_TOL = 1e-8  # eigenvalues and the loss along the toolkit's own velocity (relative)
REFERENCE_SEARCH_TOL = 1e-4  # the default ascent (steps shrinking as 1/sqrt(t)) against the dense search (relative)


class DiagonalNetwork(nn.Module):
    """``x (batch, d) -> x^T (u * v)`` as ``(batch, 1)``, with parameters ``u`` and ``v`` ``(d,)``: the group discovery
    trades each ``u_i`` against ``v_i`` (the product is their only use)."""

    def __init__(self, dim: int):
        super().__init__()
        self.u = nn.Parameter(torch.zeros(dim))
        self.v = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.u * self.v)[:, None]

    @classmethod
    def of(cls, u: np.ndarray, v: np.ndarray) -> DiagonalNetwork:
        """The float64 network with weights ``u`` and ``v`` (``(d,)`` each), in eval mode."""
        model = cls(len(u)).double().eval()
        with torch.no_grad():
            model.u.copy_(torch.as_tensor(u))
            model.v.copy_(torch.as_tensor(v))
        return model


def synthetic_data(seed: int = DATA_SEED) -> dict[str, np.ndarray]:
    """``X (n, d)``, ``y (n,)``, ``X_test``, ``y_test`` and the 90%-sparse ``beta (d,)``, noiseless, from ``seed``."""
    rng = np.random.default_rng(seed)
    x, x_test = rng.standard_normal((N_TRAIN, DIM)), rng.standard_normal((N_TEST, DIM))
    beta = np.zeros(DIM)
    beta[rng.choice(DIM, NONZERO, replace=False)] = rng.standard_normal(NONZERO) / math.sqrt(NONZERO)
    return {"X": x, "y": x @ beta, "X_test": x_test, "y_test": x_test @ beta, "beta": beta}


def start(index: int, kind: str = "gaussian") -> dict:
    """Network ``index``'s initialization scale ``alpha``, learning rate and starting weights ``u0, v0 (d,)``.

    ``alpha`` and the learning rate are log-uniform, drawn from ``numpy.random.default_rng(1000 + index)`` (the same
    for both kinds); ``"gaussian"``: ``u0, v0`` have independent ``N(0, alpha^2)`` entries drawn next from the same
    generator; ``"pesme"``: ``u0 = sqrt(2) alpha``, ``v0 = 0`` (Pesme et al.'s start, ``beta = 0`` and
    ``u^2 - v^2 = 2 alpha^2``).
    """
    rng = np.random.default_rng(1000 + index)
    alpha = float(10 ** rng.uniform(*np.log10(ALPHAS)))
    lr = float(10 ** rng.uniform(*np.log10(LEARNING_RATES)))
    if kind == "gaussian":
        u0, v0 = alpha * rng.standard_normal(DIM), alpha * rng.standard_normal(DIM)
    else:
        u0, v0 = np.full(DIM, math.sqrt(2) * alpha), np.zeros(DIM)
    return {"alpha": alpha, "lr": lr, "u0": u0, "v0": v0}


def train(data: dict, u0: np.ndarray, v0: np.ndarray, lr: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Gradient descent on the mean squared error from ``(u0, v0)`` until the sum of squared residuals is at most
    `TRAIN_LOSS`; returns ``(u, v, steps)``.

    Raises:
        FloatingPointError: the loss stops being finite (learning rate too large for the scale).
        RuntimeError: `MAX_STEPS` pass without reaching the loss.
    """
    x, y = data["X"], data["y"]
    u, v = u0, v0
    for step in range(MAX_STEPS):
        r = x @ (u * v) - y
        loss = float(r @ r)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (learning rate {lr:.3g})")
        if loss <= TRAIN_LOSS:
            return u, v, step
        g = (2.0 / N_TRAIN) * (x.T @ r)  # gradient of the mean squared error in beta
        u, v = u - lr * g * v, v - lr * g * u
    raise RuntimeError(f"training did not reach loss {TRAIN_LOSS} in {MAX_STEPS} steps (learning rate {lr})")


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rho: float = RHO) -> dict[str, float]:
    """Every measure of `MEASURES` at ``model`` on the training data ``(x, y)`` (mean squared error)."""
    from sharpness import Objective, Solver, adaptive_sharpness, geodesic_sharpness, get_measure

    objective = Objective(model, nn.MSELoss(), (x, y))
    solver = Solver(tol=1e-10, seed=0)
    node = get_measure("node").sharpness(objective, 1, solver, progress=False)
    euclidean = get_measure("euclidean").sharpness(objective, 1, solver, progress=False)
    common = {"objective": objective, "eigen": node, "progress": False}
    return {
        "adaptive": adaptive_sharpness(None, None, None, rho, **common).value,
        "geodesic": geodesic_sharpness(None, None, None, rho, **common).value,
        "geodesic_order1": geodesic_sharpness(None, None, None, rho, order=1, **common).value,
        "node_top": node.value,
        "euclidean_top": euclidean.value,
    }


def network_row(data: dict, index: int, kind: str = "gaussian") -> dict:
    """Train network ``index`` from its ``kind`` of start and measure it: hyperparameters, steps, losses, gap (the
    test loss) and measures."""
    first = start(index, kind)
    hyper = {"alpha": first["alpha"], "lr": first["lr"]}
    u, v, steps = train(data, first["u0"], first["v0"], first["lr"])
    beta = u * v
    train_mse = float(np.mean((data["X"] @ beta - data["y"]) ** 2))
    test_mse = float(np.mean((data["X_test"] @ beta - data["y_test"]) ** 2))
    model = DiagonalNetwork.of(u, v)
    values = measure(model, torch.as_tensor(data["X"]), torch.as_tensor(data["y"])[:, None])
    return {"index": index, **hyper, "steps": steps, "train_loss": train_mse, "test_loss": test_mse,
            "gap": test_mse, "test_minus_train": test_mse - train_mse,
            "l1_error": float(np.abs(beta - data["beta"]).sum()), **values}  # fmt: skip


def correlations(rows: list[dict], n_boot: int = N_BOOT) -> list[dict]:
    """Kendall's tau-b of each measure with the gap, with its 95% bootstrap interval (`sharpness.study`'s)."""
    import pandas as pd

    from sharpness.study._stats import summarize

    table = summarize(pd.DataFrame(rows), list(MEASURES), [], gap="gap", n_boot=n_boot, seed=0)
    return [{"measure": r.measure, "tau": r.tau, "tau_low": r.tau_low, "tau_high": r.tau_high}
            for r in table.itertuples()]  # fmt: skip


def _reference_instance(seed: int = 0):
    """A tiny diagonal network away from any minimum (random weights and data), float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(REFERENCE_SAMPLES, REFERENCE_DIM, generator=g, dtype=torch.float64)
    y = torch.randn(REFERENCE_SAMPLES, 1, generator=g, dtype=torch.float64)
    u = torch.randn(REFERENCE_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(REFERENCE_DIM, generator=g, dtype=torch.float64)
    return x, y, u, v


def _loss_of_beta(x: torch.Tensor, y: torch.Tensor):
    return lambda beta: ((x @ beta - y[:, 0]) ** 2).mean()


def _reference_geodesic_max(x, y, u, v, rho: float, angles: int = 720, radii: int = 60) -> float:
    """The largest loss increase over the second-order horizontal geodesic ball of the node metric, by dense search.

    Written from the geometry, not from the toolkit: a horizontal velocity is ``(u b, v b)`` (``xi_u / u = xi_v / v``)
    of node-metric norm ``sqrt(2) ||b||``; the node metric's Christoffel term is ``-xi^2 / w``, so the second-order
    geodesic ends at ``(u, v) (1 + b + b^2 / 2)``, where ``beta = u v (1 + b + b^2 / 2)^2``. For ``d = 2`` the ball
    ``||b|| <= rho / sqrt(2)`` is a disc: a polar grid, then SLSQP (scipy, float64) from the grid's best point."""
    from scipy.optimize import minimize

    f = _loss_of_beta(x, y)
    beta0, r = u * v, rho / math.sqrt(2)
    f0 = f(beta0)
    theta = torch.linspace(0, 2 * math.pi, angles + 1, dtype=torch.float64)[:-1]
    circle = torch.stack([torch.cos(theta), torch.sin(theta)], 1)
    grid = torch.cat([radius * circle for radius in torch.linspace(0, r, radii + 1, dtype=torch.float64)[1:]])
    values = _batched(f, beta0, grid) - f0
    start = grid[int(values.argmax())].numpy()

    def negative(b):
        return -float(_batched(f, beta0, torch.as_tensor(b)[None, :])[0] - f0)

    found = minimize(negative, start, method="SLSQP", tol=1e-15,
                     constraints=[{"type": "ineq", "fun": lambda b: r * r - float(b @ b)}])  # fmt: skip
    return max(float(values.max()), -float(found.fun) if r * r - found.x @ found.x >= -1e-15 else -math.inf)


def _batched(f, beta0: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``f(beta0 (1 + b + b^2/2)^2)`` for each row of ``b (m, d)``."""
    s = 1 + b + b * b / 2
    return torch.func.vmap(f)(beta0 * s * s)


def reference_checks(seed: int = 0) -> list[dict]:
    """The toolkit's measures on a tiny diagonal network against dense float64 references written from the geometry.

    Away from a minimum (random weights and data, ``d = 2``):

    - the node quotient Hessian's eigenvalues against ``eig(1/2 d^2/db^2 L(u v exp(2 b)))`` at ``b = 0``
      (``torch.func.hessian``): the node metric is flat in ``log |w|``, where the scalings are translations, so the
      quotient Hessian is the Hessian along horizontal lines ``(b, b)``, of metric norm ``sqrt(2) ||b||``;
    - geodesic sharpness along its own best velocity ``xi``: ``xi`` horizontal (``xi_u / u = xi_v / v``), of
      metric norm at most ``rho``, and the loss it reports equal to the loss at ``(u, v) (1 + b + b^2/2)``,
      ``b = xi_u / u`` (the second-order geodesic written out; dropping its Christoffel term fails here);
    - the value against the dense search of the ball (`_reference_geodesic_max`), to `REFERENCE_SEARCH_TOL`: the
      ascent finds the maximum, not only a point of the ball.

    Returns one verdict dict (``check``, ``value``, ``bound``, ``passed``) per comparison."""
    from sharpness import Objective, Solver, geodesic_sharpness, get_measure

    x, y, u, v = _reference_instance(seed)
    model = DiagonalNetwork.of(u.numpy(), v.numpy())
    objective = Objective(model, nn.MSELoss(), (x, y))
    f = _loss_of_beta(x, y)
    name = f"tiny diagonal network (d = {REFERENCE_DIM}, {REFERENCE_SAMPLES} samples, not a minimum)"
    out = []

    hessian = torch.func.hessian(lambda b: f(u * v * torch.exp(2 * b)))(torch.zeros(REFERENCE_DIM, dtype=torch.float64))
    reference = torch.linalg.eigvalsh(hessian / 2).flip(0)
    solver = Solver(tol=1e-12, max_iter=300, seed=seed)
    node = get_measure("node").sharpness(objective, REFERENCE_DIM, solver, False)
    error = float((node.eigenvalues - reference).abs().max() / reference.abs().max())
    out.append({"model": name, "check": "node quotient Hessian eigenvalues against the dense float64 reference in log "
                "coordinates (relative)", "value": error, "bound": REFERENCE_TOL})  # fmt: skip

    geo = geodesic_sharpness(None, None, None, REFERENCE_RHO, objective=objective, progress=False)
    xi_u, xi_v = geo.velocity[:REFERENCE_DIM], geo.velocity[REFERENCE_DIM:]
    b = xi_u / u
    s = 1 + b + b * b / 2
    along = f(u * v * s * s) - f(u * v)
    norm = float(torch.sqrt((b**2).sum() * 2))
    error = max(float((xi_v / v - b).abs().max()) / max(float(b.abs().max()), 1e-300),
                abs(geo.value - float(along)) / abs(float(along)), max(0.0, norm - REFERENCE_RHO) / REFERENCE_RHO)
    out.append({"model": name, "check": "geodesic sharpness (node metric) along its own velocity: horizontal, inside "
                "the ball, and the loss of the second-order geodesic written out (relative)", "value": error,
                "bound": REFERENCE_TOL})  # fmt: skip

    best = _reference_geodesic_max(x, y, u, v, REFERENCE_RHO)
    out.append({"model": name, "check": "geodesic sharpness (node metric) against the dense search of the horizontal "
                "second-order geodesic ball (relative)", "value": abs(geo.value - best) / abs(best),
                "bound": REFERENCE_SEARCH_TOL})  # fmt: skip
    for c in out:
        c["passed"] = bool(c["value"] <= c["bound"])  # a NaN fails
    return out


def quick_checks(rows: list[dict], record: dict) -> list[dict]:
    """Each recomputed network's losses and measures against the record's same network (relative)."""
    recorded = {r["index"]: r for r in record["networks"]}
    out = []
    for row in rows:
        old = recorded[row["index"]]
        keys = ["train_loss", "test_loss", *MEASURES]
        error = max(abs(row[k] - old[k]) / max(abs(old[k]), 1e-300) for k in keys)
        error = error if row["steps"] == old["steps"] else math.inf
        out.append({"check": f"network {row['index']} (alpha {row['alpha']:.3g}, lr {row['lr']:.3g}): steps, losses "
                    "and every measure against the record (relative)", "value": error, "bound": QUICK_TOL})  # fmt: skip
    for c in out:
        c["passed"] = bool(c["value"] <= c["bound"])
    return out


def population(data: dict, count: int, kind: str) -> list[dict]:
    """Networks ``0 .. count - 1`` from their ``kind`` of start, each printed as it is measured."""
    rows = []
    for index in range(count):
        rows.append(network_row(data, index, kind))
        r = rows[-1]
        print(f"{kind} network {index:2d}: alpha {r['alpha']:.3g}, lr {r['lr']:.3g}, {r['steps']} steps, test loss "
              f"{r['test_loss']:.3e}, " + ", ".join(f"{k} {r[k]:.3e}" for k in MEASURES), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Hide & Seek Sec. 5.1.1 / Fig. 3: sharpness of diagonal networks "
                                     "against their generalization, Kendall's tau.")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("diagonal-out"), help="output folder (default: diagonal-out)")
    parser.add_argument("--quick", action="store_true",
                        help=f"only the first {QUICK_NETWORKS} networks, each compared with the committed record")
    parser.add_argument("--networks", type=int, help=f"networks (default {NETWORKS}, --quick {QUICK_NETWORKS})")
    parser.add_argument("--record", type=Path, default=RECORD, help="the record --quick compares with")
    parser.add_argument("--no-variant", action="store_true",
                        help="skip the second population (Pesme et al.'s deterministic start), which halves the run")
    args = parser.parse_args(argv)
    count = args.networks if args.networks is not None else (QUICK_NETWORKS if args.quick else NETWORKS)
    if count < 1:
        print("error: --networks must be at least 1", file=sys.stderr)
        return 2
    if args.quick and not args.record.is_file():
        print(f"error: --quick compares with the record {args.record}, which does not exist; run the full "
              "reproduction first", file=sys.stderr)  # fmt: skip
        return 2
    if args.quick and count > len(json.loads(args.record.read_text())["networks"]):
        print(f"error: --quick compares with the record's networks, and {args.record} has fewer than {count}; "
              "ask for fewer with --networks", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)  # 400 parameters: thread hand-offs cost more than they save
    started, cpu = time.perf_counter(), time.process_time()
    data = synthetic_data()
    rows = population(data, count, "gaussian")
    variant = None
    if not (args.quick or args.no_variant):
        networks = population(data, count, "pesme")
        variant = {"start": "pesme", "networks": networks, "correlations": correlations(networks)}
    verdicts = reference_checks()
    if args.quick:
        verdicts += quick_checks(rows, json.loads(args.record.read_text()))
    record = {
        "paper": PAPER,
        "settings": {"n_train": N_TRAIN, "n_test": N_TEST, "dim": DIM, "nonzero": NONZERO, "data_seed": DATA_SEED,
                     "networks": count, "alphas": ALPHAS, "learning_rates": LEARNING_RATES, "train_loss": TRAIN_LOSS,
                     "rho": RHO, "n_boot": N_BOOT, "quick_networks": QUICK_NETWORKS, "quick_tol": QUICK_TOL},
        "measures": MEASURES,
        "start": "gaussian",
        "networks": rows,
        "correlations": [] if args.quick or count < 2 else correlations(rows),  # a tau of 2 networks says nothing
        "checks": verdicts,
        "passed": all(c["passed"] for c in verdicts),
        "variant": variant,
        "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
    }  # fmt: skip
    for kind, found in (("gaussian", record["correlations"]), ("pesme", variant["correlations"] if variant else [])):
        for c in found:
            print(f"{kind} start: tau({c['measure']}, test loss) = {c['tau']:+.3f}  "
                  f"[{c['tau_low']:+.3f}, {c['tau_high']:+.3f}]")
    for c in verdicts:
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['check']}: {c['value']:.2e} <= {c['bound']:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "diagonal_networks.json"
    from sharpness.io import write_atomic

    write_atomic(path, json.dumps(record, indent=1))
    print(f"wrote {path} in {record['wall_seconds']:.0f} s")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
