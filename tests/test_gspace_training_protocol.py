"""``examples/gspace_training.py`` trains as the thesis's code does, and its Fig. 4.1 claims come from the record.

The reference loop below follows the thesis's G-space formulas (Table 2.1, skeleton weights 1) and its
``GOptimizer``, which builds a new optimizer at every step, so G-Adam's every step is Adam's first."""

import copy
import json
import math

import pytest
import torch
from test_examples import EXAMPLES, load_example
from torch import nn


@pytest.fixture(scope="module")
def example():
    """The example, with subnormal floats flushed as its main() does (SGD from PyTorch's init is 15x slower
    without); restored to PyTorch's default afterwards."""
    torch.set_flush_denormal(True)
    yield load_example("gspace_training")
    torch.set_flush_denormal(False)


def _thesis_mask(index: int, rows: int, cols: int) -> torch.Tensor:
    """The thesis code's skeleton selection: identity blocks, tiled; the first layer's on its leading square."""
    ratio = max(rows, cols) // min(rows, cols) + 1
    if rows > cols:
        return torch.eye(cols).repeat(ratio, 1)[:rows]
    if index == 0:
        return torch.eye(max(rows, cols))[:rows, :cols]
    return torch.eye(min(rows, cols)).repeat(ratio, ratio)[:rows, :cols]


def _thesis_step(weights, grads, masks, lr, sign_like):
    """One G-space step in the thesis's coordinates: v_j = w_j (first-layer skeleton), v_h = w_h (other
    first-layer weights), v_i = w_i w_j[c] (later non-skeleton weights); dL/dv_j = dL/dw_j - psi / v_j with
    psi[c] = sum of w_i dL/dw_i over later non-skeleton weights leaving unit c, dL/dv_h = dL/dw_h,
    dL/dv_i = dL/dw_i / v_j[c]. A fresh Adam's step is lr g / (|g| + eps)."""
    first, grad_first = weights[0], grads[0].clone()
    vj = first.diagonal().clone()
    psi = sum((w * g * (1 - m)).sum(0) for w, g, m in zip(weights[1:], grads[1:], masks[1:]))
    grad_first.diagonal().sub_(psi / vj)

    def step(v, g):
        return v - lr * g / (g.abs() + 1e-8) if sign_like else v - lr * g

    new_first = step(first, grad_first)
    new_vj = new_first.diagonal()
    later = [
        torch.where(m.bool(), w, step(w * vj, g / vj) / new_vj) for w, g, m in zip(weights[1:], grads[1:], masks[1:])
    ]
    return [new_first, *later]


def _reference_run(example, label, lr, seed, data):
    """One epoch of ``label`` for one seed, written out plainly: the validation loss before and after."""
    X, y, X_val, y_val = data
    model = example.network(seed)
    in_gspace = label.startswith("G-")
    masks = [_thesis_mask(i, *p.shape).to(p.dtype) for i, p in enumerate(model.parameters())]
    weights = [p.detach().clone() for p in model.parameters()]
    if in_gspace:  # the thesis code's GSpace sets the skeleton to 1 when the G-optimizer is built
        weights = [w * (1 - m) + m for w, m in zip(weights, masks)]
    params = [w.requires_grad_(True) for w in weights]
    optimizer = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}[label](params, lr=lr) if not in_gspace else None

    def forward(ws, x):
        for w in ws[:-1]:
            x = torch.relu(x @ w.T)
        return x @ ws[-1].T

    def val(ws):
        with torch.no_grad():
            return sum(nn.functional.cross_entropy(forward(ws, xb), yb) for xb, yb in
                       zip(X_val.split(64), y_val.split(64))).item() / len(X_val.split(64))  # fmt: skip

    before = val(params)
    generator = torch.Generator().manual_seed(seed)
    for batch in torch.randperm(len(y), generator=generator).split(64):
        loss = nn.functional.cross_entropy(forward(params, X[batch]), y[batch])
        grads = torch.autograd.grad(loss, params)
        if optimizer is None:
            with torch.no_grad():
                new = _thesis_step([p.detach() for p in params], grads, masks, lr, label == "G-Adam")
            params = [w.requires_grad_(True) for w in new]
        else:
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
    return before, val(params)


@pytest.mark.parametrize(("label", "lr"), [("SGD", 0.1), ("Adam", 1e-3), ("G-SGD", 0.1), ("G-Adam", 1e-3)])
def test_training_follows_the_thesis_code(example, label, lr):
    """Each optimizer, initialization, batching and validation loss as the thesis code's, for one epoch."""
    data = example.digits()
    got = example.train(label, lr, data, 1, [3])["val_loss"][0]
    before, after = _reference_run(example, label, lr, 3, data)
    assert got[0].item() == pytest.approx(before, rel=1e-6)
    assert got[1].item() == pytest.approx(after, rel=1e-4)
    assert after != before  # the epoch moved the weights (SGD from the default init learns slowly)


def test_seeds_trained_together_equal_each_run_alone(example):
    data = example.digits()
    together = example.train("G-Adam (moments kept)", 1e-2, data, 1, [0, 5])["val_loss"]
    alone = example.train("G-Adam (moments kept)", 1e-2, data, 1, [5])["val_loss"]
    assert torch.equal(together[1], alone[0])


def _results(example, **best):
    """A small synthetic results dict: two rates, three seeds; ``best`` overrides ``{label: (at 0.1, at 0.01)}``."""
    base = {"SGD": (0.15, 0.8), "G-SGD": (0.16, 0.19), "Adam": (1.5, 0.1), "G-Adam": (2.0, 0.4),
            "G-Adam (moments kept)": (1.6, 0.09)} | best  # fmt: skip
    out = {}
    for label, values in base.items():
        out[label] = {}
        for lr, v in zip(("0.1", "0.01"), values):
            mean = [2.3, 1.0, v] if v < 1.0 else [2.3, v, v]
            out[label][lr] = {"mean": mean, "best": v, "best_epoch": 2, "at_best": [v - 0.01, v, v + 0.01],
                              "std": 0.01, "diverged": [None] * 3}  # fmt: skip
    return out


def test_claims_follow_the_numbers(example):
    """Each verdict comes from the results: the same claim flips when the numbers say otherwise."""
    settings = {"seeds": 3, "epochs": 2, "init": "thesis"}
    verdicts = {c["claim"][:30]: c["verdict"] for c in example.claims(_results(example), settings)}
    assert list(verdicts.values()) == ["agrees", "agrees", "agrees", "agrees", "cannot be tested here", "agrees",
                                       "agrees", "cannot be tested here"]  # fmt: skip
    flipped = example.claims(_results(example, **{"G-Adam": (2.0, 0.05), "G-SGD": (0.1, 0.15)}), settings)
    assert [c["verdict"] for c in flipped][:2] == ["does not agree", "does not agree"]
    assert "G-SGD - SGD = -0.050 (beyond 2 standard errors)" in flipped[0]["outcome"]
    assert [c["verdict"] for c in flipped][5:7] == ["does not agree", "does not agree"]


def test_the_page_states_the_recorded_claims(example, tmp_path):
    """docs/reproductions.md's Fig. 4.1 claims table is the claims of the committed record; a changed record
    changes the page."""
    table = load_example("reproduction_table")
    record = json.loads((table.DATA / "gspace_training.json").read_text())
    page = table.OUT.read_text()
    claims = example.claims(record["results"], record["settings"])
    for c in claims:
        assert f"| {c['claim']} | {c['measure']} | {c['outcome']} | {c['verdict']} |" in page
    moved = copy.deepcopy(record)
    for v in moved["results"]["G-Adam"].values():
        v["best"] = 1e-3
        v["mean"] = [1e-3] * len(v["mean"])
    data = tmp_path / "data"
    data.mkdir()
    for path in table.DATA.glob("*.json"):
        (data / path.name).write_text(path.read_text())
    (data / "gspace_training.json").write_text(json.dumps(moved))
    assert "G-Adam 0.001 ±" in table.render(data) and "G-Adam 0.001 ±" not in page
    assert math.isfinite(record["results"]["SGD"][f"{record['settings']['learning_rates'][0]:g}"]["best"])
    assert (EXAMPLES.parent / "docs" / "reproductions" / "gspace_training.png").is_file()


def test_the_quick_rerun_fails_when_a_score_moves_beyond_its_tolerance(example):
    """reproduction_table.py --check compares a fresh quick run with the record's quick scores: equal passes, a
    score moved by twice the tolerance (or missing) fails, naming the optimizer."""
    table = load_example("reproduction_table")
    recorded = json.loads((table.DATA / "gspace_training.json").read_text())["quick"]
    assert list(recorded) == list(example.OPTIMIZERS) and all(len(v) == 2 for v in recorded.values())
    assert all(c["passed"] for c in table.gspace_quick_verdicts(recorded, recorded, example.QUICK_TOL))
    moved = copy.deepcopy(recorded)
    moved["G-SGD"]["0.01"]["best"] *= 1 + 2 * example.QUICK_TOL
    half = copy.deepcopy(recorded)
    half["G-SGD"]["0.01"]["best"] *= 1 + example.QUICK_TOL / 2
    del moved["Adam"]["0.1"]
    failed = [c["check"] for c in table.gspace_quick_verdicts(moved, recorded, example.QUICK_TOL) if not c["passed"]]
    assert [f.split(":")[0] for f in failed] == ["quick G-SGD", "quick Adam"]
    assert all(c["passed"] for c in table.gspace_quick_verdicts(half, recorded, example.QUICK_TOL))


def test_the_convergence_claim_compares_how_far_each_falls_at_small_rates(example):
    results = _results(example)
    for label in results:  # a third, small rate: G-SGD falls from 2.5 to 0.9 in two epochs, the others by 0.01
        mean = [2.5, 1.0, 0.9] if label == "G-SGD" else [2.3, 2.295, 2.29]
        results[label]["0.001"] = {"mean": mean, "best": min(mean), "best_epoch": 2, "at_best": [min(mean)] * 3,
                                   "std": 0.0, "diverged": [None] * 3}  # fmt: skip
    settings = {"seeds": 3, "epochs": 2, "init": "thesis"}
    (claim,) = [c for c in example.claims(results, settings) if "converges much faster" in c["claim"]]
    assert claim["verdict"] == "agrees"
    assert claim["outcome"] == "lr 0.001: G-SGD falls 1.600 (reached at epoch 1), SGD 0.010 (not reached)"
    results["G-SGD"]["0.001"]["mean"] = [2.5, 2.5, 2.495]
    (claim,) = [c for c in example.claims(results, settings) if "converges much faster" in c["claim"]]
    assert claim["verdict"] == "does not agree"
