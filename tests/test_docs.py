"""The documentation site's sources against the code they quote (no Sphinx build: `make docs` does that).

The operator pages pull their examples out of the example DAGs with ``literalinclude`` between
``# [START howto_operator_...]`` and ``# [END ...]`` comments: a marker renamed or dropped in a
DAG fails here, naming the page, instead of at the next docs build.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from airflow_provider_pgdecode.get_provider_info import get_provider_info
from airflow_provider_pgdecode.utils.config import provider_config

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p for p in [*DOCS.rglob("*.rst"), *DOCS.rglob("*.md")] if "_build" not in p.relative_to(DOCS).parts)

# `.. literalinclude:: path` (reST) or ```{literalinclude} path (MyST), then its options.
DIRECTIVE = re.compile(r"^\s*(?:\.\. literalinclude::|```\{literalinclude\})\s*(\S+)\s*$")
OPTION = re.compile(r"^\s*:([\w-]+):\s*(.*?)\s*$")


@dataclass(frozen=True)
class Include:
    page: Path
    line: int
    path: Path
    start_after: str | None
    end_before: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"


def _includes() -> list[Include]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            match = DIRECTIVE.match(line)
            if not match:
                continue
            options = {}
            for option_line in lines[n + 1 :]:
                option = OPTION.match(option_line)
                if not option:
                    break
                options[option.group(1)] = option.group(2)
            found.append(
                Include(
                    page,
                    n + 1,
                    (page.parent / match.group(1)).resolve(),
                    options.get("start-after"),
                    options.get("end-before"),
                )
            )
    return found


INCLUDES = _includes()


def test_the_operator_pages_quote_the_example_dags() -> None:
    assert PAGES and INCLUDES, f"no literalinclude found under {DOCS}"
    assert all(i.start_after and i.end_before for i in INCLUDES if "example_dags" in i.path.parts)


@pytest.mark.parametrize("include", INCLUDES, ids=str)
def test_every_literalinclude_marker_is_in_its_file(include: Include) -> None:
    assert include.path.is_file(), f"{include}: {include.path} does not exist"
    text = include.path.read_text()
    for marker in (include.start_after, include.end_before):
        if marker is not None:
            assert text.count(marker) == 1, f"{include}: {marker!r} is {text.count(marker)} times in {include.path}"
    if include.start_after and include.end_before:
        start, end = text.index(include.start_after), text.index(include.end_before)
        assert start < end, f"{include}: {include.end_before!r} comes before {include.start_after!r}"
        assert text[start + len(include.start_after) : end].strip(), f"{include}: nothing between the markers"
        # Airflow's convention: [START name] pairs with [END name].
        start_name = re.fullmatch(r"\[START (\S+)\]", include.start_after)
        assert start_name and include.end_before == f"[END {start_name.group(1)}]", include


def test_every_operator_and_sensor_has_a_howto_section() -> None:
    """Each operator and sensor of the provider's metadata has a ``howto/...:<Class>`` label on a page."""
    from airflow.sdk import BaseOperator

    labels = set(re.findall(r"^\.\. _howto/(?:operator|sensor):(\w+):", "\n".join(p.read_text() for p in PAGES), re.M))
    info = get_provider_info()
    classes = {
        name
        for module_name in (m for kind in ("operators", "sensors") for e in info[kind] for m in e["python-modules"])
        for name, cls in inspect.getmembers(importlib.import_module(module_name), inspect.isclass)
        if issubclass(cls, BaseOperator) and cls.__module__ == module_name
    }
    assert classes - labels == set(), "operators or sensors without a section in docs/operators/"


def test_the_configuration_reference_speaks_to_pip_users() -> None:
    """An option's description names no file of the repository: a pip install has none of them."""
    for name, option in provider_config()["pgdecode"]["options"].items():
        paths = re.findall(r"(?<![\w./~])(?:scripts|dags|docs|tests|bench|\.cache)/", option["description"])
        assert not paths, f"[pgdecode] {name}: the description names repository paths {paths}"
