"""The source side of a verify run: the selected tables as of one LSN, staged. Plain Python.

A verify run checks Delta against PostgreSQL at one consistent LSN X without stopping writers.
X and the rows as of X come from a *temporary* logical slot created with an exported snapshot
(:meth:`ReplicationConnection.create_slot_exporting_snapshot`): X is its consistent point, and
in its snapshot exactly the transactions committed before X are visible, the same boundary at
which the pipeline slot's extract stops when its ceiling is X. While the snapshot is held the
tables are copied with the initial load's code (:func:`~airflow_provider_pgdecode.capture.snapshot.stage_snapshot`:
page-range chunks, the one type map, Parquet in the batch format), then the connection closes
and the temporary slot is gone: the pipeline's slot is never touched here.

The copy goes to the *verify area* ``<staging_root>/<slot>/verify/<temporary slot>/``, which no
merge, replay, reconciliation or retention reads as a batch of the pipeline (they list only
batch directories directly under ``<staging_root>/<slot>/``).

Example::

    from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot

    snapshot = stage_verify_snapshot(dsn, "pgdecode_shop", "/data/staging", ["public.orders"])
    # bring Delta to snapshot.lsn (extract with upto_lsn=snapshot.lsn, merge), then compare
    # (spark/verify_job.py) and remove_verify_snapshot(snapshot.path)
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.batch.options import TableOptions
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.capture.snapshot import DEFAULT_SNAPSHOT_CHUNK_ROWS, snapshot_workdir, stage_snapshot
from airflow_provider_pgdecode.capture.tables import parse_table_names
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, SlotError, StagingError
from airflow_provider_pgdecode.postgres.replication import check_slot_name, replication_connection
from airflow_provider_pgdecode.postgres.standby import PrimaryLink

log = logging.getLogger(__name__)

VERIFY_DIR = "verify"
"""The verify area's folder under ``<staging_root>/<slot>/`` (not a batch name: nothing merges it)."""
TEMPORARY_SLOT_PREFIX = "pgdecode_verify_"


def verify_area(staging_root: str | os.PathLike[str] | Storage, slot_name: str) -> Storage:
    """``<staging_root>/<slot_name>/verify``: verify snapshots and reports of the pipeline ``slot_name``
    (a local directory or an ``s3://`` prefix, as the staging root)."""
    return as_storage(staging_root).child(slot_name, VERIFY_DIR)


@dataclass(frozen=True)
class VerifySnapshot:
    """The staged source side of a verify run.

    :param slot: the pipeline's slot (whose Delta tables are checked).
    :param lsn: X, the LSN the rows are as of.
    :param path: the staged snapshot batch (a table with no row has no entry in it).
    :param tables: every table copied, ``schema.table``, empty ones included.
    """

    slot: str
    lsn: Lsn
    path: str
    tables: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "lsn": str(self.lsn), "path": self.path, "tables": list(self.tables)}

    @classmethod
    def from_dict(cls, data: Any) -> VerifySnapshot:
        """From :meth:`to_dict`'s form (an XCom value); :class:`ConfigurationError` when it is not one."""
        try:
            return cls(str(data["slot"]), Lsn.parse(str(data["lsn"])), str(data["path"]), tuple(data["tables"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"not a verify snapshot ({exc!r}): {data!r}. Pass the return value of the verify snapshot task "
                "(PgDecodeVerifySnapshotOperator)"
            ) from None


def stage_verify_snapshot(
    dsn: str,
    slot_name: str,
    staging_root: str | os.PathLike[str] | Storage,
    tables: Collection[str | tuple[str, str]],
    *,
    plugin: str = "test_decoding",
    chunk_rows: int = DEFAULT_SNAPSHOT_CHUNK_ROWS,
    workers: int | None = None,
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
    primary: PrimaryLink | None = None,
) -> VerifySnapshot:
    """Copy ``tables`` as of a fresh consistent LSN X into the verify area of ``slot_name``.

    Creating the temporary slot waits until every transaction running at that moment has ended
    (prepared transactions too), as any logical slot's creation does; writers keep writing.

    :param dsn: libpq connection string of the source database (the user needs REPLICATION).
    :param slot_name: the pipeline's slot (named in the area's path, never read or moved).
    :param staging_root: the pipeline's staging root, a local directory or ``s3://bucket/prefix``
        (a :class:`~airflow_provider_pgdecode.batch.storage.Storage` carries the store's settings).
    :param tables: ``schema.table`` names or pairs; each needs a key as for an initial load.
    :param plugin: the output plugin of the temporary slot (the pipeline's: it is installed).
    :param table_options: the pipeline's per-table options (an ``append_only`` table needs no key;
        ``arrays``, ``type_map`` and ``max_value_bytes`` stage values as the pipeline does).
    :param primary: when ``dsn`` is a standby's, its primary (asked to log the running
        transactions the temporary slot's creation waits for).
    """
    if plugin not in SUPPORTED_PLUGINS:
        raise SlotError(plugin_unknown(plugin))
    check_slot_name(slot_name)
    names = sorted(parse_table_names(tables))
    if not names:
        raise ConfigurationError(f"no table to verify for slot {slot_name!r}: name at least one schema.table")
    temporary = f"{TEMPORARY_SLOT_PREFIX}{uuid.uuid4().hex[:16]}"
    area = verify_area(staging_root, slot_name)
    try:
        with replication_connection(dsn, temporary) as repl:
            exported = repl.create_slot_exporting_snapshot(
                temporary, plugin, two_phase=False, temporary=True, primary=primary
            )
            log.info(
                "Verify of slot %s: temporary slot %s exported snapshot %s at LSN %s; copying %d table(s)",
                slot_name,
                temporary,
                exported.snapshot_name,
                exported.consistent_lsn,
                len(names),
            )
            manifest = stage_snapshot(
                dsn,
                exported.snapshot_name,
                exported.consistent_lsn,
                temporary,
                area,
                names,
                plugin=plugin,
                chunk_rows=chunk_rows,
                replace=False,  # rows only: this copy is compared, never merged
                workers=workers,
                table_options=table_options,
            )
    except BaseException:
        # The temporary slot's snapshot is gone: nothing can resume this copy.
        try:
            area.delete_tree(temporary)
        except StagingError as exc:  # the copy's own error matters more
            log.warning("Could not remove the unfinished verify copy %s: %s", area.uri(temporary), exc)
        shutil.rmtree(snapshot_workdir(area, temporary, "-").parent, ignore_errors=True)
        raise
    return VerifySnapshot(slot_name, exported.consistent_lsn, str(manifest.path), tuple(f"{s}.{t}" for s, t in names))


def remove_verify_snapshot(snapshot: VerifySnapshot, storage: Storage | None = None) -> None:
    """Delete a verify run's staged copy (its temporary slot's folder in the verify area).

    :param storage: any :class:`~airflow_provider_pgdecode.batch.storage.Storage` of the same
        store (its settings reach the copy on object storage); default: from the location alone
        (the ``AWS_*`` environment for ``s3://``).
    """
    location = str(snapshot.path).rstrip("/")
    folder = posixpath.dirname(location)
    if posixpath.basename(posixpath.dirname(folder)) != VERIFY_DIR or not posixpath.basename(folder).startswith(
        TEMPORARY_SLOT_PREFIX
    ):
        raise ConfigurationError(f"{location} is not a verify snapshot: refusing to delete it")
    try:
        target = storage.at(folder) if storage is not None else as_storage(folder)
        target.delete_tree()
    except StagingError as exc:
        log.warning("Could not remove the verify snapshot %s: %s", folder, exc)


__all__ = ["VERIFY_DIR", "VerifySnapshot", "remove_verify_snapshot", "stage_verify_snapshot", "verify_area"]
