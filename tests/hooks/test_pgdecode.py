from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.catalog import ReplicaIdentity
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = pytest.mark.postgres


@pytest.fixture
def hook(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    conn = json.loads(pg_cluster.airflow_conn_json("pgdecode_test"))
    # Airflow's "cursor" extra gives dict rows; the slot client must not depend on the row factory.
    conn["extra"] = {"cursor": "dictcursor"}
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", json.dumps(conn))
    with PgDecodeHook() as hook:
        yield hook


def test_hook_metadata_and_lazy_connection() -> None:
    assert PgDecodeHook.conn_type == "pgdecode"
    assert PgDecodeHook.default_conn_name == "pgdecode_default"
    assert PgDecodeHook.hook_name == "PostgreSQL logical decoding (pgdecode)"
    # No connection lookup in __init__: an unknown id only fails on use.
    hook = PgDecodeHook(postgres_conn_id="does_not_exist")
    assert hook.get_conn_id() == "does_not_exist"
    with pytest.raises(Exception, match="does_not_exist"):
        hook.get_slot_client()


def test_hook_slot_round_trip(hook: PgDecodeHook, slot_name: str, pg_conn: psycopg.Connection[Any]) -> None:
    table = f"hk_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")

    created = hook.ensure_slot(slot_name, plugin="test_decoding")
    assert created.plugin == "test_decoding" and created.database == "pgdecode_test"
    client = hook.get_slot_client()
    assert client.conn.autocommit is True
    assert hook.get_slot_client() is client

    pg_conn.execute(f"INSERT INTO {table} VALUES (1, 'a')")
    ceiling = hook.current_flush_lsn()
    rows = list(hook.peek_changes(slot_name, ceiling, options=[("include-xids", "0")], chunk_size=2))
    assert [data for _, _, data in rows] == [
        b"BEGIN",
        f"table public.{table}: INSERT: id[integer]:1 v[text]:'a'".encode(),
        b"COMMIT",
    ]
    commit_lsn = rows[-1][0]
    assert isinstance(commit_lsn, Lsn)

    assert hook.advance_slot(slot_name, commit_lsn) == commit_lsn
    described = hook.describe_slot(slot_name)
    assert described.confirmed_flush_lsn == commit_lsn
    assert list(hook.peek_changes(slot_name, ceiling)) == []

    heartbeat = hook.emit_heartbeat(content="x")
    assert heartbeat > commit_lsn

    with pytest.raises(SlotError, match="pgoutput"):
        hook.ensure_slot(slot_name, plugin="pgoutput")
    assert hook.drop_slot(slot_name) is True
    with pytest.raises(SlotError, match=slot_name):
        hook.describe_slot(slot_name)


def test_hook_catalog(hook: PgDecodeHook, pg_conn: psycopg.Connection[Any]) -> None:
    table = f"hk_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f'CREATE TABLE {table} ("Col A" int, b text, PRIMARY KEY (b, "Col A"))')
    assert hook.primary_key("public", table) == ["b", "Col A"]
    assert hook.replica_identity("public", table) == ReplicaIdentity("default", ("b", "Col A"))
    assert [(c.name, c.type_name, c.not_null) for c in hook.columns("public", table)] == [
        ("Col A", "integer", True),
        ("b", "text", True),
    ]
