"""Grid points' forward passes compiled with ``torch.compile`` (``compile=True``): the same values as the objective
in float64, one point per batch, refusals before anything is computed, and one compiled-code cache per grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import make_case
from test_landscape import _cli  # the command-line runner of the landscape tests
from torch import nn
from torch._dynamo.utils import counters

import landscape
import landscape._compiled as compiled
from landscape._compiled import compiled_forward
from sharpness import Objective

pytestmark = pytest.mark.skipif(compiled._code_generator(torch.device("cpu")) is not None, reason="no C++ compiler")


class _Block(nn.Module):
    """A residual block with a projection shortcut and BatchNorms (folded in eval mode)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 6, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.short = nn.Conv2d(4, 6, 1, stride=2)

    def forward(self, x):
        return (self.bn2(self.conv2(self.bn1(self.conv1(x)).relu())) + self.short(x)).relu()


def _net(kind: str) -> nn.Module:
    """``resnet``: a BatchNorm after the first convolution, then a residual block; ``relu-first``: a ReLU right after
    it (applied with the first layer's combination); ``linear``: a Linear first layer and a BatchNorm1d (features
    rather than images, and not a plain chain of Linear and ReLU)."""
    torch.manual_seed(11)
    if kind == "linear":
        model = nn.Sequential(nn.Flatten(), nn.Linear(108, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    else:
        first = [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
        model = nn.Sequential(
            *(first if kind == "resnet" else first[::2]), _Block(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
        )  # fmt: skip
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model.double().eval()


def _problem(kind: str = "resnet"):
    g = torch.Generator().manual_seed(5)
    X = torch.randn(11, 3, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (11,), generator=g)
    return Objective(_net(kind), nn.CrossEntropyLoss(), (X, y), chunk_size=4)


COORDS = np.array([[0.0, 0.0], [0.4, -0.3], [-0.8, 0.5], [1.0, 1.0]])


CASES = [("first-layer", "resnet"), ("first-layer", "relu-first"), ("first-layer", "linear"), ("loop", "resnet")]


@pytest.mark.parametrize("strategy, kind", CASES)
def test_compiled_grid_equals_the_objective(strategy, kind):
    obj = _problem(kind)
    d = landscape.random_directions(obj.params, k=2, seed=0)
    graphs = counters["stats"]["unique_graphs"]
    # a budget of one byte keeps the data's chunks of 4, 4 and 3 samples as they are: two piece sizes
    grid = landscape.evaluate_grid(
        obj, d.vectors, COORDS, strategy=strategy, compile=True, memory_budget=1, progress=False
    )
    assert grid.compiled and grid.batch == 1 and grid.strategy == strategy
    assert counters["stats"]["unique_graphs"] - graphs == 2  # for 4 samples, then for any number
    theta = obj.layout.flatten(obj.params)
    for i, c in enumerate(COORDS):
        ref = obj.evaluate(theta + torch.as_tensor(c) @ d.vectors)
        assert grid.loss[i] == pytest.approx(ref["loss"], rel=1e-10)
        assert grid.accuracy[i] == ref["accuracy"]
    plain = landscape.evaluate_grid(obj, d.vectors, COORDS, strategy=strategy, progress=False)
    assert not plain.compiled


def test_compiled_gspace_plane_equals_the_plain_one():
    """A curved chart (G-space plane of a CNN: later layers from a point map, first layer linear in the
    coordinates) through ``loss_plane`` with ``Grid(compile=True)``."""
    case = make_case("cnn")
    spec = landscape.DirectionSpec("gspace", seed=3)
    kw = dict(directions=spec, progress=False)
    got = landscape.loss_plane(case.model, case.loss_fn, case.data, grid=landscape.Grid(0.5, 5, compile=True), **kw)
    plain = landscape.loss_plane(case.model, case.loss_fn, case.data, grid=landscape.Grid(0.5, 5), **kw)
    assert got.metadata["compiled"] and got.metadata["strategy"] == "first-layer" and got.metadata["grid_batch"] == 1
    assert not plain.metadata["compiled"]
    np.testing.assert_allclose(got.loss, plain.loss, rtol=1e-10, atol=0)
    np.testing.assert_array_equal(got.accuracy, plain.accuracy)


def test_a_chain_of_linear_layers_is_not_compiled_and_keeps_its_batches():
    """The first-layer path of an MLP runs batched matrix products: nothing to compile, batches as without."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double().eval()
    X, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    obj = Objective(model, nn.CrossEntropyLoss(), (X, y))
    d = landscape.random_directions(obj.params, k=2, seed=1)
    got = landscape.evaluate_grid(obj, d.vectors, COORDS, compile=True, progress=False)
    plain = landscape.evaluate_grid(obj, d.vectors, COORDS, progress=False)
    assert got.strategy == "first-layer" and not got.compiled and got.batch == plain.batch == len(COORDS)
    np.testing.assert_array_equal(got.loss, plain.loss)


def test_compile_is_refused_where_it_cannot_apply(monkeypatch):
    obj = _problem()
    d = landscape.random_directions(obj.params, k=2, seed=0)
    with pytest.raises(ValueError, match="strategy 'vmap' evaluates batches"):
        landscape.evaluate_grid(obj, d.vectors, COORDS, strategy="vmap", compile=True)
    with pytest.raises(ValueError, match="one grid point at a time; got batch=2"):
        landscape.evaluate_grid(obj, d.vectors, COORDS, batch=2, compile=True)
    with pytest.raises(ValueError, match="strategy 'vmap'"):
        landscape.Grid(strategy="vmap", compile=True)
    with pytest.raises(ValueError, match="compile must be True or False"):
        landscape.Grid(compile="yes")
    missing = "a C++ compiler (g++, or the one named by the environment variable CXX)"
    monkeypatch.setattr(compiled, "_code_generator", lambda device: missing)
    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler .* leave compile off"):
        landscape.evaluate_grid(obj, d.vectors, COORDS, compile=True)
    calls = []
    monkeypatch.setattr(landscape._surfaces, "make_chart", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler"):
        landscape.loss_plane(None, None, None, grid=landscape.Grid(steps=3, compile=True), objective=obj)
    assert calls == []  # refused before the directions


def test_every_compiled_forward_has_its_own_code():
    """torch.compile keeps compiled graphs per code object and stops compiling one after 8 recompilations: a
    shared closure would run the ninth grid of a session uncompiled."""
    modules = [nn.Linear(2, 2) for _ in range(3)]
    fns = [compiled_forward(m, {}) for m in modules]
    codes = {f._torchdynamo_orig_callable.__code__ for f in fns}
    assert len(codes) == 3
    x = torch.randn(4, 2)
    params = {n: p.detach() for n, p in modules[1].named_parameters()}
    torch.testing.assert_close(fns[1](params, x), modules[1](x))


def _cli_args(tmp_path) -> list[str]:
    from sharpness._specs import build_model

    torch.manual_seed(0)
    torch.save(build_model("mlp:6-5-3").state_dict(), tmp_path / "tiny.pt")
    return ["plane", "--model", "mlp:6-5-3", "--checkpoint", str(tmp_path / "tiny.pt"), "--data",
            "synthetic:n=40,dim=6,classes=3", "--out", str(tmp_path / "out"), "--steps", "3", "--quiet"]  # fmt: skip


def test_cli_compile_records_what_ran(tmp_path, capsys):
    code, _, err = _cli([*_cli_args(tmp_path), "--compile"], capsys)
    assert code == 0, err
    meta = landscape.Surface.load(tmp_path / "out" / "plane").metadata
    assert meta["strategy"] == "first-layer" and meta["compiled"] is False  # an MLP: batched products


def test_cli_compile_without_a_compiler_exits_2_before_any_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compiled, "_code_generator", lambda device: "a C++ compiler")
    code, stdout, err = _cli([*_cli_args(tmp_path), "--compile"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: compile=True needs a C++ compiler for torch.compile on this machine; install it or leave compile off"
    ]
    assert stdout == "" and not (tmp_path / "out").exists()
