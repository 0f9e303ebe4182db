"""Writes assembled transactions into a batch directory as Parquet, in bounded memory.

Rows wait in per-table buffers; all buffers together hold at most ``part_rows`` rows. A full
budget flushes the largest buffer, and a change of a table's columns flushes that table's
buffer: each flush becomes one Parquet part file. Memory is bounded by ``part_rows`` whatever
the number of tables. Values are converted column-wise at flush
time (:mod:`airflow_provider_pgdecode.batch.values`).

The native extract's C twin of these buffers and part rules is ``capture/csrc/buffers.c`` and
``capture/csrc/parts.c``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_pgdecode.batch.badvalues import ClampedValue, StagedValues, stage_values
from airflow_provider_pgdecode.batch.format import (
    CHANGE_LSN,
    COMMIT_LSN,
    MESSAGE_LSN,
    MESSAGES_DIR,
    OLD,
    OP,
    PARQUET_OPTIONS,
    SEQ,
    XID,
    change_part_options,
    check_column_names,
    metadata_columns,
    quarantine_path,
    table_path,
)
from airflow_provider_pgdecode.batch.manifest import ColumnSummary, TableSummary
from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, TableOptions, options_for
from airflow_provider_pgdecode.batch.values import arrow_type
from airflow_provider_pgdecode.decoding.assembler import PreparedTransaction, Transaction
from airflow_provider_pgdecode.decoding.events import (
    HEARTBEAT_PREFIX,
    UNCHANGED_TOAST,
    Change,
    Message,
    RowImage,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, staging_io

DEFAULT_PART_ROWS = 100_000


def old_field_staged(name: str, key: Collection[str] | None) -> bool:
    """Whether the old image's column ``name`` is staged in ``_pg_old``, for a table whose key
    columns are ``key`` (``stage_values``' key). Under REPLICA IDENTITY FULL PostgreSQL logs the
    whole old row; the merge reads only the key from it when the table has a key of its own (a
    primary key, a replica identity index): the rest is not staged, so a value the pipeline
    cannot carry there (a BC date, an array of two dimensions) does not make the change a bad
    value. Every column is staged when the key is all of them (merged as a multiset), when it is
    not known here, or for an ``append_only`` table (empty key: never matched); and ``key`` is
    ``None`` for a table whose old image is its key alone (:meth:`BatchWriter.old_image_key`)."""
    return not key or name in key


class _TableBuffer:
    """The rows of one table waiting to be written, plus the table's running totals."""

    def __init__(
        self,
        schema: str,
        table: str,
        directory: Path,
        part_rows: int,
        options: TableOptions = DEFAULT_OPTIONS,
        key: Collection[str] | None = None,
        old_key: Collection[str] | None = None,
    ) -> None:
        self.schema = schema
        self.table = table
        self.options = options
        self.key = key  # the key columns (stage_values' key); None: unknown here
        self.old_key = old_key  # the old image's columns staged (old_field_staged); None: all
        #: per column, the first ±infinity staged clamped while the key was unknown
        self.clamped: dict[str, ClampedValue] = {}
        self.relpath = table_path(schema, table)
        self.directory = directory / self.relpath
        self.quarantine_relpath = quarantine_path(schema, table)
        self.quarantine_directory = directory / self.quarantine_relpath
        self.quarantine_files: list[str] = []
        self.quarantined = 0
        self.part_rows = part_rows
        self.files: list[str] = []
        # current part
        self.names: tuple[str, ...] | None = None
        self.types: tuple[str, ...] | None = None
        self.values: list[tuple[Any, ...] | None] = []
        # per row: (commit_lsn, seq, op, xid, commit_time, change_lsn, unchanged_toast, old image)
        self.meta: list[tuple[int, int, str, int | None, datetime | None, int, list[str] | None, RowImage | None]] = []
        # totals
        self.counts = {"I": 0, "U": 0, "D": 0, "T": 0}
        self.min_commit: int | None = None
        self.max_commit = 0
        self.all_columns: dict[str, str] = {}
        self.append_only = False

    def add(
        self, txn: Transaction, seq: int, op: str, change_lsn: int, old: RowImage | None, new: RowImage | None
    ) -> None:
        if new is not None:
            if new.names != self.names or new.types != self.types:
                if self.names is not None:
                    self.flush()
                self._check_names(new.names)
                self.names, self.types = new.names, new.types
            values = new.values
            toast = None
            if UNCHANGED_TOAST in values:
                toast = [n for n, v in zip(new.names, values) if v is UNCHANGED_TOAST]
                values = tuple(None if v is UNCHANGED_TOAST else v for v in values)
            self.values.append(values)
        else:
            self.values.append(None)
            toast = None
        commit = int(txn.commit_lsn)
        self.meta.append((commit, seq, op, txn.xid, txn.commit_time, change_lsn, toast, old))
        self.counts[op] += 1
        if self.min_commit is None:
            self.min_commit = commit
        self.max_commit = commit

    def _check_names(self, names: tuple[str, ...]) -> None:
        check_column_names(self.schema, self.table, names)

    def flush(self) -> None:
        if not self.meta:
            return
        commit, seq, ops, xids, times, change_lsn, toast, olds = zip(*self.meta)
        columns = metadata_columns(commit, seq, ops, xids, times, change_lsn, toast)
        new: list[tuple[str, str, pa.Array]] = []
        names = self.names or ()
        types = self.types or ()
        if names:
            nulls = (None,) * len(names)
            rows = [v if v is not None else nulls for v in self.values]
            for name, pg_type, column in zip(names, types, zip(*rows)):
                new.append((name, pg_type, pa.array(column, pa.string())))
                self.all_columns[name] = pg_type
        old_fields, has_old = self._old_fields(olds)  # after the values: new-tuple columns come first
        staged = stage_values(self.schema, self.table, self.options, columns, new, old_fields, has_old, self.key)
        for name, value in staged.clamped.items():
            self.clamped.setdefault(name, value)
        if staged.keep is not None:
            columns = {name: pc.filter(array, staged.keep) for name, array in columns.items()}
            has_old = [h for h, k in zip(has_old, staged.keep.to_pylist()) if k]
            self._quarantine(staged)
        n = len(columns[COMMIT_LSN])
        values = dict(staged.values)
        old = self._old_struct(n, old_fields, staged.old, has_old)
        if old is not None:
            columns[OLD] = old
            # A part of only DELETEs has no new tuple: its columns are null, but present.
            for child in old.type:
                if child.name not in values:
                    values[child.name] = pa.nulls(n, child.type)
        columns.update(values)
        self.values.clear()
        self.meta.clear()
        if n == 0:
            return  # every change of the part was quarantined
        table = pa.table(columns)
        file_name = f"part-{len(self.files):05d}.parquet"
        with staging_io(self.directory / file_name, "write Parquet part"):
            self.directory.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, self.directory / file_name, **change_part_options(table.schema))
        self.files.append(file_name)

    def _quarantine(self, staged: StagedValues) -> None:
        """Write the part's quarantined changes; they leave the table's counts."""
        assert staged.quarantine is not None
        self.quarantine_files.append(write_quarantine_part(self.quarantine_directory, self.quarantine_files, staged))
        self.quarantined += staged.quarantine.num_rows
        for op, count in staged.quarantined_ops.items():
            self.counts[op] -= count

    def _old_fields(self, images: tuple[RowImage | None, ...]) -> tuple[list[tuple[str, str, pa.Array]], list[bool]]:
        """The old image's fields as text columns (sorted as the native path sorts them), and
        which rows have an old image."""
        field_types: dict[str, str] = {}
        for image in images:
            if image is not None:
                for name, pg_type in zip(image.names, image.types):
                    if old_field_staged(name, self.old_key):
                        field_types.setdefault(name, pg_type)
        for name, pg_type in field_types.items():
            # A table with only DELETEs in this batch still lists its key columns.
            self.all_columns.setdefault(name, pg_type)
        has_old = [image is not None for image in images]
        if not field_types:
            return [], has_old
        order = {name: i for i, name in enumerate(self.names or ())}
        field_names = sorted(field_types, key=lambda n: (order.get(n, len(order)), n))
        dicts = [None if image is None else image.as_dict() for image in images]
        fields = []
        for name in field_names:
            column = [None if d is None else d.get(name) for d in dicts]
            # The old image never carries unchanged-TOAST marks in practice; if it did, the
            # value is unknown: stage NULL rather than a placeholder.
            column = [None if v is UNCHANGED_TOAST else v for v in column]
            fields.append((name, field_types[name], pa.array(column, pa.string())))
        return fields, has_old

    def _old_struct(
        self, n: int, fields: list[tuple[str, str, pa.Array]], children: list[pa.Array], has_old: list[bool]
    ) -> pa.Array | None:
        if not fields:
            if not self.names:
                return None  # a part of TRUNCATE rows only: Parquet cannot hold an empty struct
            # No old images in this part: a null struct shaped like the row keeps the schema stable.
            names, types = self.names, self.types or ()
            staging = self.options.staging
            return pa.nulls(n, pa.struct([(nm, arrow_type(t, staging)) for nm, t in zip(names, types)]))
        mask = pa.array([not h for h in has_old], pa.bool_())
        return pa.StructArray.from_arrays(children, names=[name for name, _, _ in fields], mask=mask)

    def summary(self) -> TableSummary:
        return TableSummary(
            schema=self.schema,
            table=self.table,
            path=self.relpath,
            files=list(self.files),
            rows=sum(self.counts.values()),
            inserts=self.counts["I"],
            updates=self.counts["U"],
            deletes=self.counts["D"],
            truncates=self.counts["T"],
            min_commit_lsn=str(Lsn(self.min_commit or 0)),
            max_commit_lsn=str(Lsn(self.max_commit)),
            columns=[
                ColumnSummary(n, t, str(arrow_type(t, self.options.staging))) for n, t in self.all_columns.items()
            ],
        )

    def quarantine_entry(self) -> dict[str, Any] | None:
        """The manifest's entry of this table's quarantine parts (``None``: none)."""
        return quarantine_entry(self.schema, self.table, self.quarantine_files, self.quarantined)


def write_quarantine_part(directory: Path, files: list[str], staged: StagedValues) -> str:
    """Write a part's quarantined changes as the next quarantine part; returns its file name."""
    assert staged.quarantine is not None
    directory.mkdir(parents=True, exist_ok=True)
    file_name = f"part-{len(files):05d}.parquet"
    pq.write_table(staged.quarantine, directory / file_name, **PARQUET_OPTIONS)
    return file_name


def quarantine_entry(schema: str, table: str, files: list[str], rows: int) -> dict[str, Any] | None:
    """A table's entry in the manifest's ``quarantine`` list (docs/staging-format.md)."""
    if not files:
        return None
    return {
        "schema": schema,
        "table": table,
        "path": quarantine_path(schema, table),
        "files": list(files),
        "rows": rows,
    }


def no_tuple_data_error(change: Change, identity: str | None = None) -> CatalogError:
    """The error for ``(no-tuple-data)``: PostgreSQL logged no key for the changed row.

    ``identity`` is the table's replica identity as the catalog states it now
    (:meth:`SourceTable.describe_identity`), e.g. ``REPLICA IDENTITY DEFAULT and no primary key``.
    """
    now = (
        f"The table has {identity} now"
        if identity is not None
        else "The table's replica identity is unknown (it was not found in the catalog)"
    )
    return CatalogError(
        f"{change.operation.name} on {change.schema}.{change.table} at LSN {change.lsn} carries no row "
        f"data: PostgreSQL logged no key for the changed row, so it cannot be matched in Delta. {now}. "
        "Give the table a key for later changes (a primary key under REPLICA IDENTITY DEFAULT, or ALTER TABLE "
        "... REPLICA IDENTITY FULL); a change logged without one stays so: leave the table out (exclude_tables, "
        "or the tables option) past this LSN and resnapshot it afterwards (the backfill DAG's mode 'resnapshot')"
    )


def append_only_error(schema: str, table: str, operation: str, lsn: object) -> CatalogError:
    """An UPDATE or DELETE of a table loaded ``append_only``: an append cannot apply it."""
    return CatalogError(
        f"{operation} on {schema}.{table} at LSN {lsn}: the table is loaded append_only (table_options), which "
        "only appends inserts, so this change cannot reach Delta. Nothing was staged and the slot did not move. "
        "Ways forward: if the table is not insert-only, load it with mode 'merge' (give it a primary key, or "
        "ALTER TABLE ... REPLICA IDENTITY FULL) and resnapshot it (the backfill DAG's mode 'resnapshot'); or "
        "leave it out of the pipeline with exclude_tables"
    )


def check_append_only(directory: str | os.PathLike[str], tables: list[TableSummary]) -> None:
    """Refuse a staged batch in which an ``append_only`` table has UPDATEs or DELETEs (the native
    reader stages them without asking), naming the first one's LSN."""
    for summary in tables:
        if summary.mode != "append_only" or not (summary.updates or summary.deletes):
            continue
        for name in summary.files:
            part = pq.read_table(Path(directory) / summary.path / name, columns=[OP, CHANGE_LSN])
            for op, lsn in zip(part.column(OP).to_pylist(), part.column(CHANGE_LSN).to_pylist()):
                if op in ("U", "D"):
                    operation = "UPDATE" if op == "U" else "DELETE"
                    raise append_only_error(summary.schema, summary.table, operation, Lsn(lsn))


class BatchWriter:
    """Stages transactions and messages into ``directory``.

    :param include: which tables to stage (``include(schema, table)``); others are counted
        as skipped. Default: every table.
    :param part_rows: rows buffered in memory (all tables together) before the largest
        table's rows are written as a Parquet part.
    :param table_options: per-table options by ``(schema, table)``; others take the defaults.
    :param identities: each table's replica identity as the catalog states it, by
        ``(schema, table)``, for the error about a change without row data.
    :param keys: each table's key columns (:meth:`Catalog.table_key`) by ``(schema, table)``, as
        the catalog stated them when the extract began: ``infinity`` / ``-infinity`` in a date or
        timestamp key column is a bad value (``on_bad_value`` applies), never clamped into another
        key. A table not in it (``keys`` not given, a table created or renamed since) is staged
        with them clamped and named in :meth:`clamped_values`, for the check once its key is known.
    :param whole_row_old: the tables whose old image is the whole row (REPLICA IDENTITY FULL), by
        ``(schema, table)``; ``None``: not known, every table taken as one (:meth:`old_image_key`).
    :param partitions: the partitions of partitioned tables, by ``(schema, table)``: their
        TRUNCATEs are not staged (they would empty the root's whole Delta table; the extract finds
        them in the catalog and resnapshots the root: capture/partitions.py), only counted.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        include: Callable[[str, str], bool] | None = None,
        part_rows: int = DEFAULT_PART_ROWS,
        *,
        table_options: Mapping[tuple[str, str], TableOptions] | None = None,
        identities: Mapping[tuple[str, str], str] | None = None,
        keys: Mapping[tuple[str, str], Collection[str]] | None = None,
        whole_row_old: Collection[tuple[str, str]] | None = None,
        partitions: Collection[tuple[str, str]] = (),
    ) -> None:
        self.directory = Path(directory)
        self.partitions = set(partitions)
        self.partition_truncates = 0
        self.whole_row_old = None if whole_row_old is None else set(whole_row_old)
        self.identities = dict(identities or {})
        self.keys = dict(keys or {})
        self.include = include
        self.part_rows = part_rows
        self.table_options = dict(table_options or {})
        self._tables: dict[tuple[str, str], _TableBuffer] = {}
        self._excluded: set[tuple[str, str]] = set()
        self.skipped_changes = 0
        self.transactions = 0
        self.changes = 0
        self._messages: list[tuple[int, int | None, int | None, int | None, bool, str, bytes]] = []
        self._message_files: list[str] = []
        self._message_rows = 0
        self._buffered = 0  # rows in all table buffers
        #: The manifest's ``quarantine`` entries, set by :meth:`close`.
        self.quarantine: list[dict[str, Any]] = []

    def _flush_largest(self) -> None:
        largest = max(self._tables.values(), key=lambda b: len(b.meta))
        largest.flush()
        self._buffered = sum(len(b.meta) for b in self._tables.values())

    def _buffer(self, schema: str, table: str) -> _TableBuffer | None:
        key = (schema, table)
        buffer = self._tables.get(key)
        if buffer is None:
            if key in self._excluded:
                return None
            if self.include is not None and not self.include(schema, table):
                self._excluded.add(key)
                return None
            options = options_for(self.table_options, schema, table)
            buffer = self._tables[key] = _TableBuffer(
                schema,
                table,
                self.directory,
                self.part_rows,
                options,
                self.staging_key(schema, table, options),
                self.old_image_key(schema, table, options),
            )
            buffer.append_only = buffer.options.mode == "append_only"
        return buffer

    def skips_truncate(self, schema: str, table: str) -> bool:
        """Whether a TRUNCATE of this table is left out: a partition's (counted)."""
        if (schema, table) not in self.partitions:
            return False
        self.partition_truncates += 1
        return True

    def staging_key(self, schema: str, table: str, options: TableOptions) -> Collection[str] | None:
        """The key columns checked at staging (``stage_values``' ``key``): none for a table loaded
        ``append_only`` (appended, never matched), ``None`` for a table whose key is not known."""
        if options.mode == "append_only":
            return ()
        return self.keys.get((schema, table))

    def old_image_key(self, schema: str, table: str, options: TableOptions) -> Collection[str] | None:
        """The key the old image's columns are staged by (:func:`old_field_staged`): ``None``
        (every column) when the old image is the table's key alone (REPLICA IDENTITY DEFAULT or
        USING INDEX), under the names its columns had when the change was logged: a key column
        renamed since is still staged, and the merge reads it under its name now."""
        if self.whole_row_old is not None and (schema, table) not in self.whole_row_old:
            return None
        return self.staging_key(schema, table, options)

    def clamped_values(self) -> dict[tuple[str, str], dict[str, ClampedValue]]:
        """Per table whose key was not known at staging, per column, the first ±infinity staged
        clamped (after :meth:`close`)."""
        return {name: dict(buffer.clamped) for name, buffer in self._tables.items() if buffer.clamped}

    def add_transaction(self, txn: Transaction) -> None:
        staged = 0
        last_name: tuple[str, str] | None = None
        buffer: _TableBuffer | None = None
        for seq, item in enumerate(txn.items):
            kind = type(item)
            if kind is Change:
                name = (item.schema, item.table)  # type: ignore[union-attr]
                if name != last_name:
                    buffer = self._buffer(*name)
                    last_name = name
                if buffer is None:
                    self.skipped_changes += 1
                    continue
                if buffer.append_only and item.operation.value != "I":  # type: ignore[union-attr]
                    raise append_only_error(item.schema, item.table, item.operation.name, item.lsn)  # type: ignore[union-attr]
                if not item.has_tuple_data:  # type: ignore[union-attr]
                    raise no_tuple_data_error(item, self.identities.get(name))  # type: ignore[arg-type]
                buffer.add(txn, seq, item.operation.value, int(item.lsn), item.old, item.new)  # type: ignore[union-attr]
                staged += 1
                self._buffered += 1
                if self._buffered >= self.part_rows:
                    self._flush_largest()
            elif kind is Truncate:
                for schema, table in item.relations:  # type: ignore[union-attr]
                    if self.skips_truncate(schema, table):
                        continue
                    truncated = self._buffer(schema, table)
                    if truncated is None:
                        self.skipped_changes += 1
                        continue
                    truncated.add(txn, seq, "T", int(item.lsn), None, None)
                    staged += 1
                    self._buffered += 1
                    if self._buffered >= self.part_rows:
                        self._flush_largest()
            elif kind is Message:
                self._add_message(item, txn.commit_lsn, seq, txn.xid)  # type: ignore[arg-type]
        if staged:
            self.transactions += 1
            self.changes += staged

    def add_message(self, message: Message) -> None:
        """A non-transactional message."""
        self._add_message(message, None, None, message.xid)

    def _add_message(self, message: Message, commit_lsn: Lsn | None, seq: int | None, xid: int | None) -> None:
        if message.prefix == HEARTBEAT_PREFIX:
            return  # pgdecode's own: not the source's, and no reason to run a merge
        self._messages.append(
            (
                int(message.lsn),
                None if commit_lsn is None else int(commit_lsn),
                seq,
                xid,
                message.transactional,
                message.prefix,
                message.content,
            )
        )
        if len(self._messages) >= self.part_rows:
            self._flush_messages()

    def _flush_messages(self) -> None:
        if not self._messages:
            return
        lsn, commit, seq, xid, transactional, prefix, content = zip(*self._messages)
        table = pa.table(
            {
                MESSAGE_LSN: pa.array(lsn, pa.int64()),
                COMMIT_LSN: pa.array(commit, pa.int64()),
                SEQ: pa.array(seq, pa.int32()),
                XID: pa.array(xid, pa.int64()),
                "transactional": pa.array(transactional, pa.bool_()),
                "prefix": pa.array(prefix, pa.string()),
                "content": pa.array(content, pa.binary()),
            }
        )
        directory = self.directory / MESSAGES_DIR
        name = f"part-{len(self._message_files):05d}.parquet"
        with staging_io(directory / name, "write Parquet part"):
            directory.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, directory / name, **PARQUET_OPTIONS)
        self._message_files.append(name)
        self._message_rows += len(self._messages)
        self._messages.clear()

    def save_prepared(self, prepared: list[PreparedTransaction]) -> list[dict[str, Any]]:
        """Write pending prepared transactions' items to ``prepared/``; return their manifest entries."""
        entries = []
        if prepared:
            with staging_io(self.directory / "prepared", "create directory"):
                (self.directory / "prepared").mkdir(exist_ok=True)
        for txn in prepared:
            digest = hashlib.sha1(txn.gid.encode("utf-8")).hexdigest()[:16]
            relpath = f"prepared/{txn.xid}-{digest}.jsonl.gz"
            count = txn.items.save(self.directory / relpath)  # raises StagingError itself
            entries.append({**txn.header(), "items": count, "path": relpath})
        return entries

    def close(self) -> tuple[list[TableSummary], dict[str, Any] | None]:
        """Flush everything; return the table summaries (sorted by name) and the messages entry."""
        for buffer in self._tables.values():
            buffer.flush()
        self._flush_messages()
        tables = [b.summary() for _, b in sorted(self._tables.items()) if b.files]
        self.quarantine = [e for _, b in sorted(self._tables.items()) if (e := b.quarantine_entry()) is not None]
        messages = (
            {"path": MESSAGES_DIR, "files": self._message_files, "rows": self._message_rows}
            if self._message_files
            else None
        )
        return tables, messages
