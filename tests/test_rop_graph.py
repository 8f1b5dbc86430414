"""R-operator products over the traced graph (sharpness.products._rop_graph): residual, concatenating and
BatchNorm networks, every supported operation alone, and the fall-back to autograd for the rest.

Every product is checked in float64 against a dense ``torch.func`` Hessian (or, for the built-in ResNet whose
Hessian is too large to form, against autograd's double backward) to 1e-10 relative, with the data in one
chunk whose state is kept, and streamed in chunks of 3 whose state is recomputed per product.
"""

import operator

import pytest
import torch
import torch.nn.functional as F
from test_group_zoo import ZOO, build, dense_node
from torch import nn

from manifolds import analyze, trace_network
from sharpness import Objective, dense_hessian, measure_sharpness
from sharpness._resnet import resnet
from sharpness.products._data_span import data_span_hessian
from sharpness.products._hessian import HessianOperator
from sharpness.products._rop import _Affine
from sharpness.products._rop_graph import RopGraph, rop_graph

CE = nn.CrossEntropyLoss()


def _data(shape, n=7, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in float64 and eval mode, off initialization, with BatchNorm statistics that matter."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(0.3 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
    return model.eval()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10 * float(ref.abs().max()))


def _check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=CE, strategy: str = "rop") -> Objective:
    """The objective's products (kept state; streamed in chunks of 3) equal the dense Hessian's, through the
    strategy ``strategy`` that ``"auto"`` must pick (``"graph"``: the autograd fall-back, which streams by
    double backward or jvp); the loss recorded on the way is the model's."""
    obj = Objective(model, loss_fn, (x, y))
    assert obj.hvp_strategy() == strategy
    H = dense_hessian(obj)
    g = torch.Generator().manual_seed(5)
    v, V = torch.randn(obj.layout.size, generator=g), torch.randn(3, obj.layout.size, generator=g)
    _close(obj.hvp(v), H @ v)
    _close(obj.hvp_batch(V), V @ H)
    streamed = Objective(model, loss_fn, (x, y), chunk_size=3, memory_budget=1)
    assert streamed.hvp_strategy() == strategy if strategy == "rop" else streamed.hvp_strategy() in ("double_backward",
                                                                                                       "jvp")
    _close(streamed.hvp(v), H @ v)
    _close(streamed.hvp_batch(V), V @ H)
    if strategy == "rop":
        assert obj._rop_states is not None and streamed._rop_states is None
        with torch.no_grad():
            expected = loss_fn(model(x), y)
        torch.testing.assert_close(obj.value(), expected, rtol=1e-13, atol=0)
    return obj


def _graph_products(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=CE, chunk_size: int | None = None):
    """``H V^T`` (``V``: 2 random rows) from the graph R-operator itself, and the dense ``H`` (chains included,
    which the objective would give to the chain R-operator)."""
    obj = Objective(model, loss_fn, (x, y), chunk_size=chunk_size)
    graph = rop_graph(model, obj.params, obj.buffers, obj.structure.traced.graph)
    assert graph is not None
    V = torch.randn(2, obj.layout.size, generator=torch.Generator().manual_seed(3))
    out = torch.zeros_like(V)
    rows = [obj.layout.unflatten(r) for r in V]
    into = [obj.layout.unflatten(r) for r in out]
    with torch.no_grad():
        for xc, yc, w in obj.chunks():
            state = graph.forward_state(obj.params, xc, yc, loss_fn, w)
            for v, acc in zip(rows, into):
                graph.add_products(obj.params, state, v, acc)
    return out, V @ dense_hessian(obj)


class Lin(nn.Module):
    """``tail(op(head(x)))`` with an extra skip ``skip(x)`` added at the end: never a chain."""

    def __init__(self, op, head: nn.Module, tail: nn.Module, skip: nn.Module):
        super().__init__()
        self.op, self.head, self.tail, self.skip = op, head, tail, skip

    def forward(self, x):
        return self.tail(self.op(self.head(x))) + self.skip(x)


def _mlp(op, features: int = 6):
    return Lin(op, nn.Linear(4, 6), nn.Linear(features, 3), nn.Linear(4, 3))


def _conv(op, features: int, dims: int = 2):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    return Lin(op, conv(2, 4, 3, padding=1), nn.Sequential(nn.Flatten(), nn.Linear(features, 3)),
               nn.Sequential(nn.Flatten(), nn.Linear(2 * 5**dims, 3)))  # fmt: skip


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


class NormSkip(nn.Module):
    """A BatchNorm whose input has another user (not merged into the layer before it)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, h):
        return F.relu(self.norm(h)) + h


class Dropout(nn.Module):
    def forward(self, h):
        return F.dropout(h, 0.5, self.training)


# operation -> (model, input shape per sample); each operation sits between two layers whose inputs move
SINGLE_OPS = {
    "relu module": (lambda: _mlp(nn.ReLU()), (4,)),
    "relu inplace module": (lambda: _mlp(nn.ReLU(inplace=True)), (4,)),
    "F.relu": (lambda: _mlp(Fn(F.relu)), (4,)),
    "torch.relu": (lambda: _mlp(Fn(torch.relu)), (4,)),
    "Tensor.relu": (lambda: _mlp(Fn(lambda h: h.relu())), (4,)),
    "leaky relu module": (lambda: _mlp(nn.LeakyReLU(0.2)), (4,)),
    "F.leaky_relu": (lambda: _mlp(Fn(lambda h: F.leaky_relu(h, 0.3))), (4,)),
    "identity": (lambda: _mlp(nn.Identity()), (4,)),
    "dropout (eval)": (lambda: _mlp(nn.Dropout(0.5)), (4,)),
    "F.dropout": (lambda: _mlp(Dropout()), (4,)),
    "times a number": (lambda: _mlp(Fn(lambda h: 2.5 * h)), (4,)),
    "divided by a number": (lambda: _mlp(Fn(lambda h: h / 4)), (4,)),
    "negation": (lambda: _mlp(Fn(lambda h: -h)), (4,)),
    "plus a number": (lambda: _mlp(Fn(lambda h: F.relu(h + 0.5))), (4,)),
    "number minus": (lambda: _mlp(Fn(lambda h: F.relu(1.0 - h))), (4,)),
    "plus a shape entry": (lambda: _mlp(Fn(lambda h: F.relu(h - h.shape[1] / 4))), (4,)),
    "sum with itself": (lambda: _mlp(Fn(lambda h: F.relu(h) + h)), (4,)),
    "torch.add alpha": (lambda: _mlp(Fn(lambda h: torch.add(F.relu(h), h, alpha=-0.7))), (4,)),
    "operator.sub": (lambda: _mlp(Fn(lambda h: operator.sub(F.relu(h), h))), (4,)),
    "torch.cat": (lambda: _mlp(Fn(lambda h: torch.cat([F.relu(h), h], dim=-1)), 12), (4,)),
    "batchnorm1d": (lambda: _mlp(nn.BatchNorm1d(6)), (4,)),
    "batchnorm1d no affine": (lambda: _mlp(nn.BatchNorm1d(6, affine=False)), (4,)),
    "batchnorm1d beside a skip": (lambda: _mlp(NormSkip(nn.BatchNorm1d(6))), (4,)),
    "batchnorm1d no affine beside a skip": (lambda: _mlp(NormSkip(nn.BatchNorm1d(6, affine=False))), (4,)),
    "conv1d stride groups dilation": (lambda: Lin(nn.ReLU(), nn.Conv1d(2, 4, 3, stride=2, padding=2, dilation=2,
                                                                       groups=2),
                                                  nn.Sequential(nn.Flatten(), nn.Linear(12, 3)),
                                                  nn.Sequential(nn.Flatten(), nn.Linear(10, 3))), (2, 5)),
    "conv2d + maxpool": (lambda: _conv(nn.MaxPool2d(2, ceil_mode=True), 36), (2, 5, 5)),
    "conv3d": (lambda: _conv(nn.ReLU(), 500, dims=3), (2, 5, 5, 5)),
    "avgpool2d": (lambda: _conv(nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), 36), (2, 5, 5)),
    "F.avg_pool2d": (lambda: _conv(Fn(lambda h: F.avg_pool2d(h, 2)), 16), (2, 5, 5)),
    "adaptive avgpool": (lambda: _conv(nn.AdaptiveAvgPool2d((2, 3)), 24), (2, 5, 5)),
    "F.adaptive_avg_pool2d": (lambda: _conv(Fn(lambda h: F.adaptive_avg_pool2d(h, 1)), 4), (2, 5, 5)),
    "mean over space": (lambda: _conv(Fn(lambda h: h.mean((2, 3), keepdim=True)), 4), (2, 5, 5)),
    "mean over the last axis": (lambda: _conv(Fn(lambda h: torch.mean(h, -1)), 20), (2, 5, 5)),
    "batchnorm2d": (lambda: _conv(nn.BatchNorm2d(4), 100), (2, 5, 5)),
    "batchnorm2d no affine": (lambda: _conv(nn.BatchNorm2d(4, affine=False), 100), (2, 5, 5)),
    "batchnorm2d beside a skip": (lambda: _conv(NormSkip(nn.BatchNorm2d(4)), 100), (2, 5, 5)),
    "batchnorm3d": (lambda: _conv(nn.BatchNorm3d(4), 500, dims=3), (2, 5, 5, 5)),
    "view": (lambda: _conv(Fn(lambda h: h.view(h.size(0), -1)), 100), (2, 5, 5)),
    "reshape": (lambda: _conv(Fn(lambda h: h.reshape(h.shape[0], 4, 25)), 100), (2, 5, 5)),
    "torch.flatten": (lambda: _conv(Fn(lambda h: torch.flatten(h, 1)), 100), (2, 5, 5)),
    "cat of channels": (lambda: _conv(Fn(lambda h: torch.cat([h, F.relu(h)], 1)), 200), (2, 5, 5)),
}


@pytest.mark.parametrize("name", list(SINGLE_OPS))
def test_each_supported_operation_alone(name):
    builder, shape = SINGLE_OPS[name]
    model = _perturbed(builder())
    x, y = _data(shape)
    obj = _check(model, x, y)
    assert isinstance(obj._rop, RopGraph)


def _image_tensors(obj: Objective) -> list[torch.Tensor]:
    """The 4-D tensors with more than one pixel in ``obj``'s kept R-operator state."""
    found = []
    for state in obj.rop_states()[1]:
        for s in [*state.saved, *state.deltas.values()]:
            for t in s if isinstance(s, tuple) else (s,):
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] * t.shape[3] > 1:
                    found.append(t)
    return found


@pytest.mark.parametrize("name", ["view", "conv2d + maxpool", "adaptive avgpool", "cat of channels", "chain"])
def test_image_states_on_cpu_are_channels_last_and_give_the_standard_layouts_products(monkeypatch, name):
    """On CPU the products run on channels-last images (several times faster convolutions); every operation that
    builds a tensor afresh (a view's adjoint, pooling, concatenation) keeps that order, and the products equal,
    to rounding, those of the standard order, which the objective uses when told not to convert."""
    if name == "chain":
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 3, 1), nn.ReLU(),
                              nn.Flatten(), nn.Linear(12, 3))  # fmt: skip
        shape = (2, 6, 6)
    else:
        model, shape = SINGLE_OPS[name][0](), SINGLE_OPS[name][1]
    model = _perturbed(model)
    x, y = _data(shape)
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(3))
    seen = []  # the layout of every error a convolution's adjoint is given
    conv_backward = _Affine._conv_backward

    def spy(self, g, h, weight, mask):
        seen.append(g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous())
        return conv_backward(self, g, h, weight, mask)

    monkeypatch.setattr(_Affine, "_conv_backward", spy)
    fast = Objective(model, CE, (x, y))
    got = fast.hvp(v, "rop")
    assert seen and all(seen)
    images = _image_tensors(fast)
    assert images and all(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
                          for t in images)  # fmt: skip
    streamed = Objective(model, CE, (x, y), chunk_size=3, memory_budget=1).hvp(v, "rop")
    monkeypatch.setattr("sharpness.products._objective.channels_last", lambda t: t)
    standard = Objective(model, CE, (x, y))
    ref = standard.hvp(v, "rop")
    assert all(t.is_contiguous() for t in _image_tensors(standard))
    _close(got, ref)
    _close(streamed, ref)


class DataFacing(nn.Module):
    """Operations on the data before any layer, BatchNorm as the first layer, the data concatenated later."""

    def __init__(self):
        super().__init__()
        self.bn, self.fc1, self.fc2 = nn.BatchNorm1d(4), nn.Linear(4, 5), nn.Linear(9, 3)

    def forward(self, x):
        x = 2 * x.view(x.size(0), -1)
        h = F.relu(self.fc1(self.bn(x)))
        return self.fc2(torch.cat([h, x], 1))


class Shared(nn.Module):
    """A module called twice, and a tensor with three users."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu(self.inp(x))
        a = F.relu(self.shared(h))
        return self.out(self.shared(a) + h - 0.5 * h)


@pytest.mark.parametrize("model", [DataFacing, Shared])
def test_data_side_operations_and_shared_modules(model):
    x, y = _data((2, 2) if model is DataFacing else (4,))
    obj = _check(_perturbed(model()), x, y)
    assert isinstance(obj._rop, RopGraph)


@pytest.mark.parametrize("name", [n for n in ZOO if n != "layernorm_gelu"])
def test_resnet_zoo_products_match_the_dense_hessian(name):
    """Post- and pre-activation ResNets with BatchNorm and a stride-2 projection shortcut, a VGG with BatchNorm,
    a DenseNet-style concatenation, a residual MLP, grouped convolutions, adaptive pooling."""
    model, x, y, *_ = build(name)
    obj = _check(model, x, y)
    assert obj._rop is not None


def test_the_graph_products_of_chains_and_of_the_zoo_equal_the_dense_hessian():
    """The graph R-operator itself, also on chains (which the objective gives to the chain R-operator)."""
    chain = _perturbed(nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3, 3)))
    x, y = _data((2, 4, 4))
    for model, data, chunk in [(chain, (x, y), None), (build("resnet")[0], build("resnet")[1:3], 4)]:
        got, ref = _graph_products(model, *data, chunk_size=chunk)
        _close(got, ref)


def test_the_built_in_resnet_matches_double_backward():
    """``sharpness._resnet.resnet(8)`` (about 78,000 parameters: no dense Hessian) on 8x8 inputs."""
    model = _perturbed(resnet(8, classes=4))
    x, y = _data((3, 8, 8), n=6, classes=4)
    obj = Objective(model, CE, (x, y))
    streamed = Objective(model, CE, (x, y), chunk_size=4, memory_budget=1)
    assert obj.hvp_strategy() == "rop" and streamed.hvp_strategy() == "rop" and isinstance(obj._rop, RopGraph)
    V = torch.randn(2, obj.layout.size, generator=torch.Generator().manual_seed(2))
    ref = obj.hvp_batch(V, "double_backward")
    _close(obj.hvp_batch(V), ref)
    _close(streamed.hvp(V[0]), ref[0])
    assert ref.norm() > 0 and not torch.allclose(ref[0], ref[1])


def test_a_model_left_in_training_mode_gets_its_eval_mode_products():
    model, x, y, *_ = build("resnet")
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(4))
    got = obj.hvp(v)
    assert model.training
    model.eval()
    _close(got, dense_hessian(Objective(model, CE, (x, y))) @ v)


def test_the_node_wise_measure_gets_the_graph_products():
    """The Riemannian node-wise operator is built on the Euclidean products: here the graph R-operator's."""
    model, x, y, *_ = build("resnet")
    obj = Objective(model, CE, (x, y))
    result = measure_sharpness(model, CE, (x, y), "node", objective=obj, progress=False)
    assert result.info["hvp_strategy"] == "rop"
    ref = dense_node(Objective(model, CE, (x, y)), analyze(model, example_input=x).group)
    assert abs(result.value - ref) <= 1e-8 * abs(ref)


class Gelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.a(x))
        return self.c(h + F.gelu(self.b(h), approximate="tanh"))


class Norms(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.a, self.norm, self.c = nn.Linear(4, 5), norm, nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        return self.c(F.relu(self.norm(h)) + h)


class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.c(self.a(x) * self.b(x))


class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(4, 1), nn.Linear(5, 3)

    def forward(self, x):
        return self.c(F.relu(self.a(x) + self.b(x)))


def _frozen_bn():
    model = Norms(nn.BatchNorm1d(5))
    model.norm.weight.requires_grad_(False)
    return model


def _hooked():
    model = Norms(nn.BatchNorm1d(5))
    model.norm.register_forward_hook(lambda *args: None)
    return model


class MaskedBroadcast(nn.Module):
    """``masked_fill`` with a data mask larger than the tensor it fills (broadcast: the error must be summed back)."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(2, 2), nn.Linear(4, 3)

    def forward(self, x):
        tokens = x.unflatten(1, (2, 2))  # (N, 2, 2)
        h = self.a(tokens).mean(1, keepdim=True)  # (N, 1, 2)
        return self.c(h.masked_fill(tokens > 0.5, 0.0).flatten(1))  # the mask (N, 2, 2), from the data


class Quotient(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.c(self.a(x) / (self.b(x) ** 2 + 1))


def _frozen_rms():
    model = Norms(nn.RMSNorm(5))
    model.norm.weight.requires_grad_(False)
    return model


class FunctionalAffine(nn.Module):
    """Linear layers written as functions of their parameters: ``torch.addmm(b, x, W)`` on ``(samples, features)``
    (HuggingFace's ``Conv1D`` on a batch of vectors, ``W`` stored ``(in, out)``), ``F.linear`` on tokens with and
    without a bias, and a smooth activation between, so the weights' tangents meet second derivatives."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
        self.w2, self.b2 = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(5))
        self.w3 = nn.Parameter(torch.randn(2, 5))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(torch.addmm(self.b1, x, self.w1)).unflatten(1, (2, 3))  # (N, 2 tokens, 3)
        h = F.gelu(F.linear(h, self.w2, self.b2))  # (N, 2, 5)
        return self.head(F.linear(h, self.w3).flatten(1))


class TokenSum(nn.Module):
    """Tokens summed (``x.sum(1)``, ``sum(dim=-1, keepdim=True)``): linear maps over axes but the samples'."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x.unflatten(1, (2, 2))))  # (N, 2 tokens, 5)
        return self.b(h.sum(1) - h.sum(dim=-1, keepdim=True).mean(1))


SMOOTH = {
    "addmm and F.linear with parameters": FunctionalAffine,
    "sums over tokens": TokenSum,
    "gelu, tanh approximation": Gelu,
    "rmsnorm": lambda: Norms(nn.RMSNorm(5)),
    "product of two tensors": Product,
    "broadcasting sum": Broadcast,
}


@pytest.mark.parametrize("name", list(SMOOTH))
def test_smooth_operations_of_feature_vectors_equal_the_dense_hessian(name):
    """The tanh-approximated GELU, RMSNorm, the elementwise product of two activations and a sum broadcasting a
    ``(N, 1)`` activation, read by the R-operator on ``(samples, features)`` tensors (their transformer forms:
    `test_rop_llama`, `test_rop_attention`)."""
    x, y = _data((4,))
    _check(_perturbed(SMOOTH[name]()), x, y)


UNSUPPORTED = {
    "mish": lambda: Norms(nn.Mish()),
    "rmsnorm with a frozen weight": _frozen_rms,
    "frozen batchnorm weight": _frozen_bn,
    "hook": _hooked,
    "quotient of two tensors": Quotient,
    "masked_fill broadcasting its input": MaskedBroadcast,
}


class TokenBatchNorm(nn.Module):
    """A Linear on ``(N, T, F)`` token sequences followed by ``BatchNorm1d(T)``, which normalizes axis 1 (the tokens),
    not the Linear's features (the last axis): the two cannot be merged into one layer as a convolution and its
    BatchNorm are."""

    def __init__(self, tokens: int, width: int):
        super().__init__()
        self.tokens, self.lin, self.bn = tokens, nn.Linear(2, width), nn.BatchNorm1d(tokens)
        self.head = nn.Linear(tokens * width, 3)

    def forward(self, x):
        return self.head(self.bn(self.lin(x.unflatten(1, (self.tokens, 2)))).flatten(1))


@pytest.mark.parametrize("tokens, width", [(5, 6), (6, 6)], ids=["T != width", "T == width"])
def test_a_batch_norm_over_the_tokens_of_a_token_linear_equals_the_dense_hessian(tokens, width):
    x, y = _data((2 * tokens,))
    _check(_perturbed(TokenBatchNorm(tokens, width)), x, y)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_operations_fall_back_to_autograd(name):
    model = _perturbed(UNSUPPORTED[name]())
    x, y = _data((4,))
    obj = _check(model, x, y, strategy="graph")
    assert obj._rop is None
    with pytest.raises(ValueError, match="'rop' HVP strategy needs a model built from Linear/ConvNd layers"):
        obj.hvp(torch.ones(obj.layout.size), "rop")


def test_batchnorm_with_batch_statistics_is_not_read():
    """Without running statistics BatchNorm normalizes by the batch's even in eval mode: not a fixed affine map
    (the objective cannot evaluate it on one sample, so the graph reader is asked directly)."""
    model = _perturbed(Norms(nn.BatchNorm1d(5, track_running_stats=False)))
    x, _ = _data((4,))
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    assert rop_graph(model, params, buffers, trace_network(model, x).graph) is None
    with_stats = _perturbed(Norms(nn.BatchNorm1d(5)))
    params, buffers = dict(with_stats.named_parameters()), dict(with_stats.named_buffers())
    assert rop_graph(with_stats, params, buffers, trace_network(with_stats, x).graph) is not None


class WideResidual(nn.Module):
    """A residual MLP whose first Linear sees more features (12) than there are samples (7)."""

    def __init__(self):
        super().__init__()
        self.inp, self.fc1, self.fc2, self.out = nn.Linear(12, 5), nn.Linear(5, 4), nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.inp(x))
        return self.out(F.relu(h + self.fc2(F.relu(self.fc1(h)))))


class WideNormed(nn.Module):
    """A first Linear (12 features, 7 samples) fused with the BatchNorm it feeds, then a residual block."""

    def __init__(self, affine: bool = True, bias: bool = True):
        super().__init__()
        self.inp, self.bn = nn.Linear(12, 5, bias=bias), nn.BatchNorm1d(5, affine=affine)
        self.fc, self.out = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.inp(x)))
        return self.out(F.relu(h + self.fc(h)))


SPAN_MODELS = {"residual": WideResidual, "fused BatchNorm": WideNormed,
               "fused BatchNorm without affine": lambda: WideNormed(affine=False),
               "fused BatchNorm, no bias": lambda: WideNormed(bias=False)}  # fmt: skip


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("name", SPAN_MODELS)
def test_data_span_coordinates_of_a_graph_keep_the_spectrum(chunk_size, name):
    """The first Linear's weight in coordinates of the data's span: the operator's spectrum, padded with the
    zeros of the directions orthogonal to the data, is the Hessian's, and the operator is the Hessian there."""
    model = _perturbed(SPAN_MODELS[name]())
    x, y = _data((12,))
    obj = Objective(model, CE, (x, y), chunk_size=chunk_size, memory_budget=2**30)
    span = data_span_hessian(HessianOperator(obj))
    assert isinstance(obj._rop, RopGraph) and span is not None and span.weight == "inp.weight"
    A = torch.stack([span.matvec(e) for e in torch.eye(span.size)], dim=1)
    torch.testing.assert_close(A, A.T, rtol=0, atol=1e-13)
    H = dense_hessian(obj)
    zeros = torch.zeros(H.shape[0] - span.size)
    expected, got = torch.linalg.eigvalsh(H), torch.cat([torch.linalg.eigvalsh(A), zeros]).sort().values
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10 * float(expected.abs().max()))
    # mapped back, the top eigenvector is one of H
    top = span.lift(torch.linalg.eigh(A).eigenvectors[:, -1:].T)[0]
    _close(H @ top, float(expected[-1]) * top)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_states_built_in_pieces_of_a_chunk_weight_them_by_their_samples(monkeypatch, reduction):
    """Each chunk's state is built in pieces whose largest tensor stays small (here: one sample per piece)."""
    import sharpness.products._objective as objective_module

    monkeypatch.setattr(objective_module, "_ROP_PIECE_BYTES", 1)
    model, x, y, *_ = build("resnet")
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    obj = Objective(model, loss_fn, (x, y), chunk_size=4)
    assert obj.hvp_strategy() == "rop" and obj._rop_piece == 1
    _, states = obj.rop_states()
    assert len(states) == x.shape[0]
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(7))
    H = dense_hessian(obj)
    _close(obj.hvp(v), H @ v)
    streamed = Objective(model, loss_fn, (x, y), chunk_size=4, memory_budget=1)
    _close(streamed.hvp(v), H @ v)
    with torch.no_grad():
        expected = loss_fn(model(x), y)
    torch.testing.assert_close(obj.value(), expected, rtol=1e-13, atol=0)


def test_a_regression_loss_uses_the_autograd_curvature_of_the_outputs():
    model, x, _, *_ = build("residual_mlp")
    target = torch.randn(x.shape[0], 3, generator=torch.Generator().manual_seed(6))
    _check(model, x, target, loss_fn=nn.MSELoss())


def test_state_bytes_count_the_kept_tensors():
    """The memory accounting of the kept state is what the samples' states hold, and decides streaming."""
    model, x, y, *_ = build("resnet")
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop" and obj._rop_fits()
    per_sample = obj._rop_bytes_per_sample
    _, states = obj.rop_states()
    entries = [e for state in states for e in [*state.saved, *state.deltas.values(), state.probs]]
    kept = {id(t): t for e in entries for t in (e if isinstance(e, tuple) else (e,))
            if isinstance(t, torch.Tensor) and t.shape[0] == x.shape[0]}  # fmt: skip
    assert sum(t.numel() * t.element_size() for t in kept.values()) == per_sample * x.shape[0]
    tight = Objective(model, CE, (x, y), memory_budget=per_sample * x.shape[0] - 1)
    assert tight.hvp_strategy() == "rop" and not tight._rop_fits() and tight.rop_states() is None
