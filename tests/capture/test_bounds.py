"""Bounded batches against a real PostgreSQL: a backlog drained batch by batch, each within its
bounds and ending at a transaction boundary, replaying to what PostgreSQL holds."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.bounds import CHANGES, WAL_BYTES, BatchBounds, BatchCut
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.assembler import TransactionAssembler
from airflow_provider_pgdecode.decoding.events import Begin, Change, Commit, Operation, RowImage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from tests.capture.test_extract import advance, create_slot, table_rows

pytestmark = pytest.mark.postgres

PATHS = [
    pytest.param("test_decoding", False, id="test_decoding-python"),
    pytest.param("test_decoding", True, id="test_decoding-native"),
    pytest.param("pgoutput", True, id="pgoutput-native"),
]


def drain(conn: psycopg.Connection, slot: str, root: Any, bounds: BatchBounds, **kwargs: Any) -> list[BatchManifest]:
    """Extract and confirm batch after batch until one reaches its ceiling, as the DAG's drain does."""
    batches: list[BatchManifest] = []
    checkpoint = None
    for _ in range(50):
        manifest = extract_batch(conn, slot, root, checkpoint=checkpoint, bounds=bounds, **kwargs)
        batches.append(manifest)
        advance(conn, slot, manifest)
        checkpoint = Checkpoint.from_manifest(manifest)
        if manifest.bounded_by is None:
            return batches
    raise AssertionError("the backlog was not drained in 50 batches")


def replay(batches: list[BatchManifest], table: str) -> dict[int, str | None]:
    """The table the staged changes describe, applied in commit order."""
    state: dict[int, str | None] = {}
    seen: set[tuple[int, int]] = set()
    for manifest in batches:
        for row in table_rows(manifest, "public", table):
            position = (row["_pg_commit_lsn"], row["_pg_seq"])
            assert position not in seen, f"change {position} staged twice"
            seen.add(position)
            if row["_pg_op"] == "D":
                state.pop(int(row["id"] if row["id"] is not None else row["_pg_old"]["id"]), None)
            else:
                state[int(row["id"])] = row["v"]
    return state


def transactions_of(manifest: BatchManifest, table: str) -> list[int]:
    """Changes per committed transaction of a batch, in commit order."""
    counts: dict[int, int] = {}
    for row in table_rows(manifest, "public", table):
        counts[row["_pg_commit_lsn"]] = counts.get(row["_pg_commit_lsn"], 0) + 1
    return [counts[lsn] for lsn in sorted(counts)]


@pytest.mark.postgres
def test_a_batch_without_changes_carries_the_measures_of_the_one_before(pg_conn, slot_name, tmp_path) -> None:
    pg_conn.execute(f"create table {slot_name} (id int primary key, v text)")
    create_slot(pg_conn, slot_name)
    unknown = extract_batch(pg_conn, slot_name, tmp_path / "0")
    assert unknown.changes == 0 and (unknown.rows_per_change, unknown.wal_bytes_per_change) == (None, None)
    pg_conn.execute(f"insert into {slot_name} select g, 'a' from generate_series(1, 100) g")
    measured = extract_batch(pg_conn, slot_name, tmp_path / "1", checkpoint=Checkpoint.from_manifest(unknown))
    advance(pg_conn, slot_name, measured)
    assert measured.changes == 100 and measured.rows_per_change and measured.wal_bytes_per_change
    # A quiet cycle: the next busy one still knows where to split its decoding (capture/sessions.py).
    quiet = extract_batch(pg_conn, slot_name, tmp_path / "2", checkpoint=Checkpoint.from_manifest(measured))
    assert quiet.changes == 0
    assert (quiet.rows_per_change, quiet.wal_bytes_per_change) == (
        measured.rows_per_change,
        measured.wal_bytes_per_change,
    )


@pytest.mark.parametrize(("plugin", "native"), PATHS)
def test_a_backlog_drains_in_batches_within_the_change_bound(pg_conn, slot_name, tmp_path, plugin, native) -> None:
    pg_conn.execute(f"create table {slot_name} (id int primary key, v text)")
    if plugin == "pgoutput":
        pg_conn.execute(f"create publication {slot_name} for table {slot_name}")
    create_slot(pg_conn, slot_name, plugin=plugin)
    for t in range(6):  # 6 x 30 changes
        pg_conn.execute(
            f"insert into {slot_name} select g, 'a' from generate_series(%s::int, %s::int) g", (t * 30, t * 30 + 29)
        )
    with psycopg.connect(pg_conn.info.dsn, autocommit=True) as other:  # prepared early, committed later
        other.execute(f"begin; insert into {slot_name} select g, 'p' from generate_series(1000, 1019) g")
        other.execute("prepare transaction 'spans'")
    pg_conn.execute(f"update {slot_name} set v = 'big' where id < 150")  # 150 changes: above the bound
    for t in range(4):
        pg_conn.execute(f"update {slot_name} set v = 'u' || %s where id %% 4 = %s::int", (t, t))  # 45 changes each
    pg_conn.execute(f"delete from {slot_name} where id % 10 = 0")
    pg_conn.execute("commit prepared 'spans'")
    pg_conn.execute(f"insert into {slot_name} values (5000, 'last')")

    kwargs = {"plugin": plugin, **({"publication": slot_name} if plugin == "pgoutput" else {})}
    batches = drain(
        pg_conn, slot_name, tmp_path, BatchBounds(max_changes=100, max_wal_bytes=None), native=native, **kwargs
    )

    assert len(batches) >= 6
    # each batch measures its rows per change for the next one's row limit (30-change transactions: 32 rows)
    assert all(1.0 < b.rows_per_change < 1.1 for b in batches[:2])
    for manifest in batches:
        sizes = transactions_of(manifest, slot_name)
        if sum(sizes) > 100:
            assert sizes == [150], f"{manifest.label}: only the oversized transaction may pass the bound, got {sizes}"
    assert [b.bounded_by for b in batches[:-1]] == [CHANGES] * (len(batches) - 1)
    # Each batch starts where the one before ended: a chain, nothing repeated, nothing skipped.
    assert all(b.start_lsn == a.end_lsn for a, b in zip(batches, batches[1:], strict=False))
    # The prepared transaction was carried across a boundary and committed exactly once.
    pending = [i for i, b in enumerate(batches) if any(p["gid"] == "spans" for p in b.prepared_pending)]
    committed = [i for i, b in enumerate(batches) if any(p["gid"] == "spans" for p in b.prepared_committed)]
    assert pending and len(committed) == 1 and committed[0] > pending[0]
    expected = dict(pg_conn.execute(f"select id, v from {slot_name}").fetchall())
    assert replay(batches, slot_name) == expected


@pytest.mark.parametrize(("plugin", "native"), PATHS)
def test_the_wal_bound_ends_batches_at_transaction_boundaries(pg_conn, slot_name, tmp_path, plugin, native) -> None:
    pg_conn.execute(f"create table {slot_name} (id int primary key, v text)")
    if plugin == "pgoutput":
        pg_conn.execute(f"create publication {slot_name} for table {slot_name}")
    create_slot(pg_conn, slot_name, plugin=plugin)
    for t in range(20):
        pg_conn.execute(
            f"insert into {slot_name} select g, repeat('x', 100) from generate_series(%s::int, %s::int) g",
            (t * 5, t * 5 + 4),
        )
    pg_conn.execute(f"insert into {slot_name} select g, repeat('y', 100) from generate_series(1000, 1199) g")  # ~40 kB
    pg_conn.execute(f"insert into {slot_name} values (5000, 'last')")
    wal = 8192

    kwargs = {"plugin": plugin, **({"publication": slot_name} if plugin == "pgoutput" else {})}
    batches = drain(
        pg_conn, slot_name, tmp_path, BatchBounds(max_changes=None, max_wal_bytes=wal), native=native, **kwargs
    )

    assert len(batches) >= 4
    for manifest in batches:
        span = int(manifest.end) - int(manifest.start)
        if span > wal:
            assert len(transactions_of(manifest, slot_name)) == 1, (
                f"{manifest.label}: {span} bytes in several transactions"
            )
    assert any(transactions_of(b, slot_name) == [200] for b in batches)  # the large one, a batch of its own
    assert WAL_BYTES in {b.bounded_by for b in batches}
    assert replay(batches, slot_name) == dict(pg_conn.execute(f"select id, v from {slot_name}").fetchall())


def test_a_streamed_transaction_larger_than_the_bound_is_one_batch(pg_conn, slot_name, tmp_path) -> None:
    """pgoutput streams it (logical_decoding_work_mem is 64kB in the test cluster); the server's
    row limit stops inside the stream, so the extract widens it until the transaction ends."""
    pg_conn.execute(f"create table {slot_name} (id int primary key, v text)")
    pg_conn.execute(f"create publication {slot_name} for table {slot_name}")
    create_slot(pg_conn, slot_name, plugin="pgoutput")
    pg_conn.execute(f"insert into {slot_name} select g, repeat('s', 200) from generate_series(1, 3000) g")
    pg_conn.execute(f"insert into {slot_name} values (5000, 'after')")

    batches = drain(
        pg_conn,
        slot_name,
        tmp_path,
        BatchBounds(max_changes=100, max_wal_bytes=None),
        plugin="pgoutput",
        publication=slot_name,
    )

    assert [transactions_of(b, slot_name) for b in batches if b.changes] == [[3000], [1]]
    assert replay(batches, slot_name) == dict(pg_conn.execute(f"select id, v from {slot_name}").fetchall())


def test_bounds_refuse_what_is_not_a_positive_count() -> None:
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ConfigurationError, match="max_batch_changes must be a positive integer"):
            BatchBounds(max_changes=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_batch_wal_bytes"):
        BatchBounds(max_wal_bytes=0)
    assert not BatchBounds.unbounded().bounded
    assert BatchBounds(100, None).peek_rows() == 127
    # sized by the previous batch's rows per change: 5% more, between one and three rows
    assert BatchBounds(100, None).peek_rows(1.002) == 107
    assert BatchBounds(100, None).peek_rows(0.5) == 107
    assert BatchBounds(100, None).peek_rows(10.0) == 302
    # a slot behind the checkpoint (the drain's extract ahead): room for the rows read again first
    assert BatchBounds(100, None).peek_rows(1.0, 20_000, 200.0) == 212
    assert BatchBounds(100, None).peek_rows(1.0, 0, 200.0) == 107
    assert BatchBounds(100, None).peek_rows(1.0, 20_000, None) == 107


def test_the_first_transaction_is_taken_however_large() -> None:
    """Nothing held yet: no cut, so an oversized transaction still makes progress; after it, the
    next change past the bound cuts."""
    assembler = TransactionAssembler()
    cut = BatchCut(BatchBounds(max_changes=2, max_wal_bytes=None), Lsn(0), assembler)
    image = RowImage(("id",), ("integer",), (1,))
    events: list[Any] = [Begin(Lsn(1), 7)]
    events += [Change(Lsn(2 + i), 7, Operation.INSERT, "public", "t", None, image) for i in range(5)]
    events += [Commit(Lsn(10), 7), Begin(Lsn(11), 8), Change(Lsn(12), 8, Operation.INSERT, "public", "t", None, image)]
    decisions = []
    for event in events:
        decisions.append(cut.stops_before(event))
        if decisions[-1]:
            break
        assembler.feed(event)
    assert decisions[:-1] == [False] * 8 and decisions[-1] is True
    assert cut.cut_by == CHANGES and assembler.safe_lsn == Lsn(10)


def test_table_snapshot_chunks_wait_while_a_backlog_drains(pg_conn, slot_name, tmp_path) -> None:
    """The chunks' watermarks lie at the server's WAL position: a batch that cannot reach it (a
    backlog beyond the WAL bound) leaves them for a later run instead of copying them in vain."""
    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

    pg_conn.execute(f"create table {slot_name} (id int primary key, v text)")
    pg_conn.execute(f"create table {slot_name}_added (id int primary key)")
    pg_conn.execute(f"insert into {slot_name}_added select generate_series(1, 30)")
    create_slot(pg_conn, slot_name)
    for t in range(20):
        pg_conn.execute(
            f"insert into {slot_name} select g, repeat('x', 200) from generate_series({t * 10}, {t * 10 + 9}) g"
        )
    request_table_snapshot(tmp_path, slot_name, [f"{slot_name}_added"], "add-table", chunk_rows=100)

    batches = drain(
        pg_conn, slot_name, tmp_path, BatchBounds(max_changes=None, max_wal_bytes=16384), tables=[f"public.{slot_name}"]
    )

    chunked = [i for i, b in enumerate(batches) if b.snapshot_chunks]
    assert len(batches) >= 3 and chunked == [len(batches) - 1]  # only once the backlog was drained
    assert sum(c["rows"] for c in batches[-1].snapshot_chunks) == 30
    assert replay(batches, slot_name) == dict(pg_conn.execute(f"select id, v from {slot_name}").fetchall())
