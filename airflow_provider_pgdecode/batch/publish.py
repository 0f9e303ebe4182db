"""Publishing a finished batch: every part in place first, the manifest last.

A batch is written in a local work directory (:func:`batch_workdir`), since its end LSN, and so
its name, is known only when decoding ends. Publishing puts it at ``<slot>/<start>-<end>/``:

* on a local staging root the work directory sits beside its final place, every file is made
  durable and the directory is renamed into place (the manifest inside it);
* on object storage, which has no rename, the parts are uploaded first and the manifest last,
  so the manifest is the batch's commit marker: a prefix without one (an upload cut short) does
  not exist for any reader (:func:`~airflow_provider_pgdecode.batch.manifest.list_batches`), and
  the next extract of the range replaces what it holds.

Extracting the same LSN range again gives the same contents, so an existing batch with equal
contents is kept and a different one is an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from airflow_provider_pgdecode.batch.format import MANIFEST_NAME
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import Storage, fsync_dir, spool_dir
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError, StagingError, staging_io

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
"""Names of unfinished local work directories (retention removes old ones)."""


def workdir_base(staging: Storage, slot: str) -> Path:
    """Where a slot's local work directories live: ``<staging_root>/<slot>`` for a local staging
    root (publishing is a rename); for object storage a folder of
    :func:`~airflow_provider_pgdecode.batch.storage.spool_dir` named after the slot's location, so
    that slots of one name in two stores never share one."""
    if staging.is_local:
        return Path(staging.uri(slot))
    digest = hashlib.sha256(staging.uri(slot).encode("utf-8")).hexdigest()[:16]
    return spool_dir() / f"{slot}-{digest}"


def batch_workdir(staging: Storage, slot: str, start_lsn: Lsn) -> Path:
    """A new local directory (under :func:`workdir_base`) to write a batch in. The caller removes
    it if publishing does not happen."""
    path = workdir_base(staging, slot) / f"{TMP_PREFIX}{int(start_lsn):016X}-{uuid.uuid4().hex[:12]}"
    with staging_io(path, "create batch directory"):
        path.mkdir(parents=True)
    return path


def publish_batch(workdir: Path, staging: Storage, relative: str, manifest: BatchManifest) -> str:
    """Put the finished batch at ``relative`` (``<slot>/<start>-<end>``) under ``staging``; an
    existing identical batch is kept as it is. Returns the batch's location.

    An I/O error (a full disk, lost permissions, an unreachable store) is a :class:`StagingError`
    naming the path; the work directory is left to the caller, which removes it."""
    final = staging.child(relative)
    with staging_io(workdir, "publish batch"):
        if _same_batch_exists(final, manifest):
            shutil.rmtree(workdir)
            return final.root
        if staging.is_local:
            _fsync_tree(workdir)
            os.rename(workdir, final.root)
            fsync_dir(Path(final.root).parent)
        else:
            # Objects left by an upload cut short (no manifest: invisible to readers) go first,
            # so the batch holds exactly this extract's parts.
            final.delete_tree()
            final.upload_tree(workdir, "", last=MANIFEST_NAME)
            shutil.rmtree(workdir)
    return final.root


def _same_batch_exists(final: Storage, manifest: BatchManifest) -> bool:
    if not final.is_file(MANIFEST_NAME):
        return False
    try:
        existing = BatchManifest.read(final)
    except BatchError:
        raise StagingError(
            f"batch {final.root} already exists but cannot be read; move it away to extract the range again"
        ) from None
    if existing.contents() != manifest.contents():
        raise StagingError(
            f"batch {final.root} already exists with different contents; the slot or checkpoint changed "
            "between runs over the same LSN range. Move the old batch away to extract again."
        )
    log.info("Batch %s was already staged with the same contents; keeping it", final.root)
    return True


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)


__all__ = ["TMP_PREFIX", "batch_workdir", "publish_batch", "workdir_base"]
