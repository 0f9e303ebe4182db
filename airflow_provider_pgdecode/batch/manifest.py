"""The manifest of a staged batch, and reading batches back (format: docs/staging-format.md)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.batch.format import BATCH_NAME, FORMAT, MANIFEST_NAME, batch_dir_name, table_path
from airflow_provider_pgdecode.errors import StagingError

__all__ = [
    "FORMAT", "MANIFEST_NAME", "BatchManifest", "ColumnSummary", "TableSummary", "batch_dir_name", "list_batches",
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
    format: str = FORMAT
    complete: bool = True
    #: Where the batch lives (not stored in the file).
    path: Path | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return batch_dir_name(Lsn.parse(self.start_lsn), Lsn.parse(self.end_lsn))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("path")
        return data

    def contents(self) -> dict[str, Any]:
        """What the batch holds, without how it was read (the ceiling and read statistics):
        two extracts of one LSN range with different ceilings stage the same contents."""
        data = self.to_dict()
        data.pop("ceiling_lsn")
        data.pop("skipped")
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
            "tables": {f"{t.schema}.{t.table}": t.rows for t in self.tables},
            "prepared_pending": [{"gid": p["gid"], "xid": p["xid"]} for p in self.prepared_pending],
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        target = Path(directory) / MANIFEST_NAME
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        return target

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> BatchManifest:
        """Read and check a batch's manifest; a missing, partial or inconsistent batch is an error."""
        directory = Path(directory)
        target = directory / MANIFEST_NAME
        if not target.is_file():
            raise StagingError(
                f"{directory} is not a complete batch: {MANIFEST_NAME} is missing. Batches are renamed into "
                "place only when complete, so this directory was not written by pgdecode's extract or was "
                "damaged: extract the range again."
            )
        try:
            data = json.loads(target.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StagingError(f"unreadable manifest {target}: {exc}") from None
        if data.get("format") != FORMAT:
            raise StagingError(f"{target}: unknown batch format {data.get('format')!r} (expected {FORMAT})")
        if data.get("complete") is not True:
            raise StagingError(f"{target}: the batch is marked incomplete; extract the range again")
        try:
            manifest = cls(**{**data, "tables": [TableSummary.from_dict(t) for t in data["tables"]]})
        except (TypeError, KeyError) as exc:
            raise StagingError(f"{target}: malformed manifest ({exc})") from None
        manifest.path = directory
        missing = [
            f"{t.path}/{name}" for t in manifest.tables for name in t.files if not (directory / t.path / name).is_file()
        ]
        if manifest.messages:
            missing += [
                f"{manifest.messages['path']}/{n}"
                for n in manifest.messages["files"]
                if not (directory / manifest.messages["path"] / n).is_file()
            ]
        missing += [p["path"] for p in manifest.prepared_pending if not (directory / p["path"]).is_file()]
        if missing:
            raise StagingError(f"batch {directory} is incomplete: missing {', '.join(missing[:5])}")
        return manifest


def list_batches(staging_root: str | os.PathLike[str], slot: str) -> list[Path]:
    """Complete batch directories of a slot, in LSN order (temporary directories are ignored)."""
    base = Path(staging_root) / slot
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and BATCH_NAME.match(p.name))
