"""The whole-data-set objective and its exact products: the loss, gradient and Hessian-vector products of a
model over all its data (chunked, exactly weighted), and symmetric operators built on them."""

from sharpness.products._data import ChunkedData as ChunkedData
from sharpness.products._data import DataError as DataError
from sharpness.products._distributed import Communicator as Communicator
from sharpness.products._distributed import DistributedError as DistributedError
from sharpness.products._folded import fold_batch_norms as fold_batch_norms
from sharpness.products._heap import retain_freed_memory as retain_freed_memory
from sharpness.products._hessian import HessianOperator as HessianOperator
from sharpness.products._objective import HVP_STRATEGIES as HVP_STRATEGIES
from sharpness.products._objective import Objective as Objective
from sharpness.products._objective import build_objective as build_objective
from sharpness.products._objective import eval_mode as eval_mode
from sharpness.products._operator import CallableOperator as CallableOperator
from sharpness.products._operator import DenseOperator as DenseOperator
from sharpness.products._operator import SymmetricOperator as SymmetricOperator
from sharpness.products._reference import dense_gspace_hessian as dense_gspace_hessian
from sharpness.products._reference import dense_hessian as dense_hessian
from sharpness.products._reference import dense_riemannian_hessian as dense_riemannian_hessian
from sharpness.products._reference import dense_spectrum as dense_spectrum

__all__ = [
    "HVP_STRATEGIES",
    "CallableOperator",
    "ChunkedData",
    "Communicator",
    "DataError",
    "DistributedError",
    "DenseOperator",
    "HessianOperator",
    "Objective",
    "SymmetricOperator",
    "build_objective",
    "dense_gspace_hessian",
    "dense_hessian",
    "dense_riemannian_hessian",
    "dense_spectrum",
    "eval_mode",
    "fold_batch_norms",
    "retain_freed_memory",
]
