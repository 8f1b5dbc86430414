"""Eigen-solvers on symmetric operators (Lanczos, low-memory Lanczos, deflated power iteration), the Hutchinson
trace, spectral densities by stochastic Lanczos quadrature, and the `Solver` settings shared by all."""

from sharpness.solvers._density import SpectralDensity as SpectralDensity
from sharpness.solvers._density import hessian_spectral_density as hessian_spectral_density
from sharpness.solvers._density import spectral_density as spectral_density
from sharpness.solvers._lanczos import lanczos as lanczos
from sharpness.solvers._lanczos_low_memory import low_memory_lanczos as low_memory_lanczos
from sharpness.solvers._power import power_iteration as power_iteration
from sharpness.solvers._solve import SOLVERS as SOLVERS
from sharpness.solvers._solve import Solver as Solver
from sharpness.solvers._trace import hutchinson_trace as hutchinson_trace

__all__ = [
    "SOLVERS",
    "Solver",
    "SpectralDensity",
    "hessian_spectral_density",
    "hutchinson_trace",
    "lanczos",
    "low_memory_lanczos",
    "power_iteration",
    "spectral_density",
]
