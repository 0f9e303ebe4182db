from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, ServerNotReadyError, SlotError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, ReplicaIdentity
from airflow_provider_pgdecode.postgres.health import check_readable, describe_loss, slot_invalidated
from airflow_provider_pgdecode.postgres.slot import SlotClient
from pgdecode_testing.postgres_cluster import ThrowawayCluster, remove_slot_wal

pytestmark = pytest.mark.postgres

SKIP_EMPTY = [("skip-empty-xacts", "1")]


@pytest.fixture
def client(pg_conn: psycopg.Connection[Any]) -> SlotClient:
    return SlotClient(pg_conn)


@pytest.fixture
def table(pg_conn: psycopg.Connection[Any]) -> str:
    """A fresh table ``(id int primary key, v text)``, created before any slot of the test."""
    name = f"tab_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
    return name


def _xact(conn: psycopg.Connection[Any], *statements: str) -> int:
    """Run statements in one transaction; return its xid."""
    with conn.transaction():
        for statement in statements:
            conn.execute(statement)
        row = conn.execute("SELECT txid_current()").fetchone()
    assert row is not None
    return int(row[0])


def _peek_all(client: SlotClient, slot: str, **kwargs: Any) -> list[tuple[Lsn, int | None, bytes]]:
    return list(client.peek(slot, client.current_flush_lsn(), options=SKIP_EMPTY, **kwargs))


# -- lifecycle ---------------------------------------------------------------------------------


def test_create_describe_drop(client: SlotClient, slot_name: str) -> None:
    info = client.create(slot_name)
    assert (info.slot_name, info.plugin, info.slot_type, info.database) == (
        slot_name,
        "test_decoding",
        "logical",
        "pgdecode_test",
    )
    assert (info.temporary, info.active, info.two_phase) == (False, False, False)
    assert isinstance(info.confirmed_flush_lsn, Lsn) and isinstance(info.restart_lsn, Lsn)
    assert info.current_lsn >= info.confirmed_flush_lsn
    assert info.lag_bytes == info.current_lsn - info.confirmed_flush_lsn
    assert info.wal_status == "reserved"
    as_dict = json.loads(json.dumps(info.to_dict()))
    assert Lsn.parse(as_dict["confirmed_flush_lsn"]) == info.confirmed_flush_lsn
    assert as_dict["slot_name"] == slot_name

    assert client.describe(slot_name).confirmed_flush_lsn == info.confirmed_flush_lsn
    assert client.exists(slot_name)
    assert client.drop(slot_name) is True
    assert not client.exists(slot_name)
    assert client.drop(slot_name) is False
    with pytest.raises(SlotError, match=slot_name):
        client.drop(slot_name, missing_ok=False)


def test_create_two_phase_temporary(client: SlotClient, slot_name: str) -> None:
    info = client.create(slot_name, two_phase=True, temporary=True)
    assert info.two_phase is True
    assert info.temporary is True
    with pytest.raises(SlotError, match="already exists"):
        client.create(slot_name)


def test_create_unknown_plugin(client: SlotClient, slot_name: str) -> None:
    with pytest.raises(SlotError, match="no_such_plugin"):
        client.create(slot_name, plugin="no_such_plugin")
    assert not client.exists(slot_name)


def test_ensure_creates_then_reuses(client: SlotClient, slot_name: str, table: str, pg_conn: Any) -> None:
    first = client.ensure(slot_name, plugin="test_decoding", two_phase=True)
    assert first.two_phase is True
    _xact(pg_conn, f"INSERT INTO {table} VALUES (1, 'a')")
    again = client.ensure(slot_name, plugin="test_decoding", two_phase=True)
    # Recreating would have moved the slot past the insert.
    assert again.confirmed_flush_lsn == first.confirmed_flush_lsn
    assert len(_peek_all(client, slot_name)) == 3


def test_ensure_wrong_plugin(client: SlotClient, slot_name: str) -> None:
    client.create(slot_name, plugin="test_decoding")
    with pytest.raises(SlotError) as excinfo:
        client.ensure(slot_name, plugin="pgoutput")
    message = str(excinfo.value)
    assert "'test_decoding'" in message and "'pgoutput'" in message
    assert "pg_drop_replication_slot" in message and "plugin" in message


def test_ensure_wrong_two_phase(client: SlotClient, slot_name: str) -> None:
    client.create(slot_name, two_phase=False)
    with pytest.raises(SlotError) as excinfo:
        client.ensure(slot_name, two_phase=True)
    message = str(excinfo.value)
    assert "two_phase=False" in message and "two_phase=True" in message
    assert "pg_drop_replication_slot" in message


@pytest.mark.parametrize("bad", ["Invalid Name", "", "x" * 64, "slot-1", "Upper"])
def test_invalid_slot_name(client: SlotClient, bad: str) -> None:
    before = client.conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()
    with pytest.raises(SlotError, match="invalid replication slot name"):
        client.create(bad)
    with pytest.raises(SlotError, match="invalid replication slot name"):
        client.ensure(bad)
    assert client.conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == before


def test_describe_missing_slot(client: SlotClient, slot_name: str) -> None:
    with pytest.raises(SlotError) as excinfo:
        client.describe(slot_name)
    assert slot_name in str(excinfo.value) and "pgdecode_test" in str(excinfo.value)
    with pytest.raises(SlotError, match="does not exist"):
        next(client.peek(slot_name, client.current_flush_lsn()))


def test_needs_autocommit(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(ValueError, match="autocommit"):
            SlotClient(conn)


def test_server_facts(client: SlotClient) -> None:
    assert client.server_encoding() == "utf-8"
    assert client.server_version_num() >= 140000
    assert client.current_flush_lsn() > Lsn(0)


# -- peek ----------------------------------------------------------------------------------------


def test_peek_returns_rows_without_consuming(client: SlotClient, slot_name: str, table: str, pg_conn: Any) -> None:
    client.create(slot_name)
    xid = _xact(pg_conn, f"INSERT INTO {table} VALUES (1, 'a')", f"INSERT INTO {table} VALUES (2, 'it''s')")
    rows = _peek_all(client, slot_name)
    assert [data for _, _, data in rows] == [
        f"BEGIN {xid}".encode(),
        f"table public.{table}: INSERT: id[integer]:1 v[text]:'a'".encode(),
        f"table public.{table}: INSERT: id[integer]:2 v[text]:'it''s'".encode(),
        f"COMMIT {xid}".encode(),
    ]
    lsns = [lsn for lsn, _, _ in rows]
    assert all(isinstance(lsn, Lsn) for lsn in lsns)
    assert lsns == sorted(lsns) and lsns[0] < lsns[-1]
    assert {x for _, x, _ in rows} == {xid}
    assert all(isinstance(data, bytes) for _, _, data in rows)

    assert _peek_all(client, slot_name) == rows
    confirmed = client.describe(slot_name).confirmed_flush_lsn
    assert confirmed is not None and confirmed <= lsns[0]


def test_peek_ceiling_excludes_later_transactions(client: SlotClient, slot_name: str, table: str, pg_conn: Any) -> None:
    client.create(slot_name)
    first = _xact(pg_conn, f"INSERT INTO {table} VALUES (1, 'a')")
    ceiling = client.current_flush_lsn()
    second = _xact(pg_conn, f"INSERT INTO {table} VALUES (2, 'b')")
    bounded = list(client.peek(slot_name, ceiling, options=SKIP_EMPTY))
    assert {x for _, x, _ in bounded} == {first}
    assert len(bounded) == 3
    everything = _peek_all(client, slot_name)
    assert {x for _, x, _ in everything} == {first, second}
    assert everything[:3] == bounded


def test_peek_in_chunks(client: SlotClient, slot_name: str, table: str, pg_conn: Any) -> None:
    client.create(slot_name)
    _xact(pg_conn, f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 100) g")
    rows = _peek_all(client, slot_name, chunk_size=7)
    assert len(rows) == 102
    inserts = [data for _, _, data in rows[1:-1]]
    assert inserts == [f"table public.{table}: INSERT: id[integer]:{i} v[text]:'v{i}'".encode() for i in range(1, 101)]
    assert rows == _peek_all(client, slot_name, chunk_size=10000)


def test_peek_stopped_early_releases_the_connection(
    client: SlotClient, slot_name: str, table: str, pg_conn: Any
) -> None:
    client.create(slot_name)
    _xact(pg_conn, f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 50) g")
    rows = client.peek(slot_name, client.current_flush_lsn(), chunk_size=7)
    assert next(rows)[2].startswith(b"BEGIN")
    assert pg_conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    rows.close()
    assert pg_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert pg_conn.execute("SELECT count(*) FROM pg_cursors").fetchone() == (0,)
    assert len(_peek_all(client, slot_name)) == 52


def test_peek_pins_formatting_gucs(client: SlotClient, slot_name: str, pg_conn: Any) -> None:
    name = f"fmt_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, ts timestamptz, b bytea, f float8, i interval, d date)")
    client.create(slot_name)
    _xact(
        pg_conn,
        f"INSERT INTO {name} VALUES (1, '2024-01-02 03:04:05+00', '\\x0102ff', 0.1::float8 + 0.2::float8,"
        " '1 day 2 hours', '2024-03-04')",
    )
    for setting in (
        "TimeZone = 'America/New_York'",
        "bytea_output = 'escape'",
        "DateStyle = 'SQL, DMY'",
        "IntervalStyle = 'sql_standard'",
        "extra_float_digits = 0",
    ):
        pg_conn.execute(f"SET {setting}")
    (change,) = [data for _, _, data in _peek_all(client, slot_name) if b"INSERT" in data]
    assert b"ts[timestamp with time zone]:'2024-01-02 03:04:05+00'" in change
    assert b"b[bytea]:'\\x0102ff'" in change
    assert b"f[double precision]:0.30000000000000004" in change
    assert b"i[interval]:'1 day 02:00:00'" in change
    assert b"d[date]:'2024-03-04'" in change
    # SET LOCAL: the session's own settings are back after the peek.
    assert pg_conn.execute("SHOW TimeZone").fetchone() == ("America/New_York",)
    assert pg_conn.execute("SHOW bytea_output").fetchone() == ("escape",)


def test_peek_validates_arguments(client: SlotClient, slot_name: str) -> None:
    ceiling = client.current_flush_lsn()
    with pytest.raises(ValueError, match="pairs"):
        client.peek(slot_name, ceiling, options=[("skip-empty-xacts",)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="chunk_size"):
        client.peek(slot_name, ceiling, chunk_size=0)
    with pytest.raises(TypeError, match="upto_lsn"):
        client.peek(slot_name, "0/0")  # type: ignore[arg-type]


# -- advance and heartbeat ------------------------------------------------------------------


def test_advance_never_goes_backwards(client: SlotClient, slot_name: str, table: str, pg_conn: Any) -> None:
    created = client.create(slot_name)
    _xact(pg_conn, f"INSERT INTO {table} VALUES (1, 'a')")
    second = _xact(pg_conn, f"INSERT INTO {table} VALUES (2, 'b')")
    rows = _peek_all(client, slot_name)
    commits = [lsn for lsn, _, data in rows if data.startswith(b"COMMIT")]
    assert len(commits) == 2

    assert client.advance(slot_name, commits[0]) == commits[0]
    assert {x for _, x, _ in _peek_all(client, slot_name)} == {second}
    assert client.advance(slot_name, commits[1]) == commits[1]
    assert client.advance(slot_name, commits[0]) == commits[1]
    assert client.advance(slot_name, created.confirmed_flush_lsn) == commits[1]  # type: ignore[arg-type]
    assert client.describe(slot_name).confirmed_flush_lsn == commits[1]
    assert _peek_all(client, slot_name) == []


def test_heartbeat_is_decoded_as_a_message(client: SlotClient, slot_name: str) -> None:
    client.create(slot_name)
    lsn = client.heartbeat(content="hello")
    assert client.current_flush_lsn() >= lsn
    messages = [
        (row_lsn, xid, data) for row_lsn, xid, data in _peek_all(client, slot_name) if data.startswith(b"message")
    ]
    assert messages == [
        (lsn, None, b"message: transactional: 0 prefix: pgdecode.heartbeat, sz: 5 content:hello"),
    ]
    assert client.advance(slot_name, lsn) == lsn


# -- catalog ---------------------------------------------------------------------------------


@pytest.fixture
def catalog(pg_conn: psycopg.Connection[Any]) -> Catalog:
    return Catalog(pg_conn)


def test_columns_and_primary_key(catalog: Catalog, pg_conn: Any) -> None:
    name = f"cat_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(
        f"CREATE TABLE {name} (id bigint PRIMARY KEY, gone int, code varchar(20) NOT NULL,"
        " amount numeric(12,2), at timestamptz, tags int[])"
    )
    pg_conn.execute(f"ALTER TABLE {name} DROP COLUMN gone")
    assert catalog.columns("public", name) == [
        ColumnInfo("id", "bigint", "bigint", True, 1),
        ColumnInfo("code", "character varying", "character varying(20)", True, 3),
        ColumnInfo("amount", "numeric", "numeric(12,2)", False, 4),
        ColumnInfo("at", "timestamp with time zone", "timestamp with time zone", False, 5),
        ColumnInfo("tags", "integer[]", "integer[]", False, 6),
    ]
    assert catalog.primary_key("public", name) == ["id"]
    assert catalog.replica_identity("public", name) == ReplicaIdentity("default", ("id",))


def test_composite_primary_key_in_index_order(catalog: Catalog, pg_conn: Any) -> None:
    name = f"cat_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {name} (a int, b int, c text, PRIMARY KEY (b, a) INCLUDE (c))")
    assert catalog.primary_key("public", name) == ["b", "a"]
    assert catalog.replica_identity("public", name).columns == ("b", "a")


def test_quoted_identifiers(catalog: Catalog, pg_conn: Any) -> None:
    pg_conn.execute('CREATE SCHEMA IF NOT EXISTS "Odd Schema"')
    pg_conn.execute('CREATE TABLE "Odd Schema"."Odd Tbl" ("Col A" int PRIMARY KEY, "select" text)')
    pg_conn.execute('CREATE TABLE "Odd Schema"."we""ird\'name" (k int PRIMARY KEY)')
    assert catalog.primary_key("Odd Schema", "Odd Tbl") == ["Col A"]
    assert [c.name for c in catalog.columns("Odd Schema", "Odd Tbl")] == ["Col A", "select"]
    assert catalog.primary_key("Odd Schema", "we\"ird'name") == ["k"]
    with pytest.raises(CatalogError, match="odd tbl"):
        catalog.primary_key("Odd Schema", "odd tbl")
    tables = catalog.tables_with_primary_key()
    assert ("Odd Schema", "Odd Tbl") in tables and ("Odd Schema", "we\"ird'name") in tables


def test_replica_identity_kinds(catalog: Catalog, pg_conn: Any) -> None:
    base = f"ri_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE TABLE {base}_full (id int PRIMARY KEY, v text, w int)")
    pg_conn.execute(f"ALTER TABLE {base}_full REPLICA IDENTITY FULL")
    pg_conn.execute(f"CREATE TABLE {base}_nothing (id int PRIMARY KEY, v text)")
    pg_conn.execute(f"ALTER TABLE {base}_nothing REPLICA IDENTITY NOTHING")
    pg_conn.execute(f"CREATE TABLE {base}_index (id int PRIMARY KEY, x int NOT NULL, y text NOT NULL)")
    pg_conn.execute(f"CREATE UNIQUE INDEX {base}_ux ON {base}_index (y, x)")
    pg_conn.execute(f"ALTER TABLE {base}_index REPLICA IDENTITY USING INDEX {base}_ux")
    pg_conn.execute(f"CREATE TABLE {base}_nopk (v text)")

    assert catalog.replica_identity("public", f"{base}_full") == ReplicaIdentity("full", ("id", "v", "w"))
    assert catalog.replica_identity("public", f"{base}_nothing") == ReplicaIdentity("nothing", ())
    assert catalog.replica_identity("public", f"{base}_index") == ReplicaIdentity("index", ("y", "x"), f"{base}_ux")
    assert catalog.replica_identity("public", f"{base}_nopk") == ReplicaIdentity("default", ())
    assert catalog.primary_key("public", f"{base}_nopk") == []


def test_tables_with_primary_key(catalog: Catalog, pg_conn: Any) -> None:
    base = f"tp_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE TABLE {base}_pk (id int PRIMARY KEY)")
    pg_conn.execute(f"CREATE TABLE {base}_nopk (id int)")
    pg_conn.execute(f"CREATE TABLE {base}_parted (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    pg_conn.execute(f"CREATE TEMP TABLE {base}_temp (id int PRIMARY KEY)")
    tables = catalog.tables_with_primary_key()
    assert ("public", f"{base}_pk") in tables
    assert ("public", f"{base}_parted") in tables
    assert not any(t.startswith(f"{base}_nopk") or t.startswith(f"{base}_temp") for _, t in tables)
    assert not any(schema in ("pg_catalog", "information_schema") for schema, _ in tables)
    assert ("public", f"{base}_pk") not in catalog.tables_with_primary_key(exclude_schemas=["public"])


def test_missing_table(catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match="no_such_table") as excinfo:
        catalog.columns("public", "no_such_table")
    assert "pgdecode_test" in str(excinfo.value)
    with pytest.raises(CatalogError, match="nope"):
        catalog.replica_identity("nope", "x")


# --- what 17 and 18 add to slots: failover, and why a slot was invalidated ---------------------


@pytest.mark.pg_matrix(since=17)
def test_a_failover_slot_is_created_and_described_as_one(client: SlotClient, slot_name: str, pg_version: int) -> None:
    if pg_version < 18:
        # 17's standby copy lacks two_phase_at: prepared transactions could be skipped after a promotion.
        with pytest.raises(ServerNotReadyError, match="both two-phase and failover.*two_phase=False"):
            client.create(slot_name, plugin="pgoutput", two_phase=True, failover=True)
        assert not client.exists(slot_name)
    info = client.create(slot_name, plugin="pgoutput", two_phase=pg_version >= 18, failover=True)
    assert info.failover and info.two_phase == (pg_version >= 18)
    other = f"{slot_name}_nf"
    try:
        assert client.ensure(other, plugin="test_decoding").failover is False
    finally:
        client.drop(other)


@pytest.mark.pg_matrix(before=17)
def test_a_failover_slot_before_17_is_refused_saying_why(client: SlotClient, slot_name: str, pg_version: int) -> None:
    with pytest.raises(
        ServerNotReadyError, match=rf"failover slots need PostgreSQL 17 or later \(this server is {pg_version}\."
    ):
        client.create(slot_name, failover=True)
    assert not client.exists(slot_name)
    assert client.create(slot_name).failover is False


@pytest.mark.pg_matrix(since=17)
def test_a_slot_invalidated_for_removed_wal_says_so_in_the_health_message(pg_version: int) -> None:
    with ThrowawayCluster({"max_slot_wal_keep_size": "1MB"}, pg_version=pg_version) as cluster:
        with cluster.connect() as conn:
            client = SlotClient(conn)
            client.create("behind")
            remove_slot_wal(conn, "w")
            info = client.describe("behind")
            assert (info.wal_status, info.invalidation_reason) == ("lost", "wal_removed")
            assert info.inactive_since is not None
            with pytest.raises(
                SlotError, match=r"'behind' was invalidated \(invalidation_reason = wal_removed, inactive since"
            ) as raised:
                check_readable(info, "test_decoding")
            assert "max_slot_wal_keep_size" in str(raised.value) and "pgdecode_backfill" in str(raised.value)


@pytest.mark.pg_matrix(since=18)
def test_an_idle_slot_invalidated_by_18s_timeout_is_named_so(
    pg_version: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from airflow.sdk import DAG

    from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator

    with ThrowawayCluster({"idle_replication_slot_timeout": "1s"}, pg_version=pg_version) as cluster:
        # A DAG that leaves its slot unused longer than the timeout between runs is warned of it.
        monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", cluster.airflow_conn_json("postgres"))
        for schedule, warned in (("*/15 * * * *", True), (None, False)):
            with DAG(f"idle_{warned}", schedule=schedule, start_date=datetime(2026, 1, 1, tzinfo=UTC)) as dag:
                ensure = PgDecodeEnsureSlotOperator(task_id="ensure_slot", slot_name=f"idle_{warned}".lower())
            capsys.readouterr()
            ensure.execute({"dag": dag})  # type: ignore[arg-type]
            logged = capsys.readouterr().out  # Airflow's task logger writes there
            assert ("idle_replication_slot_timeout (0:00:01)" in logged) == warned, logged
            if warned:
                assert "unused between two runs for up to 0:15:00" in logged
        with cluster.connect() as conn:
            client = SlotClient(conn)
            assert client.idle_timeout() == timedelta(seconds=1)
            client.create("idle")
            # The timeout is checked at checkpoints: wait until one finds the slot idle for longer.
            deadline = time.monotonic() + 30
            while client.describe("idle").invalidation_reason is None and time.monotonic() < deadline:
                time.sleep(0.5)
                conn.execute("checkpoint")
            info = client.describe("idle")
            assert info.invalidation_reason == "idle_timeout"
            with pytest.raises(SlotError, match="idle_replication_slot_timeout"):
                check_readable(info)
            # Read anyway (as a run that described it earlier would): the server's error names the reason too.
            with pytest.raises(SlotError, match=r"invalidation_reason = idle_timeout\).*idle_replication_slot_timeout"):
                list(client.peek("idle", client.current_flush_lsn()))


def test_health_wording_of_each_invalidation_reason() -> None:
    since = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    assert "hot_standby_feedback" in str(slot_invalidated("s", "rows_removed"))
    assert "wal_level = logical" in str(slot_invalidated("s", "wal_level_insufficient"))
    assert "inactive since 2026-01-02T03:04:00+00:00" in str(slot_invalidated("s", "idle_timeout", since))
    assert "invalidation_reason = some_new_reason" in str(slot_invalidated("s", "some_new_reason"))
    # What a recovery says of the loss tells the causes apart.
    assert "idle_replication_slot_timeout" in describe_loss("idle_timeout")
    assert "max_slot_wal_keep_size" in describe_loss("wal_removed")


@pytest.mark.pg_matrix(before=15)
def test_a_two_phase_pgoutput_slot_on_14_is_refused_since_it_could_not_be_read(
    client: SlotClient, slot_name: str
) -> None:
    with pytest.raises(ServerNotReadyError, match=r"PostgreSQL 15 or later with pgoutput \(protocol 3\)"):
        client.create(slot_name, plugin="pgoutput", two_phase=True)
    assert client.create(slot_name, plugin="test_decoding", two_phase=True).two_phase
