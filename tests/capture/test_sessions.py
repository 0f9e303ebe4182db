"""A batch decoded in two sessions (the upper half over a temporary copy of the slot) is the batch
one session gives: prepared transactions across the split, a streamed transaction in progress at
it, messages, TRUNCATE, bounds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture import sessions
from airflow_provider_pgdecode.capture.bounds import BatchBounds
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import native_wanted
from airflow_provider_pgdecode.capture.sessions import (
    LOWER_SHARE,
    MIN_SPLIT_WAL_BYTES,
    MIN_WAL_BYTES_PER_CHANGE,
    UPPER_MARGIN,
    ExpectedBatch,
    expected_end,
    first_split,
    split_point,
    two_sessions_wanted,
    upper_slot_needed,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import pgoutput_options
from airflow_provider_pgdecode.decoding.test_decoding import DEFAULT_OPTIONS
from airflow_provider_pgdecode.postgres.slot import SlotClient, SlotError, upper_slot_name
from tests.capture.test_extract_pgoutput import staged

PUBLICATION = "split_pub"


def test_split_point_splits_a_large_range_only_a_little_below_half() -> None:
    start = Lsn(1 << 32)
    assert split_point(start, Lsn(int(start) + MIN_SPLIT_WAL_BYTES - 1)) is None
    size = 2 * MIN_SPLIT_WAL_BYTES
    assert split_point(start, Lsn(int(start) + size)) == Lsn(int(start) + int(size * LOWER_SHARE))
    assert 0.35 < LOWER_SHARE < 0.5  # the lower part's rows are read while the upper part decodes
    assert split_point(start, Lsn(int(start) + 10), min_wal_bytes=0) == Lsn(int(start) + 4)
    assert split_point(start, Lsn(int(start) + 2), min_wal_bytes=0) == Lsn(int(start) + 1)  # never at the start


def test_a_backlog_batch_is_split_on_the_way_to_where_its_change_bound_is_expected() -> None:
    start, upto = Lsn(1 << 32), Lsn((1 << 32) + (1 << 30))
    assert expected_end(start, upto, None, 200.0) == upto
    assert expected_end(start, upto, 1_000_000, None) == upto
    assert expected_end(start, upto, 1_000_000, 200.0) == Lsn(int(start) + 200_000_000)
    assert expected_end(start, upto, 1_000_000, 5000.0) == upto  # the ceiling comes first
    assert split_point(start, expected_end(start, upto, 1_000_000, 200.0)) == Lsn(int(start) + 84_000_000)


def test_the_second_session_of_a_backlog_batch_decodes_only_the_rows_expected_after_its_start() -> None:
    start, upto = Lsn(1 << 32), Lsn((1 << 32) + (1 << 30))
    bounds = BatchBounds(max_changes=1_000_000, max_wal_bytes=None)
    measured = Checkpoint("s", start, rows_per_change=1.002, wal_bytes_per_change=200.0)
    split = first_split(start, upto, bounds, measured, None, None)
    assert split is not None and split.at == Lsn(int(start) + 84_000_000)
    expected = split.expected
    assert expected == ExpectedBatch(start, Lsn(int(start) + 200_000_000), bounds.peek_rows(1.002))
    # 0.58 of the batch lies after the split: that share of its rows, with the margin
    assert expected.upper_rows(split.at) == int(expected.rows * (1 - 0.42) * UPPER_MARGIN) + 2
    assert expected.upper_rows(Lsn(int(start) + 1)) == expected.rows  # never more than the batch's
    assert expected.upper_rows(Lsn(int(expected.end) + 1)) == 2
    # a batch that reaches its ceiling first: the second session's rows are not limited further
    near = Lsn(int(start) + 100_000_000)
    split = first_split(start, near, bounds, measured, None, None)
    assert split is not None and split.expected is None and split.at == Lsn(int(start) + 42_000_000)
    # WAL per change not known yet: a range that may hold more than a batch is read in one session,
    # one that cannot is split on the way to its ceiling
    assert first_split(start, upto, bounds, None, None, None) is None
    small = Lsn(int(start) + bounds.max_changes * MIN_WAL_BYTES_PER_CHANGE)
    split = first_split(start, small, bounds, None, None, None)
    assert split is not None and split.at == split_point(start, small) and split.expected is None
    assert first_split(start, upto, bounds, measured, False, None) is None


def test_a_two_phase_test_decoding_slot_needs_its_upper_half_slot() -> None:
    assert not upper_slot_needed("test_decoding", False, list(DEFAULT_OPTIONS))
    assert upper_slot_needed("test_decoding", True, list(DEFAULT_OPTIONS))
    assert not upper_slot_needed("pgoutput", True, pgoutput_options("p", 150000, two_phase=True))
    assert upper_slot_needed("pgoutput", True, pgoutput_options("p", 150000))
    assert upper_slot_name("shop") == "shop_upper" and upper_slot_name("s" * 58) is None


def test_the_settings_turn_two_sessions_and_the_native_reader_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for wanted, name in ((native_wanted, "PGDECODE_NATIVE"), (two_sessions_wanted, "PGDECODE_TWO_SESSIONS")):
        monkeypatch.delenv(name, raising=False)
        assert wanted(None) is True  # on unless turned off
        monkeypatch.setenv(name, " Off ")
        assert wanted(None) is False
        assert wanted(True) is True  # an argument wins over the environment
        monkeypatch.setenv(name, "yes")
        assert wanted(None) is True


def outcome(manifest: BatchManifest) -> dict[str, Any]:
    """What a batch holds, without how it was read."""
    skipped = {k: v for k, v in manifest.skipped.items() if k not in ("rows_read", "second_session_repeats")}
    return {
        "rows": staged(manifest),
        "end_lsn": manifest.end_lsn,
        "changes": manifest.changes,
        "transactions": manifest.transactions,
        "pending": sorted(p["gid"] for p in manifest.prepared_pending),
        "committed": sorted(p["gid"] for p in manifest.prepared_committed),
        "rolled_back": sorted(p["gid"] for p in manifest.prepared_rolled_back if p["seen"]),
        "messages": manifest.messages,
        "bounded_by": manifest.bounded_by,
        "skipped": skipped,
    }


def _insert_lsn(c: psycopg.Connection) -> Lsn:
    return Lsn.parse(str(c.execute("select pg_current_wal_insert_lsn()").fetchone()[0]))


def _two_halves(c: psycopg.Connection, rows: int = 400, per: int = 50) -> Lsn:
    """Transactions of ``per`` inserts into split_a, ``rows`` in all, and an LSN between the halves."""
    split = Lsn(0)
    for start in range(0, rows, per):
        c.execute(
            "insert into split_a select g, 'v' from generate_series(%s::int, %s::int) g", (start + 1, start + per)
        )
        if start + per == rows // 2:
            split = _insert_lsn(c)
    return split


def streaming_dsn(dsn: str) -> str:
    """The DSN with a tiny logical_decoding_work_mem: large transactions are streamed (pgoutput)
    or spilled; the second session's connection, made like the first, has it too."""
    params = conninfo_to_dict(dsn)
    params["options"] = "-c logical_decoding_work_mem=64kB"
    return make_conninfo(**params)


@pytest.fixture()
def split_source(pg_conn: psycopg.Connection, slot_name: str):
    pg_conn.execute(f"drop table if exists split_a, split_b cascade; drop publication if exists {PUBLICATION}")
    pg_conn.execute(
        "create table split_a (id int primary key, v text); create table split_b (id int primary key, n int);"
        f" create publication {PUBLICATION} for table split_a, split_b"
    )
    yield slot_name
    pg_conn.execute(
        "select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s and not active",
        (slot_name + "_po",),
    )
    pg_conn.execute(f"drop publication if exists {PUBLICATION}")


def _pgoutput_slot(c: psycopg.Connection, split_source: str) -> str:
    """A two-phase pgoutput slot beside the fixture's (dropped by it)."""
    slot = split_source + "_po"
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (slot,))
    return slot


def _prepare(conn: psycopg.Connection, gid: str, statement: str) -> None:
    conn.execute("begin")
    conn.execute(statement)
    conn.execute(f"prepare transaction '{gid}'")


@pytest.mark.pg_matrix(since=15)
@pytest.mark.parametrize(
    ("plugin", "two_phase"),
    [("pgoutput", True), ("test_decoding", True), ("test_decoding", False)],
    ids=["pgoutput-2pc", "test_decoding-2pc", "test_decoding"],
)
def test_two_sessions_stage_the_batch_one_session_stages(
    pg_conn: psycopg.Connection, matrix_dsn: str, split_source: str, tmp_path: Path, plugin: str, two_phase: bool
) -> None:
    c = pg_conn
    slot = split_source if plugin == "test_decoding" else split_source + "_po"
    publication = PUBLICATION if plugin == "pgoutput" else None
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (slot, plugin, two_phase))
    if plugin == "test_decoding" and two_phase:  # its upper half is decoded over the upper-half slot
        SlotClient(c).create(str(upper_slot_name(slot)), plugin, two_phase=True)
    # An earlier batch leaves g0 prepared and pending.
    c.execute("insert into split_a select g, 'a' || g from generate_series(1, 50) g")
    _prepare(c, "g0", "insert into split_b values (100000, 0)")
    with psycopg.connect(streaming_dsn(matrix_dsn), autocommit=True) as conn:
        first = extract_batch(conn, slot, tmp_path / "first", plugin=plugin, publication=publication)
    conn_lsn = first.end_lsn
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, conn_lsn))
    checkpoint = Checkpoint.from_manifest(first)

    _prepare(c, "g1", "update split_a set v = 'g1' where id <= 10")  # prepared below the split
    _prepare(c, "g4", "delete from split_a where id = 50")  # rolled back above it
    c.execute("select pg_logical_emit_message(false, 'split', 'below')")
    with psycopg.connect(matrix_dsn, autocommit=True) as other:
        other.execute("begin")  # a large transaction in progress at the split (streamed by pgoutput)
        other.execute("insert into split_b select g, g from generate_series(1, 3000) g")
        c.execute("insert into split_a values (100, 'committed below')")
        split = _insert_lsn(c)
        c.execute("insert into split_a values (101, 'committed above')")
        other.execute("update split_b set n = -n where id <= 1500")
        other.execute("commit")
    c.execute("commit prepared 'g1'")
    c.execute("commit prepared 'g0'")
    c.execute("rollback prepared 'g4'")
    _prepare(c, "g3", "insert into split_a values (300, 'g3')")
    c.execute("commit prepared 'g3'")
    _prepare(c, "g2", "insert into split_a values (200, 'g2 pending')")  # still pending at the end
    c.execute("select pg_logical_emit_message(false, 'split', 'above')")
    c.execute("truncate split_b")
    c.execute("insert into split_b values (1, 1)")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))

    batches = {}
    for two in (False, True):
        with psycopg.connect(streaming_dsn(matrix_dsn), autocommit=True) as conn:
            batches[two] = extract_batch(
                conn,
                slot,
                tmp_path / str(two),
                plugin=plugin,
                publication=publication,
                checkpoint=checkpoint,
                upto_lsn=upto,
                two_sessions=two,
                split_at=split,
            )
    one, both = batches[False], batches[True]
    assert one.decode_split is None and both.decode_split == str(split)
    assert outcome(both) == outcome(one)
    rows = outcome(one)["rows"]
    assert any(r["v"] == "g1" for r in rows["public.split_a"])  # the test holds what it is about
    assert len(rows["public.split_b"]) > 3000
    if two_phase:
        assert outcome(one)["pending"] == ["g2"] and outcome(one)["committed"] == ["g0", "g1", "g3"]
        assert outcome(one)["rolled_back"] == ["g4"]
    if plugin == "pgoutput":
        # the copy, two-phase from the split on, delivered g1's and g0's PREPAREs again; kept once
        # (the upper-half slot, two-phase since before the batch, delivers them as the slot would)
        assert both.skipped.get("second_session_repeats", 0) >= 1
    # the slot's copy went with the second session
    assert not c.execute("select count(*) from pg_replication_slots where temporary").fetchone()[0]


@pytest.mark.postgres
def test_a_two_phase_test_decoding_slot_gets_an_upper_half_slot_that_follows_it(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slots = SlotClient(c)
    slot, upper = split_source, str(upper_slot_name(split_source))
    slots.create(slot, "test_decoding", two_phase=True)
    split = _two_halves(c, 200, 100)
    first = extract_batch(c, slot, tmp_path / "first", split_at=split)
    # No upper-half slot yet: one session, and the slot is made (beyond this batch) meanwhile.
    assert first.decode_split is None and first.changes == 200
    made = slots.describe(upper)
    assert made.two_phase and made.plugin == "test_decoding" and not made.temporary
    assert made.confirmed_flush_lsn is not None and made.confirmed_flush_lsn >= Lsn.parse(first.end_lsn)
    # Not an idle slot of another pipeline: the health check leaves it out.
    assert upper not in [info.slot_name for info in slots.idle_slots(0, besides=slot)]
    slots.advance(slot, Lsn.parse(first.end_lsn))

    _prepare(c, "u1", "update split_a set v = 'u1' where id <= 5")
    c.execute("insert into split_a select g, 'z' from generate_series(201, 300) g")
    split = _insert_lsn(c)
    c.execute("commit prepared 'u1'")
    _prepare(c, "u2", "delete from split_a where id = 7")  # pending at the end
    c.execute("insert into split_a select g, 'w' from generate_series(301, 400) g")
    checkpoint = Checkpoint.from_manifest(first)
    one = extract_batch(c, slot, tmp_path / "one", checkpoint=checkpoint, two_sessions=False)
    both = extract_batch(c, slot, tmp_path / "both", checkpoint=checkpoint, split_at=split)
    assert both.decode_split == str(split) and outcome(both) == outcome(one)
    assert outcome(both)["pending"] == ["u2"] and outcome(both)["committed"] == ["u1"]

    # The confirm moves the upper-half slot along (it retains no WAL the slot does not) ...
    end = slots.advance(slot, Lsn.parse(both.end_lsn))
    assert slots.describe(upper).confirmed_flush_lsn == end
    # ... and dropping the slot drops it.
    c.execute("rollback prepared 'u2'")
    assert slots.drop(slot) and slots.find(upper) is None


@pytest.mark.postgres
def test_an_upper_half_slot_past_where_the_batch_is_expected_to_end_is_left_alone(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = pg_conn
    slots = SlotClient(c)
    slot, upper = split_source, str(upper_slot_name(split_source))
    slots.create(slot, "test_decoding", two_phase=True)
    slots.create(upper, "test_decoding", two_phase=True)
    start, marks = _insert_lsn(c), {}
    for done in range(100, 1700, 100):
        c.execute("insert into split_a select g, 'v' from generate_series(%s::int, %s::int) g", (done - 99, done))
        marks[done] = _insert_lsn(c)
    # An earlier batch's second session left the upper-half slot at 1,200 changes; this batch is
    # expected to end at 1,000: all that slot would decode lies past the batch.
    slots.advance(upper, marks[1200], follow_upper=False)
    measured = (int(marks[1000]) - int(start)) / 1000
    checkpoint = Checkpoint(slot, start, rows_per_change=1.02, wal_bytes_per_change=measured)
    with caplog.at_level("INFO", logger="airflow_provider_pgdecode.capture.sessions"):
        manifest = extract_batch(
            c, slot, tmp_path, checkpoint=checkpoint, bounds=BatchBounds(max_changes=1000), split_at=marks[800]
        )
    assert manifest.decode_split is None and manifest.changes == 1000
    assert f"Decoding in one session: slot {upper} stands at {marks[1200]}, beyond this batch" in caplog.text
    assert "Decoding in two sessions" not in caplog.text


@pytest.mark.postgres
def test_an_upper_half_slot_that_waits_on_a_transaction_is_left_to_a_later_batch(
    pg_conn: psycopg.Connection, matrix_dsn: str, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slots = SlotClient(c)
    upper = str(upper_slot_name(split_source))
    slots.create(split_source, "test_decoding", two_phase=True)
    split = _two_halves(c, 200, 100)
    with psycopg.connect(matrix_dsn, autocommit=True) as other:
        other.execute("begin")  # running while the slot is made: its creation waits for it
        other.execute("insert into split_b values (1, 1)")
        manifest = extract_batch(c, split_source, tmp_path / "first", split_at=split)
        # The batch is whole, in one session; the creation was cancelled, nothing left half-made.
        assert manifest.decode_split is None and manifest.changes == 200
        assert slots.find(upper) is None
        assert not c.execute(
            "select count(*) from pg_stat_activity where query like '%%pg_create_logical_replication_slot%%'"
            " and state = 'active' and pid <> pg_backend_pid()"
        ).fetchone()[0]
        other.execute("commit")
    extract_batch(c, split_source, tmp_path / "again", split_at=split)
    assert slots.find(upper) is not None  # the next large batch made it


@pytest.mark.pg_matrix(since=18)
def test_an_upper_half_slot_older_than_its_slot_is_made_anew(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slots = SlotClient(c)
    upper = str(upper_slot_name(split_source))
    slots.create(upper, "test_decoding", two_phase=True)  # left from a slot of the same name, dropped by hand
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (split_source,))
    older = slots.describe(upper).two_phase_at
    split = _two_halves(c, 200, 100)
    manifest = extract_batch(c, split_source, tmp_path, split_at=split)
    # PostgreSQL 18 shows where each is two-phase from: the older one is not used, but dropped and made again.
    assert manifest.decode_split is None and manifest.changes == 200
    remade = slots.describe(upper).two_phase_at
    assert older is not None and remade is not None and remade > older


@pytest.mark.postgres
def test_creating_a_slot_drops_an_upper_half_slot_left_from_an_earlier_one(
    pg_conn: psycopg.Connection, split_source: str
) -> None:
    slots = SlotClient(pg_conn)
    upper = str(upper_slot_name(split_source))
    slots.create(upper, "test_decoding", two_phase=True)
    slots.create(split_source, "test_decoding", two_phase=True)
    assert slots.find(upper) is None and slots.find(split_source) is not None


@pytest.mark.pg_matrix(since=15)
@pytest.mark.parametrize("max_changes", [150, 1000], ids=["cut-below-split", "cut-above-split"])
def test_bounds_cut_a_two_session_batch_where_they_cut_one_session(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path, max_changes: int
) -> None:
    c = pg_conn
    slot = _pgoutput_slot(c, split_source)
    split = _two_halves(c, 1600, 100)
    batches = {}
    for two in (False, True):
        batches[two] = extract_batch(
            c,
            slot,
            tmp_path / str(two),
            plugin="pgoutput",
            publication=PUBLICATION,
            bounds=BatchBounds(max_changes=max_changes),
            two_sessions=two,
            split_at=split,
        )
    one, both = batches[False], batches[True]
    assert outcome(both) == outcome(one)
    assert one.bounded_by == "changes" and one.changes <= max_changes
    # a cut below the split leaves the second session unread (and cancelled); above, it is read
    assert both.decode_split == (None if max_changes < 800 else str(split))
    assert not c.execute("select count(*) from pg_replication_slots where temporary").fetchone()[0]


@pytest.mark.pg_matrix(since=15)
def test_a_second_session_stopped_by_its_own_row_limit_ends_the_batch_there_and_the_next_goes_on(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slot = _pgoutput_slot(c, split_source)
    start = Lsn.parse(str(c.execute("select pg_current_wal_insert_lsn()").fetchone()[0]))
    split = _two_halves(c, 1600, 100)  # 800 changes below the split
    whole = extract_batch(c, slot, tmp_path / "whole", plugin="pgoutput", publication=PUBLICATION, two_sessions=False)
    # The previous batch's WAL per change says 1,000 changes end just past the split: the
    # second session may decode a few rows only, and stops after its first transaction.
    guess = (int(split) - int(start)) / 800 * 0.84
    checkpoint = Checkpoint(slot, start, rows_per_change=1.02, wal_bytes_per_change=guess)
    bounds = BatchBounds(max_changes=1000, max_wal_bytes=None)
    first = extract_batch(
        c,
        slot,
        tmp_path / "a",
        plugin="pgoutput",
        publication=PUBLICATION,
        checkpoint=checkpoint,
        bounds=bounds,
        split_at=split,
    )
    assert first.decode_split == str(split)
    assert first.changes == 900 and first.bounded_by == "changes"  # below the bound: the second session's limit
    second = extract_batch(
        c,
        slot,
        tmp_path / "b",
        plugin="pgoutput",
        publication=PUBLICATION,
        checkpoint=Checkpoint.from_manifest(first),
        bounds=bounds,
    )
    assert second.bounded_by is None and second.end_lsn == whole.end_lsn
    drained = sorted(staged(first)["public.split_a"] + staged(second)["public.split_a"], key=lambda r: r["id"])
    assert drained == sorted(staged(whole)["public.split_a"], key=lambda r: r["id"]) and len(drained) == 1600


@pytest.mark.postgres
def test_without_a_slot_to_spare_the_batch_is_read_in_one_session(
    pg_conn: psycopg.Connection, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slot = _pgoutput_slot(c, split_source)
    split = _two_halves(c)
    free = c.execute(
        "select current_setting('max_replication_slots')::int - count(*) from pg_replication_slots"
    ).fetchone()[0]
    fillers = [f"filler_{slot}_{i}" for i in range(free)]
    for name in fillers:
        c.execute("select pg_create_physical_replication_slot(%s)", (name,))
    try:
        manifest = extract_batch(c, slot, tmp_path, plugin="pgoutput", publication=PUBLICATION, split_at=split)
    finally:
        for name in fillers:
            c.execute("select pg_drop_replication_slot(%s)", (name,))
    assert manifest.decode_split is None and manifest.changes == 400


@pytest.mark.postgres
def test_when_the_second_session_fails_the_slot_reads_the_upper_half(
    pg_conn: psycopg.Connection, pg_dsn: str, split_source: str, tmp_path: Path
) -> None:
    c = pg_conn
    slot = _pgoutput_slot(c, split_source)
    split = _two_halves(c)
    # A role allowed one connection: the second session cannot connect.
    c.execute("drop role if exists pgdecode_one_session")
    c.execute("create role pgdecode_one_session login replication connection limit 1")
    try:
        params = conninfo_to_dict(pg_dsn)
        params["user"] = "pgdecode_one_session"
        one = extract_batch(c, slot, tmp_path / "one", plugin="pgoutput", publication=PUBLICATION, two_sessions=False)
        with psycopg.connect(make_conninfo(**params), autocommit=True) as conn:
            fallback = extract_batch(
                conn, slot, tmp_path / "fallback", plugin="pgoutput", publication=PUBLICATION, split_at=split
            )
    finally:
        c.execute("drop role if exists pgdecode_one_session")
    assert fallback.decode_split is None
    assert outcome(fallback) == outcome(one) and one.changes == 400
    # the slot's own peek delivered the lower half again, dropped as repeats
    assert fallback.skipped["second_session_repeats"] >= 4
    assert fallback.rows_per_change == one.rows_per_change  # rows delivered twice are not counted


@pytest.mark.pg_matrix(since=15)
@pytest.mark.parametrize(
    ("plugin", "two_phase", "reader"),
    [
        ("pgoutput", True, "copy"),
        ("test_decoding", False, "copy"),
        ("test_decoding", True, "upper"),
        ("test_decoding", True, "slot"),
    ],
    ids=["pgoutput-2pc", "test_decoding", "test_decoding-2pc", "test_decoding-2pc-without-upper"],
)
def test_a_batch_staged_before_the_one_before_is_confirmed_is_the_batch_staged_after(
    pg_conn: psycopg.Connection,
    matrix_dsn: str,
    split_source: str,
    tmp_path: Path,
    plugin: str,
    two_phase: bool,
    reader: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drain's extract beside a merge: the slot is still before the batch being merged, and the
    next batch is decoded over a copy of the slot moved to its start, or for a two-phase
    test_decoding slot (whose copy would not be two-phase) over its upper-half slot; without one,
    over the slot itself, which delivers the batch before again."""
    monkeypatch.setattr(sessions, "MIN_AHEAD_WAL_BYTES", 1)
    c = pg_conn
    slot = split_source if plugin == "test_decoding" else split_source + "_po"
    publication = PUBLICATION if plugin == "pgoutput" else None
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (slot, plugin, two_phase))
    if reader == "upper":
        SlotClient(c).create(str(upper_slot_name(slot)), plugin, two_phase=True)
    c.execute("insert into split_a select g, 'a' || g from generate_series(1, 50) g")
    _prepare(c, "g0", "insert into split_b values (100000, 0)")  # pending at the first batch's end
    with psycopg.connect(matrix_dsn, autocommit=True) as other:
        other.execute("begin")  # in progress at the first batch's end (streamed by pgoutput)
        other.execute("insert into split_b select g, g from generate_series(1, 3000) g")
        c.execute("insert into split_a values (100, 'committed in the first batch')")
        _prepare(c, "g1", "update split_a set v = 'g1' where id <= 10")
        with psycopg.connect(streaming_dsn(matrix_dsn), autocommit=True) as conn:
            first = extract_batch(conn, slot, tmp_path / "first", plugin=plugin, publication=publication)
        c.execute("insert into split_a values (101, 'committed in the second batch')")
        other.execute("update split_b set n = -n where id <= 1500")
        other.execute("commit")
    c.execute("commit prepared 'g1'")
    c.execute("commit prepared 'g0'")
    _prepare(c, "g2", "insert into split_a values (200, 'g2 pending')")
    c.execute("select pg_logical_emit_message(false, 'ahead', 'second')")
    c.execute("truncate split_b")
    c.execute("insert into split_b values (1, 1)")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    checkpoint = Checkpoint.from_manifest(first)

    def second(where: str) -> BatchManifest:
        with psycopg.connect(streaming_dsn(matrix_dsn), autocommit=True) as conn:
            return extract_batch(
                conn,
                slot,
                tmp_path / where,
                plugin=plugin,
                publication=publication,
                checkpoint=checkpoint,
                upto_lsn=upto,
                two_sessions=False,
            )

    with caplog.at_level(logging.INFO, logger="airflow_provider_pgdecode.capture.sessions"):
        ahead = second("ahead")
    slot_at = c.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,))
    assert Lsn.parse(slot_at.fetchone()[0]) < Lsn.parse(first.end_lsn)  # the slot stayed where it was
    assert (f"over a copy of slot {slot};" in caplog.text) is (reader == "copy")
    assert (f"over slot {upper_slot_name(slot)};" in caplog.text) is (reader == "upper")
    assert (f"Decoding slot {slot} from its position" in caplog.text) is (reader == "slot")
    assert ("it has no upper-half slot yet" in caplog.text) is (reader == "slot")
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, first.end_lsn))  # the confirm
    after = second("after")
    repeated = ahead.skipped.pop("duplicate_prepares")
    dropped = ahead.skipped.pop("already_handled")
    for key in ("duplicate_prepares", "already_handled"):
        after.skipped.pop(key)
    assert outcome(ahead) == outcome(after)
    assert (dropped == 0) is (reader != "slot")  # the slot itself delivered the first batch again
    # g0's and g1's PREPAREs came again (from the pgoutput copy, two-phase from the batch's start, or
    # from the slot itself), kept once; the upper-half slot, two-phase from before them, did not
    assert repeated == (2 if plugin == "pgoutput" or (two_phase and reader == "slot") else 0)
    rows = outcome(after)["rows"]
    assert any(r["v"] == "g1" for r in rows["public.split_a"]) and len(rows["public.split_b"]) > 3000
    if two_phase:
        assert outcome(after)["pending"] == ["g2"] and outcome(after)["committed"] == ["g0", "g1"]
    # over the copy, only those PREPAREs were read twice (g0's 3 rows, g1's 12); the slot itself
    # delivers the first batch again (its 50 inserts at least)
    again = ahead.skipped["rows_read"] - after.skipped["rows_read"]
    assert again == (15 if plugin == "pgoutput" else 0) if reader != "slot" else again >= 50
    assert not c.execute("select count(*) from pg_replication_slots where temporary").fetchone()[0]


@pytest.mark.postgres
def test_a_copy_that_cannot_be_moved_is_dropped_and_the_slot_itself_reads_the_batch(
    pg_conn: psycopg.Connection,
    pg_dsn: str,
    split_source: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Moving the copy fails after the copy was made: the copy is dropped at once, not left to the
    extract's session, and the slot itself reads the batch, which equals the one staged after the
    confirm."""
    monkeypatch.setattr(sessions, "MIN_AHEAD_WAL_BYTES", 1)
    c, slot = pg_conn, split_source
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
    c.execute("insert into split_a select g, 'a' || g from generate_series(1, 50) g")
    first = extract_batch(c, slot, tmp_path / "first")
    c.execute("insert into split_a values (101, 'second batch')")
    made: list[int] = []
    copy_at = SlotClient.copy_at

    def copied_then_failed(self: SlotClient, name: str, copy_name: str, position: Lsn) -> Lsn:
        copy_at(self, name, copy_name, position)
        made.append(c.execute("select count(*) from pg_replication_slots where temporary").fetchone()[0])
        raise SlotError(f"slot {name}: moving its copy failed (a test)")

    monkeypatch.setattr(SlotClient, "copy_at", copied_then_failed)
    with psycopg.connect(pg_dsn, autocommit=True) as conn, caplog.at_level(logging.WARNING):
        ahead = extract_batch(conn, slot, tmp_path / "ahead", checkpoint=Checkpoint.from_manifest(first))
        left = c.execute("select count(*) from pg_replication_slots where temporary").fetchone()[0]
    assert made == [1] and left == 0  # made, then dropped while the extract's session is still open
    assert "moving its copy failed (a test)" in caplog.text
    monkeypatch.undo()
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, first.end_lsn))
    after = extract_batch(c, slot, tmp_path / "after", checkpoint=Checkpoint.from_manifest(first))
    assert ahead.skipped.pop("already_handled") > 0 and after.skipped.pop("already_handled") == 0
    assert outcome(ahead) == outcome(after) and after.changes == 1
