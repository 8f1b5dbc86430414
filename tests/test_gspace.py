"""G-space (manifolds._gspace*, sharpness.measures._gspace) against the thesis's Tables 2.1-2.3, the
explicit G-SGD update rules (20)-(28) of the G-SGD paper (appendix 10.1), autograd, and rescalings."""

import copy

import pytest
import torch
from cases import make_case, mlp
from torch import nn
from torch.func import functional_call

from manifolds import (
    GModel,
    GOptimizer,
    GSpace,
    GSpaceSingularityError,
    Skeleton,
    UnsupportedModelError,
    analyze,
    gsgd_init_,
    random_rescale,
)
from manifolds._gspace import _Kernel
from sharpness import GSpaceLoss, GSpaceMeasure, Objective, Solver, invariant_sharpness

CASES = ("mlp_bias", "mlp_nobias", "cnn")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def straight_mlp(seed: int = 0, bias: bool = False, skeleton_value: float | None = None) -> nn.Sequential:
    """5-4-4-4-3 ReLU MLP (equal hidden widths, the G-SGD setting), float64."""
    torch.manual_seed(seed)
    model = mlp([5, 4, 4, 4, 3], bias=bias).double()
    if skeleton_value is not None:
        with torch.no_grad():
            for name, mask in GSpace(model).skeleton_masks().items():
                model.get_parameter(name)[mask] = skeleton_value
    return model


# ------------------------------------------------------------------------------------ construction


@pytest.mark.parametrize("name", CASES)
def test_dimension_is_weights_minus_hidden_units_plus_biases(name):
    model = make_case(name).model
    gs = GSpace(model)
    structure = analyze(model)
    n_weights = sum(model.get_parameter(layer.weight).numel() for layer in structure.layers)
    n_biases = sum(model.get_parameter(layer.bias).numel() for layer in structure.layers if layer.bias)
    assert gs.dim == n_weights - structure.n_hidden + n_biases
    assert gs.coordinates().shape == (gs.dim,)
    assert sum(int(m.sum()) for m in gs.skeleton_masks().values()) == structure.n_hidden


@pytest.mark.parametrize("name", CASES)
def test_round_trip(name):
    model = make_case(name).model
    gs = GSpace(model)
    params = params_of(model)
    v = gs.coordinates()
    weights = gs.weights(v)
    for k in gs.names:
        assert rel(weights[k], params[k]) < 1e-12
    assert rel(gs.coordinates(weights), v) < 1e-12


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kind", ["node", "layer"])
def test_coordinates_invariant_under_rescaling(name, kind):
    case = make_case(name)
    gs = GSpace(case.model)
    twin = random_rescale(case.model, kind, scale=1.0, generator=torch.Generator().manual_seed(1))
    assert rel(gs.coordinates(params_of(twin)), gs.coordinates()) < 1e-12


@pytest.mark.parametrize("name", CASES)
def test_rescaled_coordinates_map_back_to_the_same_function(name):
    case = make_case(name)
    twin = random_rescale(case.model, "node", scale=1.0, generator=torch.Generator().manual_seed(2))
    twin_gs = GSpace(twin)  # the twin's own skeleton values
    out = functional_call(case.model, twin_gs.weights(twin_gs.coordinates()), (case.X,))
    assert rel(out, case.model(case.X)) < 1e-12
    # With the original skeleton the twin's coordinates give back the original weights exactly.
    back = GSpace(case.model).weights(twin_gs.coordinates())
    for k, p in params_of(case.model).items():
        assert rel(back[k], p) < 1e-12


def test_widening_and_narrowing_layers_and_single_layer():
    torch.manual_seed(0)
    for widths in ([3, 2, 5, 7, 2], [6, 9, 2, 4], [4, 3]):
        model = mlp(widths, activation=nn.LeakyReLU).double()
        gs = GSpace(model)
        n = sum(p.numel() for p in model.parameters())
        assert gs.dim == n - sum(widths[1:-1])
        x = torch.randn(7, widths[0], dtype=torch.float64)
        v = gs.coordinates()
        twin = random_rescale(model, generator=torch.Generator().manual_seed(3))
        assert rel(gs.coordinates(params_of(twin)), v) < 1e-12
        assert rel(functional_call(model, gs.weights(v), (x,)), model(x)) < 1e-12


def test_default_skeleton_is_gsgd_on_straight_nets():
    gs = GSpace(straight_mlp())
    designated, predecessor = gs.skeleton.designated, gs.skeleton.predecessor
    assert designated[0].tolist() == designated[1].tolist() == [0, 1, 2, 3]  # diagonal
    assert designated[2].tolist() == [0, 1, 2, 0]  # last layer: i mod K
    assert predecessor[0].tolist() == [0, 1, 2, 3]  # first layer: input i mod d
    assert predecessor[1].tolist() == predecessor[2].tolist() == [0, 1, 2, 3]


def test_user_skeleton_is_accepted_and_validated():
    case = make_case("mlp_nobias")  # widths 5-7-3-4-2
    g = torch.Generator().manual_seed(0)
    hidden, nxt, prev = (7, 3, 4), (3, 4, 2), (5, 7, 3)
    skeleton = Skeleton(
        [torch.randint(0, n, (h,), generator=g) for h, n in zip(hidden, nxt)],
        [torch.randint(0, p, (h,), generator=g) for h, p in zip(hidden, prev)],
    )
    gs = GSpace(case.model, skeleton)
    v = gs.coordinates()
    assert rel(functional_call(case.model, gs.weights(v), (case.X,)), case.model(case.X)) < 1e-12
    twin = random_rescale(case.model, generator=torch.Generator().manual_seed(1))
    assert rel(gs.coordinates(params_of(twin)), v) < 1e-12
    bad = [
        (Skeleton(skeleton.designated[:2], skeleton.predecessor), "one tensor per hidden layer"),
        (Skeleton([t[:-1] for t in skeleton.designated], skeleton.predecessor), "must have shape"),
        (Skeleton([t + 10 for t in skeleton.designated], skeleton.predecessor), "outside"),
        (Skeleton(skeleton.designated, [t.double() for t in skeleton.predecessor]), "integer"),
    ]
    for sk, message in bad:
        with pytest.raises(ValueError, match=message):
            GSpace(case.model, sk)


def test_zero_designated_or_chain_weight_is_refused():
    model = straight_mlp()
    with torch.no_grad():
        model[2].weight[1, 1] = 0.0  # designated weight of unit 1 of the first hidden layer
    with pytest.raises(ValueError, match="designated .* is 0"):
        GSpace(model)
    model = straight_mlp()
    with torch.no_grad():
        model[0].weight[2, 2] = 0.0  # predecessor weight of unit 2
    with pytest.raises(ValueError, match="predecessor weight of unit 2 .* is 0"):
        GSpace(model)


def test_gsgd_init_sets_skeleton_and_predecessor_weights_to_one():
    model = make_case("mlp_bias").model
    assert gsgd_init_(model) is model
    gs = GSpace(model)
    designated, predecessor = gs.skeleton_masks(), gs.predecessor_masks()
    for name, mask in designated.items():
        weight = model.get_parameter(name).detach()
        assert torch.all(weight[mask | predecessor[name]] == 1)
        assert torch.all(weight[~(mask | predecessor[name])] != 1)  # nothing else touched
    assert all(torch.all(v == 1) for v in gs.skeleton_values())


@pytest.mark.parametrize(
    "model, culprit",
    [
        (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "Tanh"),
        (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)), "BatchNorm1d"),
        (nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2)), "grouped"),
    ],
)
def test_unsupported_models_are_refused_naming_the_module(model, culprit):
    for build in (GSpace, GModel, lambda m: GOptimizer(m, torch.optim.SGD, lr=0.1)):
        with pytest.raises(UnsupportedModelError, match=culprit):
            build(model)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)


def test_residual_connection_is_refused():
    with pytest.raises(UnsupportedModelError, match="residual"):
        GSpace(Residual())


def test_bare_parameters_must_form_a_linear_chain():
    with pytest.raises(ValueError, match="chain of Linear layers"):
        GOptimizer(make_case("cnn").model.parameters(), torch.optim.SGD, lr=0.1)
    model = straight_mlp()
    with pytest.raises(ValueError, match="forward order"):
        GOptimizer(list(model.parameters())[::-1], torch.optim.SGD, lr=0.1)


# ------------------------------------------------------------------------------------ gradients


def _loss_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: p.detach().requires_grad_(True) for k, p in model.named_parameters()}
    loss = nn.functional.cross_entropy(functional_call(model, params, (x,)), y)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def _thesis_gradients(model: nn.Sequential, dw: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """dL/dv per weight entry by Table 2.3 (2.1 when the skeleton weights are 1), with explicit loops.

    Straight net with the default skeleton: unit a of every hidden layer is fed by unit a of the
    previous layer (input a mod d for the first) and designated to unit a of the next (a mod K at the
    output). w_{s:p} is the product of the fixed skeleton weights on a path.
    """
    W = [model[2 * i].weight.detach() for i in range(4)]
    G = [dw[f"{2 * i}.weight"] for i in range(4)]
    d, K = W[0].shape[1], W[-1].shape[0]
    n = len(W)

    def target(layer: int, unit: int) -> int:  # designated target of `unit` (an input of W[layer])
        return unit % K if layer == n - 1 else unit

    def up(layer: int, unit: int) -> float:  # fixed weights from `unit` (an output of W[layer]) to the output
        out = 1.0
        for m in range(layer + 1, n):
            t = target(m, unit)
            out *= float(W[m][t, unit])
            unit = t
        return out

    def down(layer: int, unit: int) -> float:  # fixed weights from the first layer to `unit` (input of W[layer])
        return float(torch.prod(torch.stack([W[m][unit, unit] for m in range(1, layer)]))) if layer > 1 else 1.0

    dv = [torch.full_like(w, float("nan")) for w in W]
    psi = torch.zeros(W[0].shape[0], dtype=torch.float64)
    for layer in range(1, n):  # v_i: one non-skeleton weight w_i in a later layer
        for b in range(W[layer].shape[0]):
            for a in range(W[layer].shape[1]):
                if b == target(layer, a):
                    continue
                w_sp = down(layer, a) * up(layer, b)
                w_j = float(W[0][a, a % d])
                dv[layer][b, a] = G[layer][b, a] / (w_sp * w_j)
                psi[a] += dv[layer][b, a] * W[layer][b, a] * w_sp
    for b in range(W[0].shape[0]):  # v_j (skeleton path, free weight w_j) and v_h (first-layer w_h)
        w_sp = up(0, b)
        for a in range(d):
            dv[0][b, a] = (G[0][b, a] - psi[b]) / w_sp if a == b % d else G[0][b, a] / w_sp
    return dv


@pytest.mark.parametrize("skeleton_value", [1.0, None])
def test_gradient_matches_thesis_tables(skeleton_value):
    """Table 2.1 (skeleton weights 1) and Table 2.3 (the network's own skeleton weights)."""
    model = straight_mlp(seed=3, skeleton_value=skeleton_value)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (9,), generator=g)
    gs = GSpace(model)
    v = gs.coordinates()
    expected = _thesis_gradients(model, _loss_grads(model, x, y))
    leaf = v.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(functional_call(model, gs.weights(leaf), (x,)), y)
    autograd = gs.to_edges(torch.autograd.grad(loss, leaf)[0], fill=float("nan"))
    icr = gs.to_edges(gs.gradient(v, _loss_grads(model, x, y)), fill=float("nan"))
    for i, want in enumerate(expected):
        name = f"{2 * i}.weight"
        known = ~torch.isnan(want)
        assert torch.equal(known, ~torch.isnan(autograd[name]))
        assert rel(autograd[name][known], want[known]) < 1e-12
        assert rel(icr[name][known], want[known]) < 1e-12


@pytest.mark.parametrize("name", [*CASES, "custom"])
def test_gradient_is_the_inverse_chain_rule_everywhere(name):
    """grad_v L(w(v)) solves J^T grad_v = grad_w with J = dv/dw (any widths, biases, conv, skeleton)."""
    if name == "custom":
        torch.manual_seed(5)
        case = make_case("mlp_bias")
        case.model = mlp([5, 3, 6, 3], bias=True).double()
        designated = [torch.tensor([2, 0, 5]), torch.tensor([1, 1, 0, 2, 2, 1])]
        skeleton = Skeleton(designated, [torch.tensor([4, 0, 2]), torch.tensor([2, 1, 1, 0, 2, 0])])
    else:
        case, skeleton = make_case(name), None
    model = case.model
    gs = GSpace(model, skeleton)
    params = params_of(model)
    v = gs.coordinates()

    def loss_of(p):
        return case.loss_fn(functional_call(model, p, (case.X,)), case.y)

    gw = torch.func.grad(loss_of)(params)
    jac = torch.func.jacrev(gs.coordinates)(params)
    J = torch.cat([jac[k].reshape(gs.dim, -1) for k in params], dim=1)
    solution = torch.linalg.lstsq(J.T, torch.cat([gw[k].reshape(-1) for k in params]).unsqueeze(1)).solution[:, 0]
    plain = torch.func.grad(lambda u: loss_of(gs.weights(u, check=False)))(v)
    leaf = v.clone().requires_grad_(True)
    fused = torch.autograd.grad(loss_of(gs.weights(leaf, fused=True)), leaf)[0]
    icr = gs.layout.flatten(gs.gradient(v, gw))
    for g in (plain, fused, icr):
        assert rel(g, solution) < 1e-9


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skeleton_value", [1.0, None])
def test_structured_fast_paths_match_the_general_kernel(bias, skeleton_value):
    """Straight nets with the default skeleton replace the gathers and scatters by root with broadcasts,
    column sums and strided views; the general index-based kernel gives the same w(v) and gradients."""
    model = straight_mlp(seed=7, bias=bias, skeleton_value=skeleton_value)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    gs = GSpace(model)
    fast = gs._kernel()
    assert fast.columns and fast.root_step == (0, 6) and fast.block_cols == 4
    assert fast.unit_first == (skeleton_value == 1.0)
    assert fast.unit_scale == (skeleton_value == 1.0 and not bias)
    general = _Kernel(gs)
    general.columns, general.unit_scale, general.root_step, general.block_cols = False, False, None, 0
    general.unit_first = False
    v, dw = gs.coordinates(), _loss_grads(model, x, y)
    results = []
    for kernel in (fast, general):
        gs._kernel_cache = kernel
        leaf = v.clone().requires_grad_(True)
        weights = gs.weights(leaf, fused=True)
        (grad,) = torch.autograd.grad(nn.functional.cross_entropy(functional_call(model, weights, (x,)), y), leaf)
        results.append((weights, grad, gs.layout.flatten(gs.gradient(v, dw))))
    (w_fast, g_fast, icr_fast), (w_general, g_general, icr_general) = results
    for k in gs.names:  # v * (1 / root) against v * (scale / root): rounding only
        assert rel(w_fast[k], w_general[k]) < 1e-15
    assert rel(g_fast, g_general) < 1e-13 and rel(icr_fast, icr_general) < 1e-13


def test_gsgd_step_matches_explicit_update_rules():
    """One step equals eqs. (20)-(28) of the G-SGD paper (appendix 10.1), skeleton weights 1."""
    model = straight_mlp(seed=4, skeleton_value=1.0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(11, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (11,), generator=g)
    lr = 0.05
    dw = _loss_grads(model, x, y)
    W = [model[2 * i].weight.detach().clone() for i in range(4)]
    G = [dw[f"{2 * i}.weight"] for i in range(4)]
    d, n = W[0].shape[1], 4
    skeleton = GSpace(model).skeleton_masks()
    # (25)-(26): path ratio of the skeleton path through w_j = W1[j, j mod d].
    ratio = torch.ones(W[0].shape[0], dtype=torch.float64)
    for j in range(W[0].shape[0]):
        w_j = W[0][j, j % d]
        total = 0.0
        for layer in range(1, n):
            for b in range(W[layer].shape[0]):
                if not skeleton[f"{2 * layer}.weight"][b, j]:
                    w_i = W[layer][b, j]
                    v_i = w_i * w_j
                    delta_v = G[layer][b, j] * w_i / v_i  # (20)
                    total += delta_v * v_i / w_j
        ratio[j] = 1 - lr * (G[0][j, j % d] - total) / w_j
    expected = [w.clone() for w in W]
    for j in range(W[0].shape[0]):
        for a in range(d):
            if a == j % d:
                expected[0][j, a] = W[0][j, a] * ratio[j]  # (26)
            else:
                expected[0][j, a] = W[0][j, a] - lr * G[0][j, a]  # (23) with r = 1: v_h = w_h
    for layer in range(1, n):
        for b in range(W[layer].shape[0]):
            for a in range(W[layer].shape[1]):
                if skeleton[f"{2 * layer}.weight"][b, a]:
                    continue  # (28): w_k unchanged
                w_i, v_i = W[layer][b, a], W[layer][b, a] * W[0][a, a % d]
                expected[layer][b, a] = (w_i - lr * G[layer][b, a] * w_i**2 / v_i**2) / ratio[a]  # (27)
    opt = GOptimizer(model, torch.optim.SGD, lr=lr)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    gmodel = GModel(straight_mlp(seed=4, skeleton_value=1.0))
    nn.functional.cross_entropy(gmodel(x), y).backward()
    torch.optim.SGD(gmodel.parameters(), lr=lr).step()
    for i, want in enumerate(expected):
        assert rel(model[2 * i].weight.detach(), want) < 1e-12
        assert rel(gmodel.weights()[f"{2 * i}.weight"], want) < 1e-12


# ------------------------------------------------------------------------------------ training


def test_gmodel_parameters_are_coordinates_and_forward_equals_model():
    case = make_case("cnn")
    before = params_of(case.model)
    gmodel = GModel(case.model)
    assert [tuple(p.shape) for p in gmodel.parameters()] == [tuple(s) for s in gmodel.gspace.layout.shapes]
    assert sum(p.numel() for p in gmodel.parameters()) == gmodel.gspace.dim
    assert rel(gmodel(case.X), case.model(case.X)) < 1e-12
    opt = torch.optim.SGD(gmodel.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        case.loss_fn(gmodel(case.X), case.y).backward()
        opt.step()
    assert all(torch.equal(p, before[k]) for k, p in params_of(case.model).items())  # model untouched
    assert rel(gmodel.to_model()(case.X), gmodel(case.X)) < 1e-12


@pytest.mark.parametrize(
    "optimizer, options",
    [
        (torch.optim.SGD, {"lr": 0.02, "momentum": 0.9, "weight_decay": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-2}),
    ],
)
def test_skeleton_weights_never_change(optimizer, options):
    case = make_case("mlp_bias")
    model = gsgd_init_(case.model)
    masks = GSpace(model).skeleton_masks()
    start = params_of(model)
    start_loss = case.loss_fn(model(case.X), case.y).item()
    gmodel = GModel(model)
    opt_v = optimizer(gmodel.parameters(), **options)
    wrapped = copy.deepcopy(model)
    opt_w = GOptimizer(wrapped, optimizer, **options)
    for _ in range(100):
        for net, opt in ((gmodel, opt_v), (wrapped, opt_w)):
            opt.zero_grad()
            case.loss_fn(net(case.X), case.y).backward()
            opt.step()
    for weights in (gmodel.weights(), params_of(wrapped)):
        for name, mask in masks.items():
            assert torch.equal(weights[name][mask], start[name][mask])
    assert case.loss_fn(wrapped(case.X), case.y).item() < 0.5 * start_loss


def test_goptimizer_keeps_adam_state_and_matches_gmodel():
    case = make_case("mlp_nobias")
    model = gsgd_init_(case.model)
    gmodel = GModel(model)
    opt_v = torch.optim.Adam(gmodel.parameters(), lr=1e-2, betas=(0.8, 0.99), amsgrad=True)
    wrapped = copy.deepcopy(model)
    opt_w = GOptimizer(wrapped, torch.optim.Adam, lr=1e-2, betas=(0.8, 0.99), amsgrad=True)
    for _ in range(15):
        for net, opt in ((gmodel, opt_v), (wrapped, opt_w)):
            opt.zero_grad()
            case.loss_fn(net(case.X), case.y).backward()
            opt.step()
    state = opt_w.state[opt_w.coordinates[0]]
    assert int(state["step"]) == 15 and state["exp_avg"].shape == opt_w.coordinates[0].shape
    for k, w in gmodel.weights().items():
        assert rel(params_of(wrapped)[k], w) < 1e-10


def test_goptimizer_scheduler_closure_and_state_dict():
    case = make_case("mlp_bias")
    model = gsgd_init_(case.model)

    def train(net, opt, steps, scheduler=None):
        for _ in range(steps):
            opt.zero_grad()
            case.loss_fn(net(case.X), case.y).backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()

    wrapped = copy.deepcopy(model)
    opt = GOptimizer(wrapped, torch.optim.SGD, lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(wrapped, opt, 3, scheduler)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    saved, saved_weights = copy.deepcopy(opt.state_dict()), params_of(wrapped)
    train(wrapped, opt, 3)
    resumed = copy.deepcopy(model)
    opt2 = GOptimizer(resumed, torch.optim.SGD, lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved)
    assert all(rel(p, saved_weights[k]) < 1e-14 for k, p in params_of(resumed).items())
    train(resumed, opt2, 3)
    for k, p in params_of(resumed).items():
        assert rel(p, params_of(wrapped)[k]) < 1e-12

    lbfgs_model = copy.deepcopy(model)
    lbfgs = GOptimizer(lbfgs_model, torch.optim.LBFGS, lr=0.5, max_iter=4)
    gmodel = GModel(model)
    reference = torch.optim.LBFGS(gmodel.parameters(), lr=0.5, max_iter=4)
    for net, o in ((lbfgs_model, lbfgs), (gmodel, reference)):

        def closure(net=net, o=o):
            o.zero_grad()
            loss = case.loss_fn(net(case.X), case.y)
            loss.backward()
            return loss

        for _ in range(2):
            o.step(closure)
    for k, w in gmodel.weights().items():
        assert rel(params_of(lbfgs_model)[k], w) < 1e-10


def test_goptimizer_accepts_parameters_and_groups():
    model = straight_mlp(seed=6, bias=True, skeleton_value=1.0)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    bare, grouped = copy.deepcopy(model), copy.deepcopy(model)
    layers = list(grouped.parameters())  # weight and bias of four layers
    groups = [{"params": layers[:4], "lr": 0.1}, {"params": layers[4:]}]
    nets = {
        "bare": (bare, GOptimizer(bare.parameters(), torch.optim.SGD, lr=0.01)),
        "groups": (grouped, GOptimizer(groups, torch.optim.SGD, lr=0.01)),
    }
    reference = {}
    for key, lrs in (("bare", (0.01, 0.01)), ("groups", (0.1, 0.01))):
        gmodel = GModel(model)
        coords = list(gmodel.parameters())
        reference[key] = (
            gmodel,
            torch.optim.SGD([{"params": coords[:4], "lr": lrs[0]}, {"params": coords[4:]}], lr=0.01),
        )
    for net, opt in [*nets.values(), *reference.values()]:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    for key, (net, opt) in nets.items():
        assert len(opt.param_groups) == (1 if key == "bare" else 2)
        for k, w in reference[key][0].weights().items():
            assert rel(params_of(net)[k], w) < 1e-12


def test_singular_chain_is_a_clear_error():
    model = straight_mlp(seed=2)
    gs = GSpace(model)
    v = gs.coordinates()
    flipped = v.clone()
    flipped[2 * 5 + 2] *= -1  # the first-layer predecessor entry W1[2, 2] of unit 2
    with pytest.raises(GSpaceSingularityError, match="unit 2 of layer '0'.*changed sign"):
        gs.weights(flipped)
    flipped[2 * 5 + 2] = 0.0
    with pytest.raises(GSpaceSingularityError, match="is 0"):
        gs.weights(flipped)
    gmodel = GModel(model)
    with torch.no_grad():
        gmodel.coordinates[0][2, 2] *= -1
    with pytest.raises(GSpaceSingularityError):
        gmodel(torch.randn(2, 5, dtype=torch.float64))

    before = params_of(model)
    opt = GOptimizer(model, torch.optim.SGD, lr=1.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[0].weight.grad[2, 2] = 1e6 * torch.sign(model[0].weight[2, 2])  # pushes the chain through 0
    with pytest.raises(GSpaceSingularityError, match="not applied"):
        opt.step()
    assert all(torch.equal(p, before[k]) for k, p in params_of(model).items())
    assert rel(torch.cat([c.reshape(-1) for c in opt.coordinates]), gs.coordinates()) < 1e-12


def test_goptimizer_runs_step_hooks_and_profiles_its_step():
    model = gsgd_init_(straight_mlp(seed=1))
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    opt = GOptimizer(model, torch.optim.SGD, lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert calls == ["pre", "post"]
    with torch.profiler.profile() as prof:
        opt.step()
    assert "Optimizer.step#GOptimizer.step" in {event.name for event in prof.events()}


def test_goptimizer_writes_the_model_in_place_safely():
    """The model's later weights become views of the optimizer's weight buffer: a graph built before a
    step is refused as after any in-place update, resync and the next step turn changed designated
    weights back into a function-preserving rescaling, and a model whose tensors moved (.to()) gets
    copies instead."""
    model = gsgd_init_(straight_mlp(seed=3, bias=True))
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    opt = GOptimizer(model, torch.optim.SGD, lr=0.01)
    nn.functional.cross_entropy(model(x), y).backward()
    stale = nn.functional.cross_entropy(model(x), y)
    opt.step()
    with pytest.raises(RuntimeError, match="inplace"):
        stale.backward()
    masks = GSpace(model).skeleton_masks()
    with torch.no_grad():
        model[2].weight.mul_(3.0)  # changes designated entries too: a different function
    out = model(x)
    opt.resync()
    rescaled = opt.gspace.weights(opt.coordinates)
    assert rel(functional_call(model, rescaled, (x,)), out) < 1e-12
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.all(model[2].weight[masks["2.weight"]] == 1)
    model.float().double()  # new storage: no longer the optimizer's buffer
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # copies into the model's new tensors
    expected = opt.gspace.weights(opt.coordinates)
    assert all(rel(p, expected[k]) < 1e-15 for k, p in params_of(model).items())


def test_gmodel_backward_after_another_forward_pass():
    """GModel reuses one workspace: a pass whose backward comes after a later forward recomputes its own
    point from the saved coordinates, and refuses if they were modified in place meanwhile."""
    case = make_case("mlp_bias")
    gmodel, reference = GModel(case.model), GModel(case.model, fused=False)
    x2 = 0.5 * case.X.flip(0)
    for net in (gmodel, reference):
        (case.loss_fn(net(case.X), case.y) + case.loss_fn(net(x2), case.y)).backward()
    for p, q in zip(gmodel.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-12
    out = gmodel(case.X)
    gmodel(x2)
    with torch.no_grad():
        gmodel.coordinates[1].mul_(2.0)  # the first layer's bias coordinates
    with pytest.raises(RuntimeError, match="inplace"):
        case.loss_fn(out, case.y).backward()


def test_gmodel_functional_call_uses_the_given_coordinates():
    case = make_case("mlp_bias")
    gmodel = GModel(case.model)
    twin = random_rescale(case.model, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.1)  # another function
    other = GSpace(twin).coordinate_tensors()
    swapped = {f"coordinates.{k}": t for k, t in enumerate(other.values())}
    out = functional_call(gmodel, swapped, (case.X,))
    assert rel(out, GModel(twin)(case.X)) < 1e-12
    assert rel(gmodel(case.X), case.model(case.X)) < 1e-12  # its own coordinates again


def test_gmodel_can_be_copied():
    gmodel = GModel(gsgd_init_(straight_mlp(seed=5)))  # a straight net: its workspace holds views
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    twin = copy.deepcopy(gmodel)
    for net in (gmodel, twin):
        nn.functional.cross_entropy(net(x), y).backward()
        torch.optim.SGD(net.parameters(), lr=0.01).step()
    assert torch.equal(twin(x), gmodel(x))


def test_gmodel_follows_dtype_changes():
    """.float() replaces the coordinates' storage: GModel views them in one flat tensor again."""
    case = make_case("mlp_bias")
    model = gsgd_init_(case.model)
    gmodel, reference = GModel(model).float(), GModel(model, fused=False)
    x = case.X.float()
    assert rel(gmodel(x).double(), model(case.X)) < 1e-5
    case.loss_fn(gmodel(x), case.y).backward()
    case.loss_fn(reference(case.X), case.y).backward()
    for p, q in zip(gmodel.parameters(), reference.parameters()):
        assert p.dtype == torch.float32 and rel(p.grad.double(), q.grad) < 1e-5
    before = gmodel(x).detach()
    torch.optim.SGD(gmodel.parameters(), lr=0.01).step()
    assert not torch.equal(gmodel(x), before)  # the update reaches w(v)
    assert rel(gmodel.to_model()(x), gmodel(x)) < 1e-5


# ------------------------------------------------------------------------------------ sharpness


@pytest.mark.parametrize("name", CASES)
def test_gspace_sharpness_is_invariant_and_matches_dense_hessian(name):
    case = make_case(name)

    def measure(model):
        return invariant_sharpness(model, case.loss_fn, case.data, metric="gspace",
                                   solver=Solver(tol=1e-10), progress=False)

    result = measure(case.model)
    loss = GSpaceLoss(Objective(case.model, case.loss_fn, case.data))
    dense = torch.func.hessian(lambda v: loss.chunk_loss(v, case.X, case.y))(loss.point)
    assert result.value == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-8)
    for kind in ("node", "layer"):
        twin = random_rescale(case.model, kind, scale=1.0, generator=torch.Generator().manual_seed(7))
        assert measure(twin).value == pytest.approx(result.value, rel=1e-8)
    vector = result.parameter_vectors()[0]  # pushed forward to weight space: zero on the skeleton
    for k, mask in loss.gspace.skeleton_masks().items():
        assert torch.all(vector[k][mask] == 0)
    assert result.info["gspace_dim"] == loss.gspace.dim


def test_gspace_sharpness_depends_on_the_skeleton():
    case = make_case("mlp_nobias")
    obj = Objective(case.model, case.loss_fn, case.data)
    first = [torch.zeros(h, dtype=torch.long) for h in (7, 3, 4)]  # every unit designated to / fed by unit 0
    other = GSpace(case.model, Skeleton(first, first))
    values = []
    for gs in (GSpace(case.model), other):
        loss = GSpaceLoss(obj, gs)
        dense = torch.func.hessian(lambda v, loss=loss: loss.chunk_loss(v, case.X, case.y))(loss.point)
        values.append(float(torch.linalg.eigvalsh(dense)[-1]))
    assert abs(values[0] - values[1]) > 1e-3 * abs(values[0])


@pytest.mark.parametrize("hvp", ["jvp", "double_backward"])
@pytest.mark.parametrize("name", ["mlp_bias", "cnn"])
def test_gspace_sharpness_streaming_hvp_strategies_are_exact_and_invariant(name, hvp):
    """The per-chunk G-space products (``hvp="jvp"`` and ``"double_backward"``, data in several chunks of
    unequal size) give the dense Hessian's top eigenvalue and the same value after node-wise rescaling."""
    case = make_case(name)
    chunk_size = 5 if name == "cnn" else 10  # 11 samples -> 5+5+1, 23 -> 10+10+3

    def measure(model):
        objective = Objective(model, case.loss_fn, case.data, chunk_size=chunk_size)
        return GSpaceMeasure().sharpness(objective, 1, Solver(tol=1e-10, hvp=hvp), progress=False)

    result = measure(case.model)
    assert result.info["hvp_strategy"] == hvp
    loss = GSpaceLoss(Objective(case.model, case.loss_fn, case.data))
    dense = torch.func.hessian(lambda v: loss.chunk_loss(v, case.X, case.y))(loss.point)
    top = float(torch.linalg.eigvalsh(dense)[-1])
    assert result.value == pytest.approx(top, rel=1e-8)
    for seed in (7, 8):
        twin = random_rescale(case.model, "node", scale=1.0, generator=torch.Generator().manual_seed(seed))
        rescaled = measure(twin)
        assert rescaled.info["hvp_strategy"] == hvp
        assert rescaled.value == pytest.approx(result.value, rel=1e-8)


def test_gspace_jvp_products_under_a_mean_squared_error():
    """``MSELoss()`` (mean) under forward-over-reverse: torch divides the targets' tangent in place, which was
    "ZeroTensors are immutable" while the targets had none; now the dense Hessian's products, chunk by chunk."""
    case = make_case("mlp_mse_sum")
    loss = GSpaceLoss(Objective(case.model, nn.MSELoss(), case.data, chunk_size=4))
    dense = torch.func.hessian(lambda v: loss.chunk_loss(v, case.X, case.y))(loss.point)
    t = torch.randn(loss.point.shape, generator=torch.Generator().manual_seed(2), dtype=loss.point.dtype)
    torch.testing.assert_close(loss.hvp(t, "jvp"), dense @ t, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize(
    "build",
    [GModel, lambda m: GOptimizer(m, torch.optim.SGD, lr=0.1), lambda m: GOptimizer(m, torch.optim.Adam, lr=1e-3)],
    ids=["GModel", "GOptimizer-SGD", "GOptimizer-Adam"],
)
def test_residual_connection_is_refused_by_gmodel_and_goptimizer(build):
    model = Residual()
    before = params_of(model)
    with pytest.raises(UnsupportedModelError, match="residual"):
        build(model)
    assert all(torch.equal(p, before[k]) for k, p in params_of(model).items())  # refused before touching it


def test_default_initialization_points_to_gsgd_init():
    """From PyTorch's default initialization the chain values are tiny, so a G-SGD step crosses 0; the error
    says to start from the G-SGD initialization, after which the same step goes through."""
    torch.manual_seed(0)
    model = mlp([20, 16, 16, 16, 3]).double()
    x, y = torch.randn(32, 20, dtype=torch.float64), torch.randint(0, 3, (32,))

    def step(net):
        opt = GOptimizer(net, torch.optim.SGD, lr=0.5)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    with pytest.raises(GSpaceSingularityError, match=r"start from manifolds\.gsgd_init_\(model\)"):
        step(copy.deepcopy(model))
    step(gsgd_init_(copy.deepcopy(model)))


def test_init_gsgd_option_equals_gsgd_init_for_the_optimizer_the_module_and_bare_parameters():
    """``init="gsgd"`` starts GOptimizer (on a model or on bare parameters) and GModel from gsgd_init_'s weights:
    the same coordinates, and the same weights after one step, as gsgd_init_ followed by init="model"."""
    torch.manual_seed(1)
    model = mlp([20, 16, 16, 16, 3]).double()
    x, y = torch.randn(32, 20, dtype=torch.float64), torch.randint(0, 3, (32,))
    reference = gsgd_init_(copy.deepcopy(model))
    start = {k: p.detach().clone() for k, p in reference.named_parameters()}
    gspace_start = GSpace(reference).coordinates()

    def _model_of(net):
        return net.to_model() if isinstance(net, GModel) else net

    def one_step(net, opt):
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        return {k: p.detach().clone() for k, p in _model_of(net).named_parameters()}

    expected = one_step(reference, GOptimizer(reference, torch.optim.SGD, lr=0.5))
    on_model = copy.deepcopy(model)
    opt = GOptimizer(on_model, torch.optim.SGD, lr=0.5, init="gsgd")
    got = one_step(on_model, opt)
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-14)
    bare = copy.deepcopy(model)
    weights = [m.weight for m in bare if isinstance(m, nn.Linear)]
    biases = [m.bias for m in bare if isinstance(m, nn.Linear)]
    GOptimizer([t for pair in zip(weights, biases) for t in pair], torch.optim.SGD, lr=0.5, init="gsgd")
    for k, p in bare.named_parameters():  # the given tensors were initialized in place
        torch.testing.assert_close(p.detach(), start[k], rtol=0, atol=0)
    gmodel = GModel(model, init="gsgd")
    coords = GSpace(reference).layout.flatten(dict(zip(gmodel.gspace.layout.names, gmodel.coordinates)))
    torch.testing.assert_close(coords.detach(), gspace_start, rtol=0, atol=1e-15)
    for k, w in gmodel.weights().items():
        torch.testing.assert_close(w, start[k], rtol=1e-14, atol=1e-15)
    assert all(torch.all(v == 1) for v in gmodel.gspace.skeleton_values())
    assert not any(torch.equal(p, start[k]) for k, p in model.named_parameters() if p.dim() == 2)  # model untouched
    got = one_step(gmodel, torch.optim.SGD(gmodel.parameters(), lr=0.5))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match="init must be 'model' .* or 'gsgd'"):
        GModel(model, init="ones")
    with pytest.raises(ValueError, match="init must be 'model'"):
        GOptimizer(model, torch.optim.SGD, lr=0.1, init="one")
