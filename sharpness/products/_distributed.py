"""Data-parallel evaluation across the processes of a ``torch.distributed`` group.

Every process holds the whole data set and evaluates only its own contiguous share of the samples
(`shard_range`: shares differ in size by at most one sample, nothing is padded or repeated). The
loss, gradient and Hessian-vector products are sums over samples with each sample weighted once, so each
process adds up its share and one ``all_reduce`` per operator application gives every process the whole
sum. Every process then runs the same solver on the same reduced numbers; what could still differ between
them is made the same by `Communicator`: random vectors are drawn on process 0 and broadcast, and
the stopping decisions of the solvers are process 0's.

A single process uses `SINGLE_PROCESS`, whose collectives do nothing, so the code paths are the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class DistributedError(RuntimeError):
    """A collective operation failed: another process stopped, raised or did not answer within the group's
    timeout (``torch.distributed.init_process_group(timeout=...)``)."""


def shard_range(n_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """The samples ``[start, stop)`` process ``rank`` of ``world_size`` evaluates out of ``n_samples``:
    contiguous shares whose sizes differ by at most one."""
    return rank * n_samples // world_size, (rank + 1) * n_samples // world_size


class Communicator:
    """One process: every collective is the identity. `ProcessGroupCommunicator` is the distributed one.

    Attributes:
        rank: this process's number (0 for one process).
        world_size: number of processes sharing the data.
    """

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this is process 0, the one that prints and writes files."""
        return self.rank == 0

    def sum_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` in place by its sum over the processes and return it."""
        return tensor

    def max_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` in place by its element-wise maximum over the processes and return it."""
        return tensor

    def broadcast_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` in place by process 0's and return it (random draws, so all processes share one)."""
        return tensor

    def agree(self, flag: bool) -> bool:
        """Process 0's ``flag`` on every process: one decision (a solver's stopping rule) for all of them."""
        return bool(flag)

    def choose(self, value: str, options: tuple[str, ...]) -> str:
        """Process 0's ``value`` (one of ``options``) on every process: a choice made by timing, which
        could differ between processes, is made once."""
        return value

    def gather_text(self, text: str) -> list[str]:
        """Every process's ``text``, in rank order."""
        return [text]

    def check_together(self, error: BaseException | None) -> None:
        """Raise on every process when any process has an ``error``: its own, else the first other process's
        message as a `ValueError` naming that process. Validation that could fail on one process only
        (its share of the data) goes through here, so no process is left waiting for another."""
        if error is not None:
            raise error


SINGLE_PROCESS = Communicator()


def shared(error: BaseException) -> BaseException:
    """``error``, marked as raised on every process alike (``shared_by_all_processes``): the command lines
    let process 0 alone report it."""
    error.shared_by_all_processes = True
    return error


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class ProcessGroupCommunicator(Communicator):
    """The processes of an initialized ``torch.distributed`` group (``None``: the default group).

    Small tensors (flags, choices) travel on the backend's device: the current CUDA device for NCCL, the CPU
    otherwise. A collective that fails (another process stopped or timed out) raises `DistributedError`.

    Raises:
        ValueError: ``torch.distributed`` has no initialized process group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "distributed evaluation needs an initialized process group: call "
                "torch.distributed.init_process_group() in every process first (torchrun sets up its environment)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None

    def _small(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self._device or "cpu")

    def _run(self, what: str, operation) -> None:
        try:
            operation()
        except (RuntimeError, dist.DistError) as exc:
            reason = _first_line(exc)
            raise DistributedError(
                f"process {self.rank} of {self.world_size}: {what} failed because another process stopped or did "
                f"not answer within the group's timeout ({reason})"
            ) from exc

    def _in_place(self, what: str, tensor: Tensor, operation) -> Tensor:
        """``operation(t)`` on ``tensor``, through a copy on the backend's device where it lives elsewhere (NCCL
        only moves CUDA tensors)."""
        moved = tensor if self._device is None or tensor.device == self._device else tensor.to(self._device)
        self._run(what, lambda: operation(moved))
        return tensor if moved is tensor else tensor.copy_(moved)

    def sum_(self, tensor: Tensor) -> Tensor:
        return self._in_place("summing over the processes", tensor,
                              lambda t: dist.all_reduce(t, dist.ReduceOp.SUM, self.group))  # fmt: skip

    def max_(self, tensor: Tensor) -> Tensor:
        return self._in_place("a maximum over the processes", tensor,
                              lambda t: dist.all_reduce(t, dist.ReduceOp.MAX, self.group))  # fmt: skip

    def broadcast_(self, tensor: Tensor) -> Tensor:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return self._in_place("a broadcast from process 0", tensor, lambda t: dist.broadcast(t, source, self.group))

    def agree(self, flag: bool) -> bool:
        return bool(self.broadcast_(self._small([int(bool(flag))]))[0])

    def choose(self, value: str, options: tuple[str, ...]) -> str:
        return options[int(self.broadcast_(self._small([options.index(value)]))[0])]

    def gather_text(self, text: str) -> list[str]:
        # Bytes in int64 tensors (every backend reduces those), padded to the longest.
        data = list(text.encode("utf-8"))
        lengths = [self._small([0]) for _ in range(self.world_size)]
        self._run("gathering messages", lambda: dist.all_gather(lengths, self._small([len(data)]), self.group))
        longest = max(int(n[0]) for n in lengths)
        parts = [self._small([0] * longest) for _ in range(self.world_size)]
        mine = self._small(data + [0] * (longest - len(data)))
        self._run("gathering messages", lambda: dist.all_gather(parts, mine, self.group))
        return [bytes(p[: int(n[0])].tolist()).decode("utf-8") for p, n in zip(parts, lengths)]

    def check_together(self, error: BaseException | None) -> None:
        messages = self.gather_text("" if error is None else _first_line(error))
        if error is not None:
            raise shared(error)
        failed = [(rank, text) for rank, text in enumerate(messages) if text]
        if failed:
            rank, text = failed[0]
            raise shared(ValueError(f"process {rank}: {text}"))


def communicator(distributed: bool | dist.ProcessGroup | Communicator) -> Communicator:
    """The communicator an [`Objective`][sharpness.Objective] argument names: ``False`` one process, ``True`` the
    default ``torch.distributed`` group, a ``ProcessGroup`` that group, a `Communicator` itself."""
    if isinstance(distributed, Communicator):
        return distributed
    if distributed is False or distributed is None:
        return SINGLE_PROCESS
    if distributed is True:
        return ProcessGroupCommunicator()
    if isinstance(distributed, dist.ProcessGroup):
        return ProcessGroupCommunicator(distributed)
    raise ValueError(f"distributed must be True, False or a torch.distributed.ProcessGroup, got {distributed!r}")


__all__ = ["SINGLE_PROCESS", "Communicator", "DistributedError", "ProcessGroupCommunicator", "communicator",
           "shard_range", "shared"]  # fmt: skip
