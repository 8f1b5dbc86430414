"""The eval-mode forward with BatchNorm folded into the layer it follows (sharpness.products._folded), and the
grid engines that run it (channels-last images, one point without vmap), against the model itself in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call

import landscape
from sharpness import Objective
from sharpness.products._folded import _scaled_layer, fold_batch_norms


class _Mixed(nn.Module):
    """Every case the folding meets: foldable pairs (conv without and with bias, BatchNorm with and without
    affine, Linear + BatchNorm1d, Conv1d), and pairs it must leave alone (a layer output used twice, batch
    statistics in eval mode, a BatchNorm of the input)."""

    def __init__(self):
        super().__init__()
        self.bn_in = nn.BatchNorm2d(3)  # no layer before it: kept
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, stride=2), nn.BatchNorm2d(4, affine=False)
        self.conv3, self.bn3 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)  # conv3's output is used twice: kept
        self.conv4, self.bn4 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False)  # kept
        self.conv5, self.bn5 = nn.Conv1d(4, 5, 3, padding=1, groups=1), nn.BatchNorm1d(5)
        self.fc1, self.bn6 = nn.Linear(5, 6), nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        h = self.bn1(self.conv1(self.bn_in(x))).relu()
        h = self.bn2(self.conv2(h)).relu()
        t = self.conv3(h)
        h = (self.bn3(t) + t).relu()
        h = self.bn4(self.conv4(h)).relu() + h
        h = self.bn5(self.conv5(h.flatten(2))).relu()
        h = self.bn6(self.fc1(h.mean(2))).relu()
        return self.fc2(h)


def _randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.num_features, generator=g, dtype=m.running_mean.dtype))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=m.running_var.dtype))
    return model.double().eval()


def _folds(module: fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is _scaled_layer for n in module.graph.nodes)


def test_folded_forward_equals_the_model_at_any_parameters():
    torch.manual_seed(0)
    model = _randomized(_Mixed())
    folded = fold_batch_norms(model, fx.symbolic_trace(model).graph)
    assert _folds(folded) == 4  # bn1, bn2, bn5, bn6; not bn_in, bn3 (conv3 used twice) nor bn4 (batch statistics)
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    buffers = dict(model.named_buffers())
    for seed in range(3):  # parameters other than the model's own: the fold is computed per call
        g = torch.Generator().manual_seed(seed)
        params = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
        expected = functional_call(model, (params, buffers), (x,))
        got = functional_call(folded, (params, buffers), (x,))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    names = {n for n, _ in (*folded.named_parameters(), *folded.named_buffers())}
    assert names <= {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
    assert "conv1.weight" in names and "bn1.running_var" in names  # the model's names, read per call


def test_nothing_to_fold():
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    assert fold_batch_norms(model, fx.symbolic_trace(model).graph) is None


def _conv_net() -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1, stride=2), nn.BatchNorm2d(6), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    )  # fmt: skip
    return _randomized(model, seed=3)


class _Viewed(nn.Module):
    """Features flattened by ``Tensor.view`` from a map of several pixels (no view exists on channels-last
    strides), after a BatchNorm with nothing to fold into."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn, self.conv2, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 3), \
            nn.Linear(8, 3)  # fmt: skip

    def forward(self, x):
        h = F.relu(self.conv2(self.bn(F.relu(self.conv1(x)))))
        return self.fc(h.view(h.size(0), -1))


@pytest.mark.parametrize("strategy", ["loop", "first-layer", "vmap"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("net", ["folded", "viewed"])
def test_grid_engines_equal_the_objective(strategy, batch, net):
    """Folded BatchNorms, channels-last images (through a model's own ``view``) and the single-point call against
    ``Objective.evaluate`` at each point, in float64 (the unfolded, standard-layout model)."""
    g = torch.Generator().manual_seed(4)
    X = torch.randn(11, 3, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (11,), generator=g)
    model = _conv_net() if net == "folded" else _randomized(_Viewed(), seed=6)
    obj = Objective(model, nn.CrossEntropyLoss(), (X, y), chunk_size=4)
    d = landscape.random_directions(obj.params, k=2, seed=0)
    coords = np.array([[0.0, 0.0], [0.4, -0.3], [-0.8, 0.5], [1.0, 1.0], [-0.2, -0.9]])
    grid = landscape.evaluate_grid(obj, d.vectors, coords, strategy=strategy, batch=batch, progress=False)
    theta = obj.layout.flatten(obj.params)
    for i, c in enumerate(coords):
        ref = obj.evaluate(theta + torch.as_tensor(c) @ d.vectors)
        assert grid.loss[i] == pytest.approx(ref["loss"], rel=1e-12)
        assert grid.accuracy[i] == ref["accuracy"]


def test_linear_on_sequences_keeps_the_batch_norm_axis():
    """A Linear on ``(n, L, features)`` with a BatchNorm1d over axis 1 (``L`` equal to the features, so the shapes
    alone do not tell): the BatchNorm normalizes positions, not the Linear's outputs, and the result is unchanged."""
    torch.manual_seed(5)
    model = _randomized(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2)))
    folded = fold_batch_norms(model, fx.symbolic_trace(model).graph)
    x = torch.randn(7, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)


class _Residual(nn.Module):
    """Every case of the in-place rewrite: ReLUs and additions on fresh layer outputs (rewritten), on the input, on
    a tensor read twice, on a view, on a parameter, a broadcast that would grow the fresh operand and a sum in a
    wider dtype (all left out of place, statically or at run time)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 1), nn.Conv2d(2, 1, 1)
        self.lin = nn.Linear(3, 3)
        self.shift = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, x):
        a = F.relu(self.conv1(x))  # in place
        b = torch.relu(self.conv2(a)) + a  # both in place
        twice = self.conv2(b)
        c = F.relu(twice) + twice  # read twice: its ReLU out of place, the sum into the ReLU's output
        d = c.relu() + self.shift  # relu in place; the sum adds into the ReLU's fresh output
        e = self.conv3(F.relu(x)) + d  # a (n, 1, H, W) convolution plus (n, 3, H, W): out of place at run time
        f = self.lin(e.mean((2, 3))) + torch.ones(3, dtype=torch.float64)  # float32 plus float64: out of place
        v = e.flatten(1)
        return f, F.relu(v), v.sum(1) + 1  # a view's ReLU: out of place


def test_in_place_activations_change_only_unshared_fresh_tensors():
    from landscape._inplace import _add_into, inplace_activations

    torch.manual_seed(7)
    model = _Residual().float()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float32)
    x0 = x.clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = model(x)
    module = inplace_activations(fx.symbolic_trace(model))
    targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.relu_) == 3 and targets.count(_add_into) == 5  # two fall back at run time
    with torch.no_grad():
        got = module(x)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert torch.equal(x, x0)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
