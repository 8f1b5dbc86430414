"""The gradient read off the R-operator products' kept state (sharpness.products._rop_gradient.shared_gradient), of
graphs and of chains (the first layer's error carried back from the second's), equals the objective's own forward
and backward pass in float64, and falls back to it where no state is kept or a layer's error is not there."""

import pytest
import torch
from test_rop_graph import _data, _perturbed
from torch import nn

from sharpness import Objective
from sharpness._resnet import resnet
from sharpness.products._rop_gradient import shared_gradient

CE = nn.CrossEntropyLoss()


class _Residual(nn.Module):
    """A convolution whose BatchNorm (no affine) is fused with it, a residual sum into an unfused BatchNorm, a
    Linear layer with a bias and one without."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(4)
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4, affine=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 16, 5)
        self.out = nn.Linear(5, 3, bias=False)
        self.relu, self.pool, self.flat = nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()

    def forward(self, x):
        h = self.relu(self.bn0(self.conv0(x)))
        h = self.bn2(self.relu(self.bn1(self.conv1(h))) + h)
        return self.out(self.relu(self.fc(self.flat(self.pool(h)))))


def _vgg():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d((3, 3)),
                         nn.Flatten(), nn.Linear(54, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 3))  # fmt: skip


def _mlp_chain():
    return nn.Sequential(nn.Flatten(), nn.Linear(128, 6), nn.ReLU(), nn.Linear(6, 5), nn.LeakyReLU(0.1),
                         nn.Linear(5, 3))  # fmt: skip


def _conv_chain():  # the first layer's error carried back through a max pooling and a mask
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 3, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(12, 3))  # fmt: skip


@pytest.mark.parametrize("build", [_vgg, _Residual, lambda: resnet(depth=8, width=2, classes=3, in_channels=2),
                                   _mlp_chain, _conv_chain],
                         ids=["vgg", "residual", "resnet8", "mlp chain", "conv chain"])  # fmt: skip
def test_kept_state_gradient_equals_the_objectives_pass(build, monkeypatch):
    model = _perturbed(build())
    x, y = _data((2, 8, 8))
    reference = Objective(model, CE, (x, y)).gradient()
    obj = Objective(model, CE, (x, y), chunk_size=3)  # three chunks, each with its kept state
    assert obj.hvp_strategy() == "rop"
    monkeypatch.setattr(obj, "gradient", lambda: pytest.fail("the kept state was not read"))
    got = shared_gradient(obj, "rop")
    assert len(obj.rop_states()[1]) == 3
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


@pytest.mark.parametrize("case", ["chain", "data-batchnorm", "streamed", "autograd"])
def test_shared_gradient_falls_back_to_the_objectives_pass(case):
    if case == "chain":  # a chain of one affine layer keeps no error (no second layer's to carry back)
        model = nn.Sequential(nn.Flatten(), nn.Linear(128, 3))
    elif case == "data-batchnorm":  # a BatchNorm of the data alone keeps no error
        model = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(108, 3))
    else:
        model = _vgg()
    model = _perturbed(model)
    x, y = _data((2, 8, 8))
    obj = Objective(model, CE, (x, y), **({"chunk_size": 3, "memory_budget": 1} if case == "streamed" else {}))
    expected = obj.gradient()
    calls = []
    gradient = obj.gradient
    obj.gradient = lambda: calls.append(1) or gradient()
    got = shared_gradient(obj, "double_backward" if case == "autograd" else "rop")
    assert calls == [1]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_autograd_graph_strategy_reads_the_gradient_its_graph_holds(monkeypatch):
    """With the whole-data-set autograd graph the products keep (``"graph"``), the gradient is the one that graph
    holds (summed over three chunks), not another pass."""
    model = _perturbed(_Residual())
    x, y = _data((2, 8, 8))
    reference = Objective(model, CE, (x, y)).gradient()
    obj = Objective(model, CE, (x, y), chunk_size=3)
    monkeypatch.setattr(obj, "gradient", lambda: pytest.fail("another pass over the data"))
    got = shared_gradient(obj, "graph")
    assert obj._graph is not None
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))
