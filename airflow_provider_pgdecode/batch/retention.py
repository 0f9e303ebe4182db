"""Retention of staged batches: keep what a replay or a pending transaction needs, remove the rest.

Staged batches are the replay log of ``pgdecode_backfill`` (mode ``replay``): a Delta table can
be rebuilt from any retained chain of batches. They also hold the items of prepared
transactions still waiting for COMMIT PREPARED, which the checkpoint points into. Plain Python.

A batch is removed only when all of these hold:

* it is confirmed: its end LSN is at or before the checkpoint's (the slot moved past it);
* it is not the checkpoint's own batch, and holds no file of a pending prepared transaction;
* it is not among the ``keep_batches`` newest confirmed batches;
* it is older than ``keep_days`` (the time its manifest was written).

Unfinished temporary directories (``.tmp-*``) older than ``keep_days`` go too: the extract that
wrote them failed long ago, and a snapshot copy they belong to cannot resume once its slot's
snapshot is gone.

Example::

    from airflow_provider_pgdecode.batch.retention import prune_batches

    removed = prune_batches("/data/staging", checkpoint, keep_days=7)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import MANIFEST_NAME, BatchManifest, list_batches
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, StagingError

log = logging.getLogger(__name__)

DEFAULT_KEEP_DAYS = 7.0
DEFAULT_KEEP_BATCHES = 1


def prune_batches(
    staging_root: str | os.PathLike[str],
    checkpoint: Checkpoint,
    *,
    keep_days: float = DEFAULT_KEEP_DAYS,
    keep_batches: int = DEFAULT_KEEP_BATCHES,
    now: float | None = None,
    dry_run: bool = False,
) -> list[Path]:
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
    base = Path(staging_root) / checkpoint.slot
    protected = {Path(p["path"]).resolve().parent.parent for p in checkpoint.prepared_pending if p.get("path")}
    if checkpoint.batch_path:
        protected.add(Path(checkpoint.batch_path).resolve())
    confirmed: list[tuple[Lsn, Path]] = []
    for path in list_batches(staging_root, checkpoint.slot):
        try:
            manifest = BatchManifest.read(path)
        except StagingError as exc:
            log.warning("Retention leaves %s alone: %s", path, exc)
            continue
        if Lsn.parse(manifest.end_lsn) <= checkpoint.end_lsn:
            confirmed.append((Lsn.parse(manifest.end_lsn), path))
    confirmed.sort()
    newest = {path for _, path in confirmed[len(confirmed) - keep_batches :]} if keep_batches else set()
    removed = []
    for _, path in confirmed:
        if path.resolve() in protected or path in newest:
            continue
        if (path / MANIFEST_NAME).stat().st_mtime > cutoff:
            continue
        removed.append(path)
    if base.is_dir():
        removed += [
            p for p in base.iterdir() if p.is_dir() and p.name.startswith(".tmp-") and p.stat().st_mtime <= cutoff
        ]
    for path in removed:
        log.info("Retention: %s %s", "would remove" if dry_run else "removing", path)
        if not dry_run:
            shutil.rmtree(path)
    return removed


__all__ = ["DEFAULT_KEEP_BATCHES", "DEFAULT_KEEP_DAYS", "prune_batches"]
