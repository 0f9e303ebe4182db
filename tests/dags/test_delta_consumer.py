"""A DAG scheduled on the documented Asset of a Delta table is queued after a merge changed it.

Real Airflow: the example consumer DAG is parsed from dags/ and written to the metadata DB,
pgdecode_backfill in replay mode (no PostgreSQL: it re-merges a staged batch, a real spark-submit)
runs through ``dag.test()``, and Airflow's asset-DAG-run queue then holds a row for the consumer. The Asset the merge emits (through its AssetAlias) and
the one the consumer schedules on must be one record (name and URI) for that to happen.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.operators.merge import delta_table_asset
from tests.spark.staged import TableChanges, write_batch

pytestmark = [pytest.mark.spark, pytest.mark.slow]

DAGS = Path(__file__).resolve().parents[2] / "dags"
CONSUMER = "pgdecode_delta_consumer"


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


def test_a_merge_queues_the_dag_scheduled_on_the_documented_asset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: None
) -> None:
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.asset import AssetActive, AssetDagRunQueue, AssetEvent, AssetModel, DagScheduleAssetReference
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from sqlalchemy import select, update

    monkeypatch.setenv("AIRFLOW__PGDECODE__DATA_DIR", str(tmp_path))  # the consumer's Delta root: <data_dir>/delta
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    documented = delta_table_asset(tmp_path / "delta", "public", "orders")
    assert documented.name == documented.uri == (tmp_path / "delta" / "public" / "orders").resolve().as_uri()

    def bag_of(name: str) -> DagBag:
        bag = DagBag(dag_folder=str(DAGS / f"{name}.py"))
        assert not bag.import_errors, bag.import_errors
        return bag

    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
    sync_bag_to_db(bag_of(CONSUMER), "dags-folder", None)
    with create_session() as session:
        session.execute(update(DagModel).where(DagModel.dag_id == CONSUMER).values(is_paused=False))

    backfill = bag_of("pgdecode_backfill").dags["pgdecode_backfill"]
    orders = TableChanges("public", "orders", [("id", "integer", pa.int32()), ("status", "text", pa.string())])
    orders.insert(100, id=1, status="new").insert(101, id=2, status="paid")
    batch = write_batch(tmp_path / "staging", "slot_consumer", 10, 101, [orders])
    conf = {
        "mode": "replay",
        "slot_name": "slot_consumer",
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
    }
    dag_run = backfill.test(run_conf=conf)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    assert Path(batch).is_dir() and (tmp_path / "delta" / "public" / "orders" / "_delta_log").is_dir()

    with create_session() as session:
        assets = session.execute(select(AssetModel.id, AssetModel.name).where(AssetModel.uri == documented.uri)).all()
        assert [name for _, name in assets] == [documented.name]  # one record: the merge's and the consumer's
        asset_id = assets[0][0]
        consumers = session.scalars(
            select(DagScheduleAssetReference.dag_id).where(DagScheduleAssetReference.asset_id == asset_id)
        ).all()
        assert consumers == [CONSUMER]
        events = session.scalars(select(AssetEvent.extra).where(AssetEvent.asset_id == asset_id)).all()
        assert [(e["inserted"], e["updated"], e["deleted"]) for e in events] == [(2, 0, 0)]
        queued = session.scalars(
            select(AssetDagRunQueue.target_dag_id).where(AssetDagRunQueue.asset_id == asset_id)
        ).all()
        assert queued == [CONSUMER]
        active = session.scalars(select(AssetActive.name).where(AssetActive.uri == documented.uri)).all()
        assert active == [documented.name]
