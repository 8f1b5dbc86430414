"""Training to a matched loss: the loop shared by the landscape demo and the built-in study populations."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sharpness._progress import progress_bar


@dataclass(frozen=True)
class TrainingRun:
    """How a `train_to_loss` run went: its batch size and learning rate, optimizer steps, epochs (steps
    times batch size over the data size), the final whole-data training loss and accuracy, wall seconds."""

    batch_size: int
    lr: float
    steps: int
    epochs: float
    loss: float
    accuracy: float
    seconds: float


def train_to_loss(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    lr: float,
    threshold: float,
    seed: int,
    max_steps: int = 50_000,
    progress: bool | None = None,
    optimizer: str = "sgd",
    check_every: int = 4,
    weight_decay: float = 0.0,
) -> TrainingRun:
    """SGD with momentum 0.9 (``optimizer="sgd"``) or Adam (``"adam"``) until the full training loss is at
    most ``threshold`` (checked every ``check_every`` steps, so runs stop close to the same loss whatever
    the batch size).

    Args:
        model: the network, trained in place (left in eval mode).
        X: ``(n, ...)`` inputs; y: ``(n,)`` class labels.
        batch_size: samples per step (the last batch of an epoch may be smaller).
        lr: learning rate.
        threshold: the mean cross-entropy over the whole of ``(X, y)`` to stop at.
        seed: seed of the mini-batch order.
        max_steps: steps before giving up.
        progress: show a progress bar (``None``: when stderr is a terminal).
        optimizer: ``"sgd"`` or ``"adam"``.
        check_every: steps between evaluations of the whole training loss.
        weight_decay: L2 penalty coefficient of the optimizer (0: none).

    Returns:
        The `TrainingRun`.

    Raises:
        RuntimeError: the loss did not reach ``threshold`` in ``max_steps`` steps, or diverged.
    """
    loss_fn = nn.CrossEntropyLoss()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    n = X.shape[0]
    start, steps, loss = time.perf_counter(), 0, float("inf")
    bar = progress_bar(None, f"training, batch {batch_size}", progress)
    model.train()
    while steps < max_steps:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad()
            loss_fn(model(X[idx]), y[idx]).backward()
            opt.step()
            steps += 1
            if steps % check_every == 0:
                with torch.no_grad():
                    loss = float(loss_fn(model(X), y))
                bar.update(check_every)
                bar.set_postfix(loss=f"{loss:.3g}")
                if loss <= threshold or np.isnan(loss) or loss == float("inf"):
                    break
        if loss <= threshold or np.isnan(loss) or (loss == float("inf") and steps >= check_every):
            break
    bar.close()
    model.eval()
    if not np.isfinite(loss) or loss > threshold:
        raise RuntimeError(
            f"training with batch {batch_size} and lr {lr} did not reach loss {threshold:g} in {steps} steps "
            f"(loss {loss:.3g}); lower the learning rate or raise the threshold"
        )
    with torch.no_grad():
        accuracy = float((model(X).argmax(1) == y).float().mean())
    return TrainingRun(batch_size, lr, steps, steps * batch_size / n, loss, accuracy, time.perf_counter() - start)
