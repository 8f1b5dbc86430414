"""Curvature of a loss over a whole data set: exact Hessian-vector products, eigen-solvers,
Euclidean and scale-invariant sharpness, invariance verification, and the exact loss on grids of
parameter points (the engine under ``landscape`` and the demo's loss-surface panels)."""

from sharpness._data import ChunkedData as ChunkedData
from sharpness._data import DataError as DataError
from sharpness._density import SpectralDensity as SpectralDensity
from sharpness._density import hessian_spectral_density as hessian_spectral_density
from sharpness._density import spectral_density as spectral_density
from sharpness._epsilon import BALL_GEOMETRIES as BALL_GEOMETRIES
from sharpness._epsilon import BallGeometry as BallGeometry
from sharpness._epsilon import EpsilonSharpness as EpsilonSharpness
from sharpness._epsilon import epsilon_sharpness as epsilon_sharpness
from sharpness._euclidean import euclidean_sharpness as euclidean_sharpness
from sharpness._fixed_sharpness import fixed_sharpness as fixed_sharpness
from sharpness._grid import GridValues as GridValues
from sharpness._grid import evaluate_grid as evaluate_grid
from sharpness._grid import evaluate_points as evaluate_points
from sharpness._grid import grid_axis as grid_axis
from sharpness._gspace_sharpness import GSpaceLoss as GSpaceLoss
from sharpness._gspace_sharpness import gspace_hessian_operator as gspace_hessian_operator
from sharpness._gspace_sharpness import gspace_sharpness as gspace_sharpness
from sharpness._hessian import HessianOperator as HessianOperator
from sharpness._invariant import invariant_sharpness as invariant_sharpness
from sharpness._lanczos import lanczos as lanczos
from sharpness._lanczos_low_memory import low_memory_lanczos as low_memory_lanczos
from sharpness._measure import measure_sharpness as measure_sharpness
from sharpness._objective import HVP_STRATEGIES as HVP_STRATEGIES
from sharpness._objective import Objective as Objective
from sharpness._operator import CallableOperator as CallableOperator
from sharpness._operator import DenseOperator as DenseOperator
from sharpness._operator import SymmetricOperator as SymmetricOperator
from sharpness._power import power_iteration as power_iteration
from sharpness._reference import dense_hessian as dense_hessian
from sharpness._results import EigenResult as EigenResult
from sharpness._results import TraceResult as TraceResult
from sharpness._trace import hutchinson_trace as hutchinson_trace
from sharpness._verify import InvarianceReport as InvarianceReport
from sharpness._verify import verify_invariance as verify_invariance

__all__ = [
    "BALL_GEOMETRIES",
    "HVP_STRATEGIES",
    "BallGeometry",
    "CallableOperator",
    "ChunkedData",
    "DataError",
    "DenseOperator",
    "EigenResult",
    "EpsilonSharpness",
    "GSpaceLoss",
    "GridValues",
    "HessianOperator",
    "InvarianceReport",
    "Objective",
    "SpectralDensity",
    "SymmetricOperator",
    "TraceResult",
    "dense_hessian",
    "epsilon_sharpness",
    "euclidean_sharpness",
    "evaluate_grid",
    "evaluate_points",
    "fixed_sharpness",
    "gspace_hessian_operator",
    "gspace_sharpness",
    "hessian_spectral_density",
    "grid_axis",
    "hutchinson_trace",
    "invariant_sharpness",
    "lanczos",
    "low_memory_lanczos",
    "measure_sharpness",
    "power_iteration",
    "spectral_density",
    "verify_invariance",
]
