"""DAGs generated from a sources file, run through Airflow (``dag.test()``) against real
PostgreSQL, Spark and Delta: three sources (two databases of the session's cluster and one of a
second cluster; test_decoding and pgoutput; table patterns, an exclusion, per-table options, a
cron and an event schedule), one run of each incremental DAG after changes that include prepared
transactions, then each source's Delta root holds exactly its own tables, each equal to its
PostgreSQL table. The merges are client sessions of the test session's Spark Connect server."""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def airflow_db() -> None:
    from airflow.utils import db

    db.resetdb()


@pytest.fixture(scope="module")
def second_cluster() -> Iterator[ThrowawayCluster]:
    """Another PostgreSQL cluster: a source that shares nothing with the session's."""
    with ThrowawayCluster() as cluster:
        yield cluster


ALPHA = """
    CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), status text);
    CREATE TABLE order_items (id int PRIMARY KEY, order_id int, sku text, qty int);
    CREATE TABLE order_archive (id int PRIMARY KEY, note text);
    CREATE TABLE customers (id int PRIMARY KEY, name text);
"""
BETA = """
    CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total numeric(12,2));
    CREATE TABLE accounts (id int PRIMARY KEY, owner text, balance bigint);
    CREATE TABLE events (at timestamptz, kind text);
    CREATE TABLE scratch (id int PRIMARY KEY);
    CREATE PUBLICATION beta_pub FOR TABLE orders, accounts, events;
"""
GAMMA = """
    CREATE SCHEMA sales;
    CREATE TABLE sales.invoices (id int PRIMARY KEY, amount numeric(10,2));
    CREATE TABLE sales.refunds (id int PRIMARY KEY, invoice_id int);
    CREATE TABLE public.orders (id int PRIMARY KEY);
"""
EXPECTED = {
    "alpha": {("public", "orders"), ("public", "order_items")},
    "beta": {("public", "orders"), ("public", "accounts"), ("public", "events")},
    "gamma": {("sales", "invoices"), ("sales", "refunds")},
}


def sources_file(path: Path, slots: dict[str, str], data_dir: Path) -> Path:
    path.write_text(
        textwrap.dedent(
            f"""\
            defaults:
              pool: pgdecode_spark
              wait_seconds: 5
            sources:
              alpha:
                postgres_conn_id: alpha_db
                slot: {slots["alpha"]}
                plugin: test_decoding
                tables: [public.orders, "public.order_*"]
                exclude_tables: [public.order_archive]
                delta_root: {data_dir}/alpha_delta
              beta:
                postgres_conn_id: beta_db
                slot: {slots["beta"]}
                plugin: pgoutput
                publication: beta_pub
                table_options:
                  public.events: {{mode: append_only}}
                schedule: "@hourly"
              gamma:
                postgres_conn_id: gamma_db
                slot: {slots["gamma"]}
                plugin: test_decoding
                tables: ["sales.*"]
                schedule: event
            """
        )
    )
    return path


def changes(alpha: psycopg.Connection[Any], beta: psycopg.Connection[Any], gamma: psycopg.Connection[Any]) -> None:
    """Inserts, updates and deletes in every table (the ones left out too), and prepared
    transactions: committed ones reach Delta, a rolled-back one never does."""
    alpha.execute("INSERT INTO orders SELECT g, g * 1.5, 'new' FROM generate_series(1, 40) g")
    alpha.execute("INSERT INTO order_items SELECT g, g % 40 + 1, 'sku' || g, g % 3 FROM generate_series(1, 80) g")
    alpha.execute("INSERT INTO order_archive SELECT g, 'old' FROM generate_series(1, 10) g")
    alpha.execute("INSERT INTO customers SELECT g, 'c' || g FROM generate_series(1, 10) g")
    alpha.execute("BEGIN; UPDATE orders SET status = 'paid' WHERE id <= 10; PREPARE TRANSACTION 'src_alpha_pay'")
    alpha.execute("COMMIT PREPARED 'src_alpha_pay'")
    alpha.execute("BEGIN; DELETE FROM order_items WHERE id > 70; PREPARE TRANSACTION 'src_alpha_undo'")
    alpha.execute("ROLLBACK PREPARED 'src_alpha_undo'")
    alpha.execute("DELETE FROM order_items WHERE id <= 5; UPDATE order_archive SET note = 'x'")

    beta.execute("INSERT INTO orders SELECT g, 'cust' || g, g * 10 FROM generate_series(1, 30) g")
    beta.execute("INSERT INTO accounts SELECT g, 'o' || g, g * 100 FROM generate_series(1, 20) g")
    beta.execute("INSERT INTO events SELECT now(), 'login' FROM generate_series(1, 3)")  # keyless, append_only
    beta.execute("INSERT INTO events SELECT now(), 'login' FROM generate_series(1, 2)")  # identical rows stay apart
    beta.execute("INSERT INTO scratch SELECT g FROM generate_series(1, 5) g")
    beta.execute("BEGIN; UPDATE accounts SET balance = balance - 1 WHERE id = 1; PREPARE TRANSACTION 'src_beta_pay'")
    beta.execute("COMMIT PREPARED 'src_beta_pay'")
    beta.execute("DELETE FROM orders WHERE id > 25; UPDATE orders SET total = 0 WHERE id = 1")

    gamma.execute("INSERT INTO sales.invoices SELECT g, g * 3 FROM generate_series(1, 25) g")
    gamma.execute("INSERT INTO sales.refunds SELECT g, g FROM generate_series(1, 5) g")
    gamma.execute("INSERT INTO public.orders SELECT g FROM generate_series(1, 5) g")
    gamma.execute("UPDATE sales.invoices SET amount = 0 WHERE id = 2; DELETE FROM sales.refunds WHERE id = 5")


def confirmed(conn: psycopg.Connection[Any], slot: str) -> str:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return str(row.fetchone()[0])


def delta_tables(root: Path) -> set[tuple[str, str]]:
    return {
        (schema.name, table.name)
        for schema in root.iterdir()
        if schema.is_dir() and not schema.name.startswith("_")
        for table in schema.iterdir()
        if (table / "_delta_log").is_dir()
    }


def test_each_generated_dag_loads_its_own_tables(
    pg_cluster: ThrowawayCluster,
    second_cluster: ThrowawayCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    airflow_db: None,
    merge_through_connect: None,
    connect: Any,
) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    suffix = uuid.uuid4().hex[:8]
    databases = {"alpha": f"src_alpha_{suffix}", "beta": f"src_beta_{suffix}", "gamma": "src_gamma"}
    clusters = {"alpha": pg_cluster, "beta": pg_cluster, "gamma": second_cluster}
    slots = {name: f"src_{name}_{suffix}" for name in databases}
    conns: dict[str, psycopg.Connection[Any]] = {}
    try:
        for name, ddl, plugin in (
            ("alpha", ALPHA, "test_decoding"),
            ("beta", BETA, "pgoutput"),
            ("gamma", GAMMA, "test_decoding"),
        ):
            cluster = clusters[name]
            cluster.create_database(databases[name])
            conns[name] = conn = cluster.connect(databases[name])
            conn.execute(ddl)
            # the slot before the changes (the first run's ensure_slot would create it alike: two-phase)
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s, false, true)", (slots[name], plugin))
            monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}_DB", cluster.airflow_conn_json(databases[name]))
        data_dir = tmp_path / "data"
        monkeypatch.setenv("AIRFLOW__PGDECODE__DATA_DIR", str(data_dir))
        monkeypatch.setenv("PGDECODE_SOURCES", str(sources_file(tmp_path / "sources.yaml", slots, data_dir)))
        changes(conns["alpha"], conns["beta"], conns["gamma"])
        before = {name: confirmed(conns[name], slots[name]) for name in conns}

        bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
        assert not bag.import_errors, bag.import_errors
        roots = {
            "alpha": data_dir / "alpha_delta",
            "beta": data_dir / "beta" / "delta",
            "gamma": data_dir / "gamma" / "delta",
        }
        for name in ("alpha", "beta", "gamma"):
            dag = bag.dags[f"pgdecode_{name}_incremental"]
            assert dag.get_task("merge").pool == "pgdecode_spark"  # dag.test runs tasks whatever their pool
            dag_run = dag.test()
            states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
            assert dag_run.state == DagRunState.SUCCESS, (name, states)
            assert states["merge"] == states["confirm"] == "success", (name, states)

        for name, root in roots.items():
            # exactly its own tables: not the ones left out, not another source's of the same name
            assert delta_tables(root) == EXPECTED[name], name
            for schema, table in sorted(EXPECTED[name]):
                result = compare_table(conns[name], connect, str(root), schema, table)
                assert result.equal, result.describe()
                assert result.source_rows > 0, result.describe()
            moved = conns[name].execute(
                "SELECT %s::pg_lsn > %s::pg_lsn", (confirmed(conns[name], slots[name]), before[name])
            )
            assert moved.fetchone() == (True,), name  # each DAG confirmed its own slot
        staged = {p.name for p in (data_dir / "beta" / "staging").iterdir()}
        assert staged == {slots["beta"]}  # staging under <data_dir>/<name>/staging, by slot
        events = connect.read.format("delta").load(str(roots["beta"] / "public" / "events")).count()
        assert events == 5
    finally:
        for name, conn in conns.items():
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (slots[name],),
            )
            conn.close()
