"""Loss landscapes: the thesis's toy ReLU networks and their G-space charts, lines and planes of real models (MLPs,
CNNs, ResNets, transformers) along random (filter/layer-normalized), Hessian-eigenvector, quotient-eigenvector or
two-checkpoint directions (straight, or along the quotient metric's geodesics), planes in G-space coordinates and in
the free weights under fixed-weight values, a fast exact grid evaluator, and matplotlib/plotly renderers."""

from landscape._directions import Directions as Directions
from landscape._directions import eigen_directions as eigen_directions
from landscape._directions import gspace_directions as gspace_directions
from landscape._directions import normalize_direction as normalize_direction
from landscape._directions import random_directions as random_directions
from landscape._directions import segment_direction as segment_direction
from landscape._fixed_planes import fixed_weight_planes as fixed_weight_planes
from landscape._grid import GridValues as GridValues
from landscape._grid import evaluate_grid as evaluate_grid
from landscape._grid import evaluate_points as evaluate_points
from landscape._grid import grid_axis as grid_axis
from landscape._layout_check import LayoutError as LayoutError
from landscape._layout_check import check_layout as check_layout
from landscape._layout_check import layout_problems as layout_problems
from landscape._plot_mpl import line_figure as line_figure
from landscape._plot_mpl import save_figure as save_figure
from landscape._plot_mpl import surface_figure as surface_figure
from landscape._plot_plotly import plotly_figure as plotly_figure
from landscape._plot_plotly import write_html as write_html
from landscape._settings import DirectionSpec as DirectionSpec
from landscape._settings import Grid as Grid
from landscape._surface import Surface as Surface
from landscape._surfaces import loss_line as loss_line
from landscape._surfaces import loss_plane as loss_plane
from landscape._toy_figures import TOY_FIGURES as TOY_FIGURES
from landscape._toy_figures import toy_figure as toy_figure

__all__ = [
    "TOY_FIGURES",
    "DirectionSpec",
    "Directions",
    "Grid",
    "GridValues",
    "LayoutError",
    "Surface",
    "eigen_directions",
    "evaluate_grid",
    "check_layout",
    "evaluate_points",
    "fixed_weight_planes",
    "gspace_directions",
    "grid_axis",
    "layout_problems",
    "line_figure",
    "loss_line",
    "loss_plane",
    "normalize_direction",
    "plotly_figure",
    "random_directions",
    "save_figure",
    "segment_direction",
    "surface_figure",
    "toy_figure",
    "write_html",
]
