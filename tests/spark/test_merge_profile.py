"""The merge's profile of a table's staged changes: read from the parts on the driver
(:func:`profile_from_parts`) when they show the Spark pass has nothing to find, else the Spark pass
(:func:`profile_events`). Where both answer, they must give the same profile."""

from __future__ import annotations

import datetime as dt
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.manifest import read_batches
from airflow_provider_pgdecode.spark import collapse
from airflow_provider_pgdecode.spark.collapse import CollapseInput
from airflow_provider_pgdecode.spark.merge_job import (
    MergeOptions,
    Profile,
    TablePlan,
    merge_batches,
    plan_merge,
    profile_events,
    profile_from_parts,
    staged_events,
    staged_key_ranges,
)
from tests.spark.staged import UNCHANGED, Part, TableChanges, write_batch

pytestmark = pytest.mark.spark

COLUMNS = [("id", "bigint", pa.int64()), ("name", "text", pa.string()), ("amount", "numeric(12,2)", pa.string())]
BASE = 0x10_0000


def plan_of(spark: Any, root: Path, tables: list[TableChanges], start: int = BASE) -> TablePlan:
    batch = write_batch(root / "staging", "s", start, start + 100_000, tables)
    plans = plan_merge(spark, read_batches([batch]), str(root / "delta"), MergeOptions())
    assert len(plans) == 1
    return plans[0]


def spark_profile(spark: Any, plan: TablePlan) -> Profile:
    return profile_events(staged_events(spark, plan), plan, staged_key_ranges(plan))


def random_changes(seed: int, columns: list[tuple[str, str, pa.DataType]] = COLUMNS) -> TableChanges:
    """Inserts, updates (some moving their key) and deletes of a keyed table, in random order."""
    rng = random.Random(seed)
    table = TableChanges("public", "items", columns)
    live: set[int] = set()
    lsn = BASE
    for _ in range(300):
        lsn += 16
        choice = rng.random()
        if not live or choice < 0.4:
            key = rng.choice([rng.randrange(0, 50), rng.randrange(10_000, 10_050)])
            if key in live:
                continue
            live.add(key)
            table.insert(lsn, id=key, name=f"n{key}", amount=f"{rng.randrange(10_000) / 100:.2f}")
        elif choice < 0.8:
            key = rng.choice(sorted(live))
            moved = key + 100 if rng.random() < 0.2 and key + 100 not in live else key
            live.discard(key)
            live.add(moved)
            table.update(lsn, {"id": key} if moved != key else None, id=moved, name="u", amount="1.50")
        else:
            key = rng.choice(sorted(live))
            live.discard(key)
            table.delete(lsn, id=key)
    return table


@pytest.mark.parametrize("seed", [1, 2])
def test_parts_profile_equals_the_spark_pass(spark: Any, tmp_path: Path, seed: int) -> None:
    table = random_changes(seed)
    plan = plan_of(spark, tmp_path, [table])
    from_parts = profile_from_parts(plan)
    assert from_parts is not None
    assert from_parts.changes == len(table.parts[0].changes)
    assert from_parts == spark_profile(spark, plan)
    # Keys in two clusters far apart: ranges that leave the gap between them out.
    assert from_parts.key_ranges is not None and len(from_parts.key_ranges) >= 2
    assert all(high - low < 5_000 for low, high in from_parts.key_ranges)


def test_a_part_without_rows_or_old_keys_leaves_the_parts_profile_alone(spark: Any, tmp_path: Path) -> None:
    """A part may hold no rows and no ``_pg_old`` column (a table snapshot chunk that found none):
    the profile read from the parts is the one without it, and the Spark pass's."""
    table = random_changes(3)
    batch = Path(write_batch(tmp_path / "staging", "s", BASE, BASE + 100_000, [table]))
    empty = table.arrow_table(Part(table.parts[0].columns)).drop_columns(["_pg_old"])
    table_dir = batch / "tables" / "public" / "items"
    pq.write_table(empty, table_dir / "part-00001.parquet")
    manifest = json.loads((batch / "manifest.json").read_text())
    manifest["tables"][0]["files"].append("part-00001.parquet")
    (batch / "manifest.json").write_text(json.dumps(manifest))
    (plan,) = plan_merge(spark, read_batches([str(batch)]), str(tmp_path / "delta"), MergeOptions())
    from_parts = profile_from_parts(plan)
    assert from_parts is not None
    assert from_parts.changes == len(table.parts[0].changes)
    assert from_parts == spark_profile(spark, plan)


def test_parts_profile_of_a_two_column_key_equals_the_spark_pass(spark: Any, tmp_path: Path) -> None:
    table = TableChanges(
        "public", "lines", [("order_id", "bigint", pa.int64()), ("sku", "text", pa.string())], key=("order_id", "sku")
    )
    table.insert(BASE + 16, order_id=1, sku="a").insert(BASE + 32, order_id=1, sku="b")
    table.update(BASE + 48, {"order_id": 1, "sku": "b"}, order_id=2, sku="b").delete(BASE + 64, order_id=1, sku="a")
    plan = plan_of(spark, tmp_path, [table])
    from_parts = profile_from_parts(plan)
    assert from_parts is not None
    assert (from_parts.inserts, from_parts.updates, from_parts.deletes) == (2, 1, 1)
    assert from_parts == spark_profile(spark, plan)


def collapsed_both_ways(spark: Any, plan: TablePlan) -> tuple[list[Any], list[Any], Profile]:
    """The plan's merge source by the driver's known collapse and by the Spark collapse."""
    profile = profile_from_parts(plan)
    assert profile is not None and profile.superseded is not None
    spec = CollapseInput(key=plan.key, value_columns=plan.value_columns, keep_columns=())
    effects = collapse.effects_of(staged_events(spark, plan), spec)
    known = collapse.collapse_known(spark, effects, spec, profile.superseded)
    grouped = collapse.collapse_simple(effects, spec, allow_keep=False)
    assert known.columns == grouped.columns
    return sorted(map(tuple, known.collect())), sorted(map(tuple, grouped.collect())), profile


@pytest.mark.parametrize("seed", [1, 2])
def test_the_known_collapse_equals_the_spark_collapse(spark: Any, tmp_path: Path, seed: int) -> None:
    """Dropping the effects the driver found superseded leaves the rows the Spark collapse keeps."""
    table = random_changes(seed)
    # Several changes of one key in one transaction, a move and a key inserted again after it left.
    lsn = BASE + 10_000
    table.insert(lsn, id=7_000, name="a", amount="1.00").update(lsn, id=7_000, name="b", amount="2.00")
    table.update(lsn, {"id": 7_000}, id=7_001, name="c", amount="3.00").insert(lsn, id=7_000, name="d", amount="4.00")
    table.delete(lsn + 16, id=7_001)
    known, grouped, profile = collapsed_both_ways(spark, plan_of(spark, tmp_path, [table]))
    assert profile.superseded is not None and profile.superseded.num_rows > 0
    assert len(known) == len({row[0] for row in known})  # one row per key
    assert known == grouped


def test_the_known_collapse_of_a_two_column_key(spark: Any, tmp_path: Path) -> None:
    table = TableChanges(
        "public", "lines", [("order_id", "bigint", pa.int64()), ("sku", "text", pa.string())], key=("order_id", "sku")
    )
    table.insert(BASE + 16, order_id=1, sku="a").insert(BASE + 16, order_id=1, sku="b")
    table.update(BASE + 32, {"order_id": 1, "sku": "b"}, order_id=1, sku="a2").delete(BASE + 48, order_id=1, sku="a")
    table.insert(BASE + 64, order_id=1, sku="b")
    known, grouped, profile = collapsed_both_ways(spark, plan_of(spark, tmp_path, [table]))
    assert profile.superseded is not None and profile.superseded.num_rows == 3
    assert known == grouped


def _toast_moved(t: TableChanges) -> None:
    # Its kept value must follow the key's lineage, which the Spark pass does.
    t.update(BASE + 400, {"id": 1}, id=5, name=UNCHANGED, amount="2.00")


def _null_key(t: TableChanges) -> None:
    t.insert(BASE + 400, id=None, name="x", amount="1.00")


def _delete_without_old_key(t: TableChanges) -> None:
    t.delete(BASE + 400)


def _nan(t: TableChanges) -> None:
    t.insert(BASE + 400, id=9_999, name="x", amount="NaN")


def _column_added(t: TableChanges) -> None:
    # The UPDATE is staged before the column existed: it must keep Delta's value of it.
    t.update(BASE + 400, id=1, name="y", amount="1.00")
    t.alter([*COLUMNS, ("note", "text", pa.string())])
    t.insert(BASE + 416, id=2, name="z", amount="1.00", note="new")


CASES = {
    "a key moved by an UPDATE leaving TOAST unchanged": (_toast_moved, lambda p: p.keep_moves == 1),
    "NULL key": (_null_key, lambda p: p.null_keys == 1),
    "DELETE without its old key": (_delete_without_old_key, lambda p: p.null_keys == 1),
    "numeric NaN": (_nan, lambda p: p.specials == {"amount": 1}),
    "a column absent from a part": (_column_added, lambda p: "note" in p.keep_columns),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_spark_pass_decides_what_the_parts_do_not_show(spark: Any, tmp_path: Path, case: str) -> None:
    """Each of these needs the Spark pass's answer; the parts' profile stands aside for it."""
    change, found = CASES[case]
    table = TableChanges("public", "items", COLUMNS)
    table.insert(BASE + 16, id=1, name="a", amount="1.00")
    change(table)
    plan = plan_of(spark, tmp_path, [table])
    assert profile_from_parts(plan) is None
    assert found(spark_profile(spark, plan))


def test_an_unbounded_numeric_goes_to_the_spark_pass_only_with_digits_past_its_decimal(
    spark: Any, tmp_path: Path
) -> None:
    columns = [("id", "bigint", pa.int64()), ("amount", "numeric", pa.string())]
    unbounded = TableChanges("public", "u", columns)
    # decimal(38,18): 20 integer digits and 18 fraction digits fit, zeros aside
    unbounded.insert(BASE + 16, id=1, amount="1.5").insert(BASE + 32, id=2, amount="-" + "9" * 20 + "." + "1" * 18)
    unbounded.insert(BASE + 48, id=3, amount="000" + "1" * 20 + ".5" + "0" * 17)
    plan = plan_of(spark, tmp_path / "u", [unbounded])
    driver = profile_from_parts(plan)
    assert driver is not None and not driver.lossy and driver.changes == spark_profile(spark, plan).changes == 3
    for amount in ("1" * 21, "0." + "0" * 18 + "1"):  # one integer digit, one fraction digit too many
        wide = TableChanges("public", "u", columns).insert(BASE + 16, id=1, amount=amount)
        plan = plan_of(spark, tmp_path / amount, [wide])
        assert profile_from_parts(plan) is None
        assert spark_profile(spark, plan).lossy == {"amount": 1}
    text_key = TableChanges("public", "t", [("code", "text", pa.string())], key=("code",))
    text_key.insert(BASE + 16, code="b").insert(BASE + 32, code="a")
    plan = plan_of(spark, tmp_path / "t", [text_key])
    driver = profile_from_parts(plan)
    assert driver is not None and driver.key_ranges == spark_profile(spark, plan).key_ranges == [("a", "b")]


def test_unchanged_toast_is_profiled_on_the_driver_as_by_spark(spark: Any, tmp_path: Path) -> None:
    table = TableChanges("public", "items", COLUMNS)
    table.insert(BASE + 16, id=1, name="a", amount="1.00").update(BASE + 32, id=2, name=UNCHANGED, amount="2.00")
    table.delete(BASE + 48, id=3).update(BASE + 64, id=4, name="d", amount=UNCHANGED)
    plan = plan_of(spark, tmp_path, [table])
    driver, sparks = profile_from_parts(plan), spark_profile(spark, plan)
    assert driver is not None
    assert driver.keep_columns == sparks.keep_columns == ("name", "amount")
    assert (driver.changes, driver.updates, driver.keep_moves) == (sparks.changes, sparks.updates, sparks.keep_moves)


def test_a_truncate_is_profiled_on_the_driver_as_by_spark(spark: Any, tmp_path: Path) -> None:
    table = TableChanges("public", "items", COLUMNS)
    table.insert(BASE + 16, id=1, name="a", amount="1.00").truncate(BASE + 400)
    table.insert(BASE + 400, id=1, name="b", amount="2.00").update(BASE + 416, id=1, name=UNCHANGED, amount="3.00")
    plan = plan_of(spark, tmp_path, [table])
    driver = profile_from_parts(plan)
    assert driver is not None and driver.truncates == 1 and driver.truncate_at == (BASE + 400, 0)
    assert driver == spark_profile(spark, plan)


def test_a_batch_partly_applied_is_profiled_on_the_driver_as_by_spark(spark: Any, tmp_path: Path) -> None:
    first = TableChanges("public", "items", COLUMNS).insert(BASE + 16, id=1, name="a", amount="1.00")
    merge_batches(spark, [write_batch(tmp_path / "first", "s", BASE, BASE + 32, [first])], str(tmp_path / "delta"))
    # The next batch starts before the table's watermark: its first change is already applied.
    again = TableChanges("public", "items", COLUMNS).insert(BASE + 16, id=1, name="a", amount="1.00")
    again.insert(BASE + 48, id=2, name="b", amount="2.00")
    plan = plan_of(spark, tmp_path, [again])
    driver = profile_from_parts(plan)
    assert driver is not None and driver.changes == 1 and driver.inserts == 1
    # The Spark pass's key ranges (staged_key_ranges) span the applied rows too; the driver's only
    # what is merged, a narrower MERGE condition that still holds every key it touches.
    sparks = spark_profile(spark, plan)
    assert driver.key_ranges == [(2, 2)] and sparks.key_ranges == [(1, 2)]
    assert replace(driver, key_ranges=None) == replace(sparks, key_ranges=None)


SINGLE_KEYS = {
    "date": (pa.date32(), [dt.date(2024, 1, d) for d in range(1, 9)]),
    "timestamp with time zone": (
        pa.timestamp("us", tz="UTC"),
        [dt.datetime(2024, 3, 10, h, 30, 0, 7, tzinfo=dt.UTC) for h in range(8)],
    ),
    "timestamp without time zone": (pa.timestamp("us"), [dt.datetime(2024, 3, 10, h, 30) for h in range(8)]),
    "bytea": (pa.binary(), [bytes([0, 255 - i, i]) for i in range(8)]),
}


@pytest.mark.parametrize("kind", sorted(SINGLE_KEYS))
def test_parts_profile_of_a_single_date_timestamp_or_bytes_key_equals_the_spark_pass(
    spark: Any, tmp_path: Path, kind: str
) -> None:
    """Its one range, a timestamp's as microseconds (:mod:`.key_bounds`)."""
    arrow, keys = SINGLE_KEYS[kind]
    table = TableChanges("public", "k", [("k", kind, arrow), ("v", "text", pa.string())], key=("k",))
    for i, key in enumerate(keys):
        table.insert(BASE + 16 * (i + 1), k=key, v=f"v{i}")
    table.update(BASE + 400, {"k": keys[2]}, k=keys[7], v="moved").delete(BASE + 416, k=keys[0])
    plan = plan_of(spark, tmp_path, [table])
    from_parts = profile_from_parts(plan)
    assert from_parts is not None
    assert (from_parts.inserts, from_parts.updates, from_parts.deletes) == (8, 1, 1)
    assert from_parts == spark_profile(spark, plan)
    assert from_parts.key_ranges == [(from_parts.key_min, from_parts.key_max)]
    if kind.startswith("timestamp"):  # the wall clock of a zoneless one read as UTC
        assert from_parts.key_min == int(keys[0].replace(tzinfo=dt.UTC).timestamp()) * 10**6 + keys[0].microsecond
    else:
        assert (from_parts.key_min, from_parts.key_max) == (min(keys), max(keys))
