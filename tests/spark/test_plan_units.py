"""Pure pieces of the merge job: type mapping, key-range merging, batch reading. No JVM needed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import DoubleType, LongType

from airflow_provider_pgdecode.batch.manifest import BatchManifest, read_batches
from airflow_provider_pgdecode.errors import BatchError, MergeInputError, UnmappedTypeError
from airflow_provider_pgdecode.spark.collapse import StagedKeys, superseded_effects
from airflow_provider_pgdecode.spark.merge_job import delta_table_path, merge_condition, merge_ranges
from airflow_provider_pgdecode.spark.session import delta_maven_coordinates, delta_spark_conf, ivy_dir
from airflow_provider_pgdecode.spark.spark_types import map_catalog_type, parse_unbounded_numeric_rule
from tests.spark.staged import TableChanges, write_batch


@pytest.mark.parametrize(
    ("catalog_type", "delta_type"),
    [
        ("smallint", "smallint"),
        ("integer", "int"),
        ("bigint", "bigint"),
        ("oid", "bigint"),
        ("real", "float"),
        ("double precision", "double"),
        ("numeric(10,2)", "decimal(10,2)"),
        ("numeric(7)", "decimal(7,0)"),
        ("numeric", "decimal(38,18)"),
        ("numeric(38,38)", "decimal(38,38)"),
        ("numeric(39,2)", "string"),
        ("numeric(5,-2)", "decimal(7,0)"),
        ("numeric(2,5)", "decimal(5,5)"),
        ("boolean", "boolean"),
        ("text", "string"),
        ("character varying(255)", "string"),
        ("character(1)", "string"),
        ('"char"', "string"),
        ("date", "date"),
        ("timestamp with time zone", "timestamp"),
        ("timestamp(3) with time zone", "timestamp"),
        ("timestamp without time zone", "timestamp"),
        ("time(6) without time zone", "string"),
        ("interval day to second", "string"),
        ("uuid", "string"),
        ("json", "string"),
        ("jsonb", "string"),
        ("bytea", "binary"),
        ("inet", "string"),
        ("bit(8)", "string"),
        ("text[]", "array<string>"),
        ("integer[]", "array<int>"),
        ("numeric(6,2)[]", "array<decimal(6,2)>"),
        ("timestamp with time zone[]", "array<timestamp>"),
        ("bytea[]", "array<binary>"),
    ],
)
def test_type_mapping(catalog_type: str, delta_type: str) -> None:
    assert map_catalog_type(catalog_type).delta_type.simpleString() == delta_type


def test_unmapped_types_and_overrides() -> None:
    assert map_catalog_type("geometry").delta_type.simpleString() == "string"  # PostGIS's text output
    assert map_catalog_type("mood[]").delta_type.simpleString() == "array<string>"
    assert map_catalog_type("mood[]", type_overrides={"mood": "string"}).delta_type.simpleString() == "array<string>"
    with pytest.raises(UnmappedTypeError, match="can only map to 'string'"):
        map_catalog_type("mood", type_overrides={"mood": "int"})
    string = parse_unbounded_numeric_rule("string")
    assert map_catalog_type("numeric", unbounded_numeric=string).delta_type.simpleString() == "string"
    assert map_catalog_type("numeric").may_lose_digits and not map_catalog_type("numeric(10,2)").may_lose_digits
    with pytest.raises(ValueError):
        parse_unbounded_numeric_rule("decimal(40,2)")


def test_merge_ranges_closes_smallest_gaps_and_covers_every_key() -> None:
    ranges = [(50, 60), (0, 10), (5, 12), (1000, 1000), (100, 120), (20, 30)]
    assert merge_ranges(ranges) == [(0, 12), (20, 30), (50, 60), (100, 120), (1000, 1000)]
    assert merge_ranges(ranges, max_ranges=2) == [(0, 120), (1000, 1000)]
    assert merge_ranges(ranges, max_ranges=1) == [(0, 1000)]


def test_paths_and_conditions_quote_awkward_names() -> None:
    assert delta_table_path("/d", "My Schema", "Order$") == "/d/My Schema/Order$"
    # Every name is one path part, and no two names share one.
    assert delta_table_path("/d", "public", "a/b") == "/d/public/a%2Fb"
    assert delta_table_path("/d", "public", "a%2Fb") == "/d/public/a%252Fb"
    assert delta_table_path("/d", "..", ".") == "/d/%2E%2E/%2E"
    assert delta_table_path("/d", "public", "q`") == "/d/public/q%60"
    assert delta_table_path("/d", "public", "a.b") == "/d/public/a.b"

    class Plan:
        key = ("we`ird id",)
        types = {"we`ird id": SimpleNamespace(delta_type=LongType())}

    assert merge_condition(Plan(), [(1, 5), (9, 9)]) == (  # type: ignore[arg-type]
        "((t.`we``ird id` BETWEEN 1 AND 5) OR (t.`we``ird id` BETWEEN 9 AND 9)) AND t.`we``ird id` = s.`we``ird id`"
    )
    # A key without bounds (floating point: NaN) is matched by equality alone.
    Plan.types = {"we`ird id": SimpleNamespace(delta_type=DoubleType())}
    assert merge_condition(Plan(), [(1.5, 5.0)]) == "t.`we``ird id` = s.`we``ird id`"  # type: ignore[arg-type]


def test_session_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert ivy_dir() == Path(__file__).resolve().parents[2] / ".cache" / "ivy"
    monkeypatch.setenv("PGDECODE_IVY_DIR", str(tmp_path / "ivy"))  # nothing resolved there yet
    assert ivy_dir() == tmp_path / "ivy"
    conf = delta_spark_conf()
    assert conf["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert conf["spark.sql.catalog.spark_catalog"] == "org.apache.spark.sql.delta.catalog.DeltaCatalog"
    assert conf["spark.ui.enabled"] == "false"
    assert conf["spark.jars.packages"] == delta_maven_coordinates() == "io.delta:delta-spark_4.2_2.13:4.4.0"
    assert conf["spark.jars.ivy"] == str(tmp_path / "ivy")
    monkeypatch.setenv("PGDECODE_DELTA_JARS", str(tmp_path))
    (tmp_path / "a.jar").write_bytes(b"")
    assert (
        delta_spark_conf()["spark.jars"] == str(tmp_path / "a.jar") and "spark.jars.packages" not in delta_spark_conf()
    )


def test_read_batches_orders_by_lsn_and_checks_the_manifest(tmp_path: Path) -> None:
    columns = [("id", "integer", pa.int32())]
    later = write_batch(
        tmp_path, "s", 0x1_0000_0010, 0x1_0000_0100, [TableChanges("public", "t", columns).insert(0x1_0000_0050, id=1)]
    )
    earlier = write_batch(tmp_path, "s", 0x10, 0x9_0000, [TableChanges("public", "t", columns).insert(0x20, id=1)])
    batches = read_batches([later, earlier])
    assert [str(b.start_lsn) for b in batches] == ["0/10", "1/10"]
    assert batches[1].tables[0].max_commit == 0x1_0000_0050
    other_slot = write_batch(tmp_path, "other", 0x10, 0x20, [TableChanges("public", "t", columns).insert(0x20, id=1)])
    with pytest.raises(BatchError, match="different slots"):
        read_batches([earlier, other_slot])
    manifest = Path(earlier) / "manifest.json"
    document = json.loads(manifest.read_text())
    document["format"] = "pgdecode.batch/2"
    manifest.write_text(json.dumps(document))
    with pytest.raises(BatchError, match="pgdecode.batch/1"):
        BatchManifest.read(earlier)
    document["format"] = "pgdecode.batch/1"
    document["tables"][0]["path"] = "../../elsewhere"
    manifest.write_text(json.dumps(document))
    with pytest.raises(BatchError, match="leaves the batch directory"):
        BatchManifest.read(earlier)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("smallint", "integer", True),
        ("integer", "bigint", True),
        ("smallint", "bigint", True),
        ("bigint", "integer", False),  # narrowing
        ("real", "double precision", True),
        ("double precision", "real", False),
        ("integer", "double precision", True),
        ("bigint", "double precision", False),  # not every bigint is a double: Delta refuses it
        ("numeric(10,2)", "numeric(12,2)", True),  # precision raised
        ("numeric(10,2)", "numeric(12,4)", True),  # as many more digits as more scale
        ("numeric(10,2)", "numeric(12,5)", False),  # fewer integer digits
        ("numeric(12,2)", "numeric(10,2)", False),
        ("numeric(10,2)", "numeric", True),  # decimal(38,18)
        ("integer", "numeric(12,2)", True),  # room for an int's 10 digits
        ("integer", "numeric(9,0)", False),
        ("bigint", "numeric(20,0)", True),
        ("numeric(30,2)", "numeric(40,2)", False),  # beyond Spark's decimal: staged as text, a string
        ("integer", "text", False),
        ("text", "integer", False),
        ("date", "timestamp without time zone", False),  # Delta widens a date to timestamp_ntz only
        ("integer[]", "bigint[]", False),  # widening inside arrays is not applied (refused)
        ("integer", "integer", False),  # no change is no widening
    ],
)
def test_which_source_type_changes_delta_widens(before: str, after: str, expected: bool) -> None:
    from airflow_provider_pgdecode.spark.spark_types import widens

    assert widens(map_catalog_type(before).delta_type, map_catalog_type(after).delta_type) is expected


@pytest.mark.parametrize(
    ("staged_as", "now", "expected"),
    [
        ("smallint", "text", True),
        ("integer", "text", True),
        ("bigint", "character varying(20)", True),
        ("boolean", "text", True),
        ("date", "text", False),  # its text depends on the DateStyle of the ALTER's session
        ("double precision", "text", False),  # Spark and PostgreSQL print floats differently
        ("numeric(10,2)", "text", False),  # a Delta decimal prints its whole scale
        ("integer", "bigint", False),  # not text: that is widening's
    ],
)
def test_which_staged_types_read_as_their_postgres_text(staged_as: str, now: str, expected: bool) -> None:
    from airflow_provider_pgdecode.spark.spark_types import prints_as_its_text

    staged = map_catalog_type(staged_as).delta_type
    assert prints_as_its_text(staged, map_catalog_type(now).delta_type) is expected


def _history_plan(tmp_path: Path, mode: str, properties: dict[str, str], **table: Any) -> None:
    """Plan one staged table of ``mode`` against an existing Delta table with ``properties``."""
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    from airflow_provider_pgdecode.spark.merge_job import DeltaState, MergeOptions, plan_table

    columns = [("id", "integer", pa.int32()), ("v", "integer", pa.int32())]
    changes = TableChanges("public", "h", columns, mode=mode, **table).insert(0x20, id=1, v=1)
    batches = read_batches([write_batch(tmp_path, "s", 0x10, 0x30, [changes])])
    schema = StructType(
        [StructField("id", IntegerType()), StructField("v", IntegerType()), StructField("_pg_commit_lsn", LongType())]
    )
    state = DeltaState(True, 3, 0x10, schema, {"pgdecode.key": '["id"]', **properties})
    plan_table("public", "h", batches, str(tmp_path / "delta"), state, MergeOptions())


def test_a_table_mode_change_is_refused_where_history_or_soft_delete_is_involved(tmp_path: Path) -> None:
    _history_plan(tmp_path / "a", "history", {"pgdecode.mode": "history"})
    _history_plan(tmp_path / "b", "append_only", {"pgdecode.mode": "merge"})  # as before: not refused
    for number, (mode, recorded) in enumerate(
        [
            ("history", {"pgdecode.mode": "merge"}),
            ("history", {}),
            ("merge", {"pgdecode.mode": "history"}),
            ("soft_delete", {"pgdecode.mode": "history"}),
        ]
    ):
        with pytest.raises(MergeInputError) as refused:
            _history_plan(tmp_path / str(number), mode, recorded)
        kept = recorded.get("pgdecode.mode", "merge")
        message = str(refused.value)
        assert f"is kept in mode '{kept}'" in message and f"with mode '{mode}'" in message, message
        assert "Nothing was written" in message and "resnapshot public.h" in message


def test_a_keyless_table_or_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MergeInputError, match=r"public\.h has no key .*mode 'history'.*primary key"):
        _history_plan(tmp_path / "a", "history", {}, key=("id", "v"), replica_identity="full")
    with pytest.raises(MergeInputError, match=r"mode 'scd9', which this merge job does not know"):
        _history_plan(tmp_path / "b", "scd9", {})


def test_key_ranges_join_neighbouring_buckets_and_keep_real_gaps() -> None:
    from airflow_provider_pgdecode.spark.profiling import _KeyRangeCollector

    # Keys spread over the whole span: every bucket is a neighbour of the next, one range.
    spread = _KeyRangeCollector((0, 99_999))
    spread.add(pa.array(range(0, 100_000, 7), pa.int64()), pa.nulls(len(range(0, 100_000, 7)), pa.int64()))
    assert spread.result().ranges == [(0, 99_995)]  # type: ignore[union-attr]
    # Two clusters, and a change that moved a key from one to the other: its move covers both.
    clusters = _KeyRangeCollector((0, 1_000_000))
    clusters.add(
        pa.array([5, 6, 900_000, 900_010, None], pa.int64()), pa.array([None, None, None, None, 7], pa.int64())
    )
    assert clusters.result().ranges == [(5, 7), (900_000, 900_010)]  # type: ignore[union-attr]
    moved = _KeyRangeCollector((0, 1_000_000))
    moved.add(pa.array([5, 900_000], pa.int64()), pa.array([None, 6], pa.int64()))
    assert moved.result().ranges == [(5, 5), (6, 900_000)]  # type: ignore[union-attr]
    # Without the bounds from the parts' statistics: the key's bounds are the one range.
    unbounded = _KeyRangeCollector(None)
    unbounded.add(pa.array([5, 900_000], pa.int64()), pa.nulls(2, pa.int64()))
    assert unbounded.result().ranges == [(5, 900_000)]  # type: ignore[union-attr]
    assert _KeyRangeCollector(None).result() is None


def _keys(ops: list[str], new: list[Any], old: list[Any], lsns: list[int], seqs: list[int]) -> StagedKeys:
    def chunked(values: list[Any], kind: pa.DataType) -> pa.ChunkedArray:
        return pa.chunked_array([pa.array(values, kind)])

    return StagedKeys(
        op=chunked(ops, pa.string()),
        new=(chunked(new, pa.int64()),),
        old=(chunked(old, pa.int64()),),
        lsn=chunked(lsns, pa.int64()),
        seq=chunked(seqs, pa.int32()),
    )


def test_superseded_effects_are_all_but_the_last_of_each_key() -> None:
    # INSERT 1; UPDATE 1; UPDATE moving 1 -> 2 (an upsert at 2, a delete at 1); DELETE 2; INSERT 1 again.
    part = _keys(["I", "U", "U", "D", "I"], [1, 1, 2, None, 1], [None, None, 1, 2, None], [10, 20, 30, 40, 50], [0] * 5)
    superseded = superseded_effects([part])
    assert superseded is not None
    assert sorted(superseded.to_pylist(), key=lambda e: (e["__lsn"], e["__kind"])) == [
        {"__kind": "U", "__lsn": 10, "__seq": 0},
        {"__kind": "U", "__lsn": 20, "__seq": 0},
        {"__kind": "D", "__lsn": 30, "__seq": 0},  # key 1's delete, before its INSERT at 50
        {"__kind": "U", "__lsn": 30, "__seq": 0},  # key 2's upsert, before its DELETE at 40
    ]
    # Within one transaction the position orders; keys changed once supersede nothing.
    assert superseded_effects([_keys(["I", "U", "I"], [1, 1, 2], [None] * 3, [10] * 3, [0, 1, 2])]).num_rows == 1
    assert superseded_effects([_keys(["I", "I"], [1, 2], [None] * 2, [10, 20], [0, 0])]).num_rows == 0


def test_superseded_effects_stand_aside_when_effects_cannot_be_told_apart() -> None:
    # Two INSERTs at one commit LSN and position: dropping one by its id would drop both.
    assert superseded_effects([_keys(["I", "I"], [1, 2], [None] * 2, [10, 10], [0, 0])]) is None
    assert superseded_effects([]) is None


def test_a_resnapshot_s_truncate_replaces_what_earlier_batches_staged() -> None:
    """Batches before the one that starts a resnapshot of a table are not read for it (its
    TRUNCATE empties the table): a parked table's refused changes are replaced that way. Kept
    modes keep every version, so every batch."""
    from types import SimpleNamespace

    from airflow_provider_pgdecode.spark.merge_plan import since_resnapshot

    def batch(label: str, end: int, truncates: str | None = None) -> Any:
        chunks = [{"table": truncates, "kind": "truncate"}, {"table": truncates, "kind": "rows"}] if truncates else []
        return SimpleNamespace(label=label, end=end, snapshot_chunks=chunks)

    merge, history = SimpleNamespace(mode="merge"), SimpleNamespace(mode="history")
    b1, b2, b3, b4 = batch("b1", 10), batch("b2", 20), batch("b3", 30, "public.t"), batch("b4", 40)
    entries = [(b1, merge), (b2, merge), (b3, merge), (b3, merge), (b4, merge)]
    assert since_resnapshot("public.t", entries) == entries[2:]  # both names of a renamed table kept
    assert since_resnapshot("public.other", entries) == entries  # another table's resnapshot
    assert since_resnapshot("public.t", [(b3, merge), (b4, merge)]) == [(b3, merge), (b4, merge)]
    kept = [(b, history) for b in (b1, b2, b3, b4)]
    assert since_resnapshot("public.t", kept) == kept


def test_keys_outside_every_files_range() -> None:
    from airflow_provider_pgdecode.spark.light_write import keys_outside

    assert keys_outside([(100, 140), (0, 5)], [10, 60], [59, 99])
    assert not keys_outside([(100, 140)], [10, 130], [59, 200])  # inside the second file's range
    assert not keys_outside([(59, 59)], [10], [59])  # the range's ends count
    assert not keys_outside([(1, 2)], [None], [None])  # a file without statistics
    assert keys_outside([(1, 2)], [], [])
