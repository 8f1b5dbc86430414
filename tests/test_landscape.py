"""Loss landscapes: toy networks (exact gradients, G-space charts), directions, the grid evaluator's
fast path against a plain loop, surfaces on disk, and the command line."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cases import make_case, mlp
from guards import HANG_GUARD_S
from matplotlib.colors import LogNorm
from torch import nn

import landscape
from landscape import _toys as toys
from landscape._cli import main as cli_main
from landscape._grid import split_first_linear
from landscape._plot_mpl import contour_levels
from sharpness import Objective

# ---------------------------------------------------------------------------------------------
# toy networks


def _autograd(fn, *args):
    xs = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in args]
    return [g.item() for g in torch.autograd.grad(fn(*xs), xs)]


@pytest.mark.parametrize("seed", range(5))
def test_toy_gradients_match_autograd(seed):
    g = np.random.default_rng(seed)
    w = g.uniform(-3, 3, size=3)
    assert toys.grad_a(w[0]).item() == pytest.approx(_autograd(toys.loss_a, w[0])[0], abs=1e-14)
    pairs = ((toys.grad_b, toys.loss_b, 2), (toys.grad_a2, toys.loss_a2, 2), (toys.grad_b2, toys.loss_b2, 3))
    for analytic, fn, n in pairs:
        expected = _autograd(fn, *w[:n])
        assert [t.item() for t in analytic(*w[:n])] == pytest.approx(expected, abs=1e-14)
    # Fig. 4.9 in the thesis code: L = sin(0.3 y)
    for analytic, fn, n in pairs[1:]:
        expected = _autograd(lambda *a, fn=fn: fn(*a, gain=0.3), *w[:n])
        assert [t.item() for t in analytic(*w[:n], gain=0.3)] == pytest.approx(expected, abs=1e-14)


def test_fig_1_6_arrows_are_the_true_gradient_and_scale_as_one_over_alpha():
    s = toys.fig_1_6_surface(steps=5, source="text")
    pts, grads = s.extras["arrow_points"], s.extras["arrow_gradient"]
    assert np.array_equal(s.extras["arrow_vector"], grads) and s.metadata["source"] == "text"
    level, alpha = s.extras["arrow_level"], s.extras["arrow_alpha"]
    for p, g in zip(pts, grads):
        assert g == pytest.approx(_autograd(toys.loss_b, *p), abs=1e-14)
    assert pts[:, 0] * pts[:, 1] == pytest.approx(level)  # the points lie on their invariant lines
    # the gradient is normal to the line w1 w2 = c (tangent (w1, -w2)) ...
    assert grads[:, 0] * pts[:, 0] - grads[:, 1] * pts[:, 1] == pytest.approx(0, abs=1e-12)
    # ... and moving along it by alpha scales dL/dw1 by 1/alpha and dL/dw2 by alpha (thesis eq. 1.20)
    for c in np.unique(level):
        on = level == c
        base = grads[on & (alpha == 1.0)][0]
        assert grads[on, 0] * alpha[on] == pytest.approx(np.full(on.sum(), base[0]), rel=1e-12)
        assert grads[on, 1] / alpha[on] == pytest.approx(np.full(on.sum(), base[1]), rel=1e-12)
        assert abs(base[0]) > 0.1  # the drawn arrows are visible, not degenerate


def test_gspace_charts_reproduce_the_loss_and_undistort_it():
    g = torch.Generator().manual_seed(0)
    w = 4 * torch.rand(3, 200, generator=g, dtype=torch.float64) - 2
    v, s = toys.gspace_b(w[0], w[1])
    assert torch.allclose(toys.loss_b_gspace(v, s), toys.loss_b(w[0], w[1]), atol=1e-14)
    pos = w[1] > 0  # skeleton weight w2 > 0: network b in G-space is network a
    assert torch.allclose(toys.loss_b(w[0], w[1])[pos], toys.loss_a(v[pos]), atol=1e-14)
    v1, v2, s = toys.gspace_b2(w[0], w[1], w[2])
    assert torch.allclose(toys.loss_b2_gspace(v1, v2, s), toys.loss_b2(w[0], w[1], w[2]), atol=1e-14)
    pos = w[2] > 0  # skeleton weight w3 > 0: Fig. 4.9's network b in G-space is network a
    assert torch.allclose(toys.loss_b2(w[0], w[1], w[2])[pos], toys.loss_a2(v1[pos], v2[pos]), atol=1e-14)
    # invariance: a rescaling of the hidden unit changes the weights but not the G-space point
    alpha = 3.7
    assert torch.allclose(torch.stack(toys.gspace_b2(alpha * w[0], alpha * w[1], w[2] / alpha)[:2]),
                          torch.stack([v1, v2]), atol=1e-13)  # fmt: skip


@pytest.mark.parametrize(("source", "gain", "hi"), [("text", 1.0, 3.0), ("code", 0.3, 10.0)])
def test_fig_4_9_surfaces_are_reading_a_with_fixed_values(source, gain, hi):
    surfaces = toys.fig_4_9_surfaces(fixed=(1.0, 6.0), steps=7, source=source)
    assert [float(s.extras["fixed"]) for s in surfaces[1:]] == [1.0, 6.0]
    w1, w2 = np.meshgrid(surfaces[0].x, surfaces[0].y)
    assert surfaces[0].loss == pytest.approx(np.sin(np.maximum(w1 + w2, 0)), abs=1e-14)  # (a): no gain in either
    for s in surfaces:
        assert (s.x[0], s.x[-1], s.y[0], s.y[-1]) == (0.0, hi, 0.0, hi)
        assert s.metadata["source"] == source and s.metadata["window"] == [0.0, hi]
    for s in surfaces[1:]:
        assert "reading (a)" in s.title
        b = float(s.extras["fixed"])
        w2, w3 = np.meshgrid(s.x, s.y)
        assert s.loss == pytest.approx(np.sin(gain * w3 * np.maximum(b + w2, 0)), abs=1e-14)
    assert toys.fig_4_9_surfaces(steps=7)[1].metadata["source"] == "code"  # the thesis code's figure by default


def test_fig_1_6_code_arrows_are_the_thesis_codes_and_parallel_to_the_gradient():
    s = toys.fig_1_6_surface(steps=5, source="code")
    pts, drawn, grads = s.extras["arrow_points"], s.extras["arrow_vector"], s.extras["arrow_gradient"]
    np.testing.assert_allclose(drawn, -0.1 * np.stack([pts[:, 1], pts[:, 0]], -1), rtol=0, atol=1e-15)
    # on the line w1 w2 = c (w1 > 0) the true gradient is cos(c) (w2, w1): the code's arrow is -0.1 / cos(c) times it
    live = pts[:, 0] > 0
    assert live.sum() == 30  # the code's grid {0, 2, ..., 10}^2 without its column w1 = 0
    factor = -0.1 / np.cos(s.extras["arrow_level"][live])
    np.testing.assert_allclose(drawn[live], factor[:, None] * grads[live], rtol=1e-12)
    assert "−∇(0.1 w₁w₂)" in s.title and "-grad(0.1 w1 w2)" in s.metadata["arrows"]


# ---------------------------------------------------------------------------------------------
# directions


@pytest.mark.parametrize("name", ["mlp_bias", "cnn"])
def test_filter_normalization_matches_row_and_filter_norms(name):
    case = make_case(name)
    theta = {k: p.detach() for k, p in case.model.named_parameters()}
    d = landscape.random_directions(theta, k=2, seed=3, norm="filter", bias="zero")
    layout = Objective(case.model, case.loss_fn, case.data).layout
    for vec in d.vectors:
        for key, t in layout.unflatten(vec).items():
            if t.dim() == 1:
                assert torch.count_nonzero(t) == 0  # biases zeroed
            else:
                assert torch.allclose(t.flatten(1).norm(dim=1), theta[key].flatten(1).norm(dim=1), rtol=1e-12)
    assert d.info == {"seeds": [3, 4], "normalization": "filter", "bias": "zero", "distribution": "gaussian"}
    kept = landscape.random_directions(theta, k=1, seed=3, norm="layer", bias="keep")
    for key, t in layout.unflatten(kept.vectors[0]).items():
        assert float(t.norm()) == pytest.approx(float(theta[key].norm()), rel=1e-12)


def test_eigen_direction_curvature_is_the_eigenvalue():
    case = make_case("mlp_bias")
    s = landscape.loss_line(case.model, case.loss_fn, case.data, "eigen", grid=landscape.Grid(span=1e-3, steps=3),
                            progress=False)  # fmt: skip
    h = s.x[2]
    curvature = (s.loss[0] - 2 * s.loss[1] + s.loss[2]) / h**2
    assert curvature == pytest.approx(s.metadata["directions"]["eigenvalues"][0], rel=1e-4)


# ---------------------------------------------------------------------------------------------
# grid evaluation


def test_grid_axis_contains_anchors():
    assert 0.0 in landscape.grid_axis(-1, 1, 5)
    even = landscape.grid_axis(-1, 1, 4)
    assert 0.0 in even and len(even) == 5
    seg = landscape.grid_axis(-0.5, 1.5, 41, anchors=(0.0, 1.0))
    assert 0.0 in seg and 1.0 in seg and len(seg) == 41
    with pytest.raises(ValueError, match="positive"):
        landscape.grid_axis(-1, 1, 0)


def _flatten_mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), *mlp([12, 5, 3])).double().eval()


def _grid_problem(name: str, dtype: torch.dtype):
    if name in ("resnet", "shared"):  # read off the traced graph: BatchNorm and residuals, a module used twice
        from test_group_zoo import build

        model, x, y, *_ = build(name)
        return model.to(dtype), nn.CrossEntropyLoss(), (x.to(dtype), y)
    if name == "flatten_mlp":
        g = torch.Generator().manual_seed(2)
        model = _flatten_mlp().to(dtype)
        data = (torch.randn(13, 3, 4, generator=g, dtype=dtype), torch.randint(0, 3, (13,), generator=g))
        return model, nn.CrossEntropyLoss(), data
    case = make_case(name, dtype=dtype)
    return case.model, case.loss_fn, case.data


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["mlp_bias", "cnn", "mlp_mse_sum", "flatten_mlp", "resnet", "shared"])
def test_fast_path_equals_plain_loop(name, dtype):
    model, loss_fn, data = _grid_problem(name, dtype)
    obj = Objective(model, loss_fn, data, chunk_size=5)  # several data chunks
    assert split_first_linear(obj) is not None
    d = landscape.random_directions(obj.params, k=2, seed=0)
    coords = np.stack(np.meshgrid(np.linspace(-1, 1, 5), np.linspace(-0.7, 0.9, 4)), -1).reshape(-1, 2)
    fast = landscape.evaluate_grid(obj, d.vectors, coords, strategy="first-layer", batch=3, progress=False)
    loop = landscape.evaluate_grid(obj, d.vectors, coords, strategy="loop", progress=False)
    vmapped = landscape.evaluate_grid(obj, d.vectors, coords, strategy="vmap", batch=7, progress=False)
    assert fast.strategy == "first-layer"
    np.testing.assert_allclose(fast.loss, loop.loss, rtol=1e-6, atol=0)
    np.testing.assert_allclose(vmapped.loss, loop.loss, rtol=1e-6, atol=0)
    # the loop itself against the objective's own evaluation at a few points
    for i in (0, 7, len(coords) - 1):
        ref = obj.evaluate(obj.layout.flatten(obj.params) + torch.as_tensor(coords[i], dtype=dtype) @ d.vectors)
        assert loop.loss[i] == pytest.approx(ref["loss"], rel=1e-6)
        if "accuracy" in ref:
            assert fast.accuracy[i] == ref["accuracy"] == loop.accuracy[i]


_MLP_LOSSES = {
    "ce_weighted_smoothed_ignored": lambda w: nn.CrossEntropyLoss(
        weight=w, label_smoothing=0.1, ignore_index=1, reduction="sum"
    ),
    "ce_smoothed_mean": lambda w: nn.CrossEntropyLoss(label_smoothing=0.2),
    "nll_weighted": lambda w: nn.NLLLoss(weight=w, reduction="sum"),
    "mse_on_one_hot": None,
}


@pytest.mark.parametrize("loss_name", list(_MLP_LOSSES))
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_fast_path_losses_equal_the_loop_in_float64(loss_name, bias):
    """The MLP fast path computes class losses in a (points, classes, samples) layout: every option of
    CrossEntropyLoss / NLLLoss must give the loop's values, and other losses take the general route."""
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    model = mlp([6, 7, 5, 4], bias=bias).double().eval()
    X = torch.randn(23, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (23,), generator=g)
    make = _MLP_LOSSES[loss_name]
    if make is None:
        loss_fn, data = nn.MSELoss(), (X, nn.functional.one_hot(y, 4).double())
    else:
        loss_fn, data = make(torch.rand(4, generator=g, dtype=torch.float64) + 0.5), (X, y)
    obj = Objective(model, loss_fn, data, chunk_size=9)
    d = landscape.random_directions(obj.params, k=2, seed=1)
    coords = np.stack(np.meshgrid(np.linspace(-1, 1, 4), np.linspace(-0.5, 1, 3)), -1).reshape(-1, 2)
    fast = landscape.evaluate_grid(obj, d.vectors, coords, strategy="first-layer", batch=5, progress=False)
    loop = landscape.evaluate_grid(obj, d.vectors, coords, strategy="loop", progress=False)
    np.testing.assert_allclose(fast.loss, loop.loss, rtol=1e-12, atol=0)
    if make is None:
        assert fast.accuracy is None and loop.accuracy is None
    else:
        np.testing.assert_array_equal(fast.accuracy, loop.accuracy)


def test_mlp_fast_path_accuracy_breaks_ties_like_argmax():
    """With all outputs equal every class ties: argmax picks class 0, so the accuracy is the share of 0s."""
    model = mlp([3, 4, 3]).double().eval()
    with torch.no_grad():
        model[-1].weight.zero_()
        model[-1].bias.zero_()
    X, y = torch.randn(10, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 2, 1])
    obj = Objective(model, nn.CrossEntropyLoss(), (X, y))
    d = landscape.random_directions(obj.params, k=1, seed=0, norm="none", bias="keep")
    first = obj.layout.unflatten(d.vectors[0])
    only_first = torch.cat([(t if k.startswith("0.") else torch.zeros_like(t)).flatten() for k, t in first.items()])
    values = landscape.evaluate_grid(obj, only_first[None], np.array([[0.0], [0.7]]), strategy="first-layer",
                                     progress=False)  # fmt: skip
    assert values.accuracy.tolist() == [0.3, 0.3]
    assert values.loss == pytest.approx([math.log(3)] * 2, rel=1e-14)


def test_auto_strategy_reads_the_graph_and_falls_back_where_there_is_none():
    class Wrapped(nn.Module):  # not an nn.Sequential, but its traced graph is a chain: the fast path applies
        def __init__(self):
            super().__init__()
            self.net = mlp([3, 4, 2]).double()

        def forward(self, x):
            return self.net(x)

    class Untraceable(Wrapped):  # data-dependent control flow: no graph, so the plain loop
        def forward(self, x):
            return self.net(x) if x.sum() > -1e9 else -self.net(x)

    X, y = torch.randn(9, 3, dtype=torch.float64), torch.randint(0, 2, (9,))
    wrapped = Objective(Wrapped().eval(), nn.CrossEntropyLoss(), (X, y))
    d = landscape.random_directions(wrapped.params, k=1)
    coords = np.array([[0.0], [0.5]])
    fast = landscape.evaluate_grid(wrapped, d.vectors, coords, progress=False)
    loop = landscape.evaluate_grid(wrapped, d.vectors, coords, strategy="loop", progress=False)
    assert fast.strategy == "first-layer"
    np.testing.assert_allclose(fast.loss, loop.loss, rtol=1e-13, atol=0)

    obj = Objective(Untraceable().eval(), nn.CrossEntropyLoss(), (X, y))
    values = landscape.evaluate_grid(obj, d.vectors, coords, progress=False)
    assert values.strategy == "loop"
    assert values.loss[0] == pytest.approx(obj.evaluate()["loss"], rel=1e-14)
    with pytest.raises(ValueError, match="first-layer fast path"):
        landscape.evaluate_grid(obj, d.vectors, np.array([[0.0]]), strategy="first-layer")


@pytest.mark.parametrize("steps", [5, 6])
def test_plane_contains_center_and_leaves_model_untouched(steps):
    case = make_case("cnn")
    before = copy.deepcopy(case.model.state_dict())
    case.model.train()  # the surface is evaluated in eval mode and the mode is given back
    with pytest.warns(UserWarning, match="training mode"):
        s = landscape.loss_plane(case.model, case.loss_fn, case.data, grid=landscape.Grid(span=0.5, steps=steps),
                                 progress=False)
    assert case.model.training
    case.model.eval()
    i, j = s.center_index()
    exact = Objective(case.model, case.loss_fn, case.data).evaluate()
    assert s.loss[i, j] == pytest.approx(exact["loss"], rel=1e-12)
    assert s.accuracy[i, j] == exact["accuracy"]
    assert s.metadata["center_loss"] == pytest.approx(exact["loss"], rel=1e-14)
    assert s.loss.shape == (len(s.y), len(s.x)) == ((steps | 1), (steps | 1))
    for key, value in case.model.state_dict().items():
        assert torch.equal(value, before[key])


def test_segment_line_hits_both_checkpoints():
    a, b = make_case("mlp_bias", seed=0), make_case("mlp_bias", seed=1)
    s = landscape.loss_line(a.model, a.loss_fn, a.data, to=b.model, grid=landscape.Grid(steps=41), progress=False)
    assert s.x[0] == -0.5 and s.x[-1] == 1.5
    end = Objective(b.model, a.loss_fn, a.data).evaluate()["loss"]
    assert s.loss[np.flatnonzero(s.x == 1.0)[0]] == pytest.approx(end, rel=1e-12)
    assert s.loss[np.flatnonzero(s.x == 0.0)[0]] == pytest.approx(s.metadata["center_loss"], rel=1e-12)


def test_surface_npz_json_round_trip(tmp_path):
    case = make_case("mlp_bias")
    s = landscape.loss_plane(case.model, case.loss_fn, case.data, directions=landscape.DirectionSpec(seed=7),
                             grid=landscape.Grid(steps=3), progress=False)
    npz, meta = s.save(tmp_path / "plane")
    back = landscape.Surface.load(tmp_path / "plane")
    for field in ("x", "y", "loss", "accuracy"):
        np.testing.assert_array_equal(getattr(back, field), getattr(s, field))
    assert back.metadata["directions"]["seeds"] == [7, 8]
    assert back.metadata["directions"]["normalization"] == "filter"
    assert (back.x_label, back.y_label, back.title) == (s.x_label, s.y_label, s.title)
    assert json.loads(meta.read_text())["kind"] == "plane"
    line = toys.fig_1_5_surfaces(steps=5)[0]
    line.save(tmp_path / "curve")
    again = landscape.Surface.load(tmp_path / "curve.npz")
    assert again.is_line and np.array_equal(again.loss, line.loss)


def test_figures_in_every_format_with_a_shared_log_scale(tmp_path):
    loss = np.geomspace(1e-3, 10, 20).reshape(4, 5)
    a = landscape.Surface(x=np.linspace(-1, 1, 5), y=np.linspace(-1, 1, 4), loss=loss)
    b = a.replace(loss=a.loss * 3)
    fig = landscape.surface_figure([a, b], kinds=("contour", "heatmap"), log=True, title="two panels")
    paths = landscape.save_figure(fig, tmp_path / "panels", ("png", "pdf", "svg"))
    assert [p.suffix for p in paths] == [".png", ".pdf", ".svg"] and all(p.stat().st_size > 1000 for p in paths)
    assert not list(tmp_path.glob(".tmp-*"))  # atomic writes leave no temporary files
    with pytest.raises(ValueError, match="positive loss"):
        landscape.surface_figure([a.replace(loss=a.loss - 1)], log=True)
    # a narrow log range (2.3 to 4.5: no 1-2-5 level inside) gets round levels of the linear scale
    narrow = a.replace(loss=np.linspace(2.3, 4.5, 20).reshape(4, 5))
    landscape.surface_figure([narrow], kinds=("contour",), log=True)
    levels = contour_levels(LogNorm(2.3, 4.5))
    assert len(levels) >= 5 and levels[0] <= 2.3 and levels[-1] >= 4.5 and np.all(levels > 0)


@pytest.mark.parametrize("line_color", ["k", "white"])
def test_contour_labels_carry_a_halo_of_the_opposite_shade(line_color):
    """Labels stay readable on the darkest and the lightest fill: dark labels get a light halo, light ones a
    dark halo (a halo of the label's own shade would hide it)."""
    import matplotlib.pyplot as plt
    from matplotlib import patheffects

    from landscape._plot_mpl import label_contours

    x = np.linspace(-1, 1, 41)
    loss = x[:, None] ** 2 + x[None, :] ** 2
    fig, ax = plt.subplots()
    ax.contourf(x, x, loss, levels=8, cmap="viridis")
    lines = ax.contour(x, x, loss, levels=[0.2, 0.5, 0.9], colors=line_color)
    labels = label_contours(ax, lines, (-1, 1), (-1, 1), fmt="%g")
    assert labels
    for text in labels:
        (halo,) = text.get_path_effects()
        assert isinstance(halo, patheffects.withStroke)
        assert halo._gc["foreground"] == ("white" if line_color == "k" else "black")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_toy_writes_promised_files(tmp_path, capsys):
    code, out, _ = _cli(["toy", "--figure", "4.9", "--source", "text", "--fixed", "1", "6", "--steps", "9", "--out",
                         str(tmp_path), "--quiet"], capsys)  # fmt: skip
    assert code == 0 and out == ""
    for name in ("fig4_9.png", "fig4_9.html", "fig4_9_a.npz", "fig4_9_b_fixed1.npz",
                 "fig4_9_b_fixed6.npz", "fig4_9_b_fixed6.json"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    with np.load(tmp_path / "fig4_9_b_fixed6.npz") as f:
        x, y, loss, fixed = f["x"], f["y"], f["loss"], f["fixed"]
    assert float(fixed) == 6.0 and loss.shape == (len(y), len(x))
    assert loss[3, 5] == pytest.approx(math.sin(y[3] * max(6.0 + x[5], 0.0)), abs=1e-14)  # loss[i, j] at x[j], y[i]
    assert "plotly" in (tmp_path / "fig4_9.html").read_text()[:20000].lower()


def _checkpoint(tmp_path, seed=0):
    from sharpness._specs import build_model

    torch.manual_seed(seed)
    path = tmp_path / f"tiny{seed}.pt"
    torch.save(build_model("mlp:6-5-3").state_dict(), path)
    return path


def test_cli_plane_and_segment_write_files(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "out"
    common = ["--model", "mlp:6-5-3", "--checkpoint", str(ckpt), "--data", "synthetic:n=40,dim=6,classes=3",
              "--out", str(out), "--quiet", "--dtype", "float64"]  # fmt: skip
    code, _, err = _cli(["plane", *common, "--steps", "5", "--span", "0.5"], capsys)
    assert code == 0, err
    for name in ("plane.npz", "plane.json", "plane.png", "plane.html"):
        assert (out / name).stat().st_size > 0, name
    s = landscape.Surface.load(out / "plane")
    assert s.loss.shape == (5, 5) and s.metadata["model"] == "mlp:6-5-3"
    assert s.loss[2, 2] == pytest.approx(s.metadata["center_loss"], rel=1e-12)
    code, _, err = _cli(["line", *common, "--to", str(_checkpoint(tmp_path, 1)), "--steps", "9", "--name", "seg"],
                        capsys)  # fmt: skip
    assert code == 0, err
    seg = landscape.Surface.load(out / "seg")
    assert 0.0 in seg.x and 1.0 in seg.x and (out / "seg.png").exists()


@pytest.mark.parametrize(
    "change",
    [
        {"--checkpoint": "missing.pt"},
        {"--directions": "sideways"},
        {"--steps": "0"},
        {"--steps": "-3"},
        {"--data": "synthetic:n=40,dim=7,classes=3"},
        {"--name": "sub/plane"},
        {"--name": ".."},
        {"--steps": "200000"},  # 4e10 points: terabytes of results, refused before anything is computed
        {"--memory-mib": "99999999999999999999"},  # more bytes than an integer of the allocator holds
    ],
)
def test_cli_bad_input_exits_2_with_one_line_and_no_output(tmp_path, capsys, change):
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "out"
    args = {"--model": "mlp:6-5-3", "--checkpoint": str(ckpt), "--data": "synthetic:n=40,dim=6,classes=3",
            "--out": str(out)}  # fmt: skip
    args.update(change)
    code, stdout, err = _cli(["plane", *[t for kv in args.items() for t in kv], "--quiet"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("command", ["plane", "fixed"])
def test_cli_outputs_never_replace_an_input(tmp_path, capsys, command):
    ckpt = _checkpoint(tmp_path)
    X, y = torch.randn(40, 6), torch.arange(40) % 3
    np.savez(tmp_path / "data.npz", X=X.numpy(), y=y.numpy())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    # the plane's own data file under --out, or the checkpoint as one of the per-value surfaces
    name, clash = ("data", "data.npz") if command == "plane" else ("ckpt", "ckpt_b1.npz")
    if command == "fixed":
        ckpt = ckpt.rename(tmp_path / clash)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    argv = [command, "--model", "mlp:6-5-3", "--checkpoint", str(ckpt), "--data", str(tmp_path / "data.npz"),
            "--out", str(tmp_path), "--name", name, "--steps", "3", "--quiet"]  # fmt: skip
    code, _, err = _cli(argv + (["--values", "1"] if command == "fixed" else []), capsys)
    assert code == 2 and f"the output {tmp_path / clash} is one of the inputs" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cli_toy_rejects_fixed_for_other_figures(tmp_path, capsys):
    code, _, err = _cli(["toy", "--figure", "1.5", "--fixed", "2", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--fixed" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cli_process_missing_checkpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "landscape", "line", "--model", "mlp:6-5-3", "--checkpoint", str(tmp_path / "no.pt"),
         "--data", "synthetic:n=10,dim=6,classes=3", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: checkpoint {tmp_path / 'no.pt'} does not exist"]
    assert not (tmp_path / "o").exists()


def _landscape(tmp_path, *args, **options) -> subprocess.CompletedProcess:
    """``python -m landscape plane`` on a tiny checkpoint in a subprocess (``args``: str or bytes)."""
    argv = ["plane", "--model", "mlp:6-5-3", "--checkpoint", str(_checkpoint(tmp_path)), "--data",
            "synthetic:n=40,dim=6,classes=3", "--steps", "3", *args]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "landscape", *argv], cwd=tmp_path, timeout=HANG_GUARD_S, **options)


def test_cli_a_file_name_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path):
    """A Latin-1 ``--name`` (or ``--out``) cannot be printed or recorded: refused in one sentence, nothing written."""
    folder = os.fsencode(tmp_path) + b"/caf\xe9"
    for extra, shown in ((["--name", b"caf\xe9"], "caf\\xe9"), (["--out", folder], f"{tmp_path}/caf\\xe9")):
        out = ["--out", str(tmp_path / "o")] if extra[0] == "--name" else []
        r = _landscape(tmp_path, *out, *extra, capture_output=True)
        assert r.returncode == 2, r.stderr
        assert r.stderr.decode().splitlines() == [
            f"error: {extra[0]} '{shown}' is not UTF-8 text (a name in another encoding, such as Latin-1); file names "
            "are recorded in the outputs (JSON, figure metadata, HTML), so rename the file to a UTF-8 name"
        ]  # fmt: skip
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny0.pt"]


def test_cli_stdout_whose_reader_left_still_writes_every_file_and_exits_141(tmp_path):
    """``| head -1``, made certain: the pipe's reading end is closed before the command starts."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = _landscape(tmp_path, "--out", str(tmp_path / "o"), stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "plane.html", "plane.json", "plane.npz", "plane.png"]  # fmt: skip
    assert (tmp_path / "plotly.min.js").is_file()  # shared by the output folders of the current folder


def test_cli_closed_stdout_or_one_that_cannot_show_the_names_is_no_error(tmp_path):
    """``>&-`` prints nothing; an ASCII terminal gets a UTF-8 name with backslash escapes. Both exit 0."""
    r = _landscape(tmp_path, "--out", str(tmp_path / "a"), stderr=subprocess.PIPE, text=True,
                   preexec_fn=lambda: os.close(1))  # fmt: skip
    assert (r.returncode, r.stderr) == (0, "")
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = _landscape(tmp_path, "--out", str(tmp_path / "b"), "--name", "café", capture_output=True, text=True, env=env)
    assert (r.returncode, r.stderr) == (0, "") and "caf\\xe9.png" in r.stdout
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "plane.html", "plane.json", "plane.npz", "plane.png"]  # fmt: skip
    assert (tmp_path / "b" / "café.png").exists()


def test_cli_out_naming_a_file_exits_2_before_any_computation(tmp_path, capsys, monkeypatch):
    from landscape import _surfaces, _toy_figures

    def boom(*args, **kwargs):
        raise AssertionError("computed although --out is unusable")

    monkeypatch.setattr(_surfaces, "loss_plane", boom)
    monkeypatch.setattr(_toy_figures, "toy_figure", boom)
    ckpt = _checkpoint(tmp_path)
    taken = tmp_path / "taken.txt"
    taken.write_text("keep me\n")
    plane = ["plane", "--model", "mlp:6-5-3", "--checkpoint", str(ckpt), "--data", "synthetic:n=40,dim=6,classes=3",
             "--steps", "3", "--quiet"]  # fmt: skip
    toy = ["toy", "--figure", "1.5", "--steps", "5", "--quiet"]
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, out, expected in [
        (plane, taken, f"error: --out {taken} exists and is not a folder"),
        (toy, taken, f"error: --out {taken} exists and is not a folder"),
        (plane, taken / "sub", f"error: --out {taken / 'sub'} cannot be created: {taken} is not a folder"),
        (toy, taken / "sub" / "deeper", f"error: --out {taken / 'sub' / 'deeper'} cannot be created: {taken} is not "
                                         "a folder"),
    ]:  # fmt: skip
        code, stdout, err = _cli([*argv, "--out", str(out)], capsys)
        assert code == 2 and stdout == ""
        assert err.strip().splitlines() == [expected]
    assert taken.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("fixed", [["nan"], ["1", "inf"], ["1e400"], ["-2"], ["0"], ["1e308"], ["6", "6.0000001"]])
@pytest.mark.parametrize("figure", ["4.9", "gspace-4.9"])
def test_cli_toy_bad_fixed_values_exit_2_with_one_sentence(tmp_path, capsys, figure, fixed):
    out = tmp_path / "o"
    code, stdout, err = _cli(["toy", "--figure", figure, "--fixed", *fixed, "--steps", "5", "--out", str(out)], capsys)
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --fixed "), err
    assert "array" not in err and "Traceback" not in err
    assert not out.exists()


def _relu(t):
    return np.maximum(t, 0.0)


def _npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


# figure -> {surface file stem: analytic loss at (x, y) (y is None for curves)}
_TOY_LOSSES = {
    "1.5": {
        "fig1_5_a": lambda w, _: np.sin(_relu(w)),
        "fig1_5_b": lambda w1, w2: np.sin(w2 * _relu(w1)),
    },
    "1.6": {"fig1_6_b": lambda w1, w2: np.sin(w2 * _relu(w1))},
    "gspace-1.5": {
        "gspace1_5_weights": lambda w1, w2: np.sin(w2 * _relu(w1)),
        "gspace1_5_v_pos": lambda v, _: np.sin(_relu(v)),
        "gspace1_5_v_neg": lambda v, _: np.sin(-_relu(-v)),
    },
    "gspace-4.9": {
        "gspace4_9": lambda v1, v2: np.sin(_relu(v1 + v2)),
        "gspace4_9_window": lambda v1, v2: np.sin(_relu(v1 + v2)),
    },
}


@pytest.mark.parametrize("figure", list(_TOY_LOSSES))
def test_cli_toy_figures_store_the_analytic_loss(tmp_path, capsys, figure):
    argv = ["toy", "--figure", figure, "--steps", "7", "--out", str(tmp_path), "--quiet"]
    if figure == "gspace-4.9":
        argv += ["--fixed", "1", "2", "--source", "text"]
    if figure in ("1.5", "1.6"):
        argv += ["--source", "text"]
    code, out, err = _cli(argv, capsys)
    assert code == 0 and out == "", err
    stem = "fig" + figure.replace(".", "_") if figure[0].isdigit() else figure.replace("-", "").replace(".", "_")
    for suffix in (".png", ".html"):
        assert (tmp_path / (stem + suffix)).stat().st_size > 1000, stem + suffix
    rng = np.random.default_rng(0)
    for name, fn in _TOY_LOSSES[figure].items():
        assert (tmp_path / f"{name}.json").stat().st_size > 0
        f = _npz(tmp_path / f"{name}.npz")
        x, y, loss = f["x"], f["y"], f["loss"]
        if y.size == 0:  # a curve: 8 * steps + 1 points
            assert loss.shape == x.shape == (57,)
            for j in (0, len(x) - 1, *rng.integers(0, len(x), 3)):
                assert loss[j] == pytest.approx(fn(x[j], None), abs=1e-12)
            assert np.max(np.abs(loss - fn(x, None))) <= 1e-12
        else:
            assert loss.shape == (len(y), len(x)) == (7, 7)
            for i, j in ((0, 0), (6, 6), (1, 5), (5, 2), (3, 3)):  # loss[i, j] is the loss at (x[j], y[i])
                assert loss[i, j] == pytest.approx(fn(x[j], y[i]), abs=1e-12)
            assert np.ptp(loss) > 0.5  # not a flat panel
        if name == "gspace1_5_v_pos":
            assert float(f["sign"]) == 1.0
        if name == "gspace1_5_v_neg":
            assert float(f["sign"]) == -1.0
    if figure == "1.6":
        f = _npz(tmp_path / "fig1_6_b.npz")
        pts, grads = f["arrow_points"], f["arrow_gradient"]
        assert pts.shape == grads.shape == (len(toys.FIG_1_6_LEVELS) * len(toys.FIG_1_6_ALPHAS), 2)
        w1, w2 = pts[:, 0], pts[:, 1]
        c = np.cos(w2 * _relu(w1))
        np.testing.assert_allclose(grads, np.stack([c * w2 * (w1 > 0), c * _relu(w1)], -1), rtol=0, atol=1e-12)
        np.testing.assert_allclose(w1 * w2, f["arrow_level"], rtol=1e-12)
        assert sorted(set(f["arrow_alpha"].tolist())) == sorted(toys.FIG_1_6_ALPHAS)
        assert f["invariant_levels"].tolist() == list(toys.FIG_1_6_LEVELS)
    if figure == "gspace-4.9":
        f = _npz(tmp_path / "gspace4_9.npz")
        assert f["fixed"].tolist() == [1.0, 2.0]
        lo, hi = toys.LIM_4_9
        for i, b in enumerate((1.0, 2.0)):
            outline = f[f"outline_{i}"]  # the window w2, w3 in [lo, hi] of the plane w1 = b, as (b w3, w2 w3)
            assert outline[:, 0].min() == pytest.approx(b * lo) and outline[:, 0].max() == pytest.approx(b * hi)
            assert outline[:, 1].max() == pytest.approx(hi * hi)
        assert f["x"][-1] == pytest.approx(2.0 * hi)  # the G-space window covers every outline


def test_cli_toy_source_code_draws_the_thesis_codes_figures(tmp_path, capsys):
    code, out, err = _cli(["toy", "--figure", "4.9", "--source", "code", "--fixed", "2", "--steps", "7", "--out",
                           str(tmp_path), "--quiet"], capsys)  # fmt: skip
    assert code == 0 and out == "", err
    f = _npz(tmp_path / "fig4_9_b_fixed2.npz")
    assert f["x"][-1] == f["y"][-1] == 10.0
    w2, w3 = np.meshgrid(f["x"], f["y"])
    np.testing.assert_allclose(f["loss"], np.sin(0.3 * w3 * _relu(2.0 + w2)), rtol=0, atol=1e-14)
    meta = json.loads((tmp_path / "fig4_9_b_fixed2.json").read_text())
    assert meta["metadata"]["source"] == "code" and meta["metadata"]["function"] == "sin(0.3 w3 relu(2 + w2))"
    code, out, err = _cli(["toy", "--figure", "gspace-4.9", "--steps", "7", "--out", str(tmp_path), "--quiet"],
                          capsys)  # fmt: skip
    assert code == 0, err
    f = _npz(tmp_path / "gspace4_9_window.npz")
    v1, v2 = np.meshgrid(f["x"], f["y"])
    np.testing.assert_allclose(f["loss"], np.sin(0.3 * _relu(v1 + v2)), rtol=0, atol=1e-14)
    assert f["x"][-1] == 10.0


def test_cli_toy_source_code_refused_for_the_toolkits_own_chart(tmp_path, capsys):
    code, out, err = _cli(["toy", "--figure", "gspace-1.5", "--source", "code", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: --source code applies to figures 1.5, 1.6, 4.9, gspace-4.9 only, "
                                        "which the thesis's plotting code draws; figure gspace-1.5 is the toolkit's "
                                        "own chart"]  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_cli_toy_writes_every_figure_format(tmp_path, capsys):
    code, _, err = _cli(["toy", "--figure", "1.6", "--steps", "5", "--format", "png", "pdf", "svg", "--out",
                         str(tmp_path), "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    png, pdf, svg = (tmp_path / f"fig1_6.{ext}" for ext in ("png", "pdf", "svg"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    head = svg.read_bytes()[:200].lstrip()
    assert head.startswith((b"<?xml", b"<svg")) and b"<svg" in svg.read_bytes()[:2000]
    assert not list(tmp_path.glob(".tmp-*"))


def test_cli_plane_metadata_records_timing_directions_and_center_loss(tmp_path, capsys):
    from sharpness._specs import build_model, load_checkpoint, load_data

    ckpt, out, data = _checkpoint(tmp_path), tmp_path / "out", "synthetic:n=40,dim=6,classes=3"
    code, _, err = _cli(["plane", "--model", "mlp:6-5-3", "--checkpoint", str(ckpt), "--data", data, "--out",
                         str(out), "--steps", "3", "--seed", "5", "--norm", "layer", "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    meta = json.loads((out / "plane.json").read_text())["metadata"]
    for key in ("grid_seconds", "direction_seconds", "total_seconds"):
        assert isinstance(meta[key], float) and meta[key] > 0, key
    assert meta["total_seconds"] >= meta["grid_seconds"]
    assert meta["directions"]["seeds"] == [5, 6]
    assert meta["directions"]["normalization"] == "layer"
    assert meta["dtype"] == "float32" and meta["n_points"] == 9
    model = load_checkpoint(build_model("mlp:6-5-3"), str(ckpt)).float().eval()
    X, y = load_data(data)
    expected = Objective(model, nn.CrossEntropyLoss(), (X.float(), y)).evaluate()["loss"]
    assert meta["center_loss"] == pytest.approx(expected, rel=1e-6)
    s = landscape.Surface.load(out / "plane")
    assert s.loss[s.center_index()] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("strategy", ["first-layer", "vmap"])
def test_evaluate_grid_batch_follows_the_memory_budget(strategy):
    from landscape._grid import CPU_BATCH_CAP

    torch.manual_seed(0)
    model = mlp([5, 8, 6, 3]).double().eval()
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(17, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (17,), generator=g))
    obj = Objective(model, nn.CrossEntropyLoss(), data)
    d = landscape.random_directions(obj.params, k=2, seed=0)
    coords = np.stack(np.meshgrid(np.linspace(-1, 1, 7), np.linspace(-1, 1, 6)), -1).reshape(-1, 2)
    assert len(coords) > CPU_BATCH_CAP

    def run(budget):
        return landscape.evaluate_grid(obj, d.vectors, coords, strategy=strategy, memory_budget=budget,
                                       progress=False)  # fmt: skip

    per_point = run(10**12).bytes_per_point
    assert per_point > 0
    reference = run(10**12)
    assert reference.batch == CPU_BATCH_CAP  # a generous budget: the CPU cap
    for k in (1, 2, 5, CPU_BATCH_CAP - 1):
        budget = math.ceil(k * per_point)
        values = run(budget)
        assert values.strategy == strategy
        assert values.batch == k and values.bytes_per_point == per_point
        assert values.batch * values.bytes_per_point <= budget < (values.batch + 1) * values.bytes_per_point
        if k > 1:
            assert run(budget - 1).batch == k - 1  # a byte less: one point less
        np.testing.assert_allclose(values.loss, reference.loss, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(values.accuracy, reference.accuracy)
    assert run(1).batch == 1  # below one point's bytes: still one point at a time


@pytest.mark.parametrize("name", ["mlp_bias", "cnn"])
def test_element_normalized_random_planes_are_rescaling_invariant(name):
    import manifolds

    case = make_case(name)
    twin = manifolds.random_rescale(case.model, kind="node", generator=torch.Generator().manual_seed(5))
    grid = landscape.Grid(span=0.5, steps=5)
    planes = {
        norm: [landscape.loss_plane(m, case.loss_fn, case.data, landscape.DirectionSpec(norm=norm, bias="keep", seed=2),
                                    grid=grid, progress=False).loss for m in (case.model, twin)]  # fmt: skip
        for norm in ("element", "filter")
    }
    original, rescaled = planes["element"]
    np.testing.assert_allclose(rescaled, original, rtol=1e-10)
    # filter normalization divides rows by norms that a node-wise rescaling changes unevenly
    original, rescaled = planes["filter"]
    assert np.max(np.abs(rescaled - original) / original) > 1e-3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: landscape.Grid(span=0.0), "the span must be positive"),
        (lambda: landscape.Grid(span=float("inf")), "the span must be positive"),
        (lambda: landscape.Grid(steps=1), "steps must be an integer of at least 2"),
        (lambda: landscape.Grid(strategy="fast"), "unknown grid strategy 'fast'"),
        (lambda: landscape.DirectionSpec("diagonal"), "unknown direction kind 'diagonal'"),
        (lambda: landscape.DirectionSpec(roots="free"), "applies to G-space directions only"),
        (lambda: landscape.DirectionSpec(path="geodesic"), "geodesic path follows the quotient metric"),
        (lambda: landscape.DirectionSpec("gspace", norm="filter"), "per coordinate block"),
        (lambda: landscape.DirectionSpec(norm="rows"), "unknown direction normalization 'rows'"),
        (lambda: landscape.DirectionSpec(bias="drop"), "bias must be one of zero, keep"),
        (lambda: landscape.DirectionSpec("invariant-eigen", metric="fisher"), "unknown sharpness metric 'fisher'"),
    ],
)
def test_settings_objects_refuse_bad_values_when_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_segment_refuses_directions_of_its_own():
    a, b = make_case("mlp_bias"), make_case("mlp_bias", seed=1)
    given = landscape.random_directions(dict(a.model.named_parameters()), 1, seed=0)
    for directions in (given, "eigen", landscape.DirectionSpec(seed=3)):
        with pytest.raises(ValueError, match="the segment between two checkpoints is a straight line"):
            landscape.loss_line(a.model, a.loss_fn, a.data, directions, to=b.model, progress=False)


def test_a_grid_too_large_for_memory_is_refused_before_any_work(monkeypatch):
    import landscape._settings as settings

    monkeypatch.setattr(settings, "physical_memory", lambda: 2**30)  # a 1 GiB machine
    grid = landscape.Grid(steps=3000)  # 9e6 points x 64 bytes = 0.54 GiB > half of 1 GiB
    with pytest.raises(ValueError, match=r"a 3000x3000 grid has 9,000,000 points .* more than half of this machine's"):
        grid.require_memory(2)
    grid.require_memory(1)  # a line of 3000 points is fine
    with pytest.raises(ValueError, match="use fewer steps"):
        landscape.loss_plane(None, None, None, "random", grid=grid, objective=None)  # refused before the objective
    monkeypatch.setattr(settings, "physical_memory", lambda: None)  # a system that does not say: no refusal
    grid.require_memory(2)
