"""A light write's MERGE source built on the driver (spark/arrow_source.py) equals Spark's.

For runs of inserts, updates (some moving their key, some twice in a transaction, some leaving
TOAST unchanged) and deletes over columns of every flat type the extract stages as Delta keeps
it, a list, and a ``numeric(12,2)`` and a ``numeric(6,2)[]`` staged as their text, the source
built from the parts with pyarrow holds the same rows, of the same types, as the one Spark
computes (``merge_sql.merge_source``, collected). Merged, the table equals the reference model and
a merge by Delta alone, read by Spark and by delta-rs. So do runs with a TRUNCATE, runs partly
applied already, and other keys. Where a part needs Spark's checks (a key moved with TOAST
unchanged, a numeric past its decimal) the driver builds nothing, and where the light write
refuses the table after all, Delta's MERGE reads the changes in Spark.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.batch.manifest import read_batches
from airflow_provider_pgdecode.spark import arrow_source as arrow_source_module
from airflow_provider_pgdecode.spark.arrow_source import arrow_source
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from airflow_provider_pgdecode.spark.merge_plan import Profile, TablePlan, plan_merge
from airflow_provider_pgdecode.spark.merge_sql import merge_source
from airflow_provider_pgdecode.spark.profiling import profile_events, profile_from_parts, staged_key_ranges
from airflow_provider_pgdecode.spark.staged_events import staged_events
from tests.spark.staged import UNCHANGED, Model, TableChanges, write_batch

pytestmark = pytest.mark.spark

SLOT = "pgdecode_arrow"
ITEMS = [
    ("id", "bigint", pa.int64()),
    ("n", "integer", pa.int32()),
    ("s", "smallint", pa.int16()),
    ("r", "real", pa.float32()),
    ("f", "double precision", pa.float64()),
    ("flag", "boolean", pa.bool_()),
    ("ts", "timestamp with time zone", pa.timestamp("us", tz="UTC")),
    ("wall", "timestamp without time zone", pa.timestamp("us")),  # its wall-clock time read as UTC
    ("d", "date", pa.date32()),
    ("b", "bytea", pa.binary()),
    ("t", "text", pa.string()),
    ("price", "numeric(12,2)", pa.string()),  # staged as its text, cast to decimal(12,2)
    ("tags", "text[]", pa.list_(pa.string())),
    ("amounts", "numeric(6,2)[]", pa.list_(pa.string())),  # each element's text cast to decimal(6,2)
]
COLUMNS = [name for name, _, _ in ITEMS] + ["_pg_commit_lsn"]
DELTA_ONLY = MergeOptions(light_write_max_bytes=0)
MERGE_LOG = "airflow_provider_pgdecode.spark.merge"


def values(rng: random.Random, key: int) -> dict[str, Any]:
    """A row of every column, some NULL (NaN is left out: the model compares rows with ==)."""

    def maybe(value: Any) -> Any:
        return None if rng.random() < 0.1 else value

    return {
        "id": key,
        "n": maybe(rng.randrange(-(2**31), 2**31)),
        "s": maybe(rng.randrange(-(2**15), 2**15)),
        "r": maybe(rng.choice([0.5, -1.25, float("inf")])),
        "f": maybe(rng.choice([rng.random() * 1e9, float("-inf"), 0.0])),
        "flag": maybe(rng.random() < 0.5),
        "ts": maybe(datetime(2020, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**15))),
        "wall": maybe(
            rng.choice(
                [
                    datetime(1999, 12, 31, 23, 59, 59) + timedelta(microseconds=rng.randrange(10**15)),
                    datetime(9999, 12, 31, 23, 59, 59, 999999),  # infinity, as staged
                ]
            )
        ),
        "d": maybe(date(1990, 1, 1) + timedelta(days=rng.randrange(30_000))),
        "b": maybe(rng.randbytes(rng.randrange(0, 12))),
        "t": maybe(rng.choice(["", "é ü", f"t{key}", "a" * 300])),
        "price": maybe(f"{rng.randrange(-(10**12), 10**12) / 100:.2f}"),
        "tags": maybe(rng.choice([[], ["a"], ["b", None, "é"]])),
        "amounts": maybe(rng.choice([[], ["1.50", None, "-9999.99"], [f"{rng.randrange(10**6) / 100:.2f}"]])),
    }


def random_run(seed: int, start: int, live: set[int]) -> TableChanges:
    """Inserts, updates (a fifth moving their key, some twice in one transaction) and deletes of
    the rows in ``live`` (updated in place), after commit LSN ``start``."""
    rng = random.Random(seed)
    table = TableChanges("public", "items", ITEMS)
    lsn = start + 16
    for _ in range(200):
        lsn += 16 if rng.random() < 0.7 else 0  # some changes share a transaction
        choice = rng.random()
        if not live or choice < 0.35:
            key = rng.randrange(0, 120)
            if key not in live:
                live.add(key)
                table.insert(lsn, **values(rng, key))
        elif choice < 0.8:
            key = rng.choice(sorted(live))
            moved = key + 1000 if rng.random() < 0.2 and key + 1000 not in live else key
            live.discard(key)
            live.add(moved)
            row = values(rng, moved)
            if moved == key and rng.random() < 0.3:
                row["t"] = UNCHANGED  # TOAST: Delta's value kept, or the run's last one set
            table.update(lsn, {"id": key} if moved != key else None, **row)
        else:
            key = rng.choice(sorted(live))
            live.discard(key)
            table.delete(lsn, id=key)
    return table


def first_rows(rng: random.Random, keys: Any, mode: str = "merge") -> TableChanges:
    """The table's first batch: a row of every column for each of ``keys``, at commit LSN 1,000."""
    first = TableChanges("public", "items", ITEMS, mode=mode)
    for key in sorted(keys):
        first.insert(1_000, **values(rng, key))
    return first


def as_delta(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model's rows as Delta holds them: the numeric text as a decimal, the wall-clock time as
    that time in UTC."""
    return [
        {
            **row,
            "price": None if row["price"] is None else Decimal(row["price"]),
            "amounts": None
            if row.get("amounts") is None
            else [None if v is None else Decimal(v) for v in row["amounts"]],
            **({"wall": row["wall"].replace(tzinfo=UTC)} if row.get("wall") is not None else {}),
        }
        for row in rows
    ]


def sorted_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted((tuple(row.values()) for row in table.to_pylist()), key=repr)


def delta_rs_rows(path: Path, columns: list[str] = COLUMNS) -> list[dict[str, Any]]:
    import deltalake

    query = f"select {', '.join(columns)} from t order by id"
    table = deltalake.DeltaTable(str(path))
    return pa.table(deltalake.QueryBuilder().register("t", table).execute(query).read_all()).to_pylist()


def spark_rows(spark: Any, path: Path) -> list[dict[str, Any]]:
    rows = spark.read.format("delta").load(str(path)).select(*COLUMNS).collect()
    return sorted((r.asDict() for r in rows), key=lambda r: r["id"])


def only_plan(spark: Any, batch: str, root: Path) -> TablePlan:
    (plan,) = plan_merge(spark, read_batches([batch]), str(root), MergeOptions())
    assert isinstance(plan, TablePlan)
    return plan


def built_as_spark_computes(spark: Any, plan: TablePlan) -> Profile:
    """The plan's profile from its parts, with Spark's key range, and its source built on the
    driver, equal to Spark's in rows and types."""
    profile = profile_from_parts(plan)
    assert profile is not None, plan.name
    sparks = profile_events(staged_events(spark, plan), plan, staged_key_ranges(plan))
    if profile.changes < sum(s.staged.rows for s in plan.segments):  # some applied already
        # Spark's key ranges span the applied rows too; the driver's are narrower, within them.
        assert sparks.key_ranges is not None and profile.key_ranges is not None
        assert all(any(lo <= a and b <= hi for lo, hi in sparks.key_ranges) for a, b in profile.key_ranges)
        profile = replace(profile, key_ranges=sparks.key_ranges)
    assert profile == sparks, plan.name  # counts, kept columns, key ranges, TRUNCATEs
    built = arrow_source(plan, profile, MergeOptions())
    assert built is not None, plan.name
    computed = merge_source(spark, staged_events(spark, plan), plan, profile).toArrow()
    assert [f.type for f in built.schema] == [f.type for f in computed.schema], plan.name
    assert sorted_rows(built) == sorted_rows(computed), plan.name
    return profile


@pytest.mark.parametrize("seed", [1, 2])
def test_the_source_built_on_the_driver_equals_sparks(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    rng = random.Random(seed)
    live = set(range(0, 120, 3))
    first = first_rows(rng, live)
    light, plain = tmp_path / "light", tmp_path / "plain"
    created = write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])
    for root in (light, plain):
        merge_batches(spark, [created], str(root), DELTA_ONLY)
    applied = [first]
    start = 1_100
    for number in range(3):
        changes = random_run(seed * 10 + number, start, live)
        end = max(c.lsn for c in changes.parts[0].changes) + 16
        batch = write_batch(tmp_path / "staging", SLOT, start, end, [changes])
        start = end
        applied.append(changes)

        plan = only_plan(spark, batch, light)
        profile = profile_from_parts(plan)
        assert profile is not None
        built = arrow_source(plan, profile, MergeOptions())
        assert built is not None, number
        computed = merge_source(spark, staged_events(spark, plan), plan, profile).toArrow()
        assert built.column_names == computed.column_names
        assert [f.type for f in built.schema] == [f.type for f in computed.schema]
        assert sorted_rows(built) == sorted_rows(computed), number

        caplog.clear()
        with caplog.at_level(logging.INFO, logger=MERGE_LOG):
            got = merge_batches(spark, [batch], str(light))["tables"]["public.items"]
        assert "source row(s) built on the driver" in caplog.text
        want = merge_batches(spark, [batch], str(plain), DELTA_ONLY)["tables"]["public.items"]
        for name in ("status", "inserted", "updated", "deleted", "changes", "watermark_lsn"):
            assert got[name] == want[name], (number, name)
        expected = as_delta(Model().apply(*applied).state(COLUMNS))
        path_light, path_plain = light / "public" / "items", plain / "public" / "items"
        assert spark_rows(spark, path_light) == spark_rows(spark, path_plain), number
        assert delta_rs_rows(path_light) == delta_rs_rows(path_plain) == expected, number


CODED = [("code", "text", pa.string()), ("qty", "integer", pa.int32()), ("note", "text", pa.string())]


def test_a_text_key_gets_its_profile_and_source_on_the_driver(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A single text key (codes, UUIDs as text): the profile and the source come from the parts,
    its key range in byte order as Spark's; inserts of new codes are merged, not appended."""
    rng = random.Random(5)
    codes = ["a", "B", "é", "z", "zz", "éclair", "Ωa", "Ωb", "Ωc"]  # the last three after every file's range
    first = TableChanges("public", "coded", CODED, key=("code",))
    for code in codes[:6]:
        first.insert(1_000, code=code, qty=rng.randrange(100), note=None)
    root = tmp_path / "delta"
    merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])], str(root))
    changes = (
        TableChanges("public", "coded", CODED, key=("code",))
        .update(1_200, code="B", qty=1, note="updated")
        .update(1_210, {"code": "z"}, code="Ω", qty=2, note="moved")  # a key moved past every other
        .delete(1_220, code="a")
        .insert(1_230, code="0", qty=3, note="new")
    )
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, 1_300, [changes])
    (plan,) = plan_merge(spark, read_batches([batch]), str(root), MergeOptions())
    assert isinstance(plan, TablePlan)
    assert built_as_spark_computes(spark, plan).key_ranges == [("0", "Ω")]
    inserts = TableChanges("public", "coded", CODED, key=("code",))
    for code in codes[6:]:
        inserts.insert(1_400, code=code, qty=4, note="inserted")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        merge_batches(spark, [batch], str(root))
        merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, 1_300, 1_500, [inserts])], str(root))
    assert caplog.text.count("built on the driver") == 2 and "appended by delta-rs" not in caplog.text
    expected = Model(key=("code",)).apply(first, changes, inserts).state(["code", "qty", "note"])
    got = spark.read.format("delta").load(str(root / "public" / "coded")).select("code", "qty", "note").collect()
    assert sorted((r.asDict() for r in got), key=repr) == sorted(expected, key=repr)


SKUS = [("sku", "numeric(8,2)", pa.string()), ("qty", "integer", pa.int32())]


def test_a_numeric_key_gets_its_profile_and_source_on_the_driver(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``numeric(p,s)`` key staged as its text: the profile and the source come from the parts,
    the key (and its old image) cast to its decimal as Spark casts it, its range Spark's."""
    first = TableChanges("public", "skus", SKUS, key=("sku",))
    for n in range(6):
        first.insert(1_000, sku=f"{n}.50", qty=n)
    root = tmp_path / "delta"
    merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])], str(root))
    changes = (
        TableChanges("public", "skus", SKUS, key=("sku",))
        .update(1_200, sku="1.50", qty=10)
        .update(1_210, {"sku": "2.50"}, sku="-7.25", qty=11)  # a key moved below every other
        .delete(1_220, sku="3.50")
        .insert(1_230, sku="12.00", qty=12)
        .update(1_240, sku="12.00", qty=13)  # the same key again: the first effect is superseded
    )
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, 1_300, [changes])
    (plan,) = plan_merge(spark, read_batches([batch]), str(root), MergeOptions())
    assert isinstance(plan, TablePlan)
    assert built_as_spark_computes(spark, plan).key_ranges == [(Decimal("-7.25"), Decimal("12.00"))]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        result = merge_batches(spark, [batch], str(root))["tables"]["public.skus"]
    assert "built on the driver" in caplog.text
    assert (result["inserted"], result["updated"], result["deleted"]) == (2, 1, 2)  # a moved key: a delete, an insert
    expected = [
        {**row, "sku": Decimal(row["sku"])} for row in Model(key=("sku",)).apply(first, changes).state(["sku", "qty"])
    ]
    got = spark.read.format("delta").load(str(root / "public" / "skus")).select("sku", "qty").collect()
    assert sorted((r.asDict() for r in got), key=repr) == sorted(expected, key=repr)


EVENTS = [
    ("id", "bigint", pa.int64()),
    ("at", "timestamp without time zone", pa.timestamp("us")),
    ("n", "integer", pa.int32()),
]
LOGINS = [("id", "bigint", pa.int64()), ("day", "date", pa.date32()), ("n", "integer", pa.int32())]


def test_the_key_of_a_partitioned_table_gets_its_profile_and_source_on_the_driver(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key that holds a partition column beside the id (a timestamp without time zone, cast as
    Spark casts it, its old image too; a date): the profile and the source come from the parts."""
    at = datetime(2026, 3, 1, 12, 0)
    events = TableChanges("public", "events", EVENTS, key=("id", "at"))
    logins = TableChanges("public", "logins", LOGINS, key=("id", "day"))
    for n in range(5):
        events.insert(1_000, id=n, at=at + timedelta(days=n), n=n)
        logins.insert(1_000, id=n, day=date(2026, 3, 1 + n), n=n)
    root = tmp_path / "delta"
    merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, 900, 1_100, [events, logins])], str(root))
    events_run = (
        TableChanges("public", "events", EVENTS, key=("id", "at"))
        .update(1_200, id=1, at=at + timedelta(days=1), n=10)
        .update(1_210, {"id": 2, "at": at + timedelta(days=2)}, id=2, at=at + timedelta(days=40), n=11)  # moved
        .delete(1_220, id=3, at=at + timedelta(days=3))
        .insert(1_230, id=9, at=datetime(9999, 12, 31, 23, 59, 59, 999999), n=12)  # infinity, as staged
    )
    logins_run = (
        TableChanges("public", "logins", LOGINS, key=("id", "day"))
        .update(1_200, {"id": 0, "day": date(2026, 3, 1)}, id=0, day=date(2026, 4, 1), n=20)
        .delete(1_210, id=4, day=date(2026, 3, 5))
        .insert(1_220, id=4, day=date(2026, 3, 5), n=21)  # deleted, then inserted again
    )
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, 1_300, [events_run, logins_run])
    for plan in plan_merge(spark, read_batches([batch]), str(root), MergeOptions()):
        assert isinstance(plan, TablePlan)
        built_as_spark_computes(spark, plan)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        merge_batches(spark, [batch], str(root))
    assert caplog.text.count("built on the driver") == 2
    for name, changes, columns in (
        ("events", (events, events_run), ["id", "at", "n"]),
        ("logins", (logins, logins_run), ["id", "day", "n"]),
    ):
        # Spark reads the wall-clock time back as it was staged (its session's time zone is UTC).
        expected = Model(key=tuple(columns[:2])).apply(*changes).state(columns)
        got = spark.read.format("delta").load(str(root / "public" / name)).select(*columns).collect()
        assert sorted((r.asDict() for r in got), key=repr) == sorted(expected, key=repr), name


def test_a_truncate_gets_its_profile_and_source_on_the_driver(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(11)
    first = first_rows(rng, range(10))
    run = TableChanges("public", "items", ITEMS).update(1_200, **values(rng, 1)).delete(1_200, id=2)
    run.truncate(1_300).insert(1_300, **values(rng, 3))  # the same transaction, after its TRUNCATE
    for key in (20, 21, 22, 23):
        run.insert(1_310, **values(rng, key))
    run.update(1_320, **{**values(rng, 20), "t": UNCHANGED})  # keeps the t its insert set
    run.update(1_320, {"id": 21}, **values(rng, 31)).delete(1_330, id=22)
    later = TableChanges("public", "items", ITEMS).update(1_500, **{**values(rng, 23), "t": UNCHANGED})
    root = tmp_path / "delta"
    merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])], str(root), DELTA_ONLY)
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, 1_400, [run])

    plan = only_plan(spark, batch, root)
    profile = built_as_spark_computes(spark, plan)
    assert [(t.lsn, t.seq) for t in profile.truncations] == [(1_300, 0)]
    assert profile.truncates == 1 and profile.keep_columns == ("t",)
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        result = merge_batches(spark, [batch], str(root))["tables"]["public.items"]
    assert "built on the driver" in caplog.text and "merged by delta-rs" in caplog.text
    assert result["truncated"]
    # The rows from before the TRUNCATE are gone; the ones after it stay, read by Spark and delta-rs.
    expected = as_delta(Model().apply(first, run).state(COLUMNS))
    assert [row["id"] for row in expected] == [3, 20, 23, 31]
    assert delta_rs_rows(root / "public" / "items") == expected
    assert [row["id"] for row in spark_rows(spark, root / "public" / "items")] == [3, 20, 23, 31]
    # The next run keeps what Delta holds again.
    batch = write_batch(tmp_path / "staging", SLOT, 1_400, 1_600, [later])
    merge_batches(spark, [batch], str(root))
    assert delta_rs_rows(root / "public" / "items") == as_delta(Model().apply(first, run, later).state(COLUMNS))


def test_a_batch_partly_applied_gets_its_profile_and_source_on_the_driver(spark: Any, tmp_path: Path) -> None:
    """A batch extracted again after a crash overlaps what Delta holds: its changes already applied
    are left out on the driver as in Spark, and reported as such."""
    rng = random.Random(13)
    live = set(range(0, 60, 2))
    first = first_rows(rng, live)
    applied = random_run(131, 1_100, live)
    middle = max(c.lsn for c in applied.parts[0].changes) + 16
    more = random_run(132, middle, live)
    end = max(c.lsn for c in more.parts[0].changes) + 16
    replay = TableChanges("public", "items", ITEMS)
    replay.parts[0].changes = [*applied.parts[0].changes, *more.parts[0].changes]
    light, plain = tmp_path / "light", tmp_path / "plain"
    for root in (light, plain):
        merge_batches(spark, [write_batch(tmp_path / root.name, SLOT, 900, 1_100, [first])], str(root), DELTA_ONLY)
        merge_batches(spark, [write_batch(tmp_path / root.name, SLOT, 1_100, middle, [applied])], str(root))
    batch = write_batch(tmp_path / "replay", SLOT, 1_100, end, [replay])
    plan = only_plan(spark, batch, light)
    assert plan.segments[0].applied_through == middle
    profile = built_as_spark_computes(spark, plan)
    assert profile.changes == len(more.parts[0].changes)
    got = merge_batches(spark, [batch], str(light))["tables"]["public.items"]
    want = merge_batches(spark, [batch], str(plain), DELTA_ONLY)["tables"]["public.items"]
    assert got["changes_already_applied"] == want["changes_already_applied"] == len(applied.parts[0].changes)
    assert (got["inserted"], got["updated"], got["deleted"]) == (want["inserted"], want["updated"], want["deleted"])
    expected = as_delta(Model().apply(first, applied, more).state(COLUMNS))
    assert delta_rs_rows(light / "public" / "items") == delta_rs_rows(plain / "public" / "items") == expected


def test_truncates_of_a_history_table_are_profiled_on_the_driver_as_by_spark(spark: Any, tmp_path: Path) -> None:
    rng = random.Random(12)
    first = first_rows(rng, range(6), mode="history")
    run = TableChanges("public", "items", ITEMS, mode="history").update(1_200, **values(rng, 1))
    run.truncate(1_300).insert(1_310, **values(rng, 2)).truncate(1_320).insert(1_330, **values(rng, 4))
    runs = [write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])]
    runs.append(write_batch(tmp_path / "staging", SLOT, 1_100, 1_400, [run]))
    plan = only_plan(spark, runs[1], tmp_path / "none")
    profile = profile_from_parts(plan)
    assert profile == profile_events(staged_events(spark, plan), plan, staged_key_ranges(plan))
    assert profile is not None and [t.lsn for t in profile.truncations] == [1_300, 1_320]
    assert all(t.time_micros is not None and t.xid is not None for t in profile.truncations)
    # A kept mode's versions end at each TRUNCATE's commit: with the profile from the parts and
    # with the one from the Spark pass, the history table is the same, row for row.
    driver, sparks = tmp_path / "driver", tmp_path / "spark"
    for batch in runs:
        merge_batches(spark, [batch], str(driver))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("airflow_provider_pgdecode.spark.merge_job.profile_from_parts", lambda plan: None)
        for batch in runs:
            merge_batches(spark, [batch], str(sparks))
    for root in (driver, sparks):
        assert spark.read.format("delta").load(str(root / "public" / "items")).count() > 6
    history = [
        sorted((tuple(r) for r in spark.read.format("delta").load(str(root / "public" / "items")).collect()), key=repr)
        for root in (driver, sparks)
    ]
    assert history[0] == history[1]


def test_parts_that_need_spark_or_a_table_the_light_write_refuses(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(7)
    first = first_rows(rng, range(10))
    changes = TableChanges("public", "items", ITEMS).update(1_200, **values(rng, 1)).delete(1_210, id=2)
    toast = TableChanges("public", "items", ITEMS).update(1_300, **{**values(rng, 3), "t": UNCHANGED})
    priced = [*ITEMS, ("amount", "numeric", pa.string())]
    created = write_batch(tmp_path / "staging", SLOT, 900, 1_100, [first])
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, 1_250, [changes])
    later = write_batch(tmp_path / "staging", SLOT, 1_250, 1_350, [toast])

    # A table larger than the bound: the source is built on the driver, the table refused after it
    # is opened, and Delta's MERGE reads the changes in Spark.
    refused = tmp_path / "refused"
    merge_batches(spark, [created], str(refused), DELTA_ONLY)
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        result = merge_batches(spark, [batch], str(refused), MergeOptions(light_write_max_bytes=1))
    assert "above --light-write-max-bytes 1" in caplog.text
    assert result["tables"]["public.items"]["updated"] == 1 and result["tables"]["public.items"]["deleted"] == 1
    # More staged bytes than the driver reads whole: Spark computes the source, delta-rs writes it.
    bounded = tmp_path / "bounded"
    merge_batches(spark, [created], str(bounded), DELTA_ONLY)
    caplog.clear()
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO, logger=MERGE_LOG):
        patch.setattr(arrow_source_module, "DRIVER_SOURCE_MAX_BYTES", 100)
        merge_batches(spark, [batch], str(bounded))
    assert "MERGE source is computed by Spark (its staged parts hold more than the 100 bytes" in caplog.text
    assert "merged by delta-rs" in caplog.text and "built on the driver" not in caplog.text
    assert delta_rs_rows(bounded / "public" / "items") == as_delta(Model().apply(first, changes).state(COLUMNS))
    # Unchanged TOAST: the profile and the source from the parts, the value kept by the MERGE.
    plan = only_plan(spark, later, refused)
    profile = profile_from_parts(plan)
    assert profile is not None and profile.keep_columns == ("t",)
    built = arrow_source(plan, profile, MergeOptions())
    assert built is not None and built.column("__keep_0").to_pylist() == [True]
    assert sorted_rows(built) == sorted_rows(merge_source(spark, staged_events(spark, plan), plan, profile).toArrow())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        merge_batches(spark, [later], str(refused))
    assert "built on the driver" in caplog.text
    assert delta_rs_rows(refused / "public" / "items") == as_delta(Model().apply(first, changes, toast).state(COLUMNS))
    # An UPDATE that moves its key and leaves TOAST unchanged: its value follows the key's
    # lineage, which Spark's collapse does.
    moved = TableChanges("public", "items", ITEMS).update(1_400, {"id": 4}, **{**values(rng, 40), "t": UNCHANGED})
    batch = write_batch(tmp_path / "staging", SLOT, 1_350, 1_450, [moved])
    assert profile_from_parts(only_plan(spark, batch, refused)) is None
    merge_batches(spark, [batch], str(refused))
    assert delta_rs_rows(refused / "public" / "items") == as_delta(
        Model().apply(first, changes, toast, moved).state(COLUMNS)
    )

    # A numeric without a typmod, staged as text, whose digits fit its decimal(38,18) (zeros
    # aside): the driver builds the source, as Spark would.
    with_price = TableChanges("public", "items", priced)
    for key in range(5):
        with_price.insert(1_000, **values(rng, key), amount=f"{key}.50")
    priced_root = tmp_path / "priced"
    merge_batches(spark, [write_batch(tmp_path / "p", SLOT, 900, 1_100, [with_price])], str(priced_root), DELTA_ONLY)
    update = TableChanges("public", "items", priced).update(1_200, **values(rng, 1), amount="9.99" + "0" * 16)
    batch = write_batch(tmp_path / "p", SLOT, 1_100, 1_250, [update])
    plan = only_plan(spark, batch, priced_root)
    profile = profile_from_parts(plan)
    assert profile is not None
    built = arrow_source(plan, profile, MergeOptions())
    assert built is not None
    assert sorted_rows(built) == sorted_rows(merge_source(spark, staged_events(spark, plan), plan, profile).toArrow())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        merge_batches(spark, [batch], str(priced_root))
    assert "merged by delta-rs" in caplog.text and "built on the driver" in caplog.text
    amount = spark.read.format("delta").load(str(priced_root / "public" / "items")).where("id = 1").first()["amount"]
    assert amount == Decimal("9.99")


def test_tables_written_without_a_session_side_by_side(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Six tables whose sources the driver builds are committed in threads without a Spark
    session; the one whose write needs Spark after all (a column the source added) is written in
    the session, and every table equals the model and a merge by Delta alone."""
    names = [f"t{i}" for i in range(6)]
    widened = [*ITEMS, ("extra", "integer", pa.int32())]
    rng = random.Random(11)
    firsts, lives = {}, {}
    for name in names:
        lives[name] = set(range(0, 60, 2))
        firsts[name] = TableChanges("public", name, ITEMS)
        for key in sorted(lives[name]):
            firsts[name].insert(1_000, **values(rng, key))
    created = write_batch(tmp_path / "staging", SLOT, 900, 1_100, list(firsts.values()))
    light, plain = tmp_path / "light", tmp_path / "plain"
    for root in (light, plain):
        merge_batches(spark, [created], str(root), DELTA_ONLY)
    runs = {}
    for number, name in enumerate(names):
        run = random_run(100 + number, 1_100, lives[name])
        items = widened if name == "t5" else ITEMS
        runs[name] = TableChanges("public", name, items)
        for change in run.parts[0].changes:  # the same changes under the table's name
            extra = {"extra": number} if name == "t5" and change.new is not None else {}
            runs[name].parts[0].changes.append(replace(change, new={**change.new, **extra}) if extra else change)
    end = max(c.lsn for run in runs.values() for c in run.parts[0].changes) + 16
    batch = write_batch(tmp_path / "staging", SLOT, 1_100, end, list(runs.values()))

    with caplog.at_level(logging.INFO, logger=MERGE_LOG):
        got = merge_batches(spark, [batch], str(light))["tables"]
    want = merge_batches(spark, [batch], str(plain), DELTA_ONLY)["tables"]
    after_all = [r.getMessage() for r in caplog.records if "in a Spark session after all" in r.getMessage()]
    assert len(after_all) == 1 and after_all[0].startswith("table public.t5:"), after_all
    assert caplog.text.count("built on the driver") == len(names)
    for name in names:
        for field in ("status", "inserted", "updated", "deleted", "changes", "watermark_lsn"):
            assert got[f"public.{name}"][field] == want[f"public.{name}"][field], (name, field)
        columns = [*COLUMNS, "extra"] if name == "t5" else COLUMNS
        expected = as_delta(Model().apply(firsts[name], runs[name]).state(columns))
        path = light / "public" / name
        assert delta_rs_rows(path, columns) == delta_rs_rows(plain / "public" / name, columns) == expected, name
    assert spark_rows(spark, light / "public" / "t5") == spark_rows(spark, plain / "public" / "t5")
