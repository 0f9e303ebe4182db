"""Extract one batch from a replication slot: peek, parse, assemble, stage. Plain Python.

The slot is only peeked, never consumed: it is advanced (by the confirm step) after the
batch is merged into Delta. The batch is written under a temporary name and renamed into
place when complete, so a crash leaves either no batch or a whole one.

Example (a psycopg connection in autocommit mode, a slot created with test_decoding)::

    import psycopg
    from airflow_provider_pgdecode.capture.extract import extract_batch

    with psycopg.connect("host=127.0.0.1 dbname=shop user=postgres", autocommit=True) as conn:
        manifest = extract_batch(conn, "pgdecode_shop", "/data/staging")
        print(manifest.summary())
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, batch_dir_name
from airflow_provider_pgdecode.batch.options import (
    TableOptions,
    parse_table_options,
)
from airflow_provider_pgdecode.batch.publish import batch_workdir, publish_batch
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.batch.writer import DEFAULT_PART_ROWS, BatchWriter, check_append_only
from airflow_provider_pgdecode.capture.bounds import CHANGES, WAL_BYTES, BatchBounds, BatchCut
from airflow_provider_pgdecode.capture.native import extract_native, load_native, native_wanted
from airflow_provider_pgdecode.capture.partitions import (
    Roots,
    landing_roots,
    partition_changes,
    selected_kept_roots,
    with_partitions,
    with_root_options,
)
from airflow_provider_pgdecode.capture.reconcile import Reconciliation, reconcile
from airflow_provider_pgdecode.capture.renames import KnownTables, follow_selection, follow_staged
from airflow_provider_pgdecode.capture.rewrites import find_rewrites, handle_rewrites
from airflow_provider_pgdecode.capture.sessions import (
    Reader,
    SecondHalf,
    Split,
    first_split,
    reader_at,
    second_session,
    upper_slot_needed,
)
from airflow_provider_pgdecode.capture.staged_tables import (
    check_clamped_keys,
    describe_tables,
    staged_identities_and_keys,
)
from airflow_provider_pgdecode.capture.table_snapshot import (
    DEFAULT_ROWS_PER_BATCH,
    TableSnapshotter,
    added_tables,
    list_snapshot_requests,
)
from airflow_provider_pgdecode.capture.tables import check_leaves_publishable, parse_table_names
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.decoding.assembler import PreparedTransaction, Transaction, TransactionAssembler
from airflow_provider_pgdecode.decoding.events import Message
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import PgOutputParser, max_proto_version, pgoutput_options
from airflow_provider_pgdecode.decoding.spool import DEFAULT_MEMORY_ITEMS
from airflow_provider_pgdecode.decoding.test_decoding import DEFAULT_OPTIONS, TestDecodingParser
from airflow_provider_pgdecode.errors import (
    ConfigurationError,
    SlotError,
    StagingError,
    staging_io,
)
from airflow_provider_pgdecode.postgres.catalog import Catalog
from airflow_provider_pgdecode.postgres.health import check_readable
from airflow_provider_pgdecode.postgres.session import server_address
from airflow_provider_pgdecode.postgres.slot import SlotClient, SlotInfo
from airflow_provider_pgdecode.postgres.standby import PrimaryLink

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 10_000
#: Set once the extract has chosen Arrow's memory pool for this process.
_pool_chosen = False


def choose_memory_pool() -> None:
    """Make jemalloc Arrow's default memory pool, once per process, unless the user chose one.

    pyarrow's default on Linux, mimalloc, hands freed memory back to the kernel within
    milliseconds, so every part's conversion and Parquet writing faults its buffers in again
    (huge pages, zeroed): a fifth of the extract's CPU in page faults. jemalloc keeps them for
    reuse: a 100k-row part writes in 25 ms instead of 33 ms, with a lower peak RSS. Set
    ``ARROW_DEFAULT_MEMORY_POOL`` to keep another pool. The extract chooses, not the batch
    writer: the pool is process-wide, so the decision belongs to the task's entry point.
    """
    global _pool_chosen
    if _pool_chosen:
        return
    _pool_chosen = True
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    try:
        pa.set_memory_pool(pa.jemalloc_memory_pool())
    except NotImplementedError:  # a pyarrow built without jemalloc
        pass


def extract_batch(
    conn: Any,
    slot_name: str,
    staging_root: str | os.PathLike[str] | Storage,
    *,
    plugin: str = "test_decoding",
    checkpoint: Checkpoint | Reconciliation | None = None,
    upto_lsn: Lsn | None = None,
    tables: Collection[str | tuple[str, str]] | None = None,
    publication: str | None = None,
    origin: str | None = None,
    proto_version: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    part_rows: int = DEFAULT_PART_ROWS,
    memory_items: int = DEFAULT_MEMORY_ITEMS,
    progress_every: int = 100_000,
    table_snapshots: bool = True,
    snapshot_rows: int = DEFAULT_ROWS_PER_BATCH,
    native: bool | None = None,
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
    bounds: BatchBounds | None = None,
    later_tables: Callable[[str, str], bool] | None = None,
    two_sessions: bool | None = None,
    split_at: Lsn | None = None,
    primary: PrimaryLink | None = None,
) -> BatchManifest:
    """Stage the slot's changes from its confirmed position (or the checkpoint) up to a ceiling.

    :param conn: a psycopg 3 connection in autocommit mode to the slot's database.
    :param slot_name: the logical replication slot to peek.
    :param staging_root: where batches go: ``<staging_root>/<slot_name>/<start>-<end>/``, a local
        directory or an ``s3://bucket/prefix`` location (a :class:`~airflow_provider_pgdecode.batch.storage.Storage`
        carries the store's credentials; a plain ``s3://`` string takes them from the ``AWS_*`` environment).
    :param plugin: the output plugin the slot must have been created with.
    :param checkpoint: the previous batch's checkpoint: its pending prepared transactions, and its
        end LSN, where this batch starts even when the slot is behind it (a failed confirm, the
        drain reading ahead: docs/extract.md). Reconciled with the slot as the DAG does
        (:func:`~airflow_provider_pgdecode.capture.reconcile.reconcile`): a slot another reader
        moved past it raises :class:`~airflow_provider_pgdecode.errors.CheckpointError`. A
        :class:`~airflow_provider_pgdecode.capture.reconcile.Reconciliation` is taken as decided.
    :param upto_lsn: the ceiling; default the server's WAL flush position when the run starts.
        The same ceiling over the same slot position gives the same batch.
    :param tables: ``schema.table`` names to stage; default every table that has changes.
    :param publication: the publication(s) to read (pgoutput only; required there).
    :param origin: ``"none"`` to skip changes that arrived through logical replication
        (pgoutput ``origin=none`` on PostgreSQL 16+, and on 14 and 15, which lack that option,
        by dropping the transactions that carry an Origin message; test_decoding ``only-local``),
        so that changes replicated from elsewhere are not looped back. Default: all changes.
    :param proto_version: pgoutput protocol version; default the highest the server supports.
    :param chunk_rows: rows fetched from the server per round trip.
    :param part_rows: rows per table held in memory before a Parquet part is written.
    :param memory_items: items of one transaction held in memory before spilling to disk.
    :param progress_every: log progress every so many rows.
    :param table_snapshots: copy chunks of filed table snapshot requests (``add-table``,
        ``resnapshot``: :mod:`~airflow_provider_pgdecode.capture.table_snapshot`) before the peek
        and stage them in this batch. Only when ``upto_lsn`` is not given, since the ceiling
        must lie past the chunks' watermarks.
    :param snapshot_rows: at most so many snapshot rows per batch, all requests together.
    :param native: use the C fast path (:mod:`airflow_provider_pgdecode.capture.native`); default
        on unless ``PGDECODE_NATIVE=0``. It stages the same batch as the Python path.
    :param table_options: per-table options, ``{"schema.table": {"mode": ..., "on_bad_value": ...}}``
        (:class:`~airflow_provider_pgdecode.batch.options.TableOptions`); unnamed tables take the defaults.
    :param bounds: the most one batch takes (:class:`~airflow_provider_pgdecode.capture.bounds.BatchBounds`:
        changes and WAL bytes, ending at a transaction boundary); default its defaults,
        ``BatchBounds.unbounded()`` for everything up to the ceiling. ``manifest.bounded_by``
        says which bound ended the batch (``None``: it reached the ceiling).
    :param later_tables: with ``tables``: whether a table outside them that shows up in the
        changes is staged too (:func:`~airflow_provider_pgdecode.capture.tables.later_tables`: a
        table created after the run chose its tables that its patterns, or "every table", select);
        such a table must have a usable key (or be ``append_only``) as the others.
    :param two_sessions: decode a large range in two sessions at once, the upper half over a
        temporary copy of the slot (:mod:`~airflow_provider_pgdecode.capture.sessions`: when and
        why it gives the same batch); ``manifest.decode_split`` says where the second began.
        Default on unless ``PGDECODE_TWO_SESSIONS=0`` (``[pgdecode] two_sessions``).
    :param split_at: where the second session begins, instead of :func:`split_point` (for tests: a split
        inside a given transaction); the range need not be large.
    :param primary: when ``conn``'s server is a standby, its primary: where the watermarks of table
        snapshots are written (:mod:`~airflow_provider_pgdecode.postgres.standby`).
    :returns: the manifest of the staged batch (``manifest.path`` is its directory).
    """
    request = ExtractRequest(
        plugin=plugin,
        checkpoint=checkpoint,
        upto_lsn=upto_lsn,
        tables=tables,
        publication=publication,
        origin=origin,
        proto_version=proto_version,
        chunk_rows=chunk_rows,
        part_rows=part_rows,
        memory_items=memory_items,
        progress_every=progress_every,
        table_snapshots=table_snapshots,
        snapshot_rows=snapshot_rows,
        native=native,
        table_options=table_options,
        bounds=bounds if bounds is not None else BatchBounds(),
        later_tables=later_tables,
        two_sessions=two_sessions,
        split_at=split_at,
        primary=primary,
    )
    return _stage_planned_batch(plan_extract(conn, slot_name, staging_root, request), slot_name)


def _stage_planned_batch(plan: ExtractPlan, slot_name: str) -> BatchManifest:
    """Decode a planned extract into a work directory and publish it as the batch's directory.

    The work directory goes on any failure, so a failed extract leaves nothing a merge could take.
    """
    tmp = batch_workdir(plan.staging, slot_name, plan.start_lsn)
    try:
        spill_dir = tmp / ".spool"
        with staging_io(spill_dir, "create directory"):
            spill_dir.mkdir()
        snapshotter = start_table_snapshots(plan, tmp)
        decoded = decode_changes(plan, spill_dir, snapshotter)
        manifest = staged_manifest(plan, tmp, decoded, snapshotter)
        shutil.rmtree(spill_dir, ignore_errors=True)
        manifest.write(tmp)
        manifest.path = publish_batch(
            tmp, plan.staging, f"{slot_name}/{batch_dir_name(plan.start_lsn, Lsn.parse(manifest.end_lsn))}", manifest
        )
        _log_progress(decoded.rows, decoded.writer, decoded.started, Lsn.parse(manifest.end_lsn), done=True)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class ExtractRequest:
    """What one extract is asked for: :func:`extract_batch`'s keyword arguments (documented there)."""

    plugin: str = "test_decoding"
    checkpoint: Checkpoint | Reconciliation | None = None
    upto_lsn: Lsn | None = None
    tables: Collection[str | tuple[str, str]] | None = None
    publication: str | None = None
    origin: str | None = None
    proto_version: int | None = None
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    part_rows: int = DEFAULT_PART_ROWS
    memory_items: int = DEFAULT_MEMORY_ITEMS
    progress_every: int = 100_000
    table_snapshots: bool = True
    snapshot_rows: int = DEFAULT_ROWS_PER_BATCH
    native: bool | None = None
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None
    bounds: BatchBounds = field(default_factory=BatchBounds)
    later_tables: Callable[[str, str], bool] | None = None
    two_sessions: bool | None = None
    split_at: Lsn | None = None
    primary: PrimaryLink | None = None


@dataclass
class ExtractPlan:
    """The request checked against the slot: where the batch starts and what it takes.

    ``include_pairs`` grows when table snapshot requests bring tables in; ``snapshots`` is the
    snapshot requests' state carried by the checkpoint.
    """

    conn: Any
    slot_name: str
    request: ExtractRequest
    slots: SlotClient
    info: SlotInfo
    staging: Storage
    checkpoint: Checkpoint | None
    start_lsn: Lsn
    pending: list[PreparedTransaction]
    include_pairs: set[tuple[str, str]] | None
    options_by_table: dict[tuple[str, str], TableOptions]
    known: KnownTables
    snapshots: dict[str, Any]
    partition_roots: Roots = field(default_factory=dict)
    """Each partition's partitioned table at the top of its tree, whose Delta table its changes
    land in (:mod:`.partitions`); not the partitions of roots kept as leaves."""
    kept_roots: set[tuple[str, str]] = field(default_factory=set)
    """Partitioned tables whose partitions are kept as leaves (their ``partitions`` option)."""

    @property
    def resume_after(self) -> Lsn | None:
        """Rows at or before the checkpoint's end are not staged again."""
        return self.checkpoint.end_lsn if self.checkpoint is not None else None


@dataclass
class Decoded:
    """What the decode read and assembled: the last attempt's reader state and how it ended."""

    rows: int
    parser: TestDecodingParser | PgOutputParser
    assembler: TransactionAssembler
    writer: BatchWriter
    cut: BatchCut | None
    ceiling: Lsn
    upto: Lsn
    row_limited: bool
    repeated_rows: int
    decode_split: Lsn | None
    excluded_names: set[tuple[str, str]]
    started: float


def plan_extract(
    conn: Any, slot_name: str, staging_root: str | os.PathLike[str] | Storage, request: ExtractRequest
) -> ExtractPlan:
    """Check the slot and the checkpoint, reconcile them, and resolve the tables to stage."""
    if request.plugin not in SUPPORTED_PLUGINS:
        raise SlotError(plugin_unknown(request.plugin))
    slots = SlotClient(conn, primary=request.primary)
    info = slots.describe(slot_name)
    check_readable(info, request.plugin)
    staging = as_storage(staging_root)
    given = request.checkpoint
    decided = isinstance(given, Reconciliation)
    checkpoint = given.checkpoint if isinstance(given, Reconciliation) else given
    if checkpoint is not None and checkpoint.slot != slot_name:
        raise StagingError(f"the checkpoint belongs to slot {checkpoint.slot!r}, not {slot_name!r}")
    if checkpoint is not None and not decided:
        # The same reconciliation as the DAG's extract task: a slot ahead of the checkpoint with no
        # staged batches leading there was consumed by another reader, and starting from the slot
        # would skip those changes for good (CheckpointError says how to recover).
        checkpoint = reconcile(checkpoint, info, staging).checkpoint
    confirmed = info.confirmed_flush_lsn or Lsn(0)
    resume_after = checkpoint.end_lsn if checkpoint is not None else None
    start_lsn = max(confirmed, resume_after) if resume_after is not None else confirmed
    pending: list[PreparedTransaction] = checkpoint.pending_prepared(staging) if checkpoint is not None else []
    include_pairs = parse_table_names(request.tables) if request.tables else None
    known = KnownTables.from_checkpoint(checkpoint)
    catalog = Catalog(conn)
    roots = catalog.partition_roots()
    options = parse_table_options(request.table_options)
    selection = follow_selection(catalog, include_pairs, known)
    # Roots kept as leaves: their leaves land in Delta tables of their own, and only an
    # attached partition is looked for in the catalog (tracked as the roots' partitions are).
    kept = selected_kept_roots(selection, roots, options)
    check_leaves_publishable(catalog, request.publication if request.plugin == "pgoutput" else None, kept)
    for name, oid in kept.items():
        known.add_root(oid, name)
    return ExtractPlan(
        conn=conn,
        slot_name=slot_name,
        request=request,
        slots=slots,
        info=info,
        staging=staging,
        checkpoint=checkpoint,
        start_lsn=start_lsn,
        pending=pending,
        include_pairs=with_partitions(selection, roots),
        options_by_table=with_root_options(options, roots),
        known=known,
        snapshots=dict(checkpoint.snapshots) if checkpoint is not None else {},
        partition_roots=landing_roots(roots, options),
        kept_roots=set(kept),
    )


def start_table_snapshots(plan: ExtractPlan, tmp: Any) -> TableSnapshotter | None:
    """Copy the chunks of filed table snapshot requests due in this batch (before the peek: the
    ceiling must lie past their watermarks), and take the tables they brought in."""
    request = plan.request
    snapshotter = None
    requests = list_snapshot_requests(plan.staging, plan.slot_name) if request.table_snapshots else []
    if requests:
        snapshotter = TableSnapshotter(
            plan.conn,
            tmp,
            requests,
            plan.snapshots,
            rows_per_batch=request.snapshot_rows,
            publication=request.publication,
            table_options=plan.options_by_table,
            slots=plan.slots,
        )
        backlog = _backlog_beyond(request.bounds, plan.slots, plan.start_lsn) if snapshotter.active else None
        if snapshotter.active and request.upto_lsn is None and backlog is None:
            snapshotter.copy_chunks()
        elif snapshotter.active and backlog is not None:
            log.info("Table snapshot requests wait until the backlog is drained (%s)", backlog)
        elif snapshotter.active:
            log.info("Table snapshot requests wait for a run without a fixed ceiling (upto_lsn=%s)", request.upto_lsn)
    # Tables that snapshot requests brought in are staged from then on.
    added = snapshotter.included_tables() if snapshotter is not None else added_tables(plan.snapshots)
    if plan.include_pairs is not None and added:
        plan.include_pairs = set(plan.include_pairs) | added
    return snapshotter


def decode_changes(plan: ExtractPlan, spill_dir: Any, snapshotter: TableSnapshotter | None) -> Decoded:
    """Peek the slot up to the ceiling (or the batch's bounds), assemble transactions and stage
    their rows; when not one transaction ended within the bounds, widen them and read again."""
    request, slots, conn = plan.request, plan.slots, plan.conn
    bounds = request.bounds
    # Read after the chunks: the ceiling must lie past their watermarks.
    ceiling = request.upto_lsn if request.upto_lsn is not None else slots.current_flush_lsn()
    parser, options = _reader(
        request.plugin, slots, plan.info.two_phase, request.publication, request.origin, request.proto_version
    )
    excluded_names: set[tuple[str, str]] = set()
    include = (
        None
        if plan.include_pairs is None
        else _recording_include(plan.include_pairs, excluded_names, request.later_tables)
    )
    staged_as = staged_identities_and_keys(Catalog(conn))
    # Chunk placement needs to see each transaction: the Python path while chunks are staged.
    fast = _native_module(request.native, parser) if snapshotter is None or not snapshotter.chunks else None
    floor = snapshotter.high_watermark() if snapshotter is not None else None
    limit = bounds.commit_limit(plan.start_lsn)
    upto = ceiling if limit is None else min(ceiling, max(limit, floor or limit))
    checkpoint = plan.checkpoint
    started = time.monotonic()
    decode_split: Lsn | None = None
    with reader_at(slots, plan.info, plan.start_lsn, request.plugin, options) as reader:
        skipped = int(plan.start_lsn) - int(reader.position)  # read again and dropped
        peek_rows = bounds.peek_rows(
            *(checkpoint.rows_per_change, skipped, checkpoint.wal_bytes_per_change) if checkpoint is not None else ()
        )
        for attempt in itertools.count():
            assembler, writer = _assembler_and_writer(plan, spill_dir, include, staged_as)
            cut = BatchCut(bounds, plan.start_lsn, assembler, floor) if bounds.bounded else None
            log.info(
                "Extracting slot %s from %s up to %s%s",
                plan.slot_name,
                plan.start_lsn,
                upto,
                f" (at most {peek_rows} rows decoded)" if peek_rows is not None else "",
            )
            row_limited = False
            repeated_rows = 0
            if upto > reader.position and fast is not None:
                split = _first_split(plan, upto) if attempt == 0 and upto == ceiling and reader.splits else None
                peeked = _peek_native(
                    plan, reader, fast, parser, options, assembler, writer, include, cut, split, upto, peek_rows
                )
                writer, rows, repeated_rows, row_limited = (
                    peeked.writer,
                    peeked.rows,
                    peeked.repeated_rows,
                    peeked.row_limited,
                )
                if peeked.decode_split is not None:
                    decode_split = peeked.decode_split
            elif upto > reader.position:
                rows = _extract_python(
                    slots.peek(reader.name, upto, options, request.chunk_rows, upto_rows=peek_rows),
                    parser,
                    assembler,
                    writer,
                    snapshotter,
                    cut,
                    request.progress_every,
                    started,
                )
                row_limited = peek_rows is not None and rows >= peek_rows
            else:
                rows = 0
            if cut is not None and cut.cut_by is not None:
                assembler.abandon_open()
            limited = upto < ceiling or row_limited
            if assembler.safe_lsn is not None or not limited:
                break
            # Not one transaction ended within the limits the server was given (a transaction
            # larger than them, or one streamed past the row limit): widen them and read again.
            # Nothing was staged, so nothing is repeated; the first transaction becomes the batch.
            assembler.finish()
            if upto < ceiling:
                upto = ceiling
            else:
                peek_rows = None if peek_rows is None or peek_rows * 4 > 2**31 - 1 else peek_rows * 4
            log.info("No transaction ended within the batch bounds: reading on to %s", upto)
    assembler.finish()
    return Decoded(
        rows=rows,
        parser=parser,
        assembler=assembler,
        writer=writer,
        cut=cut,
        ceiling=ceiling,
        upto=upto,
        row_limited=row_limited,
        repeated_rows=repeated_rows,
        decode_split=decode_split,
        excluded_names=excluded_names,
        started=started,
    )


def _assembler_and_writer(
    plan: ExtractPlan, spill_dir: Any, include: Callable[[str, str], bool] | None, staged_as: tuple[Any, Any, Any]
) -> tuple[TransactionAssembler, BatchWriter]:
    """A fresh assembler and batch writer for one reading of the slot (``staged_as``: the
    replica identities, keys and whole-row old images of
    :func:`~airflow_provider_pgdecode.capture.staged_tables.staged_identities_and_keys`)."""
    request = plan.request
    identities, keys, whole_row_old = staged_as
    assembler = TransactionAssembler(
        plan.pending,
        request.memory_items,
        spill_dir,
        resume_after=plan.resume_after,
        drop_origins=origin_dropped_by_client(request.plugin, request.origin, plan.slots.server_version_num()),
    )
    choose_memory_pool()
    writer = BatchWriter(
        spill_dir.parent,
        include,
        request.part_rows,
        table_options=plan.options_by_table,
        identities=identities,
        keys=keys,
        whole_row_old=whole_row_old,
        partitions=plan.partition_roots.keys(),
    )
    return assembler, writer


def _first_split(plan: ExtractPlan, upto: Lsn) -> Split | None:
    """Where the first reading up to the ceiling ``upto`` splits between two decoding sessions."""
    request = plan.request
    return first_split(plan.start_lsn, upto, request.bounds, plan.checkpoint, request.two_sessions, request.split_at)


@dataclass
class NativePeek:
    """What one native peek (one session, or two) read."""

    writer: BatchWriter
    rows: int
    repeated_rows: int
    row_limited: bool
    decode_split: Lsn | None


def _peek_native(
    plan: ExtractPlan,
    reader: Reader,
    fast: Any,
    parser: TestDecodingParser | PgOutputParser,
    options: list[tuple[str, str]],
    assembler: TransactionAssembler,
    writer: BatchWriter,
    include: Callable[[str, str], bool] | None,
    cut: BatchCut | None,
    split: Split | None,
    upto: Lsn,
    peek_rows: int | None,
) -> NativePeek:
    """The C reader over the COPY of ``reader``'s peek, the upper half in a second session when ``split``."""
    request, slots, slot_name = plan.request, plan.slots, plan.slot_name
    decode_split = None
    repeated_rows = 0
    row_limited = False
    with ExitStack() as stack:
        half = None
        if split is not None:
            half = stack.enter_context(
                second_session(
                    plan.conn,
                    slot_name,
                    split.at,
                    upto,
                    options,
                    peek_rows,
                    upper=upper_slot_needed(request.plugin, plan.info.two_phase, options),
                    expected=split.expected,
                )
            )
        lower = stack.enter_context(ExitStack())  # the lower half's peek, ended before a fallback
        copy = lower.enter_context(
            slots.peek_copy(reader.name, upto if half is None else half.split, options, upto_rows=peek_rows)
        )
        writer, rows = extract_native(  # type: ignore[assignment]
            fast,
            copy,
            parser,
            request.plugin,
            assembler,
            writer,
            include,
            request.part_rows,
            request.memory_items,
            plan.resume_after,
            cut,
            None if half is None else _upper_half(half, stack, lower, slots, reader.name, upto, options, peek_rows),
        )
        if half is not None and half.taken:
            decode_split = half.split
        if half is not None and half.refused:
            repeated_rows = half.first_rows or 0
        if peek_rows is not None:
            # Each peek had a row limit; the batch stopped at it if the last one read did.
            last, row_limit = rows, peek_rows
            if half is not None and (half.taken or half.refused):
                last = rows - (half.first_rows or 0)
                row_limit = (half.upper_rows or peek_rows) if half.taken else peek_rows + (half.first_rows or 0)
            row_limited = last >= row_limit
    return NativePeek(writer, rows, repeated_rows, row_limited, decode_split)


def staged_manifest(
    plan: ExtractPlan, tmp: Any, decoded: Decoded, snapshotter: TableSnapshotter | None
) -> BatchManifest:
    """Close the batch: its end, the snapshot chunks, the tables followed through renames and
    described from the catalog, the checks on what was staged, and the manifest."""
    conn, start_lsn, assembler, writer, cut = plan.conn, plan.start_lsn, decoded.assembler, decoded.writer, decoded.cut
    bounded_by = cut.cut_by if cut is not None and cut.cut_by is not None else None
    if bounded_by is None and decoded.upto < decoded.ceiling:
        bounded_by = WAL_BYTES
    elif bounded_by is None and decoded.row_limited:
        bounded_by = CHANGES
    # Rows per change of this batch up to its end: the next batch sizes the server's row limit
    # by it. Past a cut the rows read include some of the next transaction: count BEGIN and
    # COMMIT of each transaction taken instead.
    stats = assembler.stats
    changes_used = stats.changes
    rows_used = decoded.rows - decoded.repeated_rows  # a fallback's peek delivered the lower half again
    if cut is not None and cut.cut_by is not None:
        rows_used = changes_used + 2 * (stats.transactions + stats.empty_transactions)
    tables_staged, messages = writer.close()
    carried = plan.checkpoint or Checkpoint(plan.slot_name, start_lsn)
    end_lsn = max(start_lsn, assembler.safe_lsn) if assembler.safe_lsn is not None else start_lsn
    chunk_records: list[dict] = []
    snapshot_rows_staged = 0
    snapshots = plan.snapshots
    if snapshotter is not None:
        chunk_records, snapshots = snapshotter.finish(end_lsn)
        tables_staged = snapshotter.table_summaries(tables_staged)
        snapshot_rows_staged = sum(r["rows"] + (r["kind"] == "truncate") for r in chunk_records)
    followed = follow_staged(
        Catalog(conn),
        tables_staged,
        plan.known,
        decoded.parser.relation_oids if isinstance(decoded.parser, PgOutputParser) else {},
        plan.include_pairs,
        (record["table"] for record in chunk_records if record["kind"] == "truncate"),
        plan.partition_roots,
    )
    tables_staged = followed.tables
    catalog = Catalog(conn)
    describe_tables(catalog, tables_staged, plan.options_by_table, followed.current)
    check_clamped_keys(tables_staged, writer.clamped_values())
    # Rows changed without row changes in the WAL (a rewrite, a re-created table, a partition
    # attached, detached or truncated): resnapshot or stop.
    rewrites = find_rewrites(catalog, followed.known) + partition_changes(catalog, followed.known, plan.kept_roots)
    handle_rewrites(rewrites, plan.options_by_table, plan.staging, plan.slot_name)
    check_append_only(tmp, tables_staged)
    prepared_entries = writer.save_prepared(assembler.pending())
    manifest = BatchManifest(
        slot=plan.slot_name,
        plugin=plan.request.plugin,
        database=plan.info.database or conn.info.dbname,
        server=server_address(conn),
        start_lsn=str(start_lsn),
        end_lsn=str(end_lsn),
        ceiling_lsn=str(decoded.ceiling),
        transactions=writer.transactions,
        changes=writer.changes + snapshot_rows_staged,
        tables=tables_staged,
        messages=messages,
        prepared_pending=prepared_entries,
        prepared_committed=[
            {"gid": r.gid, "xid": r.xid, "commit_lsn": str(r.lsn)} for r in stats.resolved if r.committed
        ],
        prepared_rolled_back=[
            {"gid": r.gid, "xid": r.xid, "lsn": str(r.lsn), "seen": r.known} for r in stats.resolved if not r.committed
        ],
        skipped={
            "rows_read": decoded.rows,
            "empty_transactions": stats.empty_transactions,
            "excluded_table_changes": writer.skipped_changes,
            "already_handled": stats.already_handled,
            "duplicate_prepares": stats.duplicate_prepares,
        },
        snapshot_chunks=chunk_records,
        snapshots=snapshots,
        quarantine=writer.quarantine,
        excluded_tables=sorted(f"{schema}.{table}" for schema, table in decoded.excluded_names),
        table_oids=followed.known.record(),
        bounded_by=bounded_by,
        decode_split=None if decoded.decode_split is None else str(decoded.decode_split),
        # A batch without changes carries the previous batch's measures, for the next one.
        rows_per_change=round(rows_used / changes_used, 3) if changes_used else carried.rows_per_change,
        wal_bytes_per_change=(
            round((int(end_lsn) - int(start_lsn)) / changes_used, 1)
            if changes_used and end_lsn > start_lsn
            else carried.wal_bytes_per_change
        ),
    )
    if followed.dropped_changes:
        manifest.skipped["dropped_table_changes"] = followed.dropped_changes
    if writer.partition_truncates:  # found in the catalog instead (capture/partitions.py)
        manifest.skipped["partition_truncates"] = writer.partition_truncates
    if stats.origin_dropped:
        manifest.skipped["replicated_transactions"] = stats.origin_dropped
    if stats.second_session_repeats:
        manifest.skipped["second_session_repeats"] = stats.second_session_repeats
    return manifest


def _upper_half(
    half: SecondHalf,
    stack: ExitStack,
    lower: ExitStack,
    slots: SlotClient,
    slot_name: str,
    upto: Lsn,
    options: list[tuple[str, str]],
    peek_rows: int | None,
) -> Callable[[int], Any | None]:
    """What the reader reads after the lower half: the second session's COPY; when that session
    failed, the slot's own peek up to ``upto`` (decoding the lower half again, whose rows the
    reader drops: slower, but the batch is whole)."""

    def following(first_rows: int) -> Any | None:
        copy = half.follow(first_rows)
        if copy is None and half.refused:
            lower.close()  # the lower half's COPY holds the connection
            limit = None if peek_rows is None else peek_rows + first_rows
            return stack.enter_context(slots.peek_copy(slot_name, upto, options, upto_rows=limit))
        return copy

    return following


def _backlog_beyond(bounds: BatchBounds, slots: SlotClient, start: Lsn) -> str | None:
    """Why this batch cannot reach the server's WAL position (then snapshot chunks, whose
    watermarks lie there, wait for a later run), or None."""
    limit = bounds.commit_limit(start)
    if limit is None:
        return None
    current = slots.current_flush_lsn()
    if current <= limit:
        return None
    return f"{int(current) - int(start)} bytes of WAL left, more than max_batch_wal_bytes={bounds.max_wal_bytes}"


def _extract_python(
    peek: Iterator[tuple[Lsn, int | None, bytes]],
    parser: TestDecodingParser | PgOutputParser,
    assembler: TransactionAssembler,
    writer: BatchWriter,
    snapshotter: TableSnapshotter | None,
    cut: BatchCut | None,
    progress_every: int,
    started: float,
) -> int:
    """The pure-Python path: every row parsed, assembled and staged here. Returns the rows read."""
    rows = 0
    parse = parser.parse
    feed = assembler.feed
    stops_before = cut.stops_before if cut is not None else None
    try:
        for lsn, xid, data in peek:
            rows += 1
            event = parse(lsn, xid, data)
            if event is None:  # pgoutput Relation/Type messages
                continue
            if stops_before is not None and stops_before(event):
                break
            out = feed(event)
            if out is not None:
                if type(out) is Transaction:
                    if snapshotter is not None:
                        snapshotter.observe(out)
                    writer.add_transaction(out)
                    out.items.discard()
                elif type(out) is Message:
                    writer.add_message(out)
            if rows % progress_every == 0:
                _log_progress(rows, writer, started, lsn)
    finally:
        close = getattr(peek, "close", None)
        if close is not None:
            close()  # a cut leaves the rest of the peek unread: end its cursor and transaction
    return rows


def _reader(
    plugin: str,
    slots: SlotClient,
    two_phase: bool,
    publication: str | None,
    origin: str | None,
    proto_version: int | None,
) -> tuple[TestDecodingParser | PgOutputParser, list[tuple[str, str]]]:
    """The row parser and plugin options for a slot's output plugin."""
    encoding = slots.server_encoding()
    if origin not in (None, "none", "any"):
        raise ConfigurationError(f"origin must be 'none' or 'any', not {origin!r}")
    if plugin == "test_decoding":
        if publication is not None:
            raise ConfigurationError("publication applies to pgoutput slots only; test_decoding decodes every table")
        options = list(DEFAULT_OPTIONS)
        if origin == "none":
            options.append(("only-local", "1"))
        return TestDecodingParser(encoding), options
    if not publication:
        raise SlotError(
            "reading a pgoutput slot needs a publication: CREATE PUBLICATION pgdecode FOR ALL TABLES "
            "(or FOR TABLE ...), then pass publication='pgdecode'"
        )
    version = slots.server_version_num()
    proto = proto_version if proto_version is not None else max_proto_version(version)
    options = pgoutput_options(
        publication,
        version,
        proto_version=proto,
        two_phase=two_phase,
        streaming=True,
        messages=True,
        # Before 16 the option does not exist: the assembler drops those transactions instead.
        origin="none" if origin == "none" and version >= PGOUTPUT_ORIGIN_VERSION else None,
    )
    return PgOutputParser(proto, encoding, Catalog(slots.conn).type_names()), options


PGOUTPUT_ORIGIN_VERSION = 160000
"""pgoutput's ``origin`` option (skip changes that came through replication) exists from 16."""


def origin_dropped_by_client(plugin: str, origin: str | None, server_version_num: int) -> bool:
    """Whether ``origin="none"`` is applied here, by dropping the transactions that carry an
    Origin message: pgoutput before PostgreSQL 16 (test_decoding has ``only-local`` throughout)."""
    return plugin == "pgoutput" and origin == "none" and server_version_num < PGOUTPUT_ORIGIN_VERSION


def _native_module(native: bool | None, parser: TestDecodingParser | PgOutputParser) -> Any | None:
    """The C extension when the fast path is wanted and can stage this slot's rows exactly."""
    if not native_wanted(native):
        return None
    if parser.encoding != "utf-8":
        log.info("The native extract reads UTF-8 databases only; using the Python path")
        return None
    return load_native()


def _recording_include(
    include_pairs: set[tuple[str, str]],
    excluded: set[tuple[str, str]],
    later: Callable[[str, str], bool] | None = None,
) -> Callable[[str, str], bool]:
    """``include`` for the writers (asked once per table): a table outside ``include_pairs`` that
    ``later`` admits joins them (it is then followed as a selected table); the others are added to
    ``excluded``, so the manifest names the tables whose changes were not staged."""

    def include(schema: str, table: str) -> bool:
        if (schema, table) in include_pairs:
            return True
        if later is not None and later(schema, table):
            log.info("table %s.%s appeared in the changes and belongs to the selection: staged", schema, table)
            include_pairs.add((schema, table))
            return True
        excluded.add((schema, table))
        return False

    return include


def _log_progress(rows: int, writer: BatchWriter, started: float, lsn: Lsn, done: bool = False) -> None:
    elapsed = max(time.monotonic() - started, 1e-9)
    log.info(
        "%s %d rows read, %d transactions, %d changes staged (%.0f rows/s), at LSN %s",
        "Extracted:" if done else "Progress:",
        rows,
        writer.transactions,
        writer.changes,
        rows / elapsed,
        lsn,
    )
