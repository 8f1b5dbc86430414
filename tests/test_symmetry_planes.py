"""Loss planes along the symmetry quotient's eigenvectors and geodesics (transformers): the geodesic equation
integrated by RK4 against the node metric's closed-form exponential map and the second-order geodesic, planes
unchanged by an element of the whole group while Euclidean eigen-planes change, and the command line on the
built-in vision transformer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_landscape import _cli  # the command-line runner of the landscape tests
from test_transformer_verify import make

import landscape
import manifolds
from manifolds import GeodesicMap, Metric, MetricQuotient, node_metric
from sharpness import MEASURES, Objective
from sharpness.products._boundary import _math_attention


def test_rk4_geodesics_equal_the_node_metrics_closed_form_and_bound_their_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(30, generator=g, dtype=torch.float64)
    directions = torch.randn(2, 30, generator=g, dtype=torch.float64) * w.abs() * 0.2
    c = torch.tensor([[1.0, -1.0], [0.3, 0.7], [-0.5, 0.0], [0.0, 0.0]], dtype=torch.float64)
    exact = w * torch.exp((c @ directions) / w)  # Exp_w(xi) = w exp(xi / w) entry-wise
    batched = MetricQuotient(node_metric(), w).geodesic_map(directions, radius=1.0)
    assert batched.steps >= 16 and 0 < batched.error <= 1e-6
    assert f"RK4 on the geodesic equation with {batched.steps} steps" in batched.detail
    gap = float(torch.sqrt((((batched(c) - exact) / w) ** 2).sum(-1)).max())  # in the metric at w
    assert gap < 1e-8 and gap <= batched.error  # the estimate bounds the error (by about 15x)
    # the same metric point by point (vmap, no batched points): the same path
    plain = Metric(lambda p, xi: xi / (p * p), lambda p, v: v * p * p, name="node")
    looped = GeodesicMap(plain, w, directions, radius=1.0)
    assert looped.steps == batched.steps
    torch.testing.assert_close(looped(c), batched(c), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="do not converge with up to 8 RK4 steps"):
        GeodesicMap(node_metric(), w, directions, radius=1.0, max_steps=8)


def _transformer(seed=0):
    model, x, y = make(blocks=1, pre=True, hand=False, seed=seed)
    return model, x, y, Objective(model, torch.nn.CrossEntropyLoss(), (x, y))


def test_rk4_geodesic_of_the_symmetry_metric_agrees_with_the_second_order_geodesic_to_third_order():
    *_, obj = _transformer()
    quotient = MEASURES["symmetry"].quotient(obj)
    xi = quotient.proj_horizontal(torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1),
                                              dtype=torch.float64) * quotient.point.abs())  # fmt: skip
    xi = xi / quotient.norm(xi)
    ts = (0.2, 0.1, 0.05)
    ends = quotient.geodesic_map(xi[None], radius=ts[0])(torch.tensor(ts, dtype=torch.float64)[:, None])
    gaps = [float(quotient.norm(end - quotient.second_order_geodesic(xi, t))) for t, end in zip(ts, ends)]
    assert gaps[0] / gaps[1] == pytest.approx(8, rel=0.15) and gaps[1] / gaps[2] == pytest.approx(8, rel=0.1)
    straight = float(quotient.norm(ends[2] - quotient.point - 0.05 * xi))
    assert gaps[2] < 0.1 * straight  # the Christoffel term is there: the second-order path is much closer


def _planes(model, x, y):
    """Planes along the symmetry eigenvectors (geodesic and straight) and the Euclidean ones (tight solves)."""
    obj = Objective(model, torch.nn.CrossEntropyLoss(), (x, y))
    grid = landscape.Grid(span=0.6, steps=3)
    symmetry = landscape.eigen_directions(obj, 2, "symmetry", tol=1e-10)
    euclidean = landscape.eigen_directions(obj, 2, "euclidean", tol=1e-10)
    specs = {"geodesic": landscape.DirectionSpec(symmetry, path="geodesic"), "straight": landscape.DirectionSpec(
        symmetry), "euclidean": landscape.DirectionSpec(euclidean)}  # fmt: skip
    with _math_attention():
        return {key: landscape.loss_plane(None, None, None, spec, grid=grid, objective=obj, progress=False)
                for key, spec in specs.items()}  # fmt: skip


def test_symmetry_planes_are_unchanged_by_a_group_element_and_euclidean_ones_are_not():
    model, x, y, _ = _transformer()
    twin = manifolds.random_rescale(model, kind="group", generator=torch.Generator().manual_seed(3),
                                    example_input=x)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x), rtol=1e-10, atol=1e-12)
    a, b = _planes(model, x, y), _planes(twin, x, y)
    changed = 0.0
    for path in ("geodesic", "straight"):
        np.testing.assert_allclose(b[path].loss, a[path].loss, rtol=1e-8, atol=0)
        assert np.ptp(a[path].loss) > 1e-2  # the plane is not flat: the agreement says something
        changed = max(changed, float(np.max(np.abs(b[path].loss - a[path].loss))))
    euclidean = np.max(np.abs(b["euclidean"].loss - a["euclidean"].loss))
    assert euclidean > 1e-3 and euclidean > 1e4 * changed
    geodesic = a["geodesic"]
    assert geodesic.metadata["path_metric"] == "symmetry" and geodesic.metadata["geodesic_method"] == "rk4"
    assert geodesic.metadata["geodesic_steps"] == b["geodesic"].metadata["geodesic_steps"]
    assert "symmetry metric" in geodesic.title and "geodesic" in geodesic.title
    # the two paths leave the centre together (first order) and part at second order
    assert not np.allclose(geodesic.loss, a["straight"].loss, rtol=1e-6)


def test_cli_plane_of_the_vit_along_symmetry_geodesics(tmp_path, capsys):
    from sharpness._specs import build_model

    torch.manual_seed(0)
    ckpt, out = tmp_path / "vit.pt", tmp_path / "out"
    torch.save(build_model("vit:dim=2,heads=1,mlp=2").state_dict(), ckpt)
    common = ["--model", "vit:dim=2,heads=1,mlp=2", "--checkpoint", str(ckpt), "--data",
              "synthetic:n=12,dim=64,classes=10", "--dtype", "float64", "--quiet", "--directions", "invariant-eigen",
              "--path", "geodesic", "--steps", "3", "--span", "0.5"]  # fmt: skip
    code, stdout, err = _cli(["plane", *common, "--metric", "symmetry", "--out", str(out)], capsys)
    assert code == 0, err
    meta = json.loads((out / "plane.json").read_text())["metadata"]
    assert meta["path_metric"] == "symmetry" and meta["geodesic_steps"] >= 4 and meta["geodesic_error"] <= 1e-6
    assert "geodesics of the symmetry metric: RK4" in meta["path_detail"]
    for name in ("plane.npz", "plane.png", "plane.html"):
        assert (out / name).stat().st_size > 0, name
    s = landscape.Surface.load(out / "plane")
    assert s.loss[s.center_index()] == pytest.approx(meta["center_loss"], rel=1e-12)
    assert set(meta["directions"]["invariant_under"]) >= {"attention", "normalization"}
    # the layer metric is undefined at the fresh checkpoint's zero biases: one sentence, exit 2, nothing written
    code, stdout, err = _cli(["plane", *common, "--metric", "layer", "--out", str(tmp_path / "no")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "zero norm" in err and "Traceback" not in err
    assert not (tmp_path / "no" / "plane.npz").exists()
    code, stdout, _ = _cli(["plane", "--help"], capsys)
    assert code == 0 and "symmetry for any network" in " ".join(stdout.split())
