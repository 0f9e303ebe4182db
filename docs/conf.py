"""Sphinx configuration of the pgdecode documentation site (``make docs``).

The guides (``docs/*.md``) are pages as they are (myst-parser); the API reference is generated
from the docstrings (autodoc, autosummary) by the ``pgdecode-package`` directive of
``_ext/pgdecode_docs.py``, which also generates the ``[pgdecode]`` configuration reference from
``provider_config()`` at build time. Built with ``-W --keep-going``: every warning fails the build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path[:0] = [str(DOCS / "_ext"), str(REPO)]

# Importing the provider imports Airflow, which reads (and may create) the configuration of its
# home: one of the docs build's own, so that building the docs never touches the user's Airflow.
AIRFLOW_HOME = DOCS / "_build" / "airflow-home"
AIRFLOW_HOME.mkdir(parents=True, exist_ok=True)
os.environ["AIRFLOW_HOME"] = str(AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"

from airflow_provider_pgdecode import __version__  # noqa: E402

project = "airflow-provider-pgdecode"
author = "pgdecode developers"
copyright = "pgdecode developers"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "pgdecode_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "_extra"]

# -- myst: the markdown guides as they are ------------------------------------------------------
# GitHub-style anchors for headings, so that links such as merge.md#performance resolve as they
# do on GitHub.
myst_heading_anchors = 4

# -- API reference ------------------------------------------------------------------------------
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "mixed"
# A method without a docstring of its own (execute, poke ...) is left out rather than shown with
# the docstring of Airflow's base class, which describes the base class.
autodoc_inherit_docstrings = False
autosummary_generate = False  # no stub files: the pgdecode-package directive writes nothing to disk

# Cross-references to objects outside this package (airflow, pyspark, psycopg, pyarrow) cannot
# resolve: intersphinx needs their inventories from the internet, which the build does not reach.
# Not nitpicky, so such a reference renders as plain text instead of failing the build.
nitpicky = False

# No warning type is suppressed: every warning the build met had a fix (docs/_ext/pgdecode_docs.py
# resolves the cross-references Sphinx found ambiguous the way Python does).
suppress_warnings: list[str] = []

# -- HTML ---------------------------------------------------------------------------------------
html_theme = "furo"
# Files served as they are, at the site's root: the JSON Schema of the pgdecode run facet
# (spec/facets/<version>/PgDecodeRunFacet.json, docs/lineage.md).
html_extra_path = ["_extra"]
html_title = f"pgdecode {release}"
html_theme_options = {
    "source_repository": "https://github.com/pgdecode/airflow-provider-pgdecode/",
    "source_branch": "main",
    "source_directory": "docs/",
}
