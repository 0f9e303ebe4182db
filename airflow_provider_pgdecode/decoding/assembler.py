"""Events in slot order in, whole transactions in commit order out.

Rules (DESIGN.md, invariant 3):

- only committed and commit-prepared transactions come out; a rolled-back transaction never
  does (PostgreSQL does not decode plain aborts; ``ROLLBACK PREPARED`` drops a held one);
- a prepared transaction is held until its ``COMMIT PREPARED`` (then emitted with the
  commit-prepared LSN) or ``ROLLBACK PREPARED``, also across batches: the held transactions
  are handed out by :meth:`TransactionAssembler.pending` and handed back to the next
  assembler, which is how they travel with the checkpoint;
- the same PREPARE delivered twice (the slot was read again from an earlier position) is kept
  once, keyed by (gid, xid);
- transactional messages belong to their transaction; non-transactional ones come out at once;
- a streamed transaction (pgoutput, sent in blocks while in progress) is buffered by xid across
  blocks; a Stream Abort of a subtransaction drops that subtransaction's changes (and those of
  its children, which follow them), of the top-level xid the whole transaction; Stream Commit
  emits it, Stream Prepare holds it like any prepared transaction. A stream still open when the
  rows end is dropped: its commit lies beyond this batch, so the next read streams it again
  from its start;
- with ``drop_origins``, a transaction that carries an Origin (it was applied by logical
  replication from elsewhere) is dropped when it commits: pgoutput's ``origin`` option does this
  on the server from PostgreSQL 16, and this is how 14 and 15 skip replicated changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_provider_pgdecode.decoding.events import (
    Begin,
    Change,
    Commit,
    CommitPrepared,
    Event,
    Message,
    Origin,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamDataWithheld,
    StreamPrepare,
    StreamStart,
    StreamStop,
    TransactionItem,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import DEFAULT_MEMORY_ITEMS, ItemSpool
from airflow_provider_pgdecode.errors import AssemblyError

log = logging.getLogger(__name__)


@dataclass
class Transaction:
    """A committed transaction: its items in order, and where it committed.

    ``commit_lsn`` is the LSN of the COMMIT row (for a prepared transaction, of the
    COMMIT PREPARED row): unique per transaction and increasing in commit order.
    """

    xid: int | None
    begin_lsn: Lsn
    commit_lsn: Lsn
    commit_time: datetime | None
    items: ItemSpool
    gid: str | None = None
    prepare_lsn: Lsn | None = None
    origin: str | None = None

    def __iter__(self) -> Iterator[TransactionItem]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class PreparedTransaction:
    """A transaction prepared for two-phase commit whose outcome is not known yet."""

    gid: str
    xid: int | None
    begin_lsn: Lsn
    prepare_lsn: Lsn
    prepare_time: datetime | None
    items: ItemSpool
    origin: str | None = None

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.gid, self.xid)

    def header(self) -> dict[str, Any]:
        """JSON-able description (without the items), for manifests and checkpoints."""
        return {
            "gid": self.gid,
            "xid": self.xid,
            "begin_lsn": str(self.begin_lsn),
            "prepare_lsn": str(self.prepare_lsn),
            "prepare_time": self.prepare_time.isoformat() if self.prepare_time else None,
            "origin": self.origin,
            "items": len(self.items),
        }

    @classmethod
    def from_header(cls, header: dict[str, Any], items: ItemSpool) -> PreparedTransaction:
        return cls(
            gid=header["gid"],
            xid=header["xid"],
            begin_lsn=Lsn.parse(header["begin_lsn"]),
            prepare_lsn=Lsn.parse(header["prepare_lsn"]),
            prepare_time=datetime.fromisoformat(header["prepare_time"]) if header.get("prepare_time") else None,
            items=items,
            origin=header.get("origin"),
        )


@dataclass
class _OpenTransaction:
    xid: int | None
    begin_lsn: Lsn
    items: ItemSpool
    origin: str | None = None
    #: For streamed transactions: position of the first item of each subtransaction.
    first_position: dict[int | None, int] | None = None


@dataclass
class ResolvedPrepared:
    gid: str
    xid: int | None
    lsn: Lsn
    committed: bool
    known: bool = True


Output = Transaction | Message


@dataclass
class AssemblerStats:
    events: int = 0
    transactions: int = 0
    empty_transactions: int = 0
    changes: int = 0
    duplicate_prepares: int = 0
    already_handled: int = 0
    streams_dropped: int = 0
    #: transactions and PREPAREs a second decoding session delivered again (dropped)
    second_session_repeats: int = 0
    origin_dropped: int = 0
    subtransactions_rolled_back: int = 0
    resolved: list[ResolvedPrepared] = field(default_factory=list)


class TransactionAssembler:
    """Assembles events into transactions.

    :param pending: prepared transactions still unresolved at the end of the previous batch.
    :param memory_items: items of one transaction kept in memory before spilling to disk.
    :param spill_dir: where spilled transactions are written.
    :param resume_after: rows at or before this LSN were handled by an earlier batch (the slot
        is behind the checkpoint, e.g. a confirm failed): their transactions are dropped here
        rather than staged twice.
    :param drop_origins: drop committed transactions that carry a replication origin (changes
        that came through logical replication), as pgoutput's ``origin=none`` does on 16+.
    """

    def __init__(
        self,
        pending: Iterable[PreparedTransaction] = (),
        memory_items: int = DEFAULT_MEMORY_ITEMS,
        spill_dir: str | os.PathLike[str] | None = None,
        resume_after: Lsn | None = None,
        drop_origins: bool = False,
    ) -> None:
        self.memory_items = memory_items
        self.resume_after = resume_after
        self.drop_origins = drop_origins
        self.spill_dir = spill_dir
        self._pending: dict[tuple[str, int | None], PreparedTransaction] = {}
        for prepared in pending:
            self._pending[prepared.key] = prepared
        self._open: _OpenTransaction | None = None
        self._streams: dict[int | None, _OpenTransaction] = {}
        self._handlers: dict[type, Callable[[Any], Output | None]] = {
            Begin: self._begin,
            Commit: self._commit,
            Message: self._message,
            Prepare: self._prepare,
            CommitPrepared: self._commit_prepared,
            RollbackPrepared: self._rollback_prepared,
            Origin: self._origin,
            StreamStart: self._stream_start,
            StreamStop: self._stream_stop,
            StreamAbort: self._stream_abort,
            StreamCommit: self._stream_commit,
            StreamPrepare: self._stream_prepare,
        }
        #: The LSN through which every row has been fully handled (None: nothing yet).
        self.safe_lsn: Lsn | None = None
        self.stats = AssemblerStats()
        self._counted = (0, 0)

    # -- public API ---------------------------------------------------------------------

    def feed(self, event: Event) -> Output | None:
        """Take the next event in slot order; return a transaction or message that is complete."""
        self.stats.events += 1
        kind = type(event)
        if kind is Change or kind is Truncate:
            current = self._open
            if current is None:
                raise AssemblyError(f"a change at LSN {event.lsn} arrived outside any transaction (no BEGIN)")
            current.items.append(event)  # type: ignore[arg-type]
            first = current.first_position
            if first is not None and event.xid not in first:
                first[event.xid] = len(current.items) - 1
            return None
        handler = self._handlers.get(kind)
        if handler is not None:
            return handler(event)
        if kind is StreamDataWithheld:
            raise AssemblyError(
                f"transaction {event.xid} was streamed while in progress ({event.what} at LSN {event.lsn}): "  # type: ignore[union-attr]
                "it outgrew logical_decoding_work_mem and the slot was read with streaming on. "
                "test_decoding cannot carry streamed transactions (it prints no row data for them): do not "
                "enable its stream-changes option, or use the pgoutput plugin"
            )
        raise AssemblyError(f"unexpected event {event!r}")

    def feed_all(self, events: Iterable[Event]) -> Iterator[Output]:
        for event in events:
            out = self.feed(event)
            if out is not None:
                yield out

    def finish(self) -> None:
        """Check that the input ended on a transaction boundary; drop streams still in progress."""
        self.drop_streams()
        if self._open is not None and self._open.first_position is None:
            raise AssemblyError(
                f"transaction {self._open.xid} began at LSN {self._open.begin_lsn} but neither committed "
                "nor prepared within the rows read: the slot output was cut inside a transaction"
            )

    def drop_streams(self) -> None:
        """Drop the streamed transactions in progress: the input that follows delivers them again
        from their start (the next read of the slot, or a second decoding session)."""
        for stream in self._streams.values():
            # Its commit is beyond the rows read: the next read streams it again from the start.
            log.info("streamed transaction %s is still in progress at the end of the rows read", stream.xid)
            stream.items.discard()
            self.stats.streams_dropped += 1
        self._streams.clear()

    def resume_from(self, lsn: Lsn | None) -> None:
        """The input goes on with a second decoding session's rows, which repeat what was read up
        to ``lsn`` (at most the transaction that crossed the split, and PREPAREs): drop those
        again. Counted apart, as :attr:`AssemblerStats.second_session_repeats`, until
        :meth:`end_resume`."""
        if lsn is not None and (self.resume_after is None or lsn > self.resume_after):
            self.resume_after = lsn
        self._counted = (self.stats.already_handled, self.stats.duplicate_prepares)

    def end_resume(self) -> None:
        handled, duplicates = self._counted
        stats = self.stats
        stats.second_session_repeats += stats.already_handled - handled + stats.duplicate_prepares - duplicates
        stats.already_handled, stats.duplicate_prepares = handled, duplicates

    @property
    def idle(self) -> bool:
        """No transaction (or stream block) is open: the next row starts a new one."""
        return self._open is None

    @property
    def open_items(self) -> int:
        """Items of the transaction (or stream block's transaction) being assembled."""
        return 0 if self._open is None else len(self._open.items)

    def pending_items(self, gid: str, xid: int | None) -> int:
        """Items of the pending prepared transaction ``(gid, xid)`` (0 when none is pending)."""
        found = self._pending.get((gid, xid))
        if found is None and xid is None:
            found = next((p for key, p in self._pending.items() if key[0] == gid), None)
        return 0 if found is None else len(found.items)

    def stream_items(self, xid: int | None) -> int:
        """Items read so far of the streamed transaction ``xid``."""
        stream = self._streams.get(xid)
        return 0 if stream is None else len(stream.items)

    def abandon_open(self) -> None:
        """The input stops here on purpose (a batch bound): drop the transaction being assembled;
        it is read again, whole, by the next batch. Streams are dropped by :meth:`finish`."""
        current = self._open
        self._open = None
        if current is not None and current.first_position is None:
            current.items.discard()

    def add_fast_totals(self, safe_lsn: Lsn | None, transactions: int, changes: int, empty: int) -> None:
        """Count plain transactions assembled elsewhere (the extract's native fast path)."""
        if safe_lsn is not None:
            self._advance(safe_lsn)
        self.stats.transactions += transactions
        self.stats.changes += changes
        self.stats.empty_transactions += empty

    def pending(self) -> list[PreparedTransaction]:
        """Prepared transactions not yet committed or rolled back, in prepare order."""
        return sorted(self._pending.values(), key=lambda p: int(p.prepare_lsn))

    # -- handlers -------------------------------------------------------------------------

    def _new_spool(self) -> ItemSpool:
        return ItemSpool(self.memory_items, self.spill_dir)

    def _begin(self, event: Begin) -> None:
        if self._open is not None:
            raise AssemblyError(
                f"BEGIN of transaction {event.xid} at LSN {event.lsn} while transaction "
                f"{self._open.xid} (begun at {self._open.begin_lsn}) is still open"
            )
        self._open = _OpenTransaction(event.xid, event.lsn, self._new_spool())
        return None

    def _take_open(self, what: str, event: Commit | Prepare) -> _OpenTransaction:
        current = self._open
        if current is None:
            raise AssemblyError(f"{what} at LSN {event.lsn} without a BEGIN")
        if event.xid is not None and current.xid is not None and event.xid != current.xid:
            raise AssemblyError(
                f"{what} of transaction {event.xid} at LSN {event.lsn} while transaction {current.xid} is open"
            )
        self._open = None
        return current

    def _advance(self, lsn: Lsn) -> None:
        if self.safe_lsn is None or lsn > self.safe_lsn:
            self.safe_lsn = lsn

    def _handled_before(self, lsn: Lsn) -> bool:
        if self.resume_after is not None and lsn <= self.resume_after:
            self.stats.already_handled += 1
            return True
        return False

    def _commit(self, event: Commit) -> Transaction | None:
        current = self._take_open("COMMIT", event)
        if self._handled_before(event.lsn):
            current.items.discard()
            return None
        self._advance(event.lsn)
        if len(current.items) == 0:
            # DDL-only, vacuum, or a transaction on other databases' catalogs: nothing to apply.
            self.stats.empty_transactions += 1
            current.items.discard()
            return None
        if self._replicated(current.origin, current.items):
            return None
        return self._emit(
            Transaction(
                current.xid, current.begin_lsn, event.lsn, event.commit_time, current.items, origin=current.origin
            )
        )

    def _replicated(self, origin: str | None, items: ItemSpool) -> bool:
        """Whether the committed transaction is dropped as one that came through replication."""
        if not self.drop_origins or origin is None:
            return False
        items.discard()
        self.stats.origin_dropped += 1
        return True

    def _emit(self, txn: Transaction) -> Transaction:
        self.stats.transactions += 1
        self.stats.changes += len(txn.items)
        return txn

    def _message(self, event: Message) -> Message | None:
        if event.transactional:
            current = self._open
            if current is None:
                raise AssemblyError(
                    f"transactional message (prefix {event.prefix!r}) at LSN {event.lsn} outside a transaction; "
                    "this happens when test_decoding runs with skip-empty-xacts, which pgdecode does not use"
                )
            current.items.append(event)
            return None
        if self._open is None:
            if self._handled_before(event.lsn):
                return None
            self._advance(event.lsn)
        return event

    def _prepare(self, event: Prepare) -> None:
        current = self._take_open("PREPARE TRANSACTION", event)
        xid = event.xid if event.xid is not None else current.xid
        if (event.gid, xid) not in self._pending and self._handled_before(event.lsn):
            # Prepared and resolved before the resume point: its outcome was handled then.
            current.items.discard()
            return None
        self._advance(event.lsn)
        prepared = PreparedTransaction(
            event.gid,
            xid,
            current.begin_lsn,
            event.lsn,
            event.prepare_time,
            current.items,
            current.origin,
        )
        if prepared.key in self._pending:
            # Delivered again because the slot was read from before this PREPARE: keep one.
            self.stats.duplicate_prepares += 1
            log.info("PREPARE of %r (xid %s) delivered again at LSN %s; kept once", event.gid, prepared.xid, event.lsn)
            current.items.discard()
            return None
        self._pending[prepared.key] = prepared
        return None

    def _find_pending(self, gid: str, xid: int | None) -> PreparedTransaction | None:
        found = self._pending.pop((gid, xid), None)
        if found is not None or xid is not None:
            return found
        matches = [key for key in self._pending if key[0] == gid]
        if len(matches) > 1:
            raise AssemblyError(f"several prepared transactions share the gid {gid!r}; read the slot with include-xids")
        return self._pending.pop(matches[0]) if matches else None

    def _commit_prepared(self, event: CommitPrepared) -> Transaction | None:
        if self._open is not None:
            raise AssemblyError(f"COMMIT PREPARED at LSN {event.lsn} inside an open transaction")
        if self._handled_before(event.lsn):
            return None
        prepared = self._find_pending(event.gid, event.xid)
        if prepared is None:
            raise AssemblyError(
                f"COMMIT PREPARED {event.gid!r} (xid {event.xid}) at LSN {event.lsn}: this transaction was "
                "never seen as prepared and no pending state holds it. Its changes were decoded in an earlier "
                "batch whose pending prepared transactions did not reach this run (a lost checkpoint), or the "
                "slot was advanced past its PREPARE by another consumer. The slot cannot deliver them again: "
                "re-snapshot the affected tables (pgdecode_backfill)."
            )
        self._advance(event.lsn)
        self.stats.resolved.append(ResolvedPrepared(prepared.gid, prepared.xid, event.lsn, True))
        if self._replicated(prepared.origin, prepared.items):
            return None
        return self._emit(
            Transaction(
                prepared.xid,
                prepared.begin_lsn,
                event.lsn,
                event.commit_time,
                prepared.items,
                gid=prepared.gid,
                prepare_lsn=prepared.prepare_lsn,
                origin=prepared.origin,
            )
        )

    def _rollback_prepared(self, event: RollbackPrepared) -> None:
        if self._open is not None:
            raise AssemblyError(f"ROLLBACK PREPARED at LSN {event.lsn} inside an open transaction")
        if self._handled_before(event.lsn):
            return None
        prepared = self._find_pending(event.gid, event.xid)
        self._advance(event.lsn)
        if prepared is None:
            # PostgreSQL sends ROLLBACK PREPARED for prepares it skipped (before the slot's
            # consistent point): nothing of it was ever delivered, so nothing to drop.
            log.info("ROLLBACK PREPARED of %r (xid %s) that was never delivered; nothing to drop", event.gid, event.xid)
            self.stats.resolved.append(ResolvedPrepared(event.gid, event.xid, event.lsn, False, known=False))
            return None
        prepared.items.discard()
        self.stats.resolved.append(ResolvedPrepared(prepared.gid, prepared.xid, event.lsn, False))
        return None

    # -- streamed transactions ------------------------------------------------------------

    def _origin(self, event: Origin) -> None:
        if self._open is not None:
            self._open.origin = event.name
        return None

    def _stream_stop(self, event: StreamStop) -> None:
        self._open = None
        return None

    def _stream_start(self, event: StreamStart) -> None:
        if self._open is not None and self._open.first_position is None:
            raise AssemblyError(
                f"stream block of transaction {event.xid} at LSN {event.lsn} inside transaction {self._open.xid}"
            )
        stream = self._streams.get(event.xid)
        if stream is None:
            stream = self._streams[event.xid] = _OpenTransaction(
                event.xid, event.lsn, self._new_spool(), first_position={}
            )
        self._open = stream
        return None

    def _stream_abort(self, event: StreamAbort) -> None:
        stream = self._streams.get(event.xid)
        if stream is None:
            return None  # nothing of it was read (or it was already handled)
        if event.subxid is None or event.subxid == event.xid:
            del self._streams[event.xid]
            stream.items.discard()
            if self._open is stream:
                self._open = None
            return None
        first = stream.first_position or {}
        cut = first.get(event.subxid)
        if cut is not None:
            stream.items.truncate(cut)
            for subxid in [s for s, position in first.items() if position >= cut]:
                del first[subxid]
            self.stats.subtransactions_rolled_back += 1
        return None

    def _take_stream(self, event: StreamCommit | StreamPrepare, what: str) -> _OpenTransaction:
        stream = self._streams.pop(event.xid, None)
        if stream is None:
            raise AssemblyError(
                f"{what} of streamed transaction {event.xid} at LSN {event.lsn} whose stream blocks were not read"
            )
        if self._open is stream:
            self._open = None
        return stream

    def _stream_commit(self, event: StreamCommit) -> Transaction | None:
        stream = self._take_stream(event, "Stream Commit")
        if self._handled_before(event.lsn):
            stream.items.discard()
            return None
        self._advance(event.lsn)
        if len(stream.items) == 0 or self._replicated(stream.origin, stream.items):
            stream.items.discard()
            return None
        return self._emit(
            Transaction(stream.xid, stream.begin_lsn, event.lsn, event.commit_time, stream.items, origin=stream.origin)
        )

    def _stream_prepare(self, event: StreamPrepare) -> None:
        stream = self._take_stream(event, "Stream Prepare")
        stream.first_position = None
        self._open = stream
        return self._prepare(Prepare(event.lsn, event.xid, event.gid, event.prepare_time))
