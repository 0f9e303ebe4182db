"""ItemSpool: bounded memory, spilling past its limit, order and equality, save/load, cleanup."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from airflow_provider_pgdecode.decoding.events import (
    UNCHANGED_TOAST,
    Change,
    Message,
    Operation,
    RowImage,
    TransactionItem,
    Truncate,
    item_from_json,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool


def make_items(count: int, start: int = 0) -> list[TransactionItem]:
    """A mix of every item kind, each distinct (its LSN and values follow its index)."""
    items: list[TransactionItem] = []
    for i in range(start, start + count):
        if i % 7 == 3:
            items.append(Truncate(Lsn(0x1000 + i), 5, (("public", f"t{i}"),), cascade=bool(i % 2)))
        elif i % 5 == 4:
            items.append(Message(Lsn(0x1000 + i), 5, True, "pfx", bytes([i % 256, 0, 255])))
        else:
            new = RowImage(
                ("id", "big", "note"),
                ("integer", "text", "text"),
                (str(i), UNCHANGED_TOAST if i % 3 == 0 else "x" * (i % 11), None if i % 2 else f"n'{i}\n"),
            )
            items.append(Change(Lsn(0x1000 + i), 5, Operation.UPDATE, "public", "t", None, new))
    return items


def spill_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("pgdecode-spool-*"))


def test_memory_items_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ItemSpool(0)


def test_below_the_limit_nothing_touches_disk(tmp_path: Path) -> None:
    spool = ItemSpool(memory_items=10, spill_dir=tmp_path)
    items = make_items(9)
    for item in items:
        spool.append(item)
    assert not spool.spilled
    assert spill_files(tmp_path) == []
    assert len(spool) == 9
    assert list(spool) == items


def test_past_the_limit_it_spills_and_gives_everything_back_in_order(tmp_path: Path) -> None:
    spool = ItemSpool(memory_items=4, spill_dir=tmp_path)
    items = make_items(23)
    for count, item in enumerate(items, 1):
        spool.append(item)
        assert len(spool) == count
    assert spool.spilled
    assert len(spill_files(tmp_path)) == 1  # one file per spool, appended to
    back = list(spool)
    assert back == items
    # Iterating does not consume: a second pass gives the same items.
    assert list(spool) == items
    # The unchanged-TOAST marker survives the trip through the file as the marker itself.
    toast_positions = [
        i for i, it in enumerate(items) if isinstance(it, Change) and it.new.values[1] is UNCHANGED_TOAST
    ]
    assert toast_positions and all(back[i].new.values[1] is UNCHANGED_TOAST for i in toast_positions)


def test_memory_stays_bounded_by_the_limit(tmp_path: Path) -> None:
    limit = 5
    spool = ItemSpool(memory_items=limit, spill_dir=tmp_path)
    most_in_memory = 0
    for item in make_items(200):
        spool.append(item)
        most_in_memory = max(most_in_memory, len(spool._memory))
    assert most_in_memory < limit
    assert len(spool) == 200
    assert len(spool._memory) == 200 % limit


def test_appending_after_reading_keeps_order(tmp_path: Path) -> None:
    spool = ItemSpool(memory_items=3, spill_dir=tmp_path)
    first, second = make_items(7), make_items(8, start=7)
    for item in first:
        spool.append(item)
    assert list(spool) == first
    for item in second:
        spool.append(item)
    assert list(spool) == first + second


def test_discard_removes_the_spill_file_and_frees_memory(tmp_path: Path) -> None:
    spool = ItemSpool(memory_items=2, spill_dir=tmp_path)
    for item in make_items(5):
        spool.append(item)
    assert len(spill_files(tmp_path)) == 1
    spool.discard()
    assert spill_files(tmp_path) == []
    assert len(spool) == 0 and list(spool) == []
    spool.discard()  # twice is harmless


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    spool = ItemSpool(memory_items=4, spill_dir=spill)
    items = make_items(17)
    for item in items:
        spool.append(item)
    saved = tmp_path / "900-g1.jsonl.gz"
    assert spool.save(saved) == 17
    # The saved file is gzip JSON lines, one item per line, in order.
    with gzip.open(saved, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert [item_from_json(json.loads(line)) for line in lines] == items

    loaded = ItemSpool.load(saved, 17, memory_items=4)
    assert len(loaded) == 17
    assert list(loaded) == items
    # New items go after the loaded ones.
    more = make_items(6, start=17)
    for item in more:
        loaded.append(item)
    assert len(loaded) == 23
    assert list(loaded) == items + more
    loaded.discard()
    assert saved.is_file()  # discard never removes the file a spool was loaded from
    spool.discard()
    assert spill_files(spill) == []


def test_save_is_reproducible(tmp_path: Path) -> None:
    one, two = ItemSpool(3, tmp_path), ItemSpool(100, tmp_path)
    for item in make_items(10):
        one.append(item)
        two.append(item)
    # The same file name in two batch directories (a range extracted twice).
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    one.save(tmp_path / "first" / "900-g.jsonl.gz")
    two.save(tmp_path / "second" / "900-g.jsonl.gz")
    # Same items, same bytes, however they were held and whenever written (no mtime in the gzip header).
    assert (tmp_path / "first" / "900-g.jsonl.gz").read_bytes() == (tmp_path / "second" / "900-g.jsonl.gz").read_bytes()
    assert (tmp_path / "first" / "900-g.jsonl.gz").read_bytes()[4:8] == bytes(4)  # gzip MTIME field: zero


def test_an_empty_spool_saves_and_loads(tmp_path: Path) -> None:
    assert ItemSpool(2, tmp_path).save(tmp_path / "empty.gz") == 0
    assert list(ItemSpool.load(tmp_path / "empty.gz", 0)) == []


def test_load_of_a_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "gone.jsonl.gz"
    with pytest.raises(FileNotFoundError, match="spooled transaction data is missing: .*gone.jsonl.gz"):
        ItemSpool.load(missing, 3)


@pytest.mark.parametrize("cut", [0, 1, 2, 5, 6, 9, 10, 13])
def test_truncate_keeps_exactly_the_first_items(tmp_path: Path, cut: int) -> None:
    # 13 items with a limit of 4: 12 spilled, 1 in memory; cuts fall in the file and in memory.
    spool = ItemSpool(memory_items=4, spill_dir=tmp_path)
    items = make_items(13)
    for item in items:
        spool.append(item)
    spool.truncate(cut)
    assert len(spool) == cut
    assert list(spool) == items[:cut]
    assert len(spill_files(tmp_path)) <= 1  # the old spill file is not left behind
    later = make_items(3, start=100)
    for item in later:
        spool.append(item)
    assert list(spool) == items[:cut] + later
    spool.discard()
    assert spill_files(tmp_path) == []


def test_truncate_past_the_end_changes_nothing(tmp_path: Path) -> None:
    spool = ItemSpool(memory_items=3, spill_dir=tmp_path)
    items = make_items(5)
    for item in items:
        spool.append(item)
    spool.truncate(5)
    spool.truncate(50)
    assert list(spool) == items


def test_truncate_inside_loaded_data_leaves_the_saved_file_alone(tmp_path: Path) -> None:
    source = ItemSpool(100, tmp_path)
    items = make_items(8)
    for item in items:
        source.append(item)
    saved = tmp_path / "saved.gz"
    source.save(saved)
    before = saved.read_bytes()
    loaded = ItemSpool.load(saved, 8, memory_items=3)
    loaded.truncate(5)
    assert len(loaded) == 5
    assert list(loaded) == items[:5]
    assert saved.read_bytes() == before
