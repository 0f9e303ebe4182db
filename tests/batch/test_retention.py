"""Retention keeps what a replay or a pending prepared transaction needs and removes the rest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import MANIFEST_NAME, BatchManifest, batch_dir_name
from airflow_provider_pgdecode.batch.retention import prune_batches
from airflow_provider_pgdecode.decoding.lsn import Lsn

DAY = 86400.0
NOW = 1_800_000_000.0


def stage(root: Path, start: int, end: int, age_days: float, prepared: bool = False) -> Path:
    """A complete (empty) batch whose manifest was written ``age_days`` ago."""
    path = root / "s" / batch_dir_name(Lsn(start), Lsn(end))
    path.mkdir(parents=True)
    pending = []
    if prepared:
        (path / "prepared").mkdir()
        (path / "prepared" / "7-abc.jsonl.gz").write_bytes(b"")
        pending = [{"gid": "g", "xid": 7, "items": 0, "path": "prepared/7-abc.jsonl.gz"}]
    manifest = BatchManifest(
        "s", "test_decoding", "db", str(Lsn(start)), str(Lsn(end)), str(Lsn(end)), 0, 0, [], prepared_pending=pending
    )
    manifest.write(path)
    stamp = NOW - age_days * DAY
    os.utime(path / MANIFEST_NAME, (stamp, stamp))
    return path


def test_old_confirmed_batches_go_and_needed_ones_stay(tmp_path: Path) -> None:
    snapshot = stage(tmp_path, 0, 100, age_days=30)
    old = stage(tmp_path, 100, 200, age_days=20)
    holds_prepared = stage(tmp_path, 200, 300, age_days=15, prepared=True)
    old_too = stage(tmp_path, 300, 400, age_days=10)
    recent = stage(tmp_path, 400, 500, age_days=1)
    last = stage(tmp_path, 500, 600, age_days=9)  # the checkpoint's batch, however old
    unmerged = stage(tmp_path, 600, 700, age_days=9)  # past the checkpoint: not merged yet
    stale_tmp = tmp_path / "s" / ".tmp-0000000000000258-abc"
    stale_tmp.mkdir()
    os.utime(stale_tmp, (NOW - 9 * DAY, NOW - 9 * DAY))
    requests = tmp_path / "s" / "snapshot-requests"
    requests.mkdir()
    os.utime(requests, (NOW - 90 * DAY, NOW - 90 * DAY))
    pending = BatchManifest.read(holds_prepared).prepared_pending
    checkpoint = Checkpoint("s", Lsn(600), [{**p, "path": str(holds_prepared / p["path"])} for p in pending], str(last))

    would = prune_batches(tmp_path, checkpoint, keep_days=7, keep_batches=1, now=NOW, dry_run=True)
    assert all(Path(p).exists() for p in would)
    removed = prune_batches(tmp_path, checkpoint, keep_days=7, keep_batches=1, now=NOW)
    assert sorted(removed) == sorted(would) == sorted(map(str, [snapshot, old, old_too, stale_tmp]))
    assert all(p.is_dir() for p in (holds_prepared, recent, last, unmerged, requests))
    assert not any(Path(p).exists() for p in removed)
    # the pending transaction's items are where the checkpoint points
    assert Path(checkpoint.prepared_pending[0]["path"]).is_file()


def test_keep_batches_keeps_the_newest_confirmed(tmp_path: Path) -> None:
    batches = [stage(tmp_path, n * 100, n * 100 + 100, age_days=30) for n in range(5)]
    checkpoint = Checkpoint("s", Lsn(500), [], None)
    removed = prune_batches(tmp_path, checkpoint, keep_days=7, keep_batches=2, now=NOW)
    assert sorted(removed) == list(map(str, batches[:3]))
    with pytest.raises(ValueError):
        prune_batches(tmp_path, checkpoint, keep_days=-1)
