"""Reading and checking staged batches (docs/staging-format.md, ``pgdecode.batch/1``) for the merge.

Only the manifest and the table files listed in it are read; ``prepared/`` (transactions still
pending) and ``messages/`` are never touched by the merge. Pure Python: no Spark needed.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import quote, urlparse

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError

BATCH_FORMAT = "pgdecode.batch/1"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class SourceColumn:
    """One source column as the manifest describes it."""

    name: str
    catalog_type: str
    arrow: str | None = None
    user_type: str | None = None
    """``enum``, ``domain``, ... for a user-defined type (staged as text); ``None`` if built in."""


@dataclass(frozen=True)
class StagedTable:
    """One source table's part of a batch."""

    schema: str
    table: str
    directory: str
    files: tuple[str, ...]
    rows: int
    key: tuple[str, ...]
    columns: tuple[SourceColumn, ...]
    min_commit_lsn: Lsn | None
    max_commit_lsn: Lsn | None
    truncates: int = 0
    replica_identity: str | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    def column(self, name: str) -> SourceColumn | None:
        for column in self.columns:
            if column.name == name:
                return column
        return None


@dataclass(frozen=True)
class Batch:
    """A complete staged batch: its LSN range and its tables."""

    directory: str
    slot: str
    start_lsn: Lsn
    end_lsn: Lsn
    tables: tuple[StagedTable, ...]
    plugin: str | None = None
    database: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.slot}:{self.start_lsn}-{self.end_lsn}"


def is_local(path: str) -> bool:
    """True for a plain filesystem path or a ``file:`` URI."""
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _local(path: str) -> str:
    return urlparse(path).path if path.startswith("file:") else path


class LocalFiles:
    """Batch file access on the local filesystem (the default)."""

    def read_text(self, path: str) -> str:
        with open(_local(path), encoding="utf-8") as handle:
            return handle.read()

    def exists(self, path: str) -> bool:
        return os.path.isfile(_local(path))


def join(base: str, *parts: str) -> str:
    """Join path components of a local path or a URI with ``/``."""
    return posixpath.join(base.rstrip("/"), *parts)


def _lsn(value: Any, what: str, where: str) -> Lsn:
    try:
        return Lsn.coerce(value)
    except (TypeError, ValueError) as error:
        raise BatchError(f"{where}: {what} is not an LSN ({value!r}): {error}") from None


def _require(mapping: dict[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise BatchError(f"{where}: manifest has no {key!r}; the batch is incomplete or not a {BATCH_FORMAT} batch")
    return mapping[key]


def _table_entry(entry: dict[str, Any], batch_dir: str, files: Any, where: str) -> StagedTable:
    schema = _require(entry, "schema", where)
    table = _require(entry, "table", where)
    where = f"{where} table {schema}.{table}"
    relative = entry.get("path") or f"tables/{quote(schema, safe='')}/{quote(table, safe='')}"
    if relative.startswith("/") or ".." in relative.split("/"):
        raise BatchError(f"{where}: table path {relative!r} leaves the batch directory")
    names = _require(entry, "files", where)
    if not isinstance(names, list) or not all(isinstance(n, str) and n and "/" not in n for n in names):
        raise BatchError(f"{where}: 'files' must be a list of file names, got {names!r}")
    directory = join(batch_dir, relative)
    paths = tuple(join(directory, name) for name in names)
    missing = [p for p in paths if not files.exists(p)]
    if missing:
        raise BatchError(f"{where}: {len(missing)} file(s) listed in the manifest are missing: {missing[:5]}")
    columns = tuple(
        SourceColumn(
            name=_require(column, "name", where),
            catalog_type=column.get("catalog_type") or _require(column, "type", where),
            arrow=column.get("arrow"),
            user_type=column.get("user_type"),
        )
        for column in _require(entry, "columns", where)
    )
    key = tuple(entry.get("key") or ())
    rows = int(entry.get("rows", 0))
    min_lsn = entry.get("min_commit_lsn")
    max_lsn = entry.get("max_commit_lsn")
    return StagedTable(
        schema=schema,
        table=table,
        directory=directory,
        files=paths,
        rows=rows,
        key=key,
        columns=columns,
        min_commit_lsn=_lsn(min_lsn, "min_commit_lsn", where) if min_lsn is not None else None,
        max_commit_lsn=_lsn(max_lsn, "max_commit_lsn", where) if max_lsn is not None else None,
        truncates=int(entry.get("truncates", 0)),
        replica_identity=entry.get("replica_identity"),
    )


def read_batch(directory: str, files: Any | None = None) -> Batch:
    """Read and check one batch directory; raise :class:`BatchError` saying what is wrong."""
    files = files or LocalFiles()
    manifest_path = join(directory, MANIFEST_NAME)
    if not files.exists(manifest_path):
        raise BatchError(
            f"batch {directory}: no {MANIFEST_NAME}; it is not a complete batch (batches are renamed into "
            f"place only when complete: re-run the extract for this LSN range)"
        )
    try:
        manifest = json.loads(files.read_text(manifest_path))
    except ValueError as error:
        raise BatchError(f"batch {directory}: {MANIFEST_NAME} is not valid JSON: {error}") from None
    where = f"batch {directory}"
    if not isinstance(manifest, dict):
        raise BatchError(f"{where}: {MANIFEST_NAME} is not a JSON object")
    if manifest.get("format") != BATCH_FORMAT:
        raise BatchError(f"{where}: format is {manifest.get('format')!r}, this job reads {BATCH_FORMAT!r}")
    if manifest.get("complete") is not True:
        raise BatchError(f"{where}: manifest does not say \"complete\": true; refusing a partial batch")
    start = _lsn(_require(manifest, "start_lsn", where), "start_lsn", where)
    end = _lsn(_require(manifest, "end_lsn", where), "end_lsn", where)
    if end < start:
        raise BatchError(f"{where}: end_lsn {end} is before start_lsn {start}")
    tables = tuple(_table_entry(entry, directory, files, where) for entry in _require(manifest, "tables", where))
    return Batch(
        directory=directory,
        slot=str(_require(manifest, "slot", where)),
        start_lsn=start,
        end_lsn=end,
        tables=tables,
        plugin=manifest.get("plugin"),
        database=manifest.get("database"),
        manifest=manifest,
    )


def read_batches(directories: Iterable[str], files: Any | None = None) -> list[Batch]:
    """Read every batch and return them in LSN order; all must come from one slot."""
    batches = [read_batch(directory, files) for directory in directories]
    if not batches:
        raise BatchError("no batch given")
    slots = sorted({batch.slot for batch in batches})
    if len(slots) > 1:
        raise BatchError(f"batches of different slots cannot be merged in one run: {slots}")
    return sorted(batches, key=lambda batch: (batch.start_lsn, batch.end_lsn, batch.directory))
