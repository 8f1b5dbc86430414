"""``python -m sharpness``: the documented outputs, and one clear sentence with exit code 2 (no traceback,
no output file) for every kind of bad input. Every case runs the real CLI in a subprocess."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from guards import HANG_GUARD_S
from safetensors.torch import save_file

from sharpness._specs import mlp

MODEL = "mlp:8-6-3"
DATA = "synthetic:n=20,dim=8,classes=3,seed=1"
FACTORY = """
from torch import nn

def gelu_net():
    return nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 3))

def not_a_module():
    return 3


def bn_net():
    return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.a(x).relu() + x)


def res_net():
    return Residual()


def raises():
    raise RuntimeError("no GPU here")


def exits():
    import sys

    sys.exit(0)
"""


def run_cli(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sharpness", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=HANG_GUARD_S,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = mlp([8, 6, 3])
    state = model.state_dict()
    torch.save(state, d / "model.pt")
    torch.save({"epoch": 3, "model_state_dict": state}, d / "wrapped.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    torch.save(model, d / "pickled_module.pt")
    with open(d / "arbitrary.pt", "wb") as fh:
        pickle.dump({"weights": slice(1, 2)}, fh)
    (d / "garbage.pt").write_bytes(b"this is not a checkpoint at all")
    torch.save({k: v for k, v in state.items() if k != "2.bias"}, d / "missing_key.pt")
    torch.save({**state, "9.weight": torch.zeros(2)}, d / "extra_key.pt")
    torch.save({**state, "0.weight": torch.zeros(5, 8)}, d / "bad_shape.pt")
    torch.save({**state, "0.bias": torch.full((6,), float("nan"))}, d / "nan_weights.pt")
    torch.save({**state, "0.bias": torch.zeros(6)}, d / "zero_bias.pt")
    X = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    y = np.arange(20) % 3
    np.savez(d / "good.npz", X=X, y=y)
    np.savez(d / "no_y.npz", X=X)
    np.savez(d / "short_y.npz", X=X, y=y[:5])
    np.savez(d / "bad_labels.npz", X=X, y=y + 5)
    np.savez(d / "empty.npz", X=X[:0], y=y[:0])
    np.savez(d / "text_labels.npz", X=X, y=np.array([f"class {i}" for i in y]))
    np.savez(d / "date_inputs.npz", X=np.full((20, 8), np.datetime64("2026-11-25")), y=y)
    torch.save({"X": torch.from_numpy(X), "y": (np.arange(20) % 3).tolist()}, d / "list_labels.pt")
    torch.save({"X": torch.from_numpy(X).to_sparse(), "y": torch.from_numpy(y)}, d / "sparse_inputs.pt")
    X_nan = X.copy()
    X_nan[3, 2] = np.nan
    np.savez(d / "nan_data.npz", X=X_nan, y=y)
    torch.save({"X": torch.from_numpy(X), "y": torch.from_numpy(y)}, d / "data.pt")
    (d / "factory.py").write_text(FACTORY)
    (d / "broken.py").write_text("def model(:\n")
    os.mkfifo(d / "pipe.pt")  # reading it would block for ever
    torch.save({**state, "0.bias": torch.full((6,), 1e300, dtype=torch.float64)}, d / "huge_float64.pt")
    namespace = {}
    exec(FACTORY, namespace)
    torch.save(namespace["bn_net"]().state_dict(), d / "bn.pt")
    torch.save(namespace["res_net"]().state_dict(), d / "res.pt")
    for name in ("gelu_net", "bn_net", "res_net"):
        net = namespace[name]()
        with torch.no_grad():  # off initialisation: no zero BatchNorm bias
            for p in net.parameters():
                p.add_(0.1 * torch.randn_like(p))
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(d / f"{name}.safetensors"))
    torch.save(mlp([784, 300, 100, 10]).state_dict(), d / "big.pt")
    return d


def test_help():
    for args in (["--help"], ["compute", "--help"], ["verify", "--help"], ["density", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "usage" in r.stdout


def test_compute_writes_the_documented_json(files, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli(
        "compute",
        "--model",
        MODEL,
        "--checkpoint",
        str(files / "model.pt"),
        "--data",
        DATA,
        "--metric",
        "all",
        "--k",
        "2",
        "--epsilon",
        "0.01",
        "--adaptive",
        "0.05",
        "--geodesic",
        "0.05",
        "--json",
        str(out),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    adaptive = report["adaptive"]
    assert set(adaptive) == {"l2", "linf", "average"} and adaptive["l2"]["rho"] == 0.05
    assert 0 < adaptive["l2"]["value"] <= adaptive["linf"]["value"]  # the l2 ball lies inside the l-infinity one
    assert adaptive["average"]["standard_error"] > 0 and "adaptive sharpness, rho = 0.05" in r.stdout
    geodesic = report["geodesic"]
    assert [g["order"] for g in geodesic.values()] == [2, 1] and geodesic["order2"]["value"] > 0
    assert geodesic["order2"]["eigenvalue"] == report["measures"]["node"]["value"]  # the node solve is reused
    assert geodesic["order2"]["metric"] == "node"  # auto: a ReLU network's group has no matrix factors
    assert "geodesic sharpness, rho = 0.05 (node metric" in r.stdout
    assert report["n_params"] == 8 * 6 + 6 + 6 * 3 + 3 and report["loss"] > 0
    assert report["model"] == MODEL and report["data"] == DATA and "torch" in report["versions"]
    for name in ("euclidean", "layer", "node"):
        m = report["measures"][name]
        assert len(m["eigenvalues"]) == 2 and m["value"] == m["eigenvalues"][0]
        assert m["converged"] is True and m["n_hvp"] > 0 and m["seconds"] >= 0
        assert m["epsilon"]["second_order"] > 0 and m["epsilon"]["measured"] >= 0 and m["epsilon"]["epsilon"] == 0.01
        assert m["measure"]["name"] == name and m["metric"] == name and m["tol"] == 1e-6 and m["residuals"]
    for name in ("fixed", "minnorm", "gspace"):  # no metric ball: the second-order estimate only
        m = report["measures"][name]
        assert m["epsilon"]["measured"] is None and m["epsilon"]["second_order"] > 0
    assert report["solver"] == {"method": "lanczos", "tol": 1e-6, "max_iter": None, "hvp": "auto", "seed": 0,
                                "start": "random"}
    assert "euclidean" in r.stdout and "node" in r.stdout


def test_small_memory_budget_streams_and_gives_the_same_measures(files, tmp_path):
    reports = {}
    for budget, method in (("2048", "lanczos"), ("0.001", "lanczos"), ("0.001", "low-memory-lanczos")):
        out = tmp_path / f"m{budget}{method}.json"
        r = run_cli(
            "compute", "--model", MODEL, "--checkpoint", str(files / "model.pt"), "--data", DATA,
            "--metric", "euclidean", "--metric", "node", "--memory-mib", budget, "--method", method,
            "--json", str(out), "--quiet",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        reports[budget, method] = json.loads(out.read_text())
    for name in ("euclidean", "node"):
        whole, streamed = reports["2048", "lanczos"]["measures"][name], reports["0.001", "lanczos"]["measures"][name]
        assert whole["hvp_strategy"] == streamed["hvp_strategy"] == "rop"  # kept state / recomputed per chunk
        assert streamed["value"] == pytest.approx(whole["value"], rel=1e-9)
        low = reports["0.001", "low-memory-lanczos"]["measures"][name]
        assert low["method"] == "low-memory-lanczos" and low["converged"]
        assert low["value"] == pytest.approx(whole["value"], rel=1e-9)


@pytest.mark.parametrize("checkpoint", ["wrapped.pt", "model.safetensors"])
def test_checkpoint_formats_agree(files, checkpoint, tmp_path):
    values = []
    for ckpt in ("model.pt", checkpoint):
        out = tmp_path / f"{ckpt}.json"
        r = run_cli(
            "compute",
            "--model",
            MODEL,
            "--checkpoint",
            str(files / ckpt),
            "--data",
            str(files / "good.npz"),
            "--metric",
            "node",
            "--json",
            str(out),
            "--quiet",
        )
        assert r.returncode == 0, r.stderr
        values.append(json.loads(out.read_text())["measures"]["node"]["value"])
    assert values[0] == pytest.approx(values[1], rel=1e-10)


def test_verify_passes_and_writes_report(files, tmp_path):
    out = tmp_path / "v.json"
    r = run_cli(
        "verify",
        "--model",
        MODEL,
        "--checkpoint",
        str(files / "model.pt"),
        "--data",
        str(files / "data.pt"),
        "--trials",
        "2",
        "--json",
        str(out),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr + r.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["verdicts"]["node"] == {"node": "invariant", "layer": "invariant"}
    assert report["verdicts"]["euclidean"]["node"] == "changes"


BAD_INPUTS = {
    "missing checkpoint": (["--checkpoint", "{d}/nope.pt"], "does not exist"),
    "checkpoint is a folder": (["--checkpoint", "{d}"], "folder"),
    "not a checkpoint": (["--checkpoint", "{d}/garbage.pt"], "not a PyTorch file"),
    "missing keys": (["--checkpoint", "{d}/missing_key.pt"], "keys is missing ('2.bias')"),
    "unexpected keys": (["--checkpoint", "{d}/extra_key.pt"], "keys is not in the model ('9.weight')"),
    "shape mismatch": (["--checkpoint", "{d}/bad_shape.pt"], "'0.weight': (5, 8) in the checkpoint"),
    "nan weights": (["--checkpoint", "{d}/nan_weights.pt"], "0.bias contains NaN"),
    "pickled module": (["--checkpoint", "{d}/pickled_module.pt"], "state_dict"),
    "arbitrary pickle": (["--checkpoint", "{d}/arbitrary.pt"], "never unpickled"),
    "nan data": (["--data", "{d}/nan_data.npz"], "NaN"),
    "data without y": (["--data", "{d}/no_y.npz"], "no y"),
    "X and y lengths": (["--data", "{d}/short_y.npz"], "20 samples but y has 5"),
    "labels out of range": (["--data", "{d}/bad_labels.npz"], "labels range over"),
    "empty data": (["--data", "{d}/empty.npz"], "empty"),
    "missing data file": (["--data", "{d}/nope.npz"], "does not exist"),
    "unknown model spec": (["--model", "resnet9000"], "unknown model spec"),
    "unknown factory": (["--model", "{d}/factory.py:nothing_here"], "no function 'nothing_here'"),
    "factory returns no module": (["--model", "{d}/factory.py:not_a_module"], "not an nn.Module"),
    "G-space of a non-chain": (
        ["--model", "{d}/factory.py:gelu_net", "--checkpoint", "{d}/model.pt", "--metric", "gspace"],
        "The node, layer, minnorm and euclidean measures remain available",
    ),
    "BatchNorm with gspace": (
        ["--model", "{d}/factory.py:bn_net", "--checkpoint", "{d}/bn.pt", "--metric", "gspace"],
        "module '1' (BatchNorm1d)",
    ),
    "residual with gspace": (
        ["--model", "{d}/factory.py:res_net", "--checkpoint", "{d}/res.pt", "--metric", "gspace"],
        "residual connection",
    ),
    "zero-norm tensor, layer metric": (["--checkpoint", "{d}/zero_bias.pt", "--metric", "layer"], "0.bias"),
    "unknown metric": (["--metric", "fancy"], "unknown metric 'fancy'"),
    "non-positive epsilon": (["--epsilon", "0"], "--epsilon must be positive"),
    "non-positive memory budget": (["--memory-mib", "0"], "--memory-mib must be a positive number"),
    "infinite memory budget": (["--memory-mib", "inf"], "--memory-mib must be a positive number"),
    "absurd memory budget": (["--memory-mib", "1e300"], "at most 1099511627776 (1 EiB)"),
    "negative tolerance": (["--tol", "-1"], "--tol must be a positive number"),
    "NaN tolerance": (["--tol", "nan"], "--tol must be a positive number"),
    "infinite epsilon": (["--epsilon", "inf"], "--epsilon must be positive"),
    "unknown device name": (["--device", "gpu"], "--device 'gpu' is not a device name"),
    "absent device": (["--device", "cuda:99"], "--device cuda:99"),
    "negative adaptive radius": (["--adaptive", "-0.1"], "--adaptive must be a positive and finite relative radius"),
    "infinite geodesic radius": (["--geodesic", "inf"], "--geodesic must be a positive and finite radius"),
    "unwritable output": (["--json", "/nonexistent-folder/out.json"], "cannot write"),
    "output is the checkpoint": (["--json", "{d}/model.pt"], "is one of the inputs"),
    "text labels in .npz": (["--data", "{d}/text_labels.npz"], "array y in"),
    "dates in .npz": (["--data", "{d}/date_inputs.npz"], "X and y must be numbers"),
    "a list in .pt data": (["--data", "{d}/list_labels.pt"], "is a list, not a tensor"),
    "sparse tensor in .pt data": (["--data", "{d}/sparse_inputs.pt"], "sparse"),
    "output is the data file": (["--data", "{d}/good.npz", "--json", "{d}/good.npz"], "is one of the inputs"),
    "output name too long": (["--json", "{d}/" + "x" * 300 + ".json"], "longer than the file system allows"),
    "output is a device": (["--json", "/dev/null"], "is not a regular file"),
    "checkpoint is a named pipe": (["--checkpoint", "{d}/pipe.pt"], "is not a regular file"),
    "factory raises": (["--model", "{d}/factory.py:raises"], "raised RuntimeError: no GPU here"),
    "factory calls sys.exit": (["--model", "{d}/factory.py:exits"], "called sys.exit(0)"),
    "model file does not parse": (["--model", "{d}/broken.py:model"], "raised SyntaxError"),
    "weights overflow in float32": (["--checkpoint", "{d}/huge_float64.pt", "--dtype", "float32"],
                                    "overflows in float32"),
    "model and data do not match": (["--data", "synthetic:n=5,dim=3"], "check that --model and --data match"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_sentence_and_exit_2(files, tmp_path, name):
    changes, expected = BAD_INPUTS[name]
    args = {"--model": MODEL, "--checkpoint": "{d}/model.pt", "--data": DATA, "--metric": "euclidean"}
    for flag, value in zip(changes[::2], changes[1::2]):
        args[flag] = value
    args = {flag: value.format(d=files) for flag, value in args.items()}
    out = tmp_path / "out.json"
    argv = ["compute", *[x for kv in args.items() for x in kv], "--quiet"]
    if "--json" not in args:
        argv += ["--json", str(out)]
    r = run_cli(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert expected in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith(".tmp")]
    assert all(Path(p).stat().st_size > 0 for p in (files / "model.pt", files / "good.npz"))  # inputs kept


@pytest.mark.parametrize("factory", ["gelu_net", "bn_net", "res_net"])
def test_metric_all_measures_what_applies_and_records_why_not(files, tmp_path, factory):
    """Residual, BatchNorm and GELU networks: every invariant measure runs; chain-only ones say why not."""
    out = tmp_path / "all.json"
    model = str(files / f"{factory}.safetensors")
    r = run_cli("compute", "--model", f"{files}/factory.py:{factory}", "--checkpoint", model, "--data", DATA,
                "--metric", "all", "--quiet", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    measures = json.loads(out.read_text())["measures"]
    for name in ("euclidean", "node", "minnorm"):
        assert measures[name]["value"] > 0, name
    for name in ("gspace", "fixed"):
        assert "defined for chains" in measures[name]["skipped"]
        assert "The node, layer, minnorm and euclidean measures remain available" in measures[name]["skipped"]
    assert re.search(r"^skipped \(\d\) fixed, gspace: needs a chain of layers; cannot build", r.stdout, re.M)


def test_resnet20_checkpoint_compute_and_verify(tmp_path):
    """The built-in CIFAR ResNet-20 with BatchNorm: saved by a test, measured and verified from the command line."""
    from sharpness.cli import resnet

    torch.manual_seed(0)
    model = resnet(20)
    with torch.no_grad():  # a checkpoint off initialisation: BatchNorm biases and statistics not trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
    save_file(model.state_dict(), str(tmp_path / "r20.safetensors"))
    data = "synthetic:n=4,shape=3x32x32,classes=10"
    common = ["--model", "resnet:20", "--checkpoint", str(tmp_path / "r20.safetensors"), "--data", data, "--quiet"]
    r = run_cli("compute", *common, "--metric", "node", "--metric", "euclidean", "--json", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["n_params"] == 272474
    assert report["measures"]["node"]["value"] > 0 and report["measures"]["node"]["converged"]
    r = run_cli("verify", *common, "--metric", "node", "--metric", "euclidean", "--trials", "1", "--kind", "node",
                "--json", str(tmp_path / "v.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    verdicts = json.loads((tmp_path / "v.json").read_text())
    assert verdicts["passed"], verdicts


def test_usage_errors_are_one_line():
    for args in (["compute"], ["compute", "--model", MODEL, "--k", "two"], ["nonsense"]):
        r = run_cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def _default_sigint():
    """``preexec_fn`` giving the child the default SIGINT disposition: a test run as a background job (``cmd &``
    in a script, ``setsid``) inherits SIGINT ignored, and Python keeps an inherited ``SIG_IGN``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_until(fd: int, marker: bytes) -> bytes:
    """What ``fd`` (a pty's master side) gives until ``marker`` has appeared, or until the writer closed it."""
    import select

    seen = b""
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], HANG_GUARD_S)
        assert ready, f"no {marker!r} from the program in an hour: {seen[-2000:]!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the writer closed its side
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_ctrl_c_is_one_word_and_exit_130(files, tmp_path):
    """Ctrl-C during the computation: the word ``interrupted``, exit code 130, no output file. The signal is sent
    when the program announces the computation (its first progress bar, drawn because stderr is a terminal: a
    pty), with the default SIGINT disposition whatever launched the tests."""
    import fcntl
    import pty
    import signal
    import struct
    import termios

    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column terminal shows no bar
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sharpness", "compute", "--model", "mlp:784-300-100-10", "--checkpoint",
             str(files / "big.pt"), "--data", "synthetic:n=3000,dim=784", "--metric", "all", "--k", "5", "--tol",
             "1e-12", "--json", str(out)],
            stdout=subprocess.DEVNULL, stderr=slave, env=env, preexec_fn=_default_sigint,
        )  # fmt: skip
        os.close(slave)
        seen = _read_until(master, b"lanczos")
        assert b"lanczos" in seen, f"the program ended before its first progress bar: {seen[-2000:]!r}"
        proc.send_signal(signal.SIGINT)
        seen += _read_until(master, b"\0")  # the rest, to the end
        code = proc.wait(timeout=HANG_GUARD_S)
    finally:
        os.close(master)
    text = seen.decode(errors="replace").replace("\r", "\n")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # the word ends the output, possibly on the line of a bar that the interruption left standing
    assert code == 130 and lines[-1].endswith("interrupted") and text.count("interrupted") == 1, (code, text[-2000:])
    assert "Traceback" not in text and "Error" not in text
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_verify_bad_arguments(files):
    base = ["verify", "--model", MODEL, "--checkpoint", str(files / "model.pt"), "--data", DATA, "--quiet"]
    cases = ((["--trials", "0"], "--trials"), (["--scale", "-1"], "--scale"), (["--scale", "inf"], "--scale"),
             (["--rtol", "nan"], "--rtol must be a positive number"), (["--rtol", "0"], "--rtol"))  # fmt: skip
    for extra, expected in cases:
        r = run_cli(*base, *extra)
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr


def test_density_writes_json_and_figure(files, tmp_path):
    out, fig = tmp_path / "d.json", tmp_path / "d.png"
    r = run_cli(
        "density", "--model", MODEL, "--checkpoint", str(files / "model.pt"), "--data", DATA,
        "--probes", "3", "--steps", "12", "--json", str(out), "--plot", str(fig), "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["n_probes"] == 3 and report["n_steps"] == 12 and report["n_hvp"] == 36
    assert len(report["nodes"]) == 3 and all(len(n) == 12 for n in report["nodes"])
    assert all(abs(sum(w) - 1.0) < 1e-6 for w in report["weights"])
    assert report["hvp_strategy"] == "rop" and report["model"] == MODEL and "torch" in report["versions"]
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean eigenvalue" in r.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--steps", "0"], "--steps must be at least 1"), (["--probes", "0"], "--probes must be at least 1"),
     (["--sigma", "-1"], "--sigma must be positive"), (["--sigma", "inf"], "--sigma must be positive"),
     (["--plot", "d.jpg"], "--plot must end in"), (["--plot", "d.json.png", "--json", "d.json.png"], "same file")],
)  # fmt: skip
def test_density_bad_input_is_one_sentence_and_no_file(files, tmp_path, extra, message):
    out = tmp_path / "d.json"
    r = run_cli("density", "--model", MODEL, "--checkpoint", str(files / "model.pt"), "--data", DATA,
                "--json", str(out), *extra, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not (tmp_path / "d.jpg").exists()



def test_density_refuses_names_that_are_not_utf8_before_anything_is_written(files, tmp_path):
    """A Latin-1 ``--plot`` name, or checkpoint name (drawn in the figure's title): one sentence, no file."""
    import shutil

    latin1 = os.fsencode(tmp_path) + b"/m\xe9.pt"
    shutil.copy(files / "model.pt", os.fsdecode(latin1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = ((str(files / "model.pt"), b"d\xe9.png", "--plot"), (latin1, b"d.png", "--checkpoint"))
    for checkpoint, plot, flag in cases:
        r = subprocess.run(
            [sys.executable, "-m", "sharpness", "density", "--model", MODEL, "--checkpoint", checkpoint, "--data", DATA,
             "--probes", "2", "--steps", "3", "--json", "d.json", "--plot", plot],
            capture_output=True, env=env, cwd=tmp_path, timeout=HANG_GUARD_S,
        )  # fmt: skip
        err = r.stderr.decode()
        assert r.returncode == 2 and err.startswith(f"error: {flag} '") and len(err.splitlines()) == 1, err
        assert "is not UTF-8 text" in err and "rename the file to a UTF-8 name" in err
        assert sorted(os.listdir(tmp_path)) == [b"m\xe9.pt".decode(errors="surrogateescape")]


def test_compute_whose_stdout_reader_left_writes_its_json_and_exits_141(files, tmp_path):
    """``| head -1`` made certain (the pipe's reading end closed before the command starts): the table is lost,
    the JSON written, exit code 141 as for a program ended by SIGPIPE, nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "sharpness", "compute", "--model", MODEL, "--checkpoint", str(files / "model.pt"),
             "--data", DATA, "--quiet", "--json", str(tmp_path / "c.json")],
            stdout=write, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=HANG_GUARD_S,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")
    assert json.loads((tmp_path / "c.json").read_text())["measures"]["node"]["value"] > 0


def test_atomic_writer_follows_links_and_refuses_what_it_would_replace(tmp_path):
    from sharpness.io import write_atomic

    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"  # the link stays a link, its target is written
    long_name = tmp_path / ("y" * 250)  # the temporary name does not grow with the final one
    write_atomic(long_name, b"bytes")
    assert long_name.read_bytes() == b"bytes"
    os.mkfifo(tmp_path / "pipe")
    for path in (tmp_path / "pipe", tmp_path):  # a pipe, a folder
        with pytest.raises(ValueError, match="is not a regular file"):
            write_atomic(path, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["target.json", "link.json", "y" * 250, "pipe"])


def _unprivileged():
    """``preexec_fn`` running a subprocess as the unprivileged user ``nobody`` when the tests run as root (for
    whom every folder is writable), or ``None`` when they already run unprivileged."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and no 'nobody' user to drop privileges to")

    def drop():
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import torch"], preexec_fn=drop, capture_output=True, timeout=HANG_GUARD_S
        )
    except OSError as err:
        pytest.skip(f"running as root, and the user 'nobody' cannot run this Python ({err.strerror})")
    if probe.returncode != 0:
        pytest.skip("running as root, and the user 'nobody' cannot import torch from this environment")
    return drop


def test_an_unwritable_output_folder_is_one_sentence_without_root(files):
    """Permission checks mean something only without root: the command runs as 'nobody' when the tests are root."""
    import shutil
    import tempfile

    preexec = _unprivileged()
    base = Path(tempfile.mkdtemp(prefix="relu-geometry-perm-"))
    try:
        base.chmod(0o755)
        for name in ("model.pt", "good.npz"):
            shutil.copy(files / name, base / name)
            (base / name).chmod(0o644)
        locked = base / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(base), "PYTHONDONTWRITEBYTECODE": "1"}
        argv = [sys.executable, "-m", "sharpness", "compute", "--model", MODEL, "--checkpoint",
                str(base / "model.pt"), "--data", str(base / "good.npz"), "--metric", "euclidean", "--quiet",
                "--json", str(locked / "r.json")]  # fmt: skip
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S, preexec_fn=preexec,
                           cwd=str(Path(__file__).resolve().parents[1]))  # fmt: skip
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.strip() == f"error: cannot write --json {locked / 'r.json'}: the folder {locked} does not " \
            "exist or is not writable"  # fmt: skip
        assert list(locked.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _degenerate_checkpoint(files, tmp_path, kind):
    """The 8-6-3 checkpoint with one pruned hidden unit (all incoming weights zero), a zero hidden layer, or
    every weight zero."""
    state = torch.load(files / "model.pt")
    if kind == "pruned":
        state["0.weight"][2] = 0.0
    elif kind == "zero_hidden":
        state["0.weight"].zero_(), state["0.bias"].zero_()
    else:
        state = {k: torch.zeros_like(v) for k, v in state.items()}
    torch.save(state, tmp_path / f"{kind}.pt")
    return str(tmp_path / f"{kind}.pt")


def test_a_network_without_symmetry_claims_no_invariance_and_has_nothing_to_verify(files, tmp_path):
    """GELU: the group has dimension 0, so no invariance is claimed, and verify exits 3 instead of 'passed'."""
    args = ["--model", f"{files}/factory.py:gelu_net", "--checkpoint", str(files / "gelu_net.safetensors"),
            "--data", DATA, "--quiet"]  # fmt: skip
    out = tmp_path / "c.json"
    r = run_cli("compute", *args, "--metric", "node", "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("node "))
    assert row.endswith("   nothing") and "rescaling group: 0 free node-wise scale(s)" in r.stdout
    assert "node: invariant under nothing here: this network's rescaling group has dimension 0" in r.stdout
    node = json.loads(out.read_text())["measures"]["node"]
    assert node["invariant_under"] == [] and node["group"]["dim"] == 0
    out = tmp_path / "v.json"
    r = run_cli("verify", *args, "--trials", "1", "--json", str(out))
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "nothing to verify" in r.stdout and "passed" not in r.stdout and not r.stderr
    report = json.loads(out.read_text())
    assert report["outcome"] == "nothing to verify" and report["passed"] is False and report["kinds"] == []
    assert "3 if there is nothing to verify" in " ".join(run_cli("verify", "--help").stdout.split())


def test_degenerate_points_skip_what_does_not_apply_and_count_what_was_left_out(files, tmp_path):
    """A pruned unit: `--metric all` and `verify` measure what applies and skip the rest with a short reason in
    the table and one sentence below it; a zero hidden layer: the node measure counts the parameters it drops."""
    pruned = _degenerate_checkpoint(files, tmp_path, "pruned")
    base = ["--model", MODEL, "--data", DATA, "--quiet"]
    out = tmp_path / "all.json"
    r = run_cli("compute", *base, "--checkpoint", pruned, "--metric", "all", "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    tag = next(line for line in lines if line.startswith("minnorm ")).split(None, 1)[1]  # "skipped (n)"
    assert re.fullmatch(r"skipped \(\d\)", tag), lines
    assert any(line.startswith(tag) and "minnorm: dead unit; the channel(s) output of module '0'" in line
               for line in lines)  # fmt: skip
    assert f"whole reasons: measures.NAME.skipped in {out}" in lines
    measures = json.loads(out.read_text())["measures"]
    assert measures["minnorm"]["skip_reason"] == "dead unit" and measures["node"]["value"] > 0
    assert measures["node"]["n_params"] == 75 and measures["node"]["n_dropped"] == 8
    for metric in ([], ["--metric", "all"]):
        r = run_cli("verify", *base, "--checkpoint", pruned, "--trials", "1", *metric)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "skipped: dead unit" in r.stdout and "passed: every claimed invariance holds" in r.stdout
    out = tmp_path / "node.json"
    r = run_cli("compute", *base, "--checkpoint", _degenerate_checkpoint(files, tmp_path, "zero_hidden"),
                "--metric", "node", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "21/75" in next(line for line in r.stdout.splitlines() if line.startswith("node "))
    assert "node: 54 of 75 parameters left out (0.weight, 0.bias): they are exactly zero" in r.stdout
    node = json.loads(out.read_text())["measures"]["node"]
    assert (node["n_params"], node["n_measured"], node["n_dropped"]) == (75, 21, 54)


def test_an_all_zero_checkpoint_keeps_the_euclidean_value(files, tmp_path):
    zero = _degenerate_checkpoint(files, tmp_path, "zero")
    base = ["--model", MODEL, "--checkpoint", zero, "--data", DATA, "--quiet"]
    out = tmp_path / "z.json"
    r = run_cli("compute", *base, "--json", str(out))
    assert r.returncode == 0, r.stderr
    measures = json.loads(out.read_text())["measures"]
    assert measures["euclidean"]["value"] > 0
    assert measures["node"]["skip_reason"] == "all parameters dropped"
    assert measures["layer"]["skip_reason"] == "zero-norm tensor"
    assert re.search(r"^skipped \(\d\) node: all parameters dropped; every parameter is exactly zero", r.stdout, re.M)
    assert f"whole reasons: measures.NAME.skipped in {out}" in r.stdout
    r = run_cli("compute", *base, "--metric", "node")  # asked for by name: it must apply
    assert r.returncode == 2 and r.stderr.startswith("error: every parameter is exactly zero"), r.stderr
    r = run_cli("verify", *base, "--trials", "1")
    assert r.returncode == 3 and "nothing to verify" in r.stdout, (r.stdout, r.stderr)


def test_geodesic_metric_auto_is_the_symmetry_metric_exactly_where_the_group_has_matrix_factors():
    from torch import nn

    from sharpness import Objective
    from sharpness._cli import _geodesic_metric
    from sharpness._specs import build_model

    torch.manual_seed(0)
    x, y = torch.rand(6, 64), torch.randint(0, 10, (6,))
    vit = Objective(build_model("vit:dim=8,heads=2,depth=1").eval(), nn.CrossEntropyLoss(), (x, y))
    relu = Objective(build_model("mlp:64-5-10").eval(), nn.CrossEntropyLoss(), (x, y))
    assert _geodesic_metric("auto", vit) == "symmetry"  # attention heads' GL(h) factors: node would leave them in
    assert _geodesic_metric("auto", relu) == "node"
    assert _geodesic_metric("layer", vit) == "layer"  # an explicit choice is kept
