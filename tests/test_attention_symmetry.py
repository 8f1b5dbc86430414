"""The transformer symmetry group (manifolds._attention, manifolds._matrix_group) on tiny float64 transformers.

Each model comes with its group dimension counted by hand and a transformation written here directly on the
state dict (independently of the library): both must keep the outputs to 1e-10, and a deliberately wrong
variant of the hand transformation must not.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import manifolds
from sharpness import euclidean_sharpness

D, H, HD, FF, T = 8, 2, 4, 12, 5  # model width, heads, head size, MLP width, tokens


def _activation(kind: str) -> nn.Module:
    return nn.ReLU() if kind == "relu" else nn.GELU()


class MHABlock(nn.Module):
    """A transformer block with nn.MultiheadAttention; ``kdim`` adds a Linear producing key/value inputs."""

    def __init__(self, pre_ln=True, bias=True, batch_first=True, kdim=None, act="relu", add_bias_kv=False, rms=False):
        super().__init__()
        self.pre_ln = pre_ln
        norm = nn.RMSNorm if rms else nn.LayerNorm
        self.ln1, self.ln2 = norm(D), norm(D)
        self.kv_in = nn.Linear(D, kdim) if kdim else None
        self.attn = nn.MultiheadAttention(
            D, H, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim, add_bias_kv=add_bias_kv
        )
        self.fc1, self.act, self.fc2 = nn.Linear(D, FF), _activation(act), nn.Linear(FF, D)

    def forward(self, x):
        if self.pre_ln:
            y = self.ln1(x)
            kv = self.kv_in(y) if self.kv_in is not None else y
            x = x + self.attn(y, kv, kv, need_weights=False)[0]
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))
        kv = self.kv_in(x) if self.kv_in is not None else x
        x = self.ln1(x + self.attn(x, kv, kv, need_weights=False)[0])
        return self.ln2(x + self.fc2(self.act(self.fc1(x))))


class HandBlock(nn.Module):
    """A pre-LN block with attention written by hand (explicit product and softmax, or SDPA)."""

    def __init__(self, sdpa=False, rotary=False):
        super().__init__()
        self.sdpa, self.rotary = sdpa, rotary
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.drop = nn.Dropout(0.1)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.register_buffer("phase", torch.linspace(0.5, 1.5, T * HD).reshape(T, HD))
        self.scale = HD**-0.5

    def forward(self, x):
        b, t, c = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, t, H, HD).transpose(1, 2)
        k = self.k(y).view(b, t, H, HD).transpose(1, 2)
        v = self.v(y).view(b, t, H, HD).transpose(1, 2)
        if self.rotary:  # a position-dependent diagonal map on q and k: the query/key factor keeps the diagonal A
            q, k = q * self.phase, k * self.phase
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = self.drop((q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)) @ v
        x = x + self.o(a.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


class FusedBlock(nn.Module):
    """A pre-LN block whose attention projects query, key and value with one Linear and cuts its output (as timm's
    and many ViTs do): ``unbind`` of a ``(3, b, heads, t, hd)`` permutation, integer indexing of it, or ``chunk``
    along the features; ``shared_piece`` reads the query's piece twice (as query and as key), ``overlap`` cuts a
    last piece holding every feature and adds it to the output: neither has GL factors."""

    def __init__(self, split="unbind"):
        super().__init__()
        self.split = split
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        b, t, c = x.shape
        y = self.ln1(x)
        extra = 0
        if self.split == "chunk":
            q, k, v = self.qkv(y).chunk(3, dim=-1)  # unpacked at once: torch.fx can count the pieces
            q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
        elif self.split == "overlap":  # the last piece holds every feature, the query's rows included
            q, k, v, _, whole = self.qkv(y).tensor_split([D, 2 * D, 3 * D, 0], dim=-1)
            q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
            extra = whole[..., :D]
        else:
            qkv = self.qkv(y).reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4)
            if self.split == "unbind":
                q, k, v = qkv.unbind(0)
            else:
                q, k, v = qkv[0], qkv[0 if self.split == "shared_piece" else 1], qkv[2]
        if self.split in ("chunk", "overlap"):
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c)) + extra
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


# -- hand-written group elements (state dict in, state dict out) -------------------------------------------------
def _rows(sd, name, rows, m):
    w = sd[name].clone()
    w[rows] = m @ w[rows]
    sd[name] = w


def _cols(sd, name, cols, m, rows=slice(None)):
    w = sd[name].clone()
    w[rows, cols] = w[rows, cols] @ m
    sd[name] = w


def hand_mha(sd, prefix, a, b, wrong_key=False):
    """Per head: Wq_h <- A^T Wq_h, Wk_h <- A^-1 Wk_h (biases too), Wv_h <- B^T Wv_h, out columns <- (.) B^-T."""
    packed = prefix + "in_proj_weight" in sd
    for h in range(H):
        mats = {"q": a[h].T, "k": a[h].T if wrong_key else torch.linalg.inv(a[h]), "v": b[h].T}
        for i, role in enumerate("qkv"):
            block = slice(i * D + h * HD, i * D + (h + 1) * HD)
            if packed:
                _rows(sd, prefix + "in_proj_weight", block, mats[role])
            else:
                _rows(sd, f"{prefix}{role}_proj_weight", slice(h * HD, (h + 1) * HD), mats[role])
            if prefix + "in_proj_bias" in sd:
                _rows(sd, prefix + "in_proj_bias", block, mats[role])
        _cols(sd, prefix + "out_proj.weight", slice(h * HD, (h + 1) * HD), torch.linalg.inv(b[h]).T)


def hand_linear_heads(sd, prefix, a, b, qk=True):
    """The same on separate q/k/v/o Linears whose output features h*HD:(h+1)*HD form head h."""
    for h in range(H):
        rows = slice(h * HD, (h + 1) * HD)
        pairs = [("q", a[h].T), ("k", torch.linalg.inv(a[h]))] if qk else []
        for role, m in [*pairs, ("v", b[h].T)]:
            _rows(sd, f"{prefix}{role}.weight", rows, m)
            _rows(sd, f"{prefix}{role}.bias", rows, m)
        _cols(sd, f"{prefix}o.weight", rows, torch.linalg.inv(b[h]).T)


def hand_trade(sd, scaled, consumers, c):
    """Scale the vectors ``scaled`` (rows of a matrix) by ``c`` and divide the consumers' columns by ``c``."""
    for name in scaled:
        t = sd[name].clone()
        sd[name] = t * (c[:, None] if t.dim() == 2 else c)
    for name, rows in consumers:
        _cols(sd, name, slice(None), torch.diag(1 / c), rows)


def _random_gl(g, k=HD):
    return torch.eye(k) + 0.4 * torch.randn(k, k, generator=g)


def _random_scales(g, k):
    return torch.exp(0.5 * torch.randn(k, generator=g))


def hand_mha_block(sd, cfg, g, wrong_key=False):
    """The whole group of an MHABlock, by hand."""
    a, b = [_random_gl(g) for _ in range(H)], [_random_gl(g) for _ in range(H)]
    if not cfg.get("add_bias_kv"):
        hand_mha(sd, "attn.", a, b, wrong_key)
    kdim = cfg.get("kdim")
    if cfg.get("pre_ln", True):
        readers = ["attn.q_proj_weight", "kv_in.weight"] if kdim else ["attn.in_proj_weight"]
        affine = [p for p in ("weight", "bias") if f"ln1.{p}" in sd]  # RMSNorm has no bias
        hand_trade(sd, [f"ln1.{p}" for p in affine], [(r, slice(None)) for r in readers], _random_scales(g, D))
        hand_trade(sd, [f"ln2.{p}" for p in affine], [("fc1.weight", slice(None))], _random_scales(g, D))
    if kdim:
        consumers = [("attn.k_proj_weight", slice(None)), ("attn.v_proj_weight", slice(None))]
        hand_trade(sd, ["kv_in.weight", "kv_in.bias"], consumers, _random_scales(g, kdim))
    if cfg.get("act", "relu") == "relu":
        hand_trade(sd, ["fc1.weight", "fc1.bias"], [("fc2.weight", slice(None))], _random_scales(g, FF))
    return sd


def hand_hand_block(sd, cfg, g, wrong_key=False):
    a, b = [_random_gl(g) for _ in range(H)], [_random_gl(g) for _ in range(H)]
    if wrong_key:
        for h in range(H):
            rows = slice(h * HD, (h + 1) * HD)
            _rows(sd, "q.weight", rows, a[h].T)
            _rows(sd, "q.bias", rows, a[h].T)
            _rows(sd, "k.weight", rows, a[h].T)  # should be A^-1
            _rows(sd, "k.bias", rows, a[h].T)
        return sd
    hand_linear_heads(sd, "", a, b, qk=not cfg.get("rotary"))
    hand_trade(sd, ["ln1.weight", "ln1.bias"], [(f"{r}.weight", slice(None)) for r in "qkv"], _random_scales(g, D))
    hand_trade(sd, ["ln2.weight", "ln2.bias"], [("fc1.weight", slice(None))], _random_scales(g, D))
    hand_trade(sd, ["fc1.weight", "fc1.bias"], [("fc2.weight", slice(None))], _random_scales(g, FF))
    return sd


def hand_fused_heads(sd, a, b, wrong_key=False):
    """The heads' GL factors of a FusedBlock: its fused projection's rows are laid out as nn.MultiheadAttention's
    packed ones."""
    renamed = {"attn.in_proj_weight": "qkv.weight", "attn.in_proj_bias": "qkv.bias",
               "attn.out_proj.weight": "proj.weight"}
    packed = {k: sd[v] for k, v in renamed.items()}
    hand_mha(packed, "attn.", a, b, wrong_key)
    sd.update({v: packed[k] for k, v in renamed.items()})


def hand_fused_block(sd, cfg, g, wrong_key=False):
    """The group of a FusedBlock, by hand (no GL factors where the block reads one piece twice)."""
    if not cfg.get("pinned"):
        hand_fused_heads(sd, [_random_gl(g) for _ in range(H)], [_random_gl(g) for _ in range(H)], wrong_key)
    if wrong_key:
        return sd
    hand_trade(sd, ["ln1.weight", "ln1.bias"], [("qkv.weight", slice(None))], _random_scales(g, D))
    hand_trade(sd, ["ln2.weight", "ln2.bias"], [("fc1.weight", slice(None))], _random_scales(g, D))
    hand_trade(sd, ["fc1.weight", "fc1.bias"], [("fc2.weight", slice(None))], _random_scales(g, FF))
    return sd


def hand_two_blocks(sd, cfg, g, wrong_key=False):
    """The group of each of two MHABlocks in an nn.Sequential, by hand."""
    for prefix in ("0.", "1."):
        sub = hand_mha_block({k[2:]: v for k, v in sd.items() if k.startswith(prefix)}, cfg, g, wrong_key)
        sd.update({prefix + k: v for k, v in sub.items()})
    return sd


def mha_dim(cfg) -> int:
    # 2 GL(HD) factors per head (query/key and value/output) unless add_bias_kv pins them; pre-LN: both LayerNorm
    # scales (D each); a key/value input Linear: kdim unit scales; ReLU MLP: FF unit scales (GELU: none).
    gl = 0 if cfg.get("add_bias_kv") else 2 * H * HD * HD
    ln = 2 * D if cfg.get("pre_ln", True) else 0
    return gl + ln + (cfg.get("kdim") or 0) + (FF if cfg.get("act", "relu") == "relu" else 0)


def hand_dim(cfg) -> int:
    # query/key GL factors (with the position phase only the diagonal matrices, which commute with it: HD per head);
    # value/output always; ln1, ln2 (D each); FF ReLU units.
    return H * HD * HD + H * (HD if cfg.get("rotary") else HD * HD) + 2 * D + FF


MHA_CASES = {
    "pre_ln": {},
    "post_ln": {"pre_ln": False},
    "no_bias": {"bias": False},
    "seq_first": {"batch_first": False},
    "kdim": {"kdim": 6},
    "kdim_post_ln_no_bias": {"kdim": 6, "pre_ln": False, "bias": False},
    "gelu": {"act": "gelu"},
    "bias_kv": {"add_bias_kv": True},
    "rms": {"rms": True},
}
HAND_CASES = {
    "matmul": {},
    "sdpa": {"sdpa": True},
    "rotary": {"rotary": True},
    "rotary_sdpa": {"rotary": True, "sdpa": True},
}


FUSED_CASES = {"unbind": {}, "index": {}, "chunk": {}, "shared_piece": {"pinned": True}, "overlap": {"pinned": True}}


def make(kind: str, name: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "mha":
        cfg = MHA_CASES[name]
        model = MHABlock(**cfg)
        hand, dim = hand_mha_block, mha_dim(cfg)
    elif kind == "two":
        cfg = {}
        model = nn.Sequential(MHABlock(), MHABlock())
        hand, dim = hand_two_blocks, 2 * mha_dim(cfg)
    elif kind == "fused":
        cfg = FUSED_CASES[name]
        model = FusedBlock(name)
        # two GL(HD) factors per head, ln1 and ln2 (D each), FF ReLU units; the shared piece pins both GL factors
        hand, dim = hand_fused_block, (0 if cfg.get("pinned") else 2 * H * HD * HD) + 2 * D + FF
    else:
        cfg = HAND_CASES[name]
        model = HandBlock(**cfg)
        hand, dim = hand_hand_block, hand_dim(cfg)
    with torch.no_grad():  # away from the default initialization (unit LayerNorm scales, zero biases)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.eval()
    x = torch.randn(4, T, D)
    if not cfg.get("batch_first", True):
        x = x.transpose(0, 1).contiguous()
    return model, x, cfg, hand, dim


ALL = [("mha", n) for n in MHA_CASES] + [("hand", n) for n in HAND_CASES] + [("two", "pre_ln")]
ALL += [("fused", n) for n in FUSED_CASES]


def _with(model, sd):
    twin = copy.deepcopy(model)
    twin.load_state_dict(sd)
    return twin


@pytest.mark.parametrize("kind,name", ALL)
def test_random_elements_keep_the_function(kind, name):
    model, x, _, _, dim = make(kind, name)
    sym = manifolds.transformer_symmetry(model, x)
    assert sym.dim == dim, sym.describe()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):
            element = sym.random_element(1.0, g)
            moved = sym.transformed(model, element)
            assert (moved(x) - ref).abs().max() < 1e-10
            changed = max((p - q).abs().max() for p, q in zip(model.parameters(), moved.parameters()))
            assert changed > 0.1  # the parameters did move


@pytest.mark.parametrize("kind,name", ALL)
def test_hand_built_elements_keep_the_function_and_wrong_ones_do_not(kind, name):
    model, x, cfg, hand, _ = make(kind, name)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ref = model(x)
        moved = _with(model, hand(dict(model.state_dict()), cfg, g))
        assert (moved(x) - ref).abs().max() < 1e-10
        if cfg.get("add_bias_kv") or cfg.get("rotary") or cfg.get("pinned"):  # the pinned factor is no symmetry
            sd = dict(model.state_dict())
            a, b = [_random_gl(g) for _ in range(H)], [_random_gl(g) for _ in range(H)]
            if cfg.get("add_bias_kv"):
                hand_mha(sd, "attn.", a, b)
            elif cfg.get("pinned"):
                hand_fused_heads(sd, a, b)
            else:
                hand_linear_heads(sd, "", a, b)
            assert (_with(model, sd)(x) - ref).abs().max() > 1e-3
        else:
            wrong = _with(model, hand(dict(model.state_dict()), cfg, g, wrong_key=True))
            assert (wrong(x) - ref).abs().max() > 1e-3


def test_pins_and_their_reasons():
    model, x, *_ = make("mha", "gelu")
    text = manifolds.transformer_symmetry(model, x).describe()
    assert "'fc1'" in text and "not positively homogeneous" in text
    model, x, *_ = make("mha", "bias_kv")
    assert "add_bias_kv" in manifolds.transformer_symmetry(model, x).describe()
    model, x, *_ = make("hand", "rotary")  # distinct phases per position and feature: only diagonal A commute
    sym = manifolds.transformer_symmetry(model, x)
    qk = [f for f in sym.factors if "query/key" in f.label]
    assert len(qk) == H and all(f.dim == HD for f in qk), sym.describe()
    assert all(a == b for f in qk for element in f.algebra for a, b, _ in element)
    model, x, *_ = make("mha", "post_ln")
    assert "its affine scale cannot be traded" in manifolds.transformer_symmetry(model, x).describe()


def check_orbit_derivative(sym, params: dict, xi: torch.Tensor) -> dict:
    """``sym.vertical(params, xi)`` against central differences of ``sym.act`` along ``exp(t xi)`` (``t = 1e-5``, to
    1e-7 per tensor); the tangent."""
    t = 1e-5
    plus, minus = sym.act(params, sym.exp(t * xi)), sym.act(params, sym.exp(-t * xi))
    tangent = sym.vertical(params, xi)
    for n in params:
        fd = (plus[n] - minus[n]) / (2 * t)
        assert (fd - tangent.get(n, torch.zeros_like(fd))).abs().max() < 1e-7, n
    return tangent


@pytest.mark.parametrize("kind,name", [("mha", "pre_ln"), ("mha", "kdim"), ("hand", "matmul"), ("two", "pre_ln")])
def test_vertical_tangents_are_the_orbit_derivative(kind, name):
    model, x, *_ = make(kind, name)
    sym = manifolds.transformer_symmetry(model, x)
    params = {n: p.detach() for n, p in model.named_parameters()}
    xi = torch.randn(sym.dim, generator=torch.Generator().manual_seed(3))
    tangent = check_orbit_derivative(sym, params, xi)
    # the adjoint and the dense basis agree with the map
    basis = sym.vertical_basis(params)
    layout = manifolds.ParamLayout.from_tensors(params)
    flat = layout.flatten({n: tangent.get(n, torch.zeros_like(p)) for n, p in params.items()})
    assert torch.allclose(basis @ xi, flat, atol=1e-12)
    v = {n: torch.randn_like(p) for n, p in params.items()}
    assert torch.allclose(sym.vertical_adjoint(params, v), basis.T @ layout.flatten(v), atol=1e-10)
    assert torch.linalg.matrix_rank(basis) == sym.dim  # the factors are independent: nothing counted twice


def test_euclidean_sharpness_moves_while_the_loss_does_not():
    model, x, *_ = make("mha", "pre_ln")
    y = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    sym = manifolds.transformer_symmetry(model, x)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(5)))
    loss = nn.MSELoss()
    with torch.no_grad():
        assert abs(loss(model(x), y) - loss(moved(x), y)) < 1e-12
    with sdpa_kernel(SDPBackend.MATH):  # the default CPU kernel has no second derivative
        before = euclidean_sharpness(model, loss, (x, y), progress=False).value
        after = euclidean_sharpness(moved, loss, (x, y), progress=False).value
    ratio = max(before, after) / min(before, after)
    assert ratio > 3, (before, after)


def test_nothing_is_claimed_twice_next_to_the_diagonal_group():
    # The diagonal group also frees the LayerNorm's output and the ReLU units here. A normalization trade is left
    # to its factor (whose unit-block metric is defined at a zero shift, the node metric is not), and then the
    # Linear it trades against too, so the units' factor: the diagonal classes of those tensors are pinned, and the
    # group (dimension D + 16) is counted once.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(6, D)
    assert manifolds.analyze(model, x).group.dim == D + 16
    sym = manifolds.transformer_symmetry(model, x)
    assert sym.diagonal_dim == 0 and sym.matrix_dim == D + 16 and len(sym.factors) == 2
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert torch.linalg.matrix_rank(sym.vertical_basis(params)) == sym.dim
    with torch.no_grad():
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(6)))
        assert (moved(x) - model(x)).abs().max() < 1e-12


def test_diagonal_and_matrix_factors_compose():
    # A token-wise block feeding a pooled 2-D ReLU head: the head's units belong to the diagonal group, the
    # attention to the matrix factors; a random element of the whole group keeps the function.
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = MHABlock()
            self.head1, self.head2 = nn.Linear(D, 16), nn.Linear(16, 3)

        def forward(self, x):
            return self.head2(torch.relu(self.head1(self.block(x).mean(dim=1))))

    torch.manual_seed(0)
    model = Classifier().eval()
    x = torch.randn(4, T, D)
    sym = manifolds.transformer_symmetry(model, x)
    assert sym.diagonal_dim == 16 and sym.matrix_dim == mha_dim({})
    assert not any("head1" in f.label for f in sym.factors)
    with torch.no_grad():
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(7)))
        assert (moved(x) - model(x)).abs().max() < 1e-10
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert torch.linalg.matrix_rank(sym.vertical_basis(params)) == sym.dim


class FoldedHeads(nn.Module):
    """Attention written with the samples not on axis 0 of the heads' tensors: folded into the batch ``(N H, T, hd)``
    with ``bmm`` (torch's own MHA layout), or heads first ``(H, N, T, hd)`` through SDPA; ``kv_heads`` key/value heads
    (a group of query heads reads each, repeated along a new axis of the folded layout)."""

    def __init__(self, layout: str, kv_heads: int = H):
        super().__init__()
        self.layout, self.kv = layout, kv_heads
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(D, kv_heads * HD), nn.Linear(D, kv_heads * HD)

    def split(self, t, heads):
        b, s, _ = t.shape
        if self.layout == "heads_first":
            return t.view(b, s, heads, HD).permute(2, 0, 1, 3)
        t = t.view(b, s, heads, HD).transpose(1, 2)
        if heads != H:  # each key/value head repeated for the query heads of its group, then folded
            t = t[:, :, None].expand(b, heads, H // heads, s, HD).reshape(b, H, s, HD)
        return t.reshape(b * H, s, HD)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.split(self.q(x), H), self.split(self.k(x), self.kv), self.split(self.v(x), self.kv)
        if self.layout == "heads_first":
            a = F.scaled_dot_product_attention(q, k, v).permute(1, 2, 0, 3).reshape(b, s, D)
        else:
            p = torch.bmm(q, k.transpose(1, 2)).div(HD**0.5).softmax(-1)
            a = torch.bmm(p, v).view(b, H, s, HD).transpose(1, 2).reshape(b, s, D)
        return x + self.o(a)


@pytest.mark.parametrize("layout, kv_heads", [("folded", H), ("heads_first", H), ("folded", 1)])
def test_heads_whose_samples_are_not_on_axis_0_keep_both_factors(layout, kv_heads):
    torch.manual_seed(0)
    model = FoldedHeads(layout, kv_heads).double().eval()
    x = torch.randn(3, T, D, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    labels = [f.label for f in sym.factors]
    assert sum("query/key" in la for la in labels) == sum("value/output" in la for la in labels) == kv_heads, \
        sym.describe()  # fmt: skip
    assert sym.dim == kv_heads * 2 * HD * HD
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            assert (sym.transformed(model, sym.random_element(1.0, g))(x) - model(x)).abs().max() < 1e-10


class MixedFold(nn.Module):
    """Queries folded as ``(N H, T, hd)``, keys as ``(H N, T, hd)``: the scores pair a sample's query heads with other
    samples' keys, so no query/key factor exists; with one sample both folds look alike."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, H, HD).transpose(1, 2).reshape(b * H, s, HD)
        k = self.k(x).view(b, s, H, HD).permute(2, 0, 1, 3).reshape(H * b, s, HD)
        v = self.v(x).view(b, s, H, HD).transpose(1, 2).reshape(b * H, s, HD)
        p = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        return self.o(torch.bmm(p, v).view(b, H, s, HD).transpose(1, 2).reshape(b, s, D))


def test_an_example_of_one_sample_is_read_on_two():
    torch.manual_seed(0)
    model = MixedFold().double().eval()
    x = torch.randn(3, T, D, dtype=torch.float64)
    for n in (1, 3):
        sym = manifolds.transformer_symmetry(model, x[:n])
        assert not [f for f in sym.factors if "query/key" in f.label], sym.describe()
        assert len([f for f in sym.factors if "value/output" in f.label]) == H
        with torch.no_grad():
            moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(1)))
            assert (moved(x) - model(x)).abs().max() < 1e-10


def test_weights_times_values_of_one_axis_pin_without_an_error():
    """``softmax(w) @ v(x)`` on a ``(T, D)`` input: a ``(hd,)`` output has no heads' axis to read."""

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.v, self.o = nn.Linear(D, HD), nn.Linear(HD, D)

        def forward(self, x):
            return self.o(x.sum(-1).softmax(-1) @ self.v(x))

    torch.manual_seed(0)
    sym = manifolds.transformer_symmetry(Pool().double().eval(), torch.randn(T, D, dtype=torch.float64))
    assert not [f for f in sym.factors if "value/output" in f.label]
