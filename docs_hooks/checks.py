"""MkDocs hook: the build fails on rendered pages that show what a reader should never see.

- a raw Sphinx role (":func:`x`" rendered as text): docstrings use Markdown, ``[Name][package.Name]``
  cross-references or backticks;
- a Returns (or Yields) table split into fragments: griffe makes one row per line of a Returns section whose
  continuation lines are not indented, so the same type cell repeats; a section is one ``Type: description``
  block with its continuation lines indented;
- a script, style sheet or font fetched from another host: the site works offline (MathJax is served from the
  site itself, see ``docs_hooks/mathjax.py``).
"""

from __future__ import annotations

import re

from mkdocs.exceptions import PluginError

ROLES = ("func", "class", "meth", "mod", "data", "attr", "exc", "obj", "const", "ref", "doc", "term", "math")
# ":func:`x`" renders as ":func:<code>x</code>" (or keeps its backtick where Markdown did not pair it).
RAW_ROLE = re.compile(r":(?:py:)?(?:" + "|".join(ROLES) + r"):(?:<code>|`)")
# mkdocstrings-python's section tables: a title paragraph, then a table whose rows are doc-section-items.
SECTION = re.compile(r'<span class="doc-section-title">(?P<title>Returns|Yields|Receives):</span>.*?<tbody>'
                     r"(?P<body>.*?)</tbody>", re.S)  # fmt: skip
ROW = re.compile(r'<tr class="doc-section-item">\s*<td>(?P<first>.*?)</td>', re.S)
HEADING = re.compile(r'<h\d id="(?P<id>[^"]+)"')
EXTERNAL = re.compile(
    r"<script[^>]*\ssrc=\"(?P<script>https?://[^\"]+)\""
    r"|<link[^>]*\srel=\"(?:stylesheet|preconnect|preload|modulepreload|dns-prefetch)\"[^>]*\shref=\"(?P<link>https?://[^\"]+)\""
    r"|<link[^>]*\shref=\"(?P<link2>https?://[^\"]+)\"[^>]*\srel=\"(?:stylesheet|preconnect|preload|modulepreload)\""
    r"|@import\s+url\(\s*['\"]?(?P<css>https?://[^)'\"]+)"
)  # fmt: skip


def _where(html: str, pos: int) -> str:
    """The id of the last heading before ``pos`` (the documented object), or "the top of the page"."""
    ids = [m["id"] for m in HEADING.finditer(html, 0, pos)]
    return ids[-1] if ids else "the top of the page"


def problems(html: str) -> list[str]:
    """What is wrong with one rendered page, one sentence each (empty: nothing)."""
    found = []
    for m in RAW_ROLE.finditer(html):
        snippet = re.sub(r"<[^>]+>", "`", html[m.start() : m.start() + 80])[:50].split("\n")[0]
        where = _where(html, m.start())
        found.append(f"raw Sphinx role {snippet!r} under {where}: write [Name][package.Name] or `Name`")
    for m in SECTION.finditer(html):
        types = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", row["first"])).strip() for row in ROW.finditer(m["body"])]
        if len(types) > 1 and len(set(types)) < len(types):
            found.append(
                f"{m['title']} table of {_where(html, m.start())} split into {len(types)} rows of the same type: "
                "write the section as one 'Type: description' block with its continuation lines indented"
            )
    for m in EXTERNAL.finditer(html):
        url = m["script"] or m["link"] or m["link2"] or m["css"]
        found.append(f"{url} is fetched from another host: serve it from the site (the docs must work offline)")
    return found


_found: list[str] = []


def on_pre_build(config, **kwargs) -> None:
    _found.clear()


def on_post_page(output: str, page, config, **kwargs) -> str:
    _found.extend(f"{page.file.src_uri}: {problem}" for problem in problems(output))
    return output


def on_post_build(config, **kwargs) -> None:
    """Every page's problems at once (the build stops on them)."""
    if _found:
        shown = "\n  ".join(_found[:40]) + (f"\n  ... and {len(_found) - 40} more" if len(_found) > 40 else "")
        raise PluginError(f"{len(_found)} rendering problem(s):\n  {shown}")
