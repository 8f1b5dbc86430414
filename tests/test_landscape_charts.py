"""Curved charts: exact loss at arbitrary points (evaluate_points), G-space planes w(v + a d1 + b d2)
and geodesic planes Exp_theta(a xi1 + b xi2) of invariant eigenvectors, checked in float64 against
per-point references and against node-/layer-wise rescaled twins of the same network."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cases import make_case
from test_landscape import _cli  # the command-line runner of the landscape tests
from torch import nn

import landscape
import manifolds
from landscape._directions import chain_root_mask
from landscape._settings import DirectionSpec
from landscape._surfaces import make_chart
from sharpness import Objective

# ---------------------------------------------------------------------------------------------
# evaluate_points


def _curved(obj: Objective, seed: int = 0):
    """A nonlinear point map (the node-wise exponential map along two random directions) and its directions."""
    theta = obj.layout.flatten(obj.params)
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(2, obj.layout.size, generator=g, dtype=torch.float64).to(obj.dtype) * theta.abs()
    return (lambda c: theta * torch.exp((c @ D) / theta)), theta, D


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
@pytest.mark.parametrize("name", ["mlp_bias", "cnn", "mlp_mse_sum"])
def test_evaluate_points_matches_a_per_point_value_loop(name, strategy):
    case = make_case(name)
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=5)  # several data chunks
    point_fn, _, _ = _curved(obj)
    coords = np.stack(np.meshgrid(np.linspace(-0.6, 0.6, 4), np.linspace(-0.4, 0.5, 3)), -1).reshape(-1, 2)
    values = landscape.evaluate_points(obj, point_fn, coords, strategy=strategy, batch=5, progress=False)
    assert values.strategy == strategy and values.batch == 5 and values.loss.shape == (12,)
    as_dict = landscape.evaluate_points(obj, lambda c: obj.layout.unflatten(point_fn(c)), coords, strategy=strategy,
                                        batch=5, progress=False)  # fmt: skip
    np.testing.assert_array_equal(as_dict.loss, values.loss)
    for i, c in enumerate(coords):
        ref = obj.evaluate(point_fn(torch.as_tensor(c)[None])[0])
        assert values.loss[i] == pytest.approx(ref["loss"], rel=1e-12, abs=1e-14)
        if "accuracy" in ref:
            assert values.accuracy[i] == ref["accuracy"]
    if "accuracy" not in obj.evaluate():
        assert values.accuracy is None


def test_evaluate_points_of_a_linear_map_equals_evaluate_grid_and_reuses_points():
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=4)  # 6 data chunks
    d = landscape.random_directions(obj.params, k=2, seed=1)
    theta = obj.layout.flatten(obj.params)
    calls = []

    def linear(c):
        calls.append(len(c))
        return theta + c @ d.vectors

    coords = np.stack(np.meshgrid(np.linspace(-1, 1, 5), np.linspace(-1, 1, 5)), -1).reshape(-1, 2)
    grid = landscape.evaluate_grid(obj, d.vectors, coords, strategy="first-layer", progress=False)
    points = landscape.evaluate_points(obj, linear, coords, batch=10, progress=False)
    np.testing.assert_allclose(points.loss, grid.loss, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(points.accuracy, grid.accuracy)
    assert calls == [10, 10, 5]  # points computed once per batch, kept for the later data chunks
    calls.clear()
    again = landscape.evaluate_points(obj, linear, coords, batch=10, memory_budget=1, progress=False)
    assert len(calls) == 3 * 6  # over the budget: recomputed for every data chunk, same values (to rounding:
    np.testing.assert_allclose(again.loss, points.loss, rtol=1e-13, atol=0)  # the budget joined no chunks)


def test_evaluate_points_refuses_bad_maps_and_strategies():
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data)
    n = obj.layout.size
    with pytest.raises(ValueError, match=rf"shape \(2, {n}\).*got \(2, {n - 1}\)"):
        landscape.evaluate_points(obj, lambda c: torch.zeros(len(c), n - 1), np.zeros((2, 2)), progress=False)
    with pytest.raises(ValueError, match="first-layer fast path needs a first layer that is linear"):
        landscape.evaluate_points(obj, lambda c: c, np.zeros((2, 2)), strategy="first-layer")
    point_fn, theta, D = _curved(obj)  # curved in the first layer too: the fast path must refuse it
    with pytest.raises(ValueError, match="first-layer parameters are not center"):
        landscape.evaluate_points(obj, point_fn, np.ones((2, 2)), first_layer=(theta, D), progress=False)
    with pytest.raises(ValueError, match=r"'0.bias' with shape \(2, 4\) for 2 grid points, got nothing"):
        landscape.evaluate_points(obj, lambda c: {"0.weight": torch.zeros(2, 4, 5)}, np.ones((2, 2)))
    with pytest.raises(ValueError, match="first_layer must be"):
        landscape.evaluate_points(obj, point_fn, np.ones((2, 2)), first_layer=(theta, D[:1]), progress=False)
    with pytest.raises(ValueError, match=r"coords must have shape \(P, k\)"):
        landscape.evaluate_points(obj, lambda c: c, np.zeros(3))


# ---------------------------------------------------------------------------------------------
# G-space planes


def _twin(model: nn.Module, kind: str = "node", seed: int = 5) -> nn.Module:
    return manifolds.random_rescale(model, kind=kind, scale=1.0, generator=torch.Generator().manual_seed(seed))


GSPACE_MODELS = {
    "mlp_bias": lambda: make_case("mlp_bias"),
    "mlp_nobias": lambda: make_case("mlp_nobias"),
    "cnn": lambda: make_case("cnn"),
}


def _chain_values(gs: manifolds.GSpace, weights: dict) -> list[torch.Tensor]:
    """Every hidden unit's chain value c, read off the weights: the product of the predecessor weights from the
    input to the unit (the value by which w(v) divides)."""
    masks, layers = gs.predecessor_masks(), [(la.weight, la.out_units) for la in gs.structure.layers][:-1]
    values, prev, prev_units = [], torch.ones(1, dtype=torch.float64), 1
    for name, units in layers:
        w, m = weights[name].reshape(units, prev_units, -1), masks[name].reshape(units, prev_units, -1)
        b, a, r = m.nonzero(as_tuple=True)
        assert torch.equal(b, torch.arange(units))  # one predecessor entry per unit
        prev, prev_units = w[b, a, r] * prev[a], units
        values.append(prev)
    return values


@pytest.mark.parametrize("roots", ["fixed", "free"])
@pytest.mark.parametrize("name", list(GSPACE_MODELS))
def test_gspace_plane_is_the_same_for_a_node_rescaled_twin(name, roots):
    case = GSPACE_MODELS[name]()
    twin = _twin(case.model)
    kw = dict(grid=landscape.Grid(span=0.5, steps=7), progress=False)
    spec = landscape.DirectionSpec("gspace", roots=roots, seed=3)
    s = landscape.loss_plane(case.model, case.loss_fn, case.data, spec, **kw)
    t = landscape.loss_plane(twin, case.loss_fn, case.data, spec, **kw)
    np.testing.assert_allclose(t.loss, s.loss, rtol=1e-10, atol=0)
    np.testing.assert_array_equal(t.extras["crossed"], s.extras["crossed"])
    assert s.metadata["roots"] == s.metadata["directions"]["roots"] == roots
    if roots == "free":
        return
    # the Euclidean filter-normalized planes of the same two networks are different surfaces
    e_s = landscape.loss_plane(case.model, case.loss_fn, case.data, landscape.DirectionSpec(seed=3), **kw)
    e_t = landscape.loss_plane(twin, case.loss_fn, case.data, landscape.DirectionSpec(seed=3), **kw)
    assert np.max(np.abs(e_t.loss - e_s.loss) / e_s.loss) > 1e-2
    # the centre is on the grid and has the model's loss
    exact = Objective(case.model, case.loss_fn, case.data).evaluate()
    i, j = s.center_index()
    assert s.loss[i, j] == pytest.approx(exact["loss"], rel=1e-12)
    assert s.accuracy[i, j] == exact["accuracy"]
    assert s.extras["crossed"][i, j] == 0
    meta = s.metadata
    assert meta["path"] == "gspace" and meta["directions"]["kind"] == "gspace"
    assert meta["directions"]["seeds"] == [3, 4] and meta["directions"]["normalization"] == "element"
    assert meta["crossed_points"] == int((s.extras["crossed"] > 0).sum())
    assert meta["strategy"] == "first-layer"  # the first layer of a G-space plane is linear in (a, b)


@pytest.mark.parametrize("name", ["mlp_bias", "mlp_nobias", "cnn"])
def test_gspace_fast_path_equals_the_loop(name):
    case = make_case(name)
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=4)
    chart = make_chart(obj, DirectionSpec("gspace", seed=2, bias="keep"), 2)
    coords = np.random.default_rng(0).uniform(-1, 1, size=(23, 2))
    fast = landscape.evaluate_points(obj, chart.point_fn, coords, first_layer=chart.first_layer, batch=6,
                                     progress=False)  # fmt: skip
    loop = landscape.evaluate_points(obj, chart.point_fn, coords, strategy="loop", progress=False)
    assert fast.strategy == "first-layer" and loop.strategy == "loop"
    np.testing.assert_allclose(fast.loss, loop.loss, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(fast.accuracy, loop.accuracy)


@pytest.mark.parametrize("name", list(GSPACE_MODELS))
def test_chain_root_mask_marks_exactly_the_coordinates_that_move_chain_values(name):
    case = GSPACE_MODELS[name]()
    gs = manifolds.GSpace(case.model)
    v = gs.coordinates().detach()
    mask = chain_root_mask(gs)
    first_units = gs.structure.layers[0].out_units  # every first-layer unit has a root, later units may share them
    assert mask.shape == (gs.dim,) and first_units <= int(mask.sum()) < gs.dim
    before = _chain_values(gs, gs.weights(v))
    for j in range(gs.dim):
        moved = v.clone()
        moved[j] *= 1.5
        after = _chain_values(gs, gs.weights(moved))
        changed = any(not torch.equal(x, y) for x, y in zip(before, after))
        assert changed == bool(mask[j]), j


@pytest.mark.parametrize("name", list(GSPACE_MODELS))
def test_gspace_default_plane_holds_every_chain_value_and_crosses_nothing(name):
    case = GSPACE_MODELS[name]()
    obj = Objective(case.model, case.loss_fn, case.data)
    gs = manifolds.GSpace(case.model, params=obj.params)
    chart = make_chart(obj, DirectionSpec("gspace", seed=3, bias="keep"), 2)
    mask = chain_root_mask(gs)
    assert torch.count_nonzero(chart.directions.vectors[:, mask]) == 0
    assert torch.count_nonzero(chart.directions.vectors[:, ~mask]) == 2 * int((~mask).sum())
    assert chart.directions.info["roots"] == "fixed" and chart.directions.info["fixed_coordinates"] == int(mask.sum())
    # every chain value at every grid point, far out too, is the centre's to the last bit (and the model's)
    coords = np.stack(np.meshgrid(np.linspace(-50, 50, 5), np.linspace(-50, 50, 5)), -1).reshape(-1, 2)
    points = chart.point_fn(torch.as_tensor(coords))
    center = _chain_values(gs, chart.point_fn(torch.zeros(1, 2)))
    for p, c in enumerate(coords):
        at = _chain_values(gs, {n: w[p] for n, w in points.items()})
        assert all(torch.equal(x, y) for x, y in zip(at, center)), c
    model = _chain_values(gs, obj.params)
    for x, y in zip(center, model):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=0)
    assert not chart.crossed(coords).any()
    for span in (0.5, 50.0):  # no singular line anywhere, unlike with the roots free
        s = landscape.loss_plane(case.model, case.loss_fn, case.data,
                                 directions=landscape.DirectionSpec("gspace", bias="keep"),
                                 grid=landscape.Grid(span=span, steps=5), progress=False)  # fmt: skip
        assert not s.extras["crossed"].any() and s.metadata["crossed_points"] == 0
        assert s.metadata["roots"] == "fixed" and np.all(np.isfinite(s.loss))
    free = landscape.loss_plane(case.model, case.loss_fn, case.data,
                                directions=landscape.DirectionSpec("gspace", bias="keep", roots="free"),
                                grid=landscape.Grid(span=50.0, steps=5), progress=False)  # fmt: skip
    assert free.metadata["crossed_points"] > 0


def test_gspace_plane_points_are_the_inverse_map_of_normalized_coordinate_directions():
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data)
    gs = manifolds.GSpace(case.model, params=obj.params)
    v = gs.coordinates(obj.params).detach()
    chart = make_chart(obj, DirectionSpec("gspace", seed=11, norm="layer", bias="keep"), 2)
    d = chart.directions
    assert d.vectors.shape == (2, gs.dim) and d.info["seeds"] == [11, 12]
    moved = (~chain_root_mask(gs)).to(v)
    for vec in d.vectors:  # ||d_B|| = ||v_B|| over the moved coordinates of every block (bias="keep": biases too)
        for (name, block), (_, ref), (_, keep) in zip(*(gs.layout.blocks(t) for t in (vec, v, moved))):
            assert float(block.norm()) == pytest.approx(float((ref * keep).norm()), rel=1e-12), name
    # roots="free": the old directions, each whole block scaled to ||v_B||, and the old points
    old = landscape.random_directions(gs.layout.unflatten(v), 2, seed=11, norm="layer", bias="keep")
    free = make_chart(obj, DirectionSpec("gspace", seed=11, norm="layer", bias="keep", roots="free"), 2)
    assert torch.equal(free.directions.vectors, old.vectors) and free.directions.info["roots"] == "free"
    coords = torch.tensor([[0.0, 0.0], [0.05, -0.02], [-0.03, 0.04]])
    for c, p in zip(coords, obj.layout.flatten(free.point_fn(coords))):
        torch.testing.assert_close(p, obj.layout.flatten(gs.weights(v + c @ old.vectors, check=False)), rtol=1e-15,
                                   atol=1e-15)  # fmt: skip
    # the default draws the same Gaussians (block by block, as random_directions), zeroes the roots, scales the rest
    for i, vec in enumerate(d.vectors):
        g = torch.Generator().manual_seed(11 + i)
        raw = torch.cat([torch.randn(len(b), generator=g, dtype=torch.float64) for _, b in gs.layout.blocks(v)])
        for (_, block), (_, r), (_, ref) in zip(*(gs.layout.blocks(t) for t in (vec, raw * moved, v * moved))):
            torch.testing.assert_close(block, r * (ref.norm() / r.norm()), rtol=1e-14, atol=0)
    # the default, norm="element": the same draws times |v_j|, zero on the roots
    relative = make_chart(obj, DirectionSpec("gspace", seed=11, bias="keep"), 2).directions
    assert relative.info["normalization"] == "element"
    for i, vec in enumerate(relative.vectors):
        g = torch.Generator().manual_seed(11 + i)
        raw = torch.cat([torch.randn(len(b), generator=g, dtype=torch.float64) for _, b in gs.layout.blocks(v)])
        torch.testing.assert_close(vec, raw * moved * v.abs(), rtol=1e-15, atol=0)
    zeroed = make_chart(obj, DirectionSpec("gspace", seed=11), 1).directions  # bias="zero": bias blocks stay put
    assert all(torch.count_nonzero(b) == 0 for n, b in gs.layout.blocks(zeroed.vectors[0]) if n.endswith("bias"))
    coords = torch.tensor([[0.0, 0.0], [0.05, -0.02], [-0.03, 0.04]])
    points = obj.layout.flatten(chart.point_fn(coords))
    for c, p in zip(coords, points):
        w = gs.weights(v + c @ d.vectors, check=False)
        torch.testing.assert_close(p, obj.layout.flatten(w), rtol=1e-15, atol=1e-15)
    assert torch.allclose(points[0], obj.layout.flatten(obj.params), rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(chart.crossed(coords.numpy()), [0, 0, 0])
    values = landscape.evaluate_points(obj, chart.point_fn, coords, progress=False)
    for i, p in enumerate(points):
        assert values.loss[i] == pytest.approx(float(obj.value(p)), rel=1e-12)


def test_gspace_marks_points_beyond_a_singularity_when_the_roots_move():
    case = make_case("mlp_bias")
    s = landscape.loss_line(case.model, case.loss_fn, case.data,
                            directions=landscape.DirectionSpec("gspace", roots="free"),
                            grid=landscape.Grid(span=3.0, steps=61), progress=False)  # fmt: skip
    crossed = s.extras["crossed"]
    assert crossed.shape == s.x.shape and crossed[s.center_index()] == 0
    assert crossed.max() >= 2  # far enough out, chain values of w(v) change sign
    # each root is linear along the line, so it crosses at most once: counts grow away from the centre
    j = s.center_index()[0]
    assert np.all(np.diff(crossed[j:]) >= 0) and np.all(np.diff(crossed[: j + 1]) <= 0)
    # a point is marked exactly when a chain root of its coordinates changed sign
    obj = Objective(case.model, case.loss_fn, case.data)
    chart = make_chart(obj, DirectionSpec("gspace", roots="free"), 1)
    gs = manifolds.GSpace(case.model, params=obj.params)
    v = gs.coordinates(obj.params).detach()
    for x, marked in zip(s.x, crossed):
        try:
            gs.check(v + x * chart.directions.vectors[0])
            assert not marked
        except manifolds.GSpaceSingularityError:
            assert marked
    held = landscape.loss_line(case.model, case.loss_fn, case.data, "gspace", grid=landscape.Grid(span=3.0, steps=61),
                               progress=False)  # fmt: skip
    assert not held.extras["crossed"].any() and held.metadata["roots"] == "fixed"


def test_gspace_refuses_unsupported_models_and_filter_normalization():
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)).double().eval()
    data = (torch.randn(6, 3), torch.randint(0, 2, (6,)))
    with pytest.raises(manifolds.UnsupportedModelError, match="GELU"):
        landscape.loss_plane(model, nn.CrossEntropyLoss(), data, directions=landscape.DirectionSpec("gspace"),
                             grid=landscape.Grid(steps=3), progress=False)
    case = make_case("mlp_bias")
    with pytest.raises(ValueError, match="per coordinate block"):
        landscape.loss_plane(case.model, case.loss_fn, case.data,
                             directions=landscape.DirectionSpec("gspace", norm="filter"), grid=landscape.Grid(steps=3))
    with pytest.raises(ValueError, match="not of gspace directions"):
        landscape.loss_plane(case.model, case.loss_fn, case.data,
                             directions=landscape.DirectionSpec("gspace", path="geodesic"),
                             grid=landscape.Grid(steps=3))


# ---------------------------------------------------------------------------------------------
# geodesic planes of invariant eigenvectors


@pytest.mark.parametrize(("name", "metric", "kind"), [("mlp_bias", "node", "node"), ("cnn", "node", "node"),
                                                      ("mlp_nobias", "layer", "layer")])  # fmt: skip
def test_geodesic_plane_is_the_same_for_a_rescaled_twin(name, metric, kind):
    case = make_case(name)
    twin = _twin(case.model, kind)
    kw = dict(directions=landscape.DirectionSpec("invariant-eigen", metric=metric, path="geodesic"),
              grid=landscape.Grid(span=0.5, steps=5), progress=False)  # fmt: skip
    s = landscape.loss_plane(case.model, case.loss_fn, case.data, **kw)
    t = landscape.loss_plane(twin, case.loss_fn, case.data, **kw)
    # the whitened Riemannian Hessians agree, so the solver finds the same eigenvectors (signs included)
    np.testing.assert_allclose(t.metadata["directions"]["eigenvalues"], s.metadata["directions"]["eigenvalues"],
                               rtol=1e-10)  # fmt: skip
    np.testing.assert_allclose(t.loss, s.loss, rtol=1e-10, atol=0)
    assert s.metadata["path"] == "geodesic" and s.metadata["path_metric"] == metric
    assert "geodesic" in s.title
    i, j = s.center_index()
    assert s.loss[i, j] == pytest.approx(s.metadata["center_loss"], rel=1e-14)


def test_geodesic_points_are_the_exponential_map_and_agree_with_straight_lines_to_first_order():
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data)
    chart = make_chart(obj, DirectionSpec("invariant-eigen", path="geodesic"), 2)
    theta, D = obj.layout.flatten(obj.params), chart.directions.vectors
    coords = torch.tensor([[0.3, -0.2], [-0.1, 0.4]])
    points = chart.point_fn(coords)
    torch.testing.assert_close(points, theta * torch.exp((coords @ D) / theta), rtol=1e-14, atol=0)
    quotient = manifolds.NodeScaleQuotient(obj.params, manifolds.analyze(case.model), obj.layout)
    for c, p in zip(coords, points):
        torch.testing.assert_close(p, quotient.expmap(c @ D), rtol=1e-14, atol=0)
    # zero weights stay zero along the geodesic (they have no log coordinate)
    zeroed = {k: v.clone() for k, v in obj.params.items()}
    zeroed["0.weight"][0, :2] = 0
    given = landscape.Directions(D, "invariant-eigen", ("a", "b"), {"metric": "node"})
    at_zero = make_chart(obj.with_params(zeroed), DirectionSpec(given, path="geodesic"), 2)
    moved = obj.layout.unflatten(at_zero.point_fn(coords))["0.weight"]
    assert torch.count_nonzero(moved[:, 0, :2]) == 0 and torch.all(torch.isfinite(moved))
    # Exp(t xi) = theta + t xi + t^2 xi^2 / (2 theta) + O(t^3)
    xi = D[0] + 0.5 * D[1]
    for t in (1e-2, 1e-3):
        gap = chart.point_fn(torch.tensor([[t, 0.5 * t]]))[0] - (theta + t * xi)
        rounding = 1e-14 * float(theta.abs().max()) / t**2  # cancellation in the gap
        torch.testing.assert_close(gap / t**2, xi**2 / (2 * theta), rtol=t * float((xi / theta).abs().max()),
                                   atol=rounding)  # fmt: skip
    # the losses along the two paths agree to first order: the gap shrinks like t^2, the loss change like t
    gaps, slopes = [], []
    for span in (1e-2, 5e-3):
        kw = dict(grid=landscape.Grid(span=span, steps=3), progress=False, objective=obj)
        geodesic = landscape.DirectionSpec("invariant-eigen", path="geodesic")
        curved = landscape.loss_line(None, None, None, geodesic, **kw)
        straight = landscape.loss_line(None, None, None, "invariant-eigen", **kw)
        gaps.append(abs(curved.loss[2] - straight.loss[2]))
        slopes.append(abs(straight.loss[2] - straight.loss[1]))
    assert gaps[0] / gaps[1] == pytest.approx(4.0, rel=0.05)
    assert gaps[0] < 0.05 * slopes[0]


def test_geodesic_path_needs_invariant_eigen_directions():
    case = make_case("mlp_bias")
    with pytest.raises(ValueError, match="invariant-eigen"):
        landscape.loss_plane(case.model, case.loss_fn, case.data, directions=landscape.DirectionSpec(path="geodesic"),
                             grid=landscape.Grid(steps=3))
    with pytest.raises(ValueError, match="unknown path"):
        landscape.loss_plane(case.model, case.loss_fn, case.data, directions=landscape.DirectionSpec(path="curly"),
                             grid=landscape.Grid(steps=3))


# ---------------------------------------------------------------------------------------------
# command line


def _common(tmp_path, model="mlp:6-5-4-3"):
    from sharpness._specs import build_model

    torch.manual_seed(0)
    ckpt = tmp_path / "tiny.pt"
    if model.startswith("mlp:"):
        torch.save(build_model(model).state_dict(), ckpt)
    return ["--model", model, "--checkpoint", str(ckpt), "--data", "synthetic:n=40,dim=6,classes=3", "--out",
            str(tmp_path / "out"), "--quiet", "--dtype", "float64", "--steps", "5"]  # fmt: skip


@pytest.mark.parametrize("extra", [["--directions", "gspace", "--span", "0.3"],
                                   ["--directions", "gspace", "--span", "0.3", "--roots", "free"],
                                   ["--directions", "invariant-eigen", "--path", "geodesic"]])  # fmt: skip
def test_cli_curved_planes_write_files_and_record_the_path(tmp_path, capsys, extra):
    code, stdout, err = _cli(["plane", *_common(tmp_path), *extra], capsys)
    assert code == 0, err
    assert stdout == ""
    out = tmp_path / "out"
    for name in ("plane.npz", "plane.json", "plane.png", "plane.html"):
        assert (out / name).stat().st_size > 0, name
    s = landscape.Surface.load(out / "plane")
    meta = json.loads((out / "plane.json").read_text())["metadata"]
    assert s.loss[s.center_index()] == pytest.approx(meta["center_loss"], rel=1e-12)
    if "gspace" in extra:
        assert meta["path"] == "gspace" and meta["directions"]["seeds"] == [0, 1]
        assert meta["directions"]["normalization"] == "element" and meta["gspace_dim"] == 6 * 5 + 5 * 4 + 4 * 3 - 9 + 12
        roots = "free" if "free" in extra else "fixed"
        assert meta["roots"] == meta["directions"]["roots"] == roots and f"chain roots {roots}" in s.title
        with np.load(out / "plane.npz") as f:
            assert f["crossed"].shape == (5, 5)
            assert roots == "free" or not f["crossed"].any()
    else:
        assert meta["path"] == "geodesic" and meta["path_metric"] == "node"
        assert meta["directions"]["kind"] == "invariant-eigen"


def test_cli_refuses_unsupported_models_and_misplaced_paths(tmp_path, capsys):
    factory = tmp_path / "gelu.py"
    factory.write_text("from torch import nn\n\ndef net():\n    return nn.Sequential(nn.Linear(6, 4), nn.GELU(), "
                       "nn.Linear(4, 3))\n")  # fmt: skip
    args = _common(tmp_path, f"{factory}:net")
    args[3] = str(tmp_path / "gelu.pt")
    torch.save(nn.Sequential(nn.Linear(6, 4), nn.GELU(), nn.Linear(4, 3)).state_dict(), args[3])
    cases = [
        [*args, "--directions", "gspace"],
        [*_common(tmp_path), "--directions", "random", "--path", "geodesic"],
        [*_common(tmp_path), "--directions", "gspace", "--norm", "filter"],
        [*_common(tmp_path), "--directions", "gspace", "--path", "geodesic"],
        [*_common(tmp_path), "--directions", "random", "--roots", "free"],
    ]
    for argv in cases:
        code, stdout, err = _cli(["plane", *argv], capsys)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        assert "Traceback" not in err and stdout == ""
        assert not (tmp_path / "out").exists()
    code, _, err = _cli(["plane", *cases[0]], capsys)
    assert "GELU" in err


def test_cli_problem_arguments_are_the_sharpness_ones(tmp_path, capsys):
    from landscape._cli import _parser as landscape_parser
    from sharpness._cli import _parser as sharpness_parser

    def options(parser, command):
        return {a.dest: a for a in parser._subparsers._group_actions[0].choices[command]._actions}

    ours = [options(landscape_parser(), c) for c in ("plane", "line", "fixed")]
    theirs = options(sharpness_parser(), "compute")
    for dest in ("model", "checkpoint", "data", "loss"):
        for o in ours:
            assert (o[dest].help, o[dest].required, o[dest].choices) == (
                theirs[dest].help, theirs[dest].required, theirs[dest].choices)  # fmt: skip
    assert all(o["dtype"].default == "float32" and "float32" in o["dtype"].help for o in ours)
    assert theirs["dtype"].default == "float64" and "float64" in theirs["dtype"].help  # sharpness keeps its own
    assert "--roots" in _cli(["plane", "--help"], capsys)[1]
    # real-valued targets need --loss mse, as in python -m sharpness
    data = tmp_path / "reg.npz"
    np.savez(data, X=np.random.default_rng(0).normal(size=(10, 6)), y=np.random.default_rng(1).normal(size=(10, 3)))
    args = _common(tmp_path)
    args[5] = str(data)
    code, _, err = _cli(["plane", *args], capsys)
    assert code == 2 and "--loss mse" in err
    code, _, err = _cli(["plane", *args, "--loss", "mse"], capsys)
    assert code == 0, err
    assert landscape.Surface.load(tmp_path / "out" / "plane").metadata["loss_function"] == "MSELoss"
