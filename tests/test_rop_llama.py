"""R-operator products of the pieces of LLaMA-style transformers and of smooth elementwise functions: RMSNorm (the
module and the hand-written form), SiLU and SwiGLU, sigmoid, the tanh-approximated GELU, softplus, powers, exp, log,
elementwise products of activations (broadcast ones included), and rotary position embeddings.

Each product is checked in float64 against torch.func's forward-over-reverse product (``jvp`` of ``grad``, attention
through its math kernel) to 1e-12 relative, with the data in one chunk whose state is kept and streamed in chunks of
3 whose state is recomputed per product (`test_rop_transformer._exact`).
"""

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import _data, _perturbed
from test_rop_transformer import CE, Tokens, _exact
from torch import nn

from manifolds import UnsupportedModelError, trace_network
from sharpness import Objective
from sharpness.products._rop_graph import rop_graph


class Act(nn.Module):
    """``Linear(6, 8)``, ``act``, ``Linear(8, 3)``."""

    def __init__(self, act):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(6, 8), nn.Linear(8, 3), act

    def forward(self, x):
        return self.b(self.act(self.a(x)))


ACTIVATIONS = {
    "nn.SiLU": nn.SiLU(),
    "F.silu": F.silu,
    "nn.Sigmoid": nn.Sigmoid(),
    "torch.sigmoid": torch.sigmoid,
    "nn.GELU(approximate='tanh')": nn.GELU(approximate="tanh"),
    "F.gelu(approximate='tanh')": lambda h: F.gelu(h, approximate="tanh"),
    "nn.Softplus(beta=2, threshold=1) (linear above it)": nn.Softplus(beta=2.0, threshold=1.0),
    "F.softplus": F.softplus,
    "exp": lambda h: torch.exp(0.5 * h),
    "log of a square plus one (a product of an activation with itself)": lambda h: torch.log(h * h + 1),
    "sqrt, square": lambda h: torch.sqrt(torch.square(h) + 1),
    "rsqrt, pow": lambda h: torch.rsqrt(h.pow(2) + 1) * h,
    "** 3": lambda h: h**3,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_smooth_elementwise_functions_equal_forward_over_reverse(name):
    x, y = _data((6,), n=7)
    _exact(_perturbed(Act(ACTIVATIONS[name])), x, y)


def test_softplus_hits_both_of_its_branches_in_the_test():
    model = _perturbed(Act(nn.Softplus(beta=2.0, threshold=1.0)))
    x, _ = _data((6,), n=7)
    pre = 2.0 * model.a(x)
    assert bool((pre > 1.0).any()) and bool((pre <= 1.0).any())


class SwiGLU(nn.Module):
    """LLaMA's MLP on tokens: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int = 4, hidden: int = 6):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)  # fmt: skip

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Scaled(nn.Module):
    """Products with broadcast operands: a parameter ``(D,)``, a constant buffer ``(T, D)``, a ``(N, T, 1)`` gate."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(dim))
        self.register_buffer("table", torch.randn(3, dim))
        self.gate = nn.Linear(dim, 1)

    def forward(self, x):
        return torch.mul(x * self.gain, self.table) * torch.sigmoid(self.gate(x))


class HandRMSNorm(nn.Module):
    """LLaMA's RMSNorm as its code writes it."""

    def __init__(self, dim: int = 4, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """A pre-norm LLaMA block on ``(N, T, D)``: RMSNorm, causal attention by SDPA with rotary position embeddings
    (constant cos/sin tables), SwiGLU MLP, residual sums."""

    def __init__(self, dim: int = 8, heads: int = 2, tokens: int = 3, hand_norm: bool = False,
                 grouped: str | None = None):  # fmt: skip
        super().__init__()
        self.heads, self.hd, self.grouped = heads, dim // heads, grouped
        norm = (lambda: HandRMSNorm(dim)) if hand_norm else (lambda: nn.RMSNorm(dim))
        self.n1, self.n2 = norm(), norm()
        kv = dim if grouped is None else dim // heads  # grouped: one key/value head for all query heads
        self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k, self.v = nn.Linear(dim, kv, bias=False), nn.Linear(dim, kv, bias=False)
        self.mlp = SwiGLU(dim, 12)
        freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        angles = torch.outer(torch.arange(tokens, dtype=torch.float64), freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def _rope(self, t):
        return t * self.cos + _rotate_half(t) * self.sin

    def forward(self, x):
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (m(h).view(b, t, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.grouped == "repeat_kv":  # HuggingFace's: a new axis expanded and merged into the heads'
            k, v = (u[:, :, None].expand(b, u.shape[1], self.heads // u.shape[1], t, self.hd)
                    .reshape(b, self.heads, t, self.hd) for u in (self._rope(k), v))  # fmt: skip
            a = F.scaled_dot_product_attention(self._rope(q), k, v, is_causal=True)
        elif self.grouped == "repeat_interleave":  # copies, not a view
            k, v = self._rope(k).repeat_interleave(self.heads, dim=1), torch.repeat_interleave(v, self.heads, dim=1)
            a = F.scaled_dot_product_attention(self._rope(q), k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True,
                                               enable_gqa=self.grouped == "enable_gqa")  # fmt: skip
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


BODIES = {
    "SwiGLU": lambda: SwiGLU(),
    "products with a parameter, a constant table and a (N, T, 1) gate": lambda: Scaled(),
    "nn.RMSNorm": lambda: nn.RMSNorm(4),
    "nn.RMSNorm with eps and no affine weight, then a Linear": lambda: nn.Sequential(
        nn.RMSNorm(4, eps=1e-3, elementwise_affine=False), nn.Linear(4, 4)),
    "RMSNorm written by hand": lambda: HandRMSNorm(),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_llama_pieces_equal_forward_over_reverse(name):
    x, y = _data((6,), n=7)
    _exact(_perturbed(Tokens(BODIES[name]())), x, y)


@pytest.mark.parametrize("hand_norm", [False, True])
def test_a_llama_block_with_rotary_embeddings_equals_forward_over_reverse(hand_norm):
    x, y = _data((6,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(LlamaBlock(hand_norm=hand_norm)), features=2, dim=8)), x, y)


class ShapeRepeat(nn.Module):
    """``h.repeat((1, h.shape[1] // 4))``: a copy whose sizes are computed in the graph, nested in a tuple."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h.repeat((1, h.shape[1] // 4)))


def test_a_copy_with_sizes_computed_in_the_graph_falls_back_to_autograd():
    x, y = _data((6,), n=7)
    obj = Objective(_perturbed(ShapeRepeat()), CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


@pytest.mark.parametrize("grouped", ["repeat_kv", "enable_gqa", "repeat_interleave"])
def test_grouped_query_attention_equals_forward_over_reverse(grouped):
    """One key/value head read by both query heads: repeated by HuggingFace's ``repeat_kv`` (an ``expand``), by
    SDPA's ``enable_gqa`` or copied by ``repeat_interleave`` (the key and value errors summed back over the query heads
    reading them)."""
    x, y = _data((6,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(LlamaBlock(grouped=grouped)), features=2, dim=8)), x, y)


def test_rms_norm_without_eps_uses_the_rounding_unit_of_the_products_dtype():
    """``eps=None`` is ``finfo(dtype).eps`` of the input, as in torch (here float64's, 2.2e-16). With activations
    near 1e-6 (mean square about 1e-12) float32's 1.2e-7 would change the normalization by a factor of hundreds."""
    model = _perturbed(Tokens(nn.RMSNorm(4)))
    with torch.no_grad():
        for t in (model.embed.weight, model.embed.bias, model.pos):
            t.mul_(1e-6)
    x, y = _data((6,), n=7)
    _exact(model, x, y)
    with torch.no_grad():
        h = model.embed(x.unflatten(1, (3, -1))) + model.pos
    assert float(h.pow(2).mean()) < 1e-3 * torch.finfo(torch.float32).eps


class Division(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(h / (h.abs() + 1))


def test_a_division_by_an_activation_falls_back_to_autograd():
    x, y = _data((6,), n=7)
    obj = Objective(_perturbed(Division()), CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


class PowerAfterRelu(nn.Module):
    """``relu(h) ** p + h``: at the zeros of the ReLU, ``p = 0`` and ``1`` have 0 * inf in the textbook derivatives,
    and ``1 < p < 2`` an infinite second derivative, met by a zero tangent."""

    def __init__(self, p: float):
        super().__init__()
        self.p, self.a, self.b = p, nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(F.relu(h) ** self.p + h)


@pytest.mark.parametrize("p", [0, 1, 1.5, 2.0, 3])
def test_powers_at_the_zeros_of_a_relu_equal_forward_over_reverse(p):
    x, y = _data((6,), n=7)
    model = _perturbed(PowerAfterRelu(p))
    with torch.no_grad():
        assert bool((model.a(x) < 0).any())  # some zeros of the ReLU
    _exact(model, x, y)


class ShapeRead(nn.Module):
    """Numbers read off shapes: a slice of a shape (a ``torch.Size``, so advanced indexing: a copy), or the batch
    size (different for every chunk of the data)."""

    def __init__(self, case: str):
        super().__init__()
        self.case, self.a, self.b = case, nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x)).unflatten(1, (2, 4))
        if self.case == "an index by a slice of the shape":
            h = h[:, :, h.shape[1:2]].expand(-1, -1, 4)
        elif self.case == "index bounds from the batch size":
            k = x.shape[0] % 2
            h = torch.cat((h[:, :, k : k + 2], h[:, :, k : k + 2]), dim=-1)
        else:  # "a factor from the batch size"
            h = h * (x.shape[0] % 3)
        return self.b(h.flatten(1))


@pytest.mark.parametrize("case", ["an index by a slice of the shape", "index bounds from the batch size",
                                  "a factor from the batch size"])  # fmt: skip
def test_numbers_read_off_the_shape_that_are_no_size_of_a_feature_axis_are_not_read(case):
    """The R-operator reads a number computed from shapes only where it is a size of an axis other than the samples'
    (the same in every chunk of the data) and, in an index, an int; otherwise autograd's products run. A number read
    off the batch's size makes the outputs change with the chunks: the objective refuses such a model first, so the
    reader is asked directly."""
    x, y = _data((6,), n=7)
    model = _perturbed(ShapeRead(case))
    if "batch size" in case:
        with pytest.raises(UnsupportedModelError, match="change with the size of their batch"):
            Objective(model, CE, (x, y))
        params = {k: p.detach() for k, p in model.named_parameters()}
        assert rop_graph(model, params, dict(model.named_buffers()), trace_network(model, x).graph) is None
        return
    obj = Objective(model, CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


class InPlaceOnAView(nn.Module):
    """An in-place activation of a view of ``h``, with ``h`` itself read after the write (it sees the activation)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.a, self.b, self.c, self.act = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3), act

    def forward(self, x):
        h = self.a(x)
        u = self.act(h.view(-1, 8))
        return self.b(u) + self.c(h)


@pytest.mark.parametrize("act", [nn.SiLU(inplace=True), nn.ReLU(inplace=True)], ids=["SiLU", "ReLU"])
def test_an_in_place_write_into_a_view_read_through_its_base_is_not_read(act):
    """The products read every call out of place: a write through a view, whose base is read afterwards, is refused
    (autograd's products, which see the write, run instead) and the product is exact."""
    from test_rop_inplace import _autograd_exact

    x, y = _data((6,), n=7)
    obj = _autograd_exact(_perturbed(InPlaceOnAView(act)), x, y)
    assert obj._rop is None


class EvaBlock(nn.Module):
    """timm's EVA attention (EVA-02, its rotary ViTs): the bias of one bias-free ``qkv`` Linear concatenated in the
    forward from the query and value biases and a zero key buffer, passed to ``F.linear`` by name; the first token
    left unrotated, the others rotated by pairs interleaved with ``stack``, cast back with ``.to(dtype=...)`` and
    ``.type_as(v)``. ``round_trip``: the rotation computed in float32, the pairs turned by a matrix product, and
    cast back (the tangents and errors cast with it)."""

    def __init__(self, dim: int = 8, heads: int = 2, tokens: int = 3, round_trip: bool = False):
        super().__init__()
        self.heads, self.hd, self.round_trip = heads, dim // heads, round_trip
        self.n1 = nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        angles = torch.outer(torch.arange(tokens - 1.0), 1.0 / (10000 ** (torch.arange(0.0, self.hd, 2) / self.hd)))
        angles = angles.repeat_interleave(2, dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("turn", torch.zeros(self.hd, self.hd))  # row vectors: the pair (a, b) to (-b, a)
        for i in range(0, self.hd, 2):
            self.turn[i + 1, i], self.turn[i, i + 1] = -1.0, 1.0

    def _rope(self, u):
        rest = u[:, :, 1:]
        if self.round_trip:
            rest = rest.to(torch.float32)
        if self.round_trip:  # the pairs turned by a float32 matrix (a matrix product promotes no dtype)
            turned = rest @ self.turn.to(rest.dtype)
        else:
            turned = torch.stack([-rest[..., 1::2], rest[..., ::2]], -1).reshape(rest.shape)
        rotated = (rest * self.cos.to(rest.dtype) + turned * self.sin.to(rest.dtype)).to(dtype=u.dtype)
        return torch.cat([u[:, :, :1], rotated], dim=2)

    def forward(self, x):
        b, t, d = x.shape
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(input=self.n1(x), weight=self.qkv.weight, bias=bias)
        q, k, v = qkv.reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(self._rope(q).type_as(v), self._rope(k).type_as(v), v)
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


def test_eva_attention_equals_forward_over_reverse():
    x, y = _data((6,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(EvaBlock()), features=2, dim=8)), x, y)


def test_a_float32_round_trip_casts_the_tangents_and_errors_too():
    """Both products see the float32 rounding of the rotation, each in its own order of operations: they agree to
    float32's precision. A tangent or error left in float64 would meet the float32 matrix in a product, which
    promotes no dtype."""
    x, y = _data((6,), n=5)
    model = _perturbed(Tokens(nn.Sequential(EvaBlock(round_trip=True)), features=2, dim=8))
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    torch.testing.assert_close(obj.hvp(v), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))


class Cast(nn.Module):
    """A gate cast to integers or booleans and back (``cast``): the cast's derivative is zero, so its tangent must
    be dropped, not rounded; ``idx`` a long buffer whose dtype ``type_as`` and ``to`` read."""

    def __init__(self, cast):
        super().__init__()
        self.a, self.b, self.head, self.cast = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 3), cast
        self.register_buffer("idx", torch.zeros(4, dtype=torch.long))

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) * self.cast(self, 3 * self.b(x)).to(x.dtype))


CASTS = {
    "to(torch.int64)": lambda m, h: h.to(torch.int64),
    "to(dtype=torch.bool)": lambda m, h: h.to(dtype=torch.bool),
    "type_as(a long buffer)": lambda m, h: h.type_as(m.idx),
    "to(a long buffer's dtype)": lambda m, h: h.to(m.idx.dtype),
}


@pytest.mark.parametrize("name", list(CASTS))
def test_a_cast_to_integers_or_booleans_is_not_read_as_a_cast_of_the_tangent(name):
    x, y = _data((6,), n=7)
    obj = Objective(_perturbed(Cast(CASTS[name])), CE, (x, y))
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    torch.testing.assert_close(obj.hvp(v), reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


class Joined(nn.Module):
    """``torch.stack`` and ``torch.cat`` with their tensors given by keyword."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 4), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(torch.cat(tensors=[torch.stack(tensors=[h, h * h], dim=-1).flatten(1), h * 2, h], dim=1))


def test_stack_and_cat_with_their_tensors_by_keyword_equal_forward_over_reverse():
    x, y = _data((6,), n=7)
    _exact(_perturbed(Joined()), x, y)


class Parallel(nn.Module):
    """Two branches added as timm's parallel blocks add them, ``torch.stack(branches).sum(0)`` (``how``), or summed
    along another axis or kept (the stack then read as it is)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b, self.head = how, nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        branches = [torch.tanh(self.a(x)), self.b(x) * self.b(x)]
        if self.how == "sum(0)":
            h = torch.stack(branches).sum(0)
        elif self.how == "sum(dim=0)":
            h = torch.stack(branches, dim=0).sum(dim=0)
        elif self.how == "sum(0, keepdim=True)":
            h = torch.stack(branches).sum(0, keepdim=True)[0]
        else:  # along the features: the first axis is the samples'
            h = torch.stack(branches, dim=-1).sum(-1)
        return self.head(h)


@pytest.mark.parametrize("how", ["sum(0)", "sum(dim=0)", "sum(0, keepdim=True)", "sum(-1)"])
def test_branches_stacked_and_summed_equal_forward_over_reverse(how):
    x, y = _data((6,), n=7)
    model = _perturbed(Parallel(how))
    if how == "sum(0, keepdim=True)":  # not read (the stack alone along the samples' axis is not): autograd's
        obj = Objective(model, CE, (x, y))
        assert obj._rop is None and obj.hvp_strategy() == "graph"
        return
    _exact(model, x, y)


class EagerAttention(nn.Module):
    """HuggingFace's eager attention: ``softmax(scores, dim=-1, dtype=...)`` in a dtype of its own, cast back with
    ``.to(q.dtype)`` before the product with the values."""

    def __init__(self, dtype: torch.dtype, dim: int = 8, heads: int = 2):
        super().__init__()
        self.dtype, self.heads, self.hd = dtype, heads, dim // heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.softmax(q @ k.transpose(-2, -1) * self.hd**-0.5, dim=-1, dtype=self.dtype).to(q.dtype)
        return x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))


def test_a_softmax_in_the_models_own_dtype_equals_forward_over_reverse():
    x, y = _data((6,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(EagerAttention(torch.float64)), features=2, dim=8)), x, y)


def test_a_softmax_in_float32_inside_a_float64_model_casts_the_tangents_and_errors():
    """The R-operator's product and autograd's both see the float32 softmax, each in its own order of operations: they
    agree to float32's precision (a tangent or error left in float64 would give float64 weights to the product)."""
    x, y = _data((6,), n=5)
    model = _perturbed(Tokens(nn.Sequential(EagerAttention(torch.float32)), features=2, dim=8))
    obj = Objective(model, CE, (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    error = float((obj.hvp(v) - reference).abs().max() / reference.abs().max())
    assert 1e-12 < error < 1e-5, error  # float32's rounding is seen, and no more


class Promoted(nn.Module):
    """A float32 tensor added to a float64 constant (the sum promotes it), then multiplied by a float64 matrix: the
    tangent must take the sum's dtype as the value does (before, it stayed float32 and the product raised). ``how``:
    the float32 tensor cast by ``.to`` or computed by ``softmax(..., dtype=torch.float32)``."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.head = how, nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        narrow = h.softmax(-1).to(torch.float32) if self.how == "to" else F.softmax(h, -1, dtype=torch.float32)
        return self.head(narrow + torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("how", ["to", "softmax"])
def test_a_narrow_tensor_promoted_by_a_sum_keeps_its_tangent_in_the_sum_s_dtype(how):
    x, y = _data((6,), n=7)
    obj = Objective(_perturbed(Promoted(how)), CE, (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    error = float((obj.hvp(v) - reference).abs().max() / reference.abs().max())
    assert error < 1e-6, error  # float32's rounding of the softmax, seen by both
