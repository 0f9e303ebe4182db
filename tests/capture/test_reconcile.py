"""Reconciling the previous checkpoint with the slot and the staged batches (no PostgreSQL, no Airflow)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.chains import find_chain, staged_ranges
from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, batch_dir_name
from airflow_provider_pgdecode.capture.reconcile import ADOPTED, RESUME, SLOT_BEHIND, START, reconcile
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CheckpointError
from airflow_provider_pgdecode.postgres.slot import SlotInfo

SLOT = "pgdecode_orders"


def slot_at(confirmed: int | None, name: str = SLOT) -> SlotInfo:
    return SlotInfo(
        slot_name=name,
        plugin="test_decoding",
        slot_type="logical",
        database="shop",
        temporary=False,
        active=False,
        two_phase=True,
        restart_lsn=Lsn(0x100),
        confirmed_flush_lsn=None if confirmed is None else Lsn(confirmed),
        wal_status="reserved",
        safe_wal_size=None,
        current_lsn=Lsn(0x9000),
        lag_bytes=None if confirmed is None else 0x9000 - confirmed,
    )


def stage(root: Path, start: int, end: int, *, pending_gid: str | None = None, slot: str = SLOT) -> Path:
    """A complete (empty) batch directory with a valid manifest, optionally one pending prepared xact."""
    directory = root / slot / batch_dir_name(Lsn(start), Lsn(end))
    directory.mkdir(parents=True)
    pending = []
    if pending_gid is not None:
        (directory / "prepared").mkdir()
        (directory / "prepared" / "900-x.jsonl.gz").write_bytes(b"")
        pending = [
            {
                "gid": pending_gid,
                "xid": 900,
                "begin_lsn": str(Lsn(start)),
                "prepare_lsn": str(Lsn(start + 1)),
                "prepare_time": None,
                "items": 0,
                "path": "prepared/900-x.jsonl.gz",
            }
        ]
    BatchManifest(
        slot=slot,
        plugin="test_decoding",
        database="shop",
        start_lsn=str(Lsn(start)),
        end_lsn=str(Lsn(end)),
        ceiling_lsn=str(Lsn(end)),
        transactions=0,
        changes=0,
        tables=[],
        messages=None,
        prepared_pending=pending,
        prepared_committed=[],
        prepared_rolled_back=[],
    ).write(directory)
    return directory


def checkpoint_of(batch: Path) -> dict[str, object]:
    return Checkpoint.from_manifest(BatchManifest.read(batch)).to_dict()


def test_no_checkpoint_starts_from_the_slot(tmp_path: Path) -> None:
    decision = reconcile(None, slot_at(0x500), tmp_path)
    assert decision.action == START
    assert decision.checkpoint is None
    assert decision.start_lsn == Lsn(0x500)
    assert "0/500" in decision.message
    # An empty XCom value is no checkpoint either; staging_root is optional.
    assert reconcile({}, slot_at(0x500)).action == START


def test_no_checkpoint_adopts_the_batch_ending_at_the_slot(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x300)
    batch = stage(tmp_path, 0x300, 0x500, pending_gid="tx-1")
    stage(tmp_path, 0x500, 0x700)  # extracted but never confirmed: not adopted
    decision = reconcile(None, slot_at(0x500), tmp_path)
    assert decision.action == ADOPTED
    assert decision.adopted == (str(batch),)
    assert decision.checkpoint is not None and decision.checkpoint.end_lsn == Lsn(0x500)
    assert [p["gid"] for p in decision.checkpoint.prepared_pending] == ["tx-1"]
    assert decision.checkpoint.prepared_pending[0]["path"] == str(batch / "prepared" / "900-x.jsonl.gz")


def test_checkpoint_at_the_slot_resumes(tmp_path: Path) -> None:
    batch = stage(tmp_path, 0x300, 0x500, pending_gid="tx-1")
    decision = reconcile(checkpoint_of(batch), slot_at(0x500), tmp_path)
    assert decision.action == RESUME
    assert decision.start_lsn == Lsn(0x500)
    assert decision.checkpoint == Checkpoint.from_dict(checkpoint_of(batch))


def test_slot_behind_the_checkpoint_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    batch = stage(tmp_path, 0x300, 0x500)
    decision = reconcile(checkpoint_of(batch), slot_at(0x300), tmp_path)
    assert decision.action == SLOT_BEHIND
    assert decision.start_lsn == Lsn(0x500)
    assert decision.checkpoint is not None and decision.checkpoint.end_lsn == Lsn(0x500)
    assert "behind" in decision.message


def test_slot_ahead_adopts_a_chain_of_staged_batches(tmp_path: Path) -> None:
    first = stage(tmp_path, 0x300, 0x500)
    stage(tmp_path, 0x500, 0x580)  # a shorter extract of the same range (re-run with a lower ceiling)
    stage(tmp_path, 0x580, 0x590)  # leads nowhere
    second = stage(tmp_path, 0x500, 0x600)
    third = stage(tmp_path, 0x600, 0x800, pending_gid="tx-7")
    stage(tmp_path, 0x800, 0x900)  # beyond the slot: not part of the chain
    decision = reconcile(checkpoint_of(first), slot_at(0x800), tmp_path)
    assert decision.action == ADOPTED
    assert decision.adopted == (str(second), str(third))
    assert decision.start_lsn == Lsn(0x800)
    assert decision.checkpoint is not None and decision.checkpoint.end_lsn == Lsn(0x800)
    assert decision.checkpoint.batch_path == str(third)
    assert [p["gid"] for p in decision.checkpoint.prepared_pending] == ["tx-7"]
    assert "XCom" in decision.message


def test_slot_ahead_of_everything_staged_fails_loudly(tmp_path: Path) -> None:
    first = stage(tmp_path, 0x300, 0x500)
    stage(tmp_path, 0x500, 0x600)
    stage(tmp_path, 0x600, 0x900)  # overshoots the slot's position: proves nothing
    with pytest.raises(CheckpointError) as caught:
        reconcile(checkpoint_of(first), slot_at(0x800), tmp_path)
    message = str(caught.value)
    assert "ahead of the last merged checkpoint 0/500" in message
    assert "0/800" in message
    assert "another reader" in message
    assert "pgdecode_backfill" in message
    assert f"pg_drop_replication_slot('{SLOT}')" in message
    # Without a staging root nothing can be adopted.
    with pytest.raises(CheckpointError, match="no staging_root"):
        reconcile(checkpoint_of(first), slot_at(0x600))


def test_checkpoint_of_another_slot_or_malformed_is_refused(tmp_path: Path) -> None:
    batch = stage(tmp_path, 0x300, 0x500)
    with pytest.raises(CheckpointError, match="belongs to replication slot 'pgdecode_orders', not 'other_slot'"):
        reconcile(checkpoint_of(batch), slot_at(0x500, name="other_slot"), tmp_path)
    with pytest.raises(CheckpointError, match="malformed checkpoint"):
        reconcile({"slot": SLOT, "end_lsn": "nonsense"}, slot_at(0x500), tmp_path)
    with pytest.raises(CheckpointError, match="not a dict"):
        reconcile("0/500", slot_at(0x500), tmp_path)  # type: ignore[arg-type]


def test_adopting_a_damaged_batch_is_an_error(tmp_path: Path) -> None:
    first = stage(tmp_path, 0x300, 0x500)
    second = stage(tmp_path, 0x500, 0x600)
    (second / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="cannot be read"):
        reconcile(checkpoint_of(first), slot_at(0x600), tmp_path)


def test_staged_ranges_and_find_chain(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x100)  # an empty batch: never a step
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x300)
    (tmp_path / SLOT / ".tmp-0000000000000300-abc").mkdir()  # an unfinished extract is ignored
    (tmp_path / SLOT / "not-a-batch").mkdir()
    ranges = staged_ranges(tmp_path, SLOT)
    assert [(int(s), int(e)) for s, e, _ in ranges] == [(0x100, 0x100), (0x100, 0x200), (0x200, 0x300)]
    chain = find_chain(ranges, Lsn(0x100), Lsn(0x300))
    assert chain is not None and [Path(p).name for p in chain] == [
        batch_dir_name(Lsn(0x100), Lsn(0x200)),
        batch_dir_name(Lsn(0x200), Lsn(0x300)),
    ]
    assert find_chain(ranges, Lsn(0x100), Lsn(0x250)) is None
    assert find_chain(ranges, Lsn(0x300), Lsn(0x300)) is None
    assert staged_ranges(tmp_path, "no_such_slot") == []


def test_checkpoints_module_does_not_import_airflow() -> None:
    import subprocess

    code = (
        "import sys, airflow_provider_pgdecode.capture.reconcile; "
        "sys.exit(1 if any(m == 'airflow' or m.startswith('airflow.') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_slot_without_confirmed_position_counts_as_zero(tmp_path: Path) -> None:
    info = replace(slot_at(None))
    assert reconcile(None, info, tmp_path).start_lsn == Lsn(0)
