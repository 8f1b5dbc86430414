"""Windowed attention as timm's Swin computes it, written here without timm: a LayerNorm, a cyclic shift of the token
grid (``torch.roll``), zero padding to whole windows (``F.pad`` by amounts computed from the shapes), the windows
folded into the batch (view, permute, view), a fused ``qkv`` Linear, a learned relative-position bias added to the
scores, the shifted windows' mask added per window (the scores viewed as ``(B, windows, heads, N, N)``), an
``nn.Softmax`` module, and the windows put back, cropped and rolled back.

The group holds, per block and head, ``GL(hd)`` on query/key and on value/output, and the LayerNorm's scale traded
against ``qkv``'s columns through the roll, the padding and the window folds. The key bias is left unmoved (the
softmax along the keys ignores the shift it adds, through the bias and the mask added and the view) and the value
bias is absorbed into the output bias (the ``nn.Softmax`` rows sum to one): shifts of either keep the symmetry measure.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_rop_graph import _check
from test_transformer_quotient import assert_keeps_outputs, measure_value
from torch import nn

import manifolds
from sharpness import euclidean_sharpness

DIM, HEADS, WINDOW, GRID = 8, 2, 2, 5  # a 5 x 5 token grid in windows of 2 x 2: padded to 6 x 6, 9 windows


class WindowBlock(nn.Module):
    def __init__(self, shift: int, pad_value: float = 0.0, roll_features: bool = False):
        super().__init__()
        self.shift, self.pad_value, self.roll_features = shift, pad_value, roll_features
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.softmax = nn.Softmax(dim=-1)
        self.table = nn.Parameter(torch.randn((2 * WINDOW - 1) ** 2, HEADS))
        coords = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + WINDOW - 1
        self.register_buffer("index", relative[..., 0] * (2 * WINDOW - 1) + relative[..., 1], persistent=False)
        side = GRID + (-GRID) % WINDOW
        region = torch.zeros(side, side)
        if shift:  # Swin's regions of the shifted grid: windows mixing regions mask the pairs across them
            cuts = (slice(0, -WINDOW), slice(-WINDOW, -shift), slice(-shift, None))
            for k, (a, b) in enumerate((a, b) for a in cuts for b in cuts):
                region[a, b] = k
        windows = self._partition(region[None, :, :, None]).flatten(1)
        mask = (windows[:, :, None] != windows[:, None, :]).double() * -100.0
        self.register_buffer("mask", mask, persistent=False)

    @staticmethod
    def _partition(x):
        b, h, w, c = x.shape
        x = x.view(b, h // WINDOW, WINDOW, w // WINDOW, WINDOW, c).permute(0, 1, 3, 2, 4, 5).contiguous()
        return x.view(-1, WINDOW * WINDOW, c)

    def forward(self, x):
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2) if not self.roll_features else (1, 3))
        pad_h, pad_w = (WINDOW - h % WINDOW) % WINDOW, (WINDOW - w % WINDOW) % WINDOW
        y = F.pad(y, (0, 0, 0, pad_w, 0, pad_h), value=self.pad_value)
        hp, wp = y.shape[1], y.shape[2]
        windows = self._partition(y)
        n = windows.shape[1]
        q, k, v = self.qkv(windows).reshape(-1, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q * (c // HEADS) ** -0.5) @ k.transpose(-2, -1)
        scores = scores + self.table[self.index.view(-1)].view(n, n, HEADS).permute(2, 0, 1).unsqueeze(0)
        count = self.mask.shape[0]
        scores = (scores.view(-1, count, HEADS, n, n) + self.mask[None, :, None]).view(-1, HEADS, n, n)
        out = self.proj((self.softmax(scores) @ v).transpose(1, 2).reshape(-1, n, c))
        out = out.view(b, hp // WINDOW, wp // WINDOW, WINDOW, WINDOW, c).permute(0, 1, 3, 2, 4, 5)
        out = out.reshape(b, hp, wp, c)[:, :h, :w, :].contiguous()
        if self.shift:
            out = torch.roll(out, shifts=(self.shift, self.shift), dims=(1, 2))
        return x + out


class WindowNet(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.blocks = nn.Sequential(WindowBlock(0), WindowBlock(1, **options))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):  # (B, GRID, GRID, 3) -> (B, 4)
        return self.head(self.blocks(self.embed(x)).mean(dim=(1, 2)))


def _make(seed: int = 0, **options):
    torch.manual_seed(seed)
    model = WindowNet(**options).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(4, GRID, GRID, 3, dtype=torch.float64)
    return model, x, torch.randint(0, 4, (4,))


def test_windowed_attention_has_its_heads_factors_and_the_norm_trade_through_the_windows():
    model, x, y = _make()
    sym = manifolds.transformer_symmetry(model, x)
    labels = [f.label for f in sym.factors]
    assert sum("query/key" in la for la in labels) == sum("value/output" in la for la in labels) == 2 * HEADS
    norms = [f for f in sym.factors if "norm1" in f.label]
    assert len(norms) == 2 and all(f.size == DIM for f in norms), sym.describe()
    hd = DIM // HEADS
    assert sym.dim == 2 * (HEADS * 2 * hd * hd + DIM), sym.describe()
    assert all(f.unread is not None for f in sym.factors if "query/key" in f.label), sym.describe()
    assert all(f.absorption is not None for f in sym.factors if "value/output" in f.label), sym.describe()
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)


def test_a_hand_built_norm_trade_keeps_the_outputs_and_the_measure_holds_under_the_group():
    """By hand: the second block's LayerNorm scale and shift times ``c``, ``qkv``'s columns over ``c`` (through the
    roll, the padding and the window folds) keep the outputs; the symmetry measure is unchanged (1e-8) by a random
    element and by shifts of the key biases and of the value biases against the output biases, while Euclidean
    sharpness moves."""
    model, x, y = _make()
    c = torch.exp(0.5 * torch.randn(DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    twin = copy.deepcopy(model)
    block = twin.blocks[1]
    with torch.no_grad():
        block.norm1.weight.mul_(c)
        block.norm1.bias.mul_(c)
        block.qkv.weight.div_(c)
        assert float((twin(x) - model(x)).abs().max()) < 1e-12
    loss, data = nn.CrossEntropyLoss(), (x, y)
    sym = manifolds.transformer_symmetry(model, x)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
    shifted = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for blk in shifted.blocks:
            blk.qkv.bias[DIM : 2 * DIM] += torch.randn(DIM, generator=g, dtype=torch.float64)
            u = torch.randn(DIM, generator=g, dtype=torch.float64)
            blk.qkv.bias[2 * DIM :] += u
            blk.proj.bias -= blk.proj.weight @ u
        assert float((shifted(x) - model(x)).abs().max()) < 1e-12
    before = measure_value(model, loss, data)[0]
    for other in (moved, shifted):
        after = measure_value(other, loss, data)[0]
        assert abs(after - before) <= 1e-8 * abs(before), (before, after)
    e0 = euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    e1 = euclidean_sharpness(moved, loss, data, dtype=torch.float64, progress=False).value
    assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


@pytest.mark.parametrize("options", [{"pad_value": 1.0}, {"roll_features": True}], ids=["pad_ones", "roll_features"])
def test_a_padding_of_nonzeros_or_a_roll_of_the_features_pins_the_norm(options):
    """Padding by ones (a scale would not keep them ones) or a roll along the features (which mixes them) between the
    second block's LayerNorm and ``qkv``: its scale is pinned, with the reason; the first block's is still traded."""
    model, x, _ = _make(**options)
    sym = manifolds.transformer_symmetry(model, x)
    assert [f.label for f in sym.factors if "norm1" in f.label] == ["affine scale of module 'blocks.0.norm1' "
                                                                    "(LayerNorm)"], sym.describe()  # fmt: skip
    assert any("blocks.1.norm1" in str(p) and "cannot be traded" in str(p) for p in sym.pins), sym.pins
    assert_keeps_outputs(model, sym, x, 0)


class _Bent(nn.Module):
    """Attention whose scores pass a nonlinear map before an ``nn.Softmax``: a root-level ``nn.Tanh`` module named
    ``view`` or ``transpose``, or the scores' bits read as integers and shifted (``view(torch.int64)``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv, self.proj, self.head = nn.Linear(8, 24), nn.Linear(8, 8), nn.Linear(8, 3)
        self.softmax = nn.Softmax(-1)
        if how != "bits":
            setattr(self, how, nn.Tanh())

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(x).reshape(b, 5, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        s = q @ k.transpose(-2, -1)
        s = (s.view(torch.int64) + (1 << 51)).view(torch.float64) if self.how == "bits" else getattr(self, self.how)(s)
        return self.head((x + self.proj((self.softmax(s) @ v).transpose(1, 2).reshape(b, 5, 8))).mean(1))


@pytest.mark.parametrize("how", ["view", "transpose", "bits"])
def test_a_nonlinear_map_named_like_a_reshape_keeps_the_key_bias_read(how):
    """The walk from the scores to the softmax takes only tensor operations: a module named ``view`` or ``transpose``
    (an ``nn.Tanh``) and a view as another dtype bend a shift of the scores, so the key bias stays read (moved with the
    key's rows). Before, it was claimed unread: a random element moved the outputs by 9.4e-2 and 2.7e-2."""
    torch.manual_seed(0)
    model, x = _Bent(how).double().eval(), torch.randn(3, 5, 8, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert [f.unread for f in sym.factors if "query/key" in f.label] == [None, None], sym.describe()
    for seed in range(3):
        assert_keeps_outputs(model, sym, x, seed)


@pytest.mark.parametrize("options", [{}, {"pad_value": 0.5}, {"roll_features": True}],
                         ids=["zeros", "pad_value", "roll_features"])  # fmt: skip
def test_products_through_the_windows_are_the_r_operators_and_the_dense_hessians(options):
    """The R-operator reads the windowed blocks: the rolls, the padding to whole windows by amounts computed from the
    shapes (by a constant too: its offset carries no tangent), and the windows folded into the batch axis and back.
    Products equal the dense float64 Hessian's to 1e-10, from the kept state and streamed in chunks of 3 (a chunk of
    one sample holds its 9 windows in the batch axis). Before, these blocks fell back to autograd."""
    model, x, y = _make(**options)
    _check(model, x, y, strategy="rop")


class _Padded(nn.Module):
    """Tokens rolled or padded along the sequence between two layers (``how``: ``roll``, or ``F.pad``'s mode and
    constant)."""

    def __init__(self, how: str, value: float | None = None):
        super().__init__()
        self.how, self.value = how, value
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):  # (B, 5, 4) -> (B, 3)
        h = torch.tanh(self.a(x)).transpose(1, 2)
        if self.how == "roll":
            h = torch.roll(h, shifts=2, dims=-1)
        else:
            h = F.pad(h, (1, h.shape[-1] % 3), mode=self.how, **({} if self.value is None else {"value": self.value}))
        return self.b(h.transpose(1, 2)).mean(1)


@pytest.mark.parametrize(("how", "value", "strategy"), [("roll", None, "rop"), ("constant", None, "rop"),
                                                        ("constant", 2.5, "rop"), ("reflect", None, "graph"),
                                                        ("replicate", None, "graph")])  # fmt: skip
def test_rolls_and_constant_padding_are_read_and_other_padding_falls_back_to_autograd(how, value, strategy):
    """A roll and constant padding (by zeros or a constant) are read by the R-operator; reflected or replicated
    padding (other adjoints) is not, and its products come from autograd; both equal the dense Hessian's."""
    torch.manual_seed(0)
    model = _Padded(how, value).double().eval()
    x, y = torch.randn(5, 5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    _check(model, x, y, strategy=strategy)


class _FixedRows(nn.Module):
    """A view to four rows whatever the batch (``h.reshape(4, -1)``), an elementwise map, and back: no fold of the
    samples' axis (four rows are one sample's features on two samples, not on one)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.l1(x)
        return self.l2(torch.tanh(h.reshape(4, -1)).reshape(-1, 4) + h)


def test_a_view_of_the_samples_axis_that_is_no_fold_of_the_batch_keeps_autograd_products():
    """The R-operator reads a view changing the samples' axis only where its size is a whole number per sample, the
    same at the traced batch and at every pass's (checked on one sample when the objective picks its products): four
    rows whatever the batch are two per sample on two samples and four on one, so the products are autograd's, and
    equal the dense Hessian's."""
    torch.manual_seed(0)
    model = _FixedRows().double().eval()
    _check(model, torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)), strategy="graph")
