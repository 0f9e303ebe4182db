"""pgdecode_incremental run by Airflow with staging and Delta both on a real S3-compatible server.

The oracle is PostgreSQL: after each run every Delta table equals its source as a multiset. The
workload carries a prepared transaction across runs, a TRUNCATE, an unchanged TOAST value and a
key change; one run is killed after the merge and before the confirm, and the re-run doubles
nothing. The staging root and the Delta root are ``s3://`` locations reached through an Airflow
``aws`` connection (``storage_conn_id``); nothing of either is on the local disk. Both DAGs
merge through a Spark Connect server reading the lake with its own S3A settings (spark-submit with
hadoop-aws resolved by Ivy, as users' runs do, merges on S3 in tests/spark/test_spark_submit.py and
tests/spark/test_object_store.py: five spark-submits here cost ten minutes of CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.batch.storage import Storage
from pgdecode_testing.compare import compare_table
from pgdecode_testing.s3_server import SECRET_KEY
from tests.conftest import full_only, full_only_test
from tests.dags.test_pgdecode_incremental import airflow_db, run  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.s3, pytest.mark.slow]

TABLES = ("s3_customers", "s3_orders")


def dags_on_s3(pg_cluster, s3_server, monkeypatch):
    """The repository's DAGs, with the source, Spark and the S3 server's ``aws`` connection
    (``pgdecode_lake``) in the environment."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_LAKE", s3_server.airflow_conn_json())
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    # Runs on S3 resolve their packages (Delta's and hadoop-aws) through Ivy, as users' runs do.
    monkeypatch.delenv("PGDECODE_DELTA_JARS", raising=False)
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    return bag


@pytest.fixture(
    params=[
        "test_decoding",
        full_only("pgoutput", "the storage path is the same for both plugins (local runs test both)"),
    ]
)
def incremental_s3(request, pg_cluster, pg_conn, slot_name, s3_server, s3_bucket, monkeypatch, airflow_db):  # noqa: F811
    pg_conn.execute(f"drop table if exists {', '.join(TABLES)} cascade; drop publication if exists s3_pub")
    pg_conn.execute(
        "create table s3_customers (id int primary key, name text, note text);"
        " alter table s3_customers alter column note set storage external;"
        " create table s3_orders (id bigint primary key, customer_id int, amount numeric(10,2), status text);"
        f" create publication s3_pub for table {', '.join(TABLES)}"
    )
    bag = dags_on_s3(pg_cluster, s3_server, monkeypatch)
    conf = {
        "slot_name": slot_name,
        "staging_uri": f"{s3_bucket}/staging",
        "delta_root": f"{s3_bucket}/delta",
        "storage_conn_id": "pgdecode_lake",
        "tables": [f"public.{t}" for t in TABLES],
        "plugin": request.param,
        "publication": "s3_pub",
    }
    yield bag.dags["pgdecode_incremental"], conf, Storage(s3_bucket, s3_server.settings)
    pg_conn.execute("drop publication if exists s3_pub")


@pytest.fixture
def s3_object_spark(spark, s3_server):
    """The shared Spark session, reading the S3 server through s3a:// (hadoop-aws is on its classpath)."""
    from airflow_provider_pgdecode.spark.session import configure_object_store

    configure_object_store(spark, s3_server.settings)
    return spark


def assert_equal(pg_conn, spark, delta_root: str) -> None:
    for table in TABLES:
        result = compare_table(pg_conn, spark, delta_root, "public", table)
        assert result.equal, result.describe()


@full_only_test(
    "the local oracle runs this workload (tests/spark/test_postgres_oracle.py); the S3 path is run by the backfill"
    " DAG below, tests/spark/test_object_store.py and the S3 cluster of tests/spark/test_spark_submit.py"
)
def test_the_oracle_on_s3(pg_conn, incremental_s3, merge_through_connect, s3_object_spark, tmp_path) -> None:
    dag, conf, bucket = incremental_s3
    spark = s3_object_spark
    c = pg_conn
    run(dag, conf)  # creates the slot
    c.execute("insert into s3_customers select g, 'c' || g, repeat('x', 3000) from generate_series(1, 20) g")
    c.execute("insert into s3_orders select g, g % 20, g * 2.5, 'new' from generate_series(1, 100) g")
    c.execute("begin; update s3_orders set status = 'paid' where id <= 10; prepare transaction 's3_pay'")
    run(dag, conf)
    assert_equal(c, spark, conf["delta_root"])  # the prepared update is not there yet

    c.execute("commit prepared 's3_pay'")
    c.execute("update s3_customers set name = 'renamed' where id = 3")  # note: unchanged TOAST
    c.execute("update s3_customers set id = 1003 where id = 4")  # a key change
    c.execute("begin; truncate s3_orders; insert into s3_orders values (1, 1, 1.00, 'after truncate'); commit")
    run(dag, conf)
    assert_equal(c, spark, conf["delta_root"])

    # A killed confirm and its re-run are test_pgdecode_incremental's (local storage); a replay of
    # every batch on the object store is test_initial_add_table_and_replay_on_s3's.

    # Everything went through the object store: committed batches and Delta logs are there.
    staging = bucket.child("staging")
    batches = list_batches(staging, conf["slot_name"])
    assert batches and all(b.startswith("s3://") for b in batches)
    assert all(BatchManifest.read(staging.at(b)).slot == conf["slot_name"] for b in batches)
    assert bucket.is_file("delta/public/s3_orders/_delta_log/00000000000000000000.json")
    # The store's secret is in no staged object, no Delta file, and no task log of these runs.
    assert not [name for name in bucket.walk_files() if SECRET_KEY.encode() in bucket.read_bytes(name)]
    logs = Path(dag_logs_folder())
    assert not any(SECRET_KEY in p.read_text(errors="replace") for p in logs.rglob("*.log") if p.is_file())


def dag_logs_folder() -> str:
    from airflow.configuration import conf as airflow_conf

    return airflow_conf.get("logging", "base_log_folder")


@pytest.fixture
def backfill_s3(pg_cluster, pg_conn, slot_name, s3_server, s3_bucket, monkeypatch, airflow_db):  # noqa: F811
    pg_conn.execute("drop table if exists s3_bf_customers, s3_bf_orders, s3_bf_late cascade")
    pg_conn.execute(
        "create table s3_bf_customers (id int primary key, name text);"
        " create table s3_bf_orders (id bigint primary key, customer_id int, amount numeric(10,2));"
        " create table s3_bf_late (id int primary key, label text);"
        " insert into s3_bf_customers select g, 'c' || g from generate_series(1, 300) g;"
        " insert into s3_bf_orders select g, g % 300, g * 1.5 from generate_series(1, 2000) g;"
        " insert into s3_bf_late select g, 'l' || g from generate_series(1, 500) g"
    )
    bag = dags_on_s3(pg_cluster, s3_server, monkeypatch)
    conf = {
        "slot_name": slot_name,
        "staging_uri": f"{s3_bucket}/staging",
        "delta_root": f"{s3_bucket}/delta",
        "storage_conn_id": "pgdecode_lake",
        "tables": ["public.s3_bf_customers", "public.s3_bf_orders", "public.s3_bf_late"],
    }
    return bag.dags["pgdecode_backfill"], bag.dags["pgdecode_incremental"], conf


def test_initial_add_table_and_replay_on_s3(pg_conn, backfill_s3, merge_through_connect, s3_object_spark) -> None:
    backfill, incremental, conf = backfill_s3
    spark = s3_object_spark
    tables = ("s3_bf_customers", "s3_bf_orders", "s3_bf_late")

    def equal(root: str, names: tuple[str, ...]) -> None:
        for table in names:
            result = compare_table(pg_conn, spark, root, "public", table)
            assert result.equal, result.describe()

    # initial: the slot and a consistent copy of two tables, staged on S3 and merged into Delta on S3
    run(backfill, {**conf, "mode": "initial", "tables": conf["tables"][:2], "chunk_rows": 700})
    equal(conf["delta_root"], tables[:2])
    # add-table: s3_bf_late's rows predate the slot; the request (on S3) is copied by the next run
    run(backfill, {**conf, "mode": "add-table", "tables": ["public.s3_bf_late"], "chunk_rows": 200, "wait_seconds": 0})
    pg_conn.execute("update s3_bf_late set label = 'changed' where id <= 10")
    pg_conn.execute("update s3_bf_orders set amount = 0 where id % 7 = 0")
    run(incremental, conf)
    run(incremental, conf)
    equal(conf["delta_root"], tables)
    # replay every retained batch on S3 into a fresh Delta root on S3
    replay_root = conf["delta_root"].replace("/delta", "/replayed")
    run(backfill, {**conf, "mode": "replay", "delta_root": replay_root})
    equal(replay_root, tables)
