"""The collapse of a table's staged changes into one MERGE source, on a real local Spark.

Every check compares against PostgreSQL's own semantics, computed here in plain Python: replaying
the changes in commit order on the table as it was must give the same table as applying the
collapsed MERGE source the way the merge job's MERGE does (a keep flag takes the Delta value).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from airflow_provider_pgdecode.spark.collapse import (
    DELETE,
    IS_INSERT,
    KIND,
    MOVE_IN,
    UPSERT,
    CollapseInput,
    after,
    collapse_simple,
    collapse_with_lineage,
    effects_of,
    keep_flag_name,
    resolve_lineage_roots,
)

pytestmark = pytest.mark.spark

VALUES = ("v", "big", "n")
META = ("_pg_commit_lsn", "_pg_commit_time", "_pg_xid")
EVENT_SCHEMA = (
    "id int, v string, big string, n int, _pg_commit_lsn bigint, _pg_commit_time timestamp, _pg_xid bigint,"
    " __lsn bigint, __seq int, __op string, __keep array<string>, __old_0 int"
)
TARGET_SCHEMA = "id int, v string, big string, n int, _pg_commit_lsn bigint, _pg_commit_time timestamp, _pg_xid bigint"


def ev(
    op: str,
    lsn: int,
    seq: int,
    key: int | None = None,
    *,
    old: int | None = None,
    keep: tuple[str, ...] = (),
    **values: Any,
) -> dict[str, Any]:
    """One staged change as the merge job normalizes it. Kept columns carry null, as staged."""
    row = {
        "id": key,
        "v": None,
        "big": None,
        "n": None,
        "_pg_commit_lsn": lsn,
        "_pg_commit_time": None,
        "_pg_xid": lsn // 16,
        "__lsn": lsn,
        "__seq": seq,
        "__op": op,
        "__keep": list(keep),
        "__old_0": old,
    }
    for name, value in values.items():
        assert name in VALUES
        row[name] = None if name in keep else value
    return row


def target_row(key: int, v: str, big: str, n: int, lsn: int = 1) -> dict[str, Any]:
    return {"id": key, "v": v, "big": big, "n": n, "_pg_commit_lsn": lsn, "_pg_commit_time": None, "_pg_xid": 1}


# --- the reference: PostgreSQL's semantics and the merge job's MERGE, in plain Python -------------


def replay(target: dict[int, dict[str, Any]], events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The table after applying ``events`` one by one in commit order."""
    table = {k: dict(v) for k, v in target.items()}
    for e in sorted(events, key=lambda e: (e["__lsn"], e["__seq"])):
        op = e["__op"]
        if op == "T":
            table.clear()
        elif op == "D":
            table.pop(e["__old_0"], None)
        elif op == "I":
            table[e["id"]] = {**{c: e[c] for c in VALUES}, "_pg_commit_lsn": e["_pg_commit_lsn"]}
        else:
            old_key = e["__old_0"] if e["__old_0"] is not None else e["id"]
            before = table.pop(old_key, {})
            row = {c: (before.get(c) if c in e["__keep"] else e[c]) for c in VALUES}
            table[e["id"]] = {**row, "_pg_commit_lsn": e["_pg_commit_lsn"]}
    return table


def apply_merge(
    target: dict[int, dict[str, Any]], source: list[dict[str, Any]], spec: CollapseInput
) -> dict[int, dict[str, Any]]:
    """What the merge job's MERGE does with the collapsed rows (one per key)."""
    keys = [r["id"] for r in source]
    assert len(keys) == len(set(keys)), f"more than one row per key: {sorted(keys)}"
    table = {k: dict(v) for k, v in target.items()}
    for r in source:
        key = r["id"]
        if r[KIND] == DELETE:
            table.pop(key, None)
            continue
        assert r[KIND] == UPSERT
        row = {c: r[c] for c in spec.value_columns}
        for index, column in enumerate(spec.keep_columns):
            if r[keep_flag_name(index)] and key in target:
                row[column] = target[key][column]  # CASE WHEN keep THEN t.column
        table[key] = {**row, "_pg_commit_lsn": r["_pg_commit_lsn"]}
    return table


def spec_for(events: list[dict[str, Any]]) -> CollapseInput:
    kept = {c for e in events if e["__op"] in ("I", "U") for c in e["__keep"]}
    return CollapseInput(key=("id",), value_columns=VALUES, keep_columns=tuple(c for c in VALUES if c in kept))


def keep_moves(events: list[dict[str, Any]]) -> bool:
    return any(
        e["__op"] == "U" and e["__old_0"] is not None and e["__old_0"] != e["id"] and e["__keep"] for e in events
    )


def collapse(spark, events, target, *, lineage: bool, truncate_at: tuple[int, int] | None = None):
    """Run the collapse as the merge job's merge_source does; return the spec and the collected rows."""
    shuffled = list(events)
    random.Random(len(events)).shuffle(shuffled)  # input order must not matter
    frame = spark.createDataFrame(shuffled, EVENT_SCHEMA)
    if truncate_at is not None:
        frame = frame.where(after(*truncate_at))
    spec = spec_for([e for e in events if truncate_at is None or (e["__lsn"], e["__seq"]) > truncate_at])
    allow_keep = truncate_at is None
    effects = effects_of(frame, spec)
    if lineage:
        target_frame = spark.createDataFrame(
            [{"id": k, **v, "_pg_commit_time": None, "_pg_xid": 1} for k, v in target.items()], TARGET_SCHEMA
        )
        result = collapse_with_lineage(effects, spec, target_frame if allow_keep else None, allow_keep=allow_keep)
    else:
        result = collapse_simple(effects, spec, allow_keep=allow_keep)
    return spec, [r.asDict() for r in result.collect()]


def check(spark, events, target, *, truncate_at: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Both collapses (the simple one only where the merge job would use it) agree with the replay."""
    expected = replay(target, events)
    start = {} if truncate_at is not None else target
    # As merge_source chooses: the lineage collapse only when a key change keeps a column; it also
    # handles every other batch that keeps a column, so both are checked there.
    has_keep = bool(spec_for(events).keep_columns)
    modes = [True] if keep_moves(events) else [False, True] if has_keep else [False]
    rows: list[dict[str, Any]] = []
    for lineage in modes:
        spec, rows = collapse(spark, events, target, lineage=lineage, truncate_at=truncate_at)
        assert apply_merge(start, rows, spec) == expected, f"lineage={lineage}: {rows}"
    return rows


def by_key(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in rows}


TARGET = {
    1: {"v": "t1", "big": "B1", "n": 10, "_pg_commit_lsn": 1},
    2: {"v": "t2", "big": "B2", "n": 20, "_pg_commit_lsn": 1},
    3: {"v": "t3", "big": "B3", "n": 30, "_pg_commit_lsn": 1},
}


# --- effects_of -------------------------------------------------------------------------------


def test_effects_of_each_kind_of_event(spark) -> None:
    events = [
        ev("I", 0x100, 0, 7, v="a", big="x", n=1),
        ev("U", 0x100, 1, 7, v="b", big="x", n=2),  # key unchanged, no old key sent
        ev("U", 0x100, 2, 7, old=7, v="c", big="x", n=3),  # old key sent but equal: not a move
        ev("U", 0x200, 0, 8, old=7, v="d", n=4, keep=("big",)),  # 7 -> 8
        ev("D", 0x300, 0, None, old=8),
    ]
    spec = CollapseInput(key=("id",), value_columns=VALUES, keep_columns=("big",))
    effects = effects_of(spark.createDataFrame(events, EVENT_SCHEMA), spec).collect()
    got = sorted(
        (r["id"], r[KIND], r[MOVE_IN], r[IS_INSERT], r["__lsn"], r["__seq"], r["v"], tuple(r["__keep"]))
        for r in effects
    )
    expected = []
    for e in events:
        moved = e["__op"] == "U" and e["__old_0"] is not None and e["__old_0"] != e["id"]
        if e["__op"] in ("I", "U"):
            expected.append(
                (e["id"], UPSERT, moved, e["__op"] == "I", e["__lsn"], e["__seq"], e["v"], tuple(e["__keep"]))
            )
        if e["__op"] == "D" or moved:
            expected.append((e["__old_0"], DELETE, False, False, e["__lsn"], e["__seq"], None, ()))
    assert got == sorted(expected)
    deletes = [r for r in effects if r[KIND] == DELETE]
    assert all(r["big"] is None and r["n"] is None and r["__old_0"] is None for r in deletes)


def test_effects_of_with_a_composite_key(spark) -> None:
    schema = (
        "a int, b string, v string, _pg_commit_lsn bigint, _pg_commit_time timestamp, _pg_xid bigint,"
        " __lsn bigint, __seq int, __op string, __keep array<string>, __old_0 int, __old_1 string"
    )
    rows = [
        {"a": 1, "b": "x", "v": "same", "__old_0": 1, "__old_1": "x"},  # not a move
        {"a": 1, "b": "y", "v": "half", "__old_0": 1, "__old_1": "x"},  # second part changed: a move
        {"a": 2, "b": "y", "v": "none", "__old_0": None, "__old_1": None},  # no old key sent
    ]
    for seq, row in enumerate(rows):
        row.update(_pg_commit_lsn=5, _pg_commit_time=None, _pg_xid=1, __lsn=5, __seq=seq, __op="U", __keep=[])
    spec = CollapseInput(key=("a", "b"), value_columns=("v",), keep_columns=())
    effects = effects_of(spark.createDataFrame(rows, schema), spec).collect()
    assert sorted((r["a"], r["b"], r[KIND], r[MOVE_IN]) for r in effects) == sorted(
        [(1, "x", UPSERT, False), (1, "y", UPSERT, True), (1, "x", DELETE, False), (2, "y", UPSERT, False)]
    )


# --- the collapse against the replay ----------------------------------------------------------


def test_last_change_to_a_key_wins(spark) -> None:
    events = [
        ev("U", 0x200, 0, 1, v="second", big="b", n=2),
        ev("U", 0x100, 5, 1, v="first", big="a", n=1),
        ev("U", 0x200, 3, 1, v="third", big="c", n=3),  # same transaction, later position
        ev("U", 0x100, 0, 2, v="only", big="o", n=9),
        ev("I", 0x150, 0, 4, v="new", big="n", n=4),
        ev("U", 0x150, 1, 4, v="newer", big="n2", n=5),
    ]
    rows = by_key(check(spark, events, TARGET))
    assert rows[1]["v"] == "third" and rows[1]["_pg_commit_lsn"] == 0x200
    assert rows[4]["v"] == "newer"
    assert 3 not in rows  # untouched keys are not in the MERGE source


def test_order_is_commit_lsn_then_position_not_position_alone(spark) -> None:
    # A later transaction with a smaller position still comes after an earlier one with a larger position.
    events = [ev("U", 0x300, 0, 1, v="late", big="l", n=1), ev("U", 0x200, 99, 1, v="early", big="e", n=2)]
    assert by_key(check(spark, events, TARGET))[1]["v"] == "late"


def test_delete_after_insert_and_insert_after_delete(spark) -> None:
    events = [
        ev("I", 0x100, 0, 5, v="brief", big="b", n=5),
        ev("D", 0x100, 1, old=5),  # inserted and deleted in one batch
        ev("D", 0x100, 2, old=1),
        ev("I", 0x200, 0, 1, v="reborn", big="r", n=11),  # deleted and inserted again
        ev("U", 0x250, 0, 2, v="doomed", big="d", n=0),
        ev("D", 0x300, 0, old=2),  # updated, then deleted
    ]
    rows = by_key(check(spark, events, TARGET))
    assert rows[5][KIND] == DELETE and rows[2][KIND] == DELETE
    assert rows[1][KIND] == UPSERT and rows[1]["v"] == "reborn"


def test_key_change_chain_without_kept_columns(spark) -> None:
    events = [
        ev("U", 0x100, 0, 10, old=1, v="moved once", big="m", n=1),  # 1 -> 10
        ev("U", 0x200, 0, 20, old=10, v="moved twice", big="m2", n=2),  # 10 -> 20
        ev("U", 0x200, 1, 2, old=3, v="swap", big="s", n=3),  # 3 -> 2 after 2 ...
        ev("U", 0x100, 1, 30, old=2, v="away", big="w", n=4),  # ... moved away first (2 -> 30)
    ]
    rows = by_key(check(spark, events, TARGET))
    assert {k: r[KIND] for k, r in rows.items()} == {
        1: DELETE,
        10: DELETE,
        20: UPSERT,
        2: UPSERT,
        3: DELETE,
        30: UPSERT,
    }


def test_key_change_chain_carries_unchanged_toast_along_the_lineage(spark) -> None:
    # A -> B -> C with 'big' never sent: its value is the one the row had in Delta at A.
    events = [
        ev("U", 0x100, 0, 11, old=1, v="at B", n=1, keep=("big",)),
        ev("U", 0x200, 0, 12, old=11, v="at C", n=2, keep=("big",)),
        ev("U", 0x300, 0, 13, old=12, v="at D", n=3, keep=("big",)),
    ]
    rows = by_key(check(spark, events, TARGET))
    assert rows[13]["big"] == "B1"  # read from the target row at the lineage's first key
    assert rows[13][keep_flag_name(0)] is False
    assert {rows[k][KIND] for k in (1, 11, 12)} == {DELETE}


def test_a_value_set_midway_in_a_chain_wins_over_the_origin(spark) -> None:
    events = [
        ev("U", 0x100, 0, 11, old=1, v="B", n=1, keep=("big",)),
        ev("U", 0x200, 0, 11, v="B2", big="set at B", n=2),
        ev("U", 0x300, 0, 12, old=11, v="C", n=3, keep=("big",)),
    ]
    assert by_key(check(spark, events, TARGET))[12]["big"] == "set at B"


def test_a_chain_back_to_its_own_key_keeps_the_delta_value(spark) -> None:
    events = [
        ev("U", 0x100, 0, 40, old=1, v="away", n=1, keep=("big",)),
        ev("U", 0x200, 0, 1, old=40, v="home", n=2, keep=("big",)),
    ]
    rows = by_key(check(spark, events, TARGET))
    assert rows[1][KIND] == UPSERT and rows[1]["v"] == "home"
    assert rows[40][KIND] == DELETE


def test_two_rows_trading_keys_keep_their_own_toast_values(spark) -> None:
    # 1 -> 100, 2 -> 1, 100 -> 2: the rows swap keys, each with its own unchanged 'big'.
    events = [
        ev("U", 0x100, 0, 100, old=1, v="was 1", n=1, keep=("big",)),
        ev("U", 0x100, 1, 1, old=2, v="was 2", n=2, keep=("big",)),
        ev("U", 0x100, 2, 2, old=100, v="was 1 again", n=3, keep=("big",)),
    ]
    rows = by_key(check(spark, events, TARGET))
    assert (rows[1]["v"], rows[2]["v"]) == ("was 2", "was 1 again")


def test_unchanged_toast_keeps_the_earlier_value(spark) -> None:
    events = [
        ev("I", 0x100, 0, 8, v="new", big="inserted big", n=1),
        ev("U", 0x200, 0, 8, v="edited", n=2, keep=("big",)),  # big from the insert in this batch
        ev("U", 0x200, 1, 1, v="edited", n=3, keep=("big",)),  # big from Delta
        ev("U", 0x300, 0, 2, v="e1", big="set", n=4),
        ev("U", 0x300, 1, 2, v="e2", n=5, keep=("big",)),  # big from the earlier update in this batch
    ]
    rows = by_key(check(spark, events, TARGET))
    flag = keep_flag_name(0)
    assert rows[8]["big"] == "inserted big" and rows[8][flag] is False
    assert rows[1]["big"] is None and rows[1][flag] is True  # the MERGE keeps Delta's B1
    assert rows[2]["big"] == "set" and rows[2][flag] is False
    assert apply_merge(TARGET, list(rows.values()), spec_for(events))[1]["big"] == "B1"


def test_truncate_cuts_the_batch(spark) -> None:
    events = [
        ev("U", 0x100, 0, 1, v="before", big="x", n=1),
        ev("I", 0x100, 1, 9, v="gone", big="g", n=9),
        ev("T", 0x200, 3),
        ev("U", 0x200, 1, 2, v="same xact, before the truncate", big="y", n=2),
        ev("I", 0x200, 4, 1, v="after", big="a", n=3),  # same transaction, after the TRUNCATE
        ev("U", 0x300, 0, 1, v="after again", n=4, keep=("big",)),
        ev("I", 0x300, 1, 5, v="five", big="f", n=5),
    ]
    rows = by_key(check(spark, events, TARGET, truncate_at=(0x200, 3)))
    assert set(rows) == {1, 5}
    assert rows[1]["big"] == "a" and rows[1][keep_flag_name(0)] is False  # nothing to keep after a TRUNCATE


def test_after_is_strictly_after_in_commit_order(spark) -> None:
    frame = spark.createDataFrame(
        [
            ev("U", lsn, seq, 1, v=f"{lsn}/{seq}")
            for lsn, seq in [(0x100, 9), (0x200, 2), (0x200, 3), (0x200, 4), (0x300, 0)]
        ],
        EVENT_SCHEMA,
    )
    kept = sorted((r["__lsn"], r["__seq"]) for r in frame.where(after(0x200, 3)).collect())
    assert kept == [(0x200, 4), (0x300, 0)]


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_match_the_replay(spark, seed: int) -> None:
    """Valid random histories (inserts, updates with and without key changes and unchanged TOAST,
    deletes) over a few transactions: the collapse applied as MERGE equals the replay."""
    rng = random.Random(seed)
    target = {k: {"v": f"t{k}", "big": f"B{k}", "n": k, "_pg_commit_lsn": 1} for k in range(1, 9)}
    live = set(target)
    free = iter(range(100, 1000))
    events: list[dict[str, Any]] = []
    lsn = 0x100
    for _ in range(rng.randint(4, 9)):
        lsn += 0x10 * rng.randint(1, 4)
        for seq in range(rng.randint(1, 6)):
            choice = rng.random()
            if choice < 0.2 or not live:
                key = rng.choice([k for k in range(1, 12) if k not in live] or [next(free)])
                events.append(ev("I", lsn, seq, key, v=f"i{lsn}.{seq}", big=f"ib{lsn}.{seq}", n=seq))
                live.add(key)
            elif choice < 0.35:
                key = rng.choice(sorted(live))
                events.append(ev("D", lsn, seq, old=key))
                live.discard(key)
            else:
                key = rng.choice(sorted(live))
                keep = ("big",) if rng.random() < 0.6 else ()
                if rng.random() < 0.4:
                    new_key = rng.choice([k for k in range(1, 12) if k not in live] or [next(free)])
                    events.append(ev("U", lsn, seq, new_key, old=key, keep=keep, v=f"m{lsn}.{seq}", big="moved", n=seq))
                    live.discard(key)
                    live.add(new_key)
                else:
                    old = key if rng.random() < 0.3 else None
                    events.append(ev("U", lsn, seq, key, old=old, keep=keep, v=f"u{lsn}.{seq}", big="upd", n=seq))
    check(spark, events, target)


# --- resolve_lineage_roots --------------------------------------------------------------------


def roots_by_walking(links: dict[int, int]) -> dict[int, int]:
    out = {}
    for child in links:
        node = child
        while node in links:
            node = links[node]
        out[child] = node
    return out


def test_resolve_lineage_roots_follows_chains_to_their_ends(spark) -> None:
    links = {i: i + 1 for i in range(1, 40)}  # 1 -> 2 -> ... -> 40
    links.update({100: 101, 101: 102, 200: 102, 300: 301})  # a join and a single link
    frame = spark.createDataFrame([(c, p) for c, p in links.items()], "child int, parent int")
    got = {r["child"]: r["root"] for r in resolve_lineage_roots(frame).collect()}
    assert got == roots_by_walking(links)
    assert got[1] == 40 and got[200] == 102


def test_resolve_lineage_roots_with_segment_structs(spark) -> None:
    # As collapse_with_lineage calls it: segments are (key struct, order struct) structs.
    schema = (
        "child struct<k: struct<id: int>, o: struct<lsn: bigint, seq: int>>, "
        "parent struct<k: struct<id: int>, o: struct<lsn: bigint, seq: int>>"
    )

    def seg(key: int, lsn: int | None) -> tuple:
        return ((key,), None if lsn is None else (lsn, 0))

    links = [(seg(12, 0x200), seg(11, 0x100)), (seg(11, 0x100), seg(1, None))]
    got = {
        r["child"]["k"]["id"]: (r["root"]["k"]["id"], r["root"]["o"])
        for r in resolve_lineage_roots(spark.createDataFrame(links, schema)).collect()
    }
    assert got == {12: (1, None), 11: (1, None)}


def test_resolve_lineage_roots_gives_up_on_endless_chains(spark) -> None:
    cycle = spark.createDataFrame([(1, 2), (2, 3), (3, 1)], "child int, parent int")
    with pytest.raises(RuntimeError, match="key-change chains longer than 2\\^3 moves"):
        resolve_lineage_roots(cycle, max_rounds=3)
