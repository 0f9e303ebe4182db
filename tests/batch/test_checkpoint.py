"""The checkpoint one run hands to the next: dict form, from a manifest, pending prepared transactions."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, batch_dir_name
from airflow_provider_pgdecode.decoding.events import UNCHANGED_TOAST, Change, Operation, RowImage, Truncate
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool
from airflow_provider_pgdecode.errors import StagingError

SLOT = "pgdecode_orders"


def items(count: int, xid: int) -> list[Any]:
    out: list[Any] = []
    for i in range(count):
        new = RowImage(("id", "big"), ("integer", "text"), (str(i), UNCHANGED_TOAST if i % 2 else f"v{i}"))
        out.append(Change(Lsn(0x150 + i), xid, Operation.UPDATE if i else Operation.INSERT, "public", "t", None, new))
    out.append(Truncate(Lsn(0x150 + count), xid, (("public", "t"),)))
    return out


def stage_with_pending(root: Path, prepared: dict[str, list[Any]]) -> Path:
    """A complete batch whose manifest lists pending prepared transactions (gid -> items) saved under prepared/."""
    directory = root / SLOT / batch_dir_name(Lsn(0x100), Lsn(0x200))
    (directory / "prepared").mkdir(parents=True)
    pending = []
    for number, (gid, spooled) in enumerate(prepared.items()):
        xid = 900 + number
        spool = ItemSpool(memory_items=2)
        for item in spooled:
            spool.append(item)
        relative = f"prepared/{xid}-{number}.jsonl.gz"
        count = spool.save(directory / relative)
        spool.discard()
        pending.append(
            {
                "gid": gid,
                "xid": xid,
                "begin_lsn": "0/140",
                "prepare_lsn": "0/1A0",
                "prepare_time": "2026-11-22T10:00:00+00:00",
                "origin": None,
                "items": count,
                "path": relative,
            }
        )
    BatchManifest(
        slot=SLOT,
        plugin="pgoutput",
        database="shop",
        start_lsn="0/100",
        end_lsn="0/200",
        ceiling_lsn="0/210",
        transactions=0,
        changes=0,
        tables=[],
        prepared_pending=pending,
        snapshots={"req-1": {"public.t": {"last_key": [5], "done": False}}},
    ).write(directory)
    return directory


def test_to_dict_from_dict_round_trip_through_json() -> None:
    checkpoint = Checkpoint(
        SLOT,
        Lsn.parse("1A/2B3C4D5E"),
        [{"gid": "g'1", "xid": 7, "path": "/staging/x/prepared/7-a.jsonl.gz", "items": 3}],
        "/staging/x",
        {"req": {"done": True}},
        {"16385": {"names": [["public", "orders"]], "delta_table": ["public", "orders"]}},
    )
    data = checkpoint.to_dict()
    assert data["end_lsn"] == "1A/2B3C4D5E"  # LSNs travel as PostgreSQL's text form
    wire = json.loads(json.dumps(data))  # XCom is JSON
    back = Checkpoint.from_dict(wire)
    assert back == checkpoint
    assert isinstance(back.end_lsn, Lsn)


def test_from_dict_fills_optional_fields() -> None:
    back = Checkpoint.from_dict({"slot": SLOT, "end_lsn": "0/10"})
    assert back == Checkpoint(SLOT, Lsn(0x10), [], None, {}, {})
    # null means empty as well
    assert Checkpoint.from_dict({"slot": SLOT, "end_lsn": "0/10", "prepared_pending": None, "snapshots": None}) == back


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"end_lsn": "0/10"}, "'slot'"),
        ({"slot": SLOT}, "'end_lsn'"),
        ({"slot": SLOT, "end_lsn": "ten"}, "not an LSN"),
        ({"slot": SLOT, "end_lsn": "0/XYZ"}, "not an LSN"),
        ({"slot": SLOT, "end_lsn": "0/10", "prepared_pending": 5}, "int"),
        ({"slot": SLOT, "end_lsn": "0/10", "snapshots": [1, 2]}, "snapshots|dictionary|cannot convert"),
        ({"slot": SLOT, "end_lsn": "0/10", "snapshots": "ab"}, "dictionary update sequence"),
        (["not", "a", "dict"], "indices|list"),
    ],
)
def test_malformed_dicts_raise_staging_error_naming_the_problem(data: Any, problem: str) -> None:
    with pytest.raises(StagingError, match="malformed checkpoint") as info:
        Checkpoint.from_dict(data)
    assert re.search(problem, str(info.value)), str(info.value)
    assert repr(data) in str(info.value)  # the offending value is shown


@pytest.mark.parametrize("end_lsn", [None, 16])
def test_non_text_end_lsn_is_a_staging_error(end_lsn: Any) -> None:
    with pytest.raises(StagingError, match="malformed checkpoint"):
        Checkpoint.from_dict({"slot": SLOT, "end_lsn": end_lsn})


def test_from_manifest_makes_prepared_paths_absolute(tmp_path: Path) -> None:
    directory = stage_with_pending(tmp_path, {"tx-1": items(3, 900), "tx-2": items(1, 901)})
    manifest = BatchManifest.read(directory)
    checkpoint = Checkpoint.from_manifest(manifest)
    assert checkpoint.slot == SLOT
    assert checkpoint.end_lsn == Lsn(0x200)
    assert checkpoint.batch_path == str(directory)
    assert checkpoint.snapshots == {"req-1": {"public.t": {"last_key": [5], "done": False}}}
    paths = [p["path"] for p in checkpoint.prepared_pending]
    assert paths == [str(directory / "prepared/900-0.jsonl.gz"), str(directory / "prepared/901-1.jsonl.gz")]
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in paths)
    # The manifest itself keeps its relative paths (a batch can be moved as a whole).
    assert [p["path"] for p in manifest.prepared_pending] == ["prepared/900-0.jsonl.gz", "prepared/901-1.jsonl.gz"]
    # Other header fields are carried unchanged.
    assert [(p["gid"], p["xid"], p["items"]) for p in checkpoint.prepared_pending] == [
        ("tx-1", 900, 4),
        ("tx-2", 901, 2),
    ]


def test_from_manifest_needs_a_manifest_read_from_disk() -> None:
    manifest = BatchManifest(
        slot=SLOT,
        plugin="test_decoding",
        database="shop",
        start_lsn="0/1",
        end_lsn="0/2",
        ceiling_lsn="0/2",
        transactions=0,
        changes=0,
        tables=[],
    )
    with pytest.raises(StagingError, match="read from its batch directory"):
        Checkpoint.from_manifest(manifest)


def test_pending_prepared_reads_the_spooled_items(tmp_path: Path) -> None:
    first, second = items(5, 900), items(2, 901)
    directory = stage_with_pending(tmp_path, {"tx-1": first, "tx-2": second})
    # Through XCom and back, as the next run sees it.
    checkpoint = Checkpoint.from_dict(
        json.loads(json.dumps(Checkpoint.from_manifest(BatchManifest.read(directory)).to_dict()))
    )
    pending = checkpoint.pending_prepared()
    assert [(p.gid, p.xid) for p in pending] == [("tx-1", 900), ("tx-2", 901)]
    assert [list(p.items) for p in pending] == [first, second]
    assert [len(p.items) for p in pending] == [6, 3]
    assert pending[0].begin_lsn == Lsn(0x140) and pending[0].prepare_lsn == Lsn(0x1A0)
    assert pending[0].prepare_time == datetime(2026, 11, 22, 10, tzinfo=UTC)
    assert pending[0].key == ("tx-1", 900)


def test_pending_prepared_names_a_spooled_file_that_is_gone(tmp_path: Path) -> None:
    directory = stage_with_pending(tmp_path, {"tx-1": items(2, 900), "tx-gone": items(2, 901)})
    checkpoint = Checkpoint.from_manifest(BatchManifest.read(directory))
    gone = Path(checkpoint.prepared_pending[1]["path"])
    gone.unlink()
    with pytest.raises(StagingError) as info:
        checkpoint.pending_prepared()
    message = str(info.value)
    assert "'tx-gone'" in message and "xid 901" in message
    assert str(gone) in message
    assert "no longer exists" in message and "retention" in message


def test_a_checkpoint_without_pending_transactions_has_none() -> None:
    assert Checkpoint(SLOT, Lsn(1)).pending_prepared() == []
