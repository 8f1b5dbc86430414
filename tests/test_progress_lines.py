"""Progress without a terminal: plain phase lines with elapsed time at a steady cadence, an estimate before a grid's
rest, silenced by quiet (issue 36). Time is a fake monotonic clock put into the progress helper: no real sleeps, no
wall-clock asserts."""

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch
from guards import HANG_GUARD_S
from safetensors.torch import save_file
from torch import nn

import sharpness._progress as progress_module
from sharpness import Objective
from sharpness._progress import FIRST_LINE_S, LINE_EVERY_S, progress_bar, progress_phase
from sharpness._specs import build_model

STEP_S = 3.0  # fake seconds per clock reading
ELAPSED = re.compile(r"^\[(\w+)\] (.+): (\d+) s elapsed$")

# Runs a package's command line as `python -m` does, with the fake clock in the progress helper.
HARNESS = """
import itertools, runpy, sys
import sharpness._progress as progress
ticks = itertools.count(0.0, {step})
progress.clock, progress.TICK_S = (lambda: next(ticks)), None
sys.argv = [{package!r}, *{argv!r}]
runpy.run_module({package!r}, run_name="__main__", alter_sys=True)
"""


def _fake_clock(monkeypatch) -> None:
    """Each reading of the clock is STEP_S fake seconds after the last; no ticker thread (it reads the clock too)."""
    ticks = itertools.count(0.0, STEP_S)
    monkeypatch.setattr(progress_module, "clock", lambda: next(ticks))
    monkeypatch.setattr(progress_module, "TICK_S", None)


def _cadence(lines: list[str]) -> list[tuple[str, int]]:
    """``(outermost phase, elapsed s)`` of each elapsed line, checked: the first of a phase after FIRST_LINE_S, then
    one every LINE_EVERY_S to 2 LINE_EVERY_S (a line at least once a minute) while it runs."""
    seen = []
    for line in lines:
        match = ELAPSED.match(line)
        if match:
            seen.append((re.sub(r" \d.*", "", match[2].split(" > ")[0]), int(match[3])))
    for (phase, elapsed), (before_phase, before) in zip(seen, [(None, None), *seen[:-1]]):
        if phase != before_phase or elapsed < before:  # a new phase
            assert elapsed >= FIRST_LINE_S, seen
        else:
            assert LINE_EVERY_S <= elapsed - before <= 2 * LINE_EVERY_S, seen
    return seen


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("progress") / "m.safetensors"
    save_file({k: v.contiguous() for k, v in build_model("mlp:16-8-3").state_dict().items()}, str(path))
    return str(path)


VERIFY = ["verify", "--model", "mlp:16-8-3", "--data", "synthetic:n=30,dim=16,classes=3", "--trials", "1",
          "--metric", "node", "--kind", "layer"]  # fmt: skip


def test_verify_without_a_terminal_writes_phase_lines_at_a_steady_cadence(checkpoint):
    """Every phase, the original model's included (it was silent), names itself and the time since it started."""
    code = HARNESS.format(step=STEP_S, package="sharpness", argv=[*VERIFY, "--checkpoint", checkpoint])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                       stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("[sharpness] ") for line in lines), lines
    seen = _cadence(lines)
    phases = {phase for phase, _ in seen}
    assert {"measuring original model (node)", "rescaled copies"} <= phases, seen
    assert any("measuring original model (node) > lanczos" in line for line in lines), lines
    assert any(re.fullmatch(r"\[sharpness\] rescaled copies 1/1.*: done in \d+ s", line) for line in lines), lines
    assert "passed" in r.stdout and "[sharpness]" not in r.stdout


def test_quiet_silences_the_phase_lines(checkpoint, monkeypatch, capsys):
    from sharpness._cli import main

    _fake_clock(monkeypatch)
    assert main([*VERIFY, "--checkpoint", checkpoint, "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "passed" in out.out


def test_a_short_phase_prints_nothing_and_a_long_one_a_line_at_least_every_minute(monkeypatch, capsys):
    _fake_clock(monkeypatch)
    with progress_bar(None, "short", None) as bar:  # under FIRST_LINE_S in all
        bar.update(1)
    assert capsys.readouterr().err == ""
    with progress_phase("outer phase"), progress_bar(100, "inner", None) as bar:
        for _ in range(100):
            bar.update(1)
            bar.set_postfix(residual="1e-03")
    lines = capsys.readouterr().err.splitlines()
    seen = _cadence(lines)
    assert len(seen) >= 100 * STEP_S / (2 * LINE_EVERY_S)
    assert lines[0].startswith("[sharpness] outer phase > inner ") and ", residual=1e-03: " in lines[1]
    assert re.fullmatch(r"\[sharpness\] outer phase: done in \d+ s", lines[-1])
    with progress_phase("outer phase", False), progress_bar(100, "inner", False) as bar:  # quiet
        for _ in range(100):
            bar.update(1)
    assert capsys.readouterr().err == ""


def test_a_grid_says_its_point_count_and_an_estimate_after_the_first_batch(monkeypatch, capsys):
    """A grid's first batch of points gives the estimate of the whole grid before the rest is computed."""
    from landscape import evaluate_grid

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    objective = Objective(model, nn.CrossEntropyLoss(), (torch.randn(10, 4), torch.arange(10) % 2))
    directions = torch.randn(2, objective.layout.size)
    coords = torch.cartesian_prod(torch.linspace(-1, 1, 5), torch.linspace(-1, 1, 5))
    _fake_clock(monkeypatch)
    evaluate_grid(objective, directions, coords, batch=5)
    lines = capsys.readouterr().err.splitlines()
    # the bar opened at t, its first update (5 of 25 points) at t + STEP_S: 5 times that for the whole grid
    assert lines[0] == (f"[sharpness] grid points: 25 pt in all; the first 5 took {STEP_S:.1f} s, so about "
                        f"{5 * STEP_S:.0f} s in all")  # fmt: skip
    evaluate_grid(objective, directions, coords, batch=5, progress=False)
    assert capsys.readouterr().err == ""


def test_a_phase_without_updates_gets_its_line_from_the_ticker(monkeypatch, capsys):
    """A setup step with no loop (no update for minutes) is not silent: the ticker's look writes the line."""
    _fake_clock(monkeypatch)
    with progress_phase("measuring original model (symmetry)"), progress_bar(300, "lanczos", None):
        for _ in range(13):  # the ticker's looks, one every STEP_S fake seconds from 6 s on, no update
            progress_module._tick()
    assert capsys.readouterr().err.splitlines() == [
        "[sharpness] measuring original model (symmetry) > lanczos 0/300: 6 s elapsed",
        "[sharpness] measuring original model (symmetry) > lanczos 0/300: 36 s elapsed",
        "[sharpness] measuring original model (symmetry): done in 45 s",
    ]
