"""Freed memory kept for reuse (``sharpness.products._heap``): measured by the page faults of reallocating it."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from sharpness.products._heap import ENV

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# Allocates 96 MiB as twelve 8 MiB tensors, frees them, and counts the page faults of doing it again.
_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from sharpness.products._heap import retain_freed_memory
    applied = retain_freed_memory() if sys.argv[1] == "retain" else None
    def touch():
        blocks = [torch.empty(2 * 2**20).fill_(1.0) for _ in range(12)]
        del blocks
    touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touch()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _run(mode: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if k != ENV} | env
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True,
                         env=environment).stdout.split()  # fmt: skip
    return out[0], int(out[1])


def test_freed_memory_is_reused_without_page_faults():
    applied, faults = _run("retain")
    assert applied == "True"
    # 96 MiB is 24576 pages: reused, not mapped afresh. Measured 0-2048 (an 8 MiB block mapped again once, on a
    # loaded machine); the control without the settings maps nearly all of them (24555).
    assert faults < 24576 // 4


def test_the_allocator_left_alone_faults_on_every_reuse():
    """The control: the same reallocation without the settings touches most of the pages afresh."""
    assert _run("leave")[1] > 12000


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_can_opt_out(value):
    applied, faults = _run("retain", **{ENV: value})
    assert applied == "False"
    assert faults > 12000
