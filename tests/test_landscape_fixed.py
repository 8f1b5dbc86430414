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
