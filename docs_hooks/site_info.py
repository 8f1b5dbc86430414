"""MkDocs hook: the installed package's version, read from its metadata at build time.

It goes into the footer of every page and replaces ``<!-- version -->`` in the pages' Markdown.
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


def on_config(config, **kwargs):
    config.copyright = f"{DISTRIBUTION} {version()}"
    return config


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    return markdown.replace(PLACEHOLDER, version())
