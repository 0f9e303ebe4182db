"""A role's statement_timeout (a common DBA default) cancelled every peek of a backlog, run after
run, without naming the setting (issue 35): the decoding statements pin the timeouts they need,
as they pin DateStyle."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.postgres.slot import SlotClient
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = pytest.mark.postgres

TIMEOUT = "50ms"


@pytest.fixture
def short_timeout_role(pg_cluster: ThrowawayCluster, pg_conn: psycopg.Connection[Any]) -> Any:
    role = f"cdc_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    pg_conn.execute(
        sql.SQL("ALTER ROLE {} SET statement_timeout = {}").format(sql.Identifier(role), sql.Literal(TIMEOUT))
    )
    dsn = pg_cluster.dsn("pgdecode_test").replace("user=postgres", f"user={role}")
    yield dsn
    pg_conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_backlog_decodes_under_a_roles_statement_timeout(
    short_timeout_role: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    native: str,
) -> None:
    monkeypatch.setenv("PGDECODE_NATIVE", native)
    table = f"to_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, note text)")
    with psycopg.connect(short_timeout_role, autocommit=True) as conn:
        SlotClient(conn).ensure(slot_name, plugin="test_decoding", two_phase=True)
        pg_conn.execute(f"INSERT INTO {table} SELECT g, repeat('x', 40) FROM generate_series(1, 80000) g")
        # The setting bites: a plain decode of the backlog is cancelled under this role.
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute("SELECT count(*) FROM pg_logical_slot_peek_changes(%s, NULL, NULL)", (slot_name,))
        manifest = extract_batch(conn, slot_name, str(tmp_path / "staging"))
        assert sum(t.rows for t in manifest.tables if t.table == table) == 80000
        # The confirm decodes up to there too (pg_replication_slot_advance).
        assert SlotClient(conn).advance(slot_name, Lsn.parse(manifest.end_lsn)) == Lsn.parse(manifest.end_lsn)
        # And the session keeps the role's setting for everything else.
        assert conn.execute("SHOW statement_timeout").fetchone() == (TIMEOUT,)
