"""The extract against a real PostgreSQL: what the slot says, staged; PostgreSQL is the oracle."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, CheckpointError, SlotError

pytestmark = pytest.mark.postgres


def create_slot(conn: psycopg.Connection, name: str, two_phase: bool = True, plugin: str = "test_decoding") -> None:
    conn.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (name, plugin, two_phase))


def advance(conn: psycopg.Connection, name: str, manifest: BatchManifest) -> None:
    conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (name, manifest.end_lsn))


def wait_for_flush(conn: psycopg.Connection, lsn: Any) -> None:
    for _ in range(100):
        if conn.execute("select pg_current_wal_flush_lsn() >= %s::pg_lsn", (str(lsn),)).fetchone()[0]:
            return
        time.sleep(0.05)
    raise AssertionError(f"WAL not flushed up to {lsn}")


def table_rows(manifest: BatchManifest, schema: str, table: str) -> list[dict[str, Any]]:
    summary = next((t for t in manifest.tables if (t.schema, t.table) == (schema, table)), None)
    if summary is None:
        return []
    parts = [pq.read_table(Path(manifest.path) / summary.path / name) for name in summary.files]
    return pa.concat_tables(parts, promote_options="default").to_pylist()


@pytest.mark.pg_matrix
def test_stages_committed_changes_in_commit_order_and_drops_rollbacks(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table items (id int primary key, label text)")
    create_slot(pg_conn, slot_name)
    with pg_conn.transaction():
        pg_conn.execute("insert into items values (1, 'one'), (2, 'two')")
    try:
        with pg_conn.transaction():
            pg_conn.execute("insert into items values (3, 'rolled back')")
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    with pg_conn.transaction():
        pg_conn.execute("insert into items values (4, 'kept')")
        with pytest.raises(psycopg.errors.UniqueViolation):
            with pg_conn.transaction():  # a savepoint, rolled back
                pg_conn.execute("insert into items values (5, 'savepoint')")
                pg_conn.execute("insert into items values (1, 'dup')")
        pg_conn.execute("update items set label = 'uno' where id = 1")
        pg_conn.execute("delete from items where id = 2")

    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    rows = table_rows(manifest, "public", "items")
    assert [(r["_pg_op"], r["id"], r["label"]) for r in rows] == [
        ("I", 1, "one"),
        ("I", 2, "two"),
        ("I", 4, "kept"),
        ("U", 1, "uno"),
        ("D", None, None),
    ]
    assert rows[-1]["_pg_old"]["id"] == 2
    assert [r["_pg_seq"] for r in rows] == [0, 1, 0, 1, 2]
    assert rows[0]["_pg_commit_lsn"] < rows[2]["_pg_commit_lsn"]
    assert manifest.transactions == 2 and manifest.changes == 5
    (summary,) = manifest.tables
    assert (summary.key, summary.inserts, summary.updates, summary.deletes) == (["id"], 3, 1, 1)
    assert {c.name: c.catalog_type for c in summary.columns} == {"id": "integer", "label": "text"}
    # The slot was only peeked: a second extract over the same range finds the same batch.
    again = extract_batch(pg_conn, slot_name, tmp_path, upto_lsn=Lsn.parse(manifest.ceiling_lsn))
    assert again.path == manifest.path
    assert len(list_batches(tmp_path, slot_name)) == 1


def test_interleaved_transactions_come_out_in_commit_order(pg_conn, pg_dsn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table events (id int primary key, who text)")
    create_slot(pg_conn, slot_name)
    with psycopg.connect(pg_dsn) as a, psycopg.connect(pg_dsn) as b:
        a.execute("insert into events values (1, 'a')")  # A starts first...
        b.execute("insert into events values (2, 'b')")
        a.execute("insert into events values (3, 'a')")
        b.commit()  # ...but B commits first
        a.execute("insert into events values (4, 'a')")
        a.commit()
    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    rows = table_rows(manifest, "public", "events")
    assert [(r["who"], r["id"], r["_pg_seq"]) for r in rows] == [("b", 2, 0), ("a", 1, 0), ("a", 3, 1), ("a", 4, 2)]
    assert rows[0]["_pg_commit_lsn"] < rows[1]["_pg_commit_lsn"] == rows[3]["_pg_commit_lsn"]


@pytest.mark.pg_matrix
def test_prepared_transactions_resolve_in_later_batches(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table ledger (id int primary key, amount numeric(10,2))")
    create_slot(pg_conn, slot_name)
    with psycopg.connect(pg_conn.info.dsn, autocommit=True) as other:
        other.execute("begin; insert into ledger values (1, 10.50); prepare transaction 'pay''1'")
        other.execute("begin; insert into ledger values (2, 99.99); prepare transaction 'refund'")
    pg_conn.execute("insert into ledger values (3, 1)")

    first = extract_batch(pg_conn, slot_name, tmp_path)
    assert [r["id"] for r in table_rows(first, "public", "ledger")] == [3]
    assert sorted(p["gid"] for p in first.prepared_pending) == ["pay'1", "refund"]
    advance(pg_conn, slot_name, first)  # the confirm step

    pg_conn.execute("commit prepared 'pay''1'")
    pg_conn.execute("rollback prepared 'refund'")
    second = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=Checkpoint.from_manifest(first))
    rows = table_rows(second, "public", "ledger")
    assert [(r["id"], r["amount"]) for r in rows] == [(1, "10.50")]
    commit_lsn = pg_conn.execute("select pg_current_wal_lsn()").fetchone()[0]
    assert rows[0]["_pg_commit_lsn"] <= int(Lsn.parse(str(commit_lsn)))
    assert second.prepared_pending == []
    assert [p["gid"] for p in second.prepared_committed] == ["pay'1"]
    assert [p["gid"] for p in second.prepared_rolled_back] == ["refund"]
    assert Lsn.parse(second.prepared_committed[0]["commit_lsn"]) == Lsn(rows[0]["_pg_commit_lsn"])
    # Source agrees: the rolled-back row never existed, the committed one does.
    assert pg_conn.execute("select id from ledger order by id").fetchall() == [(1,), (3,)]


def test_repeated_prepare_is_staged_once(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table t2 (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("begin; insert into t2 values (1), (2); prepare transaction 'twice'")
    first = extract_batch(pg_conn, slot_name, tmp_path)
    assert len(first.prepared_pending) == 1
    # The confirm failed: the slot stays behind, so the next peek delivers the PREPARE again.
    second = extract_batch(pg_conn, slot_name, tmp_path / "b2", checkpoint=Checkpoint.from_manifest(first))
    assert second.skipped["duplicate_prepares"] == 1
    assert len(second.prepared_pending) == 1
    pg_conn.execute("commit prepared 'twice'")
    third = extract_batch(pg_conn, slot_name, tmp_path / "b3", checkpoint=Checkpoint.from_manifest(second))
    assert [r["id"] for r in table_rows(third, "public", "t2")] == [1, 2]
    assert third.prepared_pending == []


def test_checkpoint_ahead_of_slot_does_not_restage(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table t3 (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into t3 values (1)")
    first = extract_batch(pg_conn, slot_name, tmp_path)
    pg_conn.execute("insert into t3 values (2)")
    # Not advanced (confirm failed): the slot still starts before the first batch.
    second = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=Checkpoint.from_manifest(first))
    assert [r["id"] for r in table_rows(second, "public", "t3")] == [2]
    assert second.start_lsn == first.end_lsn
    assert second.skipped["already_handled"] >= 1


@pytest.mark.pg_matrix
def test_messages_truncate_and_unchanged_toast_are_staged(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table parent (id int primary key, big text, small int)")
    pg_conn.execute("create table child (id int primary key, parent_id int references parent(id))")
    pg_conn.execute("alter table parent alter column big set storage external")
    pg_conn.execute("insert into parent values (1, repeat('x', 10000), 1)")
    create_slot(pg_conn, slot_name)
    with pg_conn.transaction():
        pg_conn.execute("update parent set small = 2 where id = 1")
        pg_conn.execute("select pg_logical_emit_message(true, 'app', 'in tx')")
        pg_conn.execute("insert into child values (10, 1)")
        pg_conn.execute("truncate parent, child restart identity cascade")
        pg_conn.execute("insert into parent values (2, 'after', 3)")
    message_lsn = pg_conn.execute("select pg_logical_emit_message(false, 'heartbeat', '\\xff00'::bytea)").fetchone()[0]
    wait_for_flush(pg_conn, message_lsn)  # a non-transactional message is flushed by the WAL writer
    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    parent = table_rows(manifest, "public", "parent")
    assert [(r["_pg_op"], r["id"], r["big"], r["_pg_unchanged_toast"]) for r in parent] == [
        ("U", 1, None, ["big"]),
        ("T", None, None, None),
        ("I", 2, "after", None),
    ]
    child = table_rows(manifest, "public", "child")
    assert [(r["_pg_op"], r["_pg_seq"]) for r in child] == [("I", 2), ("T", 3)]
    messages = pq.read_table(Path(manifest.path) / "messages").to_pylist()
    assert [(m["prefix"], m["content"], m["transactional"], m["_pg_seq"]) for m in messages] == [
        ("app", b"in tx", True, 1),
        ("heartbeat", b"\xff\x00", False, None),
    ]
    assert Lsn(messages[1]["_pg_lsn"]) == Lsn.parse(manifest.end_lsn)


def test_typed_values_equal_what_postgres_returns(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create type mood as enum ('happy', 'sad')")
    pg_conn.execute(
        """create table typed (id bigint primary key, s smallint, i int, n numeric(12,3), r real,
           d double precision, b boolean, t text, v varchar(10), dt date, ts timestamp, tz timestamptz,
           u uuid, j json, jb jsonb, by bytea, ia int[], ta text[], m mood, iv interval)"""
    )
    create_slot(pg_conn, slot_name)
    pg_conn.execute(
        """insert into typed values
           (1, -32768, 2147483647, -123456789.125, 1.5, 'NaN', true, e'multi\\nline ''q''', 'vc',
            '2024-02-29', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.5+05:30',
            'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": "c''d"}', '\\x00ff10',
            '{1,NULL,3}', '{"x y",NULL,"null","q\\"u"}', 'sad', '1 day 02:00:00'),
           (2, null, null, null, '-Infinity', 'Infinity', false, null, null, 'infinity', null, null,
            null, null, null, null, '{}', null, null, null)"""
    )
    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    staged = {r["id"]: r for r in table_rows(manifest, "public", "typed")}
    with pg_conn.cursor() as cur:
        cur.execute("set timezone = 'UTC'")
        cur.execute(
            "select id, s, i, n::text, r, d, b, t, v, case when isfinite(dt) then dt end as dt, ts, tz, u::text, j::text, jb::text, by, ia, ta, m::text, iv::text from typed order by id"
        )
        names = [c.name for c in cur.description]
        source = {row[0]: dict(zip(names, row)) for row in cur.fetchall()}
    import math

    for key, expected in source.items():
        got = staged[key]
        for name, value in expected.items():
            if name == "dt" and value is None and key == 2:
                continue  # infinity: checked below
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[name]), name
            elif name == "r" and value is not None:
                assert got[name] == pytest.approx(value), name
            elif name == "iv" and value is not None:
                assert got[name] == "1 day 02:00:00"
            else:
                assert got[name] == value, (key, name, got[name], value)
    assert str(staged[2]["dt"]) == "9999-12-31"  # infinity, clamped and documented
    columns = {c.name: (c.type, c.catalog_type) for c in manifest.tables[0].columns}
    assert columns["n"] == ("numeric", "numeric(12,3)")
    assert columns["v"] == ("character varying", "character varying(10)")


def test_table_without_a_usable_key_fails_and_leaves_nothing(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table keyless (a int, b text)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into keyless values (1, 'x')")
    with pytest.raises(CatalogError, match="keyless has no primary key.*REPLICA IDENTITY"):
        extract_batch(pg_conn, slot_name, tmp_path)
    pg_conn.execute("delete from keyless")
    with pytest.raises(CatalogError, match="carries no row data"):
        extract_batch(pg_conn, slot_name, tmp_path)
    assert list((tmp_path / slot_name).iterdir()) == []
    # Excluding the table lets the rest flow.
    pg_conn.execute("create table keyed (id int primary key)")
    pg_conn.execute("insert into keyed values (1)")
    manifest = extract_batch(pg_conn, slot_name, tmp_path, tables=["public.keyed"])
    assert [t.table for t in manifest.tables] == ["keyed"]
    assert manifest.skipped["excluded_table_changes"] == 2


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_append_only_table_stages_inserts_and_refuses_updates_and_deletes(pg_conn, slot_name, tmp_path, native) -> None:
    pg_conn.execute("drop table if exists append_log; create table append_log (at int, what text)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into append_log values (1, 'a'), (1, 'a'), (2, null)")
    pg_conn.execute("truncate append_log")
    pg_conn.execute("insert into append_log values (3, 'c')")
    options = {"public.append_log": {"mode": "append_only"}}
    manifest = extract_batch(pg_conn, slot_name, tmp_path, table_options=options, native=native)
    (entry,) = manifest.tables
    assert (entry.mode, entry.key, entry.key_source, entry.replica_identity) == ("append_only", [], None, "default")
    assert (entry.inserts, entry.truncates, entry.updates, entry.deletes) == (4, 1, 0, 0)
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))

    # An UPDATE (staged by the native reader without asking) and a DELETE (no row data) of it are
    # refused by name and LSN, before anything is published.
    lsn = pg_conn.execute("select pg_current_wal_lsn()::text").fetchall()[0][0]
    pg_conn.execute("update append_log set what = 'changed'")
    with pytest.raises(
        CatalogError, match=r"UPDATE on public\.append_log at LSN [0-9A-F]+/[0-9A-F]+: .*append_only"
    ) as info:
        extract_batch(pg_conn, slot_name, tmp_path, table_options=options, native=native)
    assert Lsn.parse(str(info.value).split("at LSN ")[1].split(":")[0]) >= Lsn.parse(lsn)  # the UPDATE's own
    for way in ("mode 'merge'", "resnapshot", "exclude_tables"):
        assert way in str(info.value)
    pg_conn.execute("select pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot_name,))
    pg_conn.execute("delete from append_log")
    with pytest.raises(CatalogError, match=r"DELETE on public\.append_log at LSN .*append_only"):
        extract_batch(pg_conn, slot_name, tmp_path, table_options=options, native=native)
    assert [p.name for p in (tmp_path / slot_name).iterdir()] == [Path(manifest.path).name]


def test_a_change_without_row_data_states_the_tables_replica_identity(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("drop table if exists pk_then_nothing; create table pk_then_nothing (id int primary key)")
    pg_conn.execute("insert into pk_then_nothing values (1)")
    pg_conn.execute("alter table pk_then_nothing replica identity nothing")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("delete from pk_then_nothing")
    with pytest.raises(CatalogError) as info:
        extract_batch(pg_conn, slot_name, tmp_path, tables=["public.pk_then_nothing"])
    message = str(info.value)
    assert message.startswith("DELETE on public.pk_then_nothing at LSN ")
    assert "carries no row data" in message
    assert "has REPLICA IDENTITY NOTHING and a primary key now" in message


def test_replica_identity_full_table_without_pk_is_keyed_by_all_columns(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table full_identity (a int, b text)")
    pg_conn.execute("alter table full_identity replica identity full")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into full_identity values (1, 'x')")
    pg_conn.execute("update full_identity set b = 'y'")
    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    rows = table_rows(manifest, "public", "full_identity")
    assert rows[1]["_pg_old"] == {"a": 1, "b": "x"}
    assert manifest.tables[0].key == ["a", "b"] and manifest.tables[0].replica_identity == "full"


@pytest.mark.parametrize("mode", ["history", "soft_delete"])
def test_keyless_table_in_a_kept_mode_is_refused_before_staging(pg_conn, slot_name, tmp_path, mode) -> None:
    """Versions and tombstones are kept per key: a keyless table cannot have them. The extract says
    so (the merge would too, after staging the batch), stages nothing and leaves the slot."""
    table = f"keyless_{mode}"
    pg_conn.execute(f"create table {table} (a int, b text)")
    pg_conn.execute(f"alter table {table} replica identity full")
    create_slot(pg_conn, slot_name)
    pg_conn.execute(f"insert into {table} values (1, 'x')")
    options = {f"public.{table}": {"mode": mode}}
    with pytest.raises(CatalogError, match=f"{table} has no key .*mode '{mode}'.*Nothing was staged"):
        extract_batch(pg_conn, slot_name, tmp_path, table_options=options)
    assert list((tmp_path / slot_name).iterdir()) == []
    # The same table as a multiset (mode 'merge') stages.
    manifest = extract_batch(pg_conn, slot_name, tmp_path)
    assert manifest.tables[0].keyed_by_all_columns


def test_wrong_plugin_is_refused(pg_conn, slot_name, tmp_path) -> None:
    create_slot(pg_conn, slot_name, two_phase=False, plugin="pgoutput")
    with pytest.raises(SlotError, match="uses output plugin 'pgoutput', but 'test_decoding' was asked for"):
        extract_batch(pg_conn, slot_name, tmp_path)


def test_same_range_gives_byte_identical_batches(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table same (id int primary key, v text)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into same select g, md5(g::text) from generate_series(1, 500) g")
    pg_conn.execute("begin; update same set v = 'p' where id < 10; prepare transaction 'same'")
    a = extract_batch(pg_conn, slot_name, tmp_path / "a")
    b = extract_batch(pg_conn, slot_name, tmp_path / "b", upto_lsn=Lsn.parse(a.ceiling_lsn))

    def digest(root: Path) -> dict[str, str]:
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    assert Path(a.path).name == Path(b.path).name
    assert digest(Path(a.path)) == digest(Path(b.path))
    assert len(digest(Path(a.path))) == 3  # manifest, one part, one pending prepared transaction
    pg_conn.execute("rollback prepared 'same'")


def test_large_transaction_in_bounded_memory(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table big (id int primary key, v text)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into big select g, repeat('v', g % 50) from generate_series(1, 12000) g")
    manifest = extract_batch(pg_conn, slot_name, tmp_path, memory_items=1000, part_rows=2500, chunk_rows=777)
    (summary,) = manifest.tables
    assert len(summary.files) == 5
    rows = table_rows(manifest, "public", "big")
    assert [r["id"] for r in rows] == list(range(1, 12001))
    assert all(r["v"] == "v" * (r["id"] % 50) for r in rows)
    assert not (Path(manifest.path) / ".spool").exists()


TRICKY = st.sampled_from(
    [
        "null",
        "NULL",
        "unchanged-toast-datum",
        "'",
        "''",
        "\\",
        "\\x00",
        "\n",
        "table public.t: INSERT: a[text]:'x'",
        " new-tuple: ",
        "B'101'",
        "{",
        '"',
        "é",
        "😀",
        "\r\n",
        "\t",
    ]
)
TEXT = st.lists(
    st.one_of(TRICKY, st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)),
    max_size=4,
).map("".join)


@pytest.fixture()
def roundtrip_slot(pg_conn, slot_name):
    pg_conn.execute("create table texts (id serial primary key, t text, arr text[])")
    create_slot(pg_conn, slot_name, two_phase=False)
    return slot_name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(TEXT, min_size=1, max_size=8))
def test_random_text_round_trips_exactly(pg_conn, roundtrip_slot, tmp_path_factory, values: list[str]) -> None:
    with pg_conn.transaction():
        with pg_conn.cursor() as cur:
            cur.executemany("insert into texts (t, arr) values (%s, %s)", [(v, [v, None, v[:3]]) for v in values])
    manifest = extract_batch(pg_conn, roundtrip_slot, tmp_path_factory.mktemp("rt"))
    advance(pg_conn, roundtrip_slot, manifest)
    rows = table_rows(manifest, "public", "texts")
    assert [r["t"] for r in rows] == values
    assert [r["arr"] for r in rows] == [[v, None, v[:3]] for v in values]


def test_concurrent_writers_while_extracting_lose_nothing(pg_conn, pg_dsn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table busy (id int primary key)")
    create_slot(pg_conn, slot_name, two_phase=False)
    stop = threading.Event()

    def writer() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            i = 0
            while not stop.is_set() and i < 3000:
                i += 1
                conn.execute("insert into busy values (%s)", (i,))

    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    checkpoint = None
    try:
        for _ in range(5):
            manifest = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=checkpoint)
            seen += [r["id"] for r in table_rows(manifest, "public", "busy")]
            advance(pg_conn, slot_name, manifest)
            checkpoint = Checkpoint.from_manifest(manifest)
    finally:
        stop.set()
        thread.join()
    manifest = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=checkpoint)
    seen += [r["id"] for r in table_rows(manifest, "public", "busy")]
    source = [r[0] for r in pg_conn.execute("select id from busy order by id")]
    assert seen == source  # each exactly once, in commit order


def test_same_range_with_a_later_ceiling_reuses_the_batch(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table later (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into later values (1)")
    first = extract_batch(pg_conn, slot_name, tmp_path)
    # A run killed before its confirm is re-run later: the server has written more WAL since
    # (nothing decodable), so the ceiling is higher but the range and the contents are the same.
    pg_conn.execute("checkpoint")
    pg_conn.execute("vacuum later")
    again = extract_batch(pg_conn, slot_name, tmp_path)
    assert Lsn.parse(again.ceiling_lsn) > Lsn.parse(first.ceiling_lsn)
    assert again.path == first.path
    assert BatchManifest.read(again.path).ceiling_lsn == first.ceiling_lsn  # the batch on disk was kept


def test_a_selection_change_over_an_unconfirmed_range_replaces_its_batch(
    pg_conn, slot_name, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch published and never confirmed, then the selection changes (a table left out, say,
    because its merge failed): the next extract of the range replaces it, saying what changed.
    It used to stop with 'already exists with different contents' until someone moved it by hand."""
    pg_conn.execute("create table sel_a (id int primary key); create table sel_b (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into sel_a values (1); insert into sel_b values (2)")
    first = extract_batch(pg_conn, slot_name, tmp_path, tables=["public.sel_a", "public.sel_b"])
    assert {t.table for t in first.tables} == {"sel_a", "sel_b"}
    with caplog.at_level("WARNING"):
        second = extract_batch(pg_conn, slot_name, tmp_path, tables=["public.sel_a"])
    assert second.path == first.path and {t.table for t in second.tables} == {"sel_a"}
    assert {t.table for t in BatchManifest.read(second.path).tables} == {"sel_a"}  # on disk too
    assert table_rows(BatchManifest.read(second.path), "public", "sel_a") and not list(
        (Path(second.path) / "tables" / "public").glob("sel_b")
    )
    assert "never confirmed, with other contents (tables no longer staged: public.sel_b" in caplog.text
    assert not [p for p in Path(tmp_path, slot_name).iterdir() if p.name.startswith(".tmp-")]


def test_origin_none_skips_changes_that_came_through_replication(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table looped (id int primary key, source text)")
    create_slot(pg_conn, slot_name, two_phase=False)
    pg_conn.execute("insert into looped values (1, 'local')")
    pg_conn.execute(
        "select pg_replication_origin_create('replica_b') where not exists"
        " (select 1 from pg_replication_origin where roname = 'replica_b')"
    )
    pg_conn.execute("select pg_replication_origin_session_setup('replica_b')")
    try:
        pg_conn.execute("insert into looped values (2, 'replicated')")
    finally:
        pg_conn.execute("select pg_replication_origin_session_reset()")
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    everything = extract_batch(pg_conn, slot_name, tmp_path / "all", upto_lsn=upto)
    local = extract_batch(pg_conn, slot_name, tmp_path / "local", upto_lsn=upto, origin="none")
    assert [r["source"] for r in table_rows(everything, "public", "looped")] == ["local", "replicated"]
    assert [r["source"] for r in table_rows(local, "public", "looped")] == ["local"]


def test_a_checkpoint_the_slot_was_moved_past_is_refused_not_skipped(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table t_moved (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into t_moved values (1)")
    first = extract_batch(pg_conn, slot_name, tmp_path)
    checkpoint = Checkpoint.from_manifest(first)
    advance(pg_conn, slot_name, first)  # confirmed as the DAG would
    pg_conn.execute("insert into t_moved values (2)")
    # Another reader consumes the slot past the change to id 2, behind pgdecode's back.
    pg_conn.execute("select pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot_name,))
    pg_conn.execute("insert into t_moved values (3)")
    with pytest.raises(CheckpointError, match=rf"replication slot '{slot_name}' is at .*ahead of the last merged"):
        extract_batch(pg_conn, slot_name, tmp_path, checkpoint=checkpoint)
    assert [Path(p).name for p in list_batches(tmp_path, slot_name)] == [first.name]  # nothing staged


def test_a_checkpoint_is_adopted_when_staged_batches_lead_to_the_slot(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("create table t_chain (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into t_chain values (1)")
    first = extract_batch(pg_conn, slot_name, tmp_path)
    pg_conn.execute("insert into t_chain values (2)")
    second = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=Checkpoint.from_manifest(first))
    advance(pg_conn, slot_name, second)  # the second confirm ran, but its checkpoint was lost
    pg_conn.execute("insert into t_chain values (3)")
    third = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=Checkpoint.from_manifest(first))
    assert third.start_lsn == second.end_lsn
    assert [r["id"] for r in table_rows(third, "public", "t_chain")] == [3]
