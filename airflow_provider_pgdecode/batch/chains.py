"""Chains of staged batches: which batches lead from one LSN to another. Plain Python.

The incremental run's checkpoint reconciliation (:mod:`airflow_provider_pgdecode.capture.reconcile`)
and ``pgdecode_backfill``'s replay and initial-load lookups read the retained batches of a slot
through these functions.

Example::

    from airflow_provider_pgdecode.batch.chains import select_batch_chain

    chain = select_batch_chain("/data/staging", "pgdecode_shop", start_lsn=None, end_lsn=None)
    print([m.name for m in chain])
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence

from airflow_provider_pgdecode.batch.format import SNAPSHOT_START_LSN, parse_batch_dir_name
from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import StagingError


def staged_ranges(staging_root: str | os.PathLike[str] | Storage, slot_name: str) -> list[tuple[Lsn, Lsn, str]]:
    """``(start, end, location)`` of the slot's committed batches, from their names, in LSN order."""
    ranges = []
    for path in list_batches(staging_root, slot_name):
        bounds = parse_batch_dir_name(posixpath.basename(path))
        if bounds is not None:
            ranges.append((*bounds, path))
    return ranges


def find_chain(ranges: Sequence[tuple[Lsn, Lsn, str]], start: Lsn, target: Lsn) -> list[str] | None:
    """Batches that lead from ``start`` to exactly ``target``, each starting where the last ended.

    Prefers the longest steps (a batch re-extracted with a higher ceiling covers a shorter one);
    empty batches (start = end) are never steps. ``None`` when no chain reaches ``target``.
    """
    by_start: dict[int, list[tuple[Lsn, str]]] = {}
    for s, e, path in ranges:
        if e > s:
            by_start.setdefault(int(s), []).append((e, path))
    for steps in by_start.values():
        steps.sort(key=lambda step: (-int(step[0]), str(step[1])))
    seen: set[int] = set()

    def walk(position: Lsn) -> list[str] | None:
        if position == target:
            return []
        if position > target or int(position) in seen:
            return None
        seen.add(int(position))
        for end, path in by_start.get(int(position), []):
            rest = walk(end)
            if rest is not None:
                return [path, *rest]
        return None

    return walk(start) if start < target else None


def select_batch_chain(
    staging_root: str | os.PathLike[str] | Storage, slot: str, start_lsn: Lsn | None = None, end_lsn: Lsn | None = None
) -> list[BatchManifest]:
    """The chain of retained batches from ``start_lsn`` up to ``end_lsn``, in LSN order.

    Each batch starts where the previous one ended. Batches that a failed run staged and a
    later run replaced (same start, smaller end) are passed over: from each start the batch
    reaching furthest is taken. ``start_lsn`` None: from the first retained batch (the
    initial load when it is still retained); ``end_lsn`` None: to the last. A gap, or a range
    retention already removed, is an error that says so.
    """
    manifests = [BatchManifest.read(_at(staging_root, path)) for path in list_batches(staging_root, slot)]
    if not manifests:
        raise StagingError(f"no retained batch of slot {slot!r} under {staging_root}")
    by_start: dict[Lsn, BatchManifest] = {}
    for manifest in manifests:
        begin = Lsn.parse(manifest.start_lsn)
        best = by_start.get(begin)
        if best is None or Lsn.parse(manifest.end_lsn) > Lsn.parse(best.end_lsn):
            by_start[begin] = manifest
    position = start_lsn if start_lsn is not None else min(by_start)
    chain: list[BatchManifest] = []
    while position in by_start and (end_lsn is None or position < end_lsn):
        manifest = by_start[position]
        if Lsn.parse(manifest.end_lsn) == position:  # an empty batch: nothing further from here
            break
        chain.append(manifest)
        position = Lsn.parse(manifest.end_lsn)
    if not chain:
        first = min(by_start)
        raise StagingError(
            f"no retained batch of slot {slot!r} starts at {position} (the first retained batch starts at {first}); "
            "give a start_lsn where a batch starts, or leave it empty"
        )
    later = sorted(start for start in by_start if start > position)
    if end_lsn is None and later:
        raise StagingError(
            f"retained batches of slot {slot!r} have a gap: none starts at {position}, where the chain from "
            f"{chain[0].start_lsn} ends, but batches start again at {later[0]}. The changes in between are not "
            "staged any more (see the retention setting); give an end_lsn at or before the gap"
        )
    if end_lsn is not None and position < end_lsn:
        raise StagingError(
            f"retained batches of slot {slot!r} end at {position}, before {end_lsn}: the changes after it are not "
            "staged (yet, or no longer: see the retention setting)"
        )
    return chain


def find_initial_load(staging_root: str | os.PathLike[str] | Storage, slot: str) -> BatchManifest | None:
    """The slot's staged initial load (the snapshot batch starting at 0/0), if retained."""
    for path in list_batches(staging_root, slot):
        manifest = BatchManifest.read(_at(staging_root, path))
        if Lsn.parse(manifest.start_lsn) == SNAPSHOT_START_LSN:
            return manifest
    return None


def _at(staging_root: str | os.PathLike[str] | Storage, location: str) -> str | Storage:
    """A batch location with the staging root's settings (credentials), when it has some."""
    return staging_root.at(location) if isinstance(staging_root, Storage) else location


__all__ = ["find_chain", "find_initial_load", "select_batch_chain", "staged_ranges"]
