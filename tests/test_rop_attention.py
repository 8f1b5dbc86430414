"""R-operator products of attention written by hand (sharpness.products._rop_attention and the reshapes of
sharpness.products._rop_ops): products of two activations, the row softmax, ``F.scaled_dot_product_attention``,
axis permutations, the pieces of a fused projection, and whole transformers built from them.

Every product is checked in float64 against torch.func's ``jvp`` of ``grad`` (attention's math kernel) to 1e-12
relative, with the state kept and streamed in chunks of 3 (`test_rop_transformer._exact`).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import _data, _perturbed
from test_rop_transformer import CE, OnData, Tokens, _exact
from test_transformer_quotient import FusedBlock, HandBlock
from torch import nn
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from sharpness import Objective
from sharpness._vit import ViT

D, H = 4, 2  # width and heads of the pieces


class Heads(nn.Module):
    """Attention by hand on ``(N, T, D)``: separate, fused (``unbind``, ``chunk`` or ``split``, or integer indexing)
    projections, and the scores by ``@``/``matmul``/``bmm`` or SDPA."""

    def __init__(self, form: str, dim: int = D, heads: int = H, act=F.gelu):
        super().__init__()
        self.form, self.heads, self.hd, self.act = form, heads, dim // heads, act
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def _split(self, t):
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        b, t, d = x.shape
        form = self.form
        if form in ("unbind", "sdpa", "causal", "scale"):
            q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        elif form == "index":  # older timm: qkv[0], qkv[1], qkv[2]
            qkv = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        elif form == "chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = self._split(q), self._split(k), self._split(v)
        else:  # nanoGPT / BERT: split, view, permute
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (p.view(b, t, self.heads, self.hd).permute(0, 2, 1, 3) for p in (q, k, v))
        if form == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v)
        elif form == "causal":
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        elif form == "scale":
            a = F.scaled_dot_product_attention(q, k, v, scale=0.7)
        elif form == "chunk":
            scores = q.matmul(torch.transpose(k, 2, 3)) / math.sqrt(self.hd)
            a = torch.permute(F.softmax(scores, dim=-1) @ v, (0, 1, 2, 3))
        else:
            a = torch.matmul(torch.softmax(q @ k.transpose(-1, -2) * self.hd**-0.5, -1), v)
        return self.o(self.act(a.permute(0, 2, 1, 3).contiguous().view(b, t, d)))


class BertSelfAttention(nn.Module):
    """HuggingFace BERT's self-attention (eval mode, no mask): shapes built from ``x.size()``, ``view``, ``permute``,
    ``torch.matmul``, division by a number, ``nn.functional.softmax``, dropout, ``contiguous``."""

    def __init__(self, dim: int = D, heads: int = H):
        super().__init__()
        self.heads, self.size = heads, dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.1)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.heads, self.size)).permute(0, 2, 1, 3)

    def forward(self, hidden):
        q, k, v = (self.transpose_for_scores(m(hidden)) for m in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.size)
        context = torch.matmul(self.dropout(nn.functional.softmax(scores, dim=-1)), v)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (self.heads * self.size,))


class Mixer(nn.Module):
    """A product of an activation with a parameter (broadcast over the samples: its errors summed back) and of an
    activation with itself."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        return torch.bmm(h, h.transpose(1, 2)).softmax(dim=-1) @ x


PIECES = {
    "q k^T, softmax, A v; separate projections": lambda: Tokens(Heads("separate")),
    "unbind of a fused projection": lambda: Tokens(Heads("unbind")),
    "integer indexing of a fused projection": lambda: Tokens(Heads("index")),
    "chunk, F.softmax": lambda: Tokens(Heads("chunk")),
    "HuggingFace BERT's self-attention": lambda: Tokens(BertSelfAttention()),
    "SDPA": lambda: Tokens(Heads("sdpa")),
    "SDPA, causal": lambda: Tokens(Heads("causal")),
    "SDPA, a scale": lambda: Tokens(Heads("scale")),
    "SDPA of the data": lambda: OnData(Heads("sdpa", act=torch.tanh)),
    "bmm: a parameter and an activation with itself": lambda: Tokens(Mixer()),
}


@pytest.mark.parametrize("name", list(PIECES))
def test_each_attention_rule_equals_forward_over_reverse(name):
    x, y = _data((6 if "data" not in name else 12,))
    _exact(_perturbed(PIECES[name]()), x, y)


class Blocks(nn.Module):
    """``blocks`` on ``(N, T, 8)`` token inputs, then the token mean and a Linear."""

    def __init__(self, *blocks):
        super().__init__()
        self.blocks, self.head = nn.Sequential(*blocks), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x.unflatten(1, (4, 8))).mean(dim=1))


class GeluHand(HandBlock):
    """The quotient tests' HandBlock with a GELU MLP."""

    def forward(self, x):
        if self.pre_ln:
            x = x + self.attend(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        x = self.ln1(x + self.attend(x))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class GeluFused(FusedBlock):
    forward = GeluHand.forward


MODELS = {
    "hand, pre-LN, ReLU": lambda: Blocks(HandBlock(True)),
    "hand, post-LN, GELU": lambda: Blocks(GeluHand(False)),
    "fused unbind, pre-LN, GELU; hand, post-LN, ReLU": lambda: Blocks(GeluFused(True), HandBlock(False)),
    "fused unbind, post-LN, ReLU": lambda: Blocks(FusedBlock(False)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_hand_written_transformers_equal_forward_over_reverse(name):
    x, y = _data((32,), n=5)
    _exact(_perturbed(MODELS[name]()), x, y)


@pytest.mark.parametrize("options", [dict(depth=2), dict(norm="post", act="gelu")])
def test_the_built_in_vit_with_sdpa_equals_forward_over_reverse(options):
    x, y = _data((64,), n=5, classes=10)
    _exact(_perturbed(ViT(dim=4, heads=2, mlp=4, attn="hand", **options)), x, y)


class Masked(HandBlock):
    """Scores with a mask (a buffer) added, or filled in as nanoGPT's causal mask (``masked_fill`` of a piece of a
    buffer, the scale computed from the keys' shape)."""

    def __init__(self, fill: bool, value: float = float("-inf")):
        super().__init__(True)
        self.fill, self.value = fill, value
        mask = torch.ones(6, 6).tril_().view(1, 1, 6, 6) if fill else torch.zeros(4, 4).triu_(1)
        self.register_buffer("mask", mask)

    def attend(self, y):
        b, t, _ = y.shape
        q, k, v = (m(y).view(b, t, 2, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))) if self.fill else \
            k.size(-1) ** -0.5 * (q @ k.transpose(-2, -1))  # fmt: skip
        if self.fill:
            scores = scores.masked_fill(self.mask[:, :, :4, :4] == 0, self.value)  # fx cannot slice by t
        else:
            scores = scores - 3.0 * self.mask
        return self.o((F.softmax(scores, dim=-1) @ v).transpose(1, 2).contiguous().view(b, t, 8))


class ClassToken(nn.Module):
    """timm's class token: a parameter expanded over the samples and put before the tokens; the output read off it."""

    def __init__(self):
        super().__init__()
        self.cls, self.block, self.head = nn.Parameter(torch.randn(1, 1, 8)), GeluFused(True), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.cat((self.cls.expand(x.shape[0], -1, -1), x.unflatten(1, (4, 8))), dim=1)
        return self.head(self.block(h)[:, 0])


class TimmPositions(ClassToken):
    """timm's layout of the positions: a ``(1, T + 1, D)`` table (a batch axis of one, broadcast over the samples)
    added after the class token; and a ``(N, 1, D)`` gate broadcast over the tokens."""

    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 8))
        self.gate = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.cat((self.cls.expand(x.shape[0], -1, -1), x.unflatten(1, (4, 8))), dim=1) + self.pos_embed
        h = h + self.gate(h.mean(1, keepdim=True))
        return self.head(self.block(h)[:, 0])


class SdpaMask(nn.Module):
    """SDPA with an ``attn_mask``: a boolean buffer (which keys each query sees), a floating mask computed from the
    data (a padding bias per sample and key, as text models pass it), a floating one a parameter moves (``"moved"``:
    added to the scores), or a boolean one a parameter moves (``"moved boolean"``: not read, autograd)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv, self.o, self.w = nn.Linear(8, 24), nn.Linear(8, 8), nn.Parameter(torch.randn(4))
        self.register_buffer("keep", torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 0], [1, 1, 1, 1]]).bool())

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if self.kind == "boolean":
            mask = self.keep
        elif self.kind == "data":
            mask = (x[:, :, 0] > 0).float().mul(-3.0)[:, None, None, :]  # (N, 1, 1, T)
        elif self.kind == "moved":
            mask = self.w.expand(t, t)
        else:  # "moved boolean"
            mask = self.w.expand(t, t) > 0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(a.transpose(1, 2).reshape(b, t, 8))


MORE = {
    "SDPA with a boolean attn_mask": lambda: Blocks(SdpaMask("boolean")),
    "SDPA with an attn_mask computed from the data": lambda: Blocks(SdpaMask("data")),
    "SDPA with a floating attn_mask a parameter moves": lambda: Blocks(SdpaMask("moved")),
    "a mask added": lambda: Blocks(Masked(fill=False)),
    "nanoGPT's causal mask filled in": lambda: Blocks(Masked(fill=True)),
    "a mask filled with a number": lambda: Blocks(Masked(fill=True, value=-2.0)),
    "a class token": ClassToken,
    "timm's (1, T, D) position table, a (N, 1, D) gate": TimmPositions,
}


@pytest.mark.parametrize("name", list(MORE))
def test_masks_and_a_class_token_equal_forward_over_reverse(name):
    x, y = _data((32,), n=5)
    _exact(_perturbed(MORE[name]()), x, y)


class Unsupported(HandBlock):
    def __init__(self, case: str):
        super().__init__(True)
        self.case = case

    def attend(self, y):
        b, t, _ = y.shape
        q, k, v = (m(y).view(b, t, 2, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1)
        if self.case == "a log-softmax with a dtype":  # a softmax with one is read (test_rop_llama)
            a = F.log_softmax(scores, dim=-1, dtype=torch.float64).exp()
        elif self.case == "a mask computed from the scores":
            a = scores.masked_fill(scores < 0, 0.0).softmax(-1)
        else:  # "a quotient of two activations"
            a = (scores / (scores * scores + 1)).softmax(-1)
        return self.o((a @ v).transpose(1, 2).reshape(b, t, 8))


UNSUPPORTED = ["a log-softmax with a dtype", "a mask computed from the scores",
               "a quotient of two activations"]  # fmt: skip


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_attention_operations_fall_back_to_autograd(name):
    x, y = _data((32,), n=5)
    obj = Objective(_perturbed(Blocks(Unsupported(name))), CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


def test_a_boolean_sdpa_mask_the_parameters_move_falls_back_to_autograd():
    x, y = _data((32,), n=5)
    obj = Objective(_perturbed(Blocks(SdpaMask("moved boolean"))), CE, (x, y))
    assert obj._rop is None and obj.hvp_strategy() == "graph"


def test_the_state_bytes_of_hand_written_attention_count_every_kept_tensor():
    """The kept state's accounting covers what the new rules keep (SDPA's inputs made ready, probabilities and
    errors; the products' factors; the softmax's centred error): it is what the samples' states hold."""
    for model in (ViT(dim=4, heads=2, mlp=4, attn="hand"), Blocks(FusedBlock(True))):
        x, y = _data((64,) if isinstance(model, ViT) else (32,), n=5, classes=3)
        obj = Objective(_perturbed(model), CE, (x, y))
        assert obj.hvp_strategy() == "rop" and obj._rop_fits()
        _, states = obj.rop_states()
        entries = [e for state in states for e in [*state.saved, *state.deltas.values(), state.probs]]
        kept = {id(t): t for e in entries for t in (e if isinstance(e, tuple) else (e,)) if isinstance(t, torch.Tensor)}
        assert sum(t.numel() * t.element_size() for t in kept.values()) == obj._rop_bytes_per_sample * x.shape[0]


@pytest.mark.parametrize("model", ["vit", "vit, attention by hand", "hand, post-LN, GELU"])
def test_float32_transformer_products_equal_float64_forward_over_reverse(model):
    """In float32, where the products read torch's fused LayerNorm and softmax kernels, the R-operator's product on
    a transformer equals the float64 ``jvp(grad)`` to float32's rounding (1e-5 relative; a product missing a term is
    off by more than 1e-2)."""
    vit = model.startswith("vit")
    net = _perturbed(ViT(dim=8, heads=2, mlp=8, attn="hand" if "hand" in model else "mha") if vit else MODELS[model]())
    x, y = _data((64,) if vit else (32,), n=6, classes=10 if vit else 3)
    obj = Objective(net.float(), CE, (x, y), dtype=torch.float32)
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    net64 = net.double()
    params = {k: t.detach() for k, t in net64.named_parameters()}
    gradient = grad(lambda p: CE(functional_call(net64, p, (x.double(),)), y))
    with sdpa_kernel(SDPBackend.MATH):
        ref = obj.layout.flatten(jvp(gradient, (params,), (obj.layout.unflatten(v.double()),))[1])
    torch.testing.assert_close(obj.hvp(v).double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


class RelativeBias(nn.Module):
    """BEiT's attention: a learned table of ``2 T - 1`` relative positions per head, read at a constant index buffer
    (each entry picked for several pairs of tokens), reshaped and permuted into ``(1, heads, T, T)`` and added to the
    scores, by SDPA's ``attn_mask`` (``"sdpa"``) or by hand (``"hand"``). ``"merged"``: the scores' samples axis
    is also merged with the heads' and split again."""

    def __init__(self, how: str, tokens: int = 4, dim: int = 8, heads: int = 2):
        super().__init__()
        self.how, self.t, self.heads, self.hd = how, tokens, heads, dim // heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.table = nn.Parameter(0.5 * torch.randn(2 * tokens - 1, heads))
        pos = torch.arange(tokens)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + tokens - 1).reshape(-1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.table[self.index].view(self.t, self.t, self.heads).permute(2, 0, 1).contiguous().unsqueeze(0)
        if self.how == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            s = q @ k.transpose(-2, -1) * self.hd**-0.5 + bias
            if self.how == "merged":  # the samples' axis merged with the heads' and split again
                s = s.reshape(b * self.heads, t, t).reshape(b, self.heads, t, t)
            a = s.softmax(-1) @ v
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("how", ["sdpa", "hand"])
def test_a_learned_relative_position_bias_equals_forward_over_reverse(how):
    """The table's products: its tangent gathered like its value, its error added back over every pair of tokens that
    picks an entry; by SDPA a floating mask the parameters move is a fourth input added to the scores."""
    x, y = _data((16,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(RelativeBias(how)), tokens=4, features=4, dim=8)), x, y)


def test_a_view_merging_the_data_s_samples_axis_is_read_by_the_r_operator():
    """The scores' samples axis merged with the heads' and split again (as Swin folds its windows into the batch): a
    view, linear whatever its axes, read by the R-operator (before, the products fell back to autograd)."""
    x, y = _data((16,), n=5)
    model = _perturbed(Tokens(nn.Sequential(RelativeBias("merged")), tokens=4, features=4, dim=8))
    _exact(model, x, y)


class Float32Bias(RelativeBias):
    """The relative position table cast to float32 before SDPA adds it to float64 scores (SDPA accepts a mask of
    another floating dtype): the mask's errors are autograd's in float32 (before: kept in float64, 2e-9 off)."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.table.to(torch.float32)[self.index].view(self.t, self.t, self.heads).permute(2, 0, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


def test_a_moved_mask_of_another_dtype_takes_its_errors_in_its_own():
    x, y = _data((16,), n=5)
    obj = Objective(_perturbed(Tokens(nn.Sequential(Float32Bias("sdpa")), tokens=4, features=4, dim=8)), CE, (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = obj.hvp(v, "double_backward")
    torch.testing.assert_close(obj.hvp(v), reference, rtol=0, atol=1e-13 * float(reference.abs().max()))


class CosineAttention(nn.Module):
    """SwinV2's cosine attention: queries and keys normalized (``F.normalize``), their products times a learned logit
    scale clamped from above and exponentiated, and a learned bias passed through a small MLP of a constant table."""

    def __init__(self, tokens: int = 4, dim: int = 8, heads: int = 2):
        super().__init__()
        self.t, self.heads, self.hd = tokens, heads, dim // heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.tensor([[[1.2]], [[9.0]]]))  # the second head's clamped
        self.cpb = nn.Sequential(nn.Linear(2, 6), nn.ReLU(), nn.Linear(6, heads, bias=False))
        self.register_buffer("coords", torch.randn(tokens, tokens, 2, generator=torch.Generator().manual_seed(9)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        s = s + 16 * torch.sigmoid(self.cpb(self.coords).permute(2, 0, 1)).unsqueeze(0)
        return x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def test_cosine_attention_is_read_by_the_r_operator():
    """SwinV2's attention: the normalization's products (a symmetric Jacobian and its second-order term) and the
    clamped logit scale's (no slope above the bound) equal forward over reverse (1e-12), from the kept state and in
    chunks of 3; before, such blocks fell back to autograd."""
    x, y = _data((16,), n=5)
    _exact(_perturbed(Tokens(nn.Sequential(CosineAttention()), tokens=4, features=4, dim=8)), x, y)


def test_the_normalization_s_rules_are_torch_s_also_on_rows_shorter_than_eps():
    """``F.normalize``'s tangent, error and second-order term against ``torch.func`` on rows of every length: a zero
    row and one shorter than ``eps`` (where the map is ``x / eps``, linear), and ordinary ones."""
    from torch.func import jvp, vjp

    from sharpness.products._rop_smooth import _Normalize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    x[0], x[1] = 0.0, 1e-13 * x[1] / x[1].norm()
    xdot, delta, g_dot = (torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    op = _Normalize(1e-12)
    out, saved = op.forward([x], [])

    def f(t):
        return F.normalize(t, dim=-1)

    torch.testing.assert_close(out, f(x), rtol=1e-15, atol=0)
    torch.testing.assert_close(op.tangent([xdot], saved), jvp(f, (x,), (xdot,))[1], rtol=1e-12, atol=0)
    torch.testing.assert_close(op.adjoint(delta, saved, [True])[0], vjp(f, x)[1](delta)[0], rtol=1e-12, atol=0)
    second = jvp(lambda t: vjp(f, t)[1](delta)[0], (x,), (xdot,))[1] + vjp(f, x)[1](g_dot)[0]
    torch.testing.assert_close(op.backward(g_dot, delta, [xdot], saved, [True])[0], second, rtol=1e-10, atol=1e-14)
