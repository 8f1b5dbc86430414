"""What the tests of the toolkit's decoder twins (`sharpness.GPTNeoX`, `OPT`, `Phi`, `GPTJ`) share: their fixtures
(a checkpoint transformers wrote, with an input and its logits, and its ``config.json``), and two checks alike: the
products are the R-operator's, and the command line reads a checkpoint with its ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sharpness import Objective, euclidean_sharpness
from sharpness._cli import main as sharpness_main

DATA = Path(__file__).parent / "data"


def load_fixture(stem: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The state dict of ``tests/data/STEM.safetensors``, and the input ids and logits stored beside it."""
    state = load_file(str(DATA / f"{stem}.safetensors"))
    return state, state.pop("__input_ids"), state.pop("__logits")


def fixture_config(stem: str) -> dict:
    """The fixture's ``config.json`` (``tests/data/STEM.json``)."""
    return json.loads((DATA / f"{stem}.json").read_text())


def check_r_operator_products(model: nn.Module, ids: torch.Tensor) -> None:
    """``"auto"`` picks the R-operator for next-token cross-entropy on ``ids``, and two of its products equal autograd's
    double backward to 1e-12 relative (``model``: logits ``(N, V, T)``, float64)."""
    obj = Objective(model, nn.CrossEntropyLoss(), (ids, torch.roll(ids, -1, dims=1)))
    assert obj.hvp_strategy() == "rop"
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        v = torch.randn(obj.layout.size, generator=g, dtype=torch.float64)
        ref = obj.hvp(v, "double_backward")
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def check_command_line(tmp_path: Path, capsys, state: dict, family: str, config: Path, model: nn.Module,
                       vocab: int = 29) -> None:  # fmt: skip
    """``compute --model FAMILY:config=PATH`` on the checkpoint ``state`` gives the library's Euclidean sharpness of
    ``model`` (the same twin, logits ``(N, V, T)``) to 1e-6; ``FAMILY:heads=2`` (no config) exits with 2 and one
    sentence naming ``FAMILY:config=PATH``, no traceback."""
    save_file(state, str(tmp_path / "model.safetensors"))
    X = torch.randint(0, vocab, (6, 7), generator=torch.Generator().manual_seed(0))
    np.savez(tmp_path / "tokens.npz", X=X.numpy(), y=torch.roll(X, -1, dims=1).numpy())
    out = tmp_path / "r.json"
    base = ["compute", "--checkpoint", str(tmp_path / "model.safetensors"), "--data", str(tmp_path / "tokens.npz"),
            "--metric", "euclidean", "--quiet"]  # fmt: skip
    assert sharpness_main([*base, "--model", f"{family}:config={config}", "--json", str(out)]) == 0
    data = (X, torch.roll(X, -1, dims=1))
    expected = euclidean_sharpness(model, nn.CrossEntropyLoss(), data, dtype=torch.float64, progress=False).value
    assert json.loads(out.read_text())["measures"]["euclidean"]["value"] == pytest.approx(expected, rel=1e-6)
    assert sharpness_main([*base, "--model", f"{family}:heads=2"]) == 2
    err = capsys.readouterr().err
    assert f"{family}:config=PATH" in err and "Traceback" not in err, err
