"""Data-parallel evaluation on 2 local processes (gloo): the same numbers as one process, refusals, failures."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from distributed_ranks import free_port, measurements, run_ranks
from guards import HANG_GUARD_S


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks("measurements")


def test_every_quantity_equals_the_single_process_result(two_ranks):
    single = measurements(None)
    for rank, (status, value) in two_ranks.items():
        assert status == "ok", f"process {rank}: {value}"
        assert value.keys() == single.keys()
        for name, expected in single.items():
            if name.startswith("unseeded_"):  # random draws of another process
                continue
            got = value[name]
            assert got.shape == expected.shape, name
            scale = max(float(expected.abs().max()), 1.0)
            assert float((got - expected).abs().max()) <= 1e-10 * scale, (name, got, expected)


def test_every_process_gets_the_same_bits(two_ranks):
    first, second = two_ranks[0][1], two_ranks[1][1]
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.fixture(scope="module")
def refusals():
    return run_ranks("refusals")


@pytest.mark.parametrize(
    "scenario, message",
    [
        ("too_small", "the data set has 1 sample but 2 processes share it"),
        ("other_data", "process 1 was given other data than process 0 (11 samples against 23)"),
        ("permuted_data", "process 1 was given other data than process 0 (the same 23 samples but other inputs or "
                          "another order)"),
        ("swapped_labels", "process 1 was given other data than process 0 (the same 23 samples but other targets or "
                           "another order)"),
        ("shuffled_loader", "the DataLoader shuffles (shuffle=True or a random sampler), so every pass"),
    ],
)
def test_bad_data_is_refused_on_every_process(refusals, scenario, message):
    for rank, (status, said) in refusals.items():
        assert status == "ok", (rank, status, said)
        assert said[scenario].startswith("DataError: ") and message in said[scenario], (rank, said[scenario])


def test_a_check_failing_in_one_share_fails_every_process(refusals):
    first, second = (refusals[rank][1]["bad_labels_in_one_share"] for rank in (0, 1))
    assert second.startswith("DataError: class labels range over [0, 7]")
    assert first == "ValueError: process 1: " + second.removeprefix("DataError: ")


def test_a_failing_process_is_reported_not_hung():
    # A collective timeout no run reaches: the message says the peer's exit was noticed, which is what tells it
    # from waiting the timeout out (no wall-clock bound, which a loaded machine could break).
    results = run_ranks("failing_rank", timeout=HANG_GUARD_S, deadline=HANG_GUARD_S)
    assert results[1] == ("error", "RuntimeError: the loss failed on purpose")
    status, value = results[0]
    assert status == "ok", results  # the scenario caught the DistributedError
    # whichever collective process 0 was in when process 1 stopped (a sum, or a broadcast of the next start vector)
    assert value["error"].startswith("process 0 of 2: ") and "failed because another process stopped" in value["error"]


def test_a_stalled_process_ends_the_run_at_the_timeout():
    results = run_ranks("stalled_rank", timeout=3, deadline=HANG_GUARD_S, wait_for=(0,))
    status, value = results[0]
    assert status == "ok", results
    assert "did not answer within the group's timeout" in value["error"]
    assert float(value["seconds"]) > 2.5  # not before the timeout (a lower bound: load only delays)


def _torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *args]  # fmt: skip
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from sharpness.cli import build_model

    folder = tmp_path_factory.mktemp("torchrun")
    torch.manual_seed(0)
    torch.save(build_model(MODEL).state_dict(), folder / "m.pt")
    return folder


MODEL, DATA = "mlp:12-8-3", "synthetic:n=29,dim=12,classes=3,seed=1"


def test_torchrun_compute_equals_one_process_and_writes_once(checkpoint):
    problem = ["--model", MODEL, "--checkpoint", "m.pt", "--data", DATA, "--quiet", "--tol", "1e-12",
               "--metric", "euclidean", "--metric", "node", "--metric", "gspace"]  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "sharpness", "compute", *problem, "--json", "one.json"],
                         cwd=checkpoint, capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = _torchrun(checkpoint, "-m", "sharpness", "compute", *problem, "--json", "two.json")
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("top eigenvalue") == 1 and "processes 2" in two.stdout  # one table, from process 0
    a, b = (json.loads((checkpoint / name).read_text()) for name in ("one.json", "two.json"))
    assert b["processes"] == 2 and b["n_samples"] == a["n_samples"] == 29
    for name, measure in a["measures"].items():
        assert b["measures"][name]["value"] == pytest.approx(measure["value"], rel=1e-10, abs=1e-12), name


def test_torchrun_plane_equals_one_process(checkpoint):
    problem = ["plane", "--model", MODEL, "--checkpoint", "m.pt", "--data", DATA, "--steps", "5", "--quiet",
               "--dtype", "float64"]  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "landscape", *problem, "--out", "one"], cwd=checkpoint,
                         capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = _torchrun(checkpoint, "-m", "landscape", *problem, "--out", "two")
    assert two.returncode == 0, two.stderr
    a, b = (np.load(checkpoint / folder / "plane.npz") for folder in ("one", "two"))
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-10, atol=0)
    np.testing.assert_array_equal(b["accuracy"], a["accuracy"])


def test_torchrun_bad_input_is_one_sentence_from_process_0(checkpoint):
    run = _torchrun(checkpoint, "-m", "sharpness", "compute", "--model", MODEL, "--checkpoint", "m.pt", "--data",
                    "synthetic:n=1,dim=12,classes=3,seed=1", "--quiet")  # fmt: skip
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: the data set has 1 sample but 2 processes share it; give at least one sample per "
                      "process or start fewer processes"]  # fmt: skip


def test_a_process_whose_data_file_is_missing_stops_every_process_in_one_sentence(checkpoint):
    """Process 1 alone cannot read its --data: every process stops at once (no process waits out the group's
    timeout), process 0 saying which process failed and why."""
    (checkpoint / "one_missing.py").write_text(
        "import os, sys\n"
        "from sharpness._cli import main\n"
        "argv = sys.argv[1:]\n"
        "if os.environ['RANK'] == '1':\n"
        "    argv[argv.index('--data') + 1] = 'missing.npz'\n"
        "sys.exit(main(argv))\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "one_missing.py", "compute", "--model", MODEL, "--checkpoint", "m.pt",
               "--data", DATA, "--quiet"]  # fmt: skip
    # The timeout only guards against a hang (before, the processes waited 30 minutes for each other).
    run = subprocess.run(command, cwd=checkpoint, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: process 1: data file missing.npz does not exist"], run.stderr
    assert "DistStoreError" not in run.stderr


def test_toy_and_demo_are_refused_under_torchrun(monkeypatch, tmp_path, capsys):
    from landscape._cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["toy", "--figure", "1.5", "--out", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == (
        "error: the toy command has no data set to share between processes; run it without torchrun\n"
    )
    assert not (tmp_path / "t").exists()


def test_a_numbered_gpu_is_refused_under_torchrun(monkeypatch):
    from sharpness._launch import process_device
    from sharpness.cli import SpecError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SpecError, match="names one GPU for every process; under torchrun pass --device cuda"):
        process_device(torch.device("cuda", 0))
    with pytest.raises(SpecError, match="started 2 processes on this machine but it has 1 CUDA device"):
        process_device(torch.device("cuda"))
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert process_device(torch.device("cuda")) == torch.device("cuda", 1) and chosen == [1]
    assert process_device(torch.device("cpu")) == torch.device("cpu")


def test_a_bad_timeout_is_one_sentence(checkpoint, capsys, monkeypatch):
    from sharpness._cli import main

    monkeypatch.chdir(checkpoint)
    code = main(["compute", "--model", MODEL, "--checkpoint", "m.pt", "--data", DATA, "--timeout", "0"])
    assert code == 2
    assert capsys.readouterr().err == "error: --timeout must be a positive number of seconds, got 0\n"


@pytest.mark.parametrize(
    "rank, joined, error, code, said",
    [
        (1, False, "bad input", 0, ""),  # before joining every process checks the same: process 0 says it
        (1, True, "bad input", 2, "error: process 1 of 2: bad input\n"),  # its own failure
        (1, True, "shared", 0, ""),  # raised on every process alike
        (0, True, "bad input", 2, "error: bad input\n"),
        (0, True, "peer", 1, "error: process 0 of 2: the peer stopped\n"),
        (1, True, "peer", 1, ""),  # the process that failed said why
    ],
)
def test_who_reports_what_under_torchrun(monkeypatch, capsys, rank, joined, error, code, said):
    import torch.distributed as dist

    import sharpness._cli as cli
    from sharpness import DistributedError
    from sharpness.products._distributed import shared

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(dist, "is_initialized", lambda: joined)
    monkeypatch.setattr(cli, "leave_processes", lambda: None)
    failure = {"bad input": ValueError("bad input"), "shared": shared(ValueError("shared")),
               "peer": DistributedError("process 0 of 2: the peer stopped")}[error]  # fmt: skip

    def command(args):
        raise failure

    assert cli.run_command(command, None) == code
    assert capsys.readouterr().err == said
