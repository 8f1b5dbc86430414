"""The interactive HTML renders in a real browser: headless Chromium takes a screenshot of a page
written by the plotly renderer, and the plot area must be full of colors (not a blank page).

Skipped only where Chromium is absent and we are not in CI; in CI (``CI=true``) a missing Chromium
fails the test, since ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
from guards import HANG_GUARD_S
from PIL import Image

from landscape import _toys as toys
from landscape._plot_plotly import plotly_figure, write_html

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _require_chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed in CI; .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return CHROMIUM


def _screenshot(html: str, png: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [_require_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=900,700", f"file://{html}"],
            check=True, capture_output=True, timeout=HANG_GUARD_S,
        )  # fmt: skip


def test_plotly_html_renders_in_headless_chromium(tmp_path):
    _require_chromium()
    html, png = tmp_path / "plane.html", tmp_path / "shot.png"
    plane = toys.fig_1_5_surfaces(steps=41)[1]
    write_html(plotly_figure([plane], title="network b"), html)
    _screenshot(str(html), str(png))
    image = Image.open(png).convert("RGB")
    assert image.size == (900, 700)
    # the plot area (below the title, above the empty bottom margin) of both panels
    area = image.crop((20, 90, 880, 520))
    colors = area.getcolors(maxcolors=area.width * area.height)
    white = sum(n for n, c in colors if min(c) > 245)
    assert len(colors) > 500, f"only {len(colors)} distinct colors: the plot did not render"
    assert white < 0.6 * area.width * area.height, "the plot area is mostly white: the plot did not render"
