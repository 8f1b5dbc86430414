import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cases import CASE_NAMES, RESCALABLE_CASES, make_case  # noqa: E402

# The test problems are tiny: thread hand-offs cost more than they save (and CI has 2 cores).
torch.set_num_threads(1)


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
