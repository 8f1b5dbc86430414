"""Every public measure, product, solver and grid on an accelerator equals its CPU result in float64 to 1e-8.

Each check runs on every device this machine has: ``cpu`` (where the comparison is with itself: it proves the
check runs) and ``cuda`` when a GPU is present, skipped with the reason otherwise.
"""

import copy

import numpy as np
import pytest
import torch
from cases import make_case
from distributed_ranks import tiny_resnet

import landscape
from sharpness import (
    HVP_STRATEGIES,
    MEASURES,
    HessianOperator,
    Objective,
    Rescalings,
    Solver,
    adaptive_sharpness,
    epsilon_sharpness,
    hutchinson_trace,
    measure_sharpness,
    spectral_density,
    verify_invariance,
)
from sharpness.products._objective import CPU_MEMORY_BUDGET, default_memory_budget

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU path is checked where one is")),
]  # fmt: skip
TOL = 1e-8
TIGHT = Solver(tol=1e-12)


def _objectives(problem: tuple, device: str, **options) -> tuple[Objective, Objective]:
    """The same problem on the CPU and on ``device`` (the model copied, the data left on the CPU: chunks move)."""
    model, loss_fn, data = problem
    on_cpu = Objective(model, loss_fn, data, **options)
    return on_cpu, Objective(copy.deepcopy(model).to(device), loss_fn, data, device=device, **options)


def _close(got, expected, what: str) -> None:
    got, expected = torch.as_tensor(got).double().cpu(), torch.as_tensor(expected).double().cpu()
    scale = max(float(expected.abs().max()), 1.0)
    assert float((got - expected).abs().max()) <= TOL * scale, (what, got, expected)


def _problem(name: str) -> tuple:
    if name == "resnet":
        return tiny_resnet()
    case = make_case(name)
    return case.model, case.loss_fn, case.data


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", ["mlp_bias", "cnn", "resnet"])
def test_products_on_the_device(device, problem):
    cpu, dev = _objectives(_problem(problem), device, chunk_size=4)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(cpu.layout.size, generator=g)
    _close(dev.value(), cpu.value(), "loss")
    _close(dev.gradient(), cpu.gradient(), "gradient")
    for strategy in HVP_STRATEGIES:
        if strategy == "rop" and cpu._rop is None:
            continue
        _close(dev.hvp(v.to(device), strategy), cpu.hvp(v, strategy), strategy)
    _close(dev.hvp_batch(v[None].repeat(2, 1).to(device)), cpu.hvp_batch(v[None].repeat(2, 1)), "batch")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MEASURES))
def test_every_measure_on_the_device(device, name):
    problem = _problem("resnet" if name in ("euclidean", "node") else "mlp_bias")
    cpu, dev = _objectives(problem, device, chunk_size=5)
    expected = measure_sharpness(None, None, None, name, k=2, solver=TIGHT, objective=cpu)
    got = measure_sharpness(None, None, None, name, k=2, solver=TIGHT, objective=dev)
    _close(got.eigenvalues, expected.eigenvalues, name)
    assert got.eigenvectors.device.type == torch.device(device).type


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["power", "low-memory-lanczos"])
def test_solvers_on_the_device(device, method):
    cpu, dev = _objectives(_problem("mlp_bias"), device)
    solver = Solver(method, tol=1e-12)
    _close(measure_sharpness(None, None, None, "layer", solver=solver, objective=dev).eigenvalues,
           measure_sharpness(None, None, None, "layer", solver=solver, objective=cpu).eigenvalues, method)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_trace_density_epsilon_and_adaptive_on_the_device(device):
    cpu, dev = _objectives(_problem("mlp_bias"), device)
    # probes drawn on the CPU for both, so the estimates are of the same vectors
    for obj in (cpu, dev):
        obj.trace = hutchinson_trace(HessianOperator(obj), n_probes=4, generator=torch.Generator().manual_seed(1))
        probes = torch.randn(2, obj.layout.size, generator=torch.Generator().manual_seed(2)).to(obj.device)
        obj.density = spectral_density(HessianOperator(obj), n_steps=6, probes=probes)
        obj.eps = epsilon_sharpness(None, None, None, 0.05, "node", steps=3, solver=TIGHT, objective=obj)
        obj.adaptive = adaptive_sharpness(None, None, None, 0.05, "l2", objective=obj)
    _close(dev.trace.estimate, cpu.trace.estimate, "trace")
    _close(torch.cat(dev.density.nodes), torch.cat(cpu.density.nodes), "density nodes")
    _close(torch.cat(dev.density.weights), torch.cat(cpu.density.weights), "density weights")
    _close(dev.eps.measured, cpu.eps.measured, "epsilon-sharpness")
    _close(dev.adaptive.value, cpu.adaptive.value, "adaptive sharpness")


@pytest.mark.parametrize("device", DEVICES)
def test_invariance_verification_on_the_device(device):
    model, loss_fn, data = _problem("mlp_bias")
    rescalings = Rescalings(trials=1)
    reports = [verify_invariance(copy.deepcopy(model).to(d), loss_fn, data, ["node", "layer"], rescalings=rescalings)
               for d in ("cpu", device)]  # fmt: skip
    assert reports[1].passed
    for name in ("node", "layer"):
        _close(reports[1].original[name], reports[0].original[name], name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["first-layer", "vmap", "loop"])
def test_grids_on_the_device(device, strategy):
    cpu, dev = _objectives(_problem("mlp_bias"), device, chunk_size=7)
    grid = landscape.Grid(span=0.5, steps=5, strategy=strategy)
    planes = [landscape.loss_plane(None, None, None, grid=grid, objective=obj, progress=False) for obj in (cpu, dev)]
    _close(planes[1].loss, planes[0].loss, strategy)
    np.testing.assert_array_equal(planes[1].accuracy, planes[0].accuracy)
    gspace = [landscape.loss_plane(None, None, None, "gspace", grid=grid, objective=obj, progress=False)
              for obj in (cpu, dev)]  # fmt: skip
    _close(gspace[1].loss, gspace[0].loss, f"G-space {strategy}")


def test_the_memory_budget_follows_the_device(monkeypatch):
    assert default_memory_budget(torch.device("cpu")) == CPU_MEMORY_BUDGET == 2 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * 2**30)
    assert default_memory_budget(torch.device("cuda", 0)) == 4 * 2**30  # half of 6 GiB free + 2 GiB cached
