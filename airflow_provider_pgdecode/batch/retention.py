"""Retention of staged batches: keep what a replay or a pending transaction needs, remove the rest.

Staged batches are the replay log of ``pgdecode_backfill`` (mode ``replay``): a Delta table can
be rebuilt from any retained chain of batches. They also hold the items of prepared
transactions still waiting for COMMIT PREPARED, which the checkpoint points into. Plain Python.

A batch is removed only when all of these hold:

* it is confirmed: its end LSN is at or before the checkpoint's (the slot moved past it);
* it is not the checkpoint's own batch, and holds no file of a pending prepared transaction;
* no parked table still needs it (it ends at or before every parked table's place,
  :mod:`~airflow_provider_pgdecode.batch.parking`);
* it is not among the ``keep_batches`` newest confirmed batches;
* it is older than ``keep_days`` (the time its manifest was written).

Unfinished temporary directories (``.tmp-*``) older than ``keep_days`` go too: the extract that
wrote them failed long ago, and a snapshot copy they belong to cannot resume once its slot's
snapshot is gone. On object storage so do batch prefixes without a manifest (an upload cut
short), once nothing under them was written for ``keep_days``.

Example::

    from airflow_provider_pgdecode.batch.retention import prune_batches

    removed = prune_batches("/data/staging", checkpoint, keep_days=7)
"""

from __future__ import annotations

import logging
import os
import posixpath
import time

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.format import BATCH_NAME
from airflow_provider_pgdecode.batch.manifest import MANIFEST_NAME, BatchManifest, list_batches
from airflow_provider_pgdecode.batch.parking import oldest_parked, read_parked
from airflow_provider_pgdecode.batch.publish import TMP_PREFIX
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, StagingError

log = logging.getLogger(__name__)

DEFAULT_KEEP_DAYS = 7.0
DEFAULT_KEEP_BATCHES = 1


def prune_batches(
    staging_root: str | os.PathLike[str] | Storage,
    checkpoint: Checkpoint,
    *,
    keep_days: float = DEFAULT_KEEP_DAYS,
    keep_batches: int = DEFAULT_KEEP_BATCHES,
    now: float | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Remove the slot's staged batches that retention no longer needs; return what went.

    :param staging_root: the staging root (batches are under ``<staging_root>/<slot>/``).
    :param checkpoint: the slot's checkpoint after the latest confirm.
    :param keep_days: keep every batch younger than this many days.
    :param keep_batches: keep at least this many of the newest confirmed batches.
    :param now: the current time (seconds since the epoch), for tests.
    :param dry_run: only report what would be removed.
    """
    if keep_days < 0 or keep_batches < 0:
        raise ConfigurationError("keep_days and keep_batches must not be negative")
    now = time.time() if now is None else now
    cutoff = now - keep_days * 86400
    store = as_storage(staging_root)
    slot = checkpoint.slot
    protected = {_normal(posixpath.dirname(posixpath.dirname(p["path"]))) for p in checkpoint.prepared_pending}
    if checkpoint.batch_path:
        protected.add(_normal(checkpoint.batch_path))
    # A parked table's staged changes are not in Delta yet: every batch from its place on stays.
    parked_from = oldest_parked(read_parked(store, slot))
    confirmed: list[tuple[Lsn, str]] = []
    for path in list_batches(store, slot):
        try:
            manifest = BatchManifest.read(store.at(path))
        except StagingError as exc:
            log.warning("Retention leaves %s alone: %s", path, exc)
            continue
        if parked_from is not None and manifest.end > parked_from:
            continue
        if Lsn.parse(manifest.end_lsn) <= checkpoint.end_lsn:
            confirmed.append((Lsn.parse(manifest.end_lsn), path))
    confirmed.sort()
    newest = {path for _, path in confirmed[len(confirmed) - keep_batches :]} if keep_batches else set()
    removed = []
    for _, path in confirmed:
        if _normal(path) in protected or path in newest:
            continue
        if store.at(path).mtime(MANIFEST_NAME) > cutoff:
            continue
        removed.append(path)
    # Left by extracts that failed long ago: local work directories, and on object storage
    # batch prefixes whose upload stopped before the manifest (invisible to every reader).
    committed = set(list_batches(store, slot))
    for name, is_dir in store.list_dir(slot):
        location = store.uri(slot, name)
        if not is_dir or location in committed:
            continue
        unfinished = name.startswith(TMP_PREFIX) or (not store.is_local and BATCH_NAME.match(name) is not None)
        if unfinished and _newest_write(store.at(location)) <= cutoff:
            removed.append(location)
    for path in removed:
        log.info("Retention: %s %s", "would remove" if dry_run else "removing", path)
        if not dry_run:
            store.at(path).delete_tree()
    return removed


def _normal(location: str) -> str:
    """A location compared as retention compares them (local paths resolved, URIs as they are)."""
    return location.rstrip("/") if "://" in location else os.path.realpath(location)


def _newest_write(store: Storage) -> float:
    """When anything under ``store`` was last written (its own time when it holds no file)."""
    if store.is_local:
        return os.stat(store.root).st_mtime
    return max((store.mtime(name) for name in store.walk_files()), default=0.0)


__all__ = ["DEFAULT_KEEP_BATCHES", "DEFAULT_KEEP_DAYS", "prune_batches"]
