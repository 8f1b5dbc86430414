"""Whole-data-set iteration in bounded chunks.

Accepted data: an ``(X, y)`` pair of tensors, a ``torch.utils.data.DataLoader``, or any iterable of
``(inputs, targets)`` batches (a one-shot iterator is read once and kept, since every
Hessian-vector product needs another pass over the data). Where several processes share the work, each
gets the whole data set and iterates only its own contiguous share of the samples (``shard``).

Every pass must see the same samples in the same order: a loader or iterable whose passes differ is refused
(`digest` of each pass against the first complete one), and processes that share a data set compare a
digest of all of it ([`ChunkedData.fingerprint`][sharpness.ChunkedData.fingerprint]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from sharpness.products._distributed import shard_range


class DataError(ValueError):
    """The data cannot be used (empty, mismatched lengths, wrong batch format)."""


def _is_pair(data: object) -> bool:
    return (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and isinstance(data[0], Tensor)
        and isinstance(data[1], Tensor)
    )


def _split_batch(batch: object) -> tuple[Tensor, Tensor]:
    if isinstance(batch, dict) and "X" in batch and "y" in batch:
        batch = (batch["X"], batch["y"])
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise DataError(
            f"each batch must be an (inputs, targets) pair, got {type(batch).__name__}; "
            "wrap your data so that iterating it yields (inputs, targets)"
        )
    x, y = batch
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise DataError("inputs and targets must be tensors")
    if x.dim() == 0 or y.dim() == 0:
        raise DataError(
            "a batch's inputs and targets need a leading samples axis, but one is a single value (a DataLoader with "
            "batch_size=None yields single samples); give the DataLoader a batch_size"
        )
    if x.shape[0] != y.shape[0]:
        raise DataError(f"inputs have {x.shape[0]} samples but targets have {y.shape[0]}; give one target per sample")
    if x.is_complex() or y.is_complex():
        raise DataError("inputs and targets must be real numbers; complex tensors are not supported")
    if x.dtype == torch.bool:
        raise DataError("inputs are booleans; give them as floating-point numbers (e.g. x.float())")
    if y.dtype == torch.bool:
        raise DataError(
            "targets are booleans; give class indices as integers (y.long()) or 0/1 regression targets as floats"
        )
    return x, y


# splitmix64's multipliers as signed 64-bit integers: torch has no uint64 arithmetic, and int64 wraps alike.
_K1, _K2 = -7046029254386353131, -4658895280553007687
# The digest of each pass reads at most this many values per sample (evenly strided): enough to see another order,
# another subset or a random augmentation, at a small fraction of a forward pass's cost.
PASS_DIGEST_VALUES = 128
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 (wrapping): unrelated values for neighbouring integers."""
    x = x * _K1
    x = x ^ (x >> 29)
    x = x * _K2
    return x ^ (x >> 32)


@functools.lru_cache(maxsize=16)
def _place_weights(size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Odd pseudo-random weights of the places ``1..size`` in a sample (kept: every batch of a pass uses them)."""
    return (_mix(torch.arange(1, size + 1, device=device)) | 1).to(dtype)


def digest(t: Tensor, start: int = 0, values: int | None = None) -> Tensor:
    """An order-sensitive digest of the samples ``t[i]`` (leading dimension), at positions ``start + i``: a 0-dim
    int64 tensor on ``t``'s device. Integer arithmetic on the values' bits, wrapping modulo 2**64, so it is exact
    and the same whatever the batching, thread count or device: the digests of consecutive batches add up to
    the digest of their concatenation. Each sample's values are weighted by their place in the sample and the
    sample by its place in the data, so reordered samples, swapped labels and transposed or shifted values change
    it (up to a collision, of chance about 2**-64).

    Args:
        t: ``(n, ...)`` real or integer tensor.
        start: position of ``t[0]`` in the data.
        values: read at most this many values per sample, evenly strided (``None``: all of them).
    """
    n = t.shape[0]
    if n == 0 or t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    flat = t.detach().reshape(n, -1)
    if values is not None and flat.shape[1] > values:
        flat = flat[:, :: -(-flat.shape[1] // values)]
    if flat.is_floating_point():
        flat = flat.view(_BITS[flat.element_size()])
    # Values of at most 4 bytes in 32-bit arithmetic: no 64-bit copy of the data (a quarter of the time).
    wide = torch.int64 if flat.element_size() == 8 else torch.int32
    weights = _place_weights(flat.shape[1], flat.device, wide)
    rows = (flat * weights).sum(1, dtype=wide).to(torch.int64)
    return (_mix(rows) * _mix(torch.arange(start + 1, start + n + 1, device=flat.device))).sum()


class _Pass(NamedTuple):
    """A complete pass over the data (or over one process's share): what every later pass must equal."""

    count: int  # samples
    digest: int  # of the samples in order (see digest)
    head: tuple[Tensor, Tensor]  # its first batch
    lead: Tensor  # the inputs of its first LEAD_SAMPLES samples (of the first batches whose inputs have one shape)


# Leading inputs a pass keeps (`ChunkedData.leading_inputs`: the samples the objective's sample check picks from)
LEAD_SAMPLES = 64


def _keep_leading(kept: list[Tensor], x: Tensor, count: int) -> bool:
    """Append to ``kept`` the first inputs of the batch ``x``, up to ``count`` inputs in all and while they have
    ``kept[0]``'s shape; whether more are wanted."""
    have = sum(t.shape[0] for t in kept)
    if have >= count or (kept and kept[0].shape[1:] != x.shape[1:]):
        return False
    kept.append(x[: count - have])
    return have + kept[-1].shape[0] < count


def _random_order(loader: DataLoader) -> bool:
    """Whether ``loader`` draws a new order (or subset) on every pass: a random sampler, itself or in its batch
    sampler."""
    random = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
    inner = loader.batch_sampler.sampler if isinstance(loader.batch_sampler, BatchSampler) else None
    return isinstance(loader.sampler, random) or isinstance(inner, random)


def _refuse_random_order(loader: DataLoader) -> None:
    if not _random_order(loader):
        return
    dropping = loader.drop_last and loader.batch_size is not None
    raise DataError(
        "the DataLoader shuffles (shuffle=True or a random sampler)"
        + (" and drops its last incomplete batch (drop_last=True)" if dropping else "")
        + f", so every pass over the data, and so every Hessian-vector product, would see "
        f"{'another subset of the samples' if dropping else 'them in another order'}; pass shuffle=False and no "
        "random sampler (the order does not change the objective)"
    )


class ChunkedData:
    """Re-iterable view of a data set as chunks of at most ``chunk_size`` samples.

    Args:
        data: ``(X, y)`` tensors with a leading sample dimension, a DataLoader, an iterable of
            ``(inputs, targets)`` batches, or another ``ChunkedData`` (its batches and share, re-chunked).
        chunk_size: largest number of samples per chunk (``None``: batches as given, a tensor pair
            in one chunk). Larger batches are split, never merged.
        shard: ``(rank, world_size)``: iterate only the share of process ``rank`` out of ``world_size``
            (`sharpness.products._distributed.shard_range` of the samples in order); ``None``: all.

    Every pass must yield the same samples in the same order. A DataLoader that shuffles is refused at once; the
    passes over any other loader or iterable (not over a tensor pair or a list of batches, which cannot change)
    are checked as they go: each complete pass's sample count and `digest` (of at most
    `PASS_DIGEST_VALUES` values per sample and every target: about 1 ms per pass over 1000 samples of
    3x32x32 on one CPU thread, against seconds for a ResNet-20 forward pass) must equal those of the first complete
    pass (the same share of it, with several processes), and a pass is refused as soon as it yields more samples
    than that. A pass its caller leaves midway is not compared; `first_batch` is the first batch of the first
    complete pass, so no pass that could go unchecked is ever the first.

    Raises:
        DataError: a bad ``chunk_size``, data of an unknown kind, a DataLoader that shuffles (or a shuffling
            DataLoader to be shared, or one with a sampler: each process would draw its own order); while
            iterating, a pass that differs from the first complete one: no samples (a one-shot iterable), another
            number of samples (an iterable that yields fewer or more batches, a loader that drops a random
            incomplete batch), or other values or order (a shuffling loader or sampler, random augmentation).
    """

    def __init__(self, data: object, chunk_size: int | None = None, shard: tuple[int, int] | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise DataError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.chunk_size = chunk_size
        self._total: int | None = None
        # labels_other_than, per label (shared with re-chunkings)
        self._not_label: dict[int, tuple[int, bool] | None] = {}
        # The first complete pass per share (None: the whole data), shared with re-chunkings: its sample count and
        # digest, which every later pass must equal, and its first batch (for first_batch).
        self._first_pass: dict[tuple[int, int] | None, _Pass] = {}
        # checks of every batch's inputs a pass reads (`check_inputs`), shared with re-chunkings
        self._input_checks: list[Callable[[Tensor], None]] = []
        if isinstance(data, ChunkedData):
            self._source: Iterable = data._source
            self._total = data._total
            self._not_label = data._not_label
            self._first_pass = data._first_pass
            self._input_checks = data._input_checks
            shard = data.shard if shard is None else shard
        elif _is_pair(data):
            x, y = _split_batch(data)
            self._source = [(x, y)]
        elif isinstance(data, Iterable):
            # An iterator can be traversed only once: keep its batches (each pass must see the same data).
            self._source = list(data) if isinstance(data, Iterator) else data
        else:
            raise DataError(
                f"data must be an (X, y) pair of tensors, a DataLoader or an iterable of batches, "
                f"got {type(data).__name__}"
            )
        if isinstance(self._source, DataLoader):
            _refuse_random_order(self._source)
        # A tensor pair or a list of batches yields the same batches on every pass: nothing to check.
        self._watched = not isinstance(self._source, (list, tuple))
        if shard is not None and shard[1] > 1 and isinstance(self._source, DataLoader):
            if not isinstance(self._source.sampler, SequentialSampler):
                raise DataError(
                    "a DataLoader that shuffles or samples cannot be shared between processes (each would draw its "
                    "own order, so their shares would overlap); pass shuffle=False and no sampler"
                )
        self.shard = shard if shard is not None and shard[1] > 1 else None
        self._n_samples: int | None = None

    def _split(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The source's batches as ``(inputs, targets)`` pairs, a stream's inputs checked (`check_inputs`)."""
        for batch in self._source:
            x, y = _split_batch(batch)
            if self._watched:  # batches held in memory were checked once, and cannot change
                for check in self._input_checks:
                    check(x)
            yield x, y

    def check_inputs(self, check: Callable[[Tensor], None]) -> None:
        """Check the inputs of every batch with ``check`` (raising `DataError`): those held in memory now, once; a
        stream's in its first complete pass, which comes before any forward (`first_batch`), and in every later one."""
        self._input_checks.append(check)
        if self._watched:
            self.total_samples  # noqa: B018 - the first complete pass
        else:
            for batch in self._source:
                check(_split_batch(batch)[0])

    def _checked(self, batches: Iterator[tuple[Tensor, Tensor]], key: tuple[int, int] | None
                 ) -> Iterator[tuple[Tensor, Tensor]]:  # fmt: skip
        """``batches``, one pass over the data (or over the share ``key``), compared with the first complete pass
        (see the class's description); the first complete pass becomes the reference."""
        if not self._watched:
            yield from batches
            return
        first = self._first_pass.get(key)
        count, total, head, lead = 0, None, None, []
        for x, y in batches:
            if first is None:
                _keep_leading(lead, x, LEAD_SAMPLES)
            part = digest(x, count, PASS_DIGEST_VALUES) + digest(y, count).to(x.device)
            total = part if total is None else total + part.to(total.device)
            head = (x, y) if head is None else head
            count += x.shape[0]
            if first is not None and count > first.count:
                raise DataError(_changed(count, first.count, during=True))
            yield x, y
        # Reached only when the pass is complete: a pass left midway is not compared.
        mine = 0 if total is None else int(total)
        if first is None:
            if count:
                self._first_pass[key] = _Pass(count, mine, head, lead[0] if len(lead) == 1 else torch.cat(lead))
        elif (count, mine) != (first.count, first.digest):
            raise DataError(_changed(count, first.count))

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The source's batches, cut to this process's share."""
        if self.shard is None:
            yield from self._checked(self._split(), None)
            return
        total = self.total_samples
        rank, world_size = self.shard
        if total < world_size:
            raise DataError(
                f"the data set has {total} sample{'s' if total != 1 else ''} but {world_size} processes share it; "
                "give at least one sample per process or start fewer processes"
            )
        yield from self._checked(self._share(*shard_range(total, rank, world_size)), self.shard)

    def _share(self, start: int, stop: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The samples ``[start, stop)`` of the source's batches."""
        offset = 0
        for x, y in self._split():
            if offset >= stop:
                break
            first, last = max(start - offset, 0), min(stop - offset, x.shape[0])
            if first < last:
                yield x[first:last], y[first:last]
            offset += x.shape[0]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        count = 0
        for x, y in self._batches():
            n = x.shape[0]
            step = n if self.chunk_size is None else self.chunk_size
            for start in range(0, n, max(step, 1)):
                count += min(step, n - start)
                yield x[start : start + step], y[start : start + step]
        if count == 0:
            raise DataError("the data set is empty; give at least one sample")
        self._n_samples = count

    @property
    def n_samples(self) -> int:
        """Number of samples this process iterates (one pass over the data the first time it is asked)."""
        if self._n_samples is None and self._reference() is not None:
            self._n_samples = self._reference().count
        if self._n_samples is None:
            for _ in self:
                pass
        return self._n_samples

    def _reference(self) -> _Pass | None:
        """This process's first complete pass, once there was one (only for data whose passes are checked)."""
        return self._first_pass.get(self.shard) if self._watched else None

    @property
    def total_samples(self) -> int:
        """Number of samples in the whole data set, every share together (counted once)."""
        if self.shard is None:
            return self.n_samples
        if self._total is None:
            self._total = sum(x.shape[0] for x, _ in self._checked(self._split(), None))
        return self._total

    def labels_other_than(self, label: int) -> tuple[int, bool] | None:
        """How many class labels of the whole data set (every share together) are not ``label``, and whether any is,
        by one pass over the targets (once); ``None`` where the targets are not class labels (integer tensors: one
        per sample, or several, such as one per token or pixel)."""
        if label not in self._not_label:
            count, some = 0, False
            for _, y in self._checked(self._split(), None):
                if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() == 0:
                    self._not_label[label] = None
                    return None
                kept = int((y != label).sum())
                count, some = count + kept, some or kept < y.numel()
            self._not_label[label] = (count, some)
        return self._not_label[label]

    def fingerprint(self) -> tuple[int, int, int]:
        """The whole data set's sample count and the `digest` of all its inputs and of all its targets (one
        pass): processes that share a data set compare theirs, so a process given other data, only its own part,
        or the same samples in another order is caught."""
        count, inputs, targets = 0, 0, 0
        for x, y in self._checked(self._split(), None):
            inputs += int(digest(x, count))
            targets += int(digest(y, count))
            count += x.shape[0]
        self._total = count
        wrap = 1 << 64  # the digests' sums wrap as theirs do: the same result however the data are batched
        return count, (inputs + wrap // 2) % wrap - wrap // 2, (targets + wrap // 2) % wrap - wrap // 2

    def leading_inputs(self, count: int) -> Tensor:
        """The inputs of this process's first ``count`` samples (at most `LEAD_SAMPLES`; fewer where it has fewer),
        whatever the chunk size, from as many of the source's batches as hold them (while their inputs have one shape):
        where passes are checked, those the first complete pass kept."""
        if self._watched:
            self.first_batch()  # the reference pass, made if there was none
            return self._reference().lead[:count]
        kept: list[Tensor] = []
        for x, _ in self._batches():
            if not _keep_leading(kept, x, count):
                break
        if not kept:
            raise DataError("the data set is empty; give at least one sample")
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def first_batch(self) -> tuple[Tensor, Tensor]:
        """The first chunk of this process's samples. Where passes are checked, it comes from the first complete
        pass (made now if there was none): a pass left after its first batch could not be checked, and would
        leave a one-shot iterable (or one that yields less after its first pass) short of what it yielded."""
        if self._watched:
            if self._reference() is None:
                self.n_samples  # noqa: B018 - one complete pass, the reference of every later one
            x, y = self._reference().head
            step = x.shape[0] if self.chunk_size is None else self.chunk_size
            return x[:step], y[:step]
        for batch in self:
            return batch
        raise DataError("the data set is empty; give at least one sample")


def _changed(count: int, first: int, during: bool = False) -> str:
    """Why a pass over the data that yielded ``count`` samples (``during``: so far) differs from the first complete
    one (``first`` samples), with the likely cause and the fix."""
    if count == 0:
        return (
            f"the data yielded no samples on this pass after {first} on the first: it is a one-shot iterable (a "
            "generator, or an IterableDataset whose __iter__ does not start over), but every value, gradient and "
            "Hessian-vector product reads the data again; give a list of batches, an (X, y) pair of tensors or a "
            "DataLoader over a map-style Dataset"
        )
    if count != first:
        said = f"more than the {first} samples of its first pass" if during else f"{count} samples on this pass and"
        return (
            f"the data yielded {said}{'' if during else f' {first} on the first'}: an iterable that yields fewer or "
            "more batches after its first pass, or a loader that drops a random incomplete batch, gives every value, "
            "gradient and Hessian-vector product other samples; give data that yield the same batches on every pass "
            "(a DataLoader with shuffle=False)"
        )
    return (
        f"the data yielded the same number of samples ({count}) on this pass as on the first but other values or "
        "another order: a shuffling loader (shuffle=True, a random sampler) or random augmentation gives every "
        "value, gradient and Hessian-vector product other data; pass shuffle=False, no random sampler and no random "
        "transforms"
    )


def cast_batch(
    x: Tensor, y: Tensor, dtype: torch.dtype | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Move a batch to ``device`` (detached); floating tensors also to ``dtype``; integer targets (class labels) to
    int64.

    Every integer dtype converts to int64 exactly. Losses read other integer dtypes differently or not at all:
    ``cross_entropy`` takes uint8 labels, but indexing with a uint8 tensor selects by mask, not by index.

    Raises:
        DataError: a tensor on the meta device (no values).
    """
    # From the host to a GPU the copy need not wait for the device (the other way round it must).
    if x.is_meta or y.is_meta:
        raise DataError("the data are on the meta device and hold no values; give tensors with values")
    ahead = device.type == "cuda" and x.device.type == "cpu"
    x, y = x.detach(), y.detach()  # data are constants of the objective, even inputs that require gradients
    x = x.to(device=device, dtype=dtype if dtype is not None and x.is_floating_point() else None, non_blocking=ahead)
    y = y.to(device=device, dtype=(dtype if dtype is not None else None) if y.is_floating_point() else torch.int64,
             non_blocking=ahead)  # fmt: skip
    return x, y
