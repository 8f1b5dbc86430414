"""The symmetry metric's closed-form Jacobian where the number of stacked row blocks equals the block size.

The metric stacks the row blocks of one shape (query, key and value rows of every head: ``3 H`` blocks of ``hd`` rows)
and inverts them in one batched solve. With ``3 H = hd`` a bare ``(hd, hd)`` identity against ``3 H`` blocks was read
by ``torch.linalg.solve`` as ``3 H`` right-hand vectors: the Christoffel term came out wrong (the measure 13.4 against
a dense 12.7 at width 12 with 2 heads, and 67127 after a group element). Checked here against ``torch.func.jacfwd`` of
the metric and the dense quotient spectrum, at sizes with and without the coincidence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_transformer_quotient import dense_quotient_spectrum, measure_value
from torch import nn

import manifolds


class Attention(nn.Module):
    """``head(mean_T(x + o(SDPA(q x, k x, v x))))`` with ``heads`` heads of width ``dim / heads``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, self.heads, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.head((x + self.o(a.transpose(1, 2).reshape(b, t, d))).mean(dim=1))


SIZES = [(12, 2), (3, 1), (8, 2)]  # 3 H = hd for the first two


def _case(dim: int, heads: int, seed: int):
    torch.manual_seed(seed)
    model = Attention(dim, heads).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(5, 4, dim, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))


@pytest.mark.parametrize("dim,heads", SIZES)
def test_the_closed_form_jacobian_equals_forward_mode_autodiff(dim, heads):
    model, _, (x, _) = _case(dim, heads, 0)
    sym = manifolds.transformer_symmetry(model, x)
    params = {n: p.detach() for n, p in model.named_parameters()}
    metric = manifolds.symmetry_metric(sym, params)
    w = manifolds.ParamLayout.from_tensors(params).flatten(params)
    g = torch.Generator().manual_seed(1)
    u, xi = (torch.randn(w.shape, generator=g, dtype=w.dtype) for _ in range(2))
    dense = torch.func.jacfwd(lambda p: metric.apply(p, u))(w)
    forward, backward = metric.jacobian(w, u)
    scale = float(dense.abs().max())
    assert torch.allclose(forward(xi), dense @ xi, rtol=0, atol=1e-11 * scale * xi.abs().sum())
    assert torch.allclose(backward(xi), dense.T @ xi, rtol=0, atol=1e-11 * scale * xi.abs().sum())


@pytest.mark.parametrize("dim,heads", SIZES)
def test_the_measure_equals_the_dense_reference_and_keeps_its_value_under_the_group(dim, heads):
    model, loss, data = _case(dim, heads, 1)
    sym = manifolds.transformer_symmetry(model, data[0])
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)[::-1][0]
    value = measure_value(model, loss, data)[0]
    assert np.isclose(value, reference, rtol=1e-8, atol=0), (value, reference)
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(1)))
    assert np.isclose(measure_value(twin, loss, data)[0], value, rtol=1e-8, atol=0)
