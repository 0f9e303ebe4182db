"""The checkpoint one run hands to the next: where it ended and what it left pending."""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import Storage, is_object_store, spool_dir
from airflow_provider_pgdecode.decoding.assembler import PreparedTransaction
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool
from airflow_provider_pgdecode.errors import StagingError


@dataclass
class Checkpoint:
    """JSON-able (for XCom) state carried between batches of one slot.

    :param end_lsn: everything at or before it is staged (and, once the batch is merged and
        confirmed, in Delta).
    :param prepared_pending: headers of prepared transactions still open, each with the
        absolute ``path`` of its spooled items.
    :param snapshots: progress of table snapshot requests, by request id
        (:mod:`airflow_provider_pgdecode.capture.table_snapshot`).
    :param table_oids: the staged tables by OID, their names and Delta tables
        (:attr:`BatchManifest.table_oids`): how a renamed table is followed.
    :param rows_per_change: the batch's rows per change (:attr:`BatchManifest.rows_per_change`):
        the next batch sizes the server's row limit by it.
    :param wal_bytes_per_change: the batch's WAL per change (:attr:`BatchManifest.wal_bytes_per_change`):
        the next batch places its second decoding session by it.
    """

    slot: str
    end_lsn: Lsn
    prepared_pending: list[dict[str, Any]] = field(default_factory=list)
    batch_path: str | None = None
    snapshots: dict[str, Any] = field(default_factory=dict)
    table_oids: dict[str, Any] = field(default_factory=dict)
    rows_per_change: float | None = None
    wal_bytes_per_change: float | None = None

    @classmethod
    def from_manifest(cls, manifest: BatchManifest) -> Checkpoint:
        if manifest.path is None:
            raise StagingError("a checkpoint needs a manifest read from its batch directory")
        pending = [{**p, "path": posixpath.join(manifest.path, p["path"])} for p in manifest.prepared_pending]
        return cls(
            manifest.slot,
            Lsn.parse(manifest.end_lsn),
            pending,
            str(manifest.path),
            dict(manifest.snapshots),
            dict(manifest.table_oids),
            manifest.rows_per_change,
            manifest.wal_bytes_per_change,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "end_lsn": str(self.end_lsn),
            "prepared_pending": self.prepared_pending,
            "batch_path": self.batch_path,
            "snapshots": self.snapshots,
            "table_oids": self.table_oids,
            "rows_per_change": self.rows_per_change,
            "wal_bytes_per_change": self.wal_bytes_per_change,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Checkpoint:
        try:
            return cls(
                data["slot"],
                Lsn.parse(data["end_lsn"]),
                list(data.get("prepared_pending") or []),
                data.get("batch_path"),
                dict(data.get("snapshots") or {}),
                dict(data.get("table_oids") or {}),
                float(data["rows_per_change"]) if data.get("rows_per_change") is not None else None,
                float(data["wal_bytes_per_change"]) if data.get("wal_bytes_per_change") is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StagingError(f"malformed checkpoint {data!r}: {exc}") from None

    def pending_prepared(self, staging: Storage | None = None) -> list[PreparedTransaction]:
        """The pending prepared transactions, their items read lazily from the staged files (a
        file on object storage is first copied to the local spool directory; ``staging`` gives
        the store's settings, else they come from the ``AWS_*`` environment)."""
        out = []
        for header in self.prepared_pending:
            path = header["path"]
            local = _local_copy(path, staging) if is_object_store(path) else path
            if local is None or not os.path.isfile(local):
                raise StagingError(
                    f"the checkpoint's prepared transaction {header['gid']!r} (xid {header['xid']}) is stored at "
                    f"{path}, which no longer exists. Keep staged batches until their pending prepared "
                    "transactions resolve (the retention setting), or re-snapshot the affected tables."
                )
            out.append(PreparedTransaction.from_header(header, ItemSpool.load(local, header["items"])))
        return out


def _local_copy(location: str, staging: Storage | None) -> str | None:
    """A local copy of a staged file on object storage (``None`` when it is gone)."""
    directory, name = posixpath.split(location)
    store = staging.at(directory) if staging is not None else Storage(directory)
    try:
        data = store.read_bytes(name)
    except FileNotFoundError:
        return None
    target = spool_dir() / "prepared" / (hashlib.sha1(location.encode("utf-8")).hexdigest()[:16] + "-" + name)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return str(target)
