"""The diagonal-network reproduction (Hide & Seek, Sec. 5.1.1 and Fig. 3) can fail: its quick run recomputes networks
of the committed population and compares them with the record, and its comparison fails when a value moves."""

import copy
import json

import torch
from test_examples import EXAMPLES, load_example

import manifolds

RECORD = EXAMPLES.parent / "docs" / "reproductions" / "diagonal_networks.json"


def test_the_group_discovery_finds_one_scaling_per_coordinate():
    """Written as the paper writes it, ``x @ (u * v)``, the product's ``(u_i, v_i) -> (a u_i, v_i / a)`` is found for
    every ``i``, and the output is unchanged under a random element."""
    example = load_example("diagonal_networks")
    g = torch.Generator().manual_seed(0)
    u, v, x = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((5,), (5,), (4, 5)))
    model = example.DiagonalNetwork.of(u.numpy(), v.numpy())
    structure = manifolds.analyze(model, x)
    assert structure.group.dim == 5 and structure.group.products == (
        ("u", "v", "product function 'mul' (graph node 'mul')"),
    )
    scale = float((x.abs() @ (u * v).abs()).max())  # rounding of the sums is relative to this
    assert torch.allclose(model(x), x @ (u * v)[:, None], rtol=0, atol=1e-14 * scale)
    moved = manifolds.random_rescale(model, "node", 1.0, torch.Generator().manual_seed(0), example_input=x)
    a = moved.u.detach() / model.u.detach()
    assert a.std() > 0.1 and torch.allclose(moved.v.detach() * a, model.v.detach(), rtol=1e-13)
    assert torch.allclose(moved(x), model(x), rtol=0, atol=1e-13 * scale)


def test_quick_check_recomputes_the_first_network_as_recorded():
    """What ``--quick`` does for each of its networks (train, measure, compare with the committed record), for
    network 0; the dense references it also runs are tests/test_reproduction_mutants.py's."""
    example = load_example("diagonal_networks")
    torch.set_num_threads(1)
    row = example.network_row(example.synthetic_data(), 0)
    checks = example.quick_checks([row], json.loads(RECORD.read_text()))
    assert len(checks) == 1 and checks[0]["check"].startswith("network 0 ") and checks[0]["passed"], checks


def test_quick_comparison_fails_when_a_recorded_value_moves_past_its_tolerance():
    example = load_example("diagonal_networks")
    record = json.loads(RECORD.read_text())
    row = record["networks"][0]
    assert all(c["passed"] for c in example.quick_checks([row], record))
    for key in ("geodesic", "adaptive", "test_loss", "node_top"):
        for factor, passes in ((2.0, False), (0.5, True)):
            moved = copy.deepcopy(row)
            moved[key] *= 1 + factor * example.QUICK_TOL
            assert [c["passed"] for c in example.quick_checks([moved], record)] == [passes], (key, factor)
    moved = copy.deepcopy(row)
    moved["steps"] += 1
    assert not example.quick_checks([moved], record)[0]["passed"]
