"""pgdecode_maintenance run through Airflow (``dag.test()``) on Delta tables merged from staged batches,
its task a client session of the test session's Spark Connect server: the tables are compacted and
vacuumed, their rows and watermarks kept, and the summary reaches XCom."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.spark.merge_job import app_id, merge_batches
from airflow_provider_pgdecode.spark.session import build_connect_session
from airflow_provider_pgdecode.testing.connect_server import LocalConnectServer
from tests.spark.staged import TableChanges, write_batch

pytestmark = [pytest.mark.spark, pytest.mark.slow]

COLUMNS = [("id", "integer", pa.int32()), ("name", "text", pa.string())]
SLOT = "pgdecode_dag_maintenance"


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


def _rows(connect: Any, path: Path) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in connect.read.format("delta").load(str(path)).select("id", "name").collect())


def _return_value(dag_id: str, run_id: str, task_id: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == "return_value",
            )
        ).one()
        return json.loads(row.value) if isinstance(row.value, str) else row.value


def test_the_maintenance_dag_compacts_and_vacuums_every_pgdecode_table(
    spark_connect_server: LocalConnectServer, merge_through_connect: None, airflow_db: None, tmp_path: Path
) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    root = tmp_path / "delta"
    connect = build_connect_session(spark_connect_server.url)
    try:
        lsn = 100
        for run in range(3):  # three merges into each table: three files or more each
            tables = []
            for name in ("dm_a", "dm_b"):
                changes = TableChanges("public", name, COLUMNS)
                for i in range(1, 11):
                    changes.insert(lsn + i, id=run * 10 + i, name=f"{name} {run}")
                if run:
                    changes.delete(lsn + 50, id=run)
                tables.append(changes)
            merge_batches(connect, [write_batch(tmp_path / "staging", SLOT, lsn, lsn + 100, tables)], str(root))
            lsn += 100
        (root / "public" / "not_delta").mkdir()  # a directory without a Delta log is left alone
        before = {name: _rows(connect, root / "public" / name) for name in ("dm_a", "dm_b")}

        bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
        assert not bag.import_errors, bag.import_errors
        dag = bag.dags["pgdecode_maintenance"]
        conf = {"delta_root": str(root), "retention_hours": 0, "allow_short_retention": True, "zorder": True}
        dag_run = dag.test(run_conf=conf)
        states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
        assert dag_run.state == DagRunState.SUCCESS, states

        summary = _return_value("pgdecode_maintenance", dag_run.run_id, "maintenance")
        assert sorted(summary["tables"]) == ["public.dm_a", "public.dm_b"]
        for name in ("dm_a", "dm_b"):
            entry = summary["tables"][f"public.{name}"]
            assert entry["files_before"] >= 3 and entry["files_after"] == 1, entry
            assert entry["files_removed"] >= 3 and entry["zorder_by"] == ["id"]
            assert entry["transactions_before"] == entry["transactions_after"] == {app_id(SLOT): lsn}
            assert _rows(connect, root / "public" / name) == before[name]
    finally:
        connect.stop()
