"""MkDocs hook: MathJax served from the site itself, so the math renders offline.

The files come from the ``django-static-mathjax`` package (MathJax 3 as static files, no dependencies; the
``dev`` extra installs it): the combined TeX component ``tex-mml-chtml.js`` and the folders it loads from at run
time (fonts, TeX extensions, the menu and its accessibility parts), under ``assets/mathjax/`` of the site.
``mkdocs.yml`` lists ``assets/mathjax/tex-mml-chtml.js`` after ``javascripts/mathjax.js`` (the settings).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

SITE_FOLDER = "assets/mathjax"
SCRIPT = "tex-mml-chtml.js"
# What tex-mml-chtml.js loads on demand, relative to itself (MathJax's "[mathjax]" path).
FOLDERS = ("input", "output/chtml", "ui", "a11y", "sre", "adaptors")


def mathjax_root() -> Path:
    """The ``es5`` folder of the installed MathJax distribution."""
    spec = importlib.util.find_spec("mathjax")
    roots = [Path(p) / "static" / "mathjax" / "es5" for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        if (root / SCRIPT).is_file():
            return root
    raise PluginError(
        "MathJax is not installed, so the math cannot be served offline: install the docs extras "
        '(pip install -e ".[dev]", which brings django-static-mathjax)'
    )


def asset_paths() -> list[Path]:
    """The MathJax files the site serves, absolute."""
    root = mathjax_root()
    paths = [root / SCRIPT]
    for folder in FOLDERS:
        paths += sorted(p for p in (root / folder).rglob("*") if p.is_file())
    return paths


def on_files(files: Files, config, **kwargs) -> Files:
    root = mathjax_root()
    for path in asset_paths():
        uri = f"{SITE_FOLDER}/{path.relative_to(root).as_posix()}"
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
