"""The history and soft-delete sources (spark/history.py) on small DataFrames, on a real local Spark.

Every check compares with the semantics computed here in plain Python: replaying the changes one
transaction at a time, each committed state of a key closes the key's current version and (when
the key is alive) opens a new one; a soft-delete table keeps the last state of each key, a
removed key as a tombstone with its last committed values. The functions' output is applied to
the table as the merge job's MERGE does (also in plain Python), and must give the same table.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import functions as F

from airflow_provider_pgdecode.spark import history
from airflow_provider_pgdecode.spark.collapse import CollapseInput, effects_of, keep_flag_name
from airflow_provider_pgdecode.spark.history import (
    ACTION,
    CLOSE,
    KNOWN,
    VERSION,
    Truncate,
    committed_states,
    current_rows,
    fill_from_target,
    latest_states,
    values_as_of,
)
from tests.spark.test_collapse import EVENT_SCHEMA, VALUES, ev, keep_moves, spec_for

pytestmark = pytest.mark.spark

BASE = datetime(2026, 1, 1)
META = ("_pg_commit_lsn", "_pg_commit_time", "_pg_xid")
HISTORY_META = ("_pg_valid_from_lsn", "_pg_valid_to_lsn", "_pg_valid_from", "_pg_valid_to", "_pg_current")
COLUMNS = ("id", *VALUES, *META)
HISTORY_SCHEMA = (
    "id int, v string, big string, n int, _pg_commit_lsn bigint, _pg_commit_time timestamp, _pg_xid bigint,"
    " _pg_valid_from_lsn bigint, _pg_valid_to_lsn bigint, _pg_valid_from timestamp, _pg_valid_to timestamp,"
    " _pg_current boolean"
)
SOFT_SCHEMA = (
    "id int, v string, big string, n int, _pg_commit_lsn bigint, _pg_commit_time timestamp, _pg_xid bigint,"
    " _pg_deleted boolean"
)


def at(lsn: int) -> datetime:
    """The commit time of the transaction committed at ``lsn``, in these tests."""
    return BASE + timedelta(seconds=lsn)


def change(op: str, lsn: int, seq: int, key: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """One staged change (:func:`tests.spark.test_collapse.ev`) with its transaction's commit time."""
    row = ev(op, lsn, seq, key, **kwargs)
    row["_pg_commit_time"] = at(lsn)
    return row


def version(key: int, v: str, big: str, n: int, lsn: int, to: int | None = None) -> dict[str, Any]:
    """A history row valid from ``lsn`` to ``to`` (None: current)."""
    return {
        "id": key,
        "v": v,
        "big": big,
        "n": n,
        "_pg_commit_lsn": lsn,
        "_pg_commit_time": at(lsn),
        "_pg_xid": lsn // 16,
        "_pg_valid_from_lsn": lsn,
        "_pg_valid_to_lsn": to,
        "_pg_valid_from": at(lsn),
        "_pg_valid_to": None if to is None else at(to),
        "_pg_current": to is None,
    }


def live(key: int, v: str, big: str, n: int, lsn: int = 1, deleted: bool = False) -> dict[str, Any]:
    """A soft-delete row."""
    return {"id": key, "v": v, "big": big, "n": n, **meta(lsn), "_pg_deleted": deleted}


def meta(lsn: int) -> dict[str, Any]:
    return {"_pg_commit_lsn": lsn, "_pg_commit_time": at(lsn), "_pg_xid": lsn // 16}


# --- the reference: PostgreSQL's committed states, in plain Python ------------------------------


def transactions(events: list[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    by_lsn: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        by_lsn.setdefault(e["__lsn"], []).append(e)
    return [(lsn, sorted(by_lsn[lsn], key=lambda e: e["__seq"])) for lsn in sorted(by_lsn)]


def apply_transaction(table: dict[int, dict[str, Any]], txn: list[dict[str, Any]]) -> set[int]:
    """Apply one transaction's changes to ``table`` (key -> values); return the keys it touched."""
    touched: set[int] = set()
    for e in txn:
        op = e["__op"]
        if op == "T":
            touched |= set(table)
            table.clear()
        elif op == "D":
            touched.add(e["__old_0"])
            table.pop(e["__old_0"], None)
        elif op == "I":
            touched.add(e["id"])
            table[e["id"]] = {c: e[c] for c in VALUES}
        else:
            old_key = e["__old_0"] if e["__old_0"] is not None else e["id"]
            before = table.pop(old_key, {})
            touched |= {old_key, e["id"]}
            table[e["id"]] = {c: (before.get(c) if c in e["__keep"] else e[c]) for c in VALUES}
    return touched


def expected_history(start: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history table after ``events``: each committed state of a key closes its current version
    at that commit and, when the key is alive after it, opens a new one."""
    rows = [dict(r) for r in start]
    current = {r["id"]: r for r in rows if r["_pg_current"]}
    table = {k: {c: r[c] for c in VALUES} for k, r in current.items()}
    for lsn, txn in transactions(events):
        for key in sorted(apply_transaction(table, txn)):
            if key in current:
                closed = current.pop(key)
                closed.update({"_pg_valid_to_lsn": lsn, "_pg_valid_to": at(lsn), "_pg_current": False})
            if key in table:
                opened = version(key, table[key]["v"], table[key]["big"], table[key]["n"], lsn)
                opened["_pg_xid"] = txn[0]["_pg_xid"]
                rows.append(opened)
                current[key] = opened
    return rows


def expected_soft(start: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The soft-delete table after ``events``: each committed state of a key is its row; a key
    removed while it was a row becomes a tombstone with its last values."""
    soft = {r["id"]: dict(r) for r in start}
    table = {k: {c: r[c] for c in VALUES} for k, r in soft.items() if not r["_pg_deleted"]}
    for lsn, txn in transactions(events):
        for key in apply_transaction(table, txn):
            stamp = {**meta(lsn), "_pg_xid": txn[0]["_pg_xid"]}
            if key in table:
                soft[key] = {"id": key, **table[key], **stamp, "_pg_deleted": False}
            elif key in soft and not soft[key]["_pg_deleted"]:
                soft[key] = {**soft[key], **stamp, "_pg_deleted": True}
    return soft


# --- the merge job's MERGEs, in plain Python -----------------------------------------------------


def apply_history(
    start: list[dict[str, Any]], source: list[dict[str, Any]], truncations: list[Truncate]
) -> list[dict[str, Any]]:
    """What the history MERGE does with its source: a close row ends the key's current version,
    a TRUNCATE every other current version, version rows are inserted."""
    rows = [dict(r) for r in start]
    closes: dict[int, dict[str, Any]] = {}
    for r in source:
        if r[ACTION] == CLOSE:
            assert r["id"] not in closes, f"two close rows for key {r['id']}"
            closes[r["id"]] = r
    assert len([r for r in rows if r["_pg_current"]]) == len({r["id"] for r in rows if r["_pg_current"]})
    for r in rows:
        if not r["_pg_current"]:
            continue
        if r["id"] in closes:
            end = closes[r["id"]]
            assert r["_pg_commit_lsn"] < end["_pg_valid_to_lsn"]
            r.update({"_pg_valid_to_lsn": end["_pg_valid_to_lsn"], "_pg_valid_to": end["_pg_valid_to"]})
            r["_pg_current"] = False
        elif truncations:
            first = min(truncations)
            r.update({"_pg_valid_to_lsn": first.lsn, "_pg_valid_to": at(first.lsn), "_pg_current": False})
    rows += [{c: r[c] for c in (*COLUMNS, *HISTORY_META)} for r in source if r[ACTION] == VERSION]
    return rows


def apply_soft(
    start: list[dict[str, Any]], source: list[dict[str, Any]], spec: CollapseInput, truncations: list[Truncate]
) -> dict[int, dict[str, Any]]:
    """What the soft-delete MERGE (merge_job.run_merge) does with its source."""
    soft = {r["id"]: dict(r) for r in start}
    keys = [r["id"] for r in source]
    assert len(keys) == len(set(keys)), f"more than one row per key: {sorted(keys)}"
    for r in source:
        key, t = r["id"], soft.get(r["id"])
        row = {c: r[c] for c in (*COLUMNS, "_pg_deleted")}
        if t is not None:
            if not t["_pg_commit_lsn"] < r["_pg_commit_lsn"]:
                continue
            if r[KNOWN]:
                for index, column in enumerate(spec.keep_columns):
                    if r[keep_flag_name(index)]:
                        row[column] = t[column]  # CASE WHEN keep THEN t.column
                soft[key] = row
            elif not t["_pg_deleted"]:
                soft[key] = {**t, **{c: r[c] for c in META}, "_pg_deleted": True}
        elif r[KNOWN]:
            soft[key] = row
    if truncations:
        first = min(truncations)
        for key, t in soft.items():
            if key not in keys and not t["_pg_deleted"] and t["_pg_commit_lsn"] < first.lsn:
                soft[key] = {**t, **meta(first.lsn), "_pg_xid": first.xid, "_pg_deleted": True}
    return soft


# --- running the functions ----------------------------------------------------------------------


def frame_of(spark, events: list[dict[str, Any]]):
    shuffled = list(events)
    random.Random(len(events)).shuffle(shuffled)  # input order must not matter
    return spark.createDataFrame(shuffled, EVENT_SCHEMA)


def truncations_of(frame) -> list[Truncate]:
    """The TRUNCATEs of the events as the merge job's profile collects them."""
    rows = frame.where(F.col("__op") == "T").select("__lsn", "__seq", F.unix_micros("_pg_commit_time"), "_pg_xid")
    return sorted(Truncate(*r) for r in rows.collect())


def states_of(spark, events: list[dict[str, Any]], *, lineage: bool):
    frame = frame_of(spark, events)
    spec = spec_for(events)
    truncations = truncations_of(frame)
    states = committed_states(values_as_of(effects_of(frame, spec), spec, lineage=lineage), spec, truncations)
    return spec, states, truncations


def lineage_modes(events: list[dict[str, Any]]) -> list[bool]:
    """As the merge job chooses (lineage only when a key change keeps a column); where a column is
    kept without one, both ways are checked."""
    return [True] if keep_moves(events) else [False, True] if spec_for(events).keep_columns else [False]


def check_history(spark, start: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    expected = sorted(expected_history(start, events), key=_version_order)
    rows: list[dict[str, Any]] = []
    for lineage in lineage_modes(events):
        spec, states, truncations = states_of(spark, events, lineage=lineage)
        new_versions = history.versions(states, spec)
        if spec.keep_columns:
            target = spark.createDataFrame([r for r in start if r["_pg_current"]] or [], HISTORY_SCHEMA)
            new_versions = fill_from_target(new_versions, target, spec)
        columns = [*COLUMNS, *HISTORY_META]
        source = history.merge_source(new_versions, history.closes(states, spec, truncations), columns)
        rows = sorted(apply_history(start, [r.asDict() for r in source.collect()], truncations), key=_version_order)
        assert rows == expected, f"lineage={lineage}"
    return rows


def check_soft(spark, start: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    expected = expected_soft(start, events)
    result: dict[int, dict[str, Any]] = {}
    for lineage in lineage_modes(events):
        spec, states, truncations = states_of(spark, events, lineage=lineage)
        source = latest_states(states, spec, truncations)
        if lineage and start:
            target = spark.createDataFrame(start, SOFT_SCHEMA)
            source = fill_from_target(source, target, spec, other_keys_only=True)
        result = apply_soft(start, [r.asDict() for r in source.collect()], spec, truncations)
        assert result == expected, f"lineage={lineage}"
    return result


def _version_order(row: dict[str, Any]) -> tuple[int, int]:
    return row["id"], row["_pg_valid_from_lsn"]


def versions_of(rows: list[dict[str, Any]], key: int) -> list[tuple[Any, ...]]:
    return [
        (r["v"], r["big"], r["n"], r["_pg_valid_from_lsn"], r["_pg_valid_to_lsn"], r["_pg_current"])
        for r in rows
        if r["id"] == key
    ]


START = [
    version(1, "old1", "B1", 1, 0x10, to=0x20),
    version(1, "t1", "B1", 10, 0x20),
    version(2, "t2", "B2", 20, 0x20),
    version(3, "t3", "B3", 30, 0x20),
]


# --- history ------------------------------------------------------------------------------------


def test_several_changes_to_a_key_in_one_transaction_are_one_version(spark) -> None:
    events = [
        change("U", 0x100, 0, 1, v="a", big="x", n=1),
        change("U", 0x100, 1, 1, v="b", big="y", n=2),
        change("U", 0x200, 0, 1, v="c", big="z", n=3),
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 1) == [
        ("old1", "B1", 1, 0x10, 0x20, False),
        ("t1", "B1", 10, 0x20, 0x100, False),
        ("b", "y", 2, 0x100, 0x200, False),
        ("c", "z", 3, 0x200, None, True),
    ]


def test_a_delete_closes_a_key_change_moves_it_and_insert_then_delete_leaves_nothing(spark) -> None:
    events = [
        change("D", 0x100, 0, old=2),
        change("U", 0x200, 0, 7, old=3, v="moved", big="M", n=7),
        change("I", 0x300, 0, 9, v="gone", big="G", n=9),
        change("D", 0x300, 1, old=9),
        change("I", 0x400, 0, 2, v="again", big="A", n=2),
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 2) == [("t2", "B2", 20, 0x20, 0x100, False), ("again", "A", 2, 0x400, None, True)]
    assert versions_of(rows, 3) == [("t3", "B3", 30, 0x20, 0x200, False)]
    assert versions_of(rows, 7) == [("moved", "M", 7, 0x200, None, True)]
    assert versions_of(rows, 9) == []


def test_a_truncate_closes_every_current_version_and_rows_after_it_open_new_ones(spark) -> None:
    events = [
        change("I", 0x100, 0, 5, v="five", big="F", n=5),
        change("I", 0x200, 0, 6, v="six", big="S", n=6),  # inserted, then truncated in its transaction
        change("T", 0x200, 1),
        change("I", 0x200, 2, 1, v="after", big="A", n=1),
        change("U", 0x300, 0, 1, v="later", big="L", n=2),
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 5) == [("five", "F", 5, 0x100, 0x200, False)]
    assert versions_of(rows, 6) == []
    assert versions_of(rows, 2) == [("t2", "B2", 20, 0x20, 0x200, False)]
    assert versions_of(rows, 1)[-3:] == [
        ("t1", "B1", 10, 0x20, 0x200, False),
        ("after", "A", 1, 0x200, 0x300, False),
        ("later", "L", 2, 0x300, None, True),
    ]
    valid_to = {(r["id"], r["_pg_valid_from_lsn"]): r["_pg_valid_to"] for r in rows}
    assert valid_to[(2, 0x20)] == at(0x200) and valid_to[(5, 0x100)] == at(0x200)


def test_two_truncates_in_one_run(spark) -> None:
    events = [
        change("T", 0x100, 0),
        change("I", 0x200, 0, 4, v="four", big="F", n=4),
        change("T", 0x300, 0),
        change("I", 0x400, 0, 4, v="four again", big="F2", n=4),
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 4) == [("four", "F", 4, 0x200, 0x300, False), ("four again", "F2", 4, 0x400, None, True)]
    assert versions_of(rows, 3) == [("t3", "B3", 30, 0x20, 0x100, False)]


def test_unchanged_toast_takes_the_previous_versions_value(spark) -> None:
    events = [
        change("U", 0x100, 0, 1, keep=("big",), v="a", n=1),  # big from Delta's current version
        change("U", 0x200, 0, 2, v="b", big="NEW", n=2),
        change("U", 0x300, 0, 2, keep=("big",), v="c", n=3),  # big from the run's previous version
        change("I", 0x400, 0, 8, v="i", big="I8", n=8),
        change("U", 0x400, 1, 8, keep=("big",), v="j", n=9),  # same transaction: one version
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 1)[-1] == ("a", "B1", 1, 0x100, None, True)
    assert versions_of(rows, 2)[-2:] == [("b", "NEW", 2, 0x200, 0x300, False), ("c", "NEW", 3, 0x300, None, True)]
    assert versions_of(rows, 8) == [("j", "I8", 9, 0x400, None, True)]


def test_unchanged_toast_follows_the_row_across_key_changes(spark) -> None:
    events = [
        change("U", 0x100, 0, 11, old=1, keep=("big",), v="m1", n=1),  # big from key 1's version
        change("U", 0x200, 0, 12, old=11, keep=("big",), v="m2", n=2),
        change("U", 0x300, 0, 1, old=2, keep=("big",), v="m3", n=3),  # key 1 again, with key 2's row
        change("U", 0x300, 1, 2, old=3, keep=("big",), v="m4", n=4),  # key 2, with key 3's row
    ]
    rows = check_history(spark, START, events)
    assert versions_of(rows, 11) == [("m1", "B1", 1, 0x100, 0x200, False)]
    assert versions_of(rows, 12) == [("m2", "B1", 2, 0x200, None, True)]
    assert versions_of(rows, 1)[-1] == ("m3", "B2", 3, 0x300, None, True)
    assert versions_of(rows, 2)[-1] == ("m4", "B3", 4, 0x300, None, True)


def test_into_an_empty_table_every_version_is_new(spark) -> None:
    events = [
        change("I", 0x100, 0, 1, v="a", big="x", n=1),
        change("U", 0x200, 0, 1, keep=("big",), v="b", n=2),
        change("D", 0x300, 0, old=1),
    ]
    rows = check_history(spark, [], events)
    assert versions_of(rows, 1) == [("a", "x", 1, 0x100, 0x200, False), ("b", "x", 2, 0x200, 0x300, False)]


def random_events(rng: random.Random, keys: set[int], *, truncates: bool) -> list[dict[str, Any]]:
    """Valid random transactions (inserts, updates with and without key changes and unchanged
    TOAST, deletes, and TRUNCATEs) over the live ``keys``."""
    alive = set(keys)
    free = iter(range(100, 1000))
    events: list[dict[str, Any]] = []
    lsn = 0x100
    for _ in range(rng.randint(4, 9)):
        lsn += 0x10 * rng.randint(1, 4)
        for seq in range(rng.randint(1, 6)):
            choice = rng.random()
            if truncates and choice < 0.05:
                events.append(change("T", lsn, seq))
                alive.clear()
            elif choice < 0.2 or not alive:
                key = rng.choice([k for k in range(1, 12) if k not in alive] or [next(free)])
                events.append(change("I", lsn, seq, key, v=f"i{lsn}.{seq}", big=f"ib{lsn}.{seq}", n=seq))
                alive.add(key)
            elif choice < 0.35:
                key = rng.choice(sorted(alive))
                events.append(change("D", lsn, seq, old=key))
                alive.discard(key)
            else:
                key = rng.choice(sorted(alive))
                keep = ("big",) if rng.random() < 0.6 else ()
                if rng.random() < 0.4:
                    new_key = rng.choice([k for k in range(1, 12) if k not in alive] or [next(free)])
                    events.append(
                        change("U", lsn, seq, new_key, old=key, keep=keep, v=f"m{lsn}.{seq}", big="moved", n=seq)
                    )
                    alive.discard(key)
                    alive.add(new_key)
                else:
                    old = key if rng.random() < 0.3 else None
                    events.append(change("U", lsn, seq, key, old=old, keep=keep, v=f"u{lsn}.{seq}", big="u", n=seq))
    return events


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_match_the_committed_states(spark, seed: int) -> None:
    rng = random.Random(seed)
    start = [version(k, f"t{k}", f"B{k}", k, 0x20) for k in range(1, 9)] + [version(1, "o", "O", 0, 0x10, to=0x20)]
    check_history(spark, start, random_events(rng, set(range(1, 9)), truncates=seed % 2 == 1))


# --- soft delete ----------------------------------------------------------------------------------


SOFT_START = [
    live(1, "t1", "B1", 10),
    live(2, "t2", "B2", 20),
    live(3, "t3", "B3", 30),
    live(4, "d4", "D4", 40, 2, True),
]


def test_a_delete_keeps_a_tombstone_with_the_last_committed_values(spark) -> None:
    events = [
        change("U", 0x100, 0, 1, v="a", big="x", n=1),
        change("D", 0x200, 0, old=1),
        change("U", 0x300, 0, 2, v="not committed", big="y", n=2),  # updated, then deleted in one transaction
        change("D", 0x300, 1, old=2),
        change("D", 0x400, 0, old=3),  # Delta keeps the values: nothing of the run set them
    ]
    soft = check_soft(spark, SOFT_START, events)
    assert soft[1] == live(1, "a", "x", 1, 0x200, deleted=True)
    assert soft[2] == live(2, "t2", "B2", 20, 0x300, deleted=True)
    assert soft[3] == live(3, "t3", "B3", 30, 0x400, deleted=True)


def test_an_insert_revives_a_tombstone_and_a_truncate_makes_tombstones(spark) -> None:
    events = [
        change("I", 0x100, 0, 4, v="back", big="K", n=4),
        change("I", 0x200, 0, 5, v="five", big="F", n=5),
        change("T", 0x300, 0),
        change("I", 0x300, 1, 6, v="six", big="S", n=6),
        change("I", 0x400, 0, 7, v="gone", big="G", n=7),  # inserted and deleted in one transaction: never a row
        change("D", 0x400, 1, old=7),
    ]
    soft = check_soft(spark, SOFT_START, events)
    assert soft[4] == live(4, "back", "K", 4, 0x300, deleted=True)
    assert soft[5] == live(5, "five", "F", 5, 0x300, deleted=True)
    assert soft[1] == live(1, "t1", "B1", 10, 0x300, deleted=True)
    assert soft[6] == live(6, "six", "S", 6, 0x300)
    assert 7 not in soft


def test_soft_delete_unchanged_toast_and_key_changes(spark) -> None:
    events = [
        change("U", 0x100, 0, 1, keep=("big",), v="a", n=1),
        change("U", 0x200, 0, 9, old=2, keep=("big",), v="moved", n=2),
    ]
    soft = check_soft(spark, SOFT_START, events)
    assert soft[1] == live(1, "a", "B1", 1, 0x100)
    assert soft[9] == live(9, "moved", "B2", 2, 0x200)
    assert soft[2] == live(2, "t2", "B2", 20, 0x200, deleted=True)


@pytest.mark.parametrize("seed", range(4))
def test_random_soft_deletes_match_the_committed_states(spark, seed: int) -> None:
    rng = random.Random(100 + seed)
    start = [live(k, f"t{k}", f"B{k}", k) for k in range(1, 9)] + [live(10, "x", "X", 10, 2, True)]
    check_soft(spark, start, random_events(rng, set(range(1, 9)), truncates=seed % 2 == 0))


# --- the current rows of each mode --------------------------------------------------------------


def test_current_rows_by_mode(spark) -> None:
    frame = spark.createDataFrame(
        [version(1, "a", "b", 1, 0x10, to=0x20), version(1, "c", "d", 2, 0x20)], HISTORY_SCHEMA
    )
    assert [r["v"] for r in current_rows(frame, "history").collect()] == ["c"]
    soft = spark.createDataFrame([live(1, "a", "b", 1), live(2, "c", "d", 2, deleted=True)], SOFT_SCHEMA)
    assert [r["v"] for r in current_rows(soft, "soft_delete").collect()] == ["a"]
    assert current_rows(soft, "merge").count() == 2
    assert history.recorded_mode({}) == "merge" and history.recorded_mode({"pgdecode.mode": "history"}) == "history"
