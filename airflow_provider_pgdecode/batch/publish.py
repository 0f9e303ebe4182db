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
contents is kept. One with other contents was staged by an earlier extract of the range that was
never confirmed (the extract starts where the last confirm left off), under another selection of
tables or other table options: the new batch replaces it, and the log says what changed. Delta is
safe either way: a table merged from the old batch holds its commit LSNs, and the merge of the new
one skips what Delta holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Collection
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


def publish_batch(
    workdir: Path, staging: Storage, relative: str, manifest: BatchManifest, *, placed: Collection[str] = ()
) -> str:
    """Put the finished batch at ``relative`` (``<slot>/<start>-<end>``) under ``staging``; an
    existing identical batch is kept as it is. Returns the batch's location.

    ``placed``: on object storage, files (relative to the batch) already uploaded to their final
    place by others (the initial load's Spark tasks): kept, while every other object under the
    batch goes before the work directory is uploaded, its manifest last.

    An I/O error (a full disk, lost permissions, an unreachable store) is a :class:`StagingError`
    naming the path; the work directory is left to the caller, which removes it."""
    final = staging.child(relative)
    with staging_io(workdir, "publish batch"):
        existing = _existing_batch(final)
        if existing is not None and existing.contents() == manifest.contents():
            log.info("Batch %s was already staged with the same contents; keeping it", final.root)
            shutil.rmtree(workdir)
            return final.root
        if existing is not None:
            log.warning(
                "Batch %s was staged before, never confirmed, with other contents (%s): this extract replaces it",
                final.root,
                describe_difference(existing, manifest),
            )
        if staging.is_local:
            _fsync_tree(workdir)
            if existing is not None:  # aside, then gone: the batch directory is never half of each
                aside = Path(final.root).with_name(
                    f"{TMP_PREFIX}replaced-{Path(final.root).name}-{uuid.uuid4().hex[:8]}"
                )
                os.rename(final.root, aside)
                shutil.rmtree(aside)
            os.rename(workdir, final.root)
            fsync_dir(Path(final.root).parent)
        else:
            # Objects left by an upload cut short (no manifest: invisible to readers) go first,
            # so the batch holds exactly this extract's parts.
            if placed:
                for name in set(final.walk_files()) - set(placed):
                    final.delete_file(name)
            else:
                final.delete_tree()
            final.upload_tree(workdir, "", last=MANIFEST_NAME)
            shutil.rmtree(workdir)
    return final.root


def _existing_batch(final: Storage) -> BatchManifest | None:
    """The manifest of a batch already published at ``final``, ``None`` when there is none."""
    if not final.is_file(MANIFEST_NAME):
        return None
    try:
        return BatchManifest.read(final)
    except BatchError:
        raise StagingError(
            f"batch {final.root} already exists but cannot be read; move it away to extract the range again"
        ) from None


def describe_difference(before: BatchManifest, after: BatchManifest) -> str:
    """What an extract of one range stages differently from an earlier one: tables selected,
    dropped, or staged otherwise (their rows, mode or columns), and what else changed."""
    old = {t.qualified_name: t.to_dict() for t in before.tables}
    new = {t.qualified_name: t.to_dict() for t in after.tables}
    parts = []
    if added := sorted(set(new) - set(old)):
        parts.append(f"tables now staged: {', '.join(added)}")
    if dropped := sorted(set(old) - set(new)):
        parts.append(f"tables no longer staged: {', '.join(dropped)}")
    if changed := sorted(name for name in set(old) & set(new) if old[name] != new[name]):
        parts.append(f"tables staged otherwise: {', '.join(changed)}")
    rest_before = {k: v for k, v in before.contents().items() if k != "tables"}
    rest_after = {k: v for k, v in after.contents().items() if k != "tables"}
    if others := sorted(k for k in set(rest_before) | set(rest_after) if rest_before.get(k) != rest_after.get(k)):
        parts.append(f"also {', '.join(others)}")
    return "; ".join(parts) or "the same tables, staged otherwise"


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
