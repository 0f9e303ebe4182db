"""Sphinx directives of the pgdecode documentation, generated at build time so they never go stale.

- ``.. pgdecode-package:: airflow_provider_pgdecode.batch``: the API reference of a package (its
  docstring, an autosummary table of its modules, then each module with autodoc), or of a
  single module. The modules are found by walking the package when the docs are built: a new
  module appears without editing the docs, and nothing is written to the source tree.
- ``.. pgdecode-config::``: the ``[pgdecode]`` section of Airflow's configuration, from
  :func:`airflow_provider_pgdecode.utils.config.provider_config` (what Airflow itself reads).
- ``.. pgdecode-connection-form::``: the form fields of the ``pgdecode`` connection type, from
  :func:`airflow_provider_pgdecode.get_provider_info.get_provider_info`.

Markdown links that leave ``docs/`` (``../README.md``, ``../airflow_provider_pgdecode/errors.py``,
``../dags/``; in the README, included by ``overview.md``, ``dags/`` or ``LICENSE``) are kept as they
are in the files, where they work on GitHub, and rewritten as the site reads them
(:func:`site_links`): the README and the changelog to their pages, anything else to its page on
GitHub (:data:`GITHUB_BLOB`).

At the end of reading, every subpackage and top-level module of the provider must have been
documented by a ``pgdecode-package`` directive, except :data:`UNDOCUMENTED`: a new one is a
warning (so an error under ``-W``), not a silent gap in the reference.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import posixpath
import re
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

PACKAGE = "airflow_provider_pgdecode"
UNDOCUMENTED = {
    f"{PACKAGE}.example_dags",  # example DAGs: shown as snippets on the operator pages instead
    f"{PACKAGE}.get_provider_info",  # Airflow's entry point; its content is on the connection and configuration pages
}
GITHUB_BLOB = "https://github.com/pgdecode/airflow-provider-pgdecode/blob/main/"
"""Where a repository file outside ``docs/`` is shown, for links the site cannot serve itself."""
SITE_PAGES = {"README.md": "docs/overview.md", "CHANGELOG.md": "docs/changelog.md"}
"""Repository files that are pages of the site (included by these pages)."""
# The target of an inline Markdown link, [text](target) or [text](target "title").
MARKDOWN_LINK = re.compile(r"(?<=\]\()([^)\s]+)(?=[)\s])")
FENCE = re.compile(r"^\s*(```|~~~)")
IMAGE = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
# The underline of each heading level below the page's title, as the generated reST uses them.
TITLE_UNDERLINES = "-~^"

logger = logging.getLogger(__name__)


def _public_modules(package: ModuleType) -> Iterator[str]:
    """The public modules of ``package``, recursively, in name order (``_native`` and the like left out)."""
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{package.__name__}.{info.name}"
        yield name
        if info.ispkg:
            yield from _public_modules(importlib.import_module(name))


def _heading(text: str, level: int) -> list[str]:
    return [text, TITLE_UNDERLINES[level] * len(text), ""]


class _GeneratedDirective(SphinxDirective):
    """A directive whose content is reST generated here, parsed as if it were in the page.

    The page must be reST, or the directive inside an ``{eval-rst}`` block of a MyST page: MyST
    would parse the generated reST as Markdown.
    """

    def parse_generated(self, lines: list[str]) -> list[nodes.Node]:
        source = f"<{self.name} in {self.env.docname}>"
        content = StringList(lines, source=source)
        node = nodes.section()  # a container whose children are returned; sections allowed
        node.document = self.state.document
        nested_parse_with_titles(self.state, content, node, content_offset=self.content_offset)
        return list(node.children)


class PackageDirective(_GeneratedDirective):
    """``.. pgdecode-package:: <module>``: a package's (or module's) API reference."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        module = importlib.import_module(name)
        self.env.note_dependency(module.__file__ or "")
        documented = _documented(self.env).setdefault(self.env.docname, set())
        documented.add(name)
        if not hasattr(module, "__path__"):
            return self.parse_generated([f".. automodule:: {name}", ""])
        modules = list(_public_modules(module))
        documented.update(modules)
        lines = [f".. automodule:: {name}", "   :no-members:", "", ".. autosummary::", ""]
        # Names relative to the package, the current module after its automodule.
        lines += [f"   {m.removeprefix(name + '.')}" for m in modules]
        lines.append("")
        for m in modules:
            self.env.note_dependency(importlib.import_module(m).__file__ or "")
            lines += _heading(f"``{m.removeprefix(PACKAGE + '.')}``", 0)
            lines += [f".. automodule:: {m}", ""]
        return self.parse_generated(lines)


def _literal(value: str | None) -> str:
    return f"``{value}``" if value else "empty"


class ConfigDirective(_GeneratedDirective):
    """``.. pgdecode-config::``: every option of the ``[pgdecode]`` section, as Airflow declares it."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from airflow_provider_pgdecode.utils import config

        self.env.note_dependency(config.__file__)
        (section, spec), *_ = config.provider_config().items()
        lines = [spec["description"], ""]
        for option, entry in spec["options"].items():
            env = f"AIRFLOW__{section.upper()}__{option.upper()}"
            lines += [f".. _config-{section}-{option.replace('_', '-')}:", ""]
            lines += _heading(option, 0)
            lines += [entry["description"], ""]
            lines += [
                f":Type: {entry['type']}",
                f":Default: {_literal(entry['default'])}",
                f":Example: {_literal(entry['example'])}",
                f":Environment variable: ``{env}``",
                f":Version added: {entry['version_added']}",
                "",
            ]
        return self.parse_generated(lines)


class ConnectionFormDirective(_GeneratedDirective):
    """``.. pgdecode-connection-form::``: the fields of the ``pgdecode`` connection form."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from airflow_provider_pgdecode import get_provider_info as provider_info

        self.env.note_dependency(provider_info.__file__)
        (conn,) = (
            c for c in provider_info.get_provider_info()["connection-types"] if c["connection-type"] == "pgdecode"
        )
        behaviour: dict[str, Any] = conn["ui-field-behaviour"]
        labels = {"host": "Host", "port": "Port", "schema": "Schema", "login": "Login", "password": "Password"}
        labels.update(behaviour.get("relabeling", {}))
        placeholders = behaviour.get("placeholders", {})
        lines = [
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 15 20 65",
            "",
            "   * - Field",
            "     - Label in the form",
            "     - Placeholder",
        ]
        for field in ("host", "port", "schema", "login", "password", "extra"):
            if field in behaviour.get("hidden-fields", []):
                continue
            placeholder = placeholders.get(field, "")
            lines += [
                f"   * - ``{field}``",
                f"     - {labels.get(field, field.capitalize())}",
                f"     - ``{placeholder}``" if placeholder else "     -",
            ]
        for name, field in conn.get("conn-fields", {}).items():
            values = ", ".join(f"``{v}``" for v in field["schema"].get("enum", []) if v is not None)
            lines += [
                f"   * - ``{name}`` (extra)",
                f"     - {field['label']}",
                f"     - {field.get('description', '')}" + (f"; one of {values}" if values else ""),
            ]
        lines.append("")
        return self.parse_generated(lines)


def site_links(text: str, source: str, docs_relative_to: str) -> str:
    """``text`` (Markdown of the repository file ``source``, a path from the repository's root) with
    its links that leave ``docs/`` made to work on the site.

    A link to the README or the changelog leads to its page (:data:`SITE_PAGES`), any other file
    or folder outside ``docs/`` to GitHub (:data:`GITHUB_BLOB`). The new link is relative to
    ``docs_relative_to`` (``docs`` for an included file: MyST's ``relative-docs`` takes it from
    there), or absolute. Links into ``docs/``, anchors, URLs, images and fenced code are left alone.
    """
    folder = posixpath.dirname(source)
    out: list[str] = []
    fenced = False

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(1)
        path, hash_, anchor = target.partition("#")
        if not path or "://" in path or path.startswith(("mailto:", "/")) or path.lower().endswith(IMAGE):
            return target
        resolved = posixpath.normpath(posixpath.join(folder, path))
        if resolved.startswith("../"):
            return target  # outside the repository: not ours to mend
        if resolved in SITE_PAGES:
            page = SITE_PAGES[resolved]
            return posixpath.relpath(page, docs_relative_to) + hash_ + anchor
        if resolved == "docs" or resolved.startswith("docs/"):
            return target
        return GITHUB_BLOB + resolved + ("/" if path.endswith("/") else "") + hash_ + anchor

    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced or FENCE.match(line) else MARKDOWN_LINK.sub(rewrite, line))
    return "".join(out)


def _source_read(app: Sphinx, docname: str, content: list[str]) -> None:
    path = app.env.doc2path(docname)
    if str(path).endswith(".md"):
        source = os.path.relpath(path, app.srcdir.parent).replace(os.sep, "/")
        content[0] = site_links(content[0], source, posixpath.dirname(source))


def _include_read(app: Sphinx, relative_path: Any, parent_docname: str, content: list[str]) -> None:
    source = os.path.normpath(os.path.join(app.srcdir, relative_path))
    if source.endswith(".md"):
        rel = os.path.relpath(source, app.srcdir.parent).replace(os.sep, "/")
        content[0] = site_links(content[0], rel, "docs")


def _resolves(name: str) -> bool:
    """Whether ``name`` is an imported module of pgdecode's, or an attribute of one."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):  # the longest imported prefix, then attributes
        obj: Any = sys.modules.get(".".join(parts[:n]))
        if obj is None:
            continue
        for part in parts[n:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return False
        return name.startswith(PACKAGE + ".")
    return False


def _python_target(module_name: str, target: str, relative: bool) -> str | None:
    """The full name of ``target`` as Python resolves it from ``module_name``, when it is pgdecode's.

    ``Truncate`` in an annotation of ``spark.merge_job`` (kept as a string when the hints cannot
    be evaluated, some names being imported for type checking only) is the class that module
    imports; ``.session`` in a docstring of ``spark.merge_job`` is the sibling module, as in a
    relative import. Sphinx would search every module for either, and find two.
    """
    module = sys.modules.get(module_name)
    if module is None:
        return None
    head = target.partition(".")[0]
    obj = getattr(module, head, None)
    if obj is not None:
        if isinstance(obj, ModuleType):
            owner = obj.__name__
        elif inspect.isclass(obj) or inspect.isfunction(obj):  # not a value: its module would be its class's
            owner = f"{obj.__module__}.{obj.__qualname__}"
        else:
            return None
        full = owner + target[len(head) :]
        return full if owner.rpartition(".")[0] != module_name and _resolves(full) else None
    if relative:
        package = module_name if hasattr(module, "__path__") else module_name.rpartition(".")[0]
        if _resolves(f"{package}.{target}"):
            return f"{package}.{target}"
    return None


def _qualify_references(app: Sphinx, doctree: nodes.document) -> None:
    """Give pgdecode's Python references the target Python itself would pick (:func:`_python_target`)."""
    for node in doctree.findall(addnodes.pending_xref):
        module_name = node.get("py:module")
        if node.get("refdomain") != "py" or not module_name:
            continue
        full = _python_target(module_name, node["reftarget"], bool(node.get("refspecific")))
        if full is not None:
            node["reftarget"] = full
            node["refspecific"] = False


def _documented(env: BuildEnvironment) -> dict[str, set[str]]:
    """The modules each page documented (kept in the environment, which is pickled between builds)."""
    if not hasattr(env, "pgdecode_documented"):
        env.pgdecode_documented = {}  # type: ignore[attr-defined]
    return env.pgdecode_documented  # type: ignore[attr-defined, no-any-return]


def _purge(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    _documented(env).pop(docname, None)


def _merge(app: Sphinx, env: BuildEnvironment, docnames: set[str], other: BuildEnvironment) -> None:
    for docname in docnames:
        if docname in _documented(other):
            _documented(env)[docname] = _documented(other)[docname]


def _check(app: Sphinx, env: BuildEnvironment) -> None:
    documented = set().union(*_documented(env).values())
    package = importlib.import_module(PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{PACKAGE}.{info.name}"
        if info.name.startswith("_") or name in UNDOCUMENTED or name in documented:
            continue
        logger.warning(
            "%s is in no page of the API reference: add `.. pgdecode-package:: %s` to a page under docs/api/, "
            "or list it in UNDOCUMENTED of docs/_ext/pgdecode_docs.py",
            name,
            name,
            type="pgdecode",
            subtype="api",
        )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("pgdecode-package", PackageDirective)
    app.add_directive("pgdecode-config", ConfigDirective)
    app.add_directive("pgdecode-connection-form", ConnectionFormDirective)
    app.connect("source-read", _source_read)
    app.connect("include-read", _include_read)
    app.connect("doctree-read", _qualify_references)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
