"""The parts of scripts/check_installed.py that decide what passes (the installed-wheel cycles of
``make dist-check`` run it for real): the README's quick start it follows, and the log lines it
refuses in a successful run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def check() -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("check_installed", ROOT / "scripts" / "check_installed.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_installed"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_quick_start_it_follows_is_the_readmes(check: ModuleType) -> None:
    """A dags/ file holding only the import of the shipped DAG, a pgdecode-typed source connection
    (whose Test button runs the readiness checks) and a local Spark connection in JSON form."""
    quick = check.read_quick_start()
    assert quick.dag_file == "pgdecode.py"
    code = [line for line in quick.dag_text.splitlines() if line and not line.startswith("#")]
    assert code == ["from airflow_provider_pgdecode.example_dags.pgdecode_incremental import dag  # noqa: F401"]
    assert quick.connections["pgdecode_default"]["conn_type"] == "pgdecode"
    assert quick.connections["spark_default"] == {"conn_type": "spark", "host": "local[*]"}
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook

    assert (PgDecodeHook.conn_type, PgDecodeHook.default_conn_name) == ("pgdecode", "pgdecode_default")


def test_a_readme_without_the_dag_file_is_refused(check: ModuleType, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text('# x\n\n## Quick start\n\n```sh\nexport AIRFLOW_CONN_X=\'{"conn_type": "spark"}\'\n```\n')
    with pytest.raises(check.InstalledCheckError, match="one dags/ file"):
        check.read_quick_start(readme)


# Lines as the runs printed them before they were quieted (issue 34), and lines they print now.
AIRFLOW_XCOM = (
    "2026-11-27T08:25:08.957766Z [error    ] XCom not found   [airflow.sdk.api.client] dag_id=pgdecode_incremental"
)
SPARK_FILTER = "26/11/27 08:25:32 ERROR DeltaParquetFileFormat: Failed to translate filter IsNotNull(_pg_lsn)"
IVY = [
    ":: resolving dependencies :: org.apache.spark#spark-submit-parent-a72db32a;1.0",
    "Ivy Default Cache set to: /root/.cache/pgdecode/ivy/cache",
    "\t34 artifacts copied, 0 already retrieved (711940kB/1381ms)",
]
PANDAS = "FutureWarning: PySpark does not yet fully support pandas >= 3.0.0."
FINE = [
    "2026-11-27T08:25:10.148582Z [info     ] Merging 1 batch(es): public.orders 181 rows, 0 errors",
    "[2026-11-27T08:25:10] {merge.py:401} INFO - MergeInputError is raised for refused batches only",
    "2026-11-27T08:29:53.805422Z [info     ] Spark-Submit cmd: spark-submit --conf -Dpgdecode.spark.log.level=WARN",
]


def test_the_log_lines_a_successful_run_may_not_hold(check: ModuleType) -> None:
    assert check.BAD_LINE.search(AIRFLOW_XCOM) and check.BAD_LINE.search(SPARK_FILTER)
    assert all(check.IVY_LINE.search(line) for line in IVY)
    assert check.NOISE_LINE.search(PANDAS) and check.NOISE_LINE.search(SPARK_FILTER)
    for line in FINE:
        assert not check.BAD_LINE.search(line) and not check.IVY_LINE.search(line), line
        assert not check.NOISE_LINE.search(line) and not check.WARNING_LINE.search(line), line
