"""MkDocs hook: the installed package's version, read from its metadata at build time.

It goes into the footer of every page and replaces ``<!-- version -->`` in the pages' Markdown. The
repository link in the header comes from the same metadata: the ``Repository`` entry of ``[project.urls]`` in
pyproject.toml, the one place to set it (PyPI shows it too); without one the header has no link.
"""

from __future__ import annotations

import importlib.metadata

from mkdocs.exceptions import PluginError

DISTRIBUTION = "relu-geometry"
PLACEHOLDER = "<!-- version -->"


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise PluginError(
            f'{DISTRIBUTION} is not installed, so the docs cannot state its version: pip install -e ".[dev]"'
        ) from exc


def repository() -> str | None:
    """The URL of the ``Repository`` (or ``Source``) entry of the package's ``[project.urls]``, if any."""
    for entry in importlib.metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in {"repository", "source", "source code"} and url.strip():
            return url.strip()
    return None


def on_config(config, **kwargs):
    config.copyright = f"{DISTRIBUTION} {version()}"
    url = repository()
    if url and not config.repo_url:
        config.repo_url = url
    return config


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    return markdown.replace(PLACEHOLDER, version())
