"""Initial load from a slot's exported snapshot: the copy and the slot's later batches fit exactly.

Real PostgreSQL (the oracle) and real Spark + Delta. Writes run in another thread while the slot
is created and while the tables are copied, so a row missed or applied twice shows up.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, StagingError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLES = [("public", "snap_items"), ("public", "snap_pairs")]
ROWS = 3000


@pytest.fixture()
def source(pg_conn: psycopg.Connection) -> None:
    c = pg_conn
    c.execute("drop table if exists snap_items, snap_pairs")
    c.execute(
        "create table snap_items (id int primary key, name text not null, amount numeric(12,2), tags text[],"
        " placed timestamptz, flag boolean, data bytea, code char(3));"
        " create table snap_pairs (a text, b int, v double precision, primary key (a, b))"
    )
    c.execute(
        f"insert into snap_items select g, 'item ' || g, g * 1.25, array['t' || g % 7, 'x y'],"
        f" '2026-01-01 00:00:00+00'::timestamptz + g * interval '1 minute', g % 2 = 0, decode(md5(g::text), 'hex'),"
        f" 'c' || g % 10 from generate_series(1, {ROWS}) g"
    )
    c.execute("insert into snap_pairs select 'k ' || g % 37, g, g / 3.0 from generate_series(1, 800) g")


class Writer(threading.Thread):
    """Inserts, updates (key changes too) and deletes in short transactions until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.ops = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(7)
        next_id = 100_000
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop.is_set():
                    r = rng.random()
                    k = rng.randint(1, ROWS)
                    if r < 0.3:
                        next_id += 1
                        c.execute(
                            "insert into snap_items values (%s, 'new', 1.5, '{n}', now(), true, '\\x01', 'z')",
                            (next_id,),
                        )
                    elif r < 0.6:
                        c.execute("update snap_items set amount = amount + 1, name = name || '+' where id = %s", (k,))
                    elif r < 0.7:
                        c.execute("update snap_items set id = id + 1000000 where id = %s", (k,))
                    elif r < 0.8:
                        c.execute("delete from snap_items where id = %s", (k,))
                    elif r < 0.9:
                        with c.transaction():
                            c.execute("update snap_pairs set v = v + 1 where a = %s", (f"k {k % 37}",))
                            c.execute("delete from snap_pairs where b = %s", (k % 800,))
                            c.execute("insert into snap_pairs values (%s, %s, 0) on conflict do nothing", (f"w {k}", k))
                    else:
                        # Logs xl_running_xacts, which a slot being created waits for on a busy server.
                        c.execute("checkpoint")
                    self.ops += 1
                    time.sleep(0.001)
        except BaseException as exc:  # reported by the test
            self.error = exc


def wait_for_ops(writer: Writer, count: int) -> None:
    target = writer.ops + count
    deadline = time.monotonic() + 20
    while writer.ops < target and time.monotonic() < deadline and writer.error is None:
        time.sleep(0.01)
    assert writer.error is None, writer.error
    assert writer.ops >= target, "the concurrent writer stalled"


def assert_delta_equals_postgres(pg_conn, spark, delta_root: str, tables=TABLES) -> None:
    for schema, table in tables:
        result = compare_table(pg_conn, spark, delta_root, schema, table)
        assert result.equal, result.describe()
        assert result.source_rows > 0


def merge_then_follow(
    pg_conn, spark, slot: str, snapshot: BatchManifest, staging: Path, delta_root: str, tables=TABLES
) -> None:
    """Merge the snapshot, then the slot's batch after it; Delta must equal PostgreSQL; replays are no-ops."""
    lsn = snapshot.end_lsn
    assert snapshot.start_lsn == "0/0"
    summary = merge_batches(spark, [str(snapshot.path)], delta_root)
    assert all(t["status"] == "merged" for t in summary["tables"].values()), summary
    # The manifest is an ordinary one: the checkpoint flow reads it.
    checkpoint = Checkpoint.from_manifest(BatchManifest.read(snapshot.path))
    assert checkpoint.end_lsn == Lsn.parse(lsn)
    follow = extract_batch(pg_conn, slot, staging, checkpoint=checkpoint)
    assert follow.start_lsn == lsn  # the slot starts exactly where the snapshot ends
    assert follow.changes > 0
    merge_batches(spark, [str(follow.path)], delta_root)
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, follow.end_lsn))
    assert_delta_equals_postgres(pg_conn, spark, delta_root, tables)

    replay = merge_batches(spark, [str(snapshot.path), str(follow.path)], delta_root)
    assert all(t["status"] == "skipped" for t in replay["tables"].values()), replay
    assert_delta_equals_postgres(pg_conn, spark, delta_root, tables)


def test_snapshot_then_slot_batches_equal_source_under_concurrent_writes(
    pg_conn, pg_dsn, source, slot_name, spark, tmp_path: Path
) -> None:
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    writer = Writer(pg_dsn)
    writer.start()
    try:
        wait_for_ops(writer, 20)
        with create_slot_with_snapshot(pg_dsn, slot_name, "test_decoding", two_phase=True) as (lsn, name):
            ops_before_copy = writer.ops
            snapshot = stage_snapshot(pg_dsn, name, lsn, slot_name, staging, TABLES)
            wait_for_ops(writer, 20)
            assert writer.ops > ops_before_copy
            with psycopg.connect(pg_dsn) as reader:  # what the exported snapshot shows, read independently
                reader.execute("begin isolation level repeatable read")
                reader.execute(f"set transaction snapshot '{name}'")
                in_snapshot = sorted(r[0] for r in reader.execute("select id from snap_items"))
                now = sorted(r[0] for r in pg_conn.execute("select id from snap_items"))
        wait_for_ops(writer, 50)  # more changes after the snapshot's connection closed
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.error is None, writer.error

    assert snapshot.end_lsn == str(lsn)
    assert Path(snapshot.path).name == f"{0:016X}-{int(lsn):016X}"
    assert (Path(snapshot.path) / "snapshot.json").is_file() and not (Path(snapshot.path) / "progress.json").exists()
    items = next(t for t in snapshot.tables if t.table == "snap_items")
    assert items.truncates == 1 and items.key == ["id"]
    staged = pq.read_table(Path(snapshot.path) / items.path, columns=["id", "_pg_op", "_pg_commit_lsn"]).to_pydict()
    assert sorted(i for i, op in zip(staged["id"], staged["_pg_op"]) if op == "I") == in_snapshot != now
    assert set(staged["_pg_commit_lsn"]) == {int(lsn)}
    merge_then_follow(pg_conn, spark, slot_name, snapshot, staging, delta_root)


def test_chunked_copy_resumes_after_a_failure_and_gives_the_same_result(
    pg_conn, pg_dsn, source, slot_name, spark, tmp_path: Path
) -> None:
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    seen: list[tuple[str, int]] = []

    def fail_once(schema: str, table: str, chunk: int, rows: int) -> None:
        seen.append((table, chunk))
        if table == "snap_items" and chunk == 3 and seen.count((table, chunk)) == 1:
            raise ConnectionError("simulated failure after chunk 3")

    writer = Writer(pg_dsn)
    writer.start()
    try:
        with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
            with pytest.raises(ConnectionError):
                stage_snapshot(
                    pg_dsn, name, lsn, slot_name, staging, TABLES, chunk_pages=1, workers=2, on_chunk=fail_once
                )
            before = len(seen)
            wait_for_ops(writer, 30)  # the source moves on; the snapshot does not
            snapshot = stage_snapshot(
                pg_dsn, name, lsn, slot_name, staging, TABLES, chunk_pages=1, workers=2, on_chunk=fail_once
            )
        wait_for_ops(writer, 30)
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.error is None, writer.error

    assert 0 < before < len(seen)
    info = json.loads((Path(snapshot.path) / "snapshot.json").read_text())
    for entry in info["tables"]:
        chunks = [chunk for table, chunk in seen if table == entry["table"]]
        assert sorted(chunks) == list(range(entry["chunks"])), entry["table"]  # each chunk copied once
        assert entry["chunks"] > 3
    items = next(t for t in snapshot.tables if t.table == "snap_items")
    assert items.inserts > ROWS - 100 and len(items.files) > 3
    merge_then_follow(pg_conn, spark, slot_name, snapshot, staging, delta_root)


def test_workers_do_not_change_what_is_staged(pg_conn, pg_dsn, source, slot_name, tmp_path: Path) -> None:
    writer = Writer(pg_dsn)  # the tables grow while they are planned twice: only trailing empty chunks differ
    writer.start()
    try:
        with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
            one = stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path / "one", TABLES, chunk_pages=2, workers=1)
            wait_for_ops(writer, 100)
            three = stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path / "three", TABLES, chunk_pages=2, workers=3)
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.error is None, writer.error
    assert one.contents() == three.contents()
    for table in one.tables:
        assert len(table.files) > 1
        for file in table.files:
            a = pq.read_table(Path(one.path) / table.path / file)
            b = pq.read_table(Path(three.path) / table.path / file)
            assert a.equals(b), (table.table, file)


def test_clear_errors_for_bad_tables(pg_conn, pg_dsn, source, slot_name, tmp_path: Path) -> None:
    pg_conn.execute("drop table if exists snap_nokey; create table snap_nokey (a int, b text)")
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        with pytest.raises(CatalogError, match="snap_missing"):
            stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path, ["public.snap_missing"])
        with pytest.raises(CatalogError, match="no primary key"):
            stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path, ["public.snap_items", "public.snap_nokey"])
        with pytest.raises(ValueError, match="workers"):
            stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path, TABLES, workers=0)


def test_snapshot_of_a_replica_identity_full_table_without_a_key(
    pg_conn, pg_dsn, slot_name, spark, tmp_path: Path
) -> None:
    """Keyed by all its columns, as the incremental extract keys it (one rule): copied in page
    ranges (no ordering needed, so json and point columns are fine), then followed by the slot."""
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    full = ("public", "snap_full")
    c = pg_conn
    c.execute("drop table if exists snap_full")
    c.execute("create table snap_full (id int, label text, doc json, at point)")
    c.execute("alter table snap_full replica identity full")
    c.execute(
        "insert into snap_full select g, 'label ' || g, json_build_object('g', g, 's', 'a,\"b'), point(g, -g)"
        " from generate_series(1, 2000) g"
    )
    c.execute("insert into snap_full select 3000, 'same id ' || g, '{}', point(0, 0) from generate_series(1, 20) g")
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        # After the consistent point: the slot's next batch carries these, keyed by all columns.
        c.execute("update snap_full set label = label || '+' where id % 100 = 0")
        c.execute("update snap_full set doc = '{\"changed\": true}', at = point(0, 0) where id % 150 = 1")
        c.execute("delete from snap_full where id % 97 = 0")
        c.execute("insert into snap_full select g, 'new', '[]', point(1, 1) from generate_series(5001, 5050) g")
        snapshot = stage_snapshot(pg_dsn, name, lsn, slot_name, staging, [full], chunk_pages=3, workers=2)
    staged = snapshot.tables[0]
    assert staged.key == ["id", "label", "doc", "at"] and staged.replica_identity == "full"
    assert staged.inserts == 2020 and len(staged.files) > 1
    merge_then_follow(pg_conn, spark, slot_name, snapshot, staging, delta_root, [full])


def test_snapshot_cannot_be_used_after_the_slot_connection_closed(pg_conn, pg_dsn, source, slot_name, tmp_path) -> None:
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        pass
    with pytest.raises(StagingError, match="exported only while"):
        stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path, TABLES)
    # The slot stays (the block succeeded); an error inside the block drops it again.
    other = slot_name + "_x"
    with pytest.raises(RuntimeError):
        with create_slot_with_snapshot(pg_dsn, other):
            raise RuntimeError("copy failed")
    assert pg_conn.execute("select count(*) from pg_replication_slots where slot_name = %s", (other,)).fetchone() == (
        0,
    )
    assert pg_conn.execute(
        "select count(*) from pg_replication_slots where slot_name = %s", (slot_name,)
    ).fetchone() == (1,)


BIG_ROWS = 60_000
CHILD = """
import json, logging, sys, time
from airflow_provider_pgdecode.capture.snapshot import stage_snapshot
logging.basicConfig(level=logging.INFO)
a = json.loads(sys.argv[1])
stage_snapshot(a["dsn"], a["name"], a["lsn"], a["slot"], a["staging"], [tuple(t) for t in a["tables"]], chunk_pages=a["pages"],
               workers=2, on_chunk=lambda *_: time.sleep(0.2), log_interval=0)
"""


def test_copy_killed_with_sigkill_resumes_without_redoing_chunks(
    pg_conn, pg_dsn, source, slot_name, spark, tmp_path: Path
) -> None:
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    c = pg_conn
    c.execute("drop table if exists snap_big")
    c.execute(
        "create table snap_big (id bigint primary key, label text, amount numeric(14,4), at timestamptz,"
        " ok boolean, doc jsonb)"
    )
    c.execute(
        f"insert into snap_big select g, repeat('x', g % 50) || g, g / 7.0, timestamptz '2026-01-01' + g * interval '1 s',"
        f" g % 3 = 0, jsonb_build_object('g', g, 's', 'a\"b,c') from generate_series(1, {BIG_ROWS}) g"
    )
    tables = [*TABLES, ("public", "snap_big")]
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        # Changes after the consistent point: the slot's next batch carries them.
        c.execute("update snap_big set label = 'changed' where id % 1000 = 0")
        c.execute("delete from snap_big where id % 997 = 0")
        c.execute("insert into snap_big select g, 'new', 1, now(), true, '{}' from generate_series(100001, 100500) g")
        arguments = {
            "dsn": pg_dsn,
            "name": name,
            "lsn": str(lsn),
            "slot": slot_name,
            "staging": str(staging),
            "tables": [list(t) for t in tables],
            "pages": 20,
        }
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(arguments)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        progress = staging / slot_name / f".tmp-snapshot-{name}" / "progress.json"
        deadline = time.monotonic() + 60
        done = 0
        while time.monotonic() < deadline and child.poll() is None:
            try:
                record = json.loads(progress.read_text())
                done = sum(len(t["done"]) for t in record["tables"].values())
            except (OSError, ValueError):
                pass
            if done >= 6:
                break
            time.sleep(0.05)
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        log = child.stderr.read().decode()
        assert "Snapshot copy overall" in log and "rows/s, ETA" in log
        record = json.loads(progress.read_text())  # what survived the kill
        before = {(t["table"], int(i)) for t in record["tables"].values() for i in t["done"]}
        total = {t["table"]: t["chunks"] for t in record["tables"].values()}
        assert 6 <= len(before) < sum(total.values()) - 2
        big = record["tables"]["public.snap_big"]
        assert big["chunks"] > 5
        stamps = {}
        for t in record["tables"].values():
            for d in t["done"].values():
                if d["file"]:
                    st = (progress.parent / "tables" / "public" / t["table"] / d["file"]).stat()
                    stamps[(t["table"], d["file"])] = (st.st_ino, st.st_mtime_ns)

        seen: list[tuple[str, int]] = []
        snapshot = stage_snapshot(
            pg_dsn,
            name,
            lsn,
            slot_name,
            staging,
            tables,
            chunk_pages=20,
            workers=3,
            on_chunk=lambda s, t, i, r: seen.append((t, i)),
        )
    assert not before & set(seen), "chunks finished before the kill were copied again"
    assert before | set(seen) == {(t, i) for t, n in total.items() for i in range(n)}
    assert len(seen) == len(set(seen))
    for (table, file), stamp in stamps.items():
        st = (Path(snapshot.path) / "tables" / "public" / table / file).stat()
        assert (st.st_ino, st.st_mtime_ns) == stamp, f"{table}/{file} was rewritten"
    assert not list(Path(snapshot.path).rglob("*.part"))
    staged = next(t for t in snapshot.tables if t.table == "snap_big")
    assert staged.inserts == BIG_ROWS
    ids = pq.read_table(Path(snapshot.path) / staged.path, columns=["id"]).column("id").drop_null().to_pylist()
    assert sorted(ids) == list(range(1, BIG_ROWS + 1))

    merge_then_follow(pg_conn, spark, slot_name, snapshot, staging, delta_root, tables)


def test_awkward_values_survive_the_csv_copy(pg_conn, pg_dsn, slot_name, spark, tmp_path: Path) -> None:
    """NULL against '', quotes, commas, newlines, backslashes, arrays with quoted and NULL elements."""
    c = pg_conn
    c.execute("drop table if exists snap_awkward")
    c.execute(
        "create table snap_awkward (id int primary key, t text, tags text[], j jsonb, b bytea, n numeric,"
        " d date, ts timestamp)"
    )
    c.execute(
        "insert into snap_awkward values"
        " (1, '', '{}', '{}', '\\x', 0, '2026-01-01', '2000-01-01 00:00:00'),"
        " (2, null, null, null, null, null, null, null),"
        " (3, 'a,b \"q\" ''s''', array['x,y', 'q\"t', null, '', 'NULL'], '{\"k\": \"v\\n\"}', '\\x00ff', 1.5,"
        "  '2026-02-03', '2026-02-03 04:05:06.789'),"
        " (4, e'line\\nbreak\\r\\n\\ttab \\\\ back', array[e'a\\\\b', 'ü'], '[1, 2.5, null]', '\\x0a0d', -1.5e-10,"
        "  '0001-01-01', '1999-12-31 23:59:59.999999'),"
        " (5, '\"', array['\"'], '\"\"', null, 12345678901234567890.123, null, null)"
    )
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        snapshot = stage_snapshot(
            pg_dsn, name, lsn, slot_name, tmp_path / "staging", ["public.snap_awkward"], workers=2
        )
    staged = pq.read_table(Path(snapshot.path) / snapshot.tables[0].path).to_pydict()
    rows = {i: (t, tags) for i, t, tags in zip(staged["id"], staged["t"], staged["tags"]) if i is not None}
    assert rows[1] == ("", []) and rows[2] == (None, None)
    assert rows[3] == ("a,b \"q\" 's'", ["x,y", 'q"t', None, "", "NULL"])
    assert rows[4][0] == "line\nbreak\r\n\ttab \\ back" and rows[5][0] == '"'
    summary = merge_batches(spark, [str(snapshot.path)], str(tmp_path / "delta"))
    assert summary["tables"]["public.snap_awkward"]["status"] == "merged", summary
    result = compare_table(pg_conn, spark, str(tmp_path / "delta"), "public", "snap_awkward")
    assert result.equal, result.describe()
