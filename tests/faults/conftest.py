"""Fixtures of the fault suite: a child Airflow home per test, tables and a unique slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from tests.conftest import rollback_prepared
from tests.faults.dagproc import DagProcess, airflow_env


@pytest.fixture
def dag_process(
    pg_cluster: ThrowawayCluster, pg_dsn: str, slot_name: str, tmp_path: Path, spark: Any
) -> Iterator[DagProcess]:
    """``pgdecode_incremental`` cycles in child process groups, over ``fk_*`` tables and a fresh slot.

    Depends on ``spark`` so that Delta's jars are in the Ivy cache before the first spark-submit.
    """
    home = tmp_path / "airflow"
    home.mkdir()
    env = airflow_env(home, pg_cluster.airflow_conn_json("pgdecode_test"))
    conf = {
        "slot_name": slot_name,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": ["public.fk_accounts", "public.fk_events"],
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    yield DagProcess(env, conf, logs)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rollback_prepared(conn)
        conn.execute("drop table if exists fk_accounts, fk_events")


def assert_caught_up(conn: psycopg.Connection[Any], spark: Any, delta_root: str, tables: tuple[str, ...]) -> None:
    """Every Delta table equals its source as a multiset, and holds each key once."""
    for table in tables:
        result = compare_table(conn, spark, delta_root, "public", table)
        assert result.equal, result.describe()
        frame = spark.read.format("delta").load(f"{delta_root}/public/{table}")
        assert frame.count() == frame.select("id").distinct().count(), f"{table}: duplicate keys in Delta"


def slot_position(conn: psycopg.Connection[Any], slot: str) -> str | None:
    row = conn.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,))
    found = row.fetchone()
    return None if found is None else found[0]
