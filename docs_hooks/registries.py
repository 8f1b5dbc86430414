"""MkDocs hook: the registry tables of the API reference, generated from the registries themselves.

A page marks a table with ``<!-- registry: PACKAGE.NAME -->`` (on a line of its own); the build replaces the
marker with one row per entry of that registry. Entries that are objects (measures, quotient classes, error
types) are described by the first paragraph of their class's docstring; the registries of plain names
(solvers, Hessian-vector product strategies, toy figures) take their one-line descriptions from
``NAME_DESCRIPTIONS`` below, and the build fails when those and the registry disagree, so a new entry cannot
go undocumented.
"""

from __future__ import annotations

import importlib
import inspect
import re

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- registry: (?P<path>[\w.]+) -->[ \t]*$", re.M)
# A Markdown anchor, ``[](){#sharpness.MEASURES}`` (attr_list): the target of ``[MEASURES][sharpness.MEASURES]``.
ANCHOR = re.compile(r"^\[\]\(\)\{#(?P<id>[\w.-]+)\}[ \t]*$", re.M)

# One line per name, for the registries that hold names rather than objects.
NAME_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "sharpness.SOLVERS": {
        "lanczos": "Lanczos with full reorthogonalization (the default): one parameter vector kept per iteration, "
        "the fewest Hessian-vector products.",
        "low-memory-lanczos": "Lanczos that keeps three parameter vectors whatever the iteration count, for about "
        "twice the Hessian-vector products.",
        "power": "deflated power iteration (on a quotient, the Riemannian power method of Rangamani et al.).",
    },
    "sharpness.HVP_STRATEGIES": {
        "auto": '`"rop"` where it applies, else `"graph"` when it fits in the memory budget, else the faster '
        "streaming kind on this machine.",
        "rop": "the R-operator written out by hand (Linear/ConvNd, eval-mode BatchNorm, ReLU, pooling, residual "
        "sums, ...), forward state kept across products when it fits.",
        "graph": "keeps the whole-data-set gradient graph and differentiates it again for each product.",
        "double_backward": "recomputes forward and backward per chunk (autograd double backward).",
        "jvp": "forward-over-reverse: `torch.func.jvp` of `torch.func.grad` per chunk.",
    },
    "landscape.TOY_FIGURES": {
        "1.5": "the thesis's networks a and b: loss surfaces over two weights.",
        "1.6": "invariant lines (hyperbolas of equal function) and exact gradients.",
        "4.9": "fixed-weight planes, reading (a): the fixed weight w1 set to each value.",
        "gspace-1.5": "Fig. 1.5's network b in G-space (basis-path coordinates).",
        "gspace-4.9": "Fig. 4.9's network b in G-space, with the fixed-weight planes outlined.",
    },
}


def registry(path: str) -> object:
    """The object at ``PACKAGE.NAME`` (``sharpness.MEASURES``)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"registry marker names {path}, which does not exist: {exc}") from exc


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s (or its class's) docstring, on one line."""
    doc = inspect.getdoc(obj if inspect.isclass(obj) else type(obj)) or ""
    return " ".join(doc.split("\n\n")[0].split())


def qualified(cls: type) -> str:
    """The path under which the API reference documents ``cls`` (``sharpness.Objective``), or its bare name."""
    for module in ("manifolds", "sharpness", "landscape", "sharpness.cli", "sharpness.io"):
        namespace = importlib.import_module(module)
        if cls.__name__ in getattr(namespace, "__all__", ()) and getattr(namespace, cls.__name__) is cls:
            return f"{module}.{cls.__name__}"
    return cls.__qualname__


def class_cell(cls: type) -> str:
    """A cross-reference to ``cls`` where the API reference documents it, its plain name otherwise."""
    name = qualified(cls)
    return f"[`{cls.__qualname__}`][{name}]" if "." in name else f"`{name}`"


def rows(path: str) -> list[tuple[str, str, str]]:
    """``(key, value, description)`` of every entry of the registry at ``path``, in the registry's order."""
    value = registry(path)
    if path in NAME_DESCRIPTIONS:
        described = NAME_DESCRIPTIONS[path]
        if not isinstance(value, tuple) or set(value) != set(described):
            raise PluginError(
                f"{path} is {value!r} but docs_hooks/registries.py describes {sorted(described)}: "
                "describe each entry there (one line) and drop the ones that are gone"
            )
        return [(f'`"{name}"`', "", described[name][:1].upper() + described[name][1:]) for name in value]
    if isinstance(value, dict):
        out = []
        for key, entry in value.items():
            if inspect.isclass(entry):
                out.append((f'`"{key}"`', class_cell(entry), summary(entry)))
            elif "." in qualified(type(entry)):  # an instance of a documented class (a measure)
                out.append((f'`"{key}"`', class_cell(type(entry)), summary(entry)))
            else:
                out.append((f'`"{key}"`', f"`{entry!r}`", ""))
        return out
    if isinstance(value, tuple) and all(inspect.isclass(entry) for entry in value):
        return [(class_cell(entry), "", summary(entry)) for entry in value]
    raise PluginError(f"{path} is neither a dict nor a tuple of classes; describe it in docs_hooks/registries.py")


def table(path: str) -> str:
    """The markdown table of the registry at ``path``: the entry, then its object (where it is one) and what it
    is. Pipes inside code spans need no escaping (the tables extension skips code spans)."""
    lines = ["| entry | what it is |", "|---|---|"]
    for key, value, text in rows(path):
        described = f"{value}: {text}" if value and text else value or text
        lines.append(f"| {key} | {described} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    # autorefs does not pick up these anchors by itself here (its anchor scanner is not active in this setup)
    autorefs = config.plugins.get("autorefs")
    for m in ANCHOR.finditer(markdown):
        autorefs.register_anchor(page, m["id"], m["id"])
    return MARKER.sub(lambda m: table(m["path"]), markdown)
