"""How much one batch takes: the bounds of a cycle, and where a batch is cut. Plain Python.

A batch normally runs from the slot's confirmed position to the server's WAL position when the
run starts. After downtime that can be millions of changes: staged, merged and, after a crash,
repeated all at once. :class:`BatchBounds` caps a batch at ``max_changes`` changes and
``max_wal_bytes`` of WAL, always ending at a transaction boundary, so a backlog is drained by
successive batches, each confirmed before the next one starts.

Two limits work together:

* **The server's**: the peek's ceiling is ``start + max_wal_bytes`` (``upto_lsn``) and it stops
  decoding after :meth:`BatchBounds.peek_rows` rows (``upto_nchanges``), so PostgreSQL never
  decodes far past the bound. It finishes the transaction that crosses either limit.
* **The batch's** (:class:`BatchCut`): once the batch holds something, the transaction (or the
  commit of a prepared or streamed one) that would take it past a bound is left for the next
  batch: the batch ends at the last one that fits. A transaction larger than a bound is a batch
  of its own; it is spooled to disk like any large transaction, so memory stays bounded.

Prepared transactions keep their meaning across a cut: a PREPARE before the cut is carried as
pending (as at any batch end) and its COMMIT PREPARED lands in the batch that reaches it; a cut
never separates a transaction from its own commit.

Example::

    from airflow_provider_pgdecode.capture.bounds import BatchBounds
    from airflow_provider_pgdecode.capture.extract import extract_batch

    manifest = extract_batch(conn, "pgdecode_shop", "/data/staging",
                             bounds=BatchBounds(max_changes=500_000, max_wal_bytes=512 << 20))
    print(manifest.bounded_by)  # "changes", "wal_bytes", or None when the batch caught up
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from airflow_provider_pgdecode.decoding.assembler import TransactionAssembler
from airflow_provider_pgdecode.decoding.events import (
    Change,
    Commit,
    CommitPrepared,
    Event,
    Message,
    Prepare,
    RollbackPrepared,
    StreamCommit,
    StreamPrepare,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError

DEFAULT_MAX_BATCH_CHANGES = 1_000_000
"""Changes per batch by default: about a minute of extract and merge on two cores."""
DEFAULT_MAX_BATCH_WAL_BYTES = 1 << 30
"""WAL per batch by default: PostgreSQL's default ``max_wal_size``."""

CHANGES = "changes"
WAL_BYTES = "wal_bytes"

_INT4_MAX = 2**31 - 1
# PostgreSQL counts rows, BEGIN and COMMIT included, and decodes every row it is allowed before
# the client can cut: rows past the cut are decoded in vain. Without a measure of the slot's rows
# per change (the previous batch's, carried by the checkpoint), a quarter more rows than changes:
# it fills a batch of transactions of ten changes or more.
_ROWS_PER_CHANGE = 1.25
# With the previous batch's measure: 5% more than it, at least one row per change, at most three
# (single-change transactions).
_MARGIN = 1.05
_MAX_ROWS_PER_CHANGE = 3.0


@dataclass(frozen=True)
class BatchBounds:
    """The most one batch may take; ``None`` lifts a bound.

    :param max_changes: changes (rows of INSERT, UPDATE, DELETE and TRUNCATE, transactional
        messages) of the transactions a batch commits.
    :param max_wal_bytes: WAL between the batch's start and end LSN.
    """

    max_changes: int | None = DEFAULT_MAX_BATCH_CHANGES
    max_wal_bytes: int | None = DEFAULT_MAX_BATCH_WAL_BYTES

    def __post_init__(self) -> None:
        for name in ("max_changes", "max_wal_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"max_batch_{name.removeprefix('max_')} must be a positive integer (or null for no bound), "
                    f"got {value!r}"
                )

    @classmethod
    def unbounded(cls) -> BatchBounds:
        return cls(None, None)

    @property
    def bounded(self) -> bool:
        return self.max_changes is not None or self.max_wal_bytes is not None

    def commit_limit(self, start: Lsn) -> Lsn | None:
        """The last LSN a batch starting at ``start`` may end at."""
        return None if self.max_wal_bytes is None else Lsn(int(start) + self.max_wal_bytes)

    def peek_rows(
        self,
        rows_per_change: float | None = None,
        skipped_wal_bytes: int = 0,
        wal_bytes_per_change: float | None = None,
    ) -> int | None:
        """The row limit handed to the server (``upto_nchanges``): ``rows_per_change``, the
        previous batch's rows per change (:attr:`Checkpoint.rows_per_change`), sizes it to the
        slot's transactions. ``skipped_wal_bytes``: WAL the peek reads again before the batch's
        start (a slot behind the checkpoint, as when the drain extracts a batch while the one
        before it merges), whose rows the limit leaves room for, at ``wal_bytes_per_change``."""
        if self.max_changes is None:
            return None
        factor = _ROWS_PER_CHANGE
        if rows_per_change is not None and rows_per_change > 0:
            factor = min(max(rows_per_change * _MARGIN, _MARGIN), _MAX_ROWS_PER_CHANGE)
        skipped = skipped_wal_bytes / wal_bytes_per_change if skipped_wal_bytes > 0 and wal_bytes_per_change else 0
        return min(int((self.max_changes + skipped) * factor) + 2, _INT4_MAX)


class BatchCut:
    """Decides, event by event, whether the batch stops before an event.

    Only once the batch holds something (a transaction, a PREPARE, a message: the assembler's
    ``safe_lsn`` moved) is anything cut: the first transaction is always taken, however large.

    :param bounds: the batch's bounds.
    :param start: the batch's start LSN.
    :param assembler: the batch's assembler (what it holds; open, pending and streamed sizes).
    :param floor: never cut at or before this LSN (a table snapshot chunk's watermark that the
        batch must reach to place the chunk).
    :param elsewhere: changes and holds of transactions assembled outside ``assembler`` (the
        native reader's share of the batch), asked only when a decision needs them.
    """

    def __init__(
        self,
        bounds: BatchBounds,
        start: Lsn,
        assembler: TransactionAssembler,
        floor: Lsn | None = None,
        elsewhere: Callable[[], tuple[int, bool]] | None = None,
    ) -> None:
        self.max_changes = bounds.max_changes
        limit = bounds.commit_limit(start)
        self.max_lsn = None if limit is None else max(limit, floor) if floor is not None else limit
        self.floor = floor
        self.assembler = assembler
        self.elsewhere = elsewhere
        #: why the batch was cut (:data:`CHANGES` or :data:`WAL_BYTES`); None while it was not.
        self.cut_by: str | None = None

    def taken(self) -> tuple[int, bool]:
        """(changes the batch commits so far, whether it holds anything)."""
        assembler = self.assembler
        changes, holds = assembler.stats.changes, assembler.safe_lsn is not None
        if self.elsewhere is not None:
            more, more_holds = self.elsewhere()
            changes, holds = changes + more, holds or more_holds
        return changes, holds

    def stops_before(self, event: Event) -> bool:
        """Whether the batch ends before ``event`` (then :attr:`cut_by` says which bound)."""
        kind = type(event)
        adding = 0
        lsn: Lsn | None = None
        assembler = self.assembler
        if kind is Change or kind is Truncate or (kind is Message and event.transactional):  # type: ignore[union-attr]
            adding = assembler.open_items + 1
        elif kind is Commit or kind is Prepare or kind is RollbackPrepared or kind is Message:
            lsn = event.lsn
        elif kind is CommitPrepared:
            adding, lsn = assembler.pending_items(event.gid, event.xid), event.lsn  # type: ignore[union-attr]
        elif kind is StreamCommit or kind is StreamPrepare:
            adding, lsn = assembler.stream_items(event.xid), event.lsn
        else:
            return False
        if not adding and lsn is None:
            return False
        if self.floor is not None and (lsn if lsn is not None else event.lsn) <= self.floor:
            return False
        changes, holds = self.taken()
        if not holds:
            return False
        if self.max_changes is not None and adding and changes + adding > self.max_changes:
            self.cut_by = CHANGES
        elif self.max_lsn is not None and lsn is not None and lsn > self.max_lsn:
            self.cut_by = WAL_BYTES
        return self.cut_by is not None


__all__ = [
    "CHANGES",
    "DEFAULT_MAX_BATCH_CHANGES",
    "DEFAULT_MAX_BATCH_WAL_BYTES",
    "WAL_BYTES",
    "BatchBounds",
    "BatchCut",
]
