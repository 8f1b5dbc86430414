"""The whole-data-set objective: values, gradients and HVPs against dense torch.func references."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases import make_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sharpness import HVP_STRATEGIES, DataError, Objective, dense_hessian
from sharpness.products._rop import _MaxPool, _Slope, _SlopePool

STRATEGIES = [s for s in HVP_STRATEGIES if s != "auto"]


def strategies(obj: Objective) -> list[str]:
    """The explicit strategies that apply to ``obj``'s model (``"rop"`` needs an MLP chain)."""
    return [s for s in STRATEGIES if s != "rop" or obj._rop is not None]


def full_batch_loss(case, flat, layout):
    from torch.func import functional_call

    return case.loss_fn(functional_call(case.model, layout.unflatten(flat), (case.X,)), case.y)


def test_hvp_matches_dense_hessian(case):
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=7)
    flat = obj.layout.flatten(obj.params)
    H = torch.func.hessian(lambda w: full_batch_loss(case, w, obj.layout))(flat)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(obj.layout.size, generator=g)
    V = torch.randn(3, obj.layout.size, generator=g)
    tol = 1e-10 * max(1, H.abs().max())
    start = torch.randn(obj.layout.size, generator=g)
    for strategy in strategies(obj):
        torch.testing.assert_close(obj.hvp(v, strategy), H @ v, rtol=0, atol=tol)
        torch.testing.assert_close(obj.hvp_batch(V, strategy), V @ H, rtol=0, atol=tol)
        # out=: the product is added to what out holds, in out's own storage
        out = start.clone()
        assert obj.hvp(v, strategy, out=out) is out
        torch.testing.assert_close(out, start + H @ v, rtol=0, atol=tol)
    torch.testing.assert_close(dense_hessian(obj), H, rtol=0, atol=1e-12 * max(1, H.abs().max()))
    if obj._rop is None:
        with pytest.raises(ValueError, match="'rop' HVP strategy needs a model built from Linear/ConvNd layers"):
            obj.hvp(v, "rop")
    else:  # the R-operator products again, recomputing each chunk's state (it does not fit the budget)
        streamed = Objective(case.model, case.loss_fn, case.data, chunk_size=7, memory_budget=1)
        torch.testing.assert_close(streamed.hvp(v, "rop"), H @ v, rtol=0, atol=tol)
        torch.testing.assert_close(streamed.hvp_batch(V, "rop"), V @ H, rtol=0, atol=tol)
        out = start.clone()
        torch.testing.assert_close(streamed.hvp(v, "rop", out=out), start + H @ v, rtol=0, atol=tol)
        assert streamed._rop_states is None and obj._rop_states is not None
    # rows of one block may be v and out; v itself, or a mismatched out, may not
    block = torch.stack([v, start])
    torch.testing.assert_close(obj.hvp(block[0], out=block[1]), start + H @ v, rtol=0, atol=tol)
    with pytest.raises(ValueError, match="must not share memory"):
        obj.hvp(v, out=v)
    with pytest.raises(ValueError, match="shape, dtype and device"):
        obj.hvp(v, out=start[:-1])


@pytest.mark.parametrize(
    "layers",
    [
        [nn.Flatten(), nn.Linear(12, 7), nn.LeakyReLU(0.3), nn.Linear(7, 5), nn.Identity(), nn.Linear(5, 4, bias=False),
         nn.ReLU(), nn.Linear(4, 3)],
        [nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3), nn.LeakyReLU(0.05)],
        [nn.Flatten(), nn.Linear(12, 3)],
        [nn.Flatten(), nn.Dropout(0.5), nn.Linear(12, 6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 3)],
    ],
    ids=["leaky-identity-nobias", "ends-with-activation", "one-layer", "dropout-in-eval-mode"],
)  # fmt: skip
@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(label_smoothing=0.1),
        nn.CrossEntropyLoss(label_smoothing=0.2, reduction="sum"),
        nn.CrossEntropyLoss(ignore_index=1, reduction="sum"),
        nn.MSELoss(reduction="sum"),
    ],
    ids=["ce-closed-form", "ce-closed-form-sum", "ce-ignored-targets", "mse"],
)
def test_rop_hvp_of_other_mlp_chains_matches_dense_hessian(layers, loss_fn):
    """Every activation, layer and loss the R-operator products take, against the dense Hessian."""
    torch.manual_seed(0)
    model = nn.Sequential(*layers).double().eval()
    g = torch.Generator().manual_seed(3)
    X = torch.randn(31, 3, 4, generator=g, dtype=torch.float64)
    X = X if isinstance(layers[0], nn.Flatten) else X.flatten(1)
    y = torch.randint(0, 3, (31,), generator=g)
    y = nn.functional.one_hot(y, 3).double() if isinstance(loss_fn, nn.MSELoss) else y
    obj = Objective(model, loss_fn, (X, y), chunk_size=8)
    assert obj.hvp_strategy() == "rop"
    flat = obj.layout.flatten(obj.params)
    H = torch.func.hessian(lambda w: loss_fn(torch.func.functional_call(model, obj.layout.unflatten(w), (X,)), y))(flat)
    v = torch.randn(flat.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v), H @ v, rtol=0, atol=1e-12 * max(1, H.abs().max()))
    # The loss the products' forward state recorded (closed form for a plain cross-entropy) is the loss.
    torch.testing.assert_close(obj.value(), loss_fn(model(X), y), rtol=1e-13, atol=0)


@pytest.mark.parametrize(
    "layers, x_shape",
    [
        ([nn.Conv1d(2, 3, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.MaxPool1d(3, stride=1, padding=1),
          nn.Conv1d(3, 4, 2, dilation=2, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)], (2, 9)),
        ([nn.MaxPool2d(2), nn.Conv2d(2, 4, 3, groups=2, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
          nn.Flatten(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3)], (2, 6, 6)),
        ([nn.Conv3d(1, 2, 2), nn.ReLU(), nn.MaxPool3d(2), nn.Flatten(), nn.Identity(), nn.Linear(2, 3)], (1, 4, 4, 4)),
    ],
    ids=["conv1d-leaky-overlapping-pool", "pooled-data-grouped-conv2d-ceil", "conv3d"],
)  # fmt: skip
def test_rop_hvp_of_convolutional_chains_matches_dense_hessian(layers, x_shape):
    """Strides, padding, dilation, groups, overlapping and ceil-mode pooling, pooling of the data."""
    torch.manual_seed(1)
    model = nn.Sequential(*layers).double().eval()
    g = torch.Generator().manual_seed(4)
    X = torch.randn(13, *x_shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (13,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    obj = Objective(model, loss_fn, (X, y), chunk_size=5)
    assert obj.hvp_strategy() == "rop"
    # a slope followed by a max-pool is one map, its slope kept at the pooled resolution
    chain, states = obj.rop_states()
    fused = [i for i, op in enumerate(chain.ops) if isinstance(op, _SlopePool)]
    assert fused and not any(isinstance(op, (_Slope, _MaxPool)) and isinstance(nxt, _MaxPool)
                             for op, nxt in zip(chain.ops, chain.ops[1:]))  # fmt: skip
    for i in fused:
        idx, _, slope = states[0].saved[i]
        assert slope.shape == idx.shape
    flat = obj.layout.flatten(obj.params)
    H = torch.func.hessian(lambda w: loss_fn(torch.func.functional_call(model, obj.layout.unflatten(w), (X,)), y))(flat)
    v = torch.randn(flat.shape, generator=g, dtype=torch.float64)
    V = torch.randn(2, flat.numel(), generator=g, dtype=torch.float64)
    tol = 1e-12 * max(1, H.abs().max())
    torch.testing.assert_close(obj.hvp(v), H @ v, rtol=0, atol=tol)
    torch.testing.assert_close(obj.hvp_batch(V), V @ H, rtol=0, atol=tol)


def test_rop_products_of_a_model_left_in_training_mode_are_the_eval_mode_ones():
    """Dropout is the identity in eval mode, where products run, also when the state is reused."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).double()
    X, y = torch.randn(17, 5, dtype=torch.float64), torch.randint(0, 3, (17,))
    with pytest.warns(UserWarning, match="training mode"):
        obj = Objective(model, nn.CrossEntropyLoss(), (X, y))
    assert model.training and obj.hvp_strategy() == "rop"
    eval_model = copy.deepcopy(model).eval()
    flat = obj.layout.flatten(obj.params)
    H = torch.func.hessian(
        lambda w: nn.functional.cross_entropy(torch.func.functional_call(eval_model, obj.layout.unflatten(w), (X,)), y)
    )(flat)
    v = torch.randn(flat.shape, dtype=torch.float64)
    for _ in range(2):  # the first product builds the state, the second reuses it
        torch.testing.assert_close(obj.hvp(v), H @ v, rtol=0, atol=1e-12 * max(1, H.abs().max()))
    assert model.training


def test_rop_is_not_used_where_it_does_not_apply():
    torch.manual_seed(0)
    y = torch.randint(0, 2, (6,))
    mish = nn.Sequential(nn.Linear(3, 4), nn.Mish(), nn.Linear(4, 2)).double()
    sequence = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()  # on (n, 5, 3) inputs
    frozen = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    frozen[0].weight.requires_grad_(False)
    cases = [(mish, torch.randn(6, 3, dtype=torch.float64), y), (frozen, torch.randn(6, 3, dtype=torch.float64), y),
             (sequence, torch.randn(6, 5, 3, dtype=torch.float64), torch.randint(0, 2, (6, 5)))]  # fmt: skip
    for model, X, target in cases:
        if X.dim() == 3:
            loss_fn = lambda out, t: nn.functional.cross_entropy(out.transpose(1, 2), t)  # noqa: E731
        else:
            loss_fn = nn.CrossEntropyLoss()
        obj = Objective(model.eval(), loss_fn, (X, target))
        assert obj.hvp_strategy() == "graph"
    hooked = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    hooked[1].register_forward_hook(lambda *args: None)
    assert Objective(hooked.eval(), nn.CrossEntropyLoss(), (torch.randn(6, 3, dtype=torch.float64), y))._rop is None
    obj = Objective(sequence.eval(), loss_fn, (torch.randn(6, 5, 3, dtype=torch.float64), torch.randint(0, 2, (6, 5))))
    with pytest.raises(ValueError, match=r"\(samples, features\) rows"):
        obj.hvp(torch.ones(obj.layout.size, dtype=torch.float64), "rop")


@pytest.mark.parametrize("piece_samples", [None, 1], ids=["chunks", "one-sample-pieces"])
def test_value_and_gradient_match_full_batch(case, piece_samples, monkeypatch):
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=5)
    if piece_samples is not None:  # on the CPU gradients run in pieces of a bounded size: cut to single samples
        from sharpness.products import _objective as objective_module

        monkeypatch.setattr(objective_module, "_GRADIENT_PIECE_BYTES", obj.activation_bytes_per_sample())
    flat = obj.layout.flatten(obj.params).requires_grad_(True)
    loss = full_batch_loss(case, flat, obj.layout)
    (g_ref,) = torch.autograd.grad(loss, flat)
    loss = loss.detach()
    assert float(obj.value()) == pytest.approx(float(loss), rel=1e-13, abs=1e-13)
    torch.testing.assert_close(obj.gradient(), g_ref, rtol=1e-12, atol=1e-13)
    value, grad = obj.value_and_gradient()
    torch.testing.assert_close(grad, g_ref, rtol=1e-12, atol=1e-13)
    assert float(value) == pytest.approx(float(loss), rel=1e-13, abs=1e-13)


@pytest.mark.parametrize("chunk_size", [1, 7, None])
@pytest.mark.parametrize("as_loader", [False, True])
def test_same_result_whatever_the_chunking(chunk_size, as_loader):
    case = make_case("mlp_bias")
    reference = Objective(case.model, case.loss_fn, case.data)
    v = torch.randn(reference.layout.size, generator=torch.Generator().manual_seed(2))
    data = DataLoader(TensorDataset(case.X, case.y), batch_size=6) if as_loader else case.data
    obj = Objective(case.model, case.loss_fn, data, chunk_size=chunk_size)
    assert obj.n_samples == case.X.shape[0]
    torch.testing.assert_close(obj.value(), reference.value(), rtol=1e-13, atol=0)
    for strategy in strategies(obj):
        torch.testing.assert_close(obj.hvp(v, strategy), reference.hvp(v, "jvp"), rtol=1e-11, atol=1e-13)


def test_unequal_batches_are_weighted_by_sample_count():
    # One peer averages batch HVPs with equal weights, wrong by several percent on a 120/80 split.
    case = make_case("mlp_bias")
    X = torch.randn(200, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (200,), generator=torch.Generator().manual_seed(4))
    batches = [(X[:120], y[:120]), (X[120:], y[120:])]
    whole = Objective(case.model, case.loss_fn, (X, y))
    split = Objective(case.model, case.loss_fn, batches)
    v = torch.randn(whole.layout.size, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(split.hvp(v), whole.hvp(v), rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(split.value(), whole.value(), rtol=1e-13, atol=0)


def test_sum_and_mean_reduction_scale_by_n():
    case = make_case("mlp_mse_sum")
    mean_obj = Objective(case.model, nn.MSELoss(), case.data, chunk_size=4)
    sum_obj = Objective(case.model, nn.MSELoss(reduction="sum"), case.data, chunk_size=4)
    n_elements = case.y.numel()  # MSELoss(mean) averages over every output entry
    v = torch.randn(sum_obj.layout.size, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(sum_obj.value(), mean_obj.value() * n_elements, rtol=1e-12, atol=0)
    torch.testing.assert_close(sum_obj.hvp(v), mean_obj.hvp(v) * n_elements, rtol=1e-11, atol=1e-12)
    # an explicit reduction override on a plain function
    fn_obj = Objective(case.model, lambda o, t: ((o - t) ** 2).sum(), case.data, chunk_size=4, reduction="sum")
    torch.testing.assert_close(fn_obj.value(), sum_obj.value(), rtol=1e-13, atol=0)


@pytest.mark.parametrize(
    "loss_fn, override",
    [
        (nn.CrossEntropyLoss(), "sum"),
        (nn.CrossEntropyLoss(reduction="sum"), "mean"),
        (nn.CrossEntropyLoss(reduction="none"), "sum"),
        (nn.CrossEntropyLoss(ignore_index=1, reduction="sum"), "mean"),
        (nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)), "sum"),
    ],
    ids=["mean-as-sum", "sum-as-mean", "none-as-sum", "ignored-as-mean", "weighted-as-sum"],
)
def test_reduction_override_of_a_loss_module_whatever_the_chunks(loss_fn, override):
    """``reduction=`` against a torch loss module's own: the true sum or mean over the data set (not the chunks'
    means summed, nor their sums averaged), for every chunk size; the caller's module is left as it was."""
    case = make_case("mlp_bias")
    own = loss_fn.reduction
    reference = copy.copy(loss_fn)
    reference.reduction = override
    layout = Objective(case.model, case.loss_fn, case.data).layout
    flat = layout.flatten(dict(case.model.named_parameters())).detach()

    def full(w):
        return reference(torch.func.functional_call(case.model, layout.unflatten(w), (case.X,)), case.y)

    value, gradient, H = full(flat), torch.func.grad(full)(flat), torch.func.hessian(full)(flat)
    v = torch.randn(layout.size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for chunk_size in (1, 3, 7, case.X.shape[0]):
        obj = Objective(case.model, loss_fn, case.data, chunk_size=chunk_size, reduction=override)
        assert obj.reduction == override
        torch.testing.assert_close(obj.value(), value, rtol=1e-13, atol=0)
        torch.testing.assert_close(obj.gradient(), gradient, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(obj.hvp(v), H @ v, rtol=1e-11, atol=1e-13)
    assert loss_fn.reduction == own


class _ConvWithSpare(nn.Module):
    """A convolution of the data (the data-convolution cut applies) and a layer the forward never calls."""

    def __init__(self):
        super().__init__()
        self.conv, self.head, self.spare = nn.Conv2d(1, 2, 3), nn.Linear(8, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def test_parameters_the_forward_never_uses_have_zero_gradient_and_hessian_rows():
    """Every strategy, through the data-convolution cut too: the spare layer's gradient and Hessian rows are zero
    and the rest is the dense Hessian's (was torch's RuntimeError from the autograd products)."""
    torch.manual_seed(0)
    model = _ConvWithSpare().double().eval()
    X, y = torch.randn(7, 1, 4, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    obj = Objective(model, nn.CrossEntropyLoss(), (X, y), chunk_size=3)
    assert obj._data_conv is not None
    flat = obj.layout.flatten(obj.params)

    def full(w):
        return F.cross_entropy(torch.func.functional_call(model, obj.layout.unflatten(w), (X,)), y)

    H, gradient = torch.func.hessian(full)(flat), torch.func.grad(full)(flat)
    spare = torch.cat([torch.full((p.numel(),), "spare" in k) for k, p in obj.params.items()])
    assert spare.sum() == 12 and torch.all(H[spare] == 0) and torch.all(gradient[spare] == 0)
    g = torch.Generator().manual_seed(4)
    v, V = torch.randn(flat.numel(), generator=g, dtype=torch.float64), torch.randn(3, flat.numel(), generator=g,
                                                                                dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(obj.gradient(), gradient, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(obj.value_and_gradient()[1], gradient, rtol=1e-12, atol=1e-15)
    for strategy in ("graph", "double_backward", "jvp", "auto"):
        torch.testing.assert_close(obj.hvp(v, strategy), H @ v, rtol=1e-11, atol=1e-13)
        torch.testing.assert_close(obj.hvp_batch(V, strategy), V @ H, rtol=1e-11, atol=1e-13)


def test_one_shot_iterator_is_kept_for_every_pass():
    case = make_case("mlp_bias")
    batches = iter([(case.X[:10], case.y[:10]), (case.X[10:], case.y[10:])])
    obj = Objective(case.model, case.loss_fn, batches)
    reference = Objective(case.model, case.loss_fn, case.data)
    v = torch.ones(obj.layout.size)
    for _ in range(2):
        torch.testing.assert_close(obj.hvp(v, "jvp"), reference.hvp(v, "jvp"), rtol=1e-12, atol=1e-14)


def test_module_is_never_mutated_and_mode_restored():
    case = make_case("cnn")
    before = copy.deepcopy(case.model.state_dict())
    case.model.train()
    with pytest.warns(UserWarning, match="eval mode"):
        obj = Objective(case.model, case.loss_fn, case.data)
    obj.hvp(torch.ones(obj.layout.size))
    obj.gradient()
    assert case.model.training
    for k, t in case.model.state_dict().items():
        assert torch.equal(t, before[k])
    assert all(p.grad is None for p in case.model.parameters())


def test_float32_and_float64():
    case = make_case("mlp_bias")
    obj64 = Objective(case.model, case.loss_fn, case.data)
    obj32 = Objective(case.model, case.loss_fn, case.data, dtype=torch.float32)
    assert obj32.params["0.weight"].dtype == torch.float32
    v = torch.randn(obj64.layout.size, generator=torch.Generator().manual_seed(7))
    for strategy in strategies(obj32):
        hv32 = obj32.hvp(v.float(), strategy)
        assert hv32.dtype == torch.float32
        np.testing.assert_allclose(hv32.double().numpy(), obj64.hvp(v).numpy(), rtol=1e-4, atol=1e-5)


def test_auto_strategy_streams_when_the_graph_does_not_fit():
    case = make_case("mlp_bias")
    mish = nn.Sequential(nn.Linear(5, 4), nn.Mish(), nn.Linear(4, 3)).double().eval()  # no R-operator products
    obj = Objective(mish, case.loss_fn, case.data, chunk_size=5, memory_budget=1000)
    assert obj.hvp_strategy() in ("double_backward", "jvp")
    assert Objective(mish, case.loss_fn, case.data).hvp_strategy() == "graph"
    # MLP chains: the R-operator, with its state kept or not; autograd=True asks for the others
    mlp = make_case("mlp_bias")
    small = Objective(mlp.model, mlp.loss_fn, mlp.data, chunk_size=5, memory_budget=1000)
    assert small.hvp_strategy() == "rop" and not small._rop_fits()
    assert small.hvp_strategy(autograd=True) in ("double_backward", "jvp")
    whole = Objective(mlp.model, mlp.loss_fn, mlp.data)
    assert whole.hvp_strategy() == "rop" and whole._rop_fits() and whole.hvp_strategy(autograd=True) == "graph"
    with pytest.raises(ValueError, match="'rop' HVP strategy"):
        whole.hvp_strategy("rop", autograd=True)


class _PerToken(nn.Module):
    """Class scores per token: ``(N, C, T)`` logits from ``(N, T * F)`` inputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 4)

    def forward(self, x):
        return self.a(torch.tanh(x.unflatten(1, (5, 2)))).transpose(1, 2)


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(ignore_index=-100), nn.CrossEntropyLoss(label_smoothing=0.1),
                                     nn.NLLLoss(ignore_index=2)], ids=["ignored", "none ignored", "nll"])  # fmt: skip
def test_per_token_targets_are_averaged_over_every_counted_token_however_the_data_are_chunked(loss_fn):
    """One class label per token (``(N, T)`` targets), some left out by ``ignore_index``: chunks hold different
    numbers of counted tokens, so the mean is over the tokens counted in the whole data set, not of the chunks'
    means weighted by their samples."""
    torch.manual_seed(0)
    model = _PerToken().double().eval()
    if isinstance(loss_fn, nn.NLLLoss):
        model = nn.Sequential(model, nn.LogSoftmax(dim=1)).eval()
    X = torch.randn(7, 10, dtype=torch.float64)
    y = torch.randint(0, 4, (7, 5))
    if getattr(loss_fn, "label_smoothing", 0.0) == 0.0:  # the smoothed case keeps every token
        y[0, :4] = y[3, 1:] = loss_fn.ignore_index
    whole = Objective(model, loss_fn, (X, y))
    with torch.no_grad():
        torch.testing.assert_close(whole.value(), loss_fn(model(X), y), rtol=1e-14, atol=0)
    v = torch.randn(whole.layout.size, dtype=torch.float64)
    for chunked in (Objective(model, loss_fn, (X, y), chunk_size=3),
                    Objective(model, loss_fn, (X, y), chunk_size=3, memory_budget=1)):  # fmt: skip
        torch.testing.assert_close(chunked.value(), whole.value(), rtol=1e-14, atol=0)
        torch.testing.assert_close(chunked.gradient(), whole.gradient(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(chunked.hvp(v), whole.hvp(v), rtol=1e-12, atol=1e-14)


def test_auto_chunk_size_follows_the_memory_budget():
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data, memory_budget=4000)
    assert 1 <= obj.data.chunk_size < case.X.shape[0]
    assert len(list(obj.chunks())) > 1


def test_bad_data_is_refused_clearly():
    case = make_case("mlp_bias")
    with pytest.raises(DataError, match="empty"):
        Objective(case.model, case.loss_fn, (case.X[:0], case.y[:0]))
    with pytest.raises(DataError, match="samples"):
        Objective(case.model, case.loss_fn, (case.X, case.y[:3]))
    with pytest.raises(DataError, match="pair"):
        Objective(case.model, case.loss_fn, 3.0)
    with pytest.raises(ValueError, match="class-weighted"):
        Objective(case.model, nn.CrossEntropyLoss(weight=torch.ones(3)), case.data)
    with pytest.raises(ValueError, match="strategy"):
        Objective(case.model, case.loss_fn, case.data).hvp(torch.ones(75), "fancy")


def _conv_net(dim: int, **conv_kwargs) -> nn.Sequential:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim](2, 4, 3, **conv_kwargs)
    features = conv(torch.zeros((1, 2) + (5,) * dim)).numel()
    return nn.Sequential(
        nn.Unflatten(1, (2,) + (5,) * dim),  # a parameter-free module before the convolution
        conv,
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(features, 3),
    )


@pytest.mark.parametrize(
    "dim, conv_kwargs",
    [
        (2, {}),
        (1, {"stride": 2, "padding": 1, "bias": False}),
        (2, {"dilation": 2, "padding": 2, "groups": 2}),
        (3, {"padding": 1}),
    ],
)
def test_data_convolution_path_gives_exact_hvps(dim, conv_kwargs):
    torch.manual_seed(0)
    model = _conv_net(dim, **conv_kwargs)
    X = torch.randn(9, 2 * 5**dim)
    y = torch.randint(0, 3, (9,))
    loss_fn = nn.CrossEntropyLoss()
    obj = Objective(model.eval(), loss_fn, (X, y), chunk_size=4)
    assert obj._data_conv is not None and obj._data_conv.name == "1"
    flat = obj.layout.flatten(obj.params)
    H = torch.func.hessian(lambda w: loss_fn(torch.func.functional_call(model, obj.layout.unflatten(w), (X,)), y))(flat)
    g = torch.Generator().manual_seed(2)
    v, V = torch.randn(obj.layout.size, generator=g), torch.randn(2, obj.layout.size, generator=g)
    scale = max(1.0, float(H.abs().max()))
    for strategy in ("graph", "double_backward"):
        torch.testing.assert_close(obj.hvp(v, strategy), H @ v, rtol=0, atol=1e-10 * scale)
        torch.testing.assert_close(obj.hvp_batch(V, strategy), V @ H, rtol=0, atol=1e-10 * scale)
    assert float(obj.value()) == pytest.approx(float(loss_fn(model(X), y).detach()), rel=1e-13)


def test_data_convolution_path_only_where_it_applies():
    from manifolds import trace_network
    from sharpness.products._data_conv import split_data_convolution

    def names(m):
        return [k for k, _ in m.named_parameters()]

    def graph(m):
        return trace_network(m).graph

    plain = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    assert split_data_convolution(plain, names(plain), graph(plain)).name == "0"
    assert split_data_convolution(plain, names(plain), None) is None  # no graph, no cut
    for model in (
        nn.Sequential(nn.Linear(4, 2)),  # not a convolution
        nn.Sequential(nn.Conv2d(1, 2, 3, padding_mode="reflect", padding=1)),
        nn.Sequential(nn.Conv2d(1, 2, 3, padding="same")),
        nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 2, 3)),  # something with state before it
        nn.Sequential(nn.ConvTranspose2d(1, 2, 3)),
    ):
        assert split_data_convolution(model, names(model), graph(model)) is None
    # The convolution's weight is not among the differentiated parameters.
    assert split_data_convolution(plain, ["0.bias"], graph(plain)) is None


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_every_integer_label_dtype_gives_the_int64_values(dtype):
    case = make_case("mlp_bias")
    as_long = Objective(case.model, case.loss_fn, (case.X, case.y.long()))
    other = Objective(case.model, case.loss_fn, (case.X, case.y.to(dtype)))
    v = torch.randn(as_long.layout.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float(other.value()) == float(as_long.value())
    torch.testing.assert_close(other.gradient(), as_long.gradient(), rtol=0, atol=0)
    for strategy in ("rop", "double_backward"):  # the closed-form cross-entropy indexes by the labels
        torch.testing.assert_close(other.hvp(v, strategy), as_long.hvp(v, strategy), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("data", "loss_fn", "message"),
    [
        ((torch.randn(6, 5), torch.randn(6)), nn.MSELoss(), r"targets of shape \(\) per sample do not match .* \(3,\)"),
        ((torch.randn(6, 5), torch.randn(6, 1)), nn.MSELoss(), r"reshape the targets to \(n, 3\)"),
        ((torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 0, 1])), nn.CrossEntropyLoss(),
         r"range over \[0, 3\] .* 3 outputs"),
        ((torch.randn(6, 5), torch.tensor([0, -2, 1, 2, 0, 1])), nn.CrossEntropyLoss(), r"range over \[-2, 2\]"),
        ((torch.randn(6, 5), torch.ones(6, dtype=torch.bool)), nn.CrossEntropyLoss(), "targets are booleans"),
        ((torch.randn(6, 5, dtype=torch.complex64), torch.zeros(6).long()), nn.CrossEntropyLoss(), "complex"),
        ((torch.ones(6, 5, dtype=torch.bool), torch.zeros(6).long()), nn.CrossEntropyLoss(), "inputs are booleans"),
    ],
)
def test_targets_a_loss_would_misread_are_refused(data, loss_fn, message):
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).eval()
    with pytest.raises(DataError, match=message):
        Objective(model, loss_fn, data)


def test_targets_of_the_outputs_shape_and_ignored_labels_are_accepted():
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).eval()
    assert float(Objective(model, nn.MSELoss(), (torch.randn(6, 5), torch.randn(6, 3))).value()) > 0
    ignored = torch.tensor([0, -100, 1, 2, -100, 1])  # CrossEntropyLoss's ignore_index
    assert float(Objective(model, nn.CrossEntropyLoss(), (torch.randn(6, 5), ignored)).value()) > 0


class _FunctionalChain(nn.Module):
    """A chain written as a forward with functional calls: the R-operator reads it from the traced graph."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc1, self.fc2 = nn.Conv2d(1, 3, 3), nn.Linear(12, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.flatten(F.relu(self.conv(x)), 1)
        return self.fc2(F.relu(self.fc1(h)))


@pytest.mark.parametrize("name", ["resnet", "vgg_bn", "shared", "functional_chain"])
def test_graph_cuts_give_exact_hvps_beyond_sequential(name):
    """The data-convolution cut and the R-operator products come from the traced graph: a BatchNorm ResNet and
    VGG get both (the products over the graph), a forward calling modules one by one (a module called twice
    included) the chain products."""
    from test_group_zoo import build

    if name == "functional_chain":
        torch.manual_seed(0)
        model = _FunctionalChain().double().eval()
        x, y = torch.randn(7, 1, 4, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    else:
        model, x, y, *_ = build(name)
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y), chunk_size=4)
    expected = {"resnet": (True, True), "vgg_bn": (True, True), "shared": (False, True),
                "functional_chain": (True, True)}[name]  # fmt: skip
    assert (obj._data_conv is not None, obj._rop is not None) == expected
    H = dense_hessian(obj)
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = float((H @ v).abs().max())
    for strategy in ("graph", "double_backward", *(("rop",) if expected[1] else ())):
        torch.testing.assert_close(obj.hvp(v, strategy), H @ v, rtol=0, atol=1e-12 * scale, msg=strategy)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("join", [False, True])
def test_pieces_regroup_the_chunks_with_their_weights(reduction, join):
    """Chunks of 4, 4, 4, 1 samples in pieces of at most 3 (cut near-evenly: 2 + 2 each) or 9 (joined while they fit):
    the samples in order, and ``sum(weight * piece_loss)`` is the objective's loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    x, y = torch.randn(13, 3, dtype=torch.float64), torch.randint(0, 2, (13,))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    obj = Objective(model, loss_fn, (x, y), chunk_size=4)
    for size, sizes in [(3, [2, 2, 2, 2, 2, 2, 1]), (9, [8, 5] if join else [4, 4, 4, 1]), (40, [13] if join else
                                                                                                [4, 4, 4, 1])]:
        pieces = list(obj.pieces(size, join=join))
        assert [p[0].shape[0] for p in pieces] == sizes
        assert torch.equal(torch.cat([p[0] for p in pieces]), x) and torch.equal(torch.cat([p[1] for p in pieces]), y)
        with torch.no_grad():
            total = sum(w * loss_fn(model(xs), ys) for xs, ys, w in pieces)
        torch.testing.assert_close(total, obj.value(), rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "loss_fn",
    [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=2), nn.NLLLoss()],
    ids=["ce", "ce-smoothed-ignoring-class-2", "nll"],
)
def test_a_mean_loss_with_ignored_targets_is_their_mean_over_the_whole_data_set_however_chunked(
    loss_fn, monkeypatch
):
    """The targets equal to ``ignore_index`` are left out of the mean over the whole data set, not chunk by chunk
    (chunk means over their own counted targets would weigh samples differently): value, gradient, products (the
    R-operator's closed form for a cross-entropy, in pieces of one sample; autograd's) and grid values agree with
    the loss of the whole batch at once, whatever the chunk size."""
    from landscape import evaluate_grid
    from sharpness.products import _objective as objective_module

    monkeypatch.setattr(objective_module, "_ROP_PIECE_BYTES", 1)  # the R-operator's state in pieces of 1 sample
    torch.manual_seed(0)
    layers = [nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)] + ([nn.LogSoftmax(dim=1)] if type(loss_fn) is nn.NLLLoss
                                                              else [])  # fmt: skip
    model = nn.Sequential(*layers).double().eval()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(13, 5, generator=g, dtype=torch.float64)
    ignored = loss_fn.ignore_index
    y = torch.tensor([0, ignored, 1, 2, ignored, 1, 0, 0, ignored, ignored, ignored, 2, 1])
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def whole(w):
        return loss_fn(torch.func.functional_call(model, obj.layout.unflatten(w), (X,)), y)

    obj = Objective(model, loss_fn, (X, y))
    H = torch.func.hessian(whole)(flat)
    gradient = torch.func.grad(whole)(flat)
    v = torch.randn(flat.shape, generator=g, dtype=torch.float64)
    directions = torch.randn(2, flat.numel(), generator=g, dtype=torch.float64)
    coords = np.array([[0.0, 0.0], [0.3, -0.2]])
    for chunk_size in (None, 3, 5):
        obj = Objective(model, loss_fn, (X, y), chunk_size=chunk_size)
        torch.testing.assert_close(obj.value(), whole(flat), rtol=1e-14, atol=0)
        torch.testing.assert_close(obj.gradient(), gradient, rtol=1e-13, atol=1e-15)
        for samples in (1, 7):  # gradients in pieces of 1 sample (chunks cut), of up to 7 (chunks of 3 joined)
            monkeypatch.setattr(objective_module, "_GRADIENT_PIECE_BYTES", samples * obj.activation_bytes_per_sample())
            torch.testing.assert_close(obj.gradient(), gradient, rtol=1e-13, atol=1e-15)
            value, grad = obj.value_and_gradient()
            torch.testing.assert_close(grad, gradient, rtol=1e-13, atol=1e-15)
            torch.testing.assert_close(value, whole(flat), rtol=1e-14, atol=0)
        monkeypatch.undo()
        monkeypatch.setattr(objective_module, "_ROP_PIECE_BYTES", 1)
        for strategy in ("rop" if type(loss_fn) is nn.CrossEntropyLoss else "jvp", "double_backward"):
            torch.testing.assert_close(obj.hvp(v, strategy), H @ v, rtol=1e-12, atol=1e-14)
        grid = evaluate_grid(obj, directions, coords, progress=False).loss
        expected = [float(whole(flat + torch.as_tensor(c) @ directions)) for c in coords]
        np.testing.assert_allclose(grid, expected, rtol=1e-13)
    if type(loss_fn) is nn.CrossEntropyLoss:  # the closed form of the cross-entropy's curvature, ignored rows 0
        assert all(s.probs is not None for s in obj.rop_states()[1])


def test_a_mean_loss_that_ignores_every_target_is_refused():
    model = nn.Sequential(nn.Linear(5, 3)).eval()
    with pytest.raises(DataError, match="every target equals the loss's ignore_index"):
        Objective(model, nn.CrossEntropyLoss(), (torch.randn(4, 5), torch.full((4,), -100)))


def test_gradient_pieces_join_chunks_only_within_the_memory_budget(monkeypatch):
    """On the CPU gradients run in pieces of about ``_GRADIENT_PIECE_BYTES`` of activations: larger chunks are cut,
    and smaller ones joined only where the memory budget allows a chunk that large (a small budget keeps them)."""
    from sharpness.products import _objective as objective_module

    case = make_case("mlp_bias")
    X, y = case.X[:13], case.y[:13]
    roomy = Objective(case.model, case.loss_fn, (X, y), chunk_size=3)
    per_sample = roomy.activation_bytes_per_sample()
    monkeypatch.setattr(objective_module, "_GRADIENT_PIECE_BYTES", 7 * per_sample)
    assert [x.shape[0] for x, _, _ in roomy._gradient_pieces()] == [6, 7]
    tight = Objective(case.model, case.loss_fn, (X, y), chunk_size=3, memory_budget=int(4 * 7 * per_sample) - 1)
    assert [x.shape[0] for x, _, _ in tight._gradient_pieces()] == [3, 3, 3, 3, 1]
    monkeypatch.setattr(objective_module, "_GRADIENT_PIECE_BYTES", 2 * per_sample)
    whole = Objective(case.model, case.loss_fn, (X, y))
    assert [x.shape[0] for x, _, _ in whole._gradient_pieces()] == [1, 2, 2, 2, 2, 2, 2]  # near-equal cuts
    torch.testing.assert_close(whole.gradient(), roomy.gradient(), rtol=1e-13, atol=1e-15)
