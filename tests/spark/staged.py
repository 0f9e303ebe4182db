"""Writes synthetic staged batches exactly as docs/staging-format.md describes (pgdecode.batch/1),
and a reference model that applies the same changes row by row, to compute expected Delta states
independently of the merge job.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

UNCHANGED = object()
"""Marks an unchanged-TOAST value in :meth:`TableChanges.update`."""


def lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass
class Column:
    name: str
    catalog_type: str
    arrow: pa.DataType


@dataclass
class Change:
    op: str
    lsn: int
    seq: int
    xid: int
    new: dict[str, Any] | None
    old: dict[str, Any] | None
    toast: tuple[str, ...]


@dataclass
class Part:
    columns: list[Column]
    changes: list[Change] = field(default_factory=list)


class TableChanges:
    """The changes of one table in one batch, in commit order (the caller gives commit LSNs)."""

    def __init__(
        self,
        schema: str,
        table: str,
        columns: Sequence[tuple[str, str, pa.DataType]],
        key: Sequence[str] = ("id",),
        *,
        mode: str = "merge",
        replica_identity: str | None = None,
    ) -> None:
        self.schema = schema
        self.table = table
        self.key = list(key)
        self.mode = mode  # table_options mode, in the manifest unless "merge"
        self.replica_identity = replica_identity
        self.parts = [Part([Column(*c) for c in columns])]
        self._seq: dict[int, int] = {}

    @property
    def columns(self) -> list[Column]:
        return self.parts[-1].columns

    def _next_seq(self, lsn: int) -> int:
        seq = self._seq.get(lsn, 0)
        self._seq[lsn] = seq + 1
        return seq

    def _add(
        self, op: str, lsn: int, new: dict[str, Any] | None, old: dict[str, Any] | None, toast: Iterable[str] = ()
    ) -> TableChanges:
        self.parts[-1].changes.append(Change(op, lsn, self._next_seq(lsn), lsn // 16, new, old, tuple(toast)))
        return self

    def insert(self, lsn: int, **row: Any) -> TableChanges:
        return self._add("I", lsn, row, None)

    def update(self, lsn: int, old_key: dict[str, Any] | None = None, **row: Any) -> TableChanges:
        toast = [name for name, value in row.items() if value is UNCHANGED]
        new = {name: (None if value is UNCHANGED else value) for name, value in row.items()}
        return self._add("U", lsn, new, old_key, toast)

    def delete(self, lsn: int, **old_key: Any) -> TableChanges:
        return self._add("D", lsn, None, old_key)

    def truncate(self, lsn: int) -> TableChanges:
        return self._add("T", lsn, None, None)

    def alter(self, columns: Sequence[tuple[str, str, pa.DataType]]) -> TableChanges:
        """The table's columns change: later changes go to a new part file with these columns."""
        self.parts.append(Part([Column(*c) for c in columns]))
        return self

    # -- writing -------------------------------------------------------------------------------

    def arrow_table(self, part: Part) -> pa.Table:
        # The old key; a table without one has the whole old row (REPLICA IDENTITY FULL).
        key_fields = [pa.field(c.name, c.arrow) for c in part.columns if c.name in self.key or not self.key]
        schema = pa.schema(
            [
                pa.field("_pg_commit_lsn", pa.int64(), nullable=False),
                pa.field("_pg_seq", pa.int32(), nullable=False),
                pa.field("_pg_op", pa.string(), nullable=False),
                pa.field("_pg_xid", pa.int64()),
                pa.field("_pg_commit_time", pa.timestamp("us", tz="UTC")),
                pa.field("_pg_change_lsn", pa.int64()),
                pa.field("_pg_unchanged_toast", pa.list_(pa.string())),
                pa.field("_pg_old", pa.struct(key_fields)),
            ]
            + [pa.field(c.name, c.arrow) for c in part.columns]
        )
        rows = []
        for change in part.changes:
            row: dict[str, Any] = {
                "_pg_commit_lsn": change.lsn,
                "_pg_seq": change.seq,
                "_pg_op": change.op,
                "_pg_xid": change.xid,
                "_pg_commit_time": datetime(2026, 11, 22, tzinfo=UTC).replace(microsecond=change.lsn % 1000),
                "_pg_change_lsn": change.lsn - 8 + change.seq,
                "_pg_unchanged_toast": list(change.toast) if change.op == "U" else [],
                "_pg_old": dict(change.old) if change.old is not None else None,
            }
            for column in part.columns:
                row[column.name] = (change.new or {}).get(column.name)
            rows.append(row)
        return pa.Table.from_pylist(rows, schema=schema)

    def manifest_entry(self, files: list[str]) -> dict[str, Any]:
        changes = [c for p in self.parts for c in p.changes]
        seen: dict[str, Column] = {}
        for part in self.parts:
            for column in part.columns:
                seen[column.name] = column
        latest = {c.name for c in self.parts[-1].columns}
        # The manifest lists the table's columns as of the batch end.
        columns = [seen[name] for name in seen if name in latest]
        lsns = [c.lsn for c in changes]
        return {
            "schema": self.schema,
            "table": self.table,
            "path": f"tables/{quote(self.schema, safe='')}/{quote(self.table, safe='')}",
            "files": files,
            "rows": len(changes),
            "inserts": sum(c.op == "I" for c in changes),
            "updates": sum(c.op == "U" for c in changes),
            "deletes": sum(c.op == "D" for c in changes),
            "truncates": sum(c.op == "T" for c in changes),
            "min_commit_lsn": lsn_text(min(lsns)) if lsns else None,
            "max_commit_lsn": lsn_text(max(lsns)) if lsns else None,
            "key": self.key,
            "replica_identity": self.replica_identity or ("default" if self.key else "nothing"),
            **({"mode": self.mode} if self.mode != "merge" else {}),
            "columns": [
                {"name": c.name, "type": c.catalog_type, "catalog_type": c.catalog_type, "arrow": str(c.arrow)}
                for c in columns
            ],
        }


def write_batch(
    root: Path | str,
    slot: str,
    start_lsn: int,
    end_lsn: int,
    tables: Sequence[TableChanges],
    *,
    complete: bool = True,
    manifest: bool = True,
) -> str:
    """Write a batch directory ``<root>/<slot>/<start:016X>-<end:016X>`` and return its path."""
    directory = Path(root) / slot / f"{start_lsn:016X}-{end_lsn:016X}"
    directory.mkdir(parents=True, exist_ok=False)
    entries = []
    transactions = set()
    for table in tables:
        table_dir = directory / "tables" / quote(table.schema, safe="") / quote(table.table, safe="")
        table_dir.mkdir(parents=True)
        files = []
        for index, part in enumerate(table.parts):
            if not part.changes and index > 0:
                continue
            name = f"part-{index:05d}.parquet"
            pq.write_table(table.arrow_table(part), table_dir / name)
            files.append(name)
            transactions.update(c.lsn for c in part.changes)
        entries.append(table.manifest_entry(files))
    # A pending prepared transaction waits in prepared/; the merge must never read it.
    (directory / "prepared").mkdir()
    (directory / "prepared" / "903-deadbeef.jsonl.gz").write_bytes(b"not gzip: must never be read")
    if manifest:
        document = {
            "format": "pgdecode.batch/1",
            "slot": slot,
            "plugin": "test_decoding",
            "database": "shop",
            "start_lsn": lsn_text(start_lsn),
            "end_lsn": lsn_text(end_lsn),
            "ceiling_lsn": lsn_text(end_lsn + 16),
            "transactions": len(transactions),
            "changes": sum(e["rows"] for e in entries),
            "tables": entries,
            "prepared_pending": [
                {
                    "gid": "tx-42",
                    "xid": 903,
                    "begin_lsn": lsn_text(start_lsn + 1),
                    "prepare_lsn": lsn_text(start_lsn + 2),
                    "prepare_time": "2026-11-22T10:00:00+00:00",
                    "items": 1,
                    "path": "prepared/903-deadbeef.jsonl.gz",
                }
            ],
            "prepared_committed": [],
            "prepared_rolled_back": [],
            "complete": complete,
        }
        (directory / "manifest.json").write_text(json.dumps(document, sort_keys=True), encoding="utf-8")
    return str(directory)


class Model:
    """Reference: applies changes one by one, in commit order, to a dict keyed by the primary key."""

    def __init__(self, key: Sequence[str] = ("id",)) -> None:
        self.key = tuple(key)
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}

    def _k(self, row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(row[k] for k in self.key)

    def apply(self, *tables: TableChanges, applied_through: int = -1) -> Model:
        changes = sorted((c for t in tables for p in t.parts for c in p.changes), key=lambda c: (c.lsn, c.seq))
        for change in changes:
            if change.lsn <= applied_through:
                continue
            if change.op == "T":
                self.rows.clear()
            elif change.op == "I":
                self.rows[self._k(change.new)] = {**change.new, "_pg_commit_lsn": change.lsn}
            elif change.op == "D":
                self.rows.pop(self._k(change.old), None)
            else:
                new_key = self._k(change.new)
                old_key = self._k(change.old) if change.old else new_key
                previous = self.rows.pop(old_key, {})
                row = {**change.new, "_pg_commit_lsn": change.lsn}
                for column in change.toast:
                    row[column] = previous.get(column)
                # Columns the change does not carry (added later / dropped) keep their value.
                for column, value in previous.items():
                    row.setdefault(column, value)
                self.rows[new_key] = row
        return self

    def state(self, columns: Sequence[str]) -> list[dict[str, Any]]:
        return sorted(
            ({c: row.get(c) for c in columns} for row in self.rows.values()),
            key=lambda r: tuple((r[k] is None, r[k]) for k in self.key),
        )

    def copy(self) -> Model:
        return copy.deepcopy(self)
