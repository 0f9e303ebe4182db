"""Adding a table to a running pipeline and re-snapshotting one, while the slot keeps flowing.

Real PostgreSQL (the oracle), real Spark + Delta. A writer thread changes every table while
chunks are copied, so a row missed, resurrected or applied out of order shows up as a
difference between Delta and PostgreSQL.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture import table_snapshot
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.table_snapshot import (
    SnapshotVisibility,
    TableSnapshotter,
    describe_progress,
    list_snapshot_requests,
    read_snapshot_state,
    request_table_snapshot,
    write_snapshot_states,
)
from airflow_provider_pgdecode.errors import StagingError
from tests.conftest import PLUGIN_REPEAT, full_only

ORDERS = ("public", "ts_orders")
REFUNDS = ("public", "ts_refunds")
FULL = ("public", "ts_full")
ROWS = 400


# -- pure parts ---------------------------------------------------------------------------------


def test_visibility_follows_pg_snapshot_rules() -> None:
    seen = SnapshotVisibility(xmin=1000, xmax=1010, xip=frozenset({1003, 1007}))
    assert seen.sees(999) and seen.sees(1004) and seen.sees(1009)
    assert not seen.sees(1003) and not seen.sees(1007)
    assert not seen.sees(1010) and not seen.sees(1500)
    assert not seen.sees(None)


def test_visibility_widens_32_bit_xids_across_an_epoch() -> None:
    epoch = 5 << 32
    snap = SnapshotVisibility(xmin=epoch + 10, xmax=epoch + 20, xip=frozenset({epoch + 15}))
    assert snap.widen(12) == epoch + 12
    assert not snap.sees(15) and snap.sees(12) and not snap.sees(25)
    # an xid just before the epoch boundary belongs to the previous epoch: long committed
    assert snap.widen(2**32 - 5) == epoch - 5 and snap.sees(2**32 - 5)


def test_requests_are_filed_once_and_checked(tmp_path: Path) -> None:
    first = request_table_snapshot(tmp_path, "s1", ["ts_refunds"], "add-table", request_id="run 1", chunk_rows=10)
    assert first.id == "run_1" and first.tables == (REFUNDS,)
    again = request_table_snapshot(
        tmp_path, "s1", ["public.ts_refunds"], "add-table", request_id="run 1", chunk_rows=10
    )
    assert again == first
    with pytest.raises(StagingError, match="already exists with other settings"):
        request_table_snapshot(tmp_path, "s1", ["public.ts_orders"], "add-table", request_id="run 1", chunk_rows=10)
    with pytest.raises(ValueError, match="mode must be one of"):
        request_table_snapshot(tmp_path, "s1", ["t"], "reload")
    with pytest.raises(ValueError, match="at least one table"):
        request_table_snapshot(tmp_path, "s1", [], "resnapshot")
    second = request_table_snapshot(tmp_path, "s1", [ORDERS], "resnapshot")
    assert [r.id for r in list_snapshot_requests(tmp_path, "s1")] == ["run_1", second.id]
    write_snapshot_states(
        tmp_path,
        "s1",
        {"run_1": {"done": True, "tables": {"public.ts_refunds": {"chunks": 3, "rows": 25, "done": True}}}},
    )
    state = read_snapshot_state(tmp_path, "s1", "run_1")
    assert state is not None and state["done"]
    assert describe_progress(state) == "public.ts_refunds: 3 chunk(s), 25 rows, done"
    # the state file is not taken for a request
    assert len(list_snapshot_requests(tmp_path, "s1")) == 2


# -- against PostgreSQL, Spark and Delta ---------------------------------------------------------


@pytest.fixture()
def tables(pg_conn: psycopg.Connection) -> None:
    c = pg_conn
    c.execute("drop table if exists ts_orders, ts_refunds, ts_nokey")
    c.execute(
        "create table ts_orders (id int primary key, status text not null, amount numeric(12,2), note text);"
        " create table ts_refunds (id int primary key, order_id int, amount numeric(12,2), reason text,"
        "  tags text[], at timestamptz);"
        " create table ts_nokey (a int, b text)"
    )
    c.execute(f"insert into ts_orders select g, 'new', g * 1.5, 'order ' || g from generate_series(1, {ROWS}) g")
    c.execute(
        f"insert into ts_refunds select g, g % 50, g * 0.25, 'reason ' || g, array['r', g::text],"
        f" '2026-03-01 00:00:00+00'::timestamptz + g * interval '1 hour' from generate_series(1, {ROWS}) g"
    )


@pytest.fixture()
def full_table(tables: None, pg_conn: psycopg.Connection) -> None:
    """ts_full: no primary key, REPLICA IDENTITY FULL, so all four columns are its key.

    Rows 1..ROWS are what the writer changes. The rows after them repeat each id eight times
    (labels differ), so chunk boundaries fall inside runs of one id and the next chunk must
    start from the whole key. No NULLs: the merge refuses a NULL in a key column (the
    chunks' handling of NULLs is checked without Spark below).
    """
    c = pg_conn
    c.execute("drop table if exists ts_full")
    c.execute("create table ts_full (id int, label text not null, amount numeric(12,2), note text)")
    c.execute("alter table ts_full replica identity full")
    c.execute(f"insert into ts_full select g, 'full ' || g, g * 0.5, 'n' || g from generate_series(1, {ROWS}) g")
    c.execute("insert into ts_full select 5000 + g / 8, 'same ' || g % 8, g, 'x' from generate_series(1, 160) g")


_INSERTS = {
    "ts_orders": "insert into ts_orders values (%s, 'late', 9.99, 'w')",
    "ts_refunds": "insert into ts_refunds values (%s, 1, 0.5, 'w', '{w}', now())",
    "ts_full": "insert into ts_full values (%s, 'late', 9.99, 'w')",
}
_TEXT_COLUMN = {"ts_orders": "status", "ts_refunds": "reason", "ts_full": "label"}


class Writer(threading.Thread):
    """Short transactions on two tables (inserts, updates, key changes, deletes) until stopped."""

    def __init__(self, dsn: str, seed: int, tables: tuple[str, str] = ("ts_orders", "ts_refunds")) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.seed = seed
        self.tables = tables
        self.stop = threading.Event()
        self.ops = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(self.seed)
        next_id = 10_000_000 * self.seed
        first, second = self.tables
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop.is_set():
                    table = rng.choice([first, second])
                    k = rng.randint(1, ROWS)
                    r = rng.random()
                    if r < 0.3:
                        next_id += 1
                        c.execute(_INSERTS[table], (next_id,))
                    elif r < 0.65:
                        column = _TEXT_COLUMN[table]
                        c.execute(f"update {table} set {column} = {column} || '+' where id = %s", (k,))
                    elif r < 0.75:
                        c.execute(f"update {table} set id = id + 1000000 where id = %s", (k,))
                    elif r < 0.85:
                        c.execute(f"delete from {table} where id = %s", (k,))
                    else:
                        with c.transaction():
                            c.execute(f"update {first} set amount = amount + 1 where id = %s", (k,))
                            c.execute(f"update {second} set amount = amount + 1 where id = %s", (k,))
                    self.ops += 1
                    time.sleep(0.002)  # a steady trickle, not a flood of WAL
        except BaseException as exc:  # surfaced by the test
            self.error = exc


class Pipeline:
    """extract -> merge -> advance, as pgdecode_incremental runs it."""

    def __init__(self, conn: psycopg.Connection, spark: Any, slot: str, root: Path, tables: list[tuple[str, str]]):
        self.conn, self.spark, self.slot = conn, spark, slot
        self.staging = str(root / "staging")
        self.delta = str(root / "delta")
        self.tables = tables
        self.checkpoint: Checkpoint | None = None
        self.manifests: list[Any] = []
        self.options: dict[str, Any] = {}

    def run(self, **options: Any) -> Any:
        from airflow_provider_pgdecode.spark.merge_job import merge_batches

        manifest = extract_batch(
            self.conn,
            self.slot,
            self.staging,
            checkpoint=self.checkpoint,
            tables=self.tables,
            **self.options,
            **options,
        )
        if any(t.rows for t in manifest.tables):
            merge_batches(self.spark, [str(manifest.path)], self.delta)
        self.conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (self.slot, manifest.end_lsn))
        self.checkpoint = Checkpoint.from_manifest(manifest)
        write_snapshot_states(self.staging, self.slot, self.checkpoint.snapshots)
        self.manifests.append(manifest)
        return manifest

    def until_done(self, request_id: str, runs: int = 30, **options: Any) -> dict[str, Any]:
        for _ in range(runs):
            self.run(**options)
            state = read_snapshot_state(self.staging, self.slot, request_id)
            if state is not None and state["done"]:
                return state
        raise AssertionError(f"request {request_id} not done after {runs} runs")


def _equal(conn: psycopg.Connection, spark: Any, delta: str, *names: tuple[str, str]) -> None:
    from pgdecode_testing.compare import compare_table

    for schema, table in names:
        result = compare_table(conn, spark, delta, schema, table)
        assert result.equal, result.describe()


def _writer(dsn: str, seed: int, tables: tuple[str, str] = ("ts_orders", "ts_refunds")) -> Writer:
    writer = Writer(dsn, seed, tables)
    writer.start()
    return writer


def _stop(writer: Writer) -> None:
    writer.stop.set()
    writer.join(30)
    assert writer.error is None, writer.error
    assert writer.ops > 0


# The longest test of `make test` (up to 7 minutes): CI leaves it to PGDECODE_FULL_TESTS=1.
ADD_TABLE_REPEAT = (
    "test_add_table_with_replica_identity_full_and_no_primary_key_under_concurrent_writes runs add-table under"
    " concurrent writes, and the backfill DAG tests add a table to a flowing pipeline"
)


@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.parametrize(
    "plugin", [full_only("test_decoding", ADD_TABLE_REPEAT), full_only("pgoutput", ADD_TABLE_REPEAT)]
)
def test_add_table_under_concurrent_writes(
    tables: None, pg_conn: psycopg.Connection, pg_dsn: str, slot_name: str, spark: Any, tmp_path: Path, plugin: str
) -> None:
    pg_conn.execute("drop publication if exists ts_all")
    pg_conn.execute("create publication ts_all for table ts_orders, ts_refunds")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    pipeline = Pipeline(pg_conn, spark, slot_name, tmp_path, [ORDERS])  # refunds not in the pipeline yet
    if plugin == "pgoutput":
        pipeline.options = {"plugin": "pgoutput", "publication": "ts_all"}
    writer = _writer(pg_dsn, 1)
    try:
        pipeline.run()
        first = pipeline.run()
        assert [t.table for t in first.tables] in ([], ["ts_orders"])
        request = request_table_snapshot(pipeline.staging, slot_name, ["ts_refunds"], "add-table", chunk_rows=60)
        state = pipeline.until_done(request.id, snapshot_rows=150)
    finally:
        _stop(writer)
    pipeline.run()  # the writer's last changes
    _equal(pg_conn, spark, pipeline.delta, ORDERS, REFUNDS)
    table = state["tables"]["public.ts_refunds"]
    assert table["done"] and table["chunks"] >= ROWS // 60
    with_chunks = [m for m in pipeline.manifests if m.snapshot_chunks]
    assert len(with_chunks) >= 2, "the copy should have been spread over several batches"
    assert with_chunks[0].snapshot_chunks[0]["kind"] == "truncate"
    # the added table keeps flowing after its snapshot, though it is not in the table list
    pg_conn.execute("update ts_refunds set reason = 'after' where id = (select min(id) from ts_refunds)")
    last = pipeline.run()
    assert any(t.table == "ts_refunds" and t.updates == 1 for t in last.tables)
    _equal(pg_conn, spark, pipeline.delta, REFUNDS)
    pg_conn.execute("drop publication ts_all")


@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.parametrize("plugin", [full_only("test_decoding", PLUGIN_REPEAT), "pgoutput"])
def test_add_table_with_replica_identity_full_and_no_primary_key_under_concurrent_writes(
    full_table: None,
    pg_conn: psycopg.Connection,
    pg_dsn: str,
    slot_name: str,
    spark: Any,
    tmp_path: Path,
    plugin: str,
) -> None:
    """The incremental extract keys a REPLICA IDENTITY FULL table by all its columns; add-table
    must take the same key (one rule), page through it, and end with Delta equal to PostgreSQL."""
    pg_conn.execute("drop publication if exists ts_full_pub")
    pg_conn.execute("create publication ts_full_pub for table ts_orders, ts_full")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    pipeline = Pipeline(pg_conn, spark, slot_name, tmp_path, [ORDERS])  # ts_full not in the pipeline yet
    if plugin == "pgoutput":
        pipeline.options = {"plugin": "pgoutput", "publication": "ts_full_pub"}
    writer = _writer(pg_dsn, 3, ("ts_orders", "ts_full"))
    try:
        pipeline.run()
        request = request_table_snapshot(pipeline.staging, slot_name, ["ts_full"], "add-table", chunk_rows=60)
        state = pipeline.until_done(request.id, snapshot_rows=150)
    finally:
        _stop(writer)
    pipeline.run()  # the writer's last changes
    assert not state["error"], state["error"]
    table = state["tables"]["public.ts_full"]
    assert table["done"] and table["chunks"] >= ROWS // 60
    _equal(pg_conn, spark, pipeline.delta, ORDERS, FULL)
    staged = [t for m in pipeline.manifests for t in m.tables if (t.schema, t.table) == FULL]
    assert staged and all(t.key == ["id", "label", "amount", "note"] and t.replica_identity == "full" for t in staged)
    # the added table keeps flowing after its snapshot, keyed by all its columns
    pg_conn.execute(
        "update ts_full set label = 'after' where (id, label) = (select id, label from ts_full order by id, label limit 1)"
    )
    last = pipeline.run()
    assert any(t.table == "ts_full" and t.updates == 1 for t in last.tables), [
        (t.table, t.inserts, t.updates, t.deletes, t.rows) for t in last.tables
    ]
    _equal(pg_conn, spark, pipeline.delta, FULL)
    pg_conn.execute("drop publication ts_full_pub")


@pytest.mark.postgres
def test_full_identity_chunks_keep_repeated_rows_and_nulls_whole(
    tables: None, pg_conn: psycopg.Connection, slot_name: str, tmp_path: Path
) -> None:
    """A key of all columns repeats when rows do: a chunk boundary must not fall between copies of
    one row (the next chunk starts after the key), nor skip rows with NULLs."""
    pg_conn.execute("drop table if exists ts_dups")
    pg_conn.execute("create table ts_dups (a int, b text); alter table ts_dups replica identity full")
    pg_conn.execute(
        "insert into ts_dups select case when g % 7 = 0 then null else g % 11 end,"
        " case when g % 5 = 0 then null else 'v' || (g % 3) end from generate_series(1, 300) g"
    )
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging = str(tmp_path / "staging")
    request = request_table_snapshot(staging, slot_name, ["ts_dups"], "add-table", chunk_rows=4)
    manifest = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS])
    state = manifest.snapshots[request.id]
    assert state["done"] and not state["error"], state
    staged = next(t for t in manifest.tables if t.table == "ts_dups")
    assert staged.key == ["a", "b"] and staged.replica_identity == "full"
    rows = pq.read_table(Path(manifest.path) / staged.path).to_pydict()
    copied = Counter((a, b) for a, b, op in zip(rows["a"], rows["b"], rows["_pg_op"]) if op == "I")
    source = Counter(pg_conn.execute("select a, b from ts_dups").fetchall())
    assert sum(source.values()) == 300 and len(source) < 60  # rows repeat, and chunks of 4 split runs of them
    assert copied == source
    assert len(manifest.snapshot_chunks) - 1 < 300 // 4  # a chunk takes every copy of its last row


@pytest.mark.postgres
def test_full_identity_table_with_a_column_without_ordering_is_refused_by_name(
    tables: None, pg_conn: psycopg.Connection, slot_name: str, tmp_path: Path
) -> None:
    pg_conn.execute("drop table if exists ts_json")
    pg_conn.execute("create table ts_json (id int, doc json, at point, fine jsonb)")
    pg_conn.execute("alter table ts_json replica identity full")
    pg_conn.execute("insert into ts_json values (1, '{}', '(1,2)', '{}')")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging = str(tmp_path / "staging")
    request = request_table_snapshot(staging, slot_name, ["ts_json"], "add-table")
    manifest = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS])
    error = manifest.snapshots[request.id]["error"]
    assert "public.ts_json" in error and "'doc' (json), 'at' (point)" in error and "cannot be ordered" in error
    assert "'fine'" not in error and "Add a primary key" in error and "jsonb instead of json" in error
    assert manifest.snapshot_chunks == []  # refused before its TRUNCATE


@pytest.mark.postgres
@pytest.mark.spark
def test_resnapshot_of_a_deleted_delta_table_while_other_tables_flow(
    tables: None, pg_conn: psycopg.Connection, pg_dsn: str, slot_name: str, spark: Any, tmp_path: Path
) -> None:
    from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
    from airflow_provider_pgdecode.spark.merge_job import merge_batches

    pipeline = Pipeline(pg_conn, spark, slot_name, tmp_path, [ORDERS, REFUNDS])
    with create_slot_with_snapshot(pg_dsn, slot_name) as snapshot:
        initial = stage_snapshot(
            pg_dsn, snapshot.snapshot_name, snapshot.consistent_lsn, slot_name, pipeline.staging, [ORDERS, REFUNDS]
        )
    merge_batches(spark, [str(initial.path)], pipeline.delta)
    writer = _writer(pg_dsn, 2)
    try:
        pipeline.run()  # the writer keeps going: Delta is compared once it has stopped
        shutil.rmtree(Path(pipeline.delta) / "public" / "ts_refunds")
        request = request_table_snapshot(pipeline.staging, slot_name, [REFUNDS], "resnapshot", chunk_rows=80)
        orders_rows_during = 0
        for _ in range(30):
            manifest = pipeline.run(snapshot_rows=100)
            orders_rows_during += sum(t.rows for t in manifest.tables if t.table == "ts_orders")
            state = read_snapshot_state(pipeline.staging, slot_name, request.id)
            if state and state["done"]:
                break
        assert state and state["done"] and not state["error"]
    finally:
        _stop(writer)
    assert orders_rows_during > 0, "the other table's changes should flow while the copy runs"
    pipeline.run()
    _equal(pg_conn, spark, pipeline.delta, ORDERS, REFUNDS)


@pytest.mark.postgres
@pytest.mark.spark
def test_a_change_the_chunk_did_not_see_lands_after_the_chunk_row(
    tables: None,
    pg_conn: psycopg.Connection,
    pg_dsn: str,
    slot_name: str,
    spark: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transaction open while the chunk is read, committed before the high watermark: its
    change commits before the watermark in the WAL but is not in the chunk, so the chunk row must
    be placed before it, or the chunk's older value would win in Delta."""
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    pipeline = Pipeline(pg_conn, spark, slot_name, tmp_path, [ORDERS])
    pipeline.run()
    late = psycopg.connect(pg_dsn)  # not autocommit: the update stays open
    late.execute("update ts_refunds set reason = 'seen only in the WAL' where id = 5")
    original = TableSnapshotter._watermark

    def watermark(self: TableSnapshotter, content: dict[str, Any]) -> Any:
        if content.get("mark") == "high" and not late.closed:
            late.commit()  # after the chunk's snapshot, before its high watermark
            late.close()
        return original(self, content)

    monkeypatch.setattr(TableSnapshotter, "_watermark", watermark)
    request = request_table_snapshot(pipeline.staging, slot_name, [REFUNDS], "add-table", chunk_rows=ROWS * 2)
    manifest = pipeline.run()
    assert late.closed
    value = spark.read.format("delta").load(f"{pipeline.delta}/public/ts_refunds").where("id = 5").collect()
    assert value[0]["reason"] == "seen only in the WAL"
    _equal(pg_conn, spark, pipeline.delta, REFUNDS)
    chunks = [c for c in manifest.snapshot_chunks if c["kind"] == "rows"]
    assert len(chunks) == 1 and chunks[0]["rows"] == ROWS
    assert chunks[0]["moved_rows"] == 1
    assert read_snapshot_state(pipeline.staging, slot_name, request.id)["done"]


@pytest.mark.postgres
def test_a_bad_request_is_given_up_without_stopping_the_pipeline(
    tables: None, pg_conn: psycopg.Connection, slot_name: str, tmp_path: Path
) -> None:
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging = str(tmp_path / "staging")
    missing = request_table_snapshot(staging, slot_name, ["public.ts_missing"], "add-table", request_id="missing")
    nokey = request_table_snapshot(staging, slot_name, ["public.ts_nokey"], "add-table", request_id="nokey")
    good = request_table_snapshot(staging, slot_name, [REFUNDS], "add-table", request_id="good", chunk_rows=1000)
    pg_conn.execute("update ts_orders set status = 'x' where id = 1")
    manifest = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS])
    assert "does not exist" in manifest.snapshots[missing.id]["error"]
    assert "no primary key" in manifest.snapshots[nokey.id]["error"]
    assert manifest.snapshots[good.id]["done"] and not manifest.snapshots[good.id]["error"]
    staged = {t.table: t for t in manifest.tables}
    assert staged["ts_orders"].updates == 1
    assert staged["ts_refunds"].inserts == ROWS and staged["ts_refunds"].truncates == 1
    assert "ts_nokey" not in staged
    # the progress travels with the checkpoint: the next batch copies nothing again
    checkpoint = Checkpoint.from_dict(json.loads(json.dumps(Checkpoint.from_manifest(manifest).to_dict())))
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
    again = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS], checkpoint=checkpoint)
    assert again.snapshot_chunks == [] and again.snapshots == manifest.snapshots


@pytest.mark.postgres
def test_pgoutput_request_for_a_table_outside_the_publication_says_how_to_fix_it(
    tables: None, pg_conn: psycopg.Connection, slot_name: str, tmp_path: Path
) -> None:
    pg_conn.execute("drop publication if exists ts_pub")
    pg_conn.execute("create publication ts_pub for table ts_orders")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (slot_name,))
    staging = str(tmp_path / "staging")
    request = request_table_snapshot(staging, slot_name, [REFUNDS], "add-table")
    manifest = extract_batch(pg_conn, slot_name, staging, plugin="pgoutput", publication="ts_pub", tables=[ORDERS])
    assert "ALTER PUBLICATION ts_pub ADD TABLE public.ts_refunds" in manifest.snapshots[request.id]["error"]
    pg_conn.execute("drop publication ts_pub")


def test_module_imports_neither_airflow_nor_spark() -> None:
    source = Path(table_snapshot.__file__).read_text()
    assert "airflow." not in source.replace("airflow_provider_pgdecode", "") and "pyspark" not in source


@pytest.mark.postgres
def test_a_commit_not_yet_visible_makes_the_chunk_wait(
    tables: None,
    pg_conn: psycopg.Connection,
    pg_dsn: str,
    slot_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit waiting for a synchronous standby is in the WAL (an earlier batch may hold it)
    but invisible: a chunk read then would be older than Delta. The chunk waits instead."""
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging = str(tmp_path / "staging")
    monkeypatch.setattr(TableSnapshotter, "snapshot_attempts", 3)
    monkeypatch.setattr(TableSnapshotter, "snapshot_pause", 0.1)
    request = request_table_snapshot(staging, slot_name, [REFUNDS], "add-table", chunk_rows=1000)
    pg_conn.execute("alter system set synchronous_standby_names = 'nobody'")
    pg_conn.execute("select pg_reload_conf()")
    waiting = threading.Thread(
        target=lambda: psycopg.connect(pg_dsn, autocommit=True).execute(
            "set synchronous_commit = on; update ts_refunds set reason = 'waits for a standby' where id = 7"
        ),
        daemon=True,
    )
    try:
        time.sleep(0.5)
        waiting.start()
        for _ in range(50):
            if pg_conn.execute("select count(*) from pg_stat_activity where wait_event = 'SyncRep'").fetchone()[0]:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the update did not wait for the synchronous standby")
        first = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS])
    finally:
        pg_conn.execute("alter system reset synchronous_standby_names")
        pg_conn.execute("select pg_reload_conf()")
        waiting.join(10)
    state = first.snapshots[request.id]
    assert not state["done"] and not state["error"]
    assert [c["kind"] for c in first.snapshot_chunks] == ["truncate"]  # the TRUNCATE, no rows yet
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))
    second = extract_batch(pg_conn, slot_name, staging, tables=[ORDERS], checkpoint=Checkpoint.from_manifest(first))
    assert second.snapshots[request.id]["done"]
    assert [c["rows"] for c in second.snapshot_chunks] == [ROWS]


@pytest.mark.postgres
@pytest.mark.spark
def test_a_row_inserted_during_the_copy_is_not_doubled_in_a_new_delta_table(
    tables: None,
    pg_conn: psycopg.Connection,
    pg_dsn: str,
    slot_name: str,
    spark: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An INSERT committed after the low watermark and seen by the chunk arrives twice: as a
    logged INSERT and as a chunk row. Into a Delta table the batch creates, with nothing but
    inserts, it must still be one row (the merge, not a plain append)."""
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    pipeline = Pipeline(pg_conn, spark, slot_name, tmp_path, [ORDERS])
    original = table_snapshot.largest_key

    def largest_key(conn: Any, *args: Any) -> Any:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("insert into ts_refunds values (999, 1, 1.0, 'during the copy', '{}', now())")
        return original(conn, *args)

    monkeypatch.setattr(table_snapshot, "largest_key", largest_key)
    request_table_snapshot(pipeline.staging, slot_name, [REFUNDS], "add-table", chunk_rows=ROWS * 2)
    manifest = pipeline.run()
    refunds = next(t for t in manifest.tables if t.table == "ts_refunds")
    assert refunds.updates == refunds.deletes == 0 and refunds.inserts == ROWS + 2  # 401 copied + 1 logged
    _equal(pg_conn, spark, pipeline.delta, REFUNDS)
