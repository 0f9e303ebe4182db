"""pgdecode_incremental run through Airflow itself, against real PostgreSQL, Spark and Delta.

The whole story (five runs, a killed confirm) runs with test_decoding; with pgoutput the DAG runs
the part that depends on the plugin: its slot, the publication handed to the sensor and the
extract, and a prepared transaction carried from one run to the next through the checkpoint. What
both plugins stage and merge beyond that is held by cheaper tests below the DAG:
tests/capture/test_extract_pgoutput.py (both plugins stage the same batch, 2PC included) and
tests/spark/test_postgres_oracle.py (extract, merge and replay against PostgreSQL, per plugin).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_pgdecode.decoding.lsn import Lsn
from pgdecode_testing.compare import compare_table

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ("dag_customers", "dag_orders")


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.fixture()
def incremental(request, pg_cluster, pg_conn, slot_name, tmp_path, monkeypatch, airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    pg_conn.execute(f"drop table if exists {', '.join(TABLES)} cascade; drop publication if exists dag_pub")
    pg_conn.execute(
        "create table dag_customers (id int primary key, name text, note text);"
        " alter table dag_customers alter column note set storage external;"
        " create table dag_orders (id bigint primary key, customer_id int, amount numeric(10,2), status text);"
        f" create publication dag_pub for table {', '.join(TABLES)}"
    )
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")  # a run without changes skips quickly
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["pgdecode_incremental"]
    conf = {
        "slot_name": slot_name,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": [f"public.{t}" for t in TABLES],
        "plugin": request.param,
        "publication": "dag_pub",
    }
    yield dag, conf
    pg_conn.execute("drop publication if exists dag_pub")


def run(dag, conf, **kwargs):
    from airflow.utils.state import DagRunState

    dag_run = dag.test(run_conf=conf, **kwargs)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    return states


def delta_assets(delta_root: str) -> set[str]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    prefix = Path(delta_root).resolve().as_uri() + "/"
    with create_session() as session:
        uris = session.scalars(select(AssetModel.uri).join(AssetEvent, AssetEvent.asset_id == AssetModel.id)).all()
    return {uri[len(prefix) :].replace("/", ".") for uri in uris if uri.startswith(prefix)}


def assert_delta_equals_source(pg_conn, spark, delta_root: str) -> None:
    for table in TABLES:
        result = compare_table(pg_conn, spark, delta_root, "public", table)
        assert result.equal, result.describe()


def slot_row(c, slot: str) -> tuple:
    return c.execute(
        "select plugin, two_phase, confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
    ).fetchone()


def slot_moved_past(c, slot: str, lsn: str) -> bool:
    return c.execute(
        "select confirmed_flush_lsn > %s::pg_lsn from pg_replication_slots where slot_name = %s", (lsn, slot)
    ).fetchone()[0]


@pytest.mark.parametrize("incremental", ["test_decoding"], indirect=True)
def test_three_runs_a_prepared_transaction_and_a_killed_confirm(pg_conn, incremental, spark) -> None:
    dag, conf = incremental
    c = pg_conn
    # run 1 creates the slot: changes made before it are the backfill's business, not this test's
    run(dag, conf)
    c.execute("insert into dag_customers select g, 'c' || g, repeat('x', 3000) from generate_series(1, 20) g")
    c.execute("insert into dag_orders select g, g % 20, g * 2.5, 'new' from generate_series(1, 100) g")
    c.execute("begin; update dag_orders set status = 'paid' where id <= 10; prepare transaction 'dag_pay'")
    states = run(dag, conf)
    assert states["merge"] == "success" and states["confirm"] == "success"
    assert_delta_equals_source(pg_conn, spark, conf["delta_root"])  # the prepared update is not there yet
    # Each Delta table the run changed is published as an Asset, for downstream DAGs.
    assert delta_assets(conf["delta_root"]) == {f"public.{t}" for t in TABLES}

    c.execute("commit prepared 'dag_pay'")
    c.execute("update dag_customers set name = 'renamed' where id = 3")  # note: unchanged TOAST
    c.execute("delete from dag_orders where id > 90")
    run(dag, conf)
    assert_delta_equals_source(pg_conn, spark, conf["delta_root"])
    paid = spark.read.format("delta").load(conf["delta_root"] + "/public/dag_orders").where("status = 'paid'").count()
    assert paid == 10

    # A run killed after the merge and before the confirm: the slot is not advanced and no
    # checkpoint is pushed. The re-run reads the same changes again and merges nothing twice.
    c.execute("update dag_orders set amount = amount + 1 where id <= 5")
    c.execute("insert into dag_orders values (500, 1, 9.99, 'late')")
    states = run(dag, conf, mark_success_pattern="^confirm$")
    slot_before = c.execute(
        "select confirmed_flush_lsn from pg_replication_slots where slot_name = %s", (conf["slot_name"],)
    ).fetchone()[0]
    run(dag, conf)
    slot_after = c.execute(
        "select confirmed_flush_lsn from pg_replication_slots where slot_name = %s", (conf["slot_name"],)
    ).fetchone()[0]
    assert slot_after > slot_before
    assert_delta_equals_source(pg_conn, spark, conf["delta_root"])
    orders = spark.read.format("delta").load(conf["delta_root"] + "/public/dag_orders")
    assert orders.count() == orders.select("id").distinct().count() == 91


@pytest.mark.parametrize("incremental", ["pgoutput"], indirect=True)
def test_pgoutput_runs_carry_a_prepared_transaction(
    pg_conn, pg_cluster, incremental, merge_through_connect, spark, openlineage_events
) -> None:
    """Merged through the Spark Connect server (the other plugin's test runs spark-submit); the
    merge's OpenLineage events name its PostgreSQL inputs and Delta outputs."""
    dag, conf = incremental
    c = pg_conn
    run(dag, conf)  # creates the slot, of the plugin asked for
    plugin, two_phase, created_at = slot_row(c, conf["slot_name"])
    assert (plugin, two_phase) == ("pgoutput", True)
    c.execute("insert into dag_customers select g, 'c' || g, repeat('x', 3000) from generate_series(1, 20) g")
    c.execute("insert into dag_orders select g, g % 20, g * 2.5, 'new' from generate_series(1, 100) g")
    c.execute("begin; update dag_orders set status = 'paid' where id <= 10; prepare transaction 'dag_pay'")
    states = run(dag, conf)
    assert states["merge"] == "success" and states["confirm"] == "success"
    assert slot_moved_past(c, conf["slot_name"], created_at)
    assert_delta_equals_source(pg_conn, spark, conf["delta_root"])  # the prepared update is not there yet
    assert delta_assets(conf["delta_root"]) == {f"public.{t}" for t in TABLES}
    assert_merge_lineage(openlineage_events(), pg_cluster, conf, expected_rows={"dag_customers": 20, "dag_orders": 100})

    c.execute("commit prepared 'dag_pay'")
    c.execute("update dag_customers set name = 'renamed' where id = 3")  # note: unchanged TOAST
    c.execute("delete from dag_orders where id > 90")
    run(dag, conf)
    assert_delta_equals_source(pg_conn, spark, conf["delta_root"])
    orders = spark.read.format("delta").load(conf["delta_root"] + "/public/dag_orders")
    assert orders.where("status = 'paid'").count() == 10
    assert orders.count() == orders.select("id").distinct().count() == 90


def assert_merge_lineage(events: list[dict], pg_cluster, conf: dict, expected_rows: dict[str, int]) -> None:
    """The last merge COMPLETE event: PostgreSQL tables in, the Delta tables changed out, row
    counts, schemas and the pgdecode run facet."""
    merges = [e for e in events if e["eventType"] == "COMPLETE" and e["job"]["name"].endswith(".merge")]
    assert merges, [(e["eventType"], e["job"]["name"]) for e in events]
    event = merges[-1]
    namespace = f"postgres://{pg_cluster.host}:{pg_cluster.port}"
    inputs = {(i["namespace"], i["name"]): i for i in event["inputs"]}
    assert set(inputs) == {(namespace, f"pgdecode_test.public.{t}") for t in expected_rows}
    outputs = {o["name"]: o for o in event["outputs"]}
    delta = Path(conf["delta_root"]).resolve()
    assert set(outputs) == {str(delta / "public" / t) for t in expected_rows}
    assert {o["namespace"] for o in event["outputs"]} == {"file"}
    for table, rows in expected_rows.items():
        assert (
            inputs[(namespace, f"pgdecode_test.public.{table}")]["inputFacets"]["inputStatistics"]["rowCount"] == rows
        )
        assert outputs[str(delta / "public" / table)]["outputFacets"]["outputStatistics"]["rowCount"] == rows
    orders_in = inputs[(namespace, "pgdecode_test.public.dag_orders")]["facets"]["schema"]["fields"]
    assert {f["name"]: f["type"] for f in orders_in}["amount"] == "numeric(10,2)"
    orders_out = outputs[str(delta / "public" / "dag_orders")]["facets"]["schema"]["fields"]
    assert {f["name"]: f["type"] for f in orders_out}["amount"] == "decimal(10,2)"
    facet = event["run"]["facets"]["pgdecode"]
    assert facet["slot"] == conf["slot_name"] and facet["plugin"] == "pgoutput"
    assert facet["changes"] == sum(expected_rows.values())
    assert Lsn.parse(facet["startLsn"]) < Lsn.parse(facet["endLsn"])
