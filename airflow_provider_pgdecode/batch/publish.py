"""Publishing a finished batch: every file made durable, then the directory renamed into place.

A batch is staged under a temporary name beside its final one; a crash leaves either no batch
or a whole one. Extracting the same LSN range again gives the same contents, so an existing
batch with equal contents is kept and a different one is an error.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.errors import StagingError, staging_io

log = logging.getLogger(__name__)


def publish_batch(tmp: Path, final: Path, manifest: BatchManifest) -> Path:
    """Rename the finished batch into place; an existing identical batch is kept as it is.

    An I/O error (a full disk, lost permissions) is a :class:`StagingError` naming the path; the
    temporary directory is left to the caller, which removes it."""
    with staging_io(tmp, "publish batch"):
        return _publish(tmp, final, manifest)


def _publish(tmp: Path, final: Path, manifest: BatchManifest) -> Path:
    _fsync_tree(tmp)
    if final.exists():
        existing = BatchManifest.read(final)
        if existing.contents() != manifest.contents():
            raise StagingError(
                f"batch {final} already exists with different contents; the slot or checkpoint changed "
                "between runs over the same LSN range. Move the old batch away to extract again."
            )
        log.info("Batch %s was already staged with the same contents; keeping it", final)
        shutil.rmtree(tmp)
        return final
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
