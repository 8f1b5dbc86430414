"""Whole-data-set iteration in bounded chunks.

Accepted data: an ``(X, y)`` pair of tensors, a ``torch.utils.data.DataLoader``, or any iterable of
``(inputs, targets)`` batches (a one-shot iterator is read once and kept, since every
Hessian-vector product needs another pass over the data).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor


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
            ``(inputs, targets)`` batches, or another ``ChunkedData`` (its batches, re-chunked).
        chunk_size: largest number of samples per chunk (``None``: batches as given, a tensor pair
            in one chunk). Larger batches are split, never merged.
    """

    def __init__(self, data: object, chunk_size: int | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise DataError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.chunk_size = chunk_size
        if isinstance(data, ChunkedData):
            self._source: Iterable = data._source
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
        self._n_samples: int | None = None

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        count = 0
        for batch in self._source:
            x, y = _split_batch(batch)
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
        """Number of samples (one pass over the data the first time it is asked)."""
        if self._n_samples is None:
            for _ in self:
                pass
        return self._n_samples

    def first_batch(self) -> tuple[Tensor, Tensor]:
        for batch in self:
            return batch
        raise DataError("the data set is empty; give at least one sample")


def cast_batch(
    x: Tensor, y: Tensor, dtype: torch.dtype | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Move a batch to ``device``; floating tensors also to ``dtype``; integer targets (class labels) to int64.

    Every integer dtype converts to int64 exactly. Losses read other integer dtypes differently or not at all:
    ``cross_entropy`` takes uint8 labels, but indexing with a uint8 tensor selects by mask, not by index."""
    x = x.to(device=device, dtype=dtype if dtype is not None and x.is_floating_point() else None)
    y = y.to(device=device, dtype=(dtype if dtype is not None else None) if y.is_floating_point() else torch.int64)
    return x, y
