"""Invariance verdicts that respect the dtype: float32 verifies what float32 resolves, says where it cannot, and a
measure that is not invariant still fails in float32 (issue 36)."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from cases import make_case
from guards import HANG_GUARD_S
from safetensors.torch import save_file
from torch import nn

from sharpness import Euclidean, Rescalings, verify_invariance
from sharpness._specs import build_model, load_data
from sharpness.measures._verify import JITTER_FACTOR, RESOLVABLE, InvarianceReport, rounding_floor


@dataclass(frozen=True)
class _Boastful(Euclidean):
    """The Euclidean measure claiming invariances it does not have (a broken measure)."""

    name = "boastful"
    invariant_under = ("node", "layer")


def test_rounding_floor_is_sqrt_n_eps():
    assert rounding_floor(torch.float32, 10_000) == pytest.approx(100 * torch.finfo(torch.float32).eps)
    assert rounding_floor(torch.float64, 10_000) == pytest.approx(100 * torch.finfo(torch.float64).eps)


def _report(difference: float, noise: float, rtol: float = 1e-6) -> InvarianceReport:
    """A one-row report: an invariant-claiming metric that moved by ``difference``, with noise floor ``noise``."""
    return InvarianceReport(
        metrics=("node",), kinds=("layer",), claims={"node": ("layer",)}, original={"node": (1.0,)},
        rescaled={"node": {"layer": ((1.0 + difference,),)}}, relative_differences={"node": {"layer": (difference,)}},
        output_differences={"layer": (3e-7,)}, converged={"node": True}, rtol=rtol, trials=1, scale=1.0, k=1, seed=0,
        dtype="float32", method="lanczos", tol=noise / 2, noise={"node": {"layer": noise}}, rounding=noise / 2,
        tol_asked=1e-10,
    )  # fmt: skip


def test_verdict_tolerance_is_rtol_or_the_noise_floor_whichever_is_larger():
    """The issue's 4.3e-6 in float32 is rounding (floor 3.9e-5): invariant; 1e-3 is a real change: FAILED."""
    within = _report(4.3e-6, 3.9e-5)
    assert within.tolerance("node", "layer") == 3.9e-5 and within.verdict("node", "layer") == "invariant"
    assert within.passed
    table = within.table()
    assert "solver tol 1e-10 asked for is below what float32 resolves; raised to" in table
    assert "rtol 1e-06 is below the noise floor in float32" in table and "not resolvable in float32" in table
    beyond = _report(1e-3, 3.9e-5)
    assert beyond.verdict("node", "layer") == "FAILED" and beyond.outcome == "FAILED"
    # a floor under rtol leaves rtol in charge
    assert _report(4.3e-6, 1e-9).verdict("node", "layer") == "FAILED"


def test_a_floor_too_high_to_tell_is_unresolved_not_passed():
    rep = _report(1e-3, 2 * RESOLVABLE)
    assert rep.verdict("node", "layer") == "unresolved" and rep.outcome == "nothing to verify"
    assert "not resolvable in float32" in rep.table()
    # beyond even that floor it is a failure all the same
    assert _report(1.0, 2 * RESOLVABLE).verdict("node", "layer") == "FAILED"


def test_report_round_trips_with_its_noise_floor():
    rep = _report(4.3e-6, 3.9e-5)
    again = InvarianceReport.from_dict(rep.to_dict())
    assert again == rep and rep.to_dict()["tolerances"] == {"node": {"layer": 3.9e-5}}
    old = {k: v for k, v in rep.to_dict().items() if k not in ("noise", "rounding", "tol_asked")}  # older JSON
    assert InvarianceReport.from_dict(old).tolerance("node", "layer") == 1e-6


@pytest.fixture(scope="module")
def float32_problem():
    """A small MLP trained a few steps on a slice of digits, in float32 (as a user would train it)."""
    torch.manual_seed(0)
    X, y = load_data("digits")
    X, y = X[:120], y[:120]
    model = build_model("mlp:64-24-24-10")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(X), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), X, y


def test_float32_cli_verify_of_a_trained_mlp_passes(float32_problem, tmp_path):
    """The issue's command (`--metric node --metric layer --dtype float32`, one trial) exits 0 and says to what."""
    model, X, y = float32_problem
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    np.savez(tmp_path / "d.npz", X=X.numpy(), y=y.numpy())
    r = subprocess.run(
        [sys.executable, "-m", "sharpness", "verify", "--model", "mlp:64-24-24-10", "--checkpoint",
         str(tmp_path / "m.safetensors"), "--data", str(tmp_path / "d.npz"), "--trials", "1", "--metric", "node",
         "--metric", "layer", "--dtype", "float32", "--quiet", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "passed: every claimed invariance holds" in r.stdout and "FAILED" not in r.stdout
    assert "raised to" in r.stdout and "noise floor" in r.stdout  # the header says what tolerance was used
    report = InvarianceReport.from_dict(json.loads((tmp_path / "r.json").read_text()))
    n = sum(p.numel() for p in model.parameters())
    assert report.rounding == pytest.approx(math.sqrt(n) * torch.finfo(torch.float32).eps)
    assert report.tol == report.rounding and report.tol_asked == 1e-10
    for m, kind in report.checked:  # within a floor that still tells invariance from change
        assert report.max_relative_difference(m, kind) <= report.tolerance(m, kind) < RESOLVABLE
    assert report.verdict("layer", "node") == "changes"
    assert set(report.jitter) == {"node", "layer"}  # measured at weights perturbed by one rounding unit
    for m in report.metrics:
        assert all(report.noise[m][kind] >= JITTER_FACTOR * report.jitter[m] for kind in report.kinds)


def test_a_broken_measure_still_fails_in_float32(float32_problem):
    """Euclidean claiming invariance: it FAILS under the default rescalings, and under rescalings so small that it
    changes by only about 1e-3, far above the float32 floor (about 1e-5) but far below the O(1) of log-std 1."""
    model, X, y = float32_problem
    loud = verify_invariance(model, nn.CrossEntropyLoss(), (X, y), [_Boastful()], dtype=torch.float32,
                             rescalings=Rescalings(kinds="layer", trials=1), progress=False)  # fmt: skip
    assert loud.verdict("boastful", "layer") == "FAILED" and loud.outcome == "FAILED"
    quiet = verify_invariance(model, nn.CrossEntropyLoss(), (X, y), [_Boastful()], dtype=torch.float32,
                              rescalings=Rescalings(kinds="layer", trials=1, scale=1e-3), progress=False)  # fmt: skip
    change = quiet.max_relative_difference("boastful", "layer")
    assert 10 * quiet.tolerance("boastful", "layer") < change < 1e-1
    assert quiet.verdict("boastful", "layer") == "FAILED"


def test_float64_keeps_the_asked_tolerances():
    """In float64 nothing is raised: the solver tol and rtol are as asked, and the header says nothing about it."""
    rep = dataclasses.replace(_report(4.3e-6, 1e-9), dtype="float64", tol=1e-10, rounding=1e-12)
    assert "raised" not in rep.table() and "below the noise floor" not in rep.table()
    case = make_case("mlp_bias")
    real = verify_invariance(case.model, case.loss_fn, case.data, ["node"], rescalings=Rescalings("layer", 1),
                             progress=False)  # fmt: skip
    assert real.tol == 1e-10 and real.tolerance("node", "layer") == 1e-6 and real.rounding < 1e-13
    assert real.jitter == {}  # no perturbed copy in float64: its rounding is far below any rtol
