"""The layers of DESIGN.md are held by import-linter's contracts (pyproject.toml), run by `make lint`.

These tests run the same `lint-imports` on the package as it is (every contract kept) and on a
copy with one layer crossed, to show that the contracts would catch it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "airflow_provider_pgdecode",
        tmp_path / "airflow_provider_pgdecode",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_every_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # The decoding core reaches up into the hooks (and so into Airflow).
        ("decoding/lsn.py", "import airflow_provider_pgdecode.hooks.pgdecode", "Layers: each imports only"),
        # The batch format, which the Spark job imports, needs a database driver.
        ("batch/manifest.py", "import psycopg", "The batch format needs no driver"),
        # The Spark job reads a PostgreSQL catalog.
        ("spark/collapse.py", "import airflow_provider_pgdecode.postgres.catalog", "The Spark job needs no Airflow"),
        # Two capture modules import each other.
        ("capture/reconcile.py", "import airflow_provider_pgdecode.capture.extract", "No import cycles"),
    ],
)
def test_a_crossed_layer_breaks_a_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    copy = copy_of_the_package(tmp_path)
    target = copy / "airflow_provider_pgdecode" / module
    target.write_text(target.read_text() + f"\n{line}  # crossing a layer on purpose\n")
    if broken == "No import cycles":
        # The cycle needs the way back too: extract -> reconcile is added beside reconcile -> extract.
        back = copy / "airflow_provider_pgdecode" / "capture" / "extract.py"
        back.write_text(back.read_text() + "\nimport airflow_provider_pgdecode.capture.reconcile\n")
    result = lint_imports(copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout
