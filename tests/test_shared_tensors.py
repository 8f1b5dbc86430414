"""Tensors reached from several places (a module used twice, a weight tied between modules, a weight also read
directly by the forward) are identified by identity: the rescaling group makes every use of such a tensor scale
it the same way, random rescalings keep the function, and ``random_rescale`` refuses what it cannot keep."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cases import mlp
from torch import nn

import manifolds
import sharpness


def _tied() -> nn.Module:
    s = mlp([4, 6, 6, 6, 3])
    s[4].weight = s[2].weight
    return s


class _Direct(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.fc, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.fc(F.relu(self.a(x))))
        return self.c(F.relu(F.linear(h, self.fc.weight)))


def _shared_module() -> nn.Module:
    m = nn.Sequential()
    m.i, m.r0, m.a, m.r1 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU()
    m.b2, m.r2, m.c = m.a, nn.ReLU(), nn.Linear(6, 3)
    return m


class _TiedBias(nn.Module):
    """A bias tied to a BatchNorm's weight: both scale by their output channels, so those are tied."""

    def __init__(self):
        super().__init__()
        self.a, self.n, self.c = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)
        self.b = nn.Linear(6, 6)
        self.b.bias = self.n.weight

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.n(self.a(x))))))


# Free scales of the node-wise group, counted by hand. The input and the output are pinned.
EXPECTED = {
    # hidden outputs of layers 0, 2 and 4 (6 channels each); W2 = W4 must scale every entry the same way in both
    # uses, so the output channels of 2 and 4 share variables, and so do their inputs (outputs of 0 and 2): one
    # scale per channel across the three layers. (Before: 18, each use scaled independently; the function
    # changed by 170%.) The exact group has one more direction, a common offset s2 = s0 - c, s4 = s0 - 2c, which
    # no rule of the form "one output class minus one input class per entry" can express.
    "tied": (_tied, 6),
    # the forward reads fc.weight directly in F.linear, a Linear's rule with its own output variables: fc.weight
    # must scale the same way in both uses, so fc's rows are tied to the F.linear's rows and fc's columns (a's
    # output) to its columns (fc's output): one scale per channel across a, fc and the F.linear, 6. (Before any
    # rule for F.linear: 0, every channel the tensor touches pinned; before identity tracking: 6 with a's output
    # alone free, and the function changed by 7%.)
    "direct": (_Direct, 6),
    # i's output (6) and a's output (6); a's second call ties its input (a's output) to its first call's input
    # (i's output): 6. (Unchanged: the graph names the module once.)
    "shared-module": (_shared_module, 6),
    # a (pinned: it feeds a BatchNorm), n's affine output (6), b's output (6), tied by b.bias = n.weight: 6.
    "tied-bias": (_TiedBias, 6),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_free_scales_and_function_preserving_rescalings(name):
    build, dim = EXPECTED[name]
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(32, 4)
    group = manifolds.analyze(model).group
    assert group.dim == dim
    assert len({a.name for a in group.actions}) == len(group.actions)  # one action per tensor
    with torch.no_grad():
        out = model(x)
        for seed in range(3):
            twin = manifolds.random_rescale(model, generator=torch.Generator().manual_seed(seed))
            assert float((twin(x) - out).abs().max() / out.abs().max()) < 1e-10
            moved = max(float((p - q).abs().max()) for p, q in zip(twin.parameters(), model.parameters(), strict=True))
            assert (moved > 1e-3) == (dim > 0)  # a real rescaling whenever the group has one
            if name == "tied":
                assert twin[4].weight is twin[2].weight  # the copy keeps the tie


def test_verify_invariance_on_tied_weights_rescales_something():
    torch.manual_seed(0)
    model = _tied().eval()
    X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    report = sharpness.verify_invariance(
        model, nn.CrossEntropyLoss(), (X, y), ["euclidean", "node"], rescalings=sharpness.Rescalings(trials=2),
        progress=False,
    )  # fmt: skip
    assert report.passed
    assert max(report.output_differences["node"]) < 1e-10
    assert report.max_relative_difference("euclidean", "node") > 1e-3  # the copies were really rescaled


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, True, "1", None])
def test_random_rescale_refuses_a_bad_scale(scale):
    model = mlp([4, 5, 3])
    with pytest.raises(ValueError, match="scale"):
        manifolds.random_rescale(model, scale=scale)
    structure = manifolds.analyze(model)
    with pytest.raises(ValueError, match="scale"):
        manifolds.random_factors(structure, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        structure.group.random_log_scales(scale)


def test_random_rescale_refuses_other_bad_arguments():
    model = mlp([4, 5, 3])
    for kwargs in ({"generator": 0}, {"buffers": 1}, {"kind": "nodes"}, {"example_input": [[0.0] * 4]}):
        with pytest.raises(ValueError):
            manifolds.random_rescale(model, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_rescale_keeps_the_function_or_refuses(dtype):
    """Scales whose factors overflow or vanish in the dtype are refused; whatever is returned keeps the function
    to sqrt(eps) of the dtype on inputs other than the one the check uses."""
    torch.manual_seed(0)
    model = mlp([4, 8, 8, 8, 3]).to(dtype)
    x = torch.randn(64, 4, dtype=dtype)
    refused = 0
    for scale in (0.0, 1.0, 10.0, 40.0, 1000.0):
        for seed in range(3):
            try:
                twin = manifolds.random_rescale(model, scale=scale, generator=torch.Generator().manual_seed(seed))
            except ValueError as err:
                assert "range" in str(err) or "outputs" in str(err)
                refused += 1
                continue
            with torch.no_grad():
                change = float((twin(x) - model(x)).abs().max() / model(x).abs().max())
            assert change <= math.sqrt(torch.finfo(dtype).eps)
    assert refused >= 3  # scale 1000 at least: e^(1000 N(0, 1)) overflows both dtypes
