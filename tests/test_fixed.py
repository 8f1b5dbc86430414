"""Fixed weights (thesis ch. 3 and 6.3.1): FixModel, the +-b reparametrization, the fixed-weight
subspace, and the "fixed" sharpness."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from cases import RESCALABLE_CASES, make_case, mlp
from torch import nn
from torch.func import functional_call

from manifolds import (
    FixedWeightSpace,
    FixModel,
    UnsupportedModelError,
    analyze,
    layer_factors,
    random_factors,
    random_rescale,
    rescale_parameters,
    rescale_to_fixed_value,
)
from sharpness import (
    MEASURES,
    Fixed,
    Objective,
    Rescalings,
    Solver,
    dense_hessian,
    euclidean_sharpness,
    invariant_sharpness,
    verify_invariance,
)


class ReverseRegistered(nn.Module):
    """Layers registered last-to-first; the forward pass uses them first-to-last."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(4, 2)
        self.b = nn.Linear(6, 4)
        self.a = nn.Linear(3, 6)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def relative_output_difference(a, b, x):
    with torch.no_grad():
        out = a(x)
        return float((b(x) - out).abs().max() / out.abs().max())


def fixed_in_params(space, params):
    return torch.cat([params[e.weight].reshape(-1)[e.index] for e in space.entries])


def random_mlp(seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    widths = [int(w) for w in torch.randint(2, 9, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)]
    return mlp(widths, bias=bias).eval()


# ------------------------------------------------------------------------------------------------------
# selection and FixModel


@pytest.mark.parametrize("name", RESCALABLE_CASES)
def test_one_fixed_weight_per_hidden_unit_and_m_minus_h_free(name):
    model = make_case(name).model
    structure = analyze(model)
    fixed = FixModel(model)
    assert fixed.n_fixed == structure.n_hidden
    assert fixed.n_free == n_params(model) - structure.n_hidden
    assert sum(p.numel() for p in fixed.parameters()) == fixed.n_free
    mask = fixed.space.mask
    assert set(mask) == {layer.weight for layer in structure.layers[1:]}  # nothing in the first layer
    for layer, nxt in zip(structure.layers[:-1], structure.layers[1:]):
        per_unit = mask[nxt.weight].reshape(nxt.out_units, layer.out_units, -1).sum(dim=(0, 2))
        assert torch.equal(per_unit, torch.ones(layer.out_units, dtype=per_unit.dtype))


def test_diagonal_selection_unequal_widths_and_cnn():
    mask = FixedWeightSpace(make_case("mlp_bias").model).mask  # widths 5 4 6 3
    expected = torch.zeros(6, 4, dtype=torch.bool)
    expected[torch.arange(4) % 6, torch.arange(4)] = True
    assert torch.equal(mask["2.weight"], expected)
    expected = torch.zeros(3, 6, dtype=torch.bool)
    expected[torch.arange(6) % 3, torch.arange(6)] = True  # 6 units onto 3: rows reused, j mod 3
    assert torch.equal(mask["4.weight"], expected)

    mask = FixedWeightSpace(make_case("cnn").model).mask
    conv = torch.zeros(3, 2, 3, 3, dtype=torch.bool)
    conv[torch.arange(2) % 3, torch.arange(2), 1, 1] = True  # next conv's kernel centre
    assert torch.equal(mask["3.weight"], conv)
    flat = torch.zeros(4, 12, dtype=torch.bool)  # Linear after Flatten: 4 spatial columns per channel
    flat[torch.arange(3) % 4, torch.arange(3) * 4 + 2] = True  # the last conv's channels are fixed too
    assert torch.equal(mask["6.weight"], flat)
    assert mask["8.weight"].sum() == 4


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    ],
    ids=["sgd_momentum_wd", "adam_wd", "adamw"],
)
@pytest.mark.parametrize("name", ["mlp_bias", "cnn"])
def test_optimizers_never_move_fixed_weights(name, make_optimizer):
    case = make_case(name)
    fixed = FixModel(case.model, fixed_factor=True)
    before = fixed.fixed_values()
    start = fixed.plain_parameters()
    optimizer = make_optimizer(fixed.parameters())
    for _ in range(100):
        optimizer.zero_grad()
        case.loss_fn(fixed(case.X), case.y).backward()
        optimizer.step()
    assert torch.equal(fixed.fixed_values(), before)
    end = fixed.plain_parameters()
    assert torch.equal(fixed_in_params(fixed.space, end), before)  # the weights the forward pass uses
    assert torch.equal(before.abs(), torch.ones_like(before))
    free_moved = (fixed.space.free_vector(end) - fixed.space.free_vector(start)).abs()
    assert float(free_moved.min()) > 0  # every free entry trained (weight decay alone moves each)


def test_fix_model_twice_is_idempotent():
    model = make_case("cnn").model
    x = make_case("cnn").X
    once = FixModel(model, fixed_factor=0.7)
    twice = FixModel(once)
    assert [(k, p.shape) for k, p in twice.named_parameters()] == [(k, p.shape) for k, p in once.named_parameters()]
    assert all(len(m.parametrizations.weight) == 1 for m in twice.modules() if hasattr(m, "parametrizations"))
    assert torch.equal(twice.fixed_values(), once.fixed_values())
    assert all(torch.equal(twice.space.mask[k], v) for k, v in once.space.mask.items())
    assert torch.equal(twice(x), once(x))
    assert twice.n_free == once.n_free == n_params(model) - once.n_fixed
    # Re-fixing with a value changes the values only; another selection is refused.
    again = FixModel(once, fixed_factor=True, selection="diagonal")
    assert torch.equal(again.fixed_values(), once.fixed_values().sign())
    with pytest.raises(ValueError, match="another selection"):
        FixModel(once, selection="hungarian")
    with pytest.raises(ValueError, match="pass the FixModel itself"):
        FixModel(once.module)


@pytest.mark.parametrize("factor", [True, 1.0, 2.5, -0.5])
def test_fixed_factor_sets_sign_times_value(factor):
    model = make_case("mlp_nobias").model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    original = FixedWeightSpace(model).values
    fixed = FixModel(model, fixed_factor=factor)
    b = 1.0 if factor is True else factor
    assert torch.equal(fixed.fixed_values(), torch.where(original < 0, -1.0, 1.0) * b)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the model is untouched


def test_fixed_factor_false_keeps_values_and_function():
    case = make_case("mlp_bias")
    fixed = FixModel(case.model, fixed_factor=False)
    assert torch.equal(fixed.fixed_values(), FixedWeightSpace(case.model).values)
    assert torch.equal(fixed(case.X), case.model(case.X))


@pytest.mark.parametrize("factor", [0.0, math.nan, math.inf, "1"])
def test_bad_fixed_factor_is_refused(factor):
    with pytest.raises(ValueError, match="fixed_factor"):
        FixModel(make_case("mlp_bias").model, fixed_factor=factor)


def test_remove_returns_plain_model_with_current_values():
    case = make_case("cnn")
    fixed = FixModel(case.model, fixed_factor=True)
    optimizer = torch.optim.SGD(fixed.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        case.loss_fn(fixed(case.X), case.y).backward()
        optimizer.step()
    plain = fixed.remove()
    assert [type(m) for m in plain.modules()] == [type(m) for m in case.model.modules()]
    assert [k for k, _ in plain.named_parameters()] == [k for k, _ in case.model.named_parameters()]
    assert all(p.requires_grad for p in plain.parameters())
    current = fixed.plain_parameters()
    assert all(torch.equal(p, current[k]) for k, p in plain.named_parameters())
    assert torch.equal(plain(case.X), fixed(case.X))
    assert analyze(plain).rescalable and not analyze(fixed).rescalable  # fixing removes the symmetry


def test_layers_in_forward_order_not_registration_order():
    torch.manual_seed(0)
    model = ReverseRegistered().double()
    fixed = FixModel(model)
    mask = fixed.space.mask
    assert set(mask) == {"b.weight", "c.weight"}  # a's 6 units fixed in b, b's 4 units in c
    assert int(mask["b.weight"].sum()) == 6 and int(mask["c.weight"].sum()) == 4
    assert fixed.n_free == n_params(model) - 10
    x = torch.randn(9, 3)
    rep = rescale_to_fixed_value(model)
    assert relative_output_difference(model, rep.model, x) <= 1e-10
    assert torch.equal(fixed_in_params(rep.space, rep.params).abs(), torch.ones(10))


@pytest.mark.parametrize("activation", [nn.Sigmoid, nn.GELU])
def test_non_homogeneous_activation_is_refused(activation):
    case = make_case("mlp_bias")
    model = mlp([5, 4, 3], activation=activation).double().eval()
    label = re.escape(f"module '1' ({activation.__name__})")
    for call in (
        lambda: FixModel(model),
        lambda: FixedWeightSpace(model),
        lambda: rescale_to_fixed_value(model),
        lambda: invariant_sharpness(model, case.loss_fn, case.data, metric="fixed"),
    ):
        with pytest.raises(UnsupportedModelError, match=label):
            call()


def test_bad_selections_are_refused():
    model = make_case("mlp_bias").model
    mask = FixedWeightSpace(model).mask
    with pytest.raises(ValueError, match="unknown selection"):
        FixedWeightSpace(model, "random")
    double = dict(mask)
    double["4.weight"] = mask["4.weight"].clone()
    double["4.weight"][0, 1] = True  # unit 1 now has two fixed weights
    with pytest.raises(ValueError, match=r"units \[1\] have \[2\]"):
        FixedWeightSpace(model, double)
    with pytest.raises(ValueError, match="lacks '2.weight'"):
        FixedWeightSpace(model, {"4.weight": mask["4.weight"]})
    with pytest.raises(ValueError, match="holds no outgoing weights"):
        FixedWeightSpace(model, {**mask, "0.weight": torch.ones(4, 5, dtype=torch.bool)})
    with pytest.raises(ValueError, match="bool tensor of shape"):
        FixedWeightSpace(model, {**mask, "2.weight": mask["2.weight"].double()})


# ------------------------------------------------------------------------------------------------------
# reparametrization (thesis 6.3.1) and rescaling to +-b


@pytest.mark.parametrize("selection", ["diagonal", "hungarian"])
@pytest.mark.parametrize("value", [1.0, 0.3, 4.0])
@pytest.mark.parametrize("name", RESCALABLE_CASES)
def test_rescale_to_fixed_value_is_exact(name, value, selection):
    case = make_case(name)
    rep = rescale_to_fixed_value(case.model, value, selection)
    assert relative_output_difference(case.model, rep.model, case.X) <= 1e-10
    fixed = fixed_in_params(rep.space, rep.params)
    assert torch.equal(fixed, rep.space.signs * value)  # exactly +-b, signs kept
    assert torch.equal(fixed_in_params(rep.space, dict(rep.model.named_parameters())).detach(), fixed)
    # It is the node-wise rescaling by rep.factors (fixed entries written exactly, the rest untouched).
    params = {k: p.detach() for k, p in case.model.named_parameters()}
    rescaled = rescale_parameters(params, rep.space.structure, rep.factors)
    for k, v in rescaled.items():
        torch.testing.assert_close(rep.params[k], v, rtol=1e-14, atol=0)
    low, high = rep.factor_range
    assert 0 < low <= high < math.inf
    assert rep.max_log_factor == pytest.approx(max(abs(math.log(low)), abs(math.log(high))))


@pytest.mark.parametrize("seed", range(6))
def test_reparametrization_exact_on_random_mlps(seed):
    model = random_mlp(seed, bias=bool(seed % 2))
    x = torch.randn(13, model[0].in_features, generator=torch.Generator().manual_seed(seed))
    for selection in ("diagonal", "hungarian"):
        rep = rescale_to_fixed_value(model, 1.0, selection)
        assert relative_output_difference(model, rep.model, x) <= 1e-10
        assert torch.equal(fixed_in_params(rep.space, rep.params).abs(), torch.ones(rep.space.n_fixed))


@pytest.mark.parametrize("seed", range(8))
def test_hungarian_factors_no_wider_than_diagonal(seed):
    model = random_mlp(100 + seed)
    diagonal = rescale_to_fixed_value(model, 1.0, "diagonal")
    hungarian = rescale_to_fixed_value(model, 1.0, "hungarian")
    # Not a theorem across layers (each layer is matched given the later ones), but it holds on random
    # nets; for one hidden layer the sum of |log f| is provably no larger (next test).
    assert hungarian.max_log_factor <= diagonal.max_log_factor


@pytest.mark.parametrize("widths", [[4, 6, 3], [4, 3, 5], [3, 5, 5]])
def test_hungarian_minimizes_log_factors_for_one_hidden_layer(widths):
    torch.manual_seed(sum(widths))
    model = mlp(widths).double()
    diagonal = rescale_to_fixed_value(model, 1.0, "diagonal")
    hungarian = rescale_to_fixed_value(model, 1.0, "hungarian")
    assert float(hungarian.factors[0].log().abs().sum()) <= float(diagonal.factors[0].log().abs().sum()) + 1e-12


def test_representative_is_unique_on_the_orbit_but_hungarian_selection_is_gauge_dependent():
    case = make_case("cnn")
    rep = rescale_to_fixed_value(case.model)
    hungarian = FixedWeightSpace(case.model, "hungarian")
    changed = False
    for seed in range(3):
        twin = random_rescale(case.model, "node", generator=torch.Generator().manual_seed(seed))
        # The diagonal selection depends on shapes only: every copy lands on the same +-1 representative.
        twin_rep = rescale_to_fixed_value(twin)
        for k, v in rep.params.items():
            torch.testing.assert_close(twin_rep.params[k], v, rtol=1e-12, atol=1e-14)
        # The Hungarian selection reads the weights' scales, so a rescaled copy may fix other entries.
        other = FixedWeightSpace(twin, "hungarian").mask
        changed = changed or any(not torch.equal(other[k], m) for k, m in hungarian.mask.items())
    assert changed


def test_rescaling_a_parameter_dict_and_zero_fixed_weight():
    model = make_case("mlp_nobias").model
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    space = FixedWeightSpace(model)
    with pytest.raises(ValueError, match="needs space"):
        rescale_to_fixed_value(params)
    rep = rescale_to_fixed_value(params, 2.0, space=space)
    assert rep.model is None and torch.equal(fixed_in_params(space, rep.params), space.signs * 2.0)
    with pytest.raises(ValueError, match="positive"):
        rescale_to_fixed_value(params, -1.0, space=space)
    e = space.entries[1]
    params[e.weight].view(-1)[e.index[2]] = 0.0
    with pytest.raises(ValueError, match=r"units \[2\] of layer '2' are 0"):
        rescale_to_fixed_value(params, space=space)
    zeroed = mlp([5, 7, 3, 4, 2], bias=False).double()
    zeroed.load_state_dict(params)
    with pytest.raises(ValueError, match="are 0"):
        FixModel(zeroed)
    assert FixModel(zeroed, fixed_factor=True).fixed_values()[space.structure.hidden_units[0] + 2] == 1.0


# ------------------------------------------------------------------------------------------------------
# the fixed-weight subspace as a function of the free weights


def test_free_coordinates_round_trip_and_both_readings():
    case = make_case("cnn")
    params = {k: p.detach() for k, p in case.model.named_parameters()}
    space = FixedWeightSpace(case.model)
    free = space.free_vector(params)
    assert free.shape == (space.n_free,) and space.n_free == sum(p.numel() for p in params.values()) - 9
    back = space.params_from_free(free)
    assert all(torch.equal(back[k], v) for k, v in params.items())

    # (a) fixed weights set to b: the function changes with b.
    def loss(p):
        return case.loss_fn(functional_call(case.model, p, (case.X,)), case.y)

    values = {b: float(loss(space.params_from_free(free, b))) for b in (0.0, 0.5, 2.0)}
    assert len(set(values.values())) == 3
    assert torch.equal(space.fixed_vector(space.params_from_free(free, 0.5)), 0.5 * space.signs)

    # (b) function-preserving rescaling to +-b, then the same free coordinates reproduce it exactly.
    for b in (0.5, 2.0):
        rep = rescale_to_fixed_value(case.model, b)
        rebuilt = space.params_from_free(space.free_vector(rep.params), b)
        assert all(torch.equal(rebuilt[k], v) for k, v in rep.params.items())
        assert float(loss(rebuilt)) == pytest.approx(float(loss(params)), rel=1e-12)

    # A grid of points at once, differentiable in the free coordinates.
    grid = free + 0.01 * torch.randn(4, 3, space.n_free)
    batched = space.params_from_free(grid, 1.0)
    assert batched["6.weight"].shape == (4, 3, 4, 12)
    point = free.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(space.params_from_free(point, 1.0)), point)
    assert g.shape == free.shape and bool(g.ne(0).any())
    with pytest.raises(ValueError, match="free entries"):
        space.params_from_free(torch.zeros(3))


# ------------------------------------------------------------------------------------------------------
# the "fixed" sharpness


def fixed_reference(case):
    """eigvalsh of the free-free block of the dense Hessian at the +-1 representative."""
    rep = rescale_to_fixed_value(case.model)
    objective = Objective(case.model, case.loss_fn, case.data, params=rep.params)
    hessian = dense_hessian(objective)
    free = rep.space.free_positions
    return torch.linalg.eigvalsh(hessian[free][:, free])


@pytest.mark.parametrize("name", RESCALABLE_CASES)
def test_fixed_sharpness_matches_dense_reference(name):
    case = make_case(name)
    reference = fixed_reference(case)
    result = invariant_sharpness(case.model, case.loss_fn, case.data, metric="fixed", k=2, solver=Solver(tol=1e-12))
    assert result.converged and result.coordinates == "fixed"
    torch.testing.assert_close(result.eigenvalues, reference.flip(0)[:2], rtol=1e-8, atol=1e-10)
    assert result.info["n_fixed"] == analyze(case.model).n_hidden
    assert result.info["n_free"] == result.info["n_params"] - result.info["n_fixed"]
    assert 0 < result.info["factor_min"] <= result.info["factor_max"]
    free = rescale_to_fixed_value(case.model).space.free_mask
    assert float(result.eigenvectors[:, ~free].abs().max()) == 0.0
    # Cross-check through the parametrization: a FixModel of the representative trains the free block.
    rep = rescale_to_fixed_value(case.model)
    fixed = FixModel(rep.model, selection=rep.space.mask)
    euclid = euclidean_sharpness(fixed, case.loss_fn, case.data, solver=Solver(tol=1e-12))
    assert euclid.value == pytest.approx(float(reference[-1]), rel=1e-8)


@pytest.mark.parametrize("name", RESCALABLE_CASES)
def test_fixed_sharpness_invariant_under_rescaling(name):
    case = make_case(name)
    structure = analyze(case.model)
    original = invariant_sharpness(case.model, case.loss_fn, case.data, metric="fixed", solver=Solver(tol=1e-12)).value
    params = {k: p.detach() for k, p in case.model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    lambdas = [3.0, 0.25] + [1.0] * (len(structure.layers) - 3) + [4 / 3]
    for factors in (random_factors(structure, "node", 1.0, g), layer_factors(structure, lambdas)):
        objective = Objective(
            case.model, case.loss_fn, case.data, params=rescale_parameters(params, structure, factors)
        )
        value = invariant_sharpness(
            case.model, case.loss_fn, case.data, metric="fixed", solver=Solver(tol=1e-12), objective=objective
        ).value
        assert value == pytest.approx(original, rel=1e-8)
    euclidean = euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(tol=1e-10)).value
    twin = random_rescale(case.model, "node", generator=torch.Generator().manual_seed(7))
    assert euclidean_sharpness(twin, case.loss_fn, case.data,
                               solver=Solver(tol=1e-10)).value != pytest.approx(euclidean, rel=1e-2)


def test_fixed_metric_registered_and_verified():
    assert MEASURES["fixed"].invariant_under == ("node", "layer") and MEASURES["fixed"] == Fixed("diagonal")
    case = make_case("mlp_bias")
    report = verify_invariance(case.model, case.loss_fn, case.data, ("euclidean", "fixed"),
                               rescalings=Rescalings(trials=1), progress=False)  # fmt: skip
    assert report.passed
    for kind in ("node", "layer"):
        assert report.verdict("fixed", kind) == "invariant"


def test_network_without_hidden_units_has_nothing_to_fix():
    case = make_case("mlp_bias")
    model = nn.Sequential(nn.Linear(5, 3)).eval()
    fixed = FixModel(model, fixed_factor=True)
    assert fixed.n_fixed == 0 and fixed.n_free == n_params(model) and fixed.fixed_values().numel() == 0
    assert rescale_to_fixed_value(model).factor_range == (1.0, 1.0)
    value = invariant_sharpness(model, case.loss_fn, case.data, metric="fixed", solver=Solver(tol=1e-12)).value
    assert value == pytest.approx(euclidean_sharpness(model, case.loss_fn, case.data,
                                                      solver=Solver(tol=1e-12)).value, rel=1e-10)
