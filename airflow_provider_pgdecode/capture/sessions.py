"""The extract's second decoding session: the upper part of a large batch's range is decoded on a
second connection, over a temporary copy of the slot (or, for a two-phase test_decoding slot, its
upper-half slot ``<slot>_upper``), while the slot's own session decodes the lower part; the
extract reads the lower part while the server still decodes the upper one.

Why the two halves together are exactly the batch one peek gives, and when one session is used
instead: docs/extract.md ("Two decoding sessions").

Example::

    from airflow_provider_pgdecode.capture.sessions import split_point
    from airflow_provider_pgdecode.decoding.lsn import Lsn

    split_point(Lsn.parse("0/1000000"), Lsn.parse("0/9000000"))  # Lsn('0/45C28F5'): 0.42 of the way
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.capture.bounds import BatchBounds
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.postgres.session import Connection, connect, conninfo_like
from airflow_provider_pgdecode.postgres.slot import SlotClient, SlotInfo, upper_slot_name

log = logging.getLogger(__name__)

MIN_SPLIT_WAL_BYTES = 32 << 20
"""A range of less WAL is decoded in one session: a second one's setup (a connection, a slot copy
moved by reading the WAL, ~50 ms) would cost more than it saves."""


UPPER_SLOT_WAIT_SECONDS = 2.0
"""How long an extract waits at its end for its upper-half slot to be created (then cancels it)."""


def two_sessions_wanted(two_sessions: bool | None) -> bool:
    """``two_sessions`` if given, else the environment (``PGDECODE_TWO_SESSIONS=0`` turns them
    off; default on)."""
    if two_sessions is not None:
        return two_sessions
    return yes_or_no(os.environ.get("PGDECODE_TWO_SESSIONS", "")) is not False


LOWER_SHARE = 0.42
"""The share of a split range's WAL that the slot's own session decodes; the second session takes
the rest. A little under half: the lower part's decode ends sooner, and its rows are read while
the server still decodes the upper part. Measured on two cores (bench/extract_bench.py's
500,000 pgoutput changes, means of 15 extracts): 0.43 s quiet and 0.67-0.69 s against two busy
loops, against 0.45 s and 0.72 s for halves; 0.38 and 0.45 were no better than 0.42."""


def split_point(start: Lsn, upto: Lsn, min_wal_bytes: int = MIN_SPLIT_WAL_BYTES) -> Lsn | None:
    """Where the second session starts: :data:`LOWER_SHARE` of the way from ``start`` to ``upto``,
    or None when the range holds less than ``min_wal_bytes`` of WAL."""
    size = int(upto) - int(start)
    if size < max(min_wal_bytes, 2):
        return None
    return Lsn(int(start) + max(1, int(size * LOWER_SHARE)))


def expected_end(start: Lsn, upto: Lsn, max_changes: int | None, wal_bytes_per_change: float | None) -> Lsn:
    """Where a batch from ``start`` is likely to end: ``upto``, or sooner when ``max_changes``
    changes at ``wal_bytes_per_change`` (the previous batch's) end it sooner. In a backlog the
    second session then begins on the way to there, not to ``upto``: its decoding beyond
    the batch's end would be spent in vain."""
    if max_changes is None or not wal_bytes_per_change:
        return upto
    return min(upto, Lsn(int(start) + int(max_changes * wal_bytes_per_change)))


UPPER_MARGIN = 1.1
"""The second session's row limit over the rows the batch is expected to take from it: a batch
that ends early at that limit is a little smaller (the next one goes on from there), while rows
decoded past the batch's cut are decoded and read in vain."""


@dataclass(frozen=True)
class ExpectedBatch:
    """A batch that ``max_batch_changes`` is expected to end at ``end``, before its ceiling (at the
    previous batch's WAL per change), after about ``rows`` rows decoded (its peek's row limit)."""

    start: Lsn
    end: Lsn
    rows: int

    def upper_rows(self, begin: Lsn) -> int:
        """The row limit of a second session that begins at ``begin``: the batch's rows after it,
        in proportion to the WAL, with :data:`UPPER_MARGIN`. Without it, that session would
        decode as many rows as the whole batch, most of them past its end."""
        share = (int(self.end) - int(begin)) / max(1, int(self.end) - int(self.start))
        return max(1, min(self.rows, int(self.rows * max(share, 0.0) * UPPER_MARGIN) + 2))


def session_split(start: Lsn, end: Lsn, two_sessions: bool | None, split_at: Lsn | None) -> Lsn | None:
    """Where a second decoding session begins (:func:`split_point` on the way to the batch's
    expected ``end``, or ``split_at`` when it lies between), or None for one session."""
    if not two_sessions_wanted(two_sessions):
        return None
    if split_at is not None:
        return split_at if start < split_at < end else None
    return split_point(start, end)


MIN_WAL_BYTES_PER_CHANGE = 40
"""Less WAL than a change takes (a DELETE's record by key is about 50 bytes): a range of less WAL
than ``max_batch_changes`` times this cannot be ended by that bound."""


@dataclass(frozen=True)
class Split:
    """Where a second decoding session begins, and where the batch is expected to end when a
    change bound ends it before its ceiling (which limits the second session's rows)."""

    at: Lsn
    expected: ExpectedBatch | None


def first_split(
    start: Lsn,
    upto: Lsn,
    bounds: BatchBounds,
    checkpoint: Checkpoint | None,
    two_sessions: bool | None,
    split_at: Lsn | None,
) -> Split | None:
    """Where a batch's first reading, from ``start`` up to its ceiling ``upto``, splits between two
    decoding sessions (:func:`session_split`, on the way to the end the checkpoint's WAL bytes per
    change lets expect), or None for one session."""
    wal_bytes_per_change = checkpoint.wal_bytes_per_change if checkpoint is not None else None
    if (
        wal_bytes_per_change is None
        and split_at is None
        and bounds.max_changes is not None
        and int(upto) - int(start) > bounds.max_changes * MIN_WAL_BYTES_PER_CHANGE
        and two_sessions_wanted(two_sessions)
    ):
        # Split on the way to the ceiling, the second session would likely decode past the batch's
        # end, and the upper-half slot moved there would be of no use to the next batches.
        log.info("Decoding in one session: the range may hold more than a batch, whose WAL per change is not known yet")
        return None
    end = expected_end(start, upto, bounds.max_changes, wal_bytes_per_change)
    at = session_split(start, end, two_sessions, split_at)
    if at is None:
        return None
    rows = bounds.peek_rows(checkpoint.rows_per_change) if checkpoint is not None else None
    return Split(at, ExpectedBatch(start, end, rows) if end < upto and rows is not None else None)


def upper_slot_needed(plugin: str, two_phase_slot: bool, options: Sequence[tuple[str, str]]) -> bool:
    """Whether the upper half is decoded over the slot's upper-half slot rather than a temporary
    copy: a copy is not a two-phase slot, and only pgoutput's ``two_phase`` option makes it decode
    as one (test_decoding has no such option)."""
    return two_phase_slot and not (plugin == "pgoutput" and ("two_phase", "true") in options)


MIN_AHEAD_WAL_BYTES = 1 << 20
"""A slot behind a batch's start by less WAL is read as it is: decoding that little again costs
less than a copy of the slot (~0.1 s to copy and move it over 1,000,000 changes, against ~3 s to
decode them)."""


@dataclass(frozen=True)
class Reader:
    """The slot a batch's peek reads, and where its decoding begins (the position it is confirmed
    up to): the slot itself, a temporary copy of it moved to the batch's start, or its upper-half
    slot moved there."""

    name: str
    position: Lsn
    splits: bool = True
    """Whether a second session may decode the batch's upper half (not when the upper-half slot,
    which that session would use, reads the whole batch)."""


@contextmanager
def reader_at(
    slots: SlotClient, slot: SlotInfo, start: Lsn, plugin: str, options: Sequence[tuple[str, str]]
) -> Iterator[Reader]:
    """The slot to peek for a batch that starts at ``start``: slot ``slot`` itself when it stands
    there. When it stands behind by :data:`MIN_AHEAD_WAL_BYTES` or more (the batch before is
    staged but not confirmed yet: the drain's extract beside that batch's merge, or a confirm that
    failed), another slot moved to ``start``, which decodes the batch only, as the slot would after
    a confirm of ``start``, while the slot stays where it is until that confirm: a temporary copy
    of it in ``slots``'s session, dropped at the end of the block, or, for a two-phase slot whose
    copy would not decode as it does (:func:`upper_slot_needed`), its upper-half slot, read in one
    session. The slot itself (logged) when neither can serve: its peek then decodes the range
    before ``start`` again, and the reader drops those rows."""
    behind = slot.confirmed_flush_lsn or Lsn(0)
    if int(start) - int(behind) < MIN_AHEAD_WAL_BYTES:
        yield Reader(slot.slot_name, behind)
        return
    copy = None
    if upper_slot_needed(plugin, slot.two_phase, options):
        reader, why_not = _upper_reader(slots, slot, start)
    else:
        copy = f"pgdecode_ahead_{os.getpid()}_{slots.conn.info.backend_pid}"
        reader, why_not = _copy_reader(slots, slot, start, copy)
    if reader is None:
        log.warning(
            "Decoding slot %s from its position %s again: the changes up to %s, staged but not confirmed, are "
            "read again and left out (slower, the same batch), since %s",
            slot.slot_name,
            behind,
            start,
            why_not,
        )
        yield Reader(slot.slot_name, behind)
        return
    log.info(
        "Decoding from %s over %s; slot %s stays at %s until confirmed",
        start,
        f"a copy of slot {slot.slot_name}" if copy else f"slot {reader.name}",
        slot.slot_name,
        behind,
    )
    try:
        yield reader
    finally:
        if copy is not None:
            _drop_copy(slots, copy)


def _copy_reader(slots: SlotClient, slot: SlotInfo, start: Lsn, copy: str) -> tuple[Reader | None, str]:
    """A temporary copy of ``slot`` named ``copy`` moved to ``start``, or None and why not."""
    if slots.free_slots() < 1:
        return None, "the server has no replication slot to spare for a copy (max_replication_slots)"
    try:
        position = slots.copy_at(slot.slot_name, copy, start)
    except SlotError as exc:
        _drop_copy(slots, copy)  # made before the move failed: not left to the session's end
        return None, str(exc)
    if position != start:
        _drop_copy(slots, copy)
        return None, f"its copy stopped at {position}, not at {start}"
    return Reader(copy, position), ""


def _upper_reader(slots: SlotClient, slot: SlotInfo, start: Lsn) -> tuple[Reader | None, str]:
    """``slot``'s upper-half slot moved to ``start``, or None and why not."""
    name = upper_slot_name(slot.slot_name)
    upper = None if name is None else slots.find(name)
    if name is None or upper is None:
        return None, (
            "a copy of a two-phase test_decoding slot is not two-phase, and it has no upper-half slot yet "
            "(a large batch read in two sessions makes one)"
        )
    why_not = _stale_upper(upper, slot)
    if (upper.slot_type, upper.database, upper.plugin, upper.two_phase) != (
        "logical",
        slot.database,
        slot.plugin,
        True,
    ):
        why_not = f"slot {name} is not a two-phase {slot.plugin} slot of {slot.database}"
    elif upper.active:
        why_not = f"slot {name} is in use"
    elif upper.confirmed_flush_lsn is None or upper.confirmed_flush_lsn > start:
        why_not = f"slot {name} stands at {upper.confirmed_flush_lsn}, past {start}"
    if why_not is not None:
        return None, why_not
    try:
        position = slots.advance(name, start, follow_upper=False)
    except SlotError as exc:
        return None, str(exc)
    if position != start:
        return None, f"slot {name} stopped at {position}, not at {start}"
    return Reader(name, position, splits=False), ""


def _drop_copy(slots: SlotClient, copy: str) -> None:
    """Drop a temporary copy of a slot; when its session cannot (a cancelled peek left it
    unusable), the copy goes with the session."""
    try:
        slots.drop(copy)
    except Exception as exc:
        log.debug("Slot %s goes with its session: %s", copy, exc)


class SecondHalf:
    """The second session, being started on a thread; :meth:`follow` hands its COPY to the reader."""

    def __init__(self, started: Future[Any], split: Lsn, row_limit: int | None, upper_rows: int | None) -> None:
        self.started = started
        self.split = split
        #: the first half's row limit (the batch's)
        self.row_limit = row_limit
        #: the second session's row limit
        self.upper_rows = upper_rows
        #: rows of the first half (set when it ended)
        self.first_rows: int | None = None
        #: the second session's COPY was handed to the reader
        self.taken = False
        #: the second session could not be started: the caller reads the upper half from the slot
        self.refused = False

    def follow(self, first_rows: int) -> Any | None:
        """The COPY that continues the first half, which ended after ``first_rows`` rows; None when
        the first half stopped at the row limit (then the batch ends within it), or when the second
        session could not be started (:attr:`refused`, logged)."""
        self.first_rows = first_rows
        if self.row_limit is not None and first_rows >= self.row_limit:
            return None
        try:
            copy = self.started.result()
        except Exception as exc:
            log.warning("Decoding the upper half in the slot's own session: the second session failed (%s)", exc)
            self.refused = True
            return None
        self.taken = True
        return copy


class _Second:
    """What the thread that starts the second session made so far, for the cleanup."""

    def __init__(self) -> None:
        self.other: Connection | None = None
        self.peek: AbstractContextManager[Any] | None = None
        self.abandoned = False

    def check(self) -> None:
        if self.abandoned:
            raise _Abandoned("the second half is not needed")

    def abandon(self) -> None:
        self.abandoned = True
        if self.other is not None:
            self.other.cancel_safe()


def _start(
    state: _Second,
    conninfo: str,
    slot_name: str,
    split: Lsn,
    upto: Lsn,
    options: Sequence[tuple[str, str]],
    upto_rows: int | None,
    upper: str | None,
) -> Any:
    """The second session: a connection, the slot's copy (or its upper-half slot ``upper``) moved
    to ``split``, its peek sent; the COPY, once the server has decoded the range (its first
    message comes then)."""
    other = state.other = connect(conninfo)
    state.check()
    client = SlotClient(other)
    if upper is None:
        reader = f"pgdecode_split_{os.getpid()}_{other.info.backend_pid}"
        position = client.copy_at(slot_name, reader, split)
    else:
        reader = upper
        position = client.advance(upper, split, follow_upper=False)
    if position != split:
        raise SlotError(f"slot {reader!r} stopped at {position}, not at {split}")
    state.check()
    peek = client.peek_copy(reader, upto, options, upto_rows=upto_rows)
    copy = peek.__enter__()
    state.peek = peek
    return copy


@contextmanager
def second_session(
    conn: Connection,
    slot_name: str,
    split: Lsn,
    upto: Lsn,
    options: Sequence[tuple[str, str]],
    upto_rows: int | None,
    upper: bool = False,
    expected: ExpectedBatch | None = None,
) -> Iterator[SecondHalf | None]:
    """Start decoding ``split``..``upto`` of ``slot_name`` in a second session like ``conn``'s,
    on a thread, while the caller starts the first half; gives the :class:`SecondHalf`, or None
    (logged) when the server has no replication slot to spare for the copy. The copy goes with
    the second connection, closed at the end of the block (its peek cancelled when it was not
    read to the end).

    With ``upper`` (:func:`upper_slot_needed`), the slot's upper-half slot decodes instead of a
    copy; the second half may then begin later than ``split``, where that slot stands. When it
    does not exist yet, it is created on a thread during this block (None: one session now).

    ``upto_rows`` is the first half's row limit; the second's is the same, or, for a batch
    ``expected`` to end before ``upto``, the rows expected after the second half's beginning
    (:meth:`ExpectedBatch.upper_rows`)."""
    client = SlotClient(conn)
    upper_name = None
    if upper:
        main = client.describe(slot_name)
        upper_name, begin = _upper_slot(client, main, split, upto if expected is None else expected.end)
        if upper_name is None:
            yield None
            return
        if begin is None:
            with _creating_upper(conn, client, main):
                yield None
            return
        split = begin
    elif client.free_slots() < 1:
        log.warning(
            "Decoding in one session: no replication slot to spare for a copy of %s (max_replication_slots)",
            slot_name,
        )
        yield None
        return
    upper_rows = upto_rows if expected is None or upto_rows is None else expected.upper_rows(split)
    state = _Second()
    conninfo = conninfo_like(conn)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdecode-second-session") as pool:
        # Connecting, copying the slot and moving the copy take ~40 ms, and the COPY's first
        # message comes once the server has decoded the whole range: all of it on a thread
        # (libpq releases the GIL) while this one starts the first half.
        started = pool.submit(_start, state, conninfo, slot_name, split, upto, options, upper_rows, upper_name)
        half = SecondHalf(started, split, upto_rows, upper_rows)
        log.info(
            "Decoding in two sessions: from %s on over %s%s",
            split,
            f"slot {upper_name}" if upper_name else f"a copy of slot {slot_name}",
            f" (at most {upper_rows} rows decoded)" if upper_rows is not None else "",
        )
        try:
            yield half
        except BaseException as exc:
            state.abandon()
            _end(started, state, exc)
            raise
        finally:
            if not half.taken:
                state.abandon()
        if half.taken:  # read to its end by the extract, which returned normally
            assert state.peek is not None
            state.peek.__exit__(None, None, None)
        else:  # the batch ended within the first half, or the second session failed
            _end(started, state, _Abandoned("the second half is not needed"))
        if state.other is not None:
            state.other.close()


def _upper_slot(client: SlotClient, main: SlotInfo, split: Lsn, end: Lsn) -> tuple[str | None, Lsn | None]:
    """The upper-half slot of slot ``main`` and where the second half begins over it: ``split``, or
    later where that slot already stands; ``(name, None)`` when it is to be created; ``(None,
    None)`` (logged) when it cannot serve this batch: it stands at or past the batch's (expected)
    ``end``, where all it would decode lies past the batch (slots do not move back)."""
    name = upper_slot_name(main.slot_name)
    if name is None:
        log.info("Decoding in one session: slot name %s leaves no room for an upper-half slot", main.slot_name)
        return None, None
    info = client.find(name)
    if info is None:
        return name, None
    if (info.slot_type, info.database, info.plugin, info.two_phase) != ("logical", main.database, main.plugin, True):
        log.info("Decoding in one session: slot %s is not a two-phase %s slot of %s", name, main.plugin, main.database)
        return None, None
    stale = _stale_upper(info, main)
    if stale is not None:
        log.warning("Dropping replication slot %s: %s; a later large batch makes it anew", name, stale)
        client.drop(name)
        return name, None
    if info.active or info.confirmed_flush_lsn is None or info.confirmed_flush_lsn >= end:
        where = "in use" if info.active else f"at {info.confirmed_flush_lsn}, beyond this batch (to {end})"
        log.info("Decoding in one session: slot %s stands %s", name, where)
        return None, None
    return name, max(split, info.confirmed_flush_lsn)


def _stale_upper(upper: SlotInfo, main: SlotInfo) -> str | None:
    """Why an upper-half slot can serve its slot no more, or None. One two-phase from before the
    slot (a slot of the same name dropped and made again by hand; PostgreSQL 18 shows it) would
    take a transaction prepared in between as delivered at PREPARE, which the slot delivers only
    at COMMIT PREPARED."""
    if upper.wal_status == "lost" or upper.invalidation_reason:
        return f"the server invalidated it ({upper.invalidation_reason or 'wal_status lost'})"
    if upper.two_phase_at is not None and main.two_phase_at is not None and upper.two_phase_at < main.two_phase_at:
        return f"it is two-phase from {upper.two_phase_at}, before slot {main.slot_name} ({main.two_phase_at})"
    return None


@contextmanager
def _creating_upper(conn: Connection, client: SlotClient, main: SlotInfo) -> Iterator[None]:
    """Create the upper-half slot of slot ``main`` on a second connection while the block runs (the
    extract, in one session). Creating a slot waits until the transactions running then have
    ended (prepared ones included); if that outlasts the block by :data:`UPPER_SLOT_WAIT_SECONDS`,
    the creation is cancelled and tried again by the next large batch."""
    name = upper_slot_name(main.slot_name)
    assert name is not None
    if client.free_slots() < 2:
        log.info(
            "Decoding in one session: slot %s is not created, to leave a replication slot free (max_replication_slots)",
            name,
        )
        yield
        return
    state = _Second()
    conninfo = conninfo_like(conn)

    def create() -> None:
        other = state.other = connect(conninfo)
        state.check()
        SlotClient(other).create(name, plugin=str(main.plugin), two_phase=True)

    log.info("Decoding in one session; creating slot %s for the upper halves of later large batches", name)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdecode-upper-slot") as pool:
        created = pool.submit(create)
        try:
            yield
        except BaseException:
            state.abandon()  # the extract failed: no wait for the slot
            raise
        finally:
            if not wait([created], timeout=UPPER_SLOT_WAIT_SECONDS).done:
                state.abandon()
            try:
                created.result()
            except Exception as exc:
                log.info("Slot %s was not created (tried again by the next large batch): %s", name, exc)
            else:
                log.info("Created slot %s beside %s", name, main.slot_name)
            if state.other is not None:
                state.other.close()


class _Abandoned(Exception):
    """The second half is not needed: its COPY is cancelled."""


def _end(started: Future[Any], state: _Second, exc: BaseException) -> None:
    """End a second session that will not be read (after a cancel): its COPY, its connection."""
    try:
        started.result()
    except Exception as error:  # failed, or cancelled before its first row: nothing to end
        log.debug("The second decoding session ended: %s", error)
    else:
        try:
            assert state.peek is not None
            state.peek.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as error:
            log.debug("The second decoding session ended: %s", error)
    if state.other is not None:
        state.other.close()


__all__ = [
    "ExpectedBatch",
    "LOWER_SHARE",
    "MIN_SPLIT_WAL_BYTES",
    "MIN_AHEAD_WAL_BYTES",
    "MIN_WAL_BYTES_PER_CHANGE",
    "expected_end",
    "first_split",
    "Split",
    "Reader",
    "reader_at",
    "SecondHalf",
    "second_session",
    "session_split",
    "split_point",
    "upper_slot_needed",
    "two_sessions_wanted",
    "UPPER_MARGIN",
]
