"""The one registry of sharpness measures: name -> default [`Measure`][sharpness.Measure] instance."""

from __future__ import annotations

from sharpness.measures._euclidean import Euclidean
from sharpness.measures._fixed import Fixed
from sharpness.measures._gspace import GSpaceMeasure
from sharpness.measures._measure import Measure
from sharpness.measures._minnorm import MinNorm
from sharpness.measures._quotient import Layer, Node
from sharpness.measures._symmetry import Symmetry

# name -> measure with default options; a measure added here is measured, verified and offered by the command
# line without any other change.
MEASURES: dict[str, Measure] = {
    m.name: m for m in (Euclidean(), Layer(), Node(), Fixed(), MinNorm(), GSpaceMeasure(), Symmetry())
}


def get_measure(measure: str | Measure) -> Measure:
    """``measure`` itself, or the registered measure of that name.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
    """
    if isinstance(measure, Measure):
        return measure
    if measure not in MEASURES:
        raise ValueError(f"unknown sharpness metric {measure!r}; choose one of {', '.join(MEASURES)}")
    return MEASURES[measure]
