"""The view's look at a slot: one read-only, bounded session that a cycle never waits on.

Against the session's PostgreSQL: the slot as ``pg_replication_slots`` has it, left as it was
(confirmed and restart positions, what it holds); the session the view opens is read-only
with 3-second statement and lock timeouts (it writes nothing and holds nothing a cycle could wait
on) and is named in ``pg_stat_activity``; a missing slot and an unreachable server are answers,
not errors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.ui import readers
from airflow_provider_pgdecode.ui.readers import SLOT_TIMEOUT_SECONDS, BoundedSlotHook, read_slot
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from tests.conftest import TEST_DATABASE

pytestmark = pytest.mark.postgres


@pytest.fixture
def view_slot(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A logical slot in the test database, and the Airflow connection ``view_db`` to it."""
    monkeypatch.setenv("AIRFLOW_CONN_VIEW_DB", pg_cluster.airflow_conn_json(TEST_DATABASE))
    monkeypatch.setattr(readers, "_slot_cache", readers._Ttl(0))
    name = f"view_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (name,))
        try:
            yield name
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def test_the_slot_as_postgresql_has_it_and_left_as_it_was(view_slot: str, pg_dsn: str) -> None:
    def row() -> Any:
        with psycopg.connect(pg_dsn) as conn:
            return conn.execute(
                "SELECT plugin, confirmed_flush_lsn::text, wal_status, active, restart_lsn::text"
                " FROM pg_replication_slots WHERE slot_name = %s",
                (view_slot,),
            ).fetchone()

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, 'pgdecode.view-test', 'pending')")  # WAL for the slot
    before = row()
    reading = read_slot("view_db", view_slot)
    assert reading.error is None and reading.info is not None
    info = reading.info
    assert (info["plugin"], info["confirmed_flush_lsn"], info["wal_status"], info["active"]) == before[:4]
    assert int(info["lag_bytes"]) > 0  # the message is still in the slot: nothing peeked it away
    assert row() == before


def test_the_views_session_is_read_only_and_bounded(view_slot: str, pg_dsn: str) -> None:
    with BoundedSlotHook(postgres_conn_id="view_db") as hook:
        conn: Any = hook.get_slot_client().conn
        settings = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]
            for name in ("default_transaction_read_only", "statement_timeout", "lock_timeout", "application_name")
        }
        assert settings == {
            "default_transaction_read_only": "on",
            "statement_timeout": f"{SLOT_TIMEOUT_SECONDS}s",
            "lock_timeout": f"{SLOT_TIMEOUT_SECONDS}s",
            "application_name": "pgdecode-view",
        }
        # it writes nothing (read-only mode does not stop slot functions: the view calls none)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("CREATE TABLE view_probe (id int)")
        assert conn.info.get_parameters()["connect_timeout"] == str(SLOT_TIMEOUT_SECONDS)


def test_a_missing_slot_and_an_unreachable_server_are_answers(view_slot: str, unreachable_conn: Any) -> None:
    missing = read_slot("view_db", "no_such_slot")
    assert missing.info is None and missing.error is not None and "does not exist" in missing.error
    conn_id, port = unreachable_conn("postgres")
    unreachable = read_slot(conn_id, view_slot)
    assert unreachable.info is None and unreachable.error is not None and str(port) in unreachable.error
    assert read_slot(None, view_slot).error is not None  # no task rendered a connection yet
