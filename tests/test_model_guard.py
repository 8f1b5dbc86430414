"""The caller's model is left exactly as found by every public entry point that takes one: parameters bitwise,
the same Parameter objects in the same slots, requires_grad flags, buffers and every submodule's mode, on
success, on an exception raised mid-computation and on a KeyboardInterrupt (see tests/model_guard.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import mlp
from model_guard import assert_unchanged, snapshot
from torch import nn

import landscape
import manifolds
import sharpness

pytestmark = pytest.mark.filterwarnings("ignore:.*is in training mode:UserWarning")


def _shared_module() -> nn.Module:
    """One Linear called twice (``m.b2 = m.a``): one module object under two names."""
    m = nn.Sequential()
    m.i, m.r0, m.a, m.r1 = nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU()
    m.b2, m.r2, m.c = m.a, nn.ReLU(), nn.Linear(5, 3)
    return m


def _tied() -> nn.Module:
    """Two Linear modules holding one weight (``s[4].weight = s[2].weight``)."""
    s = mlp([4, 5, 5, 5, 3])
    s[4].weight = s[2].weight
    return s


def _frozen() -> nn.Module:
    s = mlp([4, 5, 5, 3])
    s[0].requires_grad_(False)
    return s


class _Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.5), nn.ReLU(), nn.Linear(5, 3))

    def forward(self, x):
        return self.head(self.backbone(x))


def _mixed_modes() -> nn.Module:
    """Training, with a frozen BatchNorm backbone in eval mode (``model.train(); model.backbone.eval()``)."""
    m = _Backbone()
    with torch.no_grad():
        m.backbone[1].running_mean.uniform_(-0.5, 0.5)
        m.backbone[1].running_var.uniform_(0.5, 2.0)
    m.train()
    m.backbone.eval()
    return m


class _Direct(nn.Module):
    """A module's weight also used directly by the forward (a get_attr node consumed by F.linear)."""

    def __init__(self):
        super().__init__()
        self.a, self.fc, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.fc(F.relu(self.a(x))))
        return self.c(F.relu(F.linear(h, self.fc.weight)))


MODELS = {"shared-module": _shared_module, "tied": _tied, "frozen": _frozen, "mixed-modes": _mixed_modes,
          "direct": _Direct}  # fmt: skip

_solver = sharpness.Solver(tol=1e-6)
_grid = landscape.Grid(steps=3)
ENTRY_POINTS = {
    **{
        f"measure:{name}": lambda m, f, d, name=name: sharpness.measure_sharpness(
            m, f, d, name, solver=_solver, progress=False
        )
        for name in sharpness.MEASURES
    },
    "euclidean_sharpness": lambda m, f, d: sharpness.euclidean_sharpness(m, f, d, solver=_solver, progress=False),
    "invariant_sharpness": lambda m, f, d: sharpness.invariant_sharpness(m, f, d, solver=_solver, progress=False),
    "adaptive_sharpness": lambda m, f, d: sharpness.adaptive_sharpness(
        m, f, d, 0.1, ascent=sharpness.Ascent(steps=2, restarts=1, samples=2), progress=False
    ),
    "epsilon_sharpness": lambda m, f, d: sharpness.epsilon_sharpness(m, f, d, 0.1, steps=2, progress=False),
    "verify_invariance": lambda m, f, d: sharpness.verify_invariance(
        m, f, d, ["euclidean", "node"], rescalings=sharpness.Rescalings(trials=1), progress=False
    ),
    "hessian_spectral_density": lambda m, f, d: sharpness.hessian_spectral_density(
        m, f, d, n_probes=2, n_steps=6, progress=False
    ),
    "loss_plane": lambda m, f, d: landscape.loss_plane(m, f, d, grid=_grid, progress=False),
    "loss_plane:loop": lambda m, f, d: landscape.loss_plane(
        m, f, d, grid=landscape.Grid(steps=3, strategy="loop"), progress=False
    ),
    "loss_line": lambda m, f, d: landscape.loss_line(m, f, d, grid=_grid, progress=False),
    "fixed_weight_planes": lambda m, f, d: landscape.fixed_weight_planes(m, f, d, (1.0,), grid=_grid, progress=False),
    "random_rescale": lambda m, f, d: manifolds.random_rescale(m, generator=torch.Generator().manual_seed(0)),
    "min_norm_gauge": lambda m, f, d: manifolds.min_norm_gauge(m),
    "gspace": lambda m, f, d: manifolds.GSpace(m).weights(manifolds.GSpace(m).coordinates()),
}
# entry points that never call the loss: an exception is injected through a forward pre-hook on the model
_WITHOUT_LOSS = {"random_rescale", "min_norm_gauge", "gspace"}


class _Injected(Exception):
    pass


class _RaisingLoss:
    """Cross-entropy that raises ``error`` on its ``at``-th call."""

    def __init__(self, error: BaseException | None, at: int = 3):
        self.error, self.at, self.calls = error, at, 0

    def __call__(self, out, y):
        self.calls += 1
        if self.error is not None and self.calls == self.at:
            raise self.error
        return F.cross_entropy(out, y)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)


def _run(entry: str, model: nn.Module, error: BaseException | None) -> None:
    data = _data()
    hook = None
    if error is not None and entry in _WITHOUT_LOSS:
        hook = model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(error))
    snap = snapshot(model)  # with the hook in place: removing it afterwards restores the original dict
    try:
        ENTRY_POINTS[entry](model, _RaisingLoss(error), data)
    except (_Injected, KeyboardInterrupt):
        assert error is not None
    except Exception:  # any other outcome (a refusal such as G-space of a non-chain): the model is still as found
        pass
    finally:
        if hook is not None:
            hook.remove()
    assert_unchanged(model, snap)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_leaves_the_model_as_found(entry, model_name):
    torch.manual_seed(0)
    _run(entry, MODELS[model_name](), None)


@pytest.mark.parametrize("error", [_Injected("injected"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("model_name", ["shared-module", "mixed-modes"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_leaves_the_model_as_found_when_interrupted(entry, model_name, error):
    torch.manual_seed(0)
    _run(entry, MODELS[model_name](), error)


def test_snapshot_sees_every_kind_of_change():
    """The helper itself: each change the guarantee excludes is caught."""
    changes = {
        "values": lambda m: m.a.weight.data.add_(1e-12),
        "object": lambda m: setattr(m.a, "weight", nn.Parameter(m.a.weight.detach().clone())),
        "plain tensor": lambda m: m.a._parameters.update(weight=m.a.weight.detach()),
        "requires_grad": lambda m: m.a.weight.requires_grad_(False),
        "buffer": lambda m: m.n.running_mean.add_(1.0),
        "mode": lambda m: m.n.train(not m.n.training),
    }
    for name, change in changes.items():
        m = nn.Sequential()
        m.a, m.n, m.b2 = nn.Linear(3, 3), nn.BatchNorm1d(3), None
        m.b2 = m.a
        snap = snapshot(m)
        assert_unchanged(m, snap)
        change(m)
        with pytest.raises(AssertionError):
            assert_unchanged(m, snap)
        assert name
