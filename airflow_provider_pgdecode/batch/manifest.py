"""The manifest of a staged batch: written last (the batch's commit marker), read and checked by
every reader: the extract, reconciliation, the operators and the Spark job alike
(format: docs/staging-format.md)."""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from airflow_provider_pgdecode.batch.format import (
    BATCH_NAME,
    FORMAT,
    MANIFEST_NAME,
    batch_dir_name,
    table_path,
)
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError, StagingError, staging_io

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "BatchManifest",
    "ColumnSummary",
    "TableSummary",
    "batch_dir_name",
    "list_batches",
    "read_batches",
    "table_path",
]


@dataclass
class ColumnSummary:
    name: str
    type: str
    arrow: str
    catalog_type: str | None = None
    #: enum, domain, composite, range or multirange for user-defined types (None: built in).
    user_type: str | None = None
    #: Added with a default (``ADD COLUMN ... DEFAULT``): the value PostgreSQL shows in rows written
    #: before it (``attmissingval``), as staged, in JSON form (:func:`~airflow_provider_pgdecode.batch.values.json_value`).
    #: Absent: none.
    missing: Any = None
    #: The column's attribute number (``pg_attribute.attnum``) when the extract described the
    #: batch; ``None`` for a name no longer live (dropped, or renamed since its changes): how the
    #: merge follows a renamed column.
    attnum: int | None = None

    @property
    def source_type(self) -> str:
        """The catalog type (``format_type`` with modifiers) when known, else the decoded type name."""
        return self.catalog_type or self.type


@dataclass
class TableSummary:
    schema: str
    table: str
    path: str
    files: list[str]
    rows: int
    inserts: int
    updates: int
    deletes: int
    truncates: int
    min_commit_lsn: str
    max_commit_lsn: str
    columns: list[ColumnSummary]
    key: list[str] = field(default_factory=list)
    replica_identity: str | None = None
    #: Where the key comes from (``Catalog.table_key``): ``primary key``, ``replica identity index``
    #: or ``all columns`` (no key: merged as a multiset); None when unknown (older manifests, or
    #: an ``append_only`` table without a key).
    key_source: str | None = None
    #: ``merge``, ``append_only``, ``history`` or ``soft_delete`` (``table_options`` mode); older
    #: manifests are ``merge``.
    mode: str = "merge"
    #: The source table's OID (``pg_class.oid``); ``None`` in batches staged before it was recorded.
    oid: int | None = None
    #: ``[schema, table]`` of the Delta table these changes flow into when it is not the staged
    #: name (a renamed source table keeps its Delta table, docs/merge.md); ``None``: the staged name.
    delta_table: list[str] | None = None
    #: Snapshot batches (``capture/snapshot.py``, ``pgdecode.snapshot/3``): the ``files`` that hold
    #: only the snapshot's rows (op ``I``, commit LSN = the batch's end LSN, no old image), the
    #: TRUNCATE row being in a part of its own. Their columns are staged with the types Delta
    #: keeps (bounded ``numeric`` as ``decimal128``), so a merge that creates the Delta table may
    #: commit these files into its log as they are (docs/merge.md, "Initial load"). ``None``
    #: (absent from the file): any other batch, or a snapshot staged before this existed.
    snapshot_files: list[str] | None = None
    #: Snapshot batches: per column, the numeric ``NaN``/``Infinity`` values staged as null in a
    #: column staged as ``decimal128`` (a decimal cannot hold them). Absent: none.
    numeric_specials: dict[str, int] = field(default_factory=dict)
    #: Generated columns of the source table the slot did not send, so not staged (pgoutput sends
    #: stored ones only with publish_generated_columns = stored, PostgreSQL 18; virtual ones never).
    #: Absent: none.
    generated_not_staged: list[str] | None = None
    #: The table's ``type_map`` option when its changes were staged: types kept as the text
    #: PostgreSQL printed (``{"numeric": "string"}``), which the merge keeps as ``string``.
    #: Absent: none.
    type_map: dict[str, str] = field(default_factory=dict)
    #: The table's directory once read from a batch (not stored in the file).
    location: str | None = field(default=None, compare=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def keyed_by_all_columns(self) -> bool:
        """Whether the table has no key of its own: every column identifies a row (REPLICA IDENTITY
        FULL without a primary key or replica identity index), so it is merged as a multiset.
        Manifests written before ``key_source`` existed: a FULL table whose key is all its columns."""
        if self.key_source is not None:
            return self.key_source == "all columns"
        return self.replica_identity == "full" and bool(self.key) and set(self.key) == {c.name for c in self.columns}

    @property
    def target(self) -> tuple[str, str]:
        """``(schema, table)`` of the Delta table the changes flow into."""
        if self.delta_table:
            schema, table = self.delta_table
            return schema, table
        return self.schema, self.table

    @property
    def file_paths(self) -> list[str]:
        """Full paths of the table's Parquet parts (the table must have been read from a batch)."""
        if self.location is None:
            raise StagingError(f"table {self.qualified_name} was not read from a batch directory")
        return [posixpath.join(self.location, name) for name in self.files]

    @property
    def min_commit(self) -> Lsn | None:
        return Lsn.parse(self.min_commit_lsn) if self.min_commit_lsn else None

    @property
    def max_commit(self) -> Lsn | None:
        return Lsn.parse(self.max_commit_lsn) if self.max_commit_lsn else None

    def column(self, name: str) -> ColumnSummary | None:
        return next((c for c in self.columns if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("location")
        # Written only when set: every other batch's manifest stays byte for byte as before.
        if data["snapshot_files"] is None:
            data.pop("snapshot_files")
        if not data["numeric_specials"]:
            data.pop("numeric_specials")
        if data["generated_not_staged"] is None:
            data.pop("generated_not_staged")
        if not data["type_map"]:
            data.pop("type_map")
        for column in data["columns"]:
            if column["missing"] is None:
                column.pop("missing")
            if column["attnum"] is None:
                column.pop("attnum")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableSummary:
        data = dict(data)
        data["columns"] = [ColumnSummary(**c) for c in data["columns"]]
        return cls(**data)


@dataclass
class BatchManifest:
    """What one staged batch holds. ``end_lsn`` is where the slot may be advanced once merged."""

    slot: str
    plugin: str
    database: str
    start_lsn: str
    end_lsn: str
    ceiling_lsn: str
    transactions: int
    changes: int
    tables: list[TableSummary]
    messages: dict[str, Any] | None = None
    prepared_pending: list[dict[str, Any]] = field(default_factory=list)
    prepared_committed: list[dict[str, Any]] = field(default_factory=list)
    prepared_rolled_back: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    #: Table snapshot chunks staged in this batch (capture/table_snapshot.py).
    snapshot_chunks: list[dict[str, Any]] = field(default_factory=list)
    #: Progress of every table snapshot request once this batch is merged (for the checkpoint).
    snapshots: dict[str, Any] = field(default_factory=dict)
    #: Quarantine parts per table (``schema``, ``table``, ``path``, ``files``, ``rows``): changes
    #: holding a value the table's ``on_bad_value: quarantine`` kept out of its table part.
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    #: ``schema.table`` of tables outside the extract's table list that had changes in the range
    #: (their changes are counted in ``skipped["excluded_table_changes"]``, not staged).
    excluded_tables: list[str] = field(default_factory=list)
    #: The tables this slot's batches have staged, by OID (as a string): ``names`` (every
    #: ``[schema, table]`` the table was seen under, oldest first) and ``delta_table`` (where its
    #: changes flow). Carried from batch to batch so that a renamed table is followed.
    table_oids: dict[str, Any] = field(default_factory=dict)
    #: Which batch bound ended the batch before its ceiling (``"changes"`` or ``"wal_bytes"``,
    #: capture/bounds.py); ``None``: it read up to the ceiling, the slot was caught up.
    bounded_by: str | None = None
    #: Where a second decoding session began (capture/sessions.py: the range above it was
    #: decoded over a temporary copy of the slot, at the same time); ``None``: one session.
    decode_split: str | None = None
    #: Rows the server sent per change of the batch's transactions, up to its end (a batch without
    #: changes carries the previous batch's; None: none known): the next batch's row limit is
    #: sized by it (capture/bounds.py).
    rows_per_change: float | None = None
    #: Bytes of WAL from the batch's start to its end per change it staged (carried as
    #: ``rows_per_change`` is): the next batch places its second decoding session by it
    #: (capture/sessions.py).
    wal_bytes_per_change: float | None = None
    #: ``host:port`` of the PostgreSQL server the batch was read from, as the extract connected
    #: to it (None in batches staged before it was recorded): its tables' lineage namespace.
    server: str | None = None
    format: str = FORMAT
    complete: bool = True
    #: Where the batch lives, an absolute local path or an ``s3://`` URI (not stored in the file).
    path: str | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return batch_dir_name(self.start, self.end)

    @property
    def label(self) -> str:
        """``slot:start-end``, how logs and the merge summary name a batch."""
        return f"{self.slot}:{self.start_lsn}-{self.end_lsn}"

    @property
    def start(self) -> Lsn:
        return Lsn.parse(self.start_lsn)

    @property
    def end(self) -> Lsn:
        return Lsn.parse(self.end_lsn)

    @property
    def directory(self) -> str:
        return str(self.path) if self.path is not None else ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, tables=[]))  # each table by its own to_dict, converted once
        data.pop("path")
        data["tables"] = [t.to_dict() for t in self.tables]
        return data

    def contents(self) -> dict[str, Any]:
        """What the batch holds, without how it was read (the ceiling and read statistics):
        two extracts of one LSN range with different ceilings stage the same contents."""
        data = self.to_dict()
        data.pop("ceiling_lsn")
        data.pop("skipped")
        data.pop("bounded_by")
        data.pop("rows_per_change")
        data.pop("wal_bytes_per_change")
        return data

    def summary(self) -> dict[str, Any]:
        """A short JSON-able description (what the extract task returns to XCom)."""
        return {
            "slot": self.slot,
            "path": str(self.path) if self.path else None,
            "start_lsn": self.start_lsn,
            "end_lsn": self.end_lsn,
            "transactions": self.transactions,
            "changes": self.changes,
            "tables": {t.qualified_name: t.rows for t in self.tables},
            "prepared_pending": [{"gid": p["gid"], "xid": p["xid"]} for p in self.prepared_pending],
            "quarantined": {f"{q['schema']}.{q['table']}": q["rows"] for q in self.quarantine},
            "bounded_by": self.bounded_by,
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        target = Path(directory) / MANIFEST_NAME
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)
        with staging_io(target, "write batch manifest"), open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        return target

    @classmethod
    def read(cls, location: str | os.PathLike[str] | Storage) -> BatchManifest:
        """Read and check a batch's manifest (a local directory or an ``s3://`` location); a
        missing, partial or inconsistent batch is a :class:`~airflow_provider_pgdecode.errors.BatchError`
        that names the batch and what is wrong."""
        store = as_storage(location)
        target = store.uri(MANIFEST_NAME)
        try:
            raw = store.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            raise BatchError(
                f"{store.root} is not a complete batch: {MANIFEST_NAME} is missing. The manifest is written last, "
                "so this directory was not written by pgdecode's extract, was interrupted, or was damaged: "
                "extract the range again."
            ) from None
        except StagingError as exc:
            raise BatchError(f"unreadable manifest {target}: {exc}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            raise BatchError(f"unreadable manifest {target}: {exc}") from None
        if not isinstance(data, dict):
            raise BatchError(f"malformed manifest {target}: a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise BatchError(f"{target}: unknown batch format {data.get('format')!r} (expected {FORMAT})")
        if data.get("complete") is not True:
            raise BatchError(f"{target}: the batch is marked incomplete; extract the range again")
        manifest = _from_dict(data, target)
        manifest.path = store.root
        _check(manifest, store)
        return manifest


def _from_dict(data: dict[str, Any], target: str) -> BatchManifest:
    try:
        tables = data["tables"]
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise TypeError("'tables' must be a list of objects")
        manifest = BatchManifest(**{**data, "tables": [TableSummary.from_dict(t) for t in tables]})
        start, end = manifest.start, manifest.end
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise BatchError(f"malformed manifest {target} ({exc})") from None
    if end < start:
        raise BatchError(f"malformed manifest {target}: end_lsn {end} is before start_lsn {start}")
    return manifest


def _check(manifest: BatchManifest, store: Storage) -> None:
    """Table paths stay inside the batch, file lists are names, and every listed file exists
    (one listing of the batch, so a batch on object storage costs one request, not one per file)."""
    target = store.uri(MANIFEST_NAME)
    present = set(store.walk_files())
    missing: list[str] = []
    for table in manifest.tables:
        where = f"{target} table {table.qualified_name}"
        relative = table.path or table_path(table.schema, table.table)
        if relative.startswith("/") or ".." in relative.split("/"):
            raise BatchError(f"{where}: table path {relative!r} leaves the batch directory")
        if not all(isinstance(n, str) and n and "/" not in n for n in table.files):
            raise BatchError(f"{where}: 'files' must be a list of file names, got {table.files!r}")
        table.location = store.uri(relative)
        missing += [f"{relative}/{name}" for name in table.files if f"{relative}/{name}" not in present]
    if manifest.messages:
        missing += [
            f"{manifest.messages['path']}/{n}"
            for n in manifest.messages["files"]
            if f"{manifest.messages['path']}/{n}" not in present
        ]
    missing += [p["path"] for p in manifest.prepared_pending if p["path"] not in present]
    for entry in manifest.quarantine:
        relative = str(entry.get("path", ""))
        if relative.startswith("/") or ".." in relative.split("/"):
            raise BatchError(f"{target}: quarantine path {relative!r} leaves the batch directory")
        missing += [f"{relative}/{name}" for name in entry.get("files", []) if f"{relative}/{name}" not in present]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise BatchError(
            f"batch {store.root} is incomplete: missing {', '.join(missing[:5])}{more} (listed in its manifest, so "
            "removed or lost after the batch was staged). Restore the file(s) from a copy, or move the batch "
            "directory away and run the extract again, which stages the same LSN range anew as long as the slot "
            "was not advanced past it"
        )


def read_batches(directories: list[str] | tuple[str, ...]) -> list[BatchManifest]:
    """Read every batch and return them in LSN order; all must come from one slot."""
    batches = [BatchManifest.read(directory) for directory in directories]
    if not batches:
        raise BatchError("no batch given")
    slots = sorted({batch.slot for batch in batches})
    if len(slots) > 1:
        raise BatchError(f"batches of different slots cannot be merged in one run: {slots}")
    return sorted(batches, key=lambda batch: (batch.start, batch.end, batch.directory))


def list_batches(staging_root: str | os.PathLike[str] | Storage, slot: str) -> list[str]:
    """Locations of a slot's batches, in LSN order (temporary directories are ignored).

    On object storage only batches whose manifest is there count: the manifest is uploaded last,
    so a prefix without one is an upload cut short and does not exist for any reader. On a local
    disk a batch appears whole by a rename, so a directory with a batch's name and no manifest
    is a damaged batch, listed so that reading it reports the damage instead of skipping it.
    """
    store = as_storage(staging_root)
    return [
        store.uri(slot, name)
        for name, is_dir in store.list_dir(slot)
        if is_dir and BATCH_NAME.match(name) and (store.is_local or store.is_file(f"{slot}/{name}/{MANIFEST_NAME}"))
    ]
