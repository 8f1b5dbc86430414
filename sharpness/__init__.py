"""Curvature of a loss over a whole data set: the objective and its exact Hessian-vector products
(`sharpness.products`), eigen-solvers (`sharpness.solvers`), and the sharpness measures, Euclidean and
scale-invariant, with epsilon-sharpness and invariance verification (`sharpness.measures`)."""

# a callable package: sharpness.study(manifest, out_dir) runs a study
from sharpness import study as study
from sharpness._bert import Bert as Bert
from sharpness._distilbert import DistilBert as DistilBert
from sharpness._electra import Electra as Electra
from sharpness._gpt2 import GPT2 as GPT2
from sharpness._gptj import GPTJ as GPTJ
from sharpness._hfvit import HFDeiT as HFDeiT
from sharpness._hfvit import HFViT as HFViT
from sharpness._llama import Llama as Llama
from sharpness._llama import LlamaLayout as LlamaLayout
from sharpness._neox import GPTNeoX as GPTNeoX
from sharpness._opt import OPT as OPT
from sharpness._phi import Phi as Phi
from sharpness._results import EigenResult as EigenResult
from sharpness._results import TraceResult as TraceResult
from sharpness._roberta import Roberta as Roberta
from sharpness._timmvit import TimmViT as TimmViT
from sharpness._transformers import from_transformers as from_transformers
from sharpness.measures import MEASURES as MEASURES
from sharpness.measures import AdaptiveSharpness as AdaptiveSharpness
from sharpness.measures import Ascent as Ascent
from sharpness.measures import BallGeometry as BallGeometry
from sharpness.measures import CurvatureOperator as CurvatureOperator
from sharpness.measures import EpsilonSharpness as EpsilonSharpness
from sharpness.measures import Euclidean as Euclidean
from sharpness.measures import Fixed as Fixed
from sharpness.measures import GeodesicSharpness as GeodesicSharpness
from sharpness.measures import GSpaceLoss as GSpaceLoss
from sharpness.measures import GSpaceMeasure as GSpaceMeasure
from sharpness.measures import InvarianceReport as InvarianceReport
from sharpness.measures import Layer as Layer
from sharpness.measures import Measure as Measure
from sharpness.measures import MinNorm as MinNorm
from sharpness.measures import Node as Node
from sharpness.measures import QuotientMeasure as QuotientMeasure
from sharpness.measures import Rescalings as Rescalings
from sharpness.measures import Symmetry as Symmetry
from sharpness.measures import adaptive_sharpness as adaptive_sharpness
from sharpness.measures import epsilon_sharpness as epsilon_sharpness
from sharpness.measures import euclidean_sharpness as euclidean_sharpness
from sharpness.measures import geodesic_sharpness as geodesic_sharpness
from sharpness.measures import get_measure as get_measure
from sharpness.measures import gspace_hessian_operator as gspace_hessian_operator
from sharpness.measures import invariant_sharpness as invariant_sharpness
from sharpness.measures import measure_sharpness as measure_sharpness
from sharpness.measures import verify_invariance as verify_invariance
from sharpness.products import HVP_STRATEGIES as HVP_STRATEGIES
from sharpness.products import CallableOperator as CallableOperator
from sharpness.products import ChunkedData as ChunkedData
from sharpness.products import Communicator as Communicator
from sharpness.products import DataError as DataError
from sharpness.products import DenseOperator as DenseOperator
from sharpness.products import DistributedError as DistributedError
from sharpness.products import HessianOperator as HessianOperator
from sharpness.products import Objective as Objective
from sharpness.products import SymmetricOperator as SymmetricOperator
from sharpness.products import build_objective as build_objective
from sharpness.products import dense_gspace_hessian as dense_gspace_hessian
from sharpness.products import dense_hessian as dense_hessian
from sharpness.products import dense_riemannian_hessian as dense_riemannian_hessian
from sharpness.products import dense_spectrum as dense_spectrum
from sharpness.solvers import SOLVERS as SOLVERS
from sharpness.solvers import Solver as Solver
from sharpness.solvers import SpectralDensity as SpectralDensity
from sharpness.solvers import hessian_spectral_density as hessian_spectral_density
from sharpness.solvers import hutchinson_trace as hutchinson_trace
from sharpness.solvers import lanczos as lanczos
from sharpness.solvers import low_memory_lanczos as low_memory_lanczos
from sharpness.solvers import power_iteration as power_iteration
from sharpness.solvers import spectral_density as spectral_density
from sharpness.study import StudyResult as StudyResult
from sharpness.study import run_study as run_study

__all__ = [
    "HVP_STRATEGIES",
    "MEASURES",
    "SOLVERS",
    "BallGeometry",
    "CallableOperator",
    "ChunkedData",
    "Communicator",
    "CurvatureOperator",
    "DataError",
    "DenseOperator",
    "DistributedError",
    "EigenResult",
    "EpsilonSharpness",
    "Euclidean",
    "Fixed",
    "Bert",
    "DistilBert",
    "Electra",
    "GPT2",
    "GPTJ",
    "GPTNeoX",
    "OPT",
    "Phi",
    "Roberta",
    "HFViT",
    "HFDeiT",
    "TimmViT",
    "LlamaLayout",
    "Llama",
    "GeodesicSharpness",
    "GSpaceLoss",
    "GSpaceMeasure",
    "HessianOperator",
    "InvarianceReport",
    "Layer",
    "Measure",
    "MinNorm",
    "Node",
    "Objective",
    "QuotientMeasure",
    "Rescalings",
    "Symmetry",
    "Solver",
    "SpectralDensity",
    "StudyResult",
    "SymmetricOperator",
    "TraceResult",
    "build_objective",
    "dense_gspace_hessian",
    "dense_hessian",
    "dense_riemannian_hessian",
    "dense_spectrum",
    "epsilon_sharpness",
    "AdaptiveSharpness",
    "Ascent",
    "adaptive_sharpness",
    "euclidean_sharpness",
    "from_transformers",
    "geodesic_sharpness",
    "get_measure",
    "gspace_hessian_operator",
    "hessian_spectral_density",
    "hutchinson_trace",
    "invariant_sharpness",
    "lanczos",
    "low_memory_lanczos",
    "measure_sharpness",
    "power_iteration",
    "run_study",
    "spectral_density",
    "study",
    "verify_invariance",
]
