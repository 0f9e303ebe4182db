"""Initial load consistent with a new slot: an exported snapshot staged as one batch. Plain Python.

A slot created over a replication connection exports the snapshot its decoding starts from;
the tables copied inside it, staged with the slot's consistent point as their commit LSN, fit
the slot's later batches exactly: nothing missed, nothing twice. This room owns the chunk plan
(heap page ranges), the copying workers, the resume after a failure or a kill, and where the
copy is written; how and why: docs/backfill.md, "How the initial copy works".

::

    from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot

    with create_slot_with_snapshot(dsn, "pgdecode_shop") as (consistent_lsn, snapshot_name):
        manifest = stage_snapshot(dsn, snapshot_name, consistent_lsn, "pgdecode_shop",
                                  "/data/staging", ["public.orders", "public.customers"], workers=4)
    # merge manifest.path into Delta, then extract_batch(...) from the slot as usual

The snapshot exists only while the connection that created the slot stays open, so the copy
must run inside the ``with`` block.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_pgdecode.batch.format import (
    SNAPSHOT_START_LSN,
    check_column_names,
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
from airflow_provider_pgdecode.capture.renames import KnownTables, record_tables
from airflow_provider_pgdecode.capture.snapshot_chunks import ChunkRead, chunk_reads, describe_plan, plan_chunks
from airflow_provider_pgdecode.capture.snapshot_parts import TRUNCATE_PART, ChunkCopy, copy_chunk, staged_type
from airflow_provider_pgdecode.capture.snapshot_spark import CopyJob, copy_on_spark, finished_chunks
from airflow_provider_pgdecode.capture.staged_tables import carried_columns
from airflow_provider_pgdecode.capture.tables import parse_table_names
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.decoding.lsn import Lsn
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
from airflow_provider_pgdecode.postgres.snapshot_queries import import_snapshot
from airflow_provider_pgdecode.postgres.standby import PrimaryLink

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_CHUNK_ROWS = 100_000
#: Copying connections (threads) by default: a few, never more than the cores.
DEFAULT_SNAPSHOT_WORKERS = max(1, min(4, os.cpu_count() or 1))
SNAPSHOT_FORMAT = "pgdecode.snapshot/3"
SNAPSHOT_INFO_NAME = "snapshot.json"
PROGRESS_NAME = "progress.json"

_SNAPSHOT_NAME = re.compile(r"^[0-9A-Fa-f-]{1,64}$")


@contextmanager
def create_slot_with_snapshot(
    dsn: str,
    slot_name: str,
    plugin: str = "test_decoding",
    two_phase: bool = True,
    *,
    drop_on_error: bool = True,
    primary: PrimaryLink | None = None,
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
    :param primary: when ``dsn`` is a standby's, its primary, asked to log the running
        transactions the creation waits for (:func:`~airflow_provider_pgdecode.postgres.standby.primary_logs_snapshots`).
    """
    if plugin not in SUPPORTED_PLUGINS:
        raise SlotError(plugin_unknown(plugin))
    with _connect(dsn) as conn:  # an upper-half slot left from an earlier slot of that name
        SlotClient(conn).drop_upper(slot_name)
    with replication_connection(dsn, slot_name) as repl:
        try:
            started = time.monotonic()
            snapshot = repl.create_slot_exporting_snapshot(slot_name, plugin, two_phase, primary=primary)
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

    def reads(self, index: int) -> ChunkRead:
        """The relation (this table, or one of its leaf partitions) and pages chunk ``index`` reads."""
        return chunk_reads(self.schema, self.table, self.state, index)

    def chunk_pages(self, index: int) -> int:
        return self.reads(index).pages

    def done_rows(self) -> int:
        return sum(int(d["rows"]) for d in self.state["done"].values())

    def files(self) -> list[str]:
        """Every part: the TRUNCATE part first (``replace``), then the chunks' parts in chunk order."""
        done = self.state["done"]
        truncate = [done[i]["truncate"] for i in sorted(done, key=int) if done[i].get("truncate")]
        return truncate + self.row_files()

    def placed_files(self) -> list[str]:
        """The parts Spark tasks uploaded to the batch's final place on object storage."""
        done = [record for record in self.state["done"].values() if record.get("placed")]
        return [name for record in done for name in (record.get("truncate"), record["file"]) if name]

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


def _end_planning(planner: Connection) -> None:
    """End the planning transaction: read-only, its end matters only for the locks it releases."""
    try:
        commit(planner)
    except DatabaseError as exc:
        log.warning("Snapshot copy: the planning transaction ended with an error (%s)", str(exc).strip())


def _plan_copy(
    planner: Connection,
    snapshot_name: str,
    slot_name: str,
    names: list[tuple[str, str]],
    progress: dict[str, Any],
    chunk_rows: int,
    chunk_pages: int | None,
    options_by_table: Mapping[tuple[str, str], TableOptions],
    carried: Callable[..., list[ColumnInfo]],
    publication: str | None,
) -> tuple[list[_TablePlan], KnownTables, str, str]:
    """Plan every table's chunks inside the imported snapshot, on the planning connection.

    Returns the plans, the tables' records, the database's name and the server's address.
    """
    try:
        import_snapshot(planner, snapshot_name, slot_name)
        catalog = Catalog(planner)
        carried = functools.partial(carried, stored_published=catalog.publishes_generated(publication))
        plans = [
            _plan_table(planner, catalog, progress, schema, table, chunk_rows, chunk_pages, options_by_table, carried)
            for schema, table in names
        ]
        for plan in plans:
            plan.options = options_for(options_by_table, plan.schema, plan.table)
        return plans, record_tables(catalog, names), database_name(planner), server_address(planner)
    except DatabaseError as exc:
        raise StagingError(f"planning the snapshot copy for slot {slot_name!r} failed: {str(exc).strip()}") from exc


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
    publication: str | None = None,
    spark: SparkSession | None = None,
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
    :param publication: a pgoutput slot's publication: its stored generated columns are copied
        only when it publishes them (``publish_generated_columns = stored``), as its changes
        carry them (``staged_tables.carried_columns``; virtual ones never, test_decoding's stored
        ones always).
    :param spark: copy the chunks as the tasks of one job of this (classic) SparkSession instead of
        on ``workers`` threads here: one task per chunk, each importing the snapshot over its own
        connection (``connect`` must then be a DSN) and writing its part straight to the staging
        root: into the copy's work directory on a local staging root (a path every executor
        shares), or uploaded to the batch's final place on object storage (the manifest, uploaded
        last here, makes it visible) (:mod:`.snapshot_spark`). The chunks are planned, recorded and published here, as
        without it, and the staged batch is the same; ``workers`` does not apply (the executors'
        cores do), and chunks are recorded (and ``on_chunk`` called) once the job has ended (a failed
        job's finished chunks too: a call again copies the others).
    :returns: the manifest of the published batch ``<staging_root>/<slot>/<0>-<consistent_lsn>``.
    """
    lsn = Lsn.coerce(consistent_lsn)
    options_by_table = parse_table_options(table_options)
    workers = _checked_arguments(snapshot_name, chunk_rows, chunk_pages, workers)
    names = sorted(parse_table_names(tables))
    if not names:
        raise ConfigurationError("no table to snapshot")
    store = as_storage(staging_root)
    if spark is not None:
        _check_spark_copy(connect, store)
    tmp = snapshot_workdir(store, slot_name, snapshot_name)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    settings = _copy_settings(
        slot_name, plugin, snapshot_name, lsn, chunk_rows, chunk_pages, replace, names, options_by_table
    )

    def opener() -> Connection:
        return connect() if callable(connect) else _connect(connect)

    progress = _load_progress(tmp, settings)
    planner = opener()
    try:
        plans, loaded, database, server = _plan_copy(
            planner,
            snapshot_name,
            slot_name,
            names,
            progress,
            chunk_rows,
            chunk_pages,
            options_by_table,
            functools.partial(carried_columns, plugin=plugin),
            publication,
        )
        _save_progress(tmp, progress)
        _discard_unrecorded(tmp, plans)
        copier = _Copier(
            opener, snapshot_name, slot_name, tmp, progress, plans, lsn, chunk_rows, replace, on_chunk, log_interval
        )
        if spark is None:
            copier.run(workers)
        else:
            remote = None if store.is_local else store.child(slot_name, batch_dir_name(SNAPSHOT_START_LSN, lsn))
            copier.run_on_spark(spark, str(connect), remote)
        _end_planning(planner)
    finally:
        planner.close()

    manifest = _snapshot_manifest(plans, lsn, replace, slot_name, plugin, database, server, loaded)
    rows = _publish_snapshot(tmp, store, manifest, settings, plans)
    log.info("Staged the snapshot of %d table(s), %d rows, at %s: %s", len(names), rows, lsn, manifest.path)
    return manifest


def _copy_settings(
    slot_name: str,
    plugin: str,
    snapshot_name: str,
    lsn: Lsn,
    chunk_rows: int,
    chunk_pages: int | None,
    replace: bool,
    names: Sequence[tuple[str, str]],
    options_by_table: Mapping[tuple[str, str], Any],
) -> dict[str, Any]:
    """What a copy is made with, kept beside its progress: a call again resumes only with the same."""
    settings: dict[str, Any] = {
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
    return settings


def _publish_snapshot(
    tmp: Path, store: Storage, manifest: BatchManifest, settings: Mapping[str, Any], plans: Sequence[_TablePlan]
) -> int:
    """Write the copy's info and manifest into its work directory and publish it as the batch
    ``<slot>/<0>-<lsn>`` (``manifest.path`` set); the rows copied."""
    info = _snapshot_info(settings, plans)
    (tmp / SNAPSHOT_INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (tmp / PROGRESS_NAME).unlink()
    manifest.write(tmp)
    placed = [f"{plan.relpath}/{name}" for plan in plans for name in plan.placed_files()]
    batch = batch_dir_name(SNAPSHOT_START_LSN, Lsn.parse(str(settings["consistent_lsn"])))
    manifest.path = publish_batch(tmp, store, f"{settings['slot']}/{batch}", manifest, placed=placed)
    if not store.is_local:
        shutil.rmtree(tmp, ignore_errors=True)  # the local copy of an uploaded batch
    return int(info["rows"])


def _check_spark_copy(connect: str | Callable[[], Connection], store: Storage) -> None:
    """Refuse a copy on Spark that its executors could not do."""
    if callable(connect):
        raise ConfigurationError(
            "the snapshot copy on Spark needs the source's DSN, not a connection factory: each task opens its own "
            "connection on an executor"
        )


def _checked_arguments(snapshot_name: str, chunk_rows: int, chunk_pages: int | None, workers: int | None) -> int:
    """Refuse arguments no copy can run with; the number of workers."""
    if not _SNAPSHOT_NAME.match(snapshot_name):
        raise StagingError(f"{snapshot_name!r} is not an exported snapshot name")
    if chunk_rows < 1:
        raise ConfigurationError("chunk_rows must be at least 1")
    if chunk_pages is not None and chunk_pages < 1:
        raise ConfigurationError("chunk_pages must be at least 1")
    workers = DEFAULT_SNAPSHOT_WORKERS if workers is None else workers
    if workers < 1:
        raise ConfigurationError("workers must be at least 1")
    return workers


def _snapshot_manifest(
    plans: Sequence[_TablePlan],
    lsn: Lsn,
    replace: bool,
    slot_name: str,
    plugin: str,
    database: str,
    server: str,
    loaded: KnownTables,
) -> BatchManifest:
    """The snapshot batch's manifest: its tables with rows, each with its oid."""
    summaries = [s for s in (_summary(plan, lsn, replace) for plan in plans) if s.files]
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
    return manifest


def _snapshot_info(settings: Mapping[str, Any], plans: Sequence[_TablePlan]) -> dict[str, Any]:
    """``snapshot.json``: the copy's settings and each table's chunk plan, files and rows."""
    return {
        **settings,
        "kind": "snapshot",
        "rows": sum(plan.done_rows() for plan in plans),
        "tables": [
            {
                "schema": p.schema,
                "table": p.table,
                "files": p.files(),
                "rows": p.done_rows(),
                **{k: p.state[k] for k in ("chunks", "pages", "pages_per_chunk", "relfilenode", "seq_stride")},
                **({"leaves": p.state["leaves"]} if "leaves" in p.state else {}),
            }
            for p in plans
        ],
    }


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
    carried: Callable[[list[ColumnInfo]], list[ColumnInfo]] = list,
) -> _TablePlan:
    """Columns (those the slot's changes carry: ``carried``), key and chunk plan of one table,
    read inside the snapshot; an earlier plan is kept."""
    columns = carried(catalog.columns(schema, table))  # inside the snapshot: the columns as of the consistent point
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
    name = f"{schema}.{table}"
    chunking = plan_chunks(conn, schema, table, chunk_rows, chunk_pages)
    state = progress["tables"].get(name)
    if state is not None and state.get("relfilenode") == chunking["relfilenode"]:
        log.info(
            "Snapshot copy of %s: resuming, %d of %d chunk(s) already staged", name, len(state["done"]), state["chunks"]
        )
        return table_plan(state)
    if state is not None:
        log.warning(
            "Snapshot copy of %s: the table was rewritten since its chunks were planned; copying it again", name
        )
    state = {"schema": schema, "table": table, **chunking, "done": {}}
    progress["tables"][name] = state
    log.info("Snapshot copy of %s: %s", name, describe_plan(state))
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
            ColumnSummary(
                c.name,
                c.type_name,
                str(staged_type(c, plan.options.staging)),
                c.catalog_type,
                c.user_type,
                attnum=c.attnum,
            )
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

    def run_on_spark(self, spark: SparkSession, dsn: str, remote: Storage | None = None) -> None:
        """Copy the chunks as the tasks of one Spark job (:mod:`.snapshot_spark`), then record them
        as the threads do; the snapshot's exporting connection stays open meanwhile (the caller's).
        ``remote``: on object storage, the batch's final place, where the tasks upload the parts."""
        job = CopyJob(
            dsn,
            self.snapshot_name,
            self.slot_name,
            str(self.tmp),
            int(self.lsn),
            self.chunk_rows,
            self.replace,
            remote=None if remote is None else remote.root,
            settings=None if remote is None else remote.settings,
        )
        chunks = list(reversed(self.queue))  # table order, then chunk order
        self.queue.clear()
        for plan, _ in chunks:
            self.report.chunk_started(plan)
        try:
            copies = list(copy_on_spark(spark, job, chunks))
        except StagingError:
            kept = finished_chunks(job, chunks)  # a resumed call copies only the others
            for plan, index, copied in kept:
                self.record(plan, index, copied, placed=remote is not None)
            log.warning(
                "Snapshot copy: the Spark job failed; %d of %d chunk(s) finished and kept", len(kept), len(chunks)
            )
            raise
        for plan, index, copied in copies:
            self.record(plan, index, copied, placed=remote is not None)
        # Attempts that died mid-chunk left their temporary files: only recorded parts are published.
        _discard_unrecorded(self.tmp, self.plans)
        self.report.finish()

    def record(self, plan: _TablePlan, index: int, copied: ChunkCopy, *, placed: bool = False) -> None:
        """Record a chunk durably staged (``placed``: uploaded to the batch's final place): the
        progress record, the report, ``on_chunk``."""
        with self.lock:
            record: dict[str, Any] = {"rows": copied.rows, "file": copied.file}
            if placed:
                record["placed"] = True
            if copied.truncate:
                record["truncate"] = copied.truncate
            if copied.specials:
                record["specials"] = copied.specials
            plan.state["done"][str(index)] = record
            _save_progress(self.tmp, self.progress)
            self.report.chunk_done(plan, index, copied.rows)
            if self.on_chunk is not None:
                self.on_chunk(plan.schema, plan.table, index, copied.rows)

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
                copied = copy_chunk(conn, plan, index, self.tmp, self.lsn, self.chunk_rows, self.replace)
                self.record(plan, index, copied)
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


__all__ = [
    "DEFAULT_SNAPSHOT_CHUNK_ROWS",
    "DEFAULT_SNAPSHOT_WORKERS",
    "ExportedSnapshot",
    "SNAPSHOT_START_LSN",
    "TRUNCATE_PART",
    "create_slot_with_snapshot",
    "snapshot_workdir",
    "stage_snapshot",
]
