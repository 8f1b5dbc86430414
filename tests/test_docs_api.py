"""The API reference and the site around it, checked without building the site (``.ci/run`` builds it with
``mkdocs build --strict``, and the hooks in ``docs_hooks/`` fail that build on what these tests look for):

- every public name of ``manifolds``, ``sharpness`` and ``landscape`` has a mkdocstrings directive (or, for a
  registry, a generated table) on the API pages, and every registry's table can be generated;
- the public docstrings render cleanly: no Sphinx roles, Returns sections of one entry, every documented
  parameter a parameter of the signature (otherwise it shows as "required" without its default);
- the rendered-page checks catch raw roles, split Returns tables and resources from other hosts;
- nothing the site loads comes from another host: MathJax is copied from an installed package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import landscape
import manifolds
import sharpness

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
PACKAGES = (manifolds, sharpness, landscape)
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)
REGISTRY = re.compile(r"^<!-- registry: ([\w.]+) -->", re.M)
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`")


def hook(name: str):
    """A module of ``docs_hooks/`` (MkDocs loads them by path; they are not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", ROOT / "docs_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def api_text() -> str:
    return "".join(p.read_text(encoding="utf-8") for p in sorted(API.glob("*.md")))


def resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def registries() -> list[str]:
    """``package.NAME`` of every public registry: an upper-case dict or tuple in a package's ``__all__``."""
    modules = [*PACKAGES, importlib.import_module("sharpness.cli")]
    return [
        f"{m.__name__}.{name}"
        for m in modules
        for name in m.__all__
        if name.isupper() and isinstance(getattr(m, name), (dict, tuple))
    ]


def test_every_public_name_is_documented_on_the_api_pages():
    text = api_text()
    documented = [resolve(path) for path in DIRECTIVE.findall(text)]
    tables = set(REGISTRY.findall(text))
    missing = [
        f"{package.__name__}.{name}"
        for package in PACKAGES
        for name in package.__all__
        if f"{package.__name__}.{name}" not in tables and not any(obj is getattr(package, name) for obj in documented)
    ]
    assert not missing, f"no `::: path` directive on docs/api/*.md documents {missing}"
    assert len(set(map(id, documented))) == len(documented), "an object is documented twice (two anchors)"


def test_every_registry_has_a_generated_table():
    registry_tables = hook("registries")
    marked = REGISTRY.findall(api_text())
    assert sorted(marked) == sorted(registries())
    for path in marked:
        table = registry_tables.table(path).splitlines()
        assert len(table) == 2 + len(resolve(path)), table  # header, rule, one row per entry
        assert all(row.count("|") >= 3 and row.rstrip().endswith("|") for row in table)
    assert "[`Node`][sharpness.Node]" in registry_tables.table("sharpness.MEASURES")


def test_a_registry_entry_without_a_description_fails_the_build(monkeypatch):
    registry_tables = hook("registries")
    monkeypatch.setattr(sharpness, "SOLVERS", (*sharpness.SOLVERS, "new-solver"))
    with pytest.raises(Exception, match="describe each entry"):
        registry_tables.table("sharpness.SOLVERS")


def public_docstrings():
    """``(path, griffe object)`` of every object the API pages render: the public names and their public
    members, with the griffe settings of mkdocs.yml."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(
        search_paths=[str(ROOT)],
        docstring_parser=griffe.Parser.google,
        docstring_options={"warn_unknown_params": False, "warn_missing_types": False},
    )
    collection = loader.modules_collection
    for name in ("manifolds", "sharpness", "landscape"):
        loader.load(name)
    seen = {}

    def walk(obj):
        while obj.is_alias:
            obj = obj.target
        if obj.path in seen:
            return
        seen[obj.path] = obj
        if obj.is_class:
            for member_name, member in obj.members.items():
                if not member_name.startswith("_") and not (member.is_alias and not member.resolved):
                    walk(member)

    for path in DIRECTIVE.findall(api_text()):
        obj = collection.get_member(path)
        for member in obj.members.values() if obj.is_module else [obj]:
            if obj.is_module and (member.name.startswith("_") or member.name not in (obj.exports or ())):
                continue
            walk(member)
    return seen


def test_public_docstrings_have_no_roles_no_split_returns_and_no_unknown_parameters():
    objects = public_docstrings()
    assert len(objects) > 500  # the public names and their members
    problems = []
    for path, obj in objects.items():
        if not obj.docstring:
            continue
        if ROLE.search(obj.docstring.value):
            problems.append(f"{path}: a Sphinx role (write [Name][package.Name] or `Name`)")
        for section in obj.docstring.parsed:
            kind = section.kind.value
            if kind in ("returns", "yields") and len(section.value) > 1:
                problems.append(f"{path}: {kind} split into {len(section.value)} entries (indent continuation lines)")
            if kind == "parameters" and (obj.is_function or obj.is_class):
                signature = {p.name for p in obj.parameters}
                problems += [
                    f"{path}: documents {p.name!r}, not a parameter of the signature (shown as required)"
                    for p in section.value
                    if p.name.lstrip("*") not in signature
                ]
    assert not problems, "\n".join(problems)


BAD_PAGE = """
<h3 id="sharpness.lanczos">lanczos</h3>
<p>see :func:<code>power_iteration</code> and :class:`Solver`</p>
<p><span class="doc-section-title">Returns:</span></p>
<table><thead><tr><th>Type</th><th>Description</th></tr></thead><tbody>
<tr class="doc-section-item"><td><code><a href="#sharpness.EigenResult">EigenResult</a></code></td>
<td><p>the eigenpairs, with</p></td></tr>
<tr class="doc-section-item"><td><code><a href="#sharpness.EigenResult">EigenResult</a></code></td>
<td><p>residuals and history.</p></td></tr>
</tbody></table>
<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>
<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">
"""

GOOD_PAGE = """
<h3 id="landscape.loss_plane">loss_plane</h3>
<p>see <a href="#landscape.Grid"><code>Grid</code></a>; the ratio a:b and C++ <code>std::vector</code>.</p>
<p><span class="doc-section-title">Returns:</span></p>
<table><thead><tr><th>Type</th><th>Description</th></tr></thead><tbody>
<tr class="doc-section-item"><td><code>Surface</code></td><td><p>the plane, with its metadata.</p></td></tr>
</tbody></table>
<p><span class="doc-section-title">Raises:</span></p>
<table><tbody>
<tr class="doc-section-item"><td><code>ValueError</code></td><td><p>a bad grid.</p></td></tr>
<tr class="doc-section-item"><td><code>ValueError</code></td><td><p>a bad direction.</p></td></tr>
</tbody></table>
<script src="../assets/mathjax/tex-mml-chtml.js"></script>
<a href="https://github.com/squidfunk/mkdocs-material">a link is not a resource</a>
"""


def test_the_rendered_page_checks_catch_roles_split_tables_and_other_hosts():
    checks = hook("checks")
    found = checks.problems(BAD_PAGE)
    assert len(found) == 5, found
    assert sum("raw Sphinx role" in p for p in found) == 2
    assert any("Returns table of sharpness.lanczos split into 2 rows" in p for p in found)
    assert any("cdn.jsdelivr.net" in p for p in found) and any("fonts.googleapis.com" in p for p in found)
    assert checks.problems(GOOD_PAGE) == []


def test_the_site_loads_nothing_from_another_host():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    loaded = [*config.get("extra_javascript", []), *config.get("extra_css", [])]
    assert not [u for u in loaded if re.match(r"(https?:)?//", str(u))], loaded
    assert config["theme"].get("font") is False  # Material's default loads Roboto from Google Fonts
    hooks = config["hooks"]
    assert "docs_hooks/checks.py" in hooks and "docs_hooks/mathjax.py" in hooks
    assert not re.search(r"https?://", (ROOT / "docs" / "javascripts" / "mathjax.js").read_text(encoding="utf-8"))
    assert re.search(r"django-static-mathjax", (ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_mathjax_is_copied_from_the_installed_package():
    mathjax = hook("mathjax")
    script = f"{mathjax.SITE_FOLDER}/{mathjax.SCRIPT}"
    assert script in yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["extra_javascript"]
    paths = mathjax.asset_paths()
    names = {p.relative_to(mathjax.mathjax_root()).as_posix() for p in paths}
    assert mathjax.SCRIPT in names
    assert "output/chtml/fonts/woff-v2/MathJax_Main-Regular.woff" in names  # what CHTML output loads
    assert "input/tex/extensions/ams.js" in names


def test_the_version_comes_from_the_package_metadata():
    site_info = hook("site_info")
    assert site_info.version() == importlib.metadata.version("relu-geometry")
    page = site_info.on_page_markdown("relu-geometry <!-- version -->.", page=None)
    assert page == f"relu-geometry {importlib.metadata.version('relu-geometry')}."
    assert site_info.PLACEHOLDER in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")


def test_the_repository_link_comes_from_the_project_urls(monkeypatch):
    import email.message
    from types import SimpleNamespace

    site_info = hook("site_info")
    meta = email.message.Message()
    meta["Project-URL"] = "Documentation, https://docs.example.org"
    monkeypatch.setattr(site_info.importlib.metadata, "metadata", lambda name: meta)
    config = site_info.on_config(SimpleNamespace(copyright=None, repo_url=None))
    assert config.repo_url is None  # no Repository entry: no link, not a wrong one
    meta["Project-URL"] = "Repository, https://git.example.org/relu-geometry "
    assert site_info.repository() == "https://git.example.org/relu-geometry"
    assert site_info.on_config(SimpleNamespace(copyright=None, repo_url=None)).repo_url == site_info.repository()
    kept = site_info.on_config(SimpleNamespace(copyright=None, repo_url="https://mirror.example.org"))
    assert kept.repo_url == "https://mirror.example.org"  # mkdocs.yml's own repo_url wins
