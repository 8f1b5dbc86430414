"""Losses at the objective's boundary: each is evaluated as the true mean (or sum) over the whole data set however
the data are chunked, the same for every strategy, or refused with one sentence before any work.

Found by review: the streaming strategy choice ran a forward-mode product that some losses have no formula for
(Huber's backward, integer regression targets); integer regression targets broadcast against the outputs; KLDivLoss's
``batchmean`` (a per-sample mean) was refused, and the suggested ``reduction="mean"`` is the elementwise mean; a plain
function leaving out labels of -100 (F.cross_entropy's default) was averaged per chunk; a loss with no second
derivative failed at the first product; sequences of another length per batch broke the gradient.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sharpness import DataError, Objective


def _model(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ELU(), nn.Linear(5, out)).double().eval()  # ELU: autograd's products


def _agree(obj: Objective, ref: Objective) -> None:
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(obj.value(), ref.value(), rtol=1e-13, atol=0)
    torch.testing.assert_close(obj.gradient(), ref.gradient(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(obj.hvp(v), ref.hvp(v, "double_backward"), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss_fn, targets", [
    (nn.HuberLoss(), "float"), (nn.SoftMarginLoss(), "sign"), (nn.MSELoss(), "integer")])  # fmt: skip
def test_streaming_picks_double_backward_where_forward_mode_has_no_formula(loss_fn, targets):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(7, 4, generator=g, dtype=torch.float64)
    y = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = y.sign() if targets == "sign" else y.round().long() if targets == "integer" else y
    streamed = Objective(_model(), loss_fn, (X, y), chunk_size=3, memory_budget=1)
    assert streamed.hvp_strategy() == "double_backward"
    _agree(streamed, Objective(_model(), loss_fn, (X, y)))


def test_integer_regression_targets_of_another_shape_are_refused():
    X, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 5, (7,))
    with pytest.raises(DataError, match=r"targets of shape \(\) per sample do not match"):
        Objective(_model(out=1), nn.MSELoss(), (X, y))


def test_kl_divergence_batchmean_is_the_per_sample_mean_however_chunked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LogSoftmax(dim=1)).double().eval()
    X = torch.randn(7, 4, dtype=torch.float64)
    p = torch.softmax(torch.randn(7, 3, dtype=torch.float64), dim=1)
    kl = nn.KLDivLoss(reduction="batchmean")
    whole = Objective(model, kl, (X, p))
    with torch.no_grad():
        torch.testing.assert_close(whole.value(), kl(model(X), p), rtol=1e-14, atol=0)
    _agree(Objective(model, kl, (X, p), chunk_size=3), whole)
    # reduction="mean" asks for torch's elementwise mean, C times smaller here (torch warns about that mean)
    with pytest.warns(UserWarning, match="divides the total loss by both"):
        elementwise = Objective(model, kl, (X, p), reduction="mean")
        torch.testing.assert_close(elementwise.value() * 3, whole.value(), rtol=1e-13, atol=0)


def test_a_plain_function_leaving_out_labels_of_minus_100_is_refused():
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6, 2))
    y[0, 1] = -100
    per_token = lambda out, t: F.cross_entropy(out.reshape(-1, 3), t.reshape(-1))  # noqa: E731
    model = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (2, 3))).double().eval()
    with pytest.raises(DataError, match="-100"):
        Objective(model, per_token, (X, y), chunk_size=3)
    Objective(model, lambda out, t: F.cross_entropy(out.transpose(1, 2), t), (X, y.clamp(min=0)))  # none: accepted


def test_a_loss_with_no_second_derivative_is_refused_when_the_objective_is_built():
    X, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    with pytest.raises(ValueError, match="MultiMarginLoss has no second derivative"):
        Objective(_model(), nn.MultiMarginLoss(), (X, y))


def test_batches_of_sequences_of_other_lengths_are_not_joined():
    """Each batch holds sequences of its own length: the gradient's pieces keep them apart (they were concatenated),
    and value, gradient and products are those of the batches' losses summed, each weighted by its samples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double().eval()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 2, 4, generator=g, dtype=torch.float64), torch.randn(2, 2, 3, generator=g,
                                                                                   dtype=torch.float64)),
               (torch.randn(3, 6, 4, generator=g, dtype=torch.float64), torch.randn(3, 6, 3, generator=g,
                                                                                   dtype=torch.float64))]  # fmt: skip
    obj = Objective(model, nn.MSELoss(), batches)
    with torch.enable_grad():
        params = dict(model.named_parameters())
        total = sum(x.shape[0] / 5 * F.mse_loss(model(x), y) for x, y in batches)
        expected = torch.cat([t.reshape(-1) for t in torch.autograd.grad(total, list(params.values()))])
    torch.testing.assert_close(obj.value(), total.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(obj.gradient(), expected, rtol=1e-12, atol=1e-14)


def test_an_elementwise_weight_keeps_a_per_sample_mean_however_chunked():
    """BCE's ``weight`` rescales each output entry: the mean is still over every entry (a class-weighted
    cross-entropy's is not, and stays refused)."""
    g = torch.Generator().manual_seed(4)
    X, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.rand(7, 3, generator=g, dtype=torch.float64)
    loss_fn = nn.BCEWithLogitsLoss(weight=torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64))
    whole = Objective(_model(), loss_fn, (X, y))
    with torch.no_grad():
        torch.testing.assert_close(whole.value(), loss_fn(_model()(X), y), rtol=1e-14, atol=0)
    _agree(Objective(_model(), loss_fn, (X, y), chunk_size=3), whole)
    with pytest.raises(ValueError, match="class-weighted mean"):
        Objective(_model(), nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)),
                  (X, torch.randint(0, 3, (7,))))  # fmt: skip


def test_a_data_loader_of_single_samples_is_refused_with_a_sentence():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))),
                        batch_size=None)  # fmt: skip
    with pytest.raises(DataError, match="give the DataLoader a batch_size"):
        Objective(_model(), nn.CrossEntropyLoss(), loader)


class MeanOverSamples(nn.Module):
    """A loss that sums over the outputs and averages over the samples, with a ``reduction`` attribute saying
    "sum" (meaning the outputs)."""

    reduction = "sum"

    def forward(self, out, y):
        return ((out - y) ** 2).sum(1).mean()


class AlwaysMean(nn.modules.loss._Loss):
    """A torch loss subclass whose forward ignores ``self.reduction``: the override to "sum" changes nothing."""

    def forward(self, out, y):
        return F.mse_loss(out, y)


def _batch_softmax(out, y):
    """A contrastive-style loss normalized over the batch: no sample's loss is its own."""
    return -torch.log_softmax(out[:, 0], dim=0).mean()


@pytest.mark.parametrize("loss_fn, reduction", [(MeanOverSamples(), None), (AlwaysMean(), "sum"),
                                                (lambda o, t: F.mse_loss(o, t), "sum"), (_batch_softmax, None)],
                         ids=["attribute", "override on a module", "declared for a function", "batch-normalized"])
def test_a_loss_that_does_not_reduce_over_samples_as_declared_is_refused(loss_fn, reduction):
    """The objective sums chunks weighted as the declared reduction says; a loss computing something else would give
    a value depending on the chunking (e.g. a per-sample mean declared as a sum grows with the number of chunks)."""
    g = torch.Generator().manual_seed(5)
    X, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError, match="does not reduce over the samples as a"):
        Objective(_model(), loss_fn, (X, y), reduction=reduction)
    if reduction == "sum" and not isinstance(loss_fn, nn.Module):  # declared as it computes: accepted
        Objective(_model(), loss_fn, (X, y), reduction="mean")


def _three(out, y, w):
    return ((out - y) ** 2 * w).mean()


@pytest.mark.parametrize("loss", [_three, nn.TripletMarginLoss(), lambda out: out.sum(), 3],
                         ids=["three arguments", "TripletMarginLoss", "one argument", "not callable"])  # fmt: skip
def test_a_loss_that_cannot_take_outputs_and_targets_is_refused_before_any_call(loss):
    model = nn.Linear(3, 2).eval()
    with pytest.raises(TypeError, match=r"loss function must (take \(outputs, targets\)|be callable)"):
        Objective(model, loss, (torch.randn(6, 3), torch.randn(6, 2)))


@pytest.mark.parametrize("loss", [lambda out, y, w=1.0: ((out - y) ** 2).mean() * w,
                                  lambda *args: ((args[0] - args[1]) ** 2).mean(), F.mse_loss])  # fmt: skip
def test_losses_taking_two_arguments_among_others_are_accepted(loss):
    model = nn.Linear(3, 2).eval()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    value = float(Objective(model, loss, (x, y), dtype=torch.float64).value())
    with torch.no_grad():
        assert value == pytest.approx(float(F.mse_loss(model.double()(x), y)), rel=1e-12)


def _weighted(out, y, w):
    return ((out - y) ** 2).mean() * w


class _Packed(nn.Module):
    """``forward`` takes one pair; ``__call__`` (or a pre-hook) gives it ``(outputs, targets)`` packed."""

    def forward(self, pair):
        return F.mse_loss(*pair)


class _CallOverride(_Packed):
    def __call__(self, out, y):
        return self.forward((out, y))


def _hooked():
    loss = _Packed()
    loss.register_forward_pre_hook(lambda module, args: ((args[0], args[1]),))
    return loss


def _decorated():
    @functools.wraps(_weighted)
    def wrapper(out, y):
        return _weighted(out, y, 2.0)

    return wrapper


class _Static:
    __call__ = staticmethod(lambda out, y: F.mse_loss(out, y))


@pytest.mark.parametrize("make", [_decorated, _CallOverride, _hooked, _Static],
                         ids=["a decorator supplying an argument", "own __call__", "a pre-hook", "static call"])
def test_losses_called_with_two_arguments_through_other_means_are_accepted(make):
    model = nn.Linear(3, 2).eval()
    Objective(model, make(), (torch.randn(6, 3), torch.randn(6, 2)))


def test_a_class_weighted_plain_function_is_refused_when_the_first_samples_share_their_class():
    """``F.cross_entropy(..., weight=w)`` normalizes by the batch's summed weights: not a per-sample mean. The check
    takes the first sample whose class differs from the first's, so two leading samples of one class do not hide it."""
    g = torch.Generator().manual_seed(6)
    X = torch.randn(7, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([1, 1, 1, 0, 2, 1, 0])
    w = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="does not reduce over the samples as a mean"):
        Objective(_model(), lambda out, t: F.cross_entropy(out, t, weight=w), (X, y))
    Objective(_model(), lambda out, t: F.cross_entropy(out, t), (X, y))  # unweighted: a per-sample mean


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint32])
def test_unsigned_integer_targets_pass_the_reduction_check(dtype):
    g = torch.Generator().manual_seed(7)
    X, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.tensor([1, 1, 0, 2, 1, 0, 2]).to(dtype)
    Objective(_model(), lambda out, t: F.cross_entropy(out, t.long()), (X, y))
    with pytest.raises(ValueError, match="does not reduce over the samples as a mean"):
        Objective(_model(), lambda out, t: F.cross_entropy(out, t.long(), weight=torch.tensor([0.5, 2.0, 1.0],
                                                                                               dtype=torch.float64)),
                  (X, y))  # fmt: skip


@pytest.mark.parametrize("ignored_row", [0, 1])
def test_a_token_mean_with_a_sample_whose_tokens_are_all_ignored_is_refused(ignored_row):
    """A mean over the kept tokens weighs samples by their count; with every full row of the same length, only a row
    whose tokens are all ignored shows it (its loss alone is 0/0), and the chunked value would differ."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double().eval()
    X = torch.randn(6, 4, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6, 4))
    y[ignored_row] = -1
    loss = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=-1)  # noqa: E731
    with pytest.raises(ValueError, match="one of them alone gives nan"):
        Objective(model, loss, (X, y))
    y[ignored_row] = 0  # every row kept in full: a mean over samples of equal length is accepted
    Objective(model, loss, (X, y))
