"""Curvature of a loss over a whole data set: exact Hessian-vector products, eigen-solvers,
Euclidean and scale-invariant sharpness, invariance verification, and the exact loss on grids of
parameter points (the engine under ``landscape`` and the demo's loss-surface panels)."""

from sharpness._data import ChunkedData as ChunkedData
from sharpness._data import DataError as DataError
from sharpness._density import SpectralDensity as SpectralDensity
from sharpness._density import hessian_spectral_density as hessian_spectral_density
from sharpness._density import spectral_density as spectral_density
from sharpness._epsilon import EpsilonSharpness as EpsilonSharpness
from sharpness._epsilon import epsilon_sharpness as epsilon_sharpness
from sharpness._euclidean import Euclidean as Euclidean
from sharpness._euclidean import euclidean_sharpness as euclidean_sharpness
from sharpness._fixed_sharpness import Fixed as Fixed
from sharpness._gauged import MinNorm as MinNorm
from sharpness._grid import GridValues as GridValues
from sharpness._grid import evaluate_grid as evaluate_grid
from sharpness._grid import evaluate_points as evaluate_points
from sharpness._grid import grid_axis as grid_axis
from sharpness._gspace_sharpness import GSpaceLoss as GSpaceLoss
from sharpness._gspace_sharpness import GSpaceMeasure as GSpaceMeasure
from sharpness._gspace_sharpness import gspace_hessian_operator as gspace_hessian_operator
from sharpness._hessian import HessianOperator as HessianOperator
from sharpness._invariant import invariant_sharpness as invariant_sharpness
from sharpness._invariant import measure_sharpness as measure_sharpness
from sharpness._lanczos import lanczos as lanczos
from sharpness._lanczos_low_memory import low_memory_lanczos as low_memory_lanczos
from sharpness._measure import BallGeometry as BallGeometry
from sharpness._measure import CurvatureOperator as CurvatureOperator
from sharpness._measure import Measure as Measure
from sharpness._objective import HVP_STRATEGIES as HVP_STRATEGIES
from sharpness._objective import Objective as Objective
from sharpness._objective import build_objective as build_objective
from sharpness._operator import CallableOperator as CallableOperator
from sharpness._operator import DenseOperator as DenseOperator
from sharpness._operator import SymmetricOperator as SymmetricOperator
from sharpness._power import power_iteration as power_iteration
from sharpness._quotient_measures import Layer as Layer
from sharpness._quotient_measures import Node as Node
from sharpness._quotient_measures import QuotientMeasure as QuotientMeasure
from sharpness._reference import dense_hessian as dense_hessian
from sharpness._registry import MEASURES as MEASURES
from sharpness._registry import get_measure as get_measure
from sharpness._results import EigenResult as EigenResult
from sharpness._results import TraceResult as TraceResult
from sharpness._solve import SOLVERS as SOLVERS
from sharpness._solve import Solver as Solver
from sharpness._trace import hutchinson_trace as hutchinson_trace
from sharpness._verify import InvarianceReport as InvarianceReport
from sharpness._verify import Rescalings as Rescalings
from sharpness._verify import verify_invariance as verify_invariance

__all__ = [
    "HVP_STRATEGIES",
    "MEASURES",
    "SOLVERS",
    "BallGeometry",
    "CallableOperator",
    "ChunkedData",
    "CurvatureOperator",
    "DataError",
    "DenseOperator",
    "EigenResult",
    "EpsilonSharpness",
    "Euclidean",
    "Fixed",
    "GSpaceLoss",
    "GSpaceMeasure",
    "GridValues",
    "HessianOperator",
    "InvarianceReport",
    "Rescalings",
    "Layer",
    "Measure",
    "MinNorm",
    "Node",
    "Objective",
    "QuotientMeasure",
    "Solver",
    "SpectralDensity",
    "SymmetricOperator",
    "TraceResult",
    "build_objective",
    "dense_hessian",
    "epsilon_sharpness",
    "euclidean_sharpness",
    "evaluate_grid",
    "evaluate_points",
    "get_measure",
    "grid_axis",
    "gspace_hessian_operator",
    "hessian_spectral_density",
    "hutchinson_trace",
    "invariant_sharpness",
    "lanczos",
    "low_memory_lanczos",
    "measure_sharpness",
    "power_iteration",
    "spectral_density",
    "verify_invariance",
]
