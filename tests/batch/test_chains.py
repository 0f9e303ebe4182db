"""Chains of retained batches (batch/chains.py): select_batch_chain / find_initial_load (backfill) and
staged_ranges / find_chain (reconciliation), over batch directories written with BatchManifest.write."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.chains import find_chain, find_initial_load, select_batch_chain, staged_ranges
from airflow_provider_pgdecode.batch.manifest import BatchManifest, batch_dir_name
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import StagingError

SLOT = "pgdecode_shop"


def stage(root: Path, start: int, end: int, *, slot: str = SLOT, changes: int | None = None) -> Path:
    """A complete batch directory holding only its manifest (no tables: enough for chaining)."""
    directory = root / slot / batch_dir_name(Lsn(start), Lsn(end))
    directory.mkdir(parents=True)
    BatchManifest(
        slot=slot,
        plugin="test_decoding",
        database="shop",
        start_lsn=str(Lsn(start)),
        end_lsn=str(Lsn(end)),
        ceiling_lsn=str(Lsn(end)),
        transactions=0,
        changes=(end - start) // 16 if changes is None else changes,
        tables=[],
    ).write(directory)
    return directory


def spans(chain: list[BatchManifest]) -> list[tuple[int, int]]:
    return [(int(Lsn.parse(m.start_lsn)), int(Lsn.parse(m.end_lsn))) for m in chain]


def assert_contiguous(chain: list[BatchManifest]) -> None:
    for before, after in zip(chain, chain[1:]):
        assert before.end_lsn == after.start_lsn


# --- select_batch_chain -----------------------------------------------------------------------


def test_whole_chain_in_lsn_order(tmp_path: Path) -> None:
    ranges = [(0x300, 0x400), (0x100, 0x200), (0x200, 0x300)]
    for start, end in ranges:
        stage(tmp_path, start, end)
    chain = select_batch_chain(tmp_path, SLOT)
    assert spans(chain) == sorted(ranges)
    assert_contiguous(chain)
    assert all(m.path is not None and Path(m.path).parent == tmp_path / SLOT for m in chain)


def test_chain_across_the_32_bit_boundary_of_lsns(tmp_path: Path) -> None:
    # 0/FFFFFFF0 -> 1/10: a string sort of 'X/Y' texts would get this wrong.
    ranges = [(0xFFFFFF00, 0xFFFFFFF0), (0xFFFFFFF0, (1 << 32) + 0x10), ((1 << 32) + 0x10, (2 << 32))]
    for start, end in ranges:
        stage(tmp_path, start, end)
    assert spans(select_batch_chain(tmp_path, SLOT)) == ranges


def test_a_replaced_batch_is_passed_over(tmp_path: Path) -> None:
    # A failed run staged 100-180; a later run re-extracted from 100 with a higher ceiling.
    stage(tmp_path, 0x100, 0x180)
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x300)
    stage(tmp_path, 0x200, 0x250)
    chain = select_batch_chain(tmp_path, SLOT)
    assert spans(chain) == [(0x100, 0x200), (0x200, 0x300)]


def test_from_each_start_the_batch_reaching_furthest_is_taken(tmp_path: Path) -> None:
    ranges = [(0x100, 0x110), (0x100, 0x150), (0x100, 0x140), (0x150, 0x160)]
    for start, end in ranges:
        stage(tmp_path, start, end)
    by_start: dict[int, int] = {}
    for start, end in ranges:
        by_start[start] = max(by_start.get(start, end), end)
    expected, position = [], min(by_start)
    while position in by_start:
        expected.append((position, by_start[position]))
        position = by_start[position]
    assert spans(select_batch_chain(tmp_path, SLOT)) == expected == [(0x100, 0x150), (0x150, 0x160)]


def test_empty_batches_are_not_links(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x200, changes=0)  # a run that found nothing
    stage(tmp_path, 0x200, 0x300)
    stage(tmp_path, 0x300, 0x300, changes=0)
    chain = select_batch_chain(tmp_path, SLOT)
    assert spans(chain) == [(0x100, 0x200), (0x200, 0x300)]
    assert all(m.start_lsn != m.end_lsn for m in chain)


def test_an_empty_batch_at_the_end_of_the_chain_stops_it_quietly(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x200, changes=0)
    assert spans(select_batch_chain(tmp_path, SLOT)) == [(0x100, 0x200)]
    assert spans(select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x200))) == [(0x100, 0x200)]


def test_start_bound(tmp_path: Path) -> None:
    for start, end in [(0x100, 0x200), (0x200, 0x300), (0x300, 0x400)]:
        stage(tmp_path, start, end)
    assert spans(select_batch_chain(tmp_path, SLOT, start_lsn=Lsn(0x200))) == [(0x200, 0x300), (0x300, 0x400)]
    assert spans(select_batch_chain(tmp_path, SLOT, start_lsn=Lsn(0x300))) == [(0x300, 0x400)]


def test_a_start_where_no_batch_starts_is_an_error_naming_it(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x300)
    with pytest.raises(StagingError) as info:
        select_batch_chain(tmp_path, SLOT, start_lsn=Lsn(0x250))
    message = str(info.value)
    assert f"slot {SLOT!r}" in message
    assert "starts at 0/250" in message
    assert "the first retained batch starts at 0/100" in message
    assert "give a start_lsn where a batch starts, or leave it empty" in message
    # At the very end of the chain nothing starts either.
    with pytest.raises(StagingError, match="starts at 0/300"):
        select_batch_chain(tmp_path, SLOT, start_lsn=Lsn(0x300))


def test_end_bound(tmp_path: Path) -> None:
    for start, end in [(0x100, 0x200), (0x200, 0x300), (0x300, 0x400)]:
        stage(tmp_path, start, end)
    assert spans(select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x300))) == [(0x100, 0x200), (0x200, 0x300)]
    # An end inside a batch takes the whole batch holding it.
    assert spans(select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x250))) == [(0x100, 0x200), (0x200, 0x300)]
    assert spans(select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x101))) == [(0x100, 0x200)]
    assert spans(select_batch_chain(tmp_path, SLOT, Lsn(0x200), Lsn(0x400))) == [(0x200, 0x300), (0x300, 0x400)]


def test_an_end_beyond_the_retained_batches_is_an_error(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x300)
    with pytest.raises(StagingError) as info:
        select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x500))
    message = str(info.value)
    assert f"retained batches of slot {SLOT!r} end at 0/300, before 0/500" in message
    assert "retention" in message


def test_a_gap_before_the_end_is_an_error_that_says_where(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x300, 0x400)  # 200-300 was removed (or never staged)
    with pytest.raises(StagingError) as info:
        select_batch_chain(tmp_path, SLOT, end_lsn=Lsn(0x400))
    assert "end at 0/200, before 0/400" in str(info.value)
    # After the gap the chain is whole again.
    assert spans(select_batch_chain(tmp_path, SLOT, start_lsn=Lsn(0x300))) == [(0x300, 0x400)]


def test_a_gap_with_no_end_bound_is_an_error_too(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x300, 0x400)
    with pytest.raises(StagingError, match="0/200"):
        select_batch_chain(tmp_path, SLOT)


def test_no_batches_is_an_error_naming_slot_and_root(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200, slot="another_slot")
    with pytest.raises(StagingError) as info:
        select_batch_chain(tmp_path, SLOT)
    assert f"no retained batch of slot {SLOT!r} under {tmp_path}" in str(info.value)


def test_only_an_empty_batch_is_an_error(tmp_path: Path) -> None:
    stage(tmp_path, 0x200, 0x200, changes=0)
    with pytest.raises(StagingError, match=f"slot {SLOT!r}"):
        select_batch_chain(tmp_path, SLOT)


def test_other_slots_and_temporary_directories_do_not_join_the_chain(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    stage(tmp_path, 0x200, 0x900, slot="another_slot")
    (tmp_path / SLOT / f".tmp-{batch_dir_name(Lsn(0x200), Lsn(0x300))}").mkdir()
    assert spans(select_batch_chain(tmp_path, SLOT)) == [(0x100, 0x200)]


def test_a_damaged_batch_is_reported_not_skipped(tmp_path: Path) -> None:
    stage(tmp_path, 0x100, 0x200)
    broken = stage(tmp_path, 0x200, 0x300)
    (broken / "manifest.json").unlink()
    with pytest.raises(StagingError, match="manifest.json is missing") as info:
        select_batch_chain(tmp_path, SLOT)
    assert str(broken) in str(info.value)


# --- find_initial_load ------------------------------------------------------------------------


def test_find_initial_load(tmp_path: Path) -> None:
    assert find_initial_load(tmp_path, SLOT) is None
    stage(tmp_path, 0x500, 0x600)
    assert find_initial_load(tmp_path, SLOT) is None
    snapshot = stage(tmp_path, 0, 0x500)
    found = find_initial_load(tmp_path, SLOT)
    assert found is not None and found.path == str(snapshot)
    assert (found.start_lsn, found.end_lsn) == ("0/0", "0/500")
    # The initial load heads the whole chain.
    assert spans(select_batch_chain(tmp_path, SLOT)) == [(0, 0x500), (0x500, 0x600)]
    assert find_initial_load(tmp_path, "another_slot") is None


# --- staged_ranges / find_chain ---------------------------------------------------------------


def test_staged_ranges_come_from_directory_names_in_lsn_order(tmp_path: Path) -> None:
    made = [(0x300, 0x400), (0x100, 0x200), ((1 << 32), (1 << 32) + 1), (0x200, 0x200)]
    for start, end in made:
        stage(tmp_path, start, end)
    (tmp_path / SLOT / ".tmp-whatever").mkdir()
    ranges = staged_ranges(tmp_path, SLOT)
    assert [(int(s), int(e)) for s, e, _ in ranges] == sorted(made)
    assert all(isinstance(s, Lsn) and isinstance(e, Lsn) for s, e, _ in ranges)
    assert all(Path(path).name == batch_dir_name(s, e) for s, e, path in ranges)
    assert staged_ranges(tmp_path, "nobody") == []


def chain_spans(paths: list[str] | None) -> list[tuple[int, int]] | None:
    if paths is None:
        return None
    return [tuple(int(part, 16) for part in p.name.split("-")) for p in map(Path, paths)]  # type: ignore[misc]


def reference_chains(ranges: list[tuple[int, int]], start: int, target: int) -> list[list[tuple[int, int]]]:
    """Every chain of non-empty batches from start to exactly target (brute force)."""
    if start == target:
        return [[]]
    out = []
    for s, e in ranges:
        if s == start and e > s and e <= target:
            out += [[(s, e), *rest] for rest in reference_chains(ranges, e, target)]
    return out


def test_find_chain_backtracks_when_the_longest_step_leads_nowhere(tmp_path: Path) -> None:
    made = [(0x100, 0x200), (0x200, 0x250), (0x100, 0x150), (0x150, 0x300)]
    for start, end in made:
        stage(tmp_path, start, end)
    ranges = staged_ranges(tmp_path, SLOT)
    chain = chain_spans(find_chain(ranges, Lsn(0x100), Lsn(0x300)))
    assert chain == [(0x100, 0x150), (0x150, 0x300)]
    assert chain in reference_chains(made, 0x100, 0x300)
    assert chain_spans(find_chain(ranges, Lsn(0x100), Lsn(0x250))) == [(0x100, 0x200), (0x200, 0x250)]


def test_find_chain_prefers_the_longest_steps(tmp_path: Path) -> None:
    made = [(0x100, 0x180), (0x180, 0x200), (0x100, 0x200), (0x200, 0x300)]
    for start, end in made:
        stage(tmp_path, start, end)
    chain = chain_spans(find_chain(staged_ranges(tmp_path, SLOT), Lsn(0x100), Lsn(0x300)))
    candidates = reference_chains(made, 0x100, 0x300)
    assert len(candidates) == 2
    assert chain == min(candidates, key=len) == [(0x100, 0x200), (0x200, 0x300)]


def test_find_chain_never_steps_on_empty_batches_and_needs_an_exact_end(tmp_path: Path) -> None:
    made = [(0x100, 0x100), (0x100, 0x200), (0x200, 0x200), (0x200, 0x300)]
    for start, end in made:
        stage(tmp_path, start, end)
    ranges = staged_ranges(tmp_path, SLOT)
    chain = find_chain(ranges, Lsn(0x100), Lsn(0x300))
    assert chain_spans(chain) == [(0x100, 0x200), (0x200, 0x300)]
    assert find_chain(ranges, Lsn(0x100), Lsn(0x280)) is None  # inside a batch: not a chain end
    assert find_chain(ranges, Lsn(0x100), Lsn(0x400)) is None  # beyond the last batch
    assert find_chain(ranges, Lsn(0x150), Lsn(0x300)) is None  # no batch starts there
    assert find_chain(ranges, Lsn(0x300), Lsn(0x200)) is None  # backwards


def test_find_chain_through_a_gap_is_none(tmp_path: Path) -> None:
    made = [(0x100, 0x200), (0x300, 0x400)]
    for start, end in made:
        stage(tmp_path, start, end)
    ranges = staged_ranges(tmp_path, SLOT)
    assert find_chain(ranges, Lsn(0x100), Lsn(0x400)) is None
    assert reference_chains(made, 0x100, 0x400) == []
    assert chain_spans(find_chain(ranges, Lsn(0x300), Lsn(0x400))) == [(0x300, 0x400)]


def test_find_chain_agrees_with_brute_force_on_a_tangle(tmp_path: Path) -> None:
    made = [(a, b) for a in range(0x100, 0x600, 0x100) for b in range(a, 0x700, 0x100) if (a * 7 + b * 3) % 5 != 0]
    for start, end in made:
        stage(tmp_path, start, end)
    ranges = staged_ranges(tmp_path, SLOT)
    for start in range(0x100, 0x700, 0x100):
        for target in range(start + 0x100, 0x700, 0x100):
            found = chain_spans(find_chain(ranges, Lsn(start), Lsn(target)))
            every = reference_chains(made, start, target)
            if every:
                assert found in every, (start, target)
            else:
                assert found is None, (start, target)
