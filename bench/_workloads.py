"""Benchmark workloads shared by the scripts in ``bench/``: small ReLU networks, synthetic data, a
brief deterministic training run so the point is not the initialization.

F1: MLP 784-300-100-10 with biases (``nn.Sequential`` of ``Linear``/``ReLU``), 266,610 parameters.
C1: the small CNN of the scale-invariant flatness paper on 1x28x28 inputs: conv 5x5 (1->10) - relu -
    maxpool 2 - conv 5x5 (10->20) - relu - maxpool 2 - flatten - FC 320-120 - relu - 120-84 - relu -
    84-10, 54,814 parameters.
V1: VGG11 with BatchNorm exactly as torchvision's ``vgg11_bn`` builds it (no torchvision needed): 3x3 convolutions
    64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M (each with BatchNorm and ReLU), AdaptiveAvgPool(7, 7),
    classifier Linear(25088, 4096) - ReLU - Dropout - Linear(4096, 4096) - ReLU - Dropout - Linear(4096, 1000) (dropout
    off in eval), torchvision's initialisation (conv: Kaiming normal fan-out, biases 0; BatchNorm 1 and 0; linear:
    N(0, 0.01), biases 0); 132,868,840 parameters; not trained (see `vgg_workload`).
T1: the built-in vision transformer (``sharpness._vit.ViT``: 2x2 patches of an 8x8 image, 16 tokens) with width
    32, 4 heads of size 8, 2 pre-LayerNorm blocks, ReLU MLPs of width 64, ``nn.MultiheadAttention``; 18,154 parameters.
L1: a LLaMA-style transformer on the same 16 tokens of 4 features: width 32, 4 heads of size 8, 2 pre-norm blocks
    with ``nn.RMSNorm``, causal ``F.scaled_dot_product_attention`` on rotary-embedded queries and keys (HuggingFace's
    ``rotate_half``), SwiGLU MLPs of width 48, no biases in the blocks, a final RMSNorm, the token mean and a Linear
    head; 18,058 parameters. Not part of the default set (``--workloads`` names it), since no target is set on it.

Data: Gaussian inputs, labels uniform in 10 classes, cross-entropy (mean over samples). Everything
is seeded, so two calls give bit-identical models and data on the same machine.

Also the ``--device`` option every script shares (:func:`add_device_argument`) and the clock that counts the work
queued on a GPU (:func:`sync`, :func:`clock`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

N_CLASSES = 10


def mlp_f1() -> nn.Sequential:
    """F1: 784-300-100-10 ReLU MLP with biases."""
    return nn.Sequential(nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(), nn.Linear(100, N_CLASSES))


def cnn_c1() -> nn.Sequential:
    """C1: the scale-invariant flatness paper's small CNN (LeNet-like) for 1x28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 10, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(10, 20, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(320, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, N_CLASSES),
    )


def vit_t1() -> nn.Module:
    """T1: the built-in ViT, width 32, 4 heads, 2 pre-LayerNorm blocks, for (N, 64) inputs."""
    from sharpness._vit import ViT

    return ViT(dim=32, heads=4, depth=2)


class _LlamaBlock(nn.Module):
    """L1's block on ``(N, T, D)``: ``x + attention(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, dim: int, heads: int, tokens: int, hidden: int):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        angles = torch.outer(torch.arange(tokens, dtype=torch.float32), freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def _rope(self, t: Tensor) -> Tensor:
        half = t.shape[-1] // 2
        return t * self.cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * self.sin

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (m(h).view(b, t, self.heads, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """L1: a LLaMA-style transformer for ``(N, 64)`` inputs read as 16 tokens of 4 features."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2, hidden: int = 48, tokens: int = 16):
        super().__init__()
        self.tokens, self.embed = tokens, nn.Linear(4, dim)
        self.blocks = nn.Sequential(*(_LlamaBlock(dim, heads, tokens, hidden) for _ in range(depth)))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(x.unflatten(1, (self.tokens, -1))))).mean(dim=1))


class VGG(nn.Module):
    """torchvision's ``VGG`` layout: ``features``, ``avgpool``, ``classifier`` (the same parameter names)."""

    def __init__(self, layers: list[int | str], classes: int = 1000):
        super().__init__()
        modules: list[nn.Module] = []
        channels = 3
        for item in layers:
            if item == "M":
                modules.append(nn.MaxPool2d(2, 2))
            else:
                modules += [nn.Conv2d(channels, int(item), 3, padding=1), nn.BatchNorm2d(int(item)), nn.ReLU()]
                channels = int(item)
        self.features = nn.Sequential(*modules)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(nn.Linear(channels * 49, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 4096),
                                        nn.ReLU(), nn.Dropout(), nn.Linear(4096, classes))  # fmt: skip
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg11_bn(classes: int = 1000) -> VGG:
    """V1: torchvision's ``vgg11_bn`` (configuration "A" with BatchNorm), built by hand."""
    return VGG([64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"], classes)


def vgg_workload(samples: int = 2, size: int = 32, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """V1 at its initialisation (zero biases and BatchNorm shifts included: 14,709 exact zeros), BatchNorm running
    statistics from the data, eval mode; ``samples`` Gaussian ``3 x size x size`` images with labels in 1000
    classes. Too large to train here: the point is the projection's cost, which does not depend on training."""
    torch.manual_seed(seed)
    model = vgg11_bn()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(samples, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (samples,), generator=g)
    model.train()
    with torch.no_grad():
        model(X)
    return model.eval(), X, y


# name: (builder, input shape, description, (Adam learning rate, steps) of the brief training)
_BUILDERS = {
    "F1": (mlp_f1, (784,), "MLP 784-300-100-10 (biases)", (1e-4, 100)),
    "C1": (cnn_c1, (1, 28, 28), "CNN conv5x5(1-10)-pool-conv5x5(10-20)-pool-FC 320-120-84-10", (5e-4, 50)),
    "T1": (vit_t1, (64,), "ViT width 32, 4 heads, 2 pre-LN blocks, MHA, 2x2 patches of 8x8", (1e-3, 50)),
    "L1": (Llama, (64,), "LLaMA-style, width 32, 4 heads, 2 RMSNorm blocks, rotary SDPA, SwiGLU", (1e-3, 50)),
}
WORKLOADS = tuple(_BUILDERS)
DEFAULT_WORKLOADS = ("F1", "C1", "T1")  # the ones the issues set targets on


@dataclass
class Workload:
    """A model at a briefly trained point, its data and its loss."""

    name: str
    description: str
    model: nn.Module
    loss_fn: nn.Module
    X: Tensor
    y: Tensor
    train_steps: int
    final_train_loss: float

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def n_samples(self) -> int:
        return int(self.X.shape[0])


def build_model(name: str) -> nn.Module:
    """A freshly initialized model of workload ``name`` (uses the global torch RNG)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return _BUILDERS[name][0]()


def make_data(name: str, n_samples: int = 500, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Gaussian inputs of the workload's shape and uniform random labels in 10 classes (float32)."""
    shape = _BUILDERS[name][1]
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn((n_samples, *shape), generator=gen)
    y = torch.randint(0, N_CLASSES, (n_samples,), generator=gen)
    return X, y


def make_workload(
    name: str, n_samples: int = 500, steps: int | None = None, lr: float | None = None, seed: int = 0
) -> Workload:
    """Build workload ``name`` ("F1" or "C1"), trained ``steps`` full-batch Adam steps from ``seed``.

    The defaults (F1: 100 steps at lr 1e-4, C1: 50 steps at 5e-4; a C1 step costs ~10x an F1 step)
    leave the training loss around 1-2: away from the initialization but not at an interpolating
    point, where the softmax
    saturates and float32 loses digits of the Hessian itself (at a memorized point float32 and
    float64 top eigenvalues of F1 differ by ~4e-5 relative, so a 1e-5 accuracy target would be
    meaningless for float32 solvers).

    The model is returned in eval mode with ``requires_grad`` parameters and no ``.grad``.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    _, _, description, (default_lr, default_steps) = _BUILDERS[name]
    lr = default_lr if lr is None else lr
    steps = default_steps if steps is None else steps
    X, y = make_data(name, n_samples, seed)
    torch.manual_seed(seed)
    model = build_model(name)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(X), y)
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        final = float(loss_fn(model(X), y))
    return Workload(name, description, model, loss_fn, X, y, steps, final)


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` (default ``cpu``): where the model and data go; a GPU's work is waited for before every clock
    read. Thread options keep acting on the CPU only."""
    parser.add_argument("--device", type=_device, default="cpu",
                        help="cpu (default) or cuda[:N]: the model and data are moved there, every timer waits for "
                             "the GPU, memory figures are the GPU's peak allocation")  # fmt: skip


def use_device(parser: argparse.ArgumentParser, device: torch.device) -> None:
    """Refuse a GPU this machine does not have (one line, exit status 2). On a GPU, float32 stays float32: TF32
    (10-bit mantissas in cuDNN's convolutions, on by default) is turned off for every tool alike, or no float32 solve
    could get within 1e-5 of the float64 reference."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {device}: no such CUDA device on this machine")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def device_label(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 ..., CUDA 13.0, TF32 off)``; ``cpu`` as is."""
    if device.type != "cuda":
        return str(device)
    tf32 = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    return f"{device} ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, TF32 {'on' if tf32 else 'off'})"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on ``device`` (``None``: on the current GPU, where this process has used one); nothing
    on the CPU. Call it before reading a clock, or the GPU's queued work is not counted."""
    if device is None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` once the queued GPU work is done (see :func:`sync`)."""
    sync(device)
    return time.perf_counter()


def median_time(fn, rounds: int, device: torch.device | str | None = None) -> tuple[float, object]:
    """Median wall seconds of ``rounds`` calls of ``fn`` (timed with `clock`, synchronized on ``device``) and the
    last call's result."""
    times, out = [], None
    for _ in range(rounds):
        start = clock(device)
        out = fn()
        times.append(clock(device) - start)
    return statistics.median(times), out


def to_device(device: torch.device, model: nn.Module, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Move ``model`` to ``device`` (in place) and return ``tensors`` there (the same objects on the CPU)."""
    model.to(device)
    return tuple(t.to(device) for t in tensors)
