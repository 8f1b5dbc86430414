"""One registry of small test problems shared by every test module.

Each case is a model, a loss and a small data set, built deterministically from a seed, in float64
by default. Sizes are small enough for dense ``torch.func.hessian`` references (n <= ~300).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def mlp(widths: list[int], bias: bool = True, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """``Linear(w0,w1) act Linear(w1,w2) act ... Linear`` as an ``nn.Sequential`` (keys 0, 2, 4...)."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1], bias=bias))
        if i < len(widths) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


def moved_copy(model: nn.Module, seed: int, move) -> nn.Module:
    """A copy of ``model`` whose parameters ``move(params, generator)`` changes in place (``{name: parameter}``, no
    gradients recorded; the generator seeded with ``seed``)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        move(dict(twin.named_parameters()), torch.Generator().manual_seed(seed))
    return twin


def token_classification(model: nn.Module, width: int, seed: int = 0):
    """``model`` in float64 eval mode with its parameters moved off the initialization (``+ 0.3 N(0, 1)``: LayerNorm
    scales off 1, biases off 0), cross-entropy, and 5 samples of 4 tokens of ``width`` features in 3 classes."""
    torch.manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(5, 4, width, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))


def small_cnn(bias: bool = True) -> nn.Sequential:
    """Input 1x6x6: conv3x3(2) relu maxpool2 conv3x3 pad1 (3) relu flatten linear(12,4) relu linear(4,3)."""
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2, 3, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(12, 4, bias=bias),
        nn.ReLU(),
        nn.Linear(4, 3, bias=bias),
    )


def negated_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-MSE``: a loss whose Hessian has a dominant negative eigenvalue (mean reduction)."""
    return -((output - target) ** 2).mean()


@dataclass
class Case:
    name: str
    model: nn.Module
    loss_fn: Callable
    X: torch.Tensor
    y: torch.Tensor

    @property
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.X, self.y


def _classification(model: nn.Module, x_shape: tuple[int, ...], n: int, classes: int, g: torch.Generator):
    X = torch.randn(n, *x_shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return nn.CrossEntropyLoss(), X, y


def _build(name: str, g: torch.Generator) -> tuple[nn.Module, Callable, torch.Tensor, torch.Tensor]:
    if name == "mlp_bias":  # unequal widths, with biases
        model = mlp([5, 4, 6, 3])
        return (model, *_classification(model, (5,), 23, 3, g))
    if name == "mlp_nobias":
        model = mlp([5, 7, 3, 4, 2], bias=False)
        return (model, *_classification(model, (5,), 23, 2, g))
    if name == "mlp_wide":  # fewer samples than input features: data-span coordinates apply
        model = mlp([10, 6, 4, 3])
        return (model, *_classification(model, (10,), 7, 3, g))
    if name == "cnn":
        model = small_cnn()
        return (model, *_classification(model, (1, 6, 6), 11, 3, g))
    if name == "mlp_mse_sum":  # regression, sum reduction
        model = mlp([3, 5, 2])
        X = torch.randn(17, 3, generator=g, dtype=torch.float64)
        y = torch.randn(17, 2, generator=g, dtype=torch.float64)
        return model, nn.MSELoss(reduction="sum"), X, y
    if name == "negative_dominant":
        model = mlp([3, 4, 2])
        X = torch.randn(19, 3, generator=g, dtype=torch.float64)
        y = torch.randn(19, 2, generator=g, dtype=torch.float64)
        return model, negated_mse, X, y
    raise KeyError(name)


CASE_NAMES = ("mlp_bias", "mlp_nobias", "mlp_wide", "cnn", "mlp_mse_sum", "negative_dominant")
RESCALABLE_CASES = ("mlp_bias", "mlp_nobias", "mlp_wide", "cnn")


def make_case(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Case:
    """Build case ``name`` deterministically (parameters perturbed off initialisation, eval mode)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model, loss_fn, X, y = _build(name, g)
    with torch.no_grad():  # move away from init so no point is special (non-critical, non-zero biases)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model = model.to(dtype).eval()
    X = X.to(dtype)
    if y.is_floating_point():
        y = y.to(dtype)
    return Case(name, model, loss_fn, X, y)
