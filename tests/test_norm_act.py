"""timm's ``BatchNormAct2d`` (a ``BatchNorm2d`` whose forward adds its ``drop`` and ``act`` submodules: RegNet,
DenseNet, EfficientNet, MobileNet), written here as timm writes it, without timm. It is read as the normalization
followed by its activation: a ReLU (or none) keeps the BatchNorm's output channels free, traded against the next
convolution's input channels; another activation pins them, with the reason; a forward that computes anything else
is an unknown operation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import _check
from test_transformer_quotient import assert_keeps_outputs, measure_value
from torch import nn

import manifolds


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's eval-mode computation: ``act(drop(batch_norm(x)))`` with the running statistics."""

    def __init__(self, channels: int, act: nn.Module, shift: float = 0.0):
        super().__init__(channels)
        self.drop, self.act, self.shift = nn.Identity(), act, shift

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         0.0 if self.momentum is None else self.momentum, self.eps)  # fmt: skip
        return self.act(self.drop(x)) + self.shift  # a shift: another computation than timm's


class Net(nn.Module):
    def __init__(self, second: nn.Module, shift: float = 0.0):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), BatchNormAct2d(6, nn.ReLU(), shift)
        self.conv2, self.bn2 = nn.Conv2d(6, 5, 3, padding=1, bias=False), BatchNormAct2d(5, second)
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        return self.head(self.bn2(self.conv2(self.bn1(self.conv1(x)))).mean(dim=(2, 3)))


def _make(second: nn.Module, shift: float = 0.0):
    torch.manual_seed(0)
    model = Net(second, shift).double().eval()
    with torch.no_grad():
        for m in (model.bn1, model.bn2):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.weight.normal_()
            m.bias.normal_()
    return model, torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 4, (6,))


@pytest.mark.parametrize("second, free", [(nn.ReLU(), 6 + 5), (nn.Identity(), 6 + 5), (nn.SiLU(), 6)],
                         ids=["relu", "identity", "silu"])  # fmt: skip
def test_a_norm_act_layer_is_read_as_its_normalization_then_its_activation(second, free):
    """The first layer's 6 channels are free (a ReLU after the BatchNorm), the second's 5 too unless its activation is
    not positively homogeneous (SiLU: pinned, with the reason); a random element keeps the outputs (1e-12) and the
    symmetry measure (1e-8)."""
    model, x, y = _make(second)
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == free, structure.describe()
    if free == 6:
        assert any("bn2" in str(p) and "SiLU is not positively homogeneous" in str(p) for p in structure.group.pins)
    sym = manifolds.transformer_symmetry(model, x)
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(5)))
    before, after = (measure_value(m, nn.CrossEntropyLoss(), (x, y))[0] for m in (model, moved))
    assert abs(after - before) <= 1e-8 * abs(before), (before, after)


@pytest.mark.parametrize("shift", [0.5, 1e-9])
def test_a_norm_act_layer_computing_something_else_is_an_unknown_operation(shift):
    """A ``BatchNormAct2d`` whose forward adds a constant after the activation is not timm's computation, however
    small the constant (the check is exact, not within a tolerance): its channels are pinned as an unknown operation's
    (a scaled channel would move the constant)."""
    model, x, _ = _make(nn.ReLU(), shift=shift)
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == 5, structure.describe()  # the second layer's channels only
    assert "module 'bn1' (BatchNormAct2d)" in manifolds.transformer_symmetry(model, x).diagonal.describe()


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm over the channels of ``(N, C, H, W)`` (ConvNeXt's): to channels-last, ``F.layer_norm``, back;
    ``other`` computes with another epsilon than its own (not the layer it says it is)."""

    def __init__(self, channels: int, other: bool = False):
        super().__init__(channels)
        self.other = other

    def forward(self, x):
        eps = 100 * self.eps if self.other else self.eps
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, eps).permute(
            0, 3, 1, 2
        )


class ConvNeXtLike(nn.Module):
    def __init__(self, other: bool = False, scale: str = "none"):
        super().__init__()
        self.scale = scale
        self.stem, self.norm = nn.Conv2d(3, 6, 2, stride=2), LayerNorm2d(6, other)
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)  # depthwise: its input channels traded one by one
        self.fc1, self.act, self.fc2 = nn.Conv2d(6, 12, 1), nn.GELU(), nn.Conv2d(12, 6, 1)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)
        self.gamma4 = nn.Parameter(torch.rand(1, 6, 1, 1) + 0.5)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        x = self.dw(self.norm(self.stem(x)))
        branch = self.fc2(self.act(self.fc1(x)))
        if self.scale == "gamma":  # ConvNeXt's layer scale
            branch = branch.mul(self.gamma.reshape(1, -1, 1, 1))
        elif self.scale == "gamma_4d":  # stored as (1, C, 1, 1)
            branch = branch * self.gamma4
        elif self.scale == "gamma_twice":  # the same parameter read again elsewhere: not a layer scale alone
            branch = branch.mul(self.gamma.reshape(1, -1, 1, 1)) + self.gamma.reshape(1, -1, 1, 1)
        return self.head((x + branch).mean(dim=(2, 3)))


@pytest.mark.parametrize("other", [False, True], ids=["layer_norm_2d", "other_eps"])
def test_a_layer_norm_over_the_channels_trades_its_scale_against_the_next_convolution(other):
    """ConvNeXt's LayerNorm2d (channels last, ``F.layer_norm``, back) is read as a normalization over axis 1: its 6
    affine channels are free, traded against the depthwise convolution's input channels; one that computes something
    else (another epsilon) is an unknown operation. The depthwise convolution's 6 output channels are free either way
    (traded against ``fc1``'s columns, ``fc2``'s rows across the residual sum, and the head's columns)."""
    torch.manual_seed(0)
    model, x = ConvNeXtLike(other).double().eval(), torch.randn(4, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == (6 if other else 12), structure.describe()
    sym = manifolds.transformer_symmetry(model, x)
    unknown = "\n".join(sym.diagonal.unknown)
    assert ("module 'norm' (LayerNorm2d)" in unknown) == other, sym.diagonal.describe()
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)


class _Branching(BatchNormAct2d):
    """timm's computation on the check's old probe (a 3 x 3 grid, gradients on) and another elsewhere: a constant added
    on wider grids, or without gradients."""

    def __init__(self, channels: int, act: nn.Module, on: str):
        super().__init__(channels, act)
        self.on = on

    def forward(self, x):
        out = super().forward(x)
        other = x.shape[-1] > 3 if self.on == "shape" else not torch.is_grad_enabled()
        return out + 1.0 if other else out


_Branching.__name__ = "BatchNormAct2d"  # as timm names it: the name alone lets it be checked


@pytest.mark.parametrize("how", ["patched_act", "shape", "grad_mode"])
def test_a_norm_act_layer_that_is_not_timm_s_where_the_model_calls_it_is_not_read_so(how):
    """Each computed timm's values on a 3 x 3 probe with gradients on, and had its channels claimed free: an activation
    whose forward is replaced on the instance (``relu(t) + 1``; the check called it on both sides), a forward that
    adds a constant on wider grids, or without gradients (outputs moved by 9.0, 1.7, 1.7). The check now probes the
    input the model gives the layer, with and without gradients, and refuses a forward set on the instance."""
    model, x, _ = _make(nn.ReLU())
    if how == "patched_act":
        act = model.bn1.act
        act.forward = lambda t: torch.relu(t) + 1.0
    else:
        bn = _Branching(6, nn.ReLU(), how).double().eval()
        bn.load_state_dict(model.bn1.state_dict())
        model.bn1 = bn
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == 5, structure.describe()  # the second layer's channels only
    sym = manifolds.transformer_symmetry(model, x)
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)


@pytest.mark.parametrize("scale, free", [("gamma", 12 + 6), ("gamma_4d", 12 + 6), ("gamma_twice", 6)],
                         ids=["layer_scale", "stored_4d", "read_twice"])  # fmt: skip
def test_a_layer_scale_on_the_channels_trades_against_the_convolution_before_it(scale, free):
    """ConvNeXt's ``x.mul(gamma.reshape(1, -1, 1, 1))``: ``gamma_c`` times ``c`` against ``fc2``'s row ``c`` and bias
    over ``c`` (6 more free scales); a ``gamma`` also added elsewhere is not traded (the sum, a parameter read directly,
    pins the branch and the stream). A random element keeps the outputs and the symmetry measure."""
    torch.manual_seed(0)
    model, x = ConvNeXtLike(scale=scale).double().eval(), torch.randn(4, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == free, structure.describe()
    sym = manifolds.transformer_symmetry(model, x)
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)
    y = torch.randint(0, 4, (4,))
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(5)))
    before, after = (measure_value(m, nn.CrossEntropyLoss(), (x, y))[0] for m in (model, moved))
    assert abs(after - before) <= 1e-8 * abs(before), (before, after)


@pytest.mark.parametrize("second", [nn.ReLU(), nn.Identity(), nn.SiLU(), nn.Hardswish()],
                         ids=["relu", "identity", "silu", "hardswish"])  # fmt: skip
def test_norm_act_products_are_the_r_operators_and_equal_the_dense_hessian(second):
    """The R-operator reads a ``BatchNormAct2d`` as its BatchNorm then its activation (before, such networks' products
    were autograd's): products equal the dense float64 Hessian's to 1e-10, from the kept state and in chunks of 3."""
    model, x, y = _make(second)
    if isinstance(second, nn.Hardswish):  # the activation's three pieces are all reached
        with torch.no_grad():  # the BatchNorm's outputs, the activation's inputs, spread over the kinks at -3, 3
            model.bn2.weight.mul_(6)
            h = F.batch_norm(model.conv2(model.bn1(model.conv1(x))), model.bn2.running_mean, model.bn2.running_var,
                             model.bn2.weight, model.bn2.bias, False, 0.0, model.bn2.eps)  # fmt: skip
        assert bool((h < -3).any() and ((h > -3) & (h < 3)).any() and (h > 3).any())
    _check(model, x, y, strategy="rop")


def test_a_norm_act_layer_computing_something_else_keeps_autograd_products():
    model, x, y = _make(nn.ReLU(), shift=0.25)
    _check(model, x, y, strategy="graph")


@pytest.mark.parametrize("other, strategy", [(False, "rop"), (True, "graph")], ids=["layer_norm_2d", "other_eps"])
def test_a_layer_norm_over_the_channels_is_read_by_the_r_operator_where_it_is_one(other, strategy):
    """ConvNeXt's LayerNorm2d (with its layer scale) is read as a LayerNorm of the channels moved last and moved back;
    one with another epsilon than its own keeps autograd's products. Both equal the dense Hessian's."""
    torch.manual_seed(0)
    model, x = ConvNeXtLike(other, scale="gamma").double().eval(), torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    _check(model, x, torch.randint(0, 4, (4,)), strategy=strategy)


class TimmLinear(nn.Linear):
    """timm's ``Linear`` (MobileNetV3's classifier): ``nn.Linear``'s computation, with casts only under TorchScript;
    ``scaled``: another computation (twice the output)."""

    def __init__(self, *args, scaled: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaled = scaled

    def forward(self, input):
        if torch.jit.is_scripting():
            bias = self.bias.to(dtype=input.dtype) if self.bias is not None else None
            return F.linear(input, self.weight.to(dtype=input.dtype), bias=bias)
        out = F.linear(input, self.weight, self.bias)
        return 2 * out if self.scaled else out


@pytest.mark.parametrize("scaled", [False, True], ids=["timm_linear", "scaled"])
def test_a_linear_subclass_computing_linear_s_forward_is_read_as_linear(scaled):
    """Read as ``nn.Linear`` where its forward is ``nn.Linear``'s: the hidden layer's 5 units are free (traded against
    its columns) and the products are the R-operator's; a subclass computing something else pins its inputs as an
    unknown operation and keeps autograd's products. Products equal the dense Hessian's either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), TimmLinear(5, 3, scaled=scaled)).double().eval()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == (0 if scaled else 5), structure.describe()
    _check(model, x, y, strategy="graph" if scaled else "rop")
