"""R-operator products of transformer pieces (sharpness.products._rop_smooth): GELU, tanh, LayerNorm, parameters
used outside a module, nn.MultiheadAttention, and the built-in ViT as a whole.

Each product is checked in float64 against torch.func's forward-over-reverse product (``jvp`` of ``grad``, through
attention's math kernel: the fused ones have no forward derivative) to 1e-12 relative, with the data in one chunk
whose state is kept and streamed in chunks of 3 whose state is recomputed per product.
"""

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import Fn, _data, _mlp, _perturbed
from torch import nn
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from sharpness import Objective
from sharpness._vit import ViT
from sharpness.products._boundary import PRECISION_TOLERANCE, float32_hessian_error
from sharpness.products._rop_graph import RopGraph

CE = nn.CrossEntropyLoss()


def _exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """``auto`` picks the R-operator, and its products (kept and streamed state) equal ``jvp(grad)`` to 1e-12."""
    for obj in (Objective(model, CE, (x, y)), Objective(model, CE, (x, y), chunk_size=3, memory_budget=1)):
        assert obj.hvp_strategy() == "rop" and isinstance(obj._rop, RopGraph)
        v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        params = {k: t.detach() for k, t in obj.params.items()}
        gradient = grad(lambda p: CE(functional_call(model, p, (x,)), y))
        with sdpa_kernel(SDPBackend.MATH):
            ref = obj.layout.flatten(jvp(gradient, (params,), (obj.layout.unflatten(v),))[1])
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


class Tokens(nn.Module):
    """``(N, T * F)`` inputs as ``T`` tokens of ``F`` features, embedded by a Linear, plus a learned position
    table (a parameter outside any module, broadcast over the samples), then ``body``, the token mean, a Linear."""

    def __init__(self, body: nn.Module, tokens: int = 3, features: int = 2, dim: int = 4):
        super().__init__()
        self.tokens, self.embed, self.body = tokens, nn.Linear(features, dim), body
        self.pos = nn.Parameter(torch.randn(tokens, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.embed(x.unflatten(1, (self.tokens, -1))) + self.pos
        return self.head(self.body(h).mean(dim=1))


class OnData(nn.Module):
    """``body`` applied to ``(N, T * F)`` inputs cut into ``T`` tokens of ``F`` features (the data, which no parameter
    moves), then the token mean and a Linear."""

    def __init__(self, body: nn.Module, tokens: int = 3, dim: int = 4):
        super().__init__()
        self.tokens, self.body, self.head = tokens, body, nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(self.body(x.unflatten(1, (self.tokens, -1))).mean(dim=1))


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 4, heads: int = 2, bias: bool = True, **call):
        super().__init__()
        self.attn, self.call = nn.MultiheadAttention(dim, heads, bias=bias, batch_first=True), call

    def forward(self, h):
        return self.attn(h, h, h, **self.call)[0]


class CrossAttention(SelfAttention):
    def forward(self, h):
        return self.attn(h, F.relu(h), F.relu(h))[0]


class WithWeights(SelfAttention):
    def forward(self, h):
        out, weights = self.attn(h, h, h)
        return out + weights.sum(-1, keepdim=True)


PIECES = {
    "GELU module": (lambda: _mlp(nn.GELU()), (4,)),
    "F.gelu": (lambda: _mlp(Fn(F.gelu)), (4,)),
    "Tanh module": (lambda: _mlp(nn.Tanh()), (4,)),
    "torch.tanh": (lambda: _mlp(Fn(torch.tanh)), (4,)),
    "LayerNorm": (lambda: _mlp(nn.LayerNorm(6)), (4,)),
    "LayerNorm without bias": (lambda: _mlp(nn.LayerNorm(6, bias=False)), (4,)),
    "LayerNorm without affine": (lambda: _mlp(nn.LayerNorm(6, elementwise_affine=False)), (4,)),
    "LayerNorm of the data": (lambda: nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)),
                              (4,)),  # fmt: skip
    "Linear of tokens, a parameter outside a module": (lambda: Tokens(nn.ReLU()), (6,)),
    "LayerNorm of tokens": (lambda: Tokens(nn.LayerNorm(4)), (6,)),
    "MultiheadAttention": (lambda: Tokens(SelfAttention()), (6,)),
    "MultiheadAttention without biases": (lambda: Tokens(SelfAttention(bias=False)), (6,)),
    "MultiheadAttention, weights not needed": (lambda: Tokens(SelfAttention(need_weights=False)), (6,)),
    "MultiheadAttention of the data": (lambda: OnData(SelfAttention()), (12,)),
}


@pytest.mark.parametrize("name", list(PIECES))
def test_each_transformer_piece_equals_forward_over_reverse(name):
    builder, shape = PIECES[name]
    x, y = _data(shape)
    _exact(_perturbed(builder()), x, y)


@pytest.mark.parametrize("options", [dict(depth=2), dict(norm="post", act="gelu")])
def test_the_built_in_vit_products_equal_forward_over_reverse(options):
    model = _perturbed(ViT(dim=4, heads=2, mlp=4, **options))
    x, y = _data((64,), n=5, classes=10)
    _exact(model, x, y)


UNSUPPORTED = {
    "cross attention": lambda: Tokens(CrossAttention()),
    "attention with a mask": lambda: Tokens(SelfAttention(attn_mask=torch.zeros(3, 3, dtype=torch.bool))),
    "attention weights used": lambda: Tokens(WithWeights()),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_attention_falls_back_to_autograd(name):
    model = _perturbed(UNSUPPORTED[name]())
    x, y = _data((6,), classes=3)
    obj = Objective(model, CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


@pytest.mark.parametrize("margin", [1.0, 100.0])
def test_the_float32_check_of_a_transformer_runs_on_the_r_operator_and_keeps_its_verdict(margin):
    """The objective's float32 check (float32 against float64 products on the first samples) reads the R-operator
    where the products do, and says what the autograd check says: nothing at an ordinary point, the warning where
    every sample is fitted with logit gaps above 30 (logits scaled by ``margin``, labels the predictions) and
    float32 loses the Hessian (both errors near 0.5 there, below 1e-6 at the ordinary point)."""
    model = _perturbed(ViT(dim=4, heads=2, mlp=4)).float()
    with torch.no_grad():
        model.head.weight.mul_(margin)
        x, _ = _data((64,), n=8, classes=10)
        y = model(x.float()).argmax(1)
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop" and obj._rop_reader() is not None
    args = (obj.model, obj.chunk_loss_fn, obj.params, obj.buffers, obj.data.first_batch(), obj.device)
    with sdpa_kernel(SDPBackend.MATH):
        errors = [float32_hessian_error(*args, rop) for rop in (obj._rop_reader(), None)]
    assert [e > PRECISION_TOLERANCE for e in errors] == [margin > 1.0] * 2
    assert (obj.precision_warning is not None) == (margin > 1.0)


def test_the_state_bytes_of_a_transformer_count_every_kept_tensor():
    """The memory accounting of the kept state covers the attention's blocks of heads and its kept errors: it is
    what the samples' states hold (a budget one byte short of it streams)."""
    model = _perturbed(ViT(dim=4, heads=2, mlp=4))
    x, y = _data((64,), n=5, classes=10)
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop" and obj._rop_fits()
    _, states = obj.rop_states()
    entries = [e for state in states for e in [*state.saved, *state.deltas.values(), state.probs]]
    kept = {id(t): t for e in entries for t in (e if isinstance(e, tuple) else (e,)) if isinstance(t, torch.Tensor)}
    assert sum(t.numel() * t.element_size() for t in kept.values()) == obj._rop_bytes_per_sample * x.shape[0]


def test_the_products_read_the_trace_alone_and_the_structure_reuses_it():
    """A product needs the traced graph, not the symmetry analysis: none is run for it, and a structure asked for
    afterwards is analysed from the same trace."""
    model = _perturbed(ViT(dim=4, heads=2, mlp=4))
    x, y = _data((64,), n=5, classes=10)
    obj = Objective(model, CE, (x, y))
    obj.hvp(torch.ones(obj.layout.size, dtype=torch.float64))
    assert obj.hvp_strategy() == "rop" and not obj._structure
    assert obj.structure.traced is obj._traced[0] and obj.structure.group is not None


def _dense_jacobian_product(f, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``J(x) t`` of a map of the last axis, row by row, from torch.func's dense Jacobian in float64."""
    jac = torch.vmap(torch.func.jacrev(f))(x.double().reshape(-1, x.shape[-1]))
    return torch.einsum("rij,rj->ri", jac, t.double().reshape(-1, t.shape[-1])).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_normalization_and_softmax_jacobians_equal_dense_ones_in_every_dtype(dtype):
    """The LayerNorm and softmax Jacobian products the R-operator reads (torch's fused backward kernels in float32
    and float64 for LayerNorm, outside float64 for the softmax; separate passes otherwise) equal the dense Jacobians
    of the normalization and of the softmax to the dtype's rounding. Without the mean term or the ``xhat`` term of
    either the error is of order one."""
    from sharpness.products._rop_smooth import _norm_jacobian, _softmax_jacobian

    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(2, 5, 7, 12, generator=g, dtype=torch.float64) + 1).to(dtype)
    t = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    xhat, _, rstd = torch.native_layer_norm(x, x.shape[-1:], None, None, 1e-5)
    tol = {torch.float64: 1e-13, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]

    def normalize(row):
        return F.layer_norm(row, row.shape, eps=1e-5)

    ref = _dense_jacobian_product(normalize, x, t)
    got = _norm_jacobian(xhat, rstd.to(dtype), t).double()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * float(ref.abs().max()))
    a = torch.softmax(x.double(), -1)
    ref = _dense_jacobian_product(lambda row: torch.softmax(row, -1), x, t)
    got = _softmax_jacobian(a.to(dtype), t).double()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * float(ref.abs().max()))
