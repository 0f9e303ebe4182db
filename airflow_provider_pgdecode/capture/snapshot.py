"""Initial load consistent with a new slot: an exported snapshot staged as one batch. Plain Python.

A logical slot created over a replication connection can export the snapshot in which its
decoding starts: every transaction that committed at or before the slot's *consistent point*
is visible in the snapshot, every one committing after it is decoded by the slot. Copying the
tables inside that snapshot and staging them with the consistent point as their commit LSN
makes the copy and the slot's later batches fit exactly: nothing missed, nothing twice.

::

    from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot

    with create_slot_with_snapshot(dsn, "pgdecode_shop") as (consistent_lsn, snapshot_name):
        manifest = stage_snapshot(dsn, snapshot_name, consistent_lsn, "pgdecode_shop",
                                  "/data/staging", ["public.orders", "public.customers"], workers=4)
    # merge manifest.path into Delta, then extract_batch(...) from the slot as usual

The snapshot exists only while the connection that created the slot stays open, so the copy
must run inside the ``with`` block.

Chunks. Every table is cut into chunks of consecutive heap *pages* (``ctid`` ranges), read with
TID range scans (PostgreSQL 14+)::

    COPY (SELECT <columns> FROM t WHERE ctid >= '(first,0)'::tid AND ctid < '(next,0)'::tid)
        TO STDOUT (FORMAT csv)

the last chunk of a table open-ended (``ctid >= '(first,0)'``). Page ranges rather than key
ranges, because

* they are computed up front from two cheap numbers and nothing else: the table's size in pages
  (``pg_relation_size / block_size``) and the number of rows visible in its first 32 pages (read
  inside the snapshot), which sizes chunks of about ``chunk_rows`` rows. Key ranges would need
  the key's distribution (a sample or an index walk) and break down on skewed or composite keys;
* every chunk is a sequential read of its own pages: no index, no sort, no ``OFFSET``; chunks
  are independent, so any number of them run at once and each can be redone alone;
* tuples visible in the snapshot cannot move while it is held (the exported snapshot keeps
  VACUUM from removing them, and every copying transaction holds ACCESS SHARE locks, which keep
  ``VACUUM FULL``/``CLUSTER`` out), and pages added after the plan hold only newer tuples, which
  the snapshot does not see: the open-ended last chunk covers them anyway.

Within a chunk rows come in physical order (synchronized and parallel scans are switched off),
so a part's contents depend only on the snapshot and the chunk plan, never on worker count or
timing. Parts are named by chunk index (``part-00007.parquet``); a chunk with no visible row
writes no part. With ``replace`` the table's TRUNCATE row is a part of its own
(``part-truncate.parquet``, written with chunk 0). Two plans of one snapshot can differ only in
trailing empty chunks (when the table grew meanwhile), so they stage the same manifest.

Delta's types. The chunks' parts hold only rows, with every column in the type Spark reads as
its Delta type: bounded ``numeric`` as its ``decimal128`` (NaN/Infinity, which a decimal cannot
hold, staged as null and counted in the manifest's ``numeric_specials``), ``timestamp without
time zone`` as UTC-annotated microseconds, everything else as incremental batches stage it. The
manifest lists them as ``snapshot_files``: the merge job commits them into a Delta table it
creates as they are, without reading and writing them again (spark/delta_commit.py), and all
checks on the values happen here, in the pass that writes them.

Workers. ``workers`` threads each open their own connection that imports the snapshot
(:func:`~airflow_provider_pgdecode.postgres.snapshot_queries.import_snapshot`) and take chunks
from one queue, in table then chunk order: chunks of one table and of different tables run
concurrently. A planning connection holds the snapshot and ACCESS SHARE locks on every table
until the copy ends. COPY's CSV output is gathered as bytes, parsed by Arrow's CSV reader and
converted column-wise (batch/values.py), then written as the chunk's Parquet part; memory is
bounded by ``chunk_rows`` rows per worker (a chunk larger than estimated is written in several
row groups). Threads suffice: the only per-row Python work is gathering COPY's rows, while the
server's side of COPY, Arrow's parser, the conversions and the Parquet writer run outside the GIL.

Resume. Each part is written to ``<name>.part``, fsynced and renamed; only then is the chunk
recorded in ``progress.json`` (rewritten atomically, fsynced), together with the chunk plan.
A copy that stops at any point — an error, or the process killed with SIGKILL — continues when
:func:`stage_snapshot` is called again *inside the same block*: the recorded chunks are kept,
half-written ``.part`` files and parts not recorded are deleted, and the remaining chunks are
copied. If a table was rewritten meanwhile (its relfilenode changed) its chunks are discarded
and it is planned and copied again. Once the block has ended the snapshot is gone and nothing
can resume: drop the slot and start over (docs/staging-format.md, "Snapshot batches"). To
survive a kill of the copy, the process holding the block must outlive it: run the copy in a
child process.

Where. The copy is written in a local work directory (:func:`snapshot_workdir`): beside the
batch in ``<staging_root>/<slot>/`` when staging is local, so publishing it is a rename; under
the local spool directory (``$PGDECODE_SPOOL_DIR``) when the staging root is ``s3://...``, so
publishing uploads its parts, then its manifest last (the batch's commit marker: there is no
rename on object storage). Progress stays in the work directory either way.

Errors are specific: an unknown table or one without a key (a primary key, a replica identity
index, or all columns under REPLICA IDENTITY FULL: :meth:`Catalog.table_key`) is refused before
anything is copied (:class:`CatalogError`), a snapshot that is no longer exported is reported
with what to do (:class:`StagingError`).

Every statement is issued by the PostgreSQL layer: the replication connection by
``postgres/replication.py``, the plan's and the chunks' queries by ``postgres/snapshot_queries.py``.

Progress goes to this module's logger: per table and overall, chunks done of total, rows
copied, rows/s and an estimated time to go, at most every ``log_interval`` seconds and when a
table finishes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from airflow_provider_pgdecode.batch.badvalues import convert_snapshot_column
from airflow_provider_pgdecode.batch.format import (
    OLD,
    PARQUET_OPTIONS,
    SNAPSHOT_START_LSN,
    check_column_names,
    metadata_columns,
    part_schema,
)
from airflow_provider_pgdecode.batch.manifest import (
    BatchManifest,
    ColumnSummary,
    TableSummary,
    batch_dir_name,
    table_path,
)
from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, TableOptions, options_for, parse_table_options
from airflow_provider_pgdecode.batch.publish import TMP_PREFIX, publish_batch, workdir_base
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.batch.values import arrow_type
from airflow_provider_pgdecode.capture.renames import record_tables
from airflow_provider_pgdecode.capture.tables import parse_table_names
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import CHAR_TYPES, char_text
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError, SlotError, StagingError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, TableKey
from airflow_provider_pgdecode.postgres.replication import ExportedSnapshot, replication_connection
from airflow_provider_pgdecode.postgres.session import (
    SCAN_GUCS,
    Connection,
    DatabaseError,
    commit,
    database_name,
    server_address,
)
from airflow_provider_pgdecode.postgres.session import connect as _connect
from airflow_provider_pgdecode.postgres.slot import SlotClient
from airflow_provider_pgdecode.postgres.snapshot_queries import (
    copy_pages_csv,
    count_rows_in_first_pages,
    has_tid_range_scans,
    import_snapshot,
    lock_and_measure,
)
from airflow_provider_pgdecode.typemap import (
    DEFAULT_STAGING,
    NUMERIC_SPECIAL_VALUES,
    Staging,
    array_element,
    numeric_delta_type,
    numeric_typmod,
)

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_CHUNK_ROWS = 100_000
#: Copying connections (threads) by default: a few, never more than the cores.
DEFAULT_SNAPSHOT_WORKERS = max(1, min(4, os.cpu_count() or 1))
SNAPSHOT_FORMAT = "pgdecode.snapshot/3"
#: The part holding a table's TRUNCATE row (``replace``), apart from the rows.
TRUNCATE_PART = "part-truncate.parquet"
SNAPSHOT_INFO_NAME = "snapshot.json"
PROGRESS_NAME = "progress.json"
#: Pages at the start of a table whose visible rows are counted to size its chunks.
SAMPLE_PAGES = 32

_SNAPSHOT_NAME = re.compile(r"^[0-9A-Fa-f-]{1,64}$")
_SEQ_MAX = 2**31 - 1
_CSV_BLOCK = 1 << 22
_CSV_BATCH_BYTES = 64 << 20


@contextmanager
def create_slot_with_snapshot(
    dsn: str,
    slot_name: str,
    plugin: str = "test_decoding",
    two_phase: bool = True,
    *,
    drop_on_error: bool = True,
) -> Iterator[ExportedSnapshot]:
    """Create a logical slot that exports its snapshot; yield ``(consistent_lsn, snapshot_name)``.

    The replication connection that created the slot is held open until the block ends: the
    exported snapshot can be imported (:func:`stage_snapshot`) only meanwhile.

    Creating the slot waits until every transaction running at that moment has ended (prepared
    transactions included): PostgreSQL needs that to reach a consistent point.

    :param dsn: libpq connection string of the slot's database (the user needs REPLICATION).
    :param slot_name: the new slot (lower-case letters, digits and underscores).
    :param plugin: ``test_decoding`` or ``pgoutput``.
    :param two_phase: decode prepared transactions at PREPARE (PostgreSQL 15+ here).
    :param drop_on_error: drop the slot again when the block raises: a slot whose initial load
        failed is of no use (its snapshot is gone) and would only hold WAL back.
    """
    if plugin not in SUPPORTED_PLUGINS:
        raise SlotError(plugin_unknown(plugin))
    with _connect(dsn) as conn:  # an upper-half slot left from an earlier slot of that name
        SlotClient(conn).drop_upper(slot_name)
    with replication_connection(dsn, slot_name) as repl:
        try:
            started = time.monotonic()
            snapshot = repl.create_slot_exporting_snapshot(slot_name, plugin, two_phase)
            log.info(
                "Created slot %s (%s%s) at consistent point %s, exported snapshot %s (%.1f s)",
                slot_name,
                plugin,
                ", two-phase" if two_phase else "",
                snapshot.consistent_lsn,
                snapshot.snapshot_name,
                time.monotonic() - started,
            )
            yield snapshot
        except BaseException:
            if repl.created and drop_on_error:
                try:
                    repl.drop_slot(slot_name)
                    log.warning("The initial load failed: dropped slot %s again", slot_name)
                except Exception:  # the original error matters more
                    log.exception(
                        "The initial load failed and slot %s could not be dropped; drop it by hand", slot_name
                    )
            raise


@dataclass
class _TablePlan:
    """One table's columns, key and chunk plan; ``state`` is its entry in the progress record."""

    schema: str
    table: str
    columns: list[ColumnInfo]
    key: list[str]
    identity: str
    state: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    options: TableOptions = DEFAULT_OPTIONS
    """The table's options (``arrays``, ``max_value_bytes`` apply to a snapshot)."""
    key_source: str | None = None
    mode: str = "merge"

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def relpath(self) -> str:
        return table_path(self.schema, self.table)

    @property
    def matched_by(self) -> list[str]:
        """The key columns the merge matches rows by: none for a table loaded ``append_only``."""
        return [] if self.mode == "append_only" else self.key

    @property
    def chunks(self) -> int:
        return int(self.state["chunks"])

    def bounds(self, index: int) -> tuple[int, int | None]:
        """Pages ``[first, stop)`` of chunk ``index``; ``stop`` is None for the last (open-ended) chunk."""
        per = int(self.state["pages_per_chunk"])
        return index * per, (None if index == self.chunks - 1 else (index + 1) * per)

    def chunk_pages(self, index: int) -> int:
        first, stop = self.bounds(index)
        return max(1, (stop if stop is not None else int(self.state["pages"])) - first)

    def done_rows(self) -> int:
        return sum(int(d["rows"]) for d in self.state["done"].values())

    def files(self) -> list[str]:
        """Every part: the TRUNCATE part first (``replace``), then the chunks' parts in chunk order."""
        done = self.state["done"]
        truncate = [done[i]["truncate"] for i in sorted(done, key=int) if done[i].get("truncate")]
        return truncate + self.row_files()

    def row_files(self) -> list[str]:
        """The chunks' parts (op I rows only), in chunk order."""
        done = self.state["done"]
        return [done[i]["file"] for i in sorted(done, key=int) if done[i]["file"]]

    def numeric_specials(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for record in self.state["done"].values():
            for column, count in (record.get("specials") or {}).items():
                total[column] = total.get(column, 0) + int(count)
        return {column: count for column, count in total.items() if count}


def stage_snapshot(
    connect: str | Callable[[], Connection],
    snapshot_name: str,
    consistent_lsn: Lsn | str,
    slot_name: str,
    staging_root: str | os.PathLike[str] | Storage,
    tables: Collection[str | tuple[str, str]],
    *,
    plugin: str = "test_decoding",
    chunk_rows: int = DEFAULT_SNAPSHOT_CHUNK_ROWS,
    replace: bool = True,
    on_chunk: Callable[[str, str, int, int], None] | None = None,
    workers: int | None = None,
    chunk_pages: int | None = None,
    log_interval: float = 10.0,
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
) -> BatchManifest:
    """Copy ``tables`` inside an exported snapshot and stage them as one snapshot batch.

    :param connect: a DSN, or a function returning a new psycopg 3 connection in autocommit
        mode; it is called once to plan (that connection holds the snapshot and the tables'
        ACCESS SHARE locks until the copy ends) and once per worker. Every connection imports
        the snapshot in its own REPEATABLE READ transaction.
    :param snapshot_name: from :func:`create_slot_with_snapshot`, whose block must still be open.
    :param consistent_lsn: the slot's consistent point: the commit LSN of every staged row and
        the batch's end LSN.
    :param slot_name: the slot the snapshot belongs to (the batch goes under its directory, and
        the merge keeps its watermark under it).
    :param staging_root: the staging root: a local directory or ``s3://bucket/prefix`` (a string
        on object storage takes its settings from the ``AWS_*`` environment; pass a
        :class:`~airflow_provider_pgdecode.batch.storage.Storage` to give them). The copy is
        written in a local work directory (:func:`snapshot_workdir`) and published as one batch:
        renamed into place on a local disk, uploaded with its manifest last on object storage.
    :param tables: ``schema.table`` names or ``(schema, table)`` pairs; each needs a key (a
        primary key, a replica identity index, or REPLICA IDENTITY FULL): the merge works by key.
    :param chunk_rows: the target rows per chunk (one chunk, one Parquet part); chunks are page
        ranges sized from the rows visible in a table's first pages. It also bounds the rows
        a worker holds in memory (a larger chunk is written in several row groups).
    :param replace: stage a TRUNCATE before each table's rows, so that merging the batch replaces
        whatever the Delta table held (a re-snapshot after a lost slot); ``False`` stages inserts only.
    :param on_chunk: called as ``on_chunk(schema, table, chunk_index, rows)`` after each chunk is
        durably staged and recorded (one call at a time, from the worker threads); an exception
        it raises stops the copy (the chunk stays recorded) and is raised here.
    :param workers: chunks copied at once, each worker on its own connection; default
        :data:`DEFAULT_SNAPSHOT_WORKERS` (``min(4, cores)``). The staged contents do not depend on it.
    :param chunk_pages: pages per chunk, instead of the estimate from ``chunk_rows``.
    :param log_interval: seconds between progress lines (a finished table is always logged).
    :param table_options: per-table options (:mod:`airflow_provider_pgdecode.batch.options`), as
        the extract takes them: ``arrays`` and ``max_value_bytes`` apply (a snapshot stages arrays
        as the incremental batches do); a bad value fails the snapshot naming the table and column
        (snapshots do not quarantine; fixing the row in PostgreSQL is the way forward); a table
        loaded ``append_only`` needs no key (its rows are appended).
    :returns: the manifest of the published batch ``<staging_root>/<slot>/<0>-<consistent_lsn>``.
    """
    lsn = Lsn.coerce(consistent_lsn)
    options_by_table = parse_table_options(table_options)
    if not _SNAPSHOT_NAME.match(snapshot_name):
        raise StagingError(f"{snapshot_name!r} is not an exported snapshot name")
    if chunk_rows < 1:
        raise ConfigurationError("chunk_rows must be at least 1")
    if chunk_pages is not None and chunk_pages < 1:
        raise ConfigurationError("chunk_pages must be at least 1")
    workers = DEFAULT_SNAPSHOT_WORKERS if workers is None else workers
    if workers < 1:
        raise ConfigurationError("workers must be at least 1")
    names = sorted(parse_table_names(tables))
    if not names:
        raise ConfigurationError("no table to snapshot")
    store = as_storage(staging_root)
    tmp = snapshot_workdir(store, slot_name, snapshot_name)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    options_by_table = parse_table_options(table_options)
    settings = {
        "format": SNAPSHOT_FORMAT,
        "slot": slot_name,
        "plugin": plugin,
        "snapshot_name": snapshot_name,
        "consistent_lsn": str(lsn),
        "chunk_rows": chunk_rows,
        "chunk_pages": chunk_pages,
        "replace": replace,
        "tables": [list(n) for n in names],
    }
    if options_by_table:  # staged contents depend on them: a resume must use the same
        settings["table_options"] = {f"{s}.{t}": o.model_dump() for (s, t), o in sorted(options_by_table.items())}

    def opener() -> Connection:
        return connect() if callable(connect) else _connect(connect)

    progress = _load_progress(tmp, settings)
    planner = opener()
    try:
        try:
            import_snapshot(planner, snapshot_name, slot_name)
            catalog = Catalog(planner)
            plans = [
                _plan_table(planner, catalog, progress, schema, table, chunk_rows, chunk_pages, options_by_table)
                for schema, table in names
            ]
            for plan in plans:
                plan.options = options_for(options_by_table, plan.schema, plan.table)
            loaded = record_tables(catalog, names)
            database = database_name(planner)
            server = server_address(planner)
        except DatabaseError as exc:
            raise StagingError(f"planning the snapshot copy for slot {slot_name!r} failed: {str(exc).strip()}") from exc
        _save_progress(tmp, progress)
        _discard_unrecorded(tmp, plans)
        copier = _Copier(
            opener, snapshot_name, slot_name, tmp, progress, plans, lsn, chunk_rows, replace, on_chunk, log_interval
        )
        copier.run(workers)
        try:
            commit(planner)  # read-only: its end matters only for the locks it releases
        except DatabaseError as exc:
            log.warning("Snapshot copy: the planning transaction ended with an error (%s)", str(exc).strip())
    finally:
        planner.close()

    summaries = [s for s in (_summary(plan, lsn, replace) for plan in plans) if s.files]
    total_rows = sum(plan.done_rows() for plan in plans)
    manifest = BatchManifest(
        slot=slot_name,
        plugin=plugin,
        database=database,
        server=server,
        start_lsn=str(SNAPSHOT_START_LSN),
        end_lsn=str(lsn),
        ceiling_lsn=str(lsn),
        transactions=1 if summaries else 0,
        changes=sum(s.rows for s in summaries),
        tables=summaries,
        table_oids=loaded.record(),
    )
    oid_of = {names[0]: oid for oid, names in loaded.names.items()}
    for summary in summaries:
        summary.oid = oid_of.get((summary.schema, summary.table))
    info = {
        **settings,
        "kind": "snapshot",
        "rows": total_rows,
        "tables": [
            {
                "schema": p.schema,
                "table": p.table,
                "files": p.files(),
                "rows": p.done_rows(),
                **{k: p.state[k] for k in ("chunks", "pages", "pages_per_chunk", "relfilenode", "seq_stride")},
            }
            for p in plans
        ],
    }
    (tmp / SNAPSHOT_INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (tmp / PROGRESS_NAME).unlink()
    manifest.write(tmp)
    manifest.path = publish_batch(tmp, store, f"{slot_name}/{batch_dir_name(SNAPSHOT_START_LSN, lsn)}", manifest)
    if not store.is_local:
        shutil.rmtree(tmp, ignore_errors=True)  # the local copy of an uploaded batch
    log.info("Staged the snapshot of %d table(s), %d rows, at %s: %s", len(names), total_rows, lsn, manifest.path)
    return manifest


def snapshot_workdir(store: Storage, slot_name: str, snapshot_name: str) -> Path:
    """The local directory where the copy of ``snapshot_name`` is written and its progress kept
    before it is published: ``<staging_root>/<slot>/.tmp-snapshot-<name>`` on a local staging
    root (publishing is a rename), else under :func:`~airflow_provider_pgdecode.batch.storage.spool_dir`
    in a folder named after the staging location, so that a resumed copy finds it again."""
    return workdir_base(store, slot_name) / f"{TMP_PREFIX}snapshot-{snapshot_name}"


def _plan_table(
    conn: Connection,
    catalog: Catalog,
    progress: dict[str, Any],
    schema: str,
    table: str,
    chunk_rows: int,
    chunk_pages: int | None,
    table_options: Mapping[tuple[str, str], TableOptions] | None = None,
) -> _TablePlan:
    """Columns, key and chunk plan of one table, read inside the snapshot; an earlier plan is kept."""
    columns = catalog.columns(schema, table)  # inside the snapshot: the columns as of the consistent point
    mode = options_for(table_options or {}, schema, table).mode
    try:
        key = catalog.table_key(schema, table)
    except CatalogError:
        if mode != "append_only":
            raise
        # append_only: appended, never matched, so no key is needed.
        identity = catalog.replica_identity(schema, table).kind
        key = TableKey((), identity, "primary key")
        key_source = None
    else:
        key_source = key.source

    def table_plan(state: dict[str, Any]) -> _TablePlan:
        return _TablePlan(
            schema, table, columns, list(key.columns), key.replica_identity, state, key_source=key_source, mode=mode
        )

    check_column_names(schema, table, [c.name for c in columns])
    # Held by the planning transaction until the copy ends: no rewrite (VACUUM FULL, CLUSTER,
    # ALTER TABLE) can move the snapshot's tuples meanwhile.
    size = lock_and_measure(conn, schema, table)
    block_size, relfilenode = size.block_size, size.relfilenode
    name = f"{schema}.{table}"
    state = progress["tables"].get(name)
    if state is not None and state.get("relfilenode") == relfilenode:
        log.info(
            "Snapshot copy of %s: resuming, %d of %d chunk(s) already staged", name, len(state["done"]), state["chunks"]
        )
        return table_plan(state)
    if state is not None:
        log.warning(
            "Snapshot copy of %s: the table was rewritten since its chunks were planned; copying it again", name
        )
    pages = size.pages
    if not has_tid_range_scans(conn):
        # Before PostgreSQL 14 a ctid range is a filter on a full scan, not a TID range scan.
        per, chunks = max(pages, 1), 1
    else:
        if chunk_pages is None:
            sample = count_rows_in_first_pages(conn, schema, table, SAMPLE_PAGES)
            per = max(1, math.ceil(chunk_rows / max(1.0, sample / SAMPLE_PAGES)))
        else:
            per = chunk_pages
        chunks = max(1, math.ceil(pages / per))
    # Heap tuples per page at most (MaxHeapTuplesPerPage): a chunk's rows get _pg_seq values
    # from index * seq_stride on, so seqs grow in physical order whatever the worker count.
    max_tuples = (block_size - 24) // 28
    state = {
        "schema": schema,
        "table": table,
        "relfilenode": relfilenode,
        "pages": pages,
        "pages_per_chunk": per,
        "chunks": chunks,
        "seq_stride": per * max_tuples,
        "done": {},
    }
    progress["tables"][name] = state
    log.info("Snapshot copy of %s: %d page(s) in %d chunk(s) of %d page(s)", name, pages, chunks, per)
    return table_plan(state)


def _discard_unrecorded(tmp: Path, plans: Sequence[_TablePlan]) -> None:
    """Delete half-written parts and parts whose chunk was not recorded (a kill between the two)."""
    for plan in plans:
        directory = tmp / plan.relpath
        directory.mkdir(parents=True, exist_ok=True)
        keep = set(plan.files())
        for path in directory.iterdir():
            if path.name not in keep:
                log.info("Snapshot copy of %s: discarding unfinished %s", plan.name, path.name)
                path.unlink()


def _summary(plan: _TablePlan, lsn: Lsn, replace: bool) -> TableSummary:
    rows = plan.done_rows()
    return TableSummary(
        schema=plan.schema,
        table=plan.table,
        path=plan.relpath,
        files=plan.files(),
        rows=rows + (1 if replace else 0),
        inserts=rows,
        updates=0,
        deletes=0,
        truncates=1 if replace else 0,
        min_commit_lsn=str(lsn),
        max_commit_lsn=str(lsn),
        columns=[
            ColumnSummary(c.name, c.type_name, str(_staged_type(c, plan.options.staging)), c.catalog_type, c.user_type)
            for c in plan.columns
        ],
        key=list(plan.key),
        replica_identity=plan.identity,
        key_source=plan.key_source,
        mode=plan.mode,
        type_map=dict(plan.options.type_map),
        snapshot_files=plan.row_files(),
        numeric_specials=plan.numeric_specials(),
    )


class _Copier:
    """Runs the chunks not yet staged on ``workers`` threads, each with its own connection."""

    def __init__(
        self,
        opener: Callable[[], Connection],
        snapshot_name: str,
        slot_name: str,
        tmp: Path,
        progress: dict[str, Any],
        plans: Sequence[_TablePlan],
        lsn: Lsn,
        chunk_rows: int,
        replace: bool,
        on_chunk: Callable[[str, str, int, int], None] | None,
        log_interval: float,
    ) -> None:
        self.opener = opener
        self.snapshot_name = snapshot_name
        self.slot_name = slot_name
        self.tmp = tmp
        self.progress = progress
        self.plans = plans
        self.lsn = lsn
        self.chunk_rows = chunk_rows
        self.replace = replace
        self.on_chunk = on_chunk
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.queue: list[tuple[_TablePlan, int]] = [
            (plan, index) for plan in plans for index in range(plan.chunks) if str(index) not in plan.state["done"]
        ]
        self.queue.reverse()  # popped from the end: table order, then chunk order
        self.report = _Report(plans, log_interval)

    def run(self, workers: int) -> None:
        count = min(workers, len(self.queue))
        if count == 0:
            return
        log.info(
            "Snapshot copy: %d chunk(s) of %d table(s) to copy with %d worker(s)",
            len(self.queue),
            len(self.plans),
            count,
        )
        threads = [
            threading.Thread(target=self._work, name=f"pgdecode-snapshot-{i}", daemon=True) for i in range(count)
        ]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.5)
        except BaseException:
            self.stop.set()
            for thread in threads:
                thread.join()
            raise
        if self.errors:
            error = self.errors[0]
            if isinstance(error, DatabaseError):
                raise StagingError(
                    f"the snapshot copy for slot {self.slot_name!r} failed: {str(error).strip()}. Its finished chunks "
                    f"are kept in {self.tmp}: call stage_snapshot again while the slot's snapshot is still exported "
                    "to continue from there."
                ) from error
            raise error
        self.report.finish()

    def _next(self) -> tuple[_TablePlan, int] | None:
        with self.lock:
            if self.stop.is_set() or not self.queue:
                return None
            item = self.queue.pop()
            self.report.chunk_started(item[0])
            return item

    def _work(self) -> None:
        conn = None
        try:
            conn = self.opener()
            import_snapshot(conn, self.snapshot_name, self.slot_name, extra_settings=SCAN_GUCS)
            while (item := self._next()) is not None:
                plan, index = item
                rows, file, truncate, specials = _copy_chunk(
                    conn, plan, index, self.tmp, self.lsn, self.chunk_rows, self.replace
                )
                with self.lock:
                    record: dict[str, Any] = {"rows": rows, "file": file}
                    if truncate:
                        record["truncate"] = truncate
                    if specials:
                        record["specials"] = specials
                    plan.state["done"][str(index)] = record
                    _save_progress(self.tmp, self.progress)
                    self.report.chunk_done(plan, index, rows)
                    if self.on_chunk is not None:
                        self.on_chunk(plan.schema, plan.table, index, rows)
            commit(conn)
        except BaseException as exc:
            with self.lock:
                self.errors.append(exc)
            self.stop.set()
        finally:
            if conn is not None:
                conn.close()


class _Report:
    """Progress lines: per table and overall chunks, rows, rows/s and time to go (by pages left)."""

    def __init__(self, plans: Sequence[_TablePlan], interval: float) -> None:
        self.plans = plans
        self.interval = interval
        self.started = self.last = time.monotonic()
        self.pages_total = sum(p.chunk_pages(i) for p in plans for i in range(p.chunks))
        self.pages_before = sum(p.chunk_pages(int(i)) for p in plans for i in p.state["done"])
        self.pages_now = 0
        self.rows_now = 0
        # per table: pages and rows copied by this call, when its first chunk started
        self.table_now: dict[str, list[float]] = {p.name: [0, 0, 0.0] for p in plans}
        self.changed: set[str] = set()

    def chunk_started(self, plan: _TablePlan) -> None:
        if not self.table_now[plan.name][2]:
            self.table_now[plan.name][2] = time.monotonic()

    def chunk_done(self, plan: _TablePlan, index: int, rows: int) -> None:
        pages = plan.chunk_pages(index)
        self.pages_now += pages
        self.rows_now += rows
        now_table = self.table_now[plan.name]
        now_table[0] += pages
        now_table[1] += rows
        self.changed.add(plan.name)
        now = time.monotonic()
        if len(plan.state["done"]) == plan.chunks:
            log.info(
                "Snapshot copy of %s: done, %d chunk(s), %d rows in %d part(s) (%.1f s)",
                plan.name,
                plan.chunks,
                plan.done_rows(),
                len(plan.files()),
                now - now_table[2],
            )
            self.changed.discard(plan.name)
        if now - self.last >= self.interval:
            self.log(now)

    def log(self, now: float) -> None:
        self.last = now
        elapsed = max(now - self.started, 1e-6)
        for plan in self.plans:
            if plan.name not in self.changed:
                continue
            pages, rows, started = self.table_now[plan.name]
            left = sum(plan.chunk_pages(i) for i in range(plan.chunks) if str(i) not in plan.state["done"])
            spent = max(now - started, 1e-6)
            log.info(
                "Snapshot copy of %s: %d/%d chunks, %d rows, %.0f rows/s, ETA %s",
                plan.name,
                len(plan.state["done"]),
                plan.chunks,
                plan.done_rows(),
                rows / spent,
                _eta(spent, pages, left),
            )
        self.changed.clear()
        done_chunks = sum(len(p.state["done"]) for p in self.plans)
        left = self.pages_total - self.pages_before - self.pages_now
        log.info(
            "Snapshot copy overall: %d/%d tables, %d/%d chunks, %d rows, %.0f rows/s, ETA %s",
            sum(len(p.state["done"]) == p.chunks for p in self.plans),
            len(self.plans),
            done_chunks,
            sum(p.chunks for p in self.plans),
            sum(p.done_rows() for p in self.plans),
            self.rows_now / elapsed,
            _eta(elapsed, self.pages_now, left),
        )

    def finish(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        log.info(
            "Snapshot copy finished: %d rows copied in %.1f s (%.0f rows/s)",
            self.rows_now,
            elapsed,
            self.rows_now / elapsed,
        )


def _eta(spent: float, done: float, left: float) -> str:
    if left <= 0:
        return "0 s"
    if done <= 0:
        return "unknown"
    return f"{spent * left / done:.0f} s"


def _load_progress(tmp: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The progress of an earlier, unfinished copy of the same snapshot, or a fresh start."""
    path = tmp / PROGRESS_NAME
    if path.is_file():
        try:
            progress = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            progress = None
        if progress is not None and progress.get("settings") == settings:
            log.info("Resuming the snapshot copy in %s", tmp)
            return progress
        log.warning("Discarding the unfinished snapshot copy in %s (other settings or unreadable)", tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    progress = {"settings": settings, "tables": {}}
    _save_progress(tmp, progress)
    return progress


def _save_progress(tmp: Path, progress: dict[str, Any]) -> None:
    """Replace the progress record atomically: a kill at any point leaves the old or the new one."""
    part = tmp / (PROGRESS_NAME + ".part")
    with open(part, "w", encoding="utf-8") as f:
        f.write(json.dumps(progress, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / PROGRESS_NAME)


def _copy_chunk(
    conn: Connection,
    plan: _TablePlan,
    index: int,
    tmp: Path,
    lsn: Lsn,
    chunk_rows: int,
    replace: bool,
) -> tuple[int, str | None, str | None, dict[str, int]]:
    """Copy one chunk into its part (written under ``.part``, fsynced, renamed); its rows, file
    name, the TRUNCATE part's name (chunk 0 of a ``replace`` copy) and the numeric NaN/Infinity
    values staged as null, per column."""
    first, stop = plan.bounds(index)
    names = [c.name for c in plan.columns]
    name = f"part-{index:05d}.parquet"
    path = tmp / plan.relpath / name
    part = path.with_name(name + ".part")
    truncate = None
    seq_start = (1 if replace else 0) + index * int(plan.state["seq_stride"])
    schema = _part_schema(plan.columns, plan.options.staging)
    specials: dict[str, int] = {}
    if replace and index == 0:
        # The TRUNCATE row in a part of its own: the chunks' parts hold rows only, so that a
        # merge creating the Delta table can commit them as they are.
        empty = [pa.array([], pa.string())] * len(plan.columns)
        table = _part_table(plan.columns, empty, 0, lsn, 0, True, plan.name, schema, plan.options)
        _write_table(tmp / plan.relpath / TRUNCATE_PART, table)
        truncate = TRUNCATE_PART
    writer: pq.ParquetWriter | None = None
    rows = 0
    try:
        # A single chunk reads the whole table: no ctid condition at all.
        pages = (first, stop) if plan.chunks > 1 else (None, None)
        with copy_pages_csv(conn, plan.schema, plan.table, names, *pages) as copy:
            char_columns = {c.name: c.catalog_type for c in plan.columns if c.catalog_type in CHAR_TYPES}
            for texts, count in _read_csv(copy, names, chunk_rows, char_columns):
                table = _part_table(
                    plan.columns,
                    texts,
                    count,
                    lsn,
                    seq_start + rows,
                    False,
                    plan.name,
                    schema,
                    plan.options,
                    specials,
                    plan.matched_by,
                )
                if writer is None:
                    writer = pq.ParquetWriter(part, schema, **PARQUET_OPTIONS)
                writer.write_table(table)
                rows += count
        if writer is None:
            return 0, None, truncate, {}
        writer.close()
        writer = None
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        if writer is not None:
            writer.close()
    return rows, name, truncate, {column: count for column, count in specials.items() if count}


def _read_csv(
    copy: Iterable[Any], names: list[str], chunk_rows: int, char_columns: Mapping[str, str] | None = None
) -> Iterator[tuple[list[pa.Array], int]]:
    """COPY's CSV output as string columns, at most ``chunk_rows`` rows at a time.

    libpq hands COPY data over one row at a time, so rows are gathered as bytes (the only
    per-row Python work: the floor any client pays) and every ``chunk_rows`` rows or
    :data:`_CSV_BATCH_BYTES` bytes are parsed by Arrow's CSV reader at once. PostgreSQL's CSV
    prints NULL unquoted and empty, an empty string as ``""``: Arrow reads the first as null and
    the second as an empty string; values are the output functions' text, exactly as the text
    format prints them. ``char_columns`` (name: type) are ``"char"`` columns, read as bytes and then
    as PostgreSQL 15+ prints them: 14 prints a byte above 127 as itself, not UTF-8, which the
    reader refuses in a text column (decoding/raw_char.py, as both plugins' parsers read it).
    """
    char_columns = char_columns or {}
    read_options = pacsv.ReadOptions(column_names=names, block_size=_CSV_BLOCK)
    parse_options = pacsv.ParseOptions(newlines_in_values=True)
    convert_options = pacsv.ConvertOptions(
        column_types={n: pa.binary() if n in char_columns else pa.string() for n in names},
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
        null_values=[""],
    )

    def parse(data: bytearray) -> list[pa.Array]:
        table = pacsv.read_csv(
            pa.py_buffer(data), read_options=read_options, parse_options=parse_options, convert_options=convert_options
        ).combine_chunks()
        columns = [column.chunk(0) if column.num_chunks else pa.array([], pa.string()) for column in table.columns]
        for index, name in enumerate(names):
            if name in char_columns and pa.types.is_binary(columns[index].type):
                raw = columns[index].to_pylist()
                columns[index] = pa.array(
                    [None if v is None else char_text(v, char_columns[name]) for v in raw], pa.string()
                )
        return columns

    data = bytearray()
    count = 0
    for row in copy:
        data += row
        count += 1
        if count >= chunk_rows or len(data) >= _CSV_BATCH_BYTES:
            yield parse(data), count
            data = bytearray()
            count = 0
    if count:
        yield parse(data), count


def _decimal_type(column: ColumnInfo, staging: Staging = DEFAULT_STAGING) -> pa.Decimal128Type | None:
    """The ``decimal128`` a bounded ``numeric(p,s)`` column is staged as in a snapshot (the Delta
    type of the type map, :func:`~airflow_provider_pgdecode.typemap.numeric_delta_type`), or
    ``None``: every other column, unbounded ``numeric``, precision above 38, arrays and numeric
    kept as text by the table's ``type_map`` keep the staging of incremental batches (text)."""
    if array_element(column.catalog_type) is not None or staging.keeps_as_text(column.catalog_type):
        return None
    typmod = numeric_typmod(column.catalog_type)
    if typmod is None or typmod[0] is None:
        return None
    match = re.fullmatch(r"decimal\((\d+),(\d+)\)", numeric_delta_type(*typmod))
    return pa.decimal128(int(match.group(1)), int(match.group(2))) if match else None


_NAIVE_TIMESTAMP = pa.timestamp("us")
_UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")


def _staged_type(column: ColumnInfo, staging: Staging = DEFAULT_STAGING) -> pa.DataType:
    """A snapshot column's staged Arrow type, the one Spark reads as the column's Delta type:
    Delta's decimal for bounded numeric, ``timestamp[us, tz=UTC]`` for ``timestamp without time
    zone`` (its wall-clock time read as UTC, the type map's rule: the same microseconds, only the
    annotation differs), else as incremental batches stage it
    (:func:`~airflow_provider_pgdecode.batch.values.arrow_type`)."""
    decimal = _decimal_type(column, staging)
    if decimal is not None:
        return decimal
    staged = arrow_type(column.type_name, staging)
    return _UTC_TIMESTAMP if staged == _NAIVE_TIMESTAMP else staged


def _part_schema(columns: list[ColumnInfo], staging: Staging = DEFAULT_STAGING) -> pa.Schema:
    values = [(c.name, _staged_type(c, staging)) for c in columns]
    return part_schema(pa.struct(values), values)


def _as_decimal(text: pa.Array, decimal: pa.Decimal128Type) -> tuple[pa.Array, int]:
    """Numeric text as ``decimal``, in the pass that writes the part: NaN/Infinity (which a
    decimal cannot hold) become null and are counted. PostgreSQL already rounded every value to
    the column's scale and checked its precision, so the cast never loses a digit (it raises if
    it would)."""
    special = pc.fill_null(pc.is_in(text, pa.array(NUMERIC_SPECIAL_VALUES)), False)
    count = pc.sum(special).as_py() or 0
    if count:
        text = pc.if_else(special, pa.scalar(None, pa.string()), text)
    return pc.cast(text, decimal), int(count)


def _part_table(
    columns: list[ColumnInfo],
    texts: Sequence[pa.Array],
    rows: int,
    lsn: Lsn,
    seq_start: int,
    leading_truncate: bool,
    where: str,
    schema: pa.Schema | None = None,
    options: TableOptions = DEFAULT_OPTIONS,
    specials: dict[str, int] | None = None,
    key: Collection[str] = (),
) -> pa.Table:
    """Rows of one part in the layout of batch/writer.py: op I rows (after an op T row).

    ``_pg_seq`` is 0 for the TRUNCATE, then ``seq_start``, ``seq_start + 1``, ... (capped at
    int32: each key occurs once in a snapshot, so only the order against the TRUNCATE matters).
    Numeric NaN/Infinity staged as null in a decimal column are added to ``specials``. ``key``:
    the columns the table is matched by, where ±infinity is a bad value (not clamped).
    """
    schema = schema or _part_schema(columns, options.staging)
    count = rows + (1 if leading_truncate else 0)
    seqs = (
        pc.min_element_wise(
            pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), rows), start=seq_start - 1),
            pa.scalar(_SEQ_MAX, pa.int64()),
        )
        if rows
        else pa.array([], pa.int64())
    )
    ops = pa.repeat(pa.scalar("I"), rows)
    if leading_truncate:
        seqs = pa.concat_arrays([pa.array([0], pa.int64()), seqs])
        ops = pa.concat_arrays([pa.array(["T"]), ops])
    lsns = pa.repeat(pa.scalar(int(lsn), pa.int64()), count)
    data: list[pa.Array] = [
        *metadata_columns(lsns, seqs, ops, [None] * count, [None] * count, lsns, [None] * count).values(),
        # No old images: a null struct shaped like the row, as the writer stages it.
        pa.nulls(count, schema.field(OLD).type),
    ]
    for column, text in zip(columns, texts):
        if leading_truncate:
            text = pa.concat_arrays([pa.nulls(1, pa.string()), text.cast(pa.string())])
        value = convert_snapshot_column(
            where, column.name, column.type_name, text, options, int(lsn), key=column.name in key
        )
        decimal = _decimal_type(column, options.staging)
        if decimal is not None:
            value, nulled = _as_decimal(value, decimal)
            if specials is not None:
                specials[column.name] = specials.get(column.name, 0) + nulled
        elif value.type == _NAIVE_TIMESTAMP:
            value = value.cast(_UTC_TIMESTAMP)  # the wall-clock time as UTC: same values
        data.append(value)
    return pa.Table.from_arrays(data, schema=schema)


def _write_table(path: Path, table: pa.Table) -> None:
    """One Parquet part, written under ``.part``, fsynced, renamed."""
    part = path.with_name(path.name + ".part")
    pq.write_table(table, part, **PARQUET_OPTIONS)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


def _write_part(
    path: Path,
    columns: list[ColumnInfo],
    rows: list[tuple[Any, ...]],
    lsn: Lsn,
    rows_before: int,
    leading_truncate: bool,
    where: str,
) -> None:
    """One Parquet part from text rows (``None`` = NULL), written under ``.part``, fsynced, renamed."""
    texts = [pa.array([row[index] for row in rows], pa.string()) for index in range(len(columns))]
    first = 1 if leading_truncate else 0
    _write_table(path, _part_table(columns, texts, len(rows), lsn, first + rows_before, leading_truncate, where))


__all__ = [
    "DEFAULT_SNAPSHOT_CHUNK_ROWS",
    "DEFAULT_SNAPSHOT_WORKERS",
    "ExportedSnapshot",
    "SNAPSHOT_START_LSN",
    "create_slot_with_snapshot",
    "snapshot_workdir",
    "stage_snapshot",
]
