"""Each reproduction's own checks catch a wrong Hessian: under each mutant of the geometry (connection terms
dropped, the layer-wise metric scaled by a constant, a basis path's sign flipped in G-space, the geodesic's
second-order term dropped, which turns geodesic sharpness into its first-order limit) at least one check of
``examples/reproduction_table.py --check --reference-only`` fails, and without a mutant all pass."""

import contextlib
import io

import pytest
import torch
from test_examples import load_example

from manifolds import GSpace, LayerScaleQuotient, MetricQuotient, NodeScaleQuotient

METRIC_SCALE = 4.0  # the layer-wise metric multiplied by this: every eigenvalue divided by it, still invariant


def _layer_without_connection(self, egrad, ehvp, xi):
    return torch.where(self.sqrt_metric > 0, (self.block_norms**2)[self._block_id] * ehvp, 0.0)


def _node_without_connection(self, egrad):
    return torch.zeros_like(egrad)  # the (w g) xi term gone from every Hessian of the node quotient alike


def _scaled_layer_metric(init):
    def scaled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.sqrt_metric = self.sqrt_metric * METRIC_SCALE**0.5  # g -> c g, consistently everywhere it is used
        self.block_norms = self.block_norms / METRIC_SCALE**0.5

    return scaled


def _flipped_path(weight_coordinates):
    def flipped(self, params):
        coords, d = weight_coordinates(self, params)
        sign = torch.ones_like(coords[-1])
        sign.view(-1)[0] = -1.0  # the value of one output-layer basis path (not a chain root): v -> -v
        return [*coords[:-1], coords[-1] * sign], d

    return flipped


def _first_order_geodesic(self, xi, t=1.0):
    return self.point + t * xi  # the Christoffel term dropped: straight lines, adaptive sharpness's ball


MUTANTS = {
    "layer connection terms dropped": (LayerScaleQuotient, "connection_hessian", lambda _: _layer_without_connection),
    "node connection terms dropped": (NodeScaleQuotient, "connection_factor", lambda _: _node_without_connection),
    f"layer metric x{METRIC_SCALE:g}": (LayerScaleQuotient, "__init__", _scaled_layer_metric),
    "basis-path sign flipped in G-space": (GSpace, "_weight_coordinates", _flipped_path),
    "geodesic second-order term dropped": (MetricQuotient, "second_order_geodesic", lambda _: _first_order_geodesic),
}


# mutant -> the words one of which every check it fails names (the measure it breaks)
BREAKS = {
    "layer connection terms dropped": ("layer",),
    "node connection terms dropped": ("node",),
    f"layer metric x{METRIC_SCALE:g}": ("layer",),
    "basis-path sign flipped in G-space": ("gspace", "G-space"),
    "geodesic second-order term dropped": ("geodesic",),
}


def test_every_reference_check_passes_without_a_mutant():
    table = load_example("reproduction_table")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = table.main(["--check", "--reference-only"])
    lines = printed.getvalue().splitlines()
    assert status == 0 and lines[-1] == "23/23 checks pass" and "FAIL" not in printed.getvalue()
    assert {line.split(": ")[0].split(" (")[0] for line in lines[:-1]} == {
        "PASS  Tables 2-3", "PASS  gauge Fig. 2", "PASS  thesis Fig. 4.1", "PASS  Hide & Seek Fig. 3"}  # fmt: skip


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_a_reproduction_check(monkeypatch, mutant):
    """At least one check fails, and only checks of the measure the mutant breaks (none of the others)."""
    owner, attribute, make = MUTANTS[mutant]
    monkeypatch.setattr(owner, attribute, make(getattr(owner, attribute)))
    verdicts = load_example("reproduction_table").rerun(reference_only=True)
    failed = [c["check"] for c in verdicts if not c["passed"]]
    assert failed, mutant
    assert all(any(word in check for word in BREAKS[mutant]) for check in failed), failed


def test_check_exits_1_when_a_rerun_result_is_beyond_its_tolerance(monkeypatch):
    table = load_example("reproduction_table")
    verdict = {"check": "a number", "value": 2.0, "bound": 1.0, "passed": False}
    monkeypatch.setattr(table, "QUICK", {"a reproduction": (lambda out: [verdict], lambda: [verdict])})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert table.main(["--check"]) == 1
    assert printed.getvalue().splitlines() == ["FAIL  a reproduction: a number: 2.00e+00 <= 1.00e+00",
                                               "0/1 checks pass"]  # fmt: skip
    monkeypatch.setattr(table, "QUICK", {"a reproduction": (lambda out: [verdict | {"passed": True, "value": 0.5}],
                                                            lambda: [])})  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert table.main(["--check"]) == 0
