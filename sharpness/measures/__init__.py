"""Sharpness measures: one `Measure` object per geometry in one registry (`MEASURES`), the
functions that compute them, epsilon-, adaptive and geodesic sharpness and invariance verification."""

from sharpness.measures._adaptive import AdaptiveSharpness as AdaptiveSharpness
from sharpness.measures._adaptive import Ascent as Ascent
from sharpness.measures._adaptive import adaptive_sharpness as adaptive_sharpness
from sharpness.measures._entry_points import invariant_sharpness as invariant_sharpness
from sharpness.measures._entry_points import measure_sharpness as measure_sharpness
from sharpness.measures._epsilon import EpsilonSharpness as EpsilonSharpness
from sharpness.measures._epsilon import epsilon_sharpness as epsilon_sharpness
from sharpness.measures._euclidean import Euclidean as Euclidean
from sharpness.measures._euclidean import euclidean_sharpness as euclidean_sharpness
from sharpness.measures._fixed import Fixed as Fixed
from sharpness.measures._geodesic import GeodesicSharpness as GeodesicSharpness
from sharpness.measures._geodesic import geodesic_sharpness as geodesic_sharpness
from sharpness.measures._gspace import GSpaceLoss as GSpaceLoss
from sharpness.measures._gspace import GSpaceMeasure as GSpaceMeasure
from sharpness.measures._gspace import gspace_hessian_operator as gspace_hessian_operator
from sharpness.measures._measure import BallGeometry as BallGeometry
from sharpness.measures._measure import CurvatureOperator as CurvatureOperator
from sharpness.measures._measure import Measure as Measure
from sharpness.measures._minnorm import MinNorm as MinNorm
from sharpness.measures._quotient import Layer as Layer
from sharpness.measures._quotient import Node as Node
from sharpness.measures._quotient import QuotientMeasure as QuotientMeasure
from sharpness.measures._registry import MEASURES as MEASURES
from sharpness.measures._registry import get_measure as get_measure
from sharpness.measures._symmetry import Symmetry as Symmetry
from sharpness.measures._verify import InvarianceReport as InvarianceReport
from sharpness.measures._verify import Rescalings as Rescalings
from sharpness.measures._verify import verify_invariance as verify_invariance

__all__ = [
    "MEASURES",
    "AdaptiveSharpness",
    "Ascent",
    "adaptive_sharpness",
    "BallGeometry",
    "CurvatureOperator",
    "EpsilonSharpness",
    "Euclidean",
    "Fixed",
    "GeodesicSharpness",
    "GSpaceLoss",
    "GSpaceMeasure",
    "InvarianceReport",
    "Layer",
    "Measure",
    "MinNorm",
    "Node",
    "QuotientMeasure",
    "Rescalings",
    "Symmetry",
    "epsilon_sharpness",
    "euclidean_sharpness",
    "geodesic_sharpness",
    "get_measure",
    "gspace_hessian_operator",
    "invariant_sharpness",
    "measure_sharpness",
    "verify_invariance",
]
