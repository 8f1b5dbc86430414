"""Geometry of ReLU-network parameter spaces: structure, rescalings, quotient metrics,
G-space, fixed weights and gauges. Depends only on torch, geoopt and scipy."""

from manifolds._layout import ParamLayout as ParamLayout

__all__ = ["ParamLayout"]
