"""Output plumbing shared by the toolkit's packages: atomic file writes, figures with their metadata, JSON-ready
values and progress bars."""

from sharpness._progress import progress_bar as progress_bar
from sharpness._progress import progress_phase as progress_phase
from sharpness._results import figure_bytes as figure_bytes
from sharpness._results import jsonable as jsonable
from sharpness._results import write_atomic as write_atomic
from sharpness._results import write_tensors_atomic as write_tensors_atomic
from sharpness._results import write_text_atomic as write_text_atomic

__all__ = ["figure_bytes", "jsonable", "progress_bar", "progress_phase", "write_atomic", "write_tensors_atomic",
           "write_text_atomic"]
