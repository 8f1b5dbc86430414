"""The command lines under ``torchrun``: one process per device, joined in a ``torch.distributed`` group.

``torchrun --nproc_per_node=N -m sharpness compute ...`` starts N copies of the command with ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK`` in their environment. Each checks its command line (the same on every process, so
a bad option fails every process alike and process 0 says so), joins the group (NCCL on CUDA devices, gloo
otherwise), loads its checkpoint and data and checks them, and then `confirm_inputs`: every process
says whether its inputs were usable, so one whose files are missing or differ makes every process stop at once,
process 0 naming it, instead of leaving the others waiting for it. Each then evaluates its share of the
samples. Only process 0 prints results and writes files.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from sharpness._specs import SpecError
from sharpness.products._distributed import SINGLE_PROCESS, Communicator, ProcessGroupCommunicator

DEFAULT_TIMEOUT_S = 1800.0

# The group joined by join_processes, until its processes have confirmed their inputs (confirm_inputs).
_unconfirmed: list[Communicator] = []


def launched_processes() -> int:
    """How many processes ``torchrun`` started for this command (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_rank() -> int:
    """This process's number among them (0 without ``torchrun``)."""
    return int(os.environ.get("RANK", "0"))


def process_device(device: torch.device) -> torch.device:
    """The device this process evaluates on: under ``torchrun`` with several processes, ``cuda`` means the
    process's own GPU, ``cuda:LOCAL_RANK``.

    Raises:
        SpecError: several processes and a numbered CUDA device (they would all use that one), or more
            processes on this machine than it has CUDA devices.
    """
    if launched_processes() <= 1 or device.type != "cuda":
        return device
    if device.index is not None:
        raise SpecError(f"--device {device} names one GPU for every process; under torchrun pass --device cuda "
                        "and each process uses its own, cuda:LOCAL_RANK")  # fmt: skip
    # Judged on the processes of this machine, not on this process's number, so that all of them refuse alike.
    here, count = int(os.environ.get("LOCAL_WORLD_SIZE", launched_processes())), torch.cuda.device_count()
    if here > count:
        raise SpecError(f"torchrun started {here} processes on this machine but it has {count} CUDA device(s); "
                        f"use --nproc_per_node={count} or fewer")  # fmt: skip
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def join_processes(device: torch.device, timeout_s: float) -> Communicator:
    """The default process group under ``torchrun`` (initialized here: NCCL for CUDA, gloo otherwise, every
    exchange waiting at most ``timeout_s`` seconds), or `SINGLE_PROCESS` without it. A group initialized
    here waits for `confirm_inputs`."""
    if launched_processes() <= 1:
        return SINGLE_PROCESS
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
        _unconfirmed[:] = [ProcessGroupCommunicator()]
    return ProcessGroupCommunicator()


def confirm_inputs(error: BaseException | None = None) -> None:
    """Once after joining, before any other exchange: every process says whether it could read and check its
    inputs (``error``: why not). Where one could not, every process raises (its own error, or a ``ValueError``
    naming the process that failed and why), marked as shared so that process 0 alone reports it. Does nothing
    without a group waiting for it (one process, or inputs already confirmed).

    Raises:
        DistributedError: another process stopped before confirming.
    """
    if _unconfirmed:
        _unconfirmed.pop().check_together(error)


def leave_processes() -> None:
    """Leave the process group, if one was joined (the other processes then stop waiting for this one)."""
    _unconfirmed.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def quiet_process() -> bool:
    """Whether this process keeps its output to itself: every process but process 0 under ``torchrun``."""
    return launched_processes() > 1 and launch_rank() != 0
