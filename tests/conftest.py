import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cases import CASE_NAMES, RESCALABLE_CASES, make_case, mlp  # noqa: E402
from torch import nn  # noqa: E402

from sharpness import Objective  # noqa: E402

# The test problems are tiny: thread hand-offs cost more than they save (and CI has 2 cores). The cores go to
# pytest-xdist's workers instead (pyproject.toml: -n auto).
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each holds its own torch, about 0.5 GB)."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.fixture(params=CASE_NAMES)
def case(request):
    return make_case(request.param)


@pytest.fixture(params=RESCALABLE_CASES)
def rescalable_case(request):
    return make_case(request.param)


@pytest.fixture(autouse=True)
def _float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def critical():
    """A regression MLP at an exact critical point: the targets are its own outputs, so the loss is 0.
    ``(model, loss, x, y, objective)``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 6, 2]).double().eval()
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
    loss = nn.MSELoss()
    obj = Objective(model, loss, (x, y))
    assert float(obj.gradient().norm()) == 0.0
    return model, loss, x, y, obj
