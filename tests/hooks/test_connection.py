"""The pgdecode connection's test (``airflow connections test``, the UI's Test button) against real servers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_provider_pgdecode.errors import ServerNotReadyError, is_deterministic
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayCluster]:
    """A cluster of this module's own (room for two slots), restarted with other settings by some tests."""
    with ThrowawayCluster({"max_replication_slots": "2"}) as cluster:
        yield cluster


@pytest.fixture
def connect(cluster: ThrowawayCluster, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``connect(login=..., **extra)``: a ``pgdecode`` connection to the cluster; returns its id."""

    def make(login: str = "postgres", **extra: Any) -> str:
        conn_id = f"src_{uuid.uuid4().hex[:8]}"
        conn = {"conn_type": "pgdecode", "host": cluster.host, "port": cluster.port, "login": login}
        conn.update(schema="postgres", extra=extra)
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
        return conn_id

    return make


def test_a_ready_server_passes_and_says_what_was_checked(connect: Any) -> None:
    ok, message = PgDecodeHook(postgres_conn_id=connect()).test_connection()
    assert ok is True, message
    assert message.startswith("ready for test_decoding slots with two-phase decoding: PostgreSQL ")
    for checked in (
        "wal_level=logical",
        "role 'postgres' has superuser",
        "2 of 2 replication slots free",
        "WAL senders free",
        "max_prepared_transactions=20",
    ):
        assert checked in message

    # The plugin and two-phase setting come from the connection's extra (never passed to libpq)...
    hook = PgDecodeHook(postgres_conn_id=connect(plugin="pgoutput", two_phase=False))
    ok, message = hook.test_connection()
    assert ok is True, message
    assert message.startswith("ready for pgoutput slots: ") and "two-phase not asked" in message
    assert "protocol up to" in message
    assert hook._slot_client is None  # the test closed the connection it opened
    # ... or from the hook's arguments, which win.
    ok, message = PgDecodeHook(postgres_conn_id=connect(two_phase=False), two_phase=True).test_connection()
    assert ok is True and "max_prepared_transactions=20" in message


def test_airflow_runs_it_for_a_pgdecode_connection(connect: Any) -> None:
    """What ``airflow connections test`` does: the connection's hook by its type, then its test."""
    from airflow.models.connection import Connection

    connection = Connection.get_connection_from_secrets(connect())
    assert isinstance(connection.get_hook(), PgDecodeHook)
    ok, message = connection.test_connection()
    assert ok is True and message.startswith("ready for test_decoding slots"), message


def test_role_without_replication_fails_with_its_fix(cluster: ThrowawayCluster, connect: Any) -> None:
    role = f"norepl_{uuid.uuid4().hex[:8]}"
    with cluster.connect() as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    ok, message = PgDecodeHook(postgres_conn_id=connect(login=role)).test_connection()
    assert ok is False
    assert message.startswith("1 problem(s) keep test_decoding slots with two-phase decoding from working")
    assert f"role '{role}' has neither the REPLICATION attribute nor superuser" in message
    assert f'ALTER ROLE "{role}" WITH REPLICATION' in message
    assert "wal_level" not in message and "max_replication_slots" not in message
    # The first run fails the same way, with the same fix, and without retries.
    with PgDecodeHook(postgres_conn_id=connect(login=role)) as hook:
        with pytest.raises(ServerNotReadyError) as caught:
            hook.ensure_slot("first_run", two_phase=True)
    assert "cannot create two-phase replication slot 'first_run' in database 'postgres'" in str(caught.value)
    assert f'ALTER ROLE "{role}" WITH REPLICATION' in str(caught.value) and is_deterministic(caught.value)

    with cluster.connect() as conn:
        conn.execute(f'ALTER ROLE "{role}" WITH REPLICATION')
    ok, message = PgDecodeHook(postgres_conn_id=connect(login=role)).test_connection()
    assert ok is True and f"role '{role}' has REPLICATION" in message


def test_exhausted_replication_slots_fail_with_their_fix(cluster: ThrowawayCluster, connect: Any) -> None:
    with cluster.connect() as conn:
        for n in range(2):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (f"full_{n}",))
        try:
            ok, message = PgDecodeHook(postgres_conn_id=connect()).test_connection()
        finally:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")
    assert ok is False
    assert "2 of max_replication_slots = 2 replication slots are in use" in message
    assert "drop slots nothing reads" in message and "raise max_replication_slots" in message
    assert "REPLICATION attribute" not in message and "wal_level is" not in message


def test_wal_level_replica_fails_with_its_fix(cluster: ThrowawayCluster, connect: Any) -> None:
    cluster.reconfigure(wal_level="replica")
    try:
        ok, message = PgDecodeHook(postgres_conn_id=connect()).test_connection()
    finally:
        cluster.reconfigure(wal_level="logical")
    assert ok is False
    assert message.startswith("1 problem(s) keep ")
    assert "wal_level is 'replica', and logical decoding needs 'logical': set wal_level = logical" in message
    assert "restart PostgreSQL" in message and "max_replication_slots" not in message


def test_two_phase_without_prepared_transactions_fails_only_when_asked(cluster: ThrowawayCluster, connect: Any) -> None:
    cluster.reconfigure(max_prepared_transactions="0", wal_level="replica")
    try:
        ok, message = PgDecodeHook(postgres_conn_id=connect()).test_connection()
        ok_without, message_without = PgDecodeHook(postgres_conn_id=connect(two_phase=False)).test_connection()
    finally:
        cluster.reconfigure(max_prepared_transactions="20", wal_level="logical")
    assert ok is False and message.startswith("2 problem(s) keep ")
    # Every problem at once, each with its own fix.
    assert "(1) wal_level is 'replica'" in message
    assert "(2) max_prepared_transactions is 0, and two-phase decoding needs it above 0" in message
    assert ok_without is False and message_without.startswith("1 problem(s) keep test_decoding slots from working")
    assert "max_prepared_transactions" not in message_without


def test_an_unreachable_server_fails_without_raising(unreachable_conn: Any) -> None:
    _, port = unreachable_conn("pgdecode")
    ok, message = PgDecodeHook(postgres_conn_id="nowhere").test_connection()
    assert ok is False
    assert message.startswith("cannot check connection 'nowhere': OperationalError") and str(port) in message
