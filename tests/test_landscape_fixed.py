"""Loss planes under different fixed-weight values (landscape.fixed_weight_planes, readings (a) and (b))."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import make_case
from test_landscape import _cli  # the command-line runner of the landscape tests

import landscape
from landscape._fixed_planes import fixed_weight_centers
from manifolds import FixedWeightSpace
from sharpness import Objective

VALUES = (0.5, 1.0, 2.0)


@pytest.fixture(scope="module")
def case():
    return make_case("mlp_bias", dtype=torch.float64)


@pytest.fixture(scope="module")
def planes(case):
    return {
        r: landscape.fixed_weight_planes(
            case.model, case.loss_fn, (case.X, case.y), VALUES, reading=r, grid=landscape.Grid(steps=5), progress=False
        )  # fmt: skip
        for r in ("a", "b")
    }


def _centers(case, reading):
    obj = Objective(case.model, case.loss_fn, (case.X, case.y))
    space = FixedWeightSpace(case.model, "diagonal", params=obj.params)
    return obj, space, fixed_weight_centers(obj, space, VALUES, reading)


@pytest.mark.parametrize("reading", ["a", "b"])
def test_center_is_on_the_grid_and_has_the_center_loss(case, planes, reading):
    obj, space, centers = _centers(case, reading)
    for b, s, center in zip(VALUES, planes[reading], centers):
        assert s.loss.shape == (5, 5)
        i, j = s.center_index()
        expected = obj.evaluate(center)["loss"]
        assert s.loss[i, j] == pytest.approx(expected, rel=1e-12)
        assert s.metadata["center_loss"] == pytest.approx(expected, rel=1e-12)
        assert torch.allclose(space.fixed_vector(center), space.signs * b, rtol=0, atol=1e-12)
        assert float(s.extras["fixed"]) == b and s.metadata["fixed_value"] == b
        assert s.metadata["reading"] == reading and s.metadata["selection"] == "diagonal"
        assert f"reading ({reading})" in s.title


def test_reading_b_keeps_the_function_and_reading_a_changes_it(case, planes):
    b_losses = [s.loss[s.center_index()] for s in planes["b"]]
    a_losses = [s.loss[s.center_index()] for s in planes["a"]]
    assert max(b_losses) - min(b_losses) <= 1e-10 * abs(b_losses[0])
    assert len({round(float(v), 8) for v in a_losses}) == len(VALUES)
    assert "only the gauge differs" in planes["b"][0].title
    assert "the function changes" in planes["a"][0].title


@pytest.mark.parametrize("reading", ["a", "b"])
def test_directions_are_zero_on_fixed_entries(case, monkeypatch, reading):
    from landscape import _fixed_planes

    seen = []
    real = _fixed_planes.loss_plane

    def spy(model, loss_fn, data, directions, **kwargs):
        seen.append(directions)
        return real(model, loss_fn, data, directions, **kwargs)

    monkeypatch.setattr(_fixed_planes, "loss_plane", spy)
    surfaces = landscape.fixed_weight_planes(case.model, case.loss_fn, (case.X, case.y), VALUES, reading=reading,
                                             grid=landscape.Grid(steps=3), progress=False)  # fmt: skip
    _, space, _ = _centers(case, reading)
    assert len(seen) == len(VALUES)
    for d, s in zip(seen, surfaces):
        assert d.vectors.shape == (2, space.layout.size)
        assert torch.count_nonzero(space.fixed_vector(d.vectors)) == 0
        assert torch.count_nonzero(space.free_vector(d.vectors)) > 0
        assert s.metadata["directions"]["fixed_entries"] == "zeroed"
        assert s.metadata["directions"]["seeds"] == [0, 1]


def _checkpoint(tmp_path):
    from sharpness._specs import build_model

    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    torch.save(build_model("mlp:6-5-3").state_dict(), path)
    return path


def _args(tmp_path, out):
    return ["fixed", "--model", "mlp:6-5-3", "--checkpoint", str(_checkpoint(tmp_path)), "--data",
            "synthetic:n=40,dim=6,classes=3", "--out", str(out), "--quiet", "--dtype", "float64",
            "--steps", "5"]  # fmt: skip


@pytest.mark.parametrize("reading", ["a", "b"])
def test_cli_fixed_writes_promised_files(tmp_path, capsys, reading):
    out = tmp_path / "out"
    code, stdout, err = _cli([*_args(tmp_path, out), "--values", "0.5", "1", "2", "--reading", reading], capsys)
    assert code == 0, err
    assert stdout == ""
    for name in ("fixed.png", "fixed.html"):
        assert (out / name).stat().st_size > 0, name
    for b in (0.5, 1.0, 2.0):
        stem = out / f"fixed_b{b:g}"
        with np.load(stem.with_name(stem.name + ".npz")) as f:
            assert float(f["fixed"]) == b and f["loss"].shape == (5, 5)
        s = landscape.Surface.load(stem)
        assert s.metadata["reading"] == reading and f"reading ({reading})" in s.title
        assert s.loss[s.center_index()] == pytest.approx(s.metadata["center_loss"], rel=1e-12)


@pytest.mark.parametrize("values", [[], ["nan"], ["1", "inf"], ["-1"], ["0"]])
def test_cli_fixed_bad_values_exit_2(tmp_path, capsys, values):
    out = tmp_path / "out"
    code, stdout, err = _cli([*_args(tmp_path, out), "--values", *values], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()


def test_cli_fixed_panels_share_one_color_scale(tmp_path, capsys, monkeypatch):
    from matplotlib.contour import ContourSet
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    from landscape import _plot_mpl

    figures = []

    def spy(fig, *args, **kwargs):  # keep the figure, skip rendering it (the other CLI tests write it)
        figures.append(fig)
        return []

    monkeypatch.setattr(_plot_mpl, "save_figure", spy)
    out = tmp_path / "out"
    code, _, err = _cli([*_args(tmp_path, out), "--values", "0.5", "1", "2", "--span", "2"], capsys)
    assert code == 0, err
    (fig,) = figures
    losses = [landscape.Surface.load(out / f"fixed_b{b:g}").loss for b in VALUES]
    lo, hi = min(float(z.min()) for z in losses), max(float(z.max()) for z in losses)
    # reading (a) changes the function: the panels' own ranges differ, so a shared scale is not automatic
    assert len({(float(z.min()), float(z.max())) for z in losses}) == len(VALUES)
    assert any(float(z.min()) > lo or float(z.max()) < hi for z in losses)
    filled, surfaces3d, colorbars = [], [], []
    for ax in fig.axes:
        for artist in ax.collections:
            if isinstance(artist, ContourSet) and artist.filled:
                filled.append(artist)
            elif isinstance(artist, Poly3DCollection):
                surfaces3d.append(artist)
            if getattr(artist, "colorbar", None) is not None:
                colorbars.append(artist.colorbar)
    assert len(filled) == len(surfaces3d) == len(VALUES)  # a contour and a 3D panel per value
    limits = {(m.norm.vmin, m.norm.vmax) for m in filled + surfaces3d + [c.mappable for c in colorbars]}
    assert limits == {(lo, hi)}
    # one colorbar; for contours it spans the level boundaries, which enclose the shared range
    assert len(colorbars) == 1 and colorbars[0].vmin <= lo and colorbars[0].vmax >= hi
    # every filled contour's levels cover the shared range, not just its own panel's
    for cs in filled:
        assert cs.levels[0] <= lo and cs.levels[-1] >= hi


def _no_grid(monkeypatch):
    """Make evaluating any grid fail the test: a refusal must come before the first one."""
    from landscape import _fixed_planes

    def boom(*args, **kwargs):
        raise AssertionError("a grid was evaluated before the refusal")

    monkeypatch.setattr(_fixed_planes, "loss_plane", boom)


def test_cli_fixed_values_that_name_the_same_files_exit_2_before_any_computation(tmp_path, capsys, monkeypatch):
    _no_grid(monkeypatch)
    out = tmp_path / "out"
    code, stdout, err = _cli([*_args(tmp_path, out), "--values", "0.1", "0.10000001"], capsys)
    assert (code, stdout) == (2, "")
    assert err.splitlines() == ["error: --values 0.1 and 0.10000001 are equal to 6 significant digits, which name the "
                                "files and panels; give distinct values"]  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--values", "1e-30", "--reading", "b", "--dtype", "float32"],
         "the fixed-weight value 1e-30 cannot be drawn in float32: rescaling the network so that every fixed weight "
         "is ±b takes its weights or their plane out of the range of float32; use values nearer 1 or dtype float64 "
         "(--dtype float64)"),
        (["--values", "1", "1e-300", "--reading", "b"],
         "the fixed-weight value 1e-300 cannot be drawn in float64: rescaling the network so that every fixed weight "
         "is ±b takes its weights or their plane out of the range of float64; use values nearer 1"),
        (["--values", "1e-50", "--dtype", "float32"],
         "the fixed-weight value 1e-50 cannot be drawn in float32: float32 cannot hold it; use values nearer 1 or "
         "dtype float64 (--dtype float64)"),
    ],
)  # fmt: skip
def test_cli_fixed_values_the_dtype_cannot_draw_exit_2_before_any_grid(tmp_path, capsys, monkeypatch, extra, message):
    """Reading (b) at 1e-30 scales the other weights to 1e29, whose squares overflow float32: before, the planes
    were NaN and the command failed after computing them, on an empty array."""
    _no_grid(monkeypatch)
    out = tmp_path / "out"
    code, stdout, err = _cli([*_args(tmp_path, out), *extra], capsys)
    assert (code, stdout, err.splitlines()) == (2, "", [f"error: {message}"])
    assert not out.exists()


def test_fixed_value_1e_30_is_drawn_in_float64():
    case = make_case("mlp_bias")
    (s,) = landscape.fixed_weight_planes(case.model, case.loss_fn, case.data, [1e-30], reading="b",
                                         grid=landscape.Grid(steps=3), dtype=torch.float64, progress=False)  # fmt: skip
    assert np.isfinite(s.loss).all()


def test_cli_fixed_and_gspace_planes_on_a_resnet_name_the_landscapes_that_apply(tmp_path, capsys):
    from sharpness.cli import resnet

    torch.manual_seed(0)
    torch.save(resnet(20).state_dict(), tmp_path / "r.pt")
    np.savez(tmp_path / "img.npz", X=np.random.default_rng(0).standard_normal((4, 3, 32, 32)), y=np.arange(4))
    common = ["--model", "resnet:20", "--checkpoint", str(tmp_path / "r.pt"), "--data", str(tmp_path / "img.npz"),
              "--steps", "3", "--out", str(tmp_path / "out"), "--quiet"]  # fmt: skip
    for argv, what in ((["fixed", *common], "fixed-weight planes"),
                       (["plane", "--directions", "gspace", *common], "G-space planes")):  # fmt: skip
        code, stdout, err = _cli(argv, capsys)
        assert (code, stdout, len(err.splitlines())) == (2, "", 1), err
        assert err.startswith(f"error: {what} need a chain of Linear/Conv2d layers"), err
        assert "'layer2.0.shortcut.0' (Conv2d)" in err and "measures" not in err
        assert err.rstrip().endswith("planes and lines along random or eigen directions (python -m landscape plane or "
                                     "line, landscape.loss_plane or loss_line) apply to any model")  # fmt: skip
    assert not (tmp_path / "out").exists()
