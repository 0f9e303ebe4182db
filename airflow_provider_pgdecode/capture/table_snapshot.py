"""Snapshots of single tables while the slot keeps flowing: add a table, re-snapshot a table.

The table is copied in key-ordered chunks *inside the incremental extract*, each in its own
``REPEATABLE READ`` snapshot followed by a high-watermark message, and every copied row is placed
in the batch's commit order where it belongs (at the watermark, or just before the first change
of its key that the chunk's snapshot did not see). The algorithm, why it is exact, and what a
user sees: docs/backfill.md ("Adding a table, re-snapshotting a table").

The key is :meth:`Catalog.table_key`'s, the one the extract stages the table with; a key of all
columns (REPLICA IDENTITY FULL) may hold NULLs and repeat, so its chunks never split copies of one
row, and a column without an ordering is refused by name. Requests are files,
``<staging_root>/<slot>/snapshot-requests/<id>.json`` (:func:`request_table_snapshot`); progress
travels with the checkpoint (``Checkpoint.snapshots``). Every statement is issued by the
PostgreSQL layer (``postgres/snapshot_queries.py``). Plain Python: no Airflow, no Spark.

Example::

    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

    request_table_snapshot("/data/staging", "pgdecode_shop", ["public.refunds"], mode="add-table")
    # the next runs of pgdecode_incremental copy public.refunds chunk by chunk
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_pgdecode.batch.badvalues import convert_snapshot_column
from airflow_provider_pgdecode.batch.format import (
    CHANGE_LSN,
    COMMIT_LSN,
    SEQ,
    check_column_names,
    metadata_columns,
    table_path,
)
from airflow_provider_pgdecode.batch.manifest import ColumnSummary, TableSummary
from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, TableOptions, options_for
from airflow_provider_pgdecode.batch.storage import Storage, as_storage, iter_names
from airflow_provider_pgdecode.batch.values import arrow_type
from airflow_provider_pgdecode.capture.snapshot_parts import write_part_file
from airflow_provider_pgdecode.capture.staged_tables import carried_columns
from airflow_provider_pgdecode.capture.tables import parse_table_names
from airflow_provider_pgdecode.decoding.assembler import Transaction
from airflow_provider_pgdecode.decoding.events import UNCHANGED_TOAST, Change, RowImage, Truncate
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError, StagingError, StandbyWriteError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, TableKey
from airflow_provider_pgdecode.postgres.session import Connection, pin_settings, rollback, rollback_if_open
from airflow_provider_pgdecode.postgres.session import commit as commit_transaction
from airflow_provider_pgdecode.postgres.slot import SlotClient
from airflow_provider_pgdecode.postgres.snapshot_queries import (
    begin_chunk_snapshot,
    copy_key_range,
    emit_watermark,
    largest_key,
)

log = logging.getLogger(__name__)

MODES = ("add-table", "resnapshot")
REQUESTS_DIR = "snapshot-requests"
WATERMARK_PREFIX = "pgdecode.snapshot"
DEFAULT_CHUNK_ROWS = 50_000
#: Snapshot rows copied by one extract run, all requests together (the rest waits for the next run).
DEFAULT_ROWS_PER_BATCH = 500_000

_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")
_XID_SPAN = 2**32


# ----------------------------------------------------------------------------------------------
# Requests and their state files
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotRequest:
    """Copy ``tables`` into the running pipeline: ``add-table`` or ``resnapshot``."""

    id: str
    mode: str
    tables: tuple[tuple[str, str], ...]
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "mode": self.mode,
            "tables": [list(t) for t in self.tables],
            "chunk_rows": self.chunk_rows,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SnapshotRequest:
        try:
            return cls(
                str(data["id"]),
                str(data["mode"]),
                tuple((str(s), str(t)) for s, t in data["tables"]),
                int(data.get("chunk_rows") or DEFAULT_CHUNK_ROWS),
                str(data.get("created") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StagingError(f"malformed snapshot request {dict(data)!r}: {exc}") from None


def requests_dir(staging_root: str | os.PathLike[str] | Storage, slot: str) -> Storage:
    """``<staging_root>/<slot>/snapshot-requests``, where the slot's requests and their states are filed."""
    return as_storage(staging_root).child(slot, REQUESTS_DIR)


def request_table_snapshot(
    staging_root: str | os.PathLike[str] | Storage,
    slot: str,
    tables: Collection[str | tuple[str, str]],
    mode: str = "resnapshot",
    *,
    request_id: str | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> SnapshotRequest:
    """File a request for the slot's next extract runs to copy ``tables`` (see the module doc).

    Filing the same ``request_id`` again with the same tables and mode returns the existing
    request (a re-run does not snapshot twice); with other settings it is an error.

    :param staging_root: the slot's staging root, a local directory or ``s3://bucket/prefix``
        (a :class:`~airflow_provider_pgdecode.batch.storage.Storage` carries the store's settings;
        a string takes them from the ``AWS_*`` environment).
    :param mode: ``add-table`` (a table not staged so far joins the pipeline) or ``resnapshot``
        (a staged table is copied again, e.g. after its Delta table was deleted or damaged).
        Both stage a TRUNCATE of the Delta table before the first chunk.
    :param request_id: letters, digits, ``_.+-``; default one made from the mode and the time.
    :param chunk_rows: rows per chunk (one query, one Parquet part).
    """

    if mode not in MODES:
        raise ConfigurationError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if chunk_rows < 1:
        raise ConfigurationError("chunk_rows must be at least 1")
    pairs = tuple(sorted(parse_table_names(tables)))
    if not pairs:
        raise ConfigurationError("name at least one table to snapshot")
    now = datetime.now(UTC)
    if request_id is None:
        request_id = f"{mode}-{now.strftime('%Y%m%dT%H%M%S%fZ')}"
    request_id = re.sub(r"[^A-Za-z0-9_.+-]", "_", request_id)
    if not _REQUEST_ID.match(request_id):
        raise ConfigurationError(f"invalid request id {request_id!r}: use letters, digits and _.+- (at most 128)")
    request = SnapshotRequest(request_id, mode, pairs, chunk_rows, now.isoformat())
    directory = requests_dir(staging_root, slot)
    name = f"{request_id}.json"
    existing_data = _read_json(directory, name)
    if existing_data is not None:
        existing = SnapshotRequest.from_dict(existing_data)
        if (existing.mode, existing.tables, existing.chunk_rows) != (mode, pairs, chunk_rows):
            raise StagingError(
                f"snapshot request {request_id!r} of slot {slot!r} already exists with other settings "
                f"({existing.mode}, {', '.join('.'.join(t) for t in existing.tables)}); choose another id"
            )
        log.info("Snapshot request %s already filed at %s", request_id, existing.created)
        return existing
    _write_json(directory, name, request.to_dict())
    log.info("Filed snapshot request %s: %s of %s", request_id, mode, ", ".join(".".join(t) for t in pairs))
    return request


def list_snapshot_requests(staging_root: str | os.PathLike[str] | Storage, slot: str) -> list[SnapshotRequest]:
    """The slot's filed requests, oldest first."""
    directory = requests_dir(staging_root, slot)
    out = []
    for name in iter_names(directory, directories=False):
        if not name.endswith(".json") or name.endswith(".state.json") or name.startswith("."):
            continue
        data = _read_json(directory, name)
        if data is not None:  # removed meanwhile
            out.append(SnapshotRequest.from_dict(data))
    return sorted(out, key=lambda r: (r.created, r.id))


def write_snapshot_states(
    staging_root: str | os.PathLike[str] | Storage, slot: str, snapshots: Mapping[str, Any]
) -> None:
    """Mirror confirmed progress to ``<id>.state.json`` (the confirm step calls this)."""
    directory = requests_dir(staging_root, slot)
    if snapshots and directory.exists():
        for request_id, state in snapshots.items():
            _write_json(directory, f"{request_id}.state.json", state)


def read_snapshot_state(
    staging_root: str | os.PathLike[str] | Storage, slot: str, request_id: str
) -> dict[str, Any] | None:
    """The confirmed progress of a request, or None before its first confirmed chunk."""
    return _read_json(requests_dir(staging_root, slot), f"{request_id}.state.json")


def pending_snapshot_requests(staging_root: str | os.PathLike[str] | Storage, slot: str) -> list[str]:
    """Ids of filed requests whose confirmed state is not done yet."""
    store = as_storage(staging_root)
    out = []
    for request in list_snapshot_requests(store, slot):
        state = read_snapshot_state(store, slot, request.id)
        if state is None or not state.get("done"):
            out.append(request.id)
    return out


def describe_progress(state: Mapping[str, Any]) -> str:
    """One line per table: chunks, rows, done or not."""
    parts = []
    for name, table in sorted((state.get("tables") or {}).items()):
        status = "done" if table.get("done") else "copying"
        parts.append(f"{name}: {table.get('chunks', 0)} chunk(s), {table.get('rows', 0)} rows, {status}")
    if state.get("error"):
        parts.append(f"failed: {state['error']}")
    return "; ".join(parts) or "no chunk yet"


def _read_json(directory: Storage, name: str) -> Any:
    """A request or state file's contents; ``None`` when it does not exist."""
    try:
        text = directory.read_text(name)
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StagingError(
            f"unreadable snapshot request file {directory.uri(name)}: {exc}. Remove it, and file the request again "
            "if it was one"
        ) from None


def _write_json(directory: Storage, name: str, data: Any) -> None:
    """Replace the file whole: a local file is written aside and renamed, an object is one PUT."""
    directory.write_text(name, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _new_state(request: SnapshotRequest) -> dict[str, Any]:
    return {
        "mode": request.mode,
        "done": False,
        "error": None,
        "tables": {
            f"{s}.{t}": {
                "schema": s,
                "table": t,
                "last_key": None,
                "chunks": 0,
                "rows": 0,
                "truncated": False,
                "done": False,
            }
            for s, t in request.tables
        },
    }


def added_tables(snapshots: Mapping[str, Any]) -> set[tuple[str, str]]:
    """Tables that requests brought into the pipeline: staged from then on, whatever the table list."""
    out = set()
    for state in snapshots.values():
        if not state.get("error"):
            for table in (state.get("tables") or {}).values():
                out.add((table["schema"], table["table"]))
    return out


# ----------------------------------------------------------------------------------------------
# Visibility
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotVisibility:
    """Which transactions a snapshot sees: ``pg_current_snapshot()`` as 64-bit xids."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    def widen(self, xid: int) -> int:
        """A 32-bit xid from the slot, as the 64-bit xid nearest ``xmax``."""
        full = (self.xmax & ~(_XID_SPAN - 1)) | (xid & (_XID_SPAN - 1))
        if full > self.xmax + _XID_SPAN // 2:
            full -= _XID_SPAN
        elif full < self.xmax - _XID_SPAN // 2:
            full += _XID_SPAN
        return full

    def sees(self, xid: int | None) -> bool:
        """True when the transaction's effects are in the snapshot (``None``: unknown, so no)."""
        if xid is None:
            return False
        full = self.widen(xid)
        return full < self.xmin or (full < self.xmax and full not in self.xip)

    def to_dict(self) -> dict[str, Any]:
        return {"xmin": self.xmin, "xmax": self.xmax, "xip": sorted(self.xip)}


# ----------------------------------------------------------------------------------------------
# Copying chunks inside an extract
# ----------------------------------------------------------------------------------------------


class _NotNow(Exception):
    """A chunk cannot be taken in this run; the request goes on in a later one."""


@dataclass
class _Chunk:
    """One staged piece of a table snapshot: a TRUNCATE (``truncate``) or copied rows."""

    request_id: str
    schema: str
    table: str
    index: int  # 1, 2, ... for row chunks as the logs count them; 0 for the TRUNCATE
    high: Lsn
    file: Path
    columns: list[ColumnInfo]
    key: list[str]
    rows: int
    truncate: bool = False
    visibility: SnapshotVisibility | None = None
    keys: dict[tuple[str | None, ...], list[int]] = field(default_factory=dict)
    """Positions of the chunk's rows by key; a key of all columns may repeat."""
    placement: dict[int, tuple[int, int]] = field(default_factory=dict)
    cut: tuple[int, int] | None = None
    state_before: dict[str, Any] = field(default_factory=dict)

    def key_of(self, image: RowImage) -> tuple[str | None, ...] | None:
        """The image's key as the chunk holds it (``None`` is NULL, in a key of all columns);
        ``None`` when the image lacks a key column or holds an unchanged TOAST value there."""
        values = dict(zip(image.names, image.values))
        try:
            key = tuple(values[k] for k in self.key)
        except KeyError:
            return None
        return None if any(v is UNCHANGED_TOAST for v in key) else key  # type: ignore[return-value]


class TableSnapshotter:
    """Copies requested chunks before an extract peeks, and places them once it has read.

    Used by :func:`~airflow_provider_pgdecode.capture.extract.extract_batch`:
    :meth:`copy_chunks` before the peek, :meth:`observe` for every staged transaction,
    :meth:`finish` once the batch's end LSN is known.
    """

    def __init__(
        self,
        conn: Connection,
        batch_dir: Path,
        requests: list[SnapshotRequest],
        snapshots: Mapping[str, Any] | None,
        *,
        rows_per_batch: int = DEFAULT_ROWS_PER_BATCH,
        publication: str | None = None,
        table_options: Mapping[tuple[str, str], TableOptions] | None = None,
        slots: SlotClient | None = None,
    ) -> None:
        self.conn = conn
        #: Where the watermarks are written: ``conn`` itself, or a standby's primary.
        self.slots = slots if slots is not None else SlotClient(conn)
        #: Per-table options: ``arrays`` and ``max_value_bytes`` apply to the chunks.
        self.table_options = dict(table_options or {})
        self.batch_dir = batch_dir
        self.requests = requests
        self.progress: dict[str, Any] = copy.deepcopy(dict(snapshots or {}))
        self.rows_per_batch = rows_per_batch
        self.publication = publication
        self.chunks: list[_Chunk] = []
        self._by_table: dict[tuple[str, str], list[_Chunk]] = {}
        self._part_numbers: dict[tuple[str, str], int] = {}

    @property
    def active(self) -> bool:
        """Whether any filed request still has work."""
        return any(not self.progress.get(r.id, {}).get("done") for r in self.requests)

    def included_tables(self) -> set[tuple[str, str]]:
        """Tables to stage because of requests (active ones included)."""
        tables = added_tables(self.progress)
        for request in self.requests:
            if not self.progress.get(request.id, {}).get("error"):
                tables.update(request.tables)
        return tables

    # -- before the peek ----------------------------------------------------------------------

    def copy_chunks(self) -> int:
        """Copy chunks of the pending requests, oldest first, up to ``rows_per_batch`` rows."""
        budget = self.rows_per_batch
        copied = 0
        for request in self.requests:
            state = self.progress.get(request.id)
            if state is None:
                state = self.progress[request.id] = _new_state(request)
                log.info("Snapshot request %s (%s): starting", request.id, request.mode)
            if state["done"]:
                continue
            try:
                for name, tstate in state["tables"].items():
                    while not tstate["done"] and budget > 0:
                        started = time.monotonic()
                        rows = self._copy_chunk(request, tstate)
                        budget -= max(rows, 1)
                        copied += rows
                        elapsed = max(time.monotonic() - started, 1e-6)
                        log.info(
                            "Snapshot %s, %s: chunk %d, %d rows (%.0f rows/s), %d rows so far%s",
                            request.id,
                            name,
                            tstate["chunks"],
                            rows,
                            rows / elapsed,
                            tstate["rows"],
                            ", table done" if tstate["done"] else "",
                        )
            except _NotNow as exc:
                log.warning("Snapshot request %s waits: %s", request.id, exc)
                break
            except (CatalogError, StagingError, StandbyWriteError) as exc:
                # One bad request must not stop the pipeline's other tables. On a standby without
                # primary_conn_id the watermarks cannot be written: the error says how to name one.
                log.error("Snapshot request %s failed and is given up: %s", request.id, exc)
                state["error"] = str(exc)
                state["done"] = True
                self._drop_chunks(request.id)
                continue
            if all(t["done"] for t in state["tables"].values()):
                state["done"] = True
            if budget <= 0:
                break
        return copied

    def _drop_chunks(self, request_id: str) -> None:
        for chunk in [c for c in self.chunks if c.request_id == request_id]:
            chunk.file.unlink(missing_ok=True)
            self.chunks.remove(chunk)
            self._by_table[(chunk.schema, chunk.table)].remove(chunk)

    def _watermark(self, content: Mapping[str, Any]) -> Lsn:
        """A transactional logical message, synchronously committed: its LSN orders the chunk. On a
        standby it is written on the primary, and the standby has replayed it when this returns."""
        text = json.dumps(content, sort_keys=True)
        return self.slots.written_where_wal_is(
            lambda conn: emit_watermark(conn, WATERMARK_PREFIX, text), "a table snapshot's watermark"
        )

    def _options(self, schema: str, table: str) -> tuple[str, TableOptions]:
        return f"{schema}.{table}", options_for(self.table_options, schema, table)

    def _next_part(self, schema: str, table: str) -> Path:
        number = self._part_numbers.get((schema, table), 0)
        self._part_numbers[(schema, table)] = number + 1
        directory = self.batch_dir / table_path(schema, table)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"snapshot-{number:05d}.parquet"

    def _check_table(self, catalog: Catalog, schema: str, table: str) -> tuple[list[ColumnInfo], TableKey]:
        """The table's columns and key, checked: it exists, has a key the chunks can be ordered
        by, no column named like the metadata columns, and (pgoutput) is in the publication. The
        columns are those the slot's changes carry (``staged_tables.carried_columns``)."""
        columns = carried_columns(
            catalog.columns(schema, table),
            "pgoutput" if self.publication is not None else "test_decoding",
            catalog.publishes_generated(self.publication),
        )
        if not columns:
            raise CatalogError(f"table {schema}.{table} does not exist (or has no columns): check the request's name")
        key = catalog.table_key(schema, table)
        if not key.unique:
            by_name = {c.name: c for c in columns}
            unordered = catalog.unorderable_columns(schema, table, [by_name[k] for k in key.columns])
            if unordered:
                named = ", ".join(f"{c.name!r} ({c.catalog_type})" for c in unordered)
                raise CatalogError(
                    f"table {schema}.{table} has no primary key and REPLICA IDENTITY FULL, so all its columns are its "
                    f"key and its snapshot is copied in their order, but column(s) {named} cannot be ordered (the type "
                    "has no b-tree operator class). Add a primary key (or a unique index with REPLICA IDENTITY USING "
                    "INDEX), or change the column to a type with an ordering (jsonb instead of json, text instead of "
                    "xml), or leave the table out of the request."
                )
        check_column_names(schema, table, [c.name for c in columns])
        if self.publication is not None:
            if not catalog.in_publication(self.publication, schema, table):
                raise CatalogError(
                    f"table {schema}.{table} is not in publication {self.publication!r}, so the slot sends none of "
                    f"its changes: ALTER PUBLICATION {self.publication} ADD TABLE {schema}.{table}, then file the "
                    "request again under another request_id (this one is given up)"
                )
        return columns, key

    def _copy_chunk(self, request: SnapshotRequest, tstate: dict[str, Any]) -> int:
        schema, table = tstate["schema"], tstate["table"]
        before = copy.deepcopy(tstate)
        conn = self.conn
        pin_settings(conn)  # copied values print as decoded ones
        if not tstate["truncated"]:
            # Low watermark: the TRUNCATE that clears what Delta held goes before every chunk.
            catalog = Catalog(conn)
            columns, key = self._check_table(catalog, schema, table)
            low = self._watermark({"request": request.id, "table": f"{schema}.{table}", "mark": "low"})
            # The copy ends at the largest key present now: rows inserted later are in the slot
            # after the low watermark, so the copy does not chase a growing table.
            tstate["upper_key"] = largest_key(conn, schema, table, key)
            path = self._next_part(schema, table)
            _write_chunk(path, columns, [], low, truncate=True, options=self._options(schema, table))
            tstate["truncated"] = True
            tstate["truncate_lsn"] = str(low)
            self._add(
                _Chunk(
                    request.id,
                    schema,
                    table,
                    0,
                    low,
                    path,
                    columns,
                    list(key.columns),
                    0,
                    truncate=True,
                    state_before=before,
                )
            )
            before = copy.deepcopy(tstate)
            if tstate["upper_key"] is None:  # empty: every row it gets is in the slot after the TRUNCATE
                tstate["done"] = True
                return 0
        visibility = self._begin_chunk_snapshot()
        try:
            catalog = Catalog(conn)
            columns, key = self._check_table(catalog, schema, table)
            key_index = [next(i for i, c in enumerate(columns) if c.name == k) for k in key.columns]
            # A key of all columns may repeat: a full chunk then holds every copy of its last key.
            rows = copy_key_range(
                conn, schema, table, columns, key, tstate["last_key"], tstate.get("upper_key"), request.chunk_rows
            )
            commit_transaction(conn)
        except BaseException:
            rollback_if_open(conn)
            raise
        high = self._watermark(
            {"request": request.id, "table": f"{schema}.{table}", "chunk": tstate["chunks"], "mark": "high"}
        )
        path = self._next_part(schema, table)
        _write_chunk(path, columns, rows, high, options=self._options(schema, table), key=key.columns)
        keys: dict[tuple[str | None, ...], list[int]] = {}
        for n, r in enumerate(rows):
            keys.setdefault(tuple(r[i] for i in key_index), []).append(n)
        tstate["chunks"] += 1
        tstate["rows"] += len(rows)
        if rows:
            tstate["last_key"] = [rows[-1][i] for i in key_index]
        tstate["done"] = len(rows) < request.chunk_rows
        self._add(
            _Chunk(
                request.id,
                schema,
                table,
                tstate["chunks"],
                high,
                path,
                columns,
                list(key.columns),
                len(rows),
                visibility=visibility,
                keys=keys,
                state_before=before,
            )
        )
        return len(rows)

    #: How often, and how far apart, a chunk's snapshot is tried before the chunk waits for the next run.
    snapshot_attempts = 25
    snapshot_pause = 0.2

    def _begin_chunk_snapshot(self) -> SnapshotVisibility:
        """Open the chunk's REPEATABLE READ transaction; return what its snapshot sees.

        A transaction whose commit is already in the WAL (and so possibly in an earlier batch)
        but not yet visible, as when a commit waits for a synchronous standby, would make the
        chunk older than changes Delta already holds. While any commit waits so (seen in
        ``pg_stat_activity``, which shows other users' sessions to members of ``pg_monitor``),
        the snapshot is not used: the chunk waits, at most a few seconds, else for the next run.
        """
        waiting: tuple[str, ...] = ()
        for _ in range(self.snapshot_attempts):
            snapshot = begin_chunk_snapshot(self.conn)
            if not snapshot.waiting:
                return SnapshotVisibility(snapshot.xmin, snapshot.xmax, snapshot.xip)
            waiting = snapshot.waiting
            rollback(self.conn)
            time.sleep(self.snapshot_pause)
        raise _NotNow(
            f"transactions {', '.join(waiting)} are committed but not yet visible (a synchronous standby not "
            "answering?); the chunk is taken in a later run"
        )

    def _add(self, chunk: _Chunk) -> None:
        self.chunks.append(chunk)
        self._by_table.setdefault((chunk.schema, chunk.table), []).append(chunk)

    def high_watermark(self) -> Lsn | None:
        """The last watermark of the chunks copied in this run: the batch must reach it."""
        return max((chunk.high for chunk in self.chunks), default=None)

    # -- while the slot is read ---------------------------------------------------------------

    def observe(self, txn: Transaction) -> None:
        """Note changes to chunk keys by transactions the chunk's snapshot did not see."""
        if not self._by_table:
            return
        commit = int(txn.commit_lsn)
        candidates = [
            c
            for chunks in self._by_table.values()
            for c in chunks
            if not c.truncate and commit <= c.high and c.visibility is not None and not c.visibility.sees(txn.xid)
        ]
        if not candidates:
            return
        by_table: dict[tuple[str, str], list[_Chunk]] = {}
        for chunk in candidates:
            by_table.setdefault((chunk.schema, chunk.table), []).append(chunk)
        for seq, item in enumerate(txn.items):
            kind = type(item)
            if kind is Change:
                chunks = by_table.get((item.schema, item.table))  # type: ignore[union-attr]
                if not chunks:
                    continue
                for chunk in chunks:
                    for image in (item.old, item.new):  # type: ignore[union-attr]
                        if image is None:
                            continue
                        key = chunk.key_of(image)
                        for position in chunk.keys.get(key, ()) if key is not None else ():
                            if position not in chunk.placement:
                                chunk.placement[position] = (commit, seq)
            elif kind is Truncate:
                for relation in item.relations:  # type: ignore[union-attr]
                    for chunk in by_table.get(relation, ()):
                        if chunk.cut is None:
                            chunk.cut = (commit, seq)

    # -- once the batch's end is known --------------------------------------------------------

    def finish(self, end_lsn: Lsn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Place the chunk rows, drop chunks beyond ``end_lsn``; return chunk records and progress."""
        records: list[dict[str, Any]] = []
        kept: list[_Chunk] = []
        restored: set[tuple[str, str, str]] = set()
        for chunk in self.chunks:
            ident = (chunk.request_id, chunk.schema, chunk.table)
            if chunk.high > end_lsn:
                # Not reached by this batch (cannot happen with a ceiling past the watermark):
                # the chunk, and every later one of its table, is copied again by the next run
                # rather than land out of order.
                log.warning(
                    "Snapshot chunk of %s.%s at %s is past the batch end %s: copied again next run",
                    chunk.schema,
                    chunk.table,
                    chunk.high,
                    end_lsn,
                )
                chunk.file.unlink(missing_ok=True)
                if ident not in restored:
                    self.progress[chunk.request_id]["tables"][f"{chunk.schema}.{chunk.table}"] = chunk.state_before
                    restored.add(ident)
                continue
            kept.append(chunk)
            moved = self._place(chunk)
            records.append(
                {
                    "request": chunk.request_id,
                    "table": f"{chunk.schema}.{chunk.table}",
                    "chunk": chunk.index,
                    "kind": "truncate" if chunk.truncate else "rows",
                    "lsn": str(chunk.high),
                    "rows": chunk.rows,
                    "moved_rows": moved,
                    "file": chunk.file.name,
                    **({"snapshot": chunk.visibility.to_dict()} if chunk.visibility is not None else {}),
                }
            )
        self.chunks = kept
        for state in self.progress.values():
            if not state.get("error"):
                state["done"] = all(t["done"] for t in state["tables"].values())
        return records, self.progress

    def _place(self, chunk: _Chunk) -> int:
        """Rewrite the part's commit LSN and seq where a row must precede an unseen change."""
        if chunk.truncate or (not chunk.placement and chunk.cut is None):
            return 0
        high = int(chunk.high)
        positions = []
        moved = 0
        for n in range(chunk.rows):
            spot = chunk.placement.get(n)
            position = (high, n) if spot is None else (spot[0], -1)
            if chunk.cut is not None and position > (chunk.cut[0], -1):
                position = (chunk.cut[0], -1)
            moved += position[0] != high
            positions.append(position)
        table = pq.read_table(chunk.file)
        lsns = pa.array([p[0] for p in positions], pa.int64())
        table = table.set_column(table.schema.get_field_index(COMMIT_LSN), COMMIT_LSN, lsns)
        table = table.set_column(table.schema.get_field_index(CHANGE_LSN), CHANGE_LSN, lsns)
        table = table.set_column(
            table.schema.get_field_index(SEQ), SEQ, pa.array([p[1] for p in positions], pa.int32())
        )
        write_part_file(chunk.file, table)
        return moved

    def table_summaries(self, summaries: list[TableSummary]) -> list[TableSummary]:
        """The extract's table summaries with the chunk parts added (new tables sorted in)."""
        by_name = {(s.schema, s.table): s for s in summaries}
        for chunk in self.chunks:
            name = (chunk.schema, chunk.table)
            summary = by_name.get(name)
            if summary is None:
                summary = by_name[name] = TableSummary(
                    schema=chunk.schema,
                    table=chunk.table,
                    path=table_path(*name),
                    files=[],
                    rows=0,
                    inserts=0,
                    updates=0,
                    deletes=0,
                    truncates=0,
                    min_commit_lsn=str(chunk.high),
                    max_commit_lsn=str(chunk.high),
                    columns=[],
                )
            summary.files.append(chunk.file.name)
            summary.rows += chunk.rows + (1 if chunk.truncate else 0)
            summary.inserts += chunk.rows
            summary.truncates += 1 if chunk.truncate else 0
            lsns = [int(chunk.high)] + [p[0] for p in chunk.placement.values()]
            if chunk.cut is not None:
                lsns.append(chunk.cut[0])
            summary.min_commit_lsn = str(Lsn(min(int(Lsn.parse(summary.min_commit_lsn)), *lsns)))
            summary.max_commit_lsn = str(Lsn(max(int(Lsn.parse(summary.max_commit_lsn)), *lsns)))
            known = {c.name for c in summary.columns}
            for column in chunk.columns:
                if column.name not in known:
                    summary.columns.append(
                        ColumnSummary(
                            column.name,
                            column.type_name,
                            str(arrow_type(column.type_name, options_for(self.table_options, *name).staging)),
                            column.catalog_type,
                            column.user_type,
                            attnum=column.attnum,
                        )
                    )
                    known.add(column.name)
        return [by_name[k] for k in sorted(by_name)]


def _write_chunk(
    path: Path,
    columns: list[ColumnInfo],
    rows: list[tuple[Any, ...]],
    lsn: Lsn,
    truncate: bool = False,
    options: tuple[str, TableOptions] | None = None,
    key: Sequence[str] = (),
) -> None:
    """A part in the layout of batch/writer.py: op I rows at ``lsn`` (or one op T row). ``key``: the
    columns the table is matched by, where ±infinity is a bad value (not clamped)."""
    count = 1 if truncate else len(rows)
    lsns = pa.array([int(lsn)] * count, pa.int64())
    nulls = [None] * count
    data = metadata_columns(lsns, range(count), ["T" if truncate else "I"] * count, nulls, nulls, lsns, nulls)
    for index, column in enumerate(columns):
        values = [None] if truncate else [row[index] for row in rows]
        where, table_options = options if options is not None else (path.parent.name, DEFAULT_OPTIONS)
        data[column.name] = convert_snapshot_column(
            where,
            column.name,
            column.type_name,
            pa.array(values, pa.string()),
            table_options,
            int(lsn),
            key=column.name in key and table_options.mode != "append_only",
        )
    write_part_file(path, pa.table(data))


__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_ROWS_PER_BATCH",
    "MODES",
    "SnapshotRequest",
    "SnapshotVisibility",
    "TableSnapshotter",
    "describe_progress",
    "list_snapshot_requests",
    "pending_snapshot_requests",
    "read_snapshot_state",
    "request_table_snapshot",
    "write_snapshot_states",
]
