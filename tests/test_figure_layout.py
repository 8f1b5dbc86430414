"""Every figure the toolkit writes passes the layout check (no clipped or overlapping text, no linear axis
over more than three decades), carries its provenance in the file's metadata, and the HTML pages stay small.

Each test runs a command the way a user would and checks every figure it saves: ``Figure.savefig`` is
wrapped so that :func:`landscape.check_layout` runs on the figure before it is written.
"""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from landscape import check_layout
from landscape._cli import main as landscape_main
from sharpness._cli import main as sharpness_main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODEL = ["--model", "mlp:6-5-3", "--data", "synthetic:n=40,dim=6,classes=3", "--dtype", "float64", "--quiet"]


@pytest.fixture
def checked(monkeypatch):
    """The figures saved while the test runs, each checked before it is written (a list of their titles)."""
    saved = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        check_layout(self)
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _checkpoint(folder: Path, seed: int = 0) -> Path:
    from sharpness._specs import build_model

    torch.manual_seed(seed)
    path = folder / f"tiny{seed}.pt"
    torch.save(build_model("mlp:6-5-3").state_dict(), path)
    return path


def _run(main, argv):
    assert main(argv) == 0


def _png_meta(path: Path) -> dict:
    with Image.open(path) as image:
        return dict(image.info)


def test_plane_line_and_segment_figures(tmp_path, checked):
    ckpt = _checkpoint(tmp_path)
    common = [*MODEL, "--checkpoint", str(ckpt), "--out", str(tmp_path)]
    _run(landscape_main, ["plane", *common, "--steps", "7", "--format", "png", "pdf", "svg"])
    _run(landscape_main, ["plane", *common, "--steps", "7", "--directions", "gspace", "--name", "gs"])
    _run(landscape_main, ["line", *common, "--steps", "9", "--name", "line"])
    _run(landscape_main, ["line", *common, "--steps", "9", "--to", str(_checkpoint(tmp_path, 1)), "--name", "seg"])
    assert len(checked) == 6
    meta = _png_meta(tmp_path / "plane.png")
    assert meta["Title"].startswith("Loss on the plane") and "mlp:6-5-3" in meta["Description"]
    assert "mlp:6-5-3" in (tmp_path / "plane.svg").read_text()  # SVG metadata
    assert b"mlp:6-5-3" in (tmp_path / "plane.pdf").read_bytes()  # the PDF's Subject
    gs = json.loads((tmp_path / "gs.json").read_text())
    assert gs["metadata"]["directions"]["normalization"] == "element"
    assert "unnormalized" not in gs["title"] and "normalized per coordinate" in gs["title"]
    seg = checked[-1]
    assert [t.get_text() for t in seg.axes[0].child_axes[0].get_xticklabels()] == ["tiny0.pt", "tiny1.pt"]


def test_a_loss_over_decades_is_drawn_on_a_log_scale(tmp_path, checked):
    """A steep plane (span 30) reaches losses decades above the centre: colour bar and 3-D heights turn
    logarithmic by themselves, and --linear is refused by the check."""
    ckpt = _checkpoint(tmp_path)
    common = [*MODEL, "--checkpoint", str(ckpt), "--out", str(tmp_path), "--steps", "7", "--span", "300"]
    _run(landscape_main, ["plane", *common])
    (fig,) = checked
    colorbar = next(ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None)
    assert colorbar.get_yscale() == "log" and "log scale" in colorbar.get_ylabel()
    with pytest.raises(AssertionError, match="is linear over .* decades"):
        landscape_main(["plane", *common, "--linear", "--name", "linear"])


def test_fixed_weight_figures(tmp_path, checked):
    ckpt = _checkpoint(tmp_path)
    for reading in ("a", "b"):
        _run(landscape_main, ["fixed", *MODEL, "--checkpoint", str(ckpt), "--out", str(tmp_path), "--steps", "7",
                              "--reading", reading, "--name", f"fixed-{reading}"])  # fmt: skip
    for fig in checked:
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert titles == ["b = 0.5", "b = 1", "b = 2"]  # one short line per column, details in the caption
        assert "\n" not in fig.get_suptitle()
    page = (tmp_path / "fixed-b.html").read_text()
    (title,) = re.findall(r"<title>(.*?)</title>", page)
    assert title.count("(") == title.count(")") and "mlp:6-5-3" in title
    assert "agree to rounding" in checked[1]._supxlabel.get_text()  # reading (b): a layer-wise rescaling


@pytest.mark.parametrize("figure", ["1.5", "1.6", "4.9", "gspace-1.5", "gspace-4.9"])
def test_toy_figures(tmp_path, checked, figure):
    _run(landscape_main, ["toy", "--figure", figure, "--steps", "21", "--out", str(tmp_path), "--quiet"])
    (fig,) = checked
    (png,) = tmp_path.glob("*.png")
    meta = _png_meta(png)
    assert "Jestädt" in meta["Description"] and f"Fig. {figure.replace('gspace-', '')}" in meta["Description"]
    assert "Jestädt" in fig._supxlabel.get_text()


def test_density_figure(tmp_path, checked):
    ckpt = _checkpoint(tmp_path)
    plot = tmp_path / "density.png"
    _run(sharpness_main, ["density", *MODEL, "--checkpoint", str(ckpt), "--probes", "2", "--steps", "6",
                          "--plot", str(plot)])  # fmt: skip
    (fig,) = checked
    (ax,) = fig.axes
    assert "mlp:6-5-3" in ax.get_title() and "synthetic" in ax.get_title()
    (line,) = ax.lines
    y = np.asarray(line.get_ydata(), dtype=float)
    floor = np.nanmin(y)
    assert np.isnan(y).any() and np.sum(y == floor) == 1  # below the floor: gaps, not a flat line of made-up data
    assert "not drawn" in ax.get_title()
    assert "mlp:6-5-3" in _png_meta(plot)["Title"]


def test_demo_figures(tmp_path, checked):
    from landscape._demo import run_demo

    run_demo(str(tmp_path), seed=0, threshold=0.3, progress=False, grid_steps=9)
    assert len(checked) == 2
    for name in ("sharpness.png", "surfaces.png"):
        assert "MLP 64-128-128-10" in _png_meta(tmp_path / name)["Description"]
    report = (tmp_path / "report.md").read_text()
    assert not re.search(r"\| \de[+-]\d\d \|", report.replace(" | ", " |\n| "))  # no bare 1e+07: 1.000e+07
    from landscape._demo_figures import format_value

    assert [format_value(v) for v in (10000228.3, 1.108, 115.8, 0.05425, 2234.0)] == [
        "1.000e+07", "1.108", "115.8", "0.05425", "2234"
    ]


def test_gauge_example_figure(tmp_path, checked):
    from manifolds import GaugeHistory

    spec = importlib.util.spec_from_file_location("example_min_norm_gauge", EXAMPLES / "min_norm_gauge.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    histories = {}
    for p in example.P_VALUES:
        for k, widths in enumerate(example.NETWORKS):
            n = 30 + 10 * k
            objective = list(1e5 * (0.6 + 0.4 * np.exp(-np.arange(n) / 5.0)))
            imbalance = list(0.5 * 10.0 ** (-np.arange(n) * 10 / n))
            histories[(p, widths)] = GaugeHistory(p, objective, imbalance, imbalance[-1], n - 1, True,
                                                  torch.zeros(1, dtype=torch.float64))  # fmt: skip
    paths = example.plot(histories, 1e-10, tmp_path)
    assert len(checked) == 2  # png and pdf
    assert [path.name for path in paths] == ["min_norm_gauge.png", "min_norm_gauge.pdf"]
    meta = _png_meta(tmp_path / "min_norm_gauge.png")
    assert meta["Title"].startswith("Min-norm gauge paper, Fig. 2:")
    assert "Fig. 2 of 'The Minimum-Norm Gauge for Deep Learning'" in meta["Description"]
    assert "200-2500-1250-10" in meta["Description"]


def test_gspace_training_example_figure(tmp_path, checked):
    spec = importlib.util.spec_from_file_location("example_gspace_training", EXAMPLES / "gspace_training.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    rates = [f"{lr:g}" for lr in example.LEARNING_RATES]
    results = {
        label: {lr: {"mean": [2.3, 1.0 / (k + 1), 0.5 / (k + 1) + 0.01 * i], "best": 0.5 / (k + 1) + 0.01 * i,
                     "best_epoch": 2, "at_best": [0.5 / (k + 1) + 0.01 * i] * 3, "std": 0.01,
                     "diverged": [None, 2, None] if i == 2 else [None] * 3}  # one seed diverged: annotated
                for i, lr in enumerate(rates)}
        for k, label in enumerate(example.OPTIMIZERS)
    }  # fmt: skip
    example.plot(results, {"seeds": 3, "epochs": 2, "init": "thesis"}, tmp_path)
    assert len(checked) == 2
    meta = _png_meta(tmp_path / "gspace_training.png")
    assert "thesis Fig. 4.1" in meta["Title"] and "Fig. 4.1 of C. Jestaedt" in meta["Description"]


def test_html_pages_share_one_plotly_js_by_default(tmp_path):
    ckpt = _checkpoint(tmp_path)
    common = [*MODEL, "--checkpoint", str(ckpt), "--steps", "5"]
    for mode in ("directory", "inline", "cdn"):
        _run(landscape_main, ["plane", *common, "--out", str(tmp_path / mode), "--html-js", mode])
        _run(landscape_main, ["line", *common, "--out", str(tmp_path / mode), "--html-js", mode])
    shared = tmp_path / "directory" / "plotly.min.js"
    assert shared.stat().st_size > 3_000_000
    for name in ("plane.html", "line.html"):
        page = (tmp_path / "directory" / name).read_text()
        assert '<script charset="utf-8" src="plotly.min.js"></script>' in page
        assert (tmp_path / "directory" / name).stat().st_size < 100_000
        assert (tmp_path / "inline" / name).stat().st_size > 3_000_000
        cdn = tmp_path / "cdn" / name
        assert cdn.stat().st_size < 100_000 and "cdn.plot.ly" in cdn.read_text()
    assert not (tmp_path / "inline" / "plotly.min.js").exists() and not (tmp_path / "cdn" / "plotly.min.js").exists()
    page = (tmp_path / "directory" / "plane.html").read_text()
    meta = json.loads(re.search(r'"meta":\s*(\{.*?\})', page).group(1))
    assert "mlp:6-5-3" in meta["caption"] and math.isfinite(len(meta["title"]))
