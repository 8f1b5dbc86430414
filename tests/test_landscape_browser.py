"""The interactive HTML renders in a real browser: headless Chromium takes a screenshot of a page
written by the plotly renderer, and the plot area must be full of colors (not a blank page).

Skipped only where Chromium is absent and we are not in CI; in CI (``CI=true``) a missing Chromium
fails the test, since ``.ci/run`` installs it.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

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


# Run after the page's own script: once plotly has drawn, writes what a reviewer looks at into <pre id="layout">
# (the page's width, the boxes of the figure title and of the panel titles, the drawn size of each 2-D panel).
MEASURE = """<script>
(function measure(tries) {
  const gd = document.querySelector('.plotly-graph-div'), title = document.querySelector('.gtitle');
  if (!(gd && gd._fullLayout && title) && tries > 0) { setTimeout(() => measure(tries - 1), 100); return; }
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const L = gd._fullLayout;
  const panels = Object.keys(L).filter(k => /^xaxis[0-9]*$/.test(k))
    .map(k => [L[k]._length, L['yaxis' + L[k].anchor.slice(1)]._length]);
  const report = {width: document.documentElement.clientWidth, title: box(title), panels: panels,
                  panel_titles: [...document.querySelectorAll('.annotation-text')].map(box)};
  const pre = document.createElement('pre');
  pre.id = 'layout';
  pre.textContent = JSON.stringify(report);
  document.body.appendChild(pre);
})(200);
</script>"""


def _measured_layout(page: Path, width: int) -> dict:
    """What :data:`MEASURE` finds in ``page`` (a copy of it beside it, with the script added) at a window ``width``
    pixels wide, in headless Chromium."""
    measured = page.with_name(f"measured-{page.name}")
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [_require_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--dump-dom",
             f"--window-size={width},2000", f"file://{measured}"],
            check=True, capture_output=True, text=True, timeout=HANG_GUARD_S,
        )  # fmt: skip
    found = re.search(r'<pre id="layout">(.*?)</pre>', result.stdout, re.S)
    assert found, f"the page did not finish drawing at {width} px:\n{result.stderr[-2000:]}"
    return json.loads(html.unescape(found[1]))


def _apart(a: list[float], b: list[float], gap: float = 2.0) -> bool:
    """Whether two boxes ``[left, top, right, bottom]`` are at least ``gap`` pixels apart in one direction."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def test_fixed_weight_page_keeps_titles_whole_and_contour_panels_square_at_common_widths(tmp_path):
    """The page ``landscape fixed`` writes (three rows, two-line panel titles, a long title naming model, checkpoint,
    data and loss) at the widths of common screens: the title whole and clear of the panel titles, the panel
    titles clear of each other, and every contour panel square."""
    _require_chromium()
    planes = [s.replace(title=f"reading (a): fixed weights set to {b}, the function changes\nloss on the free-weight "
                              "plane of random filter-normalized directions (biases: zero)")
              for b in (0.5, 1, 2)
              for s in [next(s for s in toys.fig_1_5_surfaces(steps=21) if not s.is_line)]]  # fmt: skip
    title = ("Loss in the free weights, reading (a): fixed weights set to b, the function changes with b (model "
             "mlp:64-128-128-10 (small_batch.safetensors), data digits, loss CrossEntropyLoss (float32))")
    page = tmp_path / "fixed.html"
    write_html(plotly_figure(planes, title=title), page)
    for width in (1280, 1400, 1920):
        found = _measured_layout(page, width)
        left, top, right, bottom = found["title"]
        assert 0 <= left and right <= found["width"] and top >= 0, (width, found)
        assert len(found["panel_titles"]) == 3, found
        for i, box in enumerate(found["panel_titles"]):
            assert box[0] >= 0 and box[2] <= found["width"], (width, box)
            assert _apart(found["title"], box, gap=4), (width, "the title touches a panel title", found)
            assert all(_apart(box, other) for other in found["panel_titles"][i + 1 :]), (width, found)
        assert len(found["panels"]) == 3
        for w, h in found["panels"]:
            assert abs(w / h - 1) < 0.02, (width, "a contour panel is not square", found["panels"])
