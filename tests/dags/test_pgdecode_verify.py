"""pgdecode_verify run through Airflow against real PostgreSQL, Spark and Delta: equal under a
concurrent writer; after one Delta row is changed by hand, the run fails and names that key.

Its merge and verify tasks run as client sessions of the test session's Spark Connect server
(tests/operators/test_verify.py runs the verify job by spark-submit too)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import psycopg
import pytest

from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.capture.verify import verify_area
from airflow_provider_pgdecode.spark.merge_job import merge_batches

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ["public.vd_accounts", "public.vd_moves"]


class Writer(threading.Thread):
    """Short transactions on both tables (inserts, updates, deletes) until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.ops = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(5)
        next_id = 1_000
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop.is_set():
                    r, k = rng.random(), rng.randint(1, 150)  # accounts 151-200 stay as loaded
                    if r < 0.4:
                        next_id += 1
                        with c.transaction():
                            c.execute("insert into vd_moves values (%s, %s, 5.00)", (next_id, k))
                            c.execute("update vd_accounts set balance = balance + 5 where id = %s", (k,))
                    elif r < 0.7:
                        c.execute("update vd_accounts set owner = owner || '.' where id = %s", (k,))
                    elif r < 0.8:
                        c.execute("delete from vd_moves where id = (select min(id) from vd_moves)")
                    else:
                        next_id += 1
                        c.execute("insert into vd_accounts values (%s, 'late', 0) on conflict do nothing", (next_id,))
                    self.ops += 1
                    self.stop.wait(0.002)
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.fixture()
def pipeline(pg_cluster, pg_conn, pg_dsn, slot_name, tmp_path, monkeypatch, airflow_db, spark):
    """A running pipeline: the slot and its initial load merged into Delta; yields (dag, conf)."""
    from airflow.dag_processing.dagbag import DagBag

    c = pg_conn
    c.execute("drop table if exists vd_accounts, vd_moves")
    c.execute(
        "create table vd_accounts (id int primary key, owner text, balance numeric(12,2));"
        " create table vd_moves (id bigint primary key, account int, amount numeric(10,2))"
    )
    c.execute("insert into vd_accounts select g, 'owner ' || g, 100 from generate_series(1, 200) g")
    c.execute("insert into vd_moves select g, g % 200 + 1, 1.5 from generate_series(1, 500) g")
    staging, delta = tmp_path / "staging", str(tmp_path / "delta")
    with create_slot_with_snapshot(pg_dsn, slot_name) as snapshot:
        load = stage_snapshot(pg_dsn, snapshot.snapshot_name, snapshot.consistent_lsn, slot_name, staging, TABLES)
    merge_batches(spark, [str(load.path)], delta)

    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    conf = {"slot_name": slot_name, "staging_uri": str(staging), "delta_root": delta, "tables": TABLES}
    return bag.dags["pgdecode_verify"], conf


def latest_report(conf) -> dict:
    reports = sorted(Path(verify_area(conf["staging_uri"], conf["slot_name"]).root).glob("report-*.json"))
    assert reports
    return json.loads(reports[-1].read_text())


def verify_events(staging_uri: str, slot: str) -> list[dict]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    uri = Path(verify_area(staging_uri, slot).root).resolve().as_uri()
    with create_session() as session:
        rows = session.scalars(
            select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id).where(AssetModel.uri == uri)
        ).all()
        return [dict(event.extra) for event in rows]


def test_equal_under_a_concurrent_writer_then_names_a_row_changed_in_delta(
    pg_conn, pg_dsn, pipeline, merge_through_connect, spark
) -> None:
    from airflow.utils.state import DagRunState
    from delta.tables import DeltaTable

    dag, conf = pipeline
    slot_before = pg_conn.execute(
        "select confirmed_flush_lsn from pg_replication_slots where slot_name = %s", (conf["slot_name"],)
    ).fetchone()[0]
    writer = Writer(pg_dsn)
    writer.start()
    try:
        while writer.ops < 50 and writer.error is None:
            writer.stop.wait(0.01)
        ops_before = writer.ops
        dag_run = dag.test(run_conf=conf)
        ops_during = writer.ops - ops_before
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None, writer.error
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    assert ops_during > 0  # the writer went on during the run

    report = latest_report(conf)
    assert report["equal"] and report["differing_tables"] == []
    for table in TABLES:
        assert report["tables"][table]["source_rows"] == report["tables"][table]["delta_rows"] > 0
    events = verify_events(conf["staging_uri"], conf["slot_name"])
    assert [(e["equal"], e["lsn"], e["tables_checked"]) for e in events] == [(True, report["lsn"], 2)]
    # The verify run does not advance the pipeline's slot, and its copy is gone.
    slot_after = pg_conn.execute(
        "select confirmed_flush_lsn from pg_replication_slots where slot_name = %s", (conf["slot_name"],)
    ).fetchone()[0]
    assert slot_after == slot_before
    assert not list(Path(verify_area(conf["staging_uri"], conf["slot_name"]).root).glob("pgdecode_verify_*"))

    # One Delta row changed by hand: the next verify fails and names that table and key. (The
    # next verify re-merges what the writer did after the first one's LSN: an account it never
    # touches keeps the change.)
    path = f"{conf['delta_root']}/public/vd_accounts"
    DeltaTable.forPath(spark, path).update("id = 170", {"owner": "'tampered'"})
    dag_run = dag.test(run_conf=conf)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.FAILED, states
    assert states["merge"] == "success" and states["verify"] == "failed"
    report = latest_report(conf)
    assert report["differing_tables"] == ["public.vd_accounts"]
    accounts = report["tables"]["public.vd_accounts"]
    assert accounts["differing_keys"] == 1
    assert accounts["keys"] == [
        {"key": {"id": 170}, "source_rows": 1, "delta_rows": 1, "difference": "rows differ", "columns": ["owner"]}
    ]
    assert len(verify_events(conf["staging_uri"], conf["slot_name"])) == 1  # a failed verify emits nothing
