"""Curvature of a loss over a whole data set: exact Hessian-vector products, eigen-solvers,
Euclidean and scale-invariant sharpness, invariance verification."""

from sharpness._operator import CallableOperator as CallableOperator
from sharpness._operator import DenseOperator as DenseOperator
from sharpness._operator import SymmetricOperator as SymmetricOperator
from sharpness._results import EigenResult as EigenResult
from sharpness._results import TraceResult as TraceResult

__all__ = ["CallableOperator", "DenseOperator", "EigenResult", "SymmetricOperator", "TraceResult"]
