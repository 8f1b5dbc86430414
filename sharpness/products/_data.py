"""Whole-data-set iteration in bounded chunks.

Accepted data: an ``(X, y)`` pair of tensors, a ``torch.utils.data.DataLoader``, or any iterable of
``(inputs, targets)`` batches (a one-shot iterator is read once and kept, since every
Hessian-vector product needs another pass over the data). Where several processes share the work, each
gets the whole data set and iterates only its own contiguous share of the samples (``shard``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, SequentialSampler

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


class ChunkedData:
    """Re-iterable view of a data set as chunks of at most ``chunk_size`` samples.

    Args:
        data: ``(X, y)`` tensors with a leading sample dimension, a DataLoader, an iterable of
            ``(inputs, targets)`` batches, or another ``ChunkedData`` (its batches and share, re-chunked).
        chunk_size: largest number of samples per chunk (``None``: batches as given, a tensor pair
            in one chunk). Larger batches are split, never merged.
        shard: ``(rank, world_size)``: iterate only the share of process ``rank`` out of ``world_size``
            (:func:`sharpness.products._distributed.shard_range` of the samples in order); ``None``: all.

    Raises:
        DataError: a bad ``chunk_size``, data of an unknown kind, or a shuffling DataLoader to be shared
            (each process would shuffle differently, so shares would overlap).
    """

    def __init__(self, data: object, chunk_size: int | None = None, shard: tuple[int, int] | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise DataError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.chunk_size = chunk_size
        self._total: int | None = None
        self._not_label: dict[int, int | None] = {}  # labels_other_than, per label (shared with re-chunkings)
        if isinstance(data, ChunkedData):
            self._source: Iterable = data._source
            self._total = data._total
            self._not_label = data._not_label
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
        if shard is not None and shard[1] > 1 and isinstance(self._source, DataLoader):
            if not isinstance(self._source.sampler, SequentialSampler):
                raise DataError(
                    "a DataLoader that shuffles or samples cannot be shared between processes (each would draw its "
                    "own order, so their shares would overlap); pass shuffle=False and no sampler"
                )
        self.shard = shard if shard is not None and shard[1] > 1 else None
        self._n_samples: int | None = None

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The source's batches, cut to this process's share."""
        if self.shard is None:
            for batch in self._source:
                yield _split_batch(batch)
            return
        rank, world_size = self.shard
        total = self.total_samples
        if total < world_size:
            raise DataError(
                f"the data set has {total} sample{'s' if total != 1 else ''} but {world_size} processes share it; "
                "give at least one sample per process or start fewer processes"
            )
        start, stop = shard_range(total, rank, world_size)
        offset = 0
        for batch in self._source:
            if offset >= stop:
                break
            x, y = _split_batch(batch)
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
        if self._n_samples is None:
            for _ in self:
                pass
        return self._n_samples

    @property
    def total_samples(self) -> int:
        """Number of samples in the whole data set, every share together (counted once)."""
        if self.shard is None:
            return self.n_samples
        if self._total is None:
            self._total = sum(_split_batch(batch)[0].shape[0] for batch in self._source)
        return self._total

    def labels_other_than(self, label: int) -> int | None:
        """How many targets of the whole data set (every share together) are not ``label``, by one pass over
        the targets (once); ``None`` where the targets are not class labels (integer, one per sample)."""
        if label not in self._not_label:
            count: int | None = 0
            for batch in self._source:
                _, y = _split_batch(batch)
                if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() != 1:
                    count = None
                    break
                count += int((y != label).sum())
            self._not_label[label] = count
        return self._not_label[label]

    def fingerprint(self) -> tuple[int, float, float]:
        """The whole data set's sample count and the float64 sums of its inputs and targets: processes that share
        a data set compare theirs, so a process given other data (or only its own part) is caught."""
        count, x_sum, y_sum = 0, 0.0, 0.0
        for batch in self._source:
            x, y = _split_batch(batch)
            count += x.shape[0]
            x_sum += float(x.detach().sum(dtype=torch.float64))  # no float64 copy of the data
            y_sum += float(y.detach().sum(dtype=torch.float64))
        self._total = count
        return count, x_sum, y_sum

    def first_batch(self) -> tuple[Tensor, Tensor]:
        for batch in self:
            return batch
        raise DataError("the data set is empty; give at least one sample")


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
