"""geoopt manifolds on the rescaling quotient.

The property that matters: training a function-identical rescaled copy with a geoopt optimiser
reproduces the original losses at every step (node-wise rescalings with LogEuclidean, layer-wise
with LayerScaleEuclidean), while torch.optim.SGD does not. Then the operator identities: metric
duality of the gradient, isometric transport, Taylor tests of retraction and exponential map, the
geodesic equation, and checks that refuse zero tensors.
"""

import copy

import geoopt
import pytest
import torch
from cases import make_case
from torch import nn

import manifolds
from manifolds import LayerScaleEuclidean, LogEuclidean

STEPS = 50
LR = 1e-2
MLPS = ("mlp_bias", "mlp_nobias")


@pytest.fixture(autouse=True)
def _one_thread():
    # tensors of a few dozen entries: thread hand-offs cost more than they save (10x on a busy machine)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _train(model: nn.Module, case, optimizer) -> torch.Tensor:
    """Full-batch losses before each of ``STEPS`` steps, shape ``(STEPS,)``."""
    opt = optimizer(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = case.loss_fn(model(case.X), case.y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def _rsgd(momentum: float, zero_init: bool = True):
    def make(params):
        opt = geoopt.optim.RiemannianSGD(params, lr=LR, momentum=momentum)
        if momentum and zero_init:
            manifolds.zero_init_momentum(opt)
        return opt

    return make


def _rescaled(case, kind: str) -> nn.Module:
    return manifolds.random_rescale(case.model, kind=kind, scale=1.0, generator=torch.Generator().manual_seed(1))


def _quotient_losses(case, kind: str, metric: str, optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Losses of the original and of a ``kind``-rescaled copy, both trained on ``metric``."""
    original = _train(manifolds.quotient_parameters(case.model, metric), case, optimizer)
    rescaled = _train(manifolds.quotient_parameters(_rescaled(case, kind), metric), case, optimizer)
    return original, rescaled


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / a.abs()).max().item()


# ---------------------------------------------------------------- training follows the rescaling


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize(
    "kind, metric",
    [("node", "node"), ("layer", "node"), ("layer", "layer")],
    ids=["node-LogEuclidean", "layer-LogEuclidean", "layer-LayerScale"],
)
@pytest.mark.parametrize("name", MLPS)
def test_riemannian_sgd_follows_rescaling(name, kind, metric, momentum):
    case = make_case(name)
    original, rescaled = _quotient_losses(case, kind, metric, _rsgd(momentum))
    assert original[-1] < original[0]  # it trains, so agreement is not trivial
    torch.testing.assert_close(rescaled, original, rtol=1e-10, atol=0)


@pytest.mark.parametrize("kind", ["node", "layer"])
@pytest.mark.parametrize("name", MLPS)
def test_euclidean_sgd_does_not_follow_rescaling(name, kind):
    case = make_case(name)
    sgd = lambda params: torch.optim.SGD(params, lr=LR)  # noqa: E731
    original = _train(copy.deepcopy(case.model), case, sgd)
    rescaled = _train(_rescaled(case, kind), case, sgd)
    assert torch.isfinite(rescaled).all()
    assert (rescaled - original).abs().max() > 1e-3


@pytest.mark.parametrize("name", MLPS)
def test_layer_scale_does_not_follow_node_rescaling(name):
    """Limitation: one factor per tensor cannot absorb per-unit factors; use metric='node'."""
    original, rescaled = _quotient_losses(make_case(name), "node", "layer", _rsgd(0.0))
    assert (rescaled - original).abs().max() > 1e-3


@pytest.mark.parametrize("metric", ["node", "layer"])
def test_geoopt_momentum_seed_breaks_equivariance_without_zero_init(metric):
    """Why zero_init_momentum exists: geoopt seeds the buffer with the Euclidean gradient."""
    original, rescaled = _quotient_losses(make_case("mlp_bias"), "layer", metric, _rsgd(0.9, zero_init=False))
    assert _max_rel_diff(original, rescaled) > 1e-4


@pytest.mark.parametrize(
    "kind, metric",
    [("node", "node"), ("layer", "layer")],
    ids=["node-LogEuclidean", "layer-LayerScale"],
)
def test_riemannian_adam_trains_and_follows_rescaling(kind, metric):
    case = make_case("mlp_bias")
    # eps enters the step unscaled; with a negligible eps Adam's step is equivariant too
    tiny_eps = lambda params: geoopt.optim.RiemannianAdam(params, lr=LR, eps=1e-30)  # noqa: E731
    original, rescaled = _quotient_losses(case, kind, metric, tiny_eps)
    assert original[-1] < 0.8 * original[0]
    torch.testing.assert_close(rescaled, original, rtol=1e-10, atol=0)
    default = _train(
        manifolds.quotient_parameters(case.model, metric),
        case,
        lambda p: geoopt.optim.RiemannianAdam(p, lr=LR),
    )
    assert default[-1] < 0.8 * default[0]


# ---------------------------------------------------------------- quotient_parameters


def test_quotient_parameters_copies_and_wraps():
    case = make_case("mlp_bias")
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    q = manifolds.quotient_parameters(case.model, "node", exclude=["4.bias"])
    kinds = {n: type(p.manifold) if isinstance(p, geoopt.ManifoldParameter) else None for n, p in q.named_parameters()}
    assert kinds.pop("4.bias") is None
    assert set(kinds.values()) == {LogEuclidean}
    _train(q, case, _rsgd(0.9))
    assert not any(isinstance(p, geoopt.ManifoldParameter) for p in case.model.parameters())
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_quotient_parameters_keeps_tied_and_frozen_parameters():
    tied = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    tied[2].weight = tied[0].weight
    tied[0].bias.requires_grad_(False)
    q = manifolds.quotient_parameters(tied, "layer")
    assert q[2].weight is q[0].weight
    assert isinstance(q[0].weight, geoopt.ManifoldParameter)
    assert not isinstance(q[0].bias, geoopt.ManifoldParameter)


def test_quotient_parameters_refuses_zero_tensor_for_layer_metric():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    nn.init.zeros_(model[0].bias)
    with pytest.raises(ValueError, match=r"'0\.bias'.*metric='node'.*exclude=\['0\.bias'\]"):
        manifolds.quotient_parameters(model, "layer")
    q = manifolds.quotient_parameters(model, "layer", exclude=["0.bias"])
    assert type(q[0].bias) is nn.Parameter and isinstance(q[0].weight, geoopt.ManifoldParameter)
    # node metric accepts it, and the zero entries are fixed points of training
    q = manifolds.quotient_parameters(model, "node")
    X, y = torch.randn(8, 3), torch.randn(8, 2)
    opt = geoopt.optim.RiemannianSGD(q.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(q(X), y).backward()
        opt.step()
    assert torch.equal(q[0].bias.detach(), torch.zeros(4))


def test_quotient_parameters_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown metric"):
        manifolds.quotient_parameters(model, "channel")
    with pytest.raises(ValueError, match="weight2"):
        manifolds.quotient_parameters(model, "layer", exclude=["weight2"])


# ---------------------------------------------------------------- operator identities


def _point(manifold, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(4, 3, generator=g)
    if isinstance(manifold, LogEuclidean):
        x[1, 2] = 0.0  # exercise the zero-entry convention
    return x


MANIFOLDS = [LayerScaleEuclidean(), LogEuclidean()]
IDS = ["LayerScale", "LogEuclidean"]


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_rgrad_is_metric_dual_of_egrad(manifold):
    g = torch.Generator().manual_seed(0)
    x = _point(manifold, g)
    egrad = torch.randn(x.shape, generator=g)
    rgrad = manifold.egrad2rgrad(x, egrad)
    for _ in range(3):
        v = manifold.proju(x, torch.randn(x.shape, generator=g))
        torch.testing.assert_close(manifold.inner(x, rgrad, v), (egrad * v).sum(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_transp_is_isometric(manifold):
    g = torch.Generator().manual_seed(1)
    x = _point(manifold, g)
    v = manifold.proju(x, torch.randn(x.shape, generator=g))
    if isinstance(manifold, LogEuclidean):
        factor = torch.rand(x.shape, generator=g) * 10 + 0.1  # node-wise: one factor per entry
    else:
        factor = torch.tensor(7.3)
    targets = [factor * x, manifold.retr(x, 0.3 * manifold.proju(x, torch.randn(x.shape, generator=g)))]
    for y in targets:
        moved = manifold.transp(x, y, v)
        torch.testing.assert_close(manifold.norm(y, moved), manifold.norm(x, v), rtol=1e-12, atol=0)
    torch.testing.assert_close(manifold.transp(x, targets[0], v), factor * v, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["retr", "expmap"])
@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_first_order_taylor(manifold, method):
    """``|R(x, t u) - x - t u| = O(t^2)``: the error drops 100x when ``t`` drops 10x."""
    g = torch.Generator().manual_seed(2)
    x = _point(manifold, g)
    u = manifold.proju(x, torch.randn(x.shape, generator=g))
    step = getattr(manifold, method)
    errors = [(step(x, t * u) - x - t * u).norm().item() for t in (1e-2, 1e-3, 1e-4)]
    assert errors[1] <= 0.012 * errors[0] + 1e-15
    assert errors[2] <= 0.012 * errors[1] + 1e-15


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_expmap_solves_geodesic_equation(manifold):
    """Central differences of ``c(t) = Exp_x(t u)`` satisfy the metric's geodesic equation."""
    g = torch.Generator().manual_seed(3)
    x = _point(manifold, g)
    # entries of u relative to those of x: no entry's exp(t u / x) outruns the finite-difference step
    u = manifold.proju(x, x.abs() * torch.randn(x.shape, generator=g))
    h, t = 1e-3, 0.7
    c0, cp, cm = (manifold.expmap(x, s * u) for s in (t, t + h, t - h))
    vel, acc = (cp - cm) / (2 * h), (cp - 2 * c0 + cm) / h**2
    if isinstance(manifold, LogEuclidean):
        # per entry: dw^2 / w^2, geodesics w0 exp(a t), so c'' = c'^2 / c (zero entries stay 0)
        residual = acc - torch.where(c0 == 0, 0.0, vel**2 / torch.where(c0 == 0, 1.0, c0))
    else:
        # conformal metric |dx|^2 / |x|^2: c'' - 2 <c, c'> / |c|^2 c' + |c'|^2 / |c|^2 c = 0
        sq = (c0 * c0).sum()
        residual = acc - 2 * (c0 * vel).sum() / sq * vel + (vel * vel).sum() / sq * c0
    assert residual.norm() < 1e-5 * acc.norm()
    assert acc.norm() > 1e-2  # the geodesic is curved, so the test is not vacuous


def test_layer_scale_checks_refuse_zero_tensor():
    m = LayerScaleEuclidean()
    ok, reason = m.check_point(torch.zeros(3, 2), explain=True)
    assert not ok and "all zeros" in reason
    assert not m.check_point_on_manifold(torch.zeros(3))
    assert m.check_point(torch.tensor([0.0, 1e-300]))
    with pytest.raises(ValueError, match="all zeros"):
        geoopt.ManifoldParameter(torch.zeros(3), manifold=m)
    with pytest.raises(ValueError, match="all zeros"):
        m.assert_check_point_on_manifold(torch.zeros(2, 2))


def test_log_euclidean_checks():
    m = LogEuclidean()
    x = torch.tensor([1.0, 0.0, -2.0])
    assert m.check_point_on_manifold(torch.zeros(3))  # zero entries are fixed points, not errors
    ok, reason = m.check_vector_on_tangent(x, torch.tensor([1.0, 0.5, 1.0]), explain=True)
    assert not ok and "exactly zero" in reason
    assert m.check_vector_on_tangent(x, m.proju(x, torch.ones(3)))
    assert not m.check_point_on_manifold(torch.tensor([1.0, float("inf")]))
