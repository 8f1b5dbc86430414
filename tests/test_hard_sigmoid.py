"""The hard sigmoid (``nn.Hardsigmoid``, ``F.hardsigmoid``: MobileNetV3's squeeze-and-excitation gates), which torch
differentiates once only (no double backward, no forward mode through its backward): the objectives compute it as
``hardtanh(x + 3, 0, 6) / 6``, the same numbers to the bit, so every autograd product works. Before, each failed with
``derivative for aten::hardsigmoid_backward is not implemented``.

References: the dense Hessian of a twin that writes the hard sigmoid out by hand, by ``torch.func.hessian``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian

from sharpness import Objective, dense_hessian, euclidean_sharpness


class Gated(nn.Module):
    """A convolution, a squeeze-and-excitation gate by a hard sigmoid (module or function, in place or not), a
    hard-swish and a linear head."""

    def __init__(self, gate: str, by_hand: bool = False):
        super().__init__()
        self.gate, self.by_hand = gate, by_hand
        self.conv, self.squeeze, self.excite = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 2), nn.Linear(2, 4)
        self.head = nn.Linear(4, 3)
        self.module = nn.Hardsigmoid(inplace=gate == "module, in place")

    def _hard_sigmoid(self, s):
        if self.by_hand:
            return torch.clamp(s + 3, 0, 6) / 6
        if self.gate.startswith("module"):
            return self.module(s)
        return F.hardsigmoid(s, inplace=self.gate == "function, in place")

    def forward(self, x):  # (B, 2, 5, 5) -> (B, 3)
        h = F.hardswish(self.conv(x))
        s = self._hard_sigmoid(8 * self.excite(torch.relu(self.squeeze(h.mean((2, 3))))))
        return self.head((h * s[:, :, None, None]).mean((2, 3)))


GATES = ["module", "module, in place", "function", "function, in place"]


def _problem(gate: str):
    torch.manual_seed(0)
    model = Gated(gate).double().eval()
    twin = Gated(gate, by_hand=True).double().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(6, 2, 5, 5, dtype=torch.float64)
    return model, twin, x, torch.randint(0, 3, (6,))


def _reference(twin: nn.Module, x, y, names) -> torch.Tensor:
    params = {k: p.detach() for k, p in twin.named_parameters()}
    loss = nn.CrossEntropyLoss()
    rows = hessian(lambda p: loss(functional_call(twin, p, (x,)), y))(params)
    sizes = [params[k].numel() for k in names]
    return torch.cat([torch.cat([rows[a][b].reshape(params[a].numel(), params[b].numel()) for b in names], 1)
                      for a in names]).reshape(sum(sizes), sum(sizes))  # fmt: skip


@pytest.mark.parametrize("gate", GATES)
def test_products_of_a_hard_sigmoid_gate_equal_the_dense_hessian_of_its_formula(gate):
    model, twin, x, y = _problem(gate)
    s = 8 * model.excite(torch.relu(model.squeeze(F.hardswish(model.conv(x)).mean((2, 3)))))
    assert bool(((s > -3) & (s < 3)).any()) and bool(((s < -3) | (s > 3)).any())  # both pieces are reached
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    # the R-operator reads the hard sigmoid and hard swish, except a function called in place (autograd's products)
    assert obj.hvp_strategy() == ("graph" if gate == "function, in place" else "rop")
    H = _reference(twin, x, y, list(obj.params))
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = float((H @ v).abs().max())
    for strategy in (None, "jvp", "double_backward"):
        got = obj.hvp(v) if strategy is None else obj.hvp(v, strategy)
        torch.testing.assert_close(got, H @ v, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(dense_hessian(obj), H, rtol=0, atol=1e-12 * float(H.abs().max()))
    with torch.no_grad():  # the loss is the model's own, to the bit
        assert float(obj.value()) == float(nn.CrossEntropyLoss()(model(x), y))


def test_sharpness_of_a_hard_sigmoid_network_is_its_top_eigenvalue_and_leaves_the_inputs_alone():
    model, twin, x, y = _problem("module, in place")
    before = x.clone()
    value = euclidean_sharpness(model, nn.CrossEntropyLoss(), (x, y), dtype=torch.float64, progress=False).value
    H = _reference(twin, x, y, [k for k, _ in model.named_parameters()])
    assert abs(value - float(torch.linalg.eigvalsh(H)[-1])) <= 1e-8 * abs(value)
    assert torch.equal(x, before)
    with torch.no_grad():  # outside the objective the hard sigmoid is torch's own again
        assert torch.equal(F.hardsigmoid(x), F.hardtanh(x + 3, 0.0, 6.0) / 6)
    y2 = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(F.hardsigmoid(y2).sum(), y2, create_graph=True)
    with pytest.raises(RuntimeError, match="hardsigmoid_backward"):
        torch.autograd.grad(g.sum(), y2)


def test_r_operator_products_are_in_the_model_s_dtype_whatever_torch_s_default():
    """The R-operator forms the hard sigmoid's and hard swish's slopes in their input's dtype: under torch's default
    float32 (this suite runs in float64), a float64 model's products still equal the dense Hessian's to 1e-12. Before,
    a mask times a number took the default dtype: products 1e-8 off on timm's MobileNetV3."""
    model, twin, x, y = _problem("module")
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
        assert obj.hvp_strategy() == "rop"
        got = obj.hvp(v)
    finally:
        torch.set_default_dtype(previous)
    expected = _reference(twin, x, y, list(obj.params)) @ v
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_at_the_kinks_the_slope_is_torch_s_and_every_product_agrees():
    """Pre-activations exactly at -3 and 3 (a blank sample through biases of 3 and -3): the slope there is zero, as
    torch's hard sigmoid has it, in the objective's gradient, autograd's products and the R-operator's alike. Before,
    ``clamp``'s slope of 1/6 at its bounds moved the gradient by 7.7e-3 and the products apart by 4.0e-3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Hardsigmoid(), nn.Linear(4, 3)).double().eval()
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([3.0, -3.0, 0.5, 1.0]))
    x, y = torch.randn(6, 2, dtype=torch.float64), torch.randint(0, 3, (6,))
    x[0] = 0
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = obj.hvp(v, "jvp")
    for got in (obj.hvp(v), obj.hvp(v, "double_backward")):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    own = torch.autograd.grad(nn.CrossEntropyLoss()(model(x), y), list(model.parameters()))
    # torch's own backward multiplies by 1/6 rounded to float32, even in float64
    torch.testing.assert_close(obj.gradient(), torch.cat([g.flatten() for g in own]), rtol=1e-7, atol=0)
