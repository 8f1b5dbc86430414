"""Run a function on several local processes joined by a gloo ``torch.distributed`` group (for the tests).

:func:`run_ranks` spawns the processes on a free port, each calls ``scenario(rank)`` (a function of this
module, looked up by name, so the spawned interpreters can find it), and the results come back per rank as
``("ok", value)`` or ``("error", "ExceptionType: message")``. A process that neither answers nor ends within
``deadline`` seconds is killed and reported as ``("hung", None)``.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from cases import make_case  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, scenario: str, timeout: float, results) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        value = globals()[scenario](rank)
        if isinstance(value, dict):  # tensors by value (a shared-memory tensor dies with its process)
            value = {k: t.numpy() if isinstance(t, torch.Tensor) else t for k, t in value.items()}
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    scenario: str, world_size: int = 2, timeout: float = 30.0, deadline: float = 120.0, wait_for: tuple | None = None
) -> dict:
    """``{rank: (status, value)}`` of ``scenario`` run on ``world_size`` processes (collective ``timeout``); with
    ``wait_for``, only those ranks are waited for and the others are killed once they have answered."""
    wait_for = tuple(range(world_size)) if wait_for is None else wait_for
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, scenario, timeout, results))
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    found: dict = {}
    end = time.monotonic() + deadline
    while not all(r in found for r in wait_for) and time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=1.0)
            found[rank] = (status, value)
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    for rank, p in enumerate(processes):
        p.join(timeout=max(end - time.monotonic(), 1.0) if rank in wait_for else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    for status, value in found.values():
        if status == "ok" and isinstance(value, dict):
            value.update({k: torch.from_numpy(t) for k, t in value.items() if not isinstance(t, (int, float, str))})
    return {rank: found.get(rank, ("hung", None)) for rank in range(world_size)}


# ------------------------------------------------------------------------------------------------------
# scenarios: each runs on every process (rank) and, with rank None, in the test's own single process


def _distributed(rank: int | None) -> bool:
    return rank is not None


def tiny_resnet() -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A ResNet-8 with BatchNorm (running statistics moved off their defaults) on 13 samples of 2x8x8."""
    from sharpness._resnet import resnet

    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    model = resnet(8, 1, classes=3, in_channels=2).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
                m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=g))
    X = torch.randn(13, 2, 8, 8, generator=g)
    y = torch.randint(0, 3, (13,), generator=g)
    return model, nn.CrossEntropyLoss(), (X, y)


def measurements(rank: int | None) -> dict:
    """Loss, gradient, products by every strategy, top eigenvalues, a trace estimate, a density and a grid on an
    MLP with 23 samples (uneven shares: 12 and 11), and the products and measures of a residual network."""
    import landscape
    from sharpness import (
        HVP_STRATEGIES,
        HessianOperator,
        Objective,
        Solver,
        euclidean_sharpness,
        hutchinson_trace,
        invariant_sharpness,
        lanczos,
        measure_sharpness,
    )
    from sharpness.solvers import spectral_density

    distributed = _distributed(rank)
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data, chunk_size=5, distributed=distributed)
    g = torch.Generator().manual_seed(7)
    v = torch.randn(obj.layout.size, generator=g)
    vs = torch.randn(3, obj.layout.size, generator=g)
    out = {"loss": obj.value(), "gradient": obj.gradient(), "n_samples": obj.n_samples}
    out["value_and_gradient"] = torch.cat([t.reshape(-1) for t in obj.value_and_gradient()])
    out["evaluate"] = torch.tensor(list(obj.evaluate().values()))
    for strategy in HVP_STRATEGIES:
        out[f"hvp_{strategy}"] = obj.hvp(v, strategy)
        out[f"hvp_batch_{strategy}"] = obj.hvp_batch(vs, strategy)
    # the same data as a DataLoader of batches of 7: shares cut across batches
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(case.X, case.y), batch_size=7)
    batched = Objective(case.model, case.loss_fn, loader, distributed=distributed)
    out["loader_gradient"], out["loader_hvp"] = batched.gradient(), batched.hvp(v)
    added = torch.ones_like(v)
    obj.hvp(v, "rop", out=added)
    out["hvp_out"] = added
    tight = Solver(tol=1e-12)
    out["euclidean"] = euclidean_sharpness(None, None, None, k=2, solver=tight, objective=obj).eigenvalues
    out["node"] = invariant_sharpness(None, None, None, "node", solver=tight, objective=obj).eigenvalues
    out["node_power"] = invariant_sharpness(None, None, None, "node", solver=Solver("power", tol=1e-12),
                                            objective=obj).eigenvalues  # fmt: skip
    out["layer_low_memory"] = invariant_sharpness(None, None, None, "layer", solver=Solver("low-memory-lanczos",
                                                  tol=1e-12), objective=obj).eigenvalues  # fmt: skip
    for name in ("gspace", "fixed", "minnorm"):
        out[name] = measure_sharpness(None, None, None, name, solver=tight, objective=obj).eigenvalues
    op = HessianOperator(obj)
    out["trace"] = torch.tensor(hutchinson_trace(op, n_probes=6, generator=torch.Generator().manual_seed(1)).estimate)
    # Drawn from each process's own global random state (as in practice): only process 0's draw may count.
    torch.manual_seed(1000 + (rank or 0))
    out["unseeded_trace"] = torch.tensor(hutchinson_trace(op, n_probes=2).estimate)
    out["unseeded_lanczos"] = lanczos(op, k=1, tol=1e-12).eigenvectors
    density = spectral_density(op, n_probes=2, n_steps=5, generator=torch.Generator().manual_seed(2))
    out["density"] = torch.cat([torch.cat(density.nodes), torch.cat(density.weights)])
    grid = landscape.Grid(span=0.5, steps=5)
    out["plane"] = torch.as_tensor(landscape.loss_plane(None, None, None, grid=grid, objective=obj,
                                                        progress=False).loss)  # fmt: skip

    model, loss_fn, data = tiny_resnet()
    res = Objective(model, loss_fn, data, chunk_size=4, distributed=distributed)
    w = torch.randn(res.layout.size, generator=g)
    out["resnet_loss"] = res.value()
    out["resnet_gradient"] = res.gradient()
    for strategy in ("rop", "double_backward"):
        out[f"resnet_hvp_{strategy}"] = res.hvp(w, strategy)
    out["resnet_euclidean"] = euclidean_sharpness(None, None, None, solver=Solver(tol=1e-10),
                                                  objective=res).eigenvalues  # fmt: skip
    out["resnet_node"] = invariant_sharpness(None, None, None, "node", solver=Solver(tol=1e-10),
                                             objective=res).eigenvalues  # fmt: skip
    return {k: torch.as_tensor(t).detach().clone() for k, t in out.items()}


def too_small(rank: int | None) -> None:
    """One sample for two processes."""
    from sharpness import Objective

    case = make_case("mlp_bias")
    Objective(case.model, case.loss_fn, (case.X[:1], case.y[:1]), distributed=_distributed(rank))


def other_data(rank: int | None) -> None:
    """Process 1 is given only its own half of the data (as a DistributedSampler would)."""
    from sharpness import Objective

    case = make_case("mlp_bias")
    data = case.data if not rank else (case.X[12:], case.y[12:])
    Objective(case.model, case.loss_fn, data, distributed=_distributed(rank))


def permuted_data(rank: int | None) -> None:
    """Process 1 reads a row-permuted copy: the same samples, counts and sums, so its share overlaps process 0's."""
    from sharpness import Objective

    case = make_case("mlp_bias")
    order = torch.randperm(case.X.shape[0], generator=torch.Generator().manual_seed(0)) if rank else slice(None)
    Objective(case.model, case.loss_fn, (case.X[order], case.y[order]), distributed=_distributed(rank))


def swapped_labels(rank: int | None) -> None:
    """Process 1 has two (different) labels swapped: the same label counts and sums."""
    from sharpness import Objective

    case = make_case("mlp_bias")
    y = case.y.clone()
    if rank:
        i, j = 0, int((y != y[0]).nonzero()[0])
        y[i], y[j] = case.y[j], case.y[i]
    Objective(case.model, case.loss_fn, (case.X, y), distributed=_distributed(rank))


def shuffled_loader(rank: int | None) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from sharpness import Objective

    case = make_case("mlp_bias")
    loader = DataLoader(TensorDataset(case.X, case.y), batch_size=5, shuffle=True)
    Objective(case.model, case.loss_fn, loader, distributed=_distributed(rank))


def _solve_until_a_process_fails(rank: int, failure) -> dict:
    """A Lanczos solve in which process 1's loss calls ``failure()`` from its 4th call after the objective is built
    (its checks call the loss too); process 0 reports the error it gets and how long it took."""
    from sharpness import DistributedError, Objective, Solver, euclidean_sharpness

    case = make_case("mlp_bias")
    calls = [0, False]  # the solve's calls, whether the solve has started

    def loss(out, y):
        calls[0] += calls[1]
        if rank == 1 and calls[0] > 3:
            failure()
        return case.loss_fn(out, y)

    obj = Objective(case.model, loss, case.data, chunk_size=5, distributed=True)
    calls[1] = True  # counted from here
    start = time.monotonic()
    try:
        euclidean_sharpness(None, None, None, solver=Solver(hvp="jvp", tol=1e-14), objective=obj)
    except DistributedError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": "", "seconds": time.monotonic() - start}


def _raise() -> None:
    raise RuntimeError("the loss failed on purpose")


def failing_rank(rank: int) -> dict:
    return _solve_until_a_process_fails(rank, _raise)


def stalled_rank(rank: int) -> dict:
    return _solve_until_a_process_fails(rank, lambda: time.sleep(60))


def bad_labels_in_one_share(rank: int | None) -> None:
    """A label out of range in process 1's share only: its first batch fails the target check there."""
    from sharpness import Objective

    case = make_case("mlp_bias")
    y = case.y.clone()
    y[-1] = 7  # three classes
    Objective(case.model, case.loss_fn, (case.X, y), chunk_size=20, distributed=_distributed(rank))


def refusals(rank: int | None) -> dict:
    """Every refusal above in turn (one group for all: each is raised on every process, so they stay in step),
    as ``{scenario: "ExceptionType: message"}``."""
    said = {}
    for scenario in (too_small, other_data, permuted_data, swapped_labels, shuffled_loader,
                     bad_labels_in_one_share):
        try:
            scenario(rank)
            said[scenario.__name__] = ""
        except Exception as exc:  # noqa: BLE001 - reported to the test
            said[scenario.__name__] = f"{type(exc).__name__}: {exc}"
    return said
