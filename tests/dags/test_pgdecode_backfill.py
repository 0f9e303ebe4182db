"""pgdecode_backfill run through Airflow, against real PostgreSQL, Spark and Delta: an initial load,
a re-snapshot of a table whose Delta copy was deleted (carried out by pgdecode_incremental runs),
and a replay of the retained batches into a fresh Delta root."""

from __future__ import annotations

import json
import shutil
from datetime import UTC
from pathlib import Path

import pytest

from pgdecode_testing.compare import compare_table

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ("bf_customers", "bf_orders")


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.fixture()
def dags(pg_cluster, pg_conn, slot_name, tmp_path, monkeypatch, airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    pg_conn.execute(f"drop table if exists {', '.join(TABLES)} cascade")
    pg_conn.execute(
        "create table bf_customers (id int primary key, name text, since date);"
        " create table bf_orders (id bigint primary key, customer_id int, amount numeric(10,2), status text)"
    )
    pg_conn.execute("insert into bf_customers select g, 'c' || g, date '2026-01-01' + g from generate_series(1, 300) g")
    pg_conn.execute("insert into bf_orders select g, g % 300, g * 1.25, 'new' from generate_series(1, 2000) g")
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    conf = {
        "slot_name": slot_name,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": [f"public.{t}" for t in TABLES],
    }
    return bag.dags["pgdecode_backfill"], bag.dags["pgdecode_incremental"], conf


def run(dag, conf, **kwargs):
    from airflow.utils.state import DagRunState

    dag_run = dag.test(run_conf=conf, **kwargs)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    return states


def assert_equal(pg_conn, spark, delta_root: str) -> None:
    for table in TABLES:
        result = compare_table(pg_conn, spark, delta_root, "public", table)
        assert result.equal, result.describe()


def delta_version(spark, path: str) -> int:
    return spark.sql(f"describe history delta.`{path}`").agg({"version": "max"}).collect()[0][0]


def test_initial_load_resnapshot_and_replay(pg_conn, dags, merge_through_connect, spark, tmp_path) -> None:
    """The merges go through the Spark Connect server (the incremental DAG's test_decoding test runs spark-submit)."""
    backfill, incremental, conf = dags
    orders = f"{conf['delta_root']}/public/bf_orders"

    # initial: slot + consistent copy + merge; changes made afterwards flow through the slot
    states = run(backfill, {**conf, "mode": "initial", "chunk_rows": 700})
    assert states["merge"] == "success"
    assert_equal(pg_conn, spark, conf["delta_root"])
    pg_conn.execute("update bf_orders set status = 'paid' where id % 3 = 0")
    pg_conn.execute("delete from bf_customers where id > 290")
    run(incremental, conf)
    assert_equal(pg_conn, spark, conf["delta_root"])
    # repeating the initial load changes nothing: the slot exists, its load is merged already
    version = delta_version(spark, orders)
    run(backfill, {**conf, "mode": "initial"})
    assert delta_version(spark, orders) == version
    assert_equal(pg_conn, spark, conf["delta_root"])

    # resnapshot of a deleted Delta table, done by the incremental runs while bf_customers flows
    shutil.rmtree(orders)
    request = {
        **conf,
        "mode": "resnapshot",
        "tables": ["public.bf_orders"],
        "chunk_rows": 600,
        "request_id": "rebuild-orders",
    }
    run(backfill, {**request, "wait_seconds": 0})
    pg_conn.execute("update bf_customers set name = name || '!' where id < 10")
    pg_conn.execute("insert into bf_orders values (5000, 1, 1.00, 'during')")
    run(incremental, conf)
    run(incremental, conf)
    assert_equal(pg_conn, spark, conf["delta_root"])
    run(backfill, request)  # the same request: not filed again, and found done
    state = json.loads(
        (Path(conf["staging_uri"]) / conf["slot_name"] / "snapshot-requests" / "rebuild-orders.state.json").read_text()
    )
    assert state["done"] and state["tables"]["public.bf_orders"]["chunks"] >= 4

    # replay every retained batch into a fresh root: the same tables again, and repeatable
    replay_root = str(tmp_path / "replayed")
    run(backfill, {**conf, "mode": "replay", "delta_root": replay_root})
    assert_equal(pg_conn, spark, replay_root)
    version = delta_version(spark, f"{replay_root}/public/bf_orders")
    run(backfill, {**conf, "mode": "replay", "delta_root": replay_root})
    assert delta_version(spark, f"{replay_root}/public/bf_orders") == version


def test_add_table_without_tables_or_slot_fails_clearly(dags) -> None:
    from airflow.utils.state import DagRunState

    backfill, _, conf = dags
    dag_run = backfill.test(run_conf={**conf, "mode": "add-table", "tables": ["public.bf_orders"]})
    assert dag_run.state == DagRunState.FAILED
    prepare = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "prepare")
    assert prepare.state == "failed"


def test_airflow_backfill_accepts_the_dag_and_its_conf(dags) -> None:
    """`airflow backfill create` needs a periodic timetable and params that validate."""
    from datetime import datetime

    from airflow.models.backfill import InvalidBackfillConf, ReprocessBehavior, _do_dry_run
    from airflow.utils.session import create_session

    backfill, _, conf = dags
    backfill.test(run_conf={**conf, "mode": "replay"})  # serialises the DAG into the metadata DB
    window = {"from_date": datetime(2026, 3, 1, tzinfo=UTC), "to_date": datetime(2026, 3, 3, tzinfo=UTC)}
    with create_session() as session:
        runs = list(
            _do_dry_run(
                dag_id="pgdecode_backfill",
                reverse=False,
                reprocess_behavior=ReprocessBehavior.NONE,
                session=session,
                dag_run_conf={**conf, "mode": "replay"},
                **window,
            )
        )
        assert [r.logical_date.day for r in runs] == [1, 2, 3]
        with pytest.raises(InvalidBackfillConf):
            list(
                _do_dry_run(
                    dag_id="pgdecode_backfill",
                    reverse=False,
                    reprocess_behavior=ReprocessBehavior.NONE,
                    session=session,
                    dag_run_conf={**conf, "mode": "reload"},
                    **window,
                )
            )
