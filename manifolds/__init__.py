"""Geometry of ReLU-network parameter spaces: structure, rescalings, quotient metrics,
G-space, fixed weights and gauges. Depends only on torch, geoopt and scipy."""

from manifolds._attention import random_transform as random_transform
from manifolds._attention import transformer_symmetry as transformer_symmetry
from manifolds._connection import Metric as Metric
from manifolds._connection import MetricQuotient as MetricQuotient
from manifolds._connection import layer_metric as layer_metric
from manifolds._connection import node_metric as node_metric
from manifolds._fixed import FixedEntries as FixedEntries
from manifolds._fixed import FixedWeightSpace as FixedWeightSpace
from manifolds._fixed import Reparametrization as Reparametrization
from manifolds._fixed import rescale_to_fixed_value as rescale_to_fixed_value
from manifolds._fixed_model import FixModel as FixModel
from manifolds._gauge import GaugeHistory as GaugeHistory
from manifolds._gauge import min_norm_gauge as min_norm_gauge
from manifolds._gauge import min_norm_gauge_parameters as min_norm_gauge_parameters
from manifolds._geodesic_ode import GeodesicMap as GeodesicMap
from manifolds._graph import FirstLayerSplit as FirstLayerSplit
from manifolds._graph import TracedNetwork as TracedNetwork
from manifolds._graph import module_chain as module_chain
from manifolds._graph import split_first_layer as split_first_layer
from manifolds._graph import trace_network as trace_network
from manifolds._group import Action as Action
from manifolds._group import RescalingGroup as RescalingGroup
from manifolds._group_discovery import Pin as Pin
from manifolds._gspace import GSpace as GSpace
from manifolds._gspace import GSpaceSingularityError as GSpaceSingularityError
from manifolds._gspace import Skeleton as Skeleton
from manifolds._gspace import gsgd_init_ as gsgd_init_
from manifolds._gspace_training import GModel as GModel
from manifolds._gspace_training import GOptimizer as GOptimizer
from manifolds._layout import ParamLayout as ParamLayout
from manifolds._matrix_group import Block as Block
from manifolds._matrix_group import Factor as Factor
from manifolds._matrix_group import MatrixSymmetry as MatrixSymmetry
from manifolds._matrix_group import SymmetryElement as SymmetryElement
from manifolds._modules import eval_mode as eval_mode
from manifolds._modules import functional_call as functional_call
from manifolds._modules import tensor_aliases as tensor_aliases
from manifolds._modules import untied as untied
from manifolds._node_symmetry import NodeSymmetry as NodeSymmetry
from manifolds._quotient import QUOTIENTS as QUOTIENTS
from manifolds._quotient import LayerScaleQuotient as LayerScaleQuotient
from manifolds._quotient import NodeScaleQuotient as NodeScaleQuotient
from manifolds._quotient import SolverHessian as SolverHessian
from manifolds._structure import DegeneratePointError as DegeneratePointError
from manifolds._structure import Layer as Layer
from manifolds._structure import NetworkStructure as NetworkStructure
from manifolds._structure import UnsupportedModelError as UnsupportedModelError
from manifolds._structure import analyze as analyze
from manifolds._structure import buffer_group as buffer_group
from manifolds._structure import layer_factors as layer_factors
from manifolds._structure import random_factors as random_factors
from manifolds._structure import random_rescale as random_rescale
from manifolds._structure import rescale_model as rescale_model
from manifolds._structure import rescale_parameters as rescale_parameters
from manifolds._symmetry_metric import symmetry_metric as symmetry_metric
from manifolds._symmetry_quotient import SymmetryQuotient as SymmetryQuotient

__all__ = [
    "Metric",
    "MetricQuotient",
    "GeodesicMap",
    "layer_metric",
    "node_metric",
    "Block",
    "Factor",
    "MatrixSymmetry",
    "SymmetryQuotient",
    "SymmetryElement",
    "random_transform",
    "symmetry_metric",
    "transformer_symmetry",
    "FixModel",
    "FixedEntries",
    "FixedWeightSpace",
    "Reparametrization",
    "rescale_to_fixed_value",
    "GaugeHistory",
    "min_norm_gauge",
    "min_norm_gauge_parameters",
    "LayerScaleEuclidean",
    "LogEuclidean",
    "quotient_parameters",
    "zero_init_momentum",
    "GModel",
    "GOptimizer",
    "GSpace",
    "GSpaceSingularityError",
    "Skeleton",
    "gsgd_init_",
    "ParamLayout",
    "eval_mode",
    "functional_call",
    "tensor_aliases",
    "untied",
    "Action",
    "Pin",
    "RescalingGroup",
    "TracedNetwork",
    "FirstLayerSplit",
    "module_chain",
    "split_first_layer",
    "trace_network",
    "buffer_group",
    "LayerScaleQuotient",
    "NodeScaleQuotient",
    "SolverHessian",
    "QUOTIENTS",
    "Layer",
    "NetworkStructure",
    "NodeSymmetry",
    "UnsupportedModelError",
    "DegeneratePointError",
    "analyze",
    "layer_factors",
    "random_factors",
    "random_rescale",
    "rescale_model",
    "rescale_parameters",
]

# geoopt (and the scipy.optimize it pulls in) is slow to import: load its manifolds on first use.
_LAZY = {
    name: "manifolds._geoopt"
    for name in ["LayerScaleEuclidean", "LogEuclidean", "quotient_parameters", "zero_init_momentum"]
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'manifolds' has no attribute {name!r}")
