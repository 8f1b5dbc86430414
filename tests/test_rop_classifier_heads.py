"""R-operator products through a classifier's softmax and log-softmax heads (`_Softmax`, `_LogSoftmax`).

The classic classifier ends in ``log_softmax`` and is trained with ``NLLLoss`` (PyTorch's MNIST example); others end
in a softmax read by a loss on probabilities, or take a softmax over another axis than the last (the classes of a
segmentation map, the heads of attention). Each product is checked in float64 against torch.func's
forward-over-reverse product (``jvp`` of ``grad``) to 1e-12 relative, with the data in one chunk whose state is kept
and streamed in chunks of 3 whose state is recomputed per product. ``NLLLoss`` is linear in the log-probabilities,
so the whole curvature comes through the log-softmax: its second-order term (``-pdot sum(delta)``, ``sum(delta)``
being ``-1`` over the count per sample) is what these products test.
"""

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import _data, _perturbed
from torch import nn
from torch.func import functional_call, grad, jvp

from sharpness import Objective
from sharpness.products._rop_graph import RopGraph

NLL = nn.NLLLoss()


def _assert_exact(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> None:
    """``auto`` picks the graph R-operator, and its products (kept and streamed state) equal ``jvp(grad)``."""
    for obj in (Objective(model, loss_fn, (x, y)), Objective(model, loss_fn, (x, y), chunk_size=3, memory_budget=1)):
        assert obj.hvp_strategy() == "rop" and isinstance(obj._rop, RopGraph)
        v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        params = {k: t.detach() for k, t in obj.params.items()}
        gradient = grad(lambda p: loss_fn(functional_call(model, p, (x,)), y))
        ref = obj.layout.flatten(jvp(gradient, (params,), (obj.layout.unflatten(v),))[1])
        assert float(ref.abs().max()) > 1e-3  # a product that is not all rounding
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


class Head(nn.Module):
    """A ReLU MLP on ``(N, 6)`` inputs whose logits go through ``head``."""

    def __init__(self, head, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, classes))
        self.head = head

    def forward(self, x):
        return self.head(self.body(x))


class LogitsThroughLogSoftmax(nn.Module):
    """Log-probabilities in the middle of the network: ``Linear(log_softmax(Linear(x)))``, read by a cross-entropy."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 4)

    def forward(self, x):
        return self.b(torch.log_softmax(self.a(x), 1))


class Segmenter(nn.Module):
    """A convolution map ``(N, C, 5, 5)`` of per-pixel class scores, log-softmax over the classes' axis (1)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 5, 3, padding=1), nn.Conv2d(5, 4, 3, padding=1)

    def forward(self, x):
        return F.log_softmax(self.b(torch.relu(self.a(x))), dim=1)


def _one_hot_mse(out, y):
    return ((out - torch.eye(4, dtype=out.dtype)[y]) ** 2).mean()


HEADS = {
    "F.log_softmax(dim=1), NLLLoss": (lambda: Head(lambda z: F.log_softmax(z, dim=1)), NLL),
    "nn.LogSoftmax(dim=1) in a Sequential, NLLLoss summed": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4), nn.LogSoftmax(dim=1)),
        nn.NLLLoss(reduction="sum")),
    ".log_softmax(-1), F.nll_loss": (lambda: Head(lambda z: z.log_softmax(-1)), F.nll_loss),
    "torch.log_softmax(z, 1), cross-entropy of log-probabilities": (
        lambda: Head(lambda z: torch.log_softmax(z, 1)), nn.CrossEntropyLoss()),
    "nn.Softmax(dim=1), a squared error on the probabilities": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.Softmax(dim=1)), _one_hot_mse),
    "F.softmax(dim=-1), a squared error on the probabilities": (lambda: Head(lambda z: F.softmax(z, dim=-1)),
                                                               _one_hot_mse),
    "log-probabilities inside the network, cross-entropy": (LogitsThroughLogSoftmax, nn.CrossEntropyLoss()),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_softmax_and_log_softmax_heads_equal_forward_over_reverse(name):
    build, loss_fn = HEADS[name]
    x, y = _data((6,), n=7, classes=4)
    _assert_exact(_perturbed(build()), loss_fn, x, y)


def test_a_segmentation_map_with_log_softmax_over_the_classes_axis():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 2, 5, 5, generator=g), torch.randint(0, 4, (5, 5, 5), generator=g)
    _assert_exact(_perturbed(Segmenter()), NLL, x, y)


class OverHeads(nn.Module):
    """Attention by hand whose softmax normalizes ``(N, heads, T, T)`` scores over the heads (``dim=1``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = x.unflatten(1, (3, 4))
        b, t, _ = h.shape
        q, k, v = (m(h).view(b, t, 2, 2).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.softmax(q @ k.transpose(-2, -1), dim=1)
        return self.head(self.o((a @ v).transpose(1, 2).reshape(b, t, 4)).mean(1))


def test_a_softmax_over_the_heads_axis_of_attention_scores():
    x, y = _data((12,), n=6)
    _assert_exact(_perturbed(OverHeads()), nn.CrossEntropyLoss(), x, y)


@pytest.mark.parametrize("name", ["segmentation map", "softmax over the heads"])
def test_float32_products_over_a_middle_axis_equal_float64_forward_over_reverse(name):
    """In float32 the softmax's Jacobian runs through torch's fused kernel, along the axis given."""
    if name == "segmentation map":
        g = torch.Generator().manual_seed(1)
        model, loss_fn = _perturbed(Segmenter()), NLL
        x, y = torch.randn(5, 2, 5, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (5, 5, 5), generator=g)
    else:
        model, loss_fn = _perturbed(OverHeads()), nn.CrossEntropyLoss()
        x, y = _data((12,), n=6)
    obj = Objective(model, loss_fn, (x, y), dtype=torch.float32)
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = {k: t.detach() for k, t in model.named_parameters()}
    gradient = grad(lambda p: loss_fn(functional_call(model, p, (x,)), y))
    ref = obj.layout.flatten(jvp(gradient, (params,), (obj.layout.unflatten(v),))[1])
    err = float((obj.hvp(v.float()).double() - ref).norm() / ref.norm())
    assert err < 1e-5


def test_a_softmax_without_an_axis_falls_back_to_autograd():
    """Without ``dim`` torch picks an axis by the number of axes (deprecated): not read, autograd's products run."""
    model = _perturbed(Head(lambda z: F.softmax(z)))
    x, y = _data((6,), n=7, classes=4)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        obj = Objective(model, _one_hot_mse, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


def test_a_normalization_over_the_samples_axis_is_not_read():
    """Over the samples it would mix them (and the objective refuses such a model as a whole, see the boundary)."""
    from sharpness.products._rop_graph import _normalization

    assert _normalization("softmax", 0, 2) is None and _normalization("log_softmax", -2, 2) is None
    assert _normalization("softmax", None, 2) is None
    assert _normalization("log_softmax", 1, 2).dim == -1 and _normalization("softmax", 1, 4).dim == 1


class MnistExample(nn.Module):
    """PyTorch's MNIST example network (``pytorch/examples``, ``mnist/main.py``), narrower, on 1x10x10 images: two
    convolutions with ``F.relu``, ``F.max_pool2d``, dropout, ``torch.flatten``, two Linears, ``F.log_softmax``, read by
    ``F.nll_loss``."""

    def __init__(self, pool=lambda h: F.max_pool2d(h, 2)):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 3, 3, 1), nn.Conv2d(3, 4, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.pool = pool
        self.fc1, self.fc2 = nn.LazyLinear(6), nn.Linear(6, 4)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(self.dropout1(self.pool(x)), 1)
        return F.log_softmax(self.fc2(self.dropout2(F.relu(self.fc1(x)))), dim=1)


POOLS = {
    "F.max_pool2d(h, 2)": lambda h: F.max_pool2d(h, 2),
    "F.max_pool2d(h, 3, stride=2, padding=1, ceil_mode=True)": lambda h: F.max_pool2d(h, 3, stride=2, padding=1,
                                                                                       ceil_mode=True),
    "F.max_pool1d over the flattened rows": lambda h: F.max_pool1d(h.flatten(2), kernel_size=4),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_pytorch_mnist_example_network_equals_forward_over_reverse(pool):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 1, 10, 10, generator=g), torch.randint(0, 4, (6,), generator=g)
    model = MnistExample(POOLS[pool])
    model(x)  # the lazy Linear takes its input size
    _assert_exact(_perturbed(model), F.nll_loss, x, y)


def test_a_max_pool_returning_its_indices_is_not_read():
    model = MnistExample(lambda h: F.max_pool2d(h, 2, return_indices=True)[0])
    x, y = torch.randn(6, 1, 10, 10), torch.randint(0, 4, (6,))
    model(x)
    obj = Objective(_perturbed(model), F.nll_loss, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"
