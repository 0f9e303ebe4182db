"""Initial load consistent with a new slot: an exported snapshot staged as one batch. Plain Python.

A logical slot created over a replication connection can export the snapshot in which its
decoding starts: every transaction that committed at or before the slot's *consistent point*
is visible in the snapshot, every one committing after it is decoded by the slot. Copying the
tables inside that snapshot and staging them with the consistent point as their commit LSN
makes the copy and the slot's later batches fit exactly: nothing missed, nothing twice.

::

    from airflow_provider_pgdecode.staging.snapshot import create_slot_with_snapshot, stage_snapshot

    with create_slot_with_snapshot(dsn, "pgdecode_shop") as (consistent_lsn, snapshot_name):
        manifest = stage_snapshot(dsn, snapshot_name, consistent_lsn, "pgdecode_shop",
                                  "/data/staging", ["public.orders", "public.customers"])
    # merge manifest.path into Delta, then extract_batch(...) from the slot as usual

The snapshot exists only while the connection that created the slot stays open, so the copy
must run inside the ``with`` block. Tables are read in key order, ``chunk_rows`` rows at a
time (keyset pagination); every chunk becomes one Parquet part and is recorded in a progress
file, so a copy that fails part-way (a dropped connection, a statement timeout) continues
from its last finished chunk when :func:`stage_snapshot` is called again *inside the same
block*. Once the block has ended the snapshot is gone and nothing can resume: drop the slot
and start over (docs/staging-format.md, "Snapshot batches").
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
from psycopg import sql

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, SlotError, StagingError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo
from airflow_provider_pgdecode.staging.extract import SUPPORTED_PLUGINS, publish_batch, parse_table_names
from airflow_provider_pgdecode.staging.manifest import (
    BatchManifest,
    ColumnSummary,
    TableSummary,
    batch_dir_name,
    table_path,
)
from airflow_provider_pgdecode.staging.types import arrow_type, convert_column
from airflow_provider_pgdecode.staging.writer import PARQUET_OPTIONS, METADATA_PREFIX

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_CHUNK_ROWS = 100_000
SNAPSHOT_FORMAT = "pgdecode.snapshot/1"
SNAPSHOT_INFO_NAME = "snapshot.json"
PROGRESS_NAME = "progress.json"
#: The start LSN of every snapshot batch: the copy holds the effect of all WAL up to its end.
SNAPSHOT_START_LSN = Lsn(0)

# The formatting the decoding session pins (extract), so that values read here print alike.
SESSION_GUCS = (
    ("DateStyle", "ISO, YMD"),
    ("TimeZone", "UTC"),
    ("IntervalStyle", "postgres"),
    ("bytea_output", "hex"),
    ("extra_float_digits", "3"),
)

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
_SNAPSHOT_NAME = re.compile(r"^[0-9A-Fa-f-]{1,64}$")
_SEQ_MAX = 2**31 - 1


class ExportedSnapshot(NamedTuple):
    """The slot's consistent point and the name of the snapshot exported with it."""

    consistent_lsn: Lsn
    snapshot_name: str


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
    import psycopg2
    import psycopg2.extras

    if plugin not in SUPPORTED_PLUGINS:
        raise SlotError(f"output plugin {plugin!r} is not supported; use one of {', '.join(SUPPORTED_PLUGINS)}")
    if not _SLOT_NAME.match(slot_name):
        raise SlotError(
            f"invalid slot name {slot_name!r}: PostgreSQL allows lower-case letters, digits and underscores (at most 63)"
        )
    try:
        conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    except psycopg2.Error as exc:
        raise SlotError(
            f"cannot open a replication connection to create slot {slot_name!r}: {str(exc).strip()}. The user needs "
            "the REPLICATION attribute and pg_hba.conf must allow its connection (a 'database' line serves "
            "logical replication connections)."
        ) from None
    created = False
    try:
        cur = conn.cursor()
        if conn.server_version >= 150000:
            options = "SNAPSHOT 'export'" + (", TWO_PHASE" if two_phase else "")
            command = f"CREATE_REPLICATION_SLOT {slot_name} LOGICAL {plugin} ({options})"
        elif two_phase:
            raise SlotError(
                f"creating a two-phase slot with an exported snapshot needs PostgreSQL 15 or later (server "
                f"{conn.server_version}); pass two_phase=False"
            )
        else:
            command = f"CREATE_REPLICATION_SLOT {slot_name} LOGICAL {plugin} EXPORT_SNAPSHOT"
        started = time.monotonic()
        try:
            cur.execute(command)
        except psycopg2.errors.DuplicateObject:
            raise SlotError(
                f"slot {slot_name!r} already exists: an initial load needs a new slot (its snapshot is exported only "
                "when it is created). Drop the slot first, or choose another name."
            ) from None
        except psycopg2.Error as exc:
            raise SlotError(f"cannot create slot {slot_name!r}: {str(exc).strip()}") from None
        created = True
        names = [d.name for d in cur.description]
        row = dict(zip(names, cur.fetchone()))
        for column in ("slot_name", "consistent_point", "snapshot_name", "output_plugin"):
            if row.get(column) is None:
                raise SlotError(f"CREATE_REPLICATION_SLOT for {slot_name!r} returned no {column} (reply columns {names})")
        snapshot = ExportedSnapshot(Lsn.parse(row["consistent_point"]), row["snapshot_name"])
        log.info(
            "Created slot %s (%s%s) at consistent point %s, exported snapshot %s (%.1f s)",
            slot_name, plugin, ", two-phase" if two_phase else "", snapshot.consistent_lsn, snapshot.snapshot_name,
            time.monotonic() - started,
        )
        yield snapshot
    except BaseException:
        if created and drop_on_error:
            try:
                conn.cursor().execute(f"DROP_REPLICATION_SLOT {slot_name}")
                log.warning("The initial load failed: dropped slot %s again", slot_name)
            except Exception:  # the original error matters more
                log.exception("The initial load failed and slot %s could not be dropped; drop it by hand", slot_name)
        raise
    finally:
        conn.close()


def stage_snapshot(
    connect: str | Callable[[], psycopg.Connection[Any]],
    snapshot_name: str,
    consistent_lsn: Lsn | str,
    slot_name: str,
    staging_root: str | os.PathLike[str],
    tables: Collection[str | tuple[str, str]],
    *,
    plugin: str = "test_decoding",
    chunk_rows: int = DEFAULT_SNAPSHOT_CHUNK_ROWS,
    replace: bool = True,
    on_chunk: Callable[[str, str, int, int], None] | None = None,
) -> BatchManifest:
    """Copy ``tables`` inside an exported snapshot and stage them as one snapshot batch.

    :param connect: a DSN, or a function returning a new psycopg 3 connection; the copy runs
        in its own REPEATABLE READ transaction that imports the snapshot.
    :param snapshot_name: from :func:`create_slot_with_snapshot`, whose block must still be open.
    :param consistent_lsn: the slot's consistent point: the commit LSN of every staged row and
        the batch's end LSN.
    :param slot_name: the slot the snapshot belongs to (the batch goes under its directory, and
        the merge keeps its watermark under it).
    :param tables: ``schema.table`` names or ``(schema, table)`` pairs; each needs a primary
        key (or a replica identity index) to be read in key order.
    :param chunk_rows: rows read per query and written per Parquet part.
    :param replace: stage a TRUNCATE before each table's rows, so that merging the batch replaces
        whatever the Delta table held (a re-snapshot after a lost slot); ``False`` stages inserts only.
    :param on_chunk: called as ``on_chunk(schema, table, chunk_index, rows)`` after each chunk is
        durably staged (progress reporting).
    :returns: the manifest of the published batch ``<staging_root>/<slot>/<0>-<consistent_lsn>``.
    """
    lsn = Lsn.coerce(consistent_lsn)
    if not _SNAPSHOT_NAME.match(snapshot_name):
        raise StagingError(f"{snapshot_name!r} is not an exported snapshot name")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be at least 1")
    names = sorted(parse_table_names(tables))
    if not names:
        raise ValueError("no table to snapshot")
    base = Path(staging_root) / slot_name
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".tmp-snapshot-{snapshot_name}"
    settings = {
        "format": SNAPSHOT_FORMAT, "slot": slot_name, "plugin": plugin, "snapshot_name": snapshot_name,
        "consistent_lsn": str(lsn), "chunk_rows": chunk_rows, "replace": replace,
        "tables": [list(n) for n in names],
    }
    progress = _load_progress(tmp, settings)
    conn = connect() if callable(connect) else psycopg.connect(connect, autocommit=True)
    try:
        _import_snapshot(conn, snapshot_name, slot_name)
        catalog = Catalog(conn)
        summaries: list[TableSummary] = []
        total_rows = 0
        for schema, table in names:
            state = progress["progress"].setdefault(
                f"{schema}.{table}", {"schema": schema, "table": table, "files": [], "rows": 0, "last_key": None, "done": False}
            )
            summary = _stage_table(conn, catalog, tmp, progress, state, schema, table, lsn, chunk_rows, replace, on_chunk)
            total_rows += state["rows"]
            if summary.files:
                summaries.append(summary)
        conn.execute("COMMIT")
        database = conn.info.dbname
    except psycopg.Error as exc:
        raise StagingError(
            f"the snapshot copy for slot {slot_name!r} failed: {str(exc).strip()}. Its finished chunks are kept in "
            f"{tmp}: call stage_snapshot again while the slot's snapshot is still exported to continue from there."
        ) from exc
    finally:
        conn.close()

    manifest = BatchManifest(
        slot=slot_name,
        plugin=plugin,
        database=database,
        start_lsn=str(SNAPSHOT_START_LSN),
        end_lsn=str(lsn),
        ceiling_lsn=str(lsn),
        transactions=1 if summaries else 0,
        changes=sum(s.rows for s in summaries),
        tables=summaries,
    )
    info = {**settings, "kind": "snapshot", "rows": total_rows,
            "tables": [{k: v for k, v in s.items() if k != "done"} for s in progress["progress"].values()]}
    (tmp / SNAPSHOT_INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (tmp / PROGRESS_NAME).unlink()
    manifest.write(tmp)
    manifest.path = publish_batch(tmp, base / batch_dir_name(SNAPSHOT_START_LSN, lsn), manifest)
    log.info("Staged the snapshot of %d table(s), %d rows, at %s: %s", len(names), total_rows, lsn, manifest.path)
    return manifest


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
    progress = {"settings": settings, "progress": {}}
    _save_progress(tmp, progress)
    return progress


def _save_progress(tmp: Path, progress: dict[str, Any]) -> None:
    part = tmp / (PROGRESS_NAME + ".part")
    with open(part, "w", encoding="utf-8") as f:
        f.write(json.dumps(progress, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / PROGRESS_NAME)


def _import_snapshot(conn: psycopg.Connection[Any], snapshot_name: str, slot_name: str) -> None:
    if not conn.autocommit:
        raise StagingError("stage_snapshot needs a connection in autocommit mode (it runs its own transaction)")
    for name, value in SESSION_GUCS:
        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    try:
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
    except psycopg.Error as exc:
        conn.execute("ROLLBACK")
        raise StagingError(
            f"cannot import snapshot {snapshot_name!r} of slot {slot_name!r}: {str(exc).strip()}. A snapshot is "
            "exported only while the replication connection that created the slot is open, so an unfinished copy "
            "can resume only inside that create_slot_with_snapshot block. Drop the slot and start the initial load "
            "again."
        ) from None


def _table_key(catalog: Catalog, schema: str, table: str) -> tuple[list[str], str]:
    identity = catalog.replica_identity(schema, table)
    key = catalog.primary_key(schema, table)
    if not key and identity.kind == "index":
        key = list(identity.columns)
    if not key:
        raise CatalogError(
            f"table {schema}.{table} has no primary key (nor a replica identity index): it can be neither copied in "
            "key order nor merged by key. Add a primary key, or leave the table out."
        )
    return key, identity.kind


def _stage_table(
    conn: psycopg.Connection[Any],
    catalog: Catalog,
    tmp: Path,
    progress: dict[str, Any],
    state: dict[str, Any],
    schema: str,
    table: str,
    lsn: Lsn,
    chunk_rows: int,
    replace: bool,
    on_chunk: Callable[[str, str, int, int], None] | None,
) -> TableSummary:
    columns = catalog.columns(schema, table)  # inside the snapshot: the columns as of the consistent point
    key, identity = _table_key(catalog, schema, table)
    for column in columns:
        if column.name.startswith(METADATA_PREFIX):
            raise CatalogError(
                f"column {column.name!r} of {schema}.{table} starts with {METADATA_PREFIX!r}, which pgdecode reserves "
                "for its metadata columns; rename the column or leave the table out"
            )
    by_name = {c.name: c for c in columns}
    key_index = [next(i for i, c in enumerate(columns) if c.name == k) for k in key]
    relpath = table_path(schema, table)
    directory = tmp / relpath
    directory.mkdir(parents=True, exist_ok=True)
    select = sql.SQL(", ").join(sql.Identifier(c.name) for c in columns)
    key_list = sql.SQL(", ").join(sql.Identifier(k) for k in key)
    started = time.monotonic()
    while not state["done"]:
        chunk = len(state["files"])
        where = sql.SQL("")
        if state["last_key"] is not None:
            bound = sql.SQL(", ").join(
                sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(by_name[k].catalog_type))
                for k, v in zip(key, state["last_key"])
            )
            where = sql.SQL(" WHERE ({}) > ({})").format(key_list, bound)
        query = sql.SQL("COPY (SELECT {} FROM {}{} ORDER BY {} LIMIT {}) TO STDOUT").format(
            select, sql.Identifier(schema, table), where, key_list, sql.Literal(chunk_rows)
        )
        with conn.cursor() as cur, cur.copy(query) as copy:
            rows = list(copy.rows())
        leading_truncate = replace and chunk == 0
        if rows or leading_truncate:
            name = f"part-{chunk:05d}.parquet"
            _write_part(directory / name, columns, rows, lsn, state["rows"], leading_truncate, f"{schema}.{table}")
            state["files"].append(name)
            state["rows"] += len(rows)
        if rows:
            state["last_key"] = [rows[-1][i] for i in key_index]
        state["done"] = len(rows) < chunk_rows
        _save_progress(tmp, progress)
        if on_chunk is not None:
            on_chunk(schema, table, chunk, len(rows))
    log.info("Snapshot of %s.%s: %d rows in %d part(s) (%.1f s)", schema, table, state["rows"],
             len(state["files"]), time.monotonic() - started)
    return TableSummary(
        schema=schema,
        table=table,
        path=relpath,
        files=list(state["files"]),
        rows=state["rows"] + (1 if replace else 0),
        inserts=state["rows"],
        updates=0,
        deletes=0,
        truncates=1 if replace else 0,
        min_commit_lsn=str(lsn),
        max_commit_lsn=str(lsn),
        columns=[
            ColumnSummary(c.name, c.type_name, str(arrow_type(c.type_name)), c.catalog_type, c.user_type)
            for c in columns
        ],
        key=list(key),
        replica_identity=identity,
    )


def _write_part(
    path: Path,
    columns: list[ColumnInfo],
    rows: list[tuple[Any, ...]],
    lsn: Lsn,
    rows_before: int,
    leading_truncate: bool,
    where: str,
) -> None:
    """One Parquet part in the layout of staging/writer.py: op I rows (after an op T row)."""
    count = len(rows) + (1 if leading_truncate else 0)
    first = 1 if leading_truncate else 0
    ops = (["T"] if leading_truncate else []) + ["I"] * len(rows)
    # _pg_seq: 0 for the TRUNCATE, then the row number within the table (capped at int32: each
    # key occurs once in a snapshot, so only the order against the TRUNCATE matters).
    seqs = ([0] if leading_truncate else []) + [
        min(first + rows_before + i, _SEQ_MAX) for i in range(len(rows))
    ]
    data: dict[str, pa.Array] = {
        "_pg_commit_lsn": pa.array([int(lsn)] * count, pa.int64()),
        "_pg_seq": pa.array(seqs, pa.int32()),
        "_pg_op": pa.array(ops, pa.string()),
        "_pg_xid": pa.nulls(count, pa.int64()),
        "_pg_commit_time": pa.nulls(count, pa.timestamp("us", tz="UTC")),
        "_pg_change_lsn": pa.array([int(lsn)] * count, pa.int64()),
        "_pg_unchanged_toast": pa.nulls(count, pa.list_(pa.string())),
        # No old images: a null struct shaped like the row, as the writer stages it.
        "_pg_old": pa.nulls(count, pa.struct([(c.name, arrow_type(c.type_name)) for c in columns])),
    }
    for index, column in enumerate(columns):
        values = ([None] if leading_truncate else []) + [row[index] for row in rows]
        data[column.name] = convert_column(column.type_name, values, f"{where}.{column.name}")
    part = path.with_name(path.name + ".part")
    pq.write_table(pa.table(data), part, **PARQUET_OPTIONS)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


__all__ = [
    "DEFAULT_SNAPSHOT_CHUNK_ROWS",
    "ExportedSnapshot",
    "SNAPSHOT_START_LSN",
    "create_slot_with_snapshot",
    "stage_snapshot",
]
