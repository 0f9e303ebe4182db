"""The README's map of the package stays whole: its table of parts names every module, and the
paths its "Where to change…" answers give exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "airflow_provider_pgdecode"
README = (ROOT / "README.md").read_text(encoding="utf-8")
FOLDERS = (
    "decoding",
    "batch",
    "postgres",
    "capture",
    "spark",
    "hooks",
    "cycle",
    "operators",
    "sensors",
    "triggers",
    "notifications",
    "ui",
    "utils",
)


def parts_table() -> str:
    start = README.index("| layer | folder | holds |")
    return README[start : README.index("\n\n", start)]


def where_to_change() -> str:
    start = README.index("Where to change…")
    return README[start : README.index("\n## ", start)]


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_table_of_parts_names_every_module_of_a_folder(folder: str) -> None:
    row = next(line for line in parts_table().splitlines() if f"`{folder}/`" in line)
    modules = sorted(p.name for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py")
    assert modules
    assert [m for m in modules if f"`{m}`" not in row] == []


def test_every_path_in_where_to_change_exists() -> None:
    section = where_to_change()
    paths = set(re.findall(r"`((?:airflow_provider_pgdecode|tests|docs)/[\w/.<>-]+)`", section))
    # A path given after a full one is relative to the package (`operators/confirm.py`).
    paths |= {
        f"airflow_provider_pgdecode/{p}"
        for p in re.findall(r"`((?:decoding|batch|postgres|capture|spark|hooks|operators|utils)/[\w/.-]+)`", section)
    }
    paths |= set(re.findall(r"\]\(((?:docs)/[\w/.-]+?)(?:#[\w-]+)?\)", section))
    assert len(paths) >= 15, sorted(paths)
    concrete = [p for p in paths if "<" not in p]
    assert [p for p in concrete if not (ROOT / p).exists()] == []


def test_the_anchors_of_merge_md_it_links_exist() -> None:
    merge = (ROOT / "docs" / "merge.md").read_text(encoding="utf-8")
    anchors = {
        re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-") for h in re.findall(r"^#+ (.+)$", merge, re.M)
    }
    for anchor in re.findall(r"docs/merge\.md#([\w-]+)", where_to_change()):
        assert anchor in anchors
