"""Sharpness studies: every measure over a population of checkpoints, in one resumable, parallel run.

``sharpness.study(manifest, out_dir)`` (this package is callable: it is `run_study`) reads a manifest (one
row per checkpoint: ``id``, ``model``, ``checkpoint``, ``train``, ``test`` and hyperparameter columns), checks
every row, measures each (stored as it is finished, so an interrupted study resumes) and returns a
`StudyResult` whose ``table`` is a pandas DataFrame; ``python -m sharpness study`` is the same from the
command line.
"""

import sys
import types

from sharpness.study._manifest import Manifest as Manifest
from sharpness.study._manifest import ManifestError as ManifestError
from sharpness.study._manifest import Row as Row
from sharpness.study._manifest import read_manifest as read_manifest
from sharpness.study._runner import StudyOptions as StudyOptions
from sharpness.study._runner import StudyResult as StudyResult
from sharpness.study._runner import run_study as run_study

__all__ = ["Manifest", "ManifestError", "Row", "StudyOptions", "StudyResult", "read_manifest", "run_study"]


class _CallableModule(types.ModuleType):
    """This package, callable: ``sharpness.study(...)`` runs a study while ``sharpness.study.StudyResult`` and
    its submodules stay reachable (a function of the same name would hide the package)."""

    def __call__(self, manifest, out_dir, measures=None, jobs=1, progress=None, **options) -> StudyResult:
        """`run_study` (see there for the arguments)."""
        return run_study(manifest, out_dir, measures, jobs, progress, **options)


sys.modules[__name__].__class__ = _CallableModule
