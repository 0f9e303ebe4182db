"""Fixtures of the sensor tests: the source connection, and a cluster whose slots lose WAL quickly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pgdecode_testing.postgres_cluster import ThrowawayCluster


@pytest.fixture
def source_conn(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``pgdecode_default`` pointing at the shared test database."""
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    return "pgdecode_default"


@pytest.fixture
def small_wal_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThrowawayCluster]:
    """A cluster of its own with max_slot_wal_keep_size = 1MB, so a slot can be made unreserved or lost.

    ``pgdecode_default`` points at its ``postgres`` database. Separate from the shared cluster:
    its CHECKPOINTs would invalidate other tests' slots.
    """
    with ThrowawayCluster({"max_slot_wal_keep_size": "1MB"}) as cluster:
        monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", cluster.airflow_conn_json("postgres"))
        yield cluster


def _outgrow_wal(conn: psycopg.Connection[Any], slot: str, until: str) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS wal_filler (id serial PRIMARY KEY)")
    for _ in range(8):
        conn.execute("INSERT INTO wal_filler DEFAULT VALUES")
        conn.execute("SELECT pg_switch_wal()")
        if until == "lost":
            conn.execute("CHECKPOINT")
        row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        if row is not None and row[0] == until:
            return
    raise AssertionError(f"slot {slot} did not become {until!r}")


@pytest.fixture
def outgrow_wal() -> Any:
    """``outgrow_wal(conn, slot, "unreserved" | "lost")``: write and switch WAL segments (with a
    CHECKPOINT for 'lost') until the slot's wal_status is that."""
    return _outgrow_wal
