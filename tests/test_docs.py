"""Keep README.md and docs/*.md from rotting.

- Every ```python block of a file runs, the blocks of one file in order in one fresh interpreter
  (cwd a temporary folder, MPLBACKEND=Agg). A block that needs the user's own files is fenced
  ```python {.no-run} instead (rendered as Python by GitHub and MkDocs); use that sparingly.
- Every relative link (``[text](path)`` or ``![alt](path)``) points to an existing file.
- Every ``python -m sharpness SUB`` / ``python -m landscape SUB`` in a ```bash block names a real
  subcommand (read from the command line's ``--help``), and the shell blocks of the pages in
  ``SHELL_FILES`` run after their Python blocks (``{.no-run}`` marks installs and the demo).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from guards import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in DOC_FILES]

# ```lang [marker]  ...  ``` (fences of three or more backticks, possibly indented, e.g. in lists)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                   re.M | re.S)  # fmt: skip
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CLI = re.compile(r"python -m (sharpness|landscape)\s+([A-Za-z][\w-]*)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block, in order, bodies dedented by the fence's indent."""
    blocks = []
    for m in FENCE.finditer(text):
        indent = len(m["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line for line in m["body"].splitlines(True))
        blocks.append((m["info"].strip(), body))
    return blocks


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks that run (not the ones marked ``{.no-run}``)."""
    return [
        body
        for info, body in fenced_blocks(path.read_text(encoding="utf-8"))
        if language(info) in ("python", "py") and "no-run" not in info
    ]


def language(info: str) -> str:
    """The language of a fence's info string: ``python`` for ``python``, ``python {.no-run}`` and ``{.python}``."""
    m = re.match(r"\{?\s*\.?([\w+-]+)", info)
    return m[1].lower() if m else ""


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans removed (links inside code are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)[^`]*?\1", "", text)


@functools.cache
def all_subcommands() -> dict[str, frozenset[str]]:
    """Subcommand names of ``python -m sharpness`` and ``python -m landscape``, read from their usage lines
    (both ``--help`` runs at once: each spends seconds importing torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = {
        package: subprocess.Popen(
            [sys.executable, "-m", package, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )  # fmt: skip
        for package in ("sharpness", "landscape")
    }
    found = {}
    for package, proc in procs.items():
        out, err = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, f"python -m {package} --help failed:\n{err}"
        choices = re.search(r"\{([\w,-]+)\}", out)
        assert choices, f"no subcommands in python -m {package} --help:\n{out}"
        found[package] = frozenset(choices[1].split(","))
    return found


def shell_blocks(path: Path) -> list[str]:
    """The shell blocks that run (not the ones marked ``{.no-run}``: installs, the minute-long demo)."""
    return [
        body
        for info, body in fenced_blocks(path.read_text(encoding="utf-8"))
        if language(info) in ("bash", "sh", "shell") and "no-run" not in info
    ]


def bash_commands(path: Path) -> list[tuple[str, str]]:
    """``(package, subcommand)`` of every ``python -m sharpness|landscape SUB`` in the file's shell blocks."""
    return [
        command
        for info, body in fenced_blocks(path.read_text(encoding="utf-8"))
        if language(info) in ("bash", "sh", "console", "shell")
        for command in CLI.findall(body)
    ]


# The pages whose shell blocks run too, after their Python blocks and in the same folder (the Python blocks
# write the checkpoint, data and model file the commands read).
SHELL_FILES = ("getting-started.md", "index.md")
# Only the files that have something to check are parametrized: a test that can only skip checks nothing.
PYTHON_FILES = [p for p in DOC_FILES if python_blocks(p)]
COMMAND_FILES = [p for p in DOC_FILES if bash_commands(p)]


def test_the_checked_files_are_the_ones_with_examples():
    assert all(shell_blocks(ROOT / "docs" / name) for name in SHELL_FILES)
    names = {p.name for p in PYTHON_FILES}
    assert {"README.md", "getting-started.md", "math.md"} <= names  # the API tour, the jobs, the math
    assert {"README.md", "getting-started.md"} <= {p.name for p in COMMAND_FILES}


@pytest.mark.parametrize("path", PYTHON_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    blocks = python_blocks(path)
    script = tmp_path / "blocks.py"
    script.write_text(
        "\n".join(f"# --- block {i + 1} of {path.name}\n{body}" for i, body in enumerate(blocks)), encoding="utf-8"
    )
    shell = shell_blocks(path) if path.name in SHELL_FILES else []
    (tmp_path / "blocks.sh").write_text("set -euo pipefail\n" + "\n".join(shell), encoding="utf-8")
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        if result.returncode == 0 and shell:
            # `python` in the commands is the interpreter running the tests
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
            result = subprocess.run(["bash", "blocks.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                    timeout=HANG_GUARD_S)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the python blocks of {path.name} ran longer than {HANG_GUARD_S} s (hung?):\n{exc.stderr}")
    assert result.returncode == 0, (
        f"the python blocks of {path.name} failed (exit code {result.returncode}); the script is {script}\n"
        f"--- stderr:\n{result.stderr}"
    )


@pytest.mark.parametrize("path", DOC_FILES, ids=IDS)
def test_relative_links_exist(path: Path) -> None:
    broken = []
    for target in LINK.findall(without_code(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s):, mailto:, in-page anchors
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.name} links to missing files: {broken}"


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_subcommands_exist(path: Path) -> None:
    used = bash_commands(path)
    unknown = sorted({f"python -m {pkg} {sub}" for pkg, sub in used if sub not in all_subcommands()[pkg]})
    assert not unknown, f"{path.name} uses subcommands that do not exist: {unknown}"
