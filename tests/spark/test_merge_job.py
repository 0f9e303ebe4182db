"""The merge job against real Delta tables, with synthetic staged batches (docs/staging-format.md).

Expected states come from :class:`tests.spark.staged.Model`, which applies the same changes one
by one; the job's output is read back from Delta (with Spark, and with delta-rs where noted).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.errors import BatchError, MergeInputError
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from tests.spark.staged import UNCHANGED, Model, TableChanges, write_batch

pytestmark = pytest.mark.spark

SLOT = "pgdecode_test"
ORDERS = [("id", "integer", pa.int32()), ("note", "text", pa.string()), ("amount", "numeric(10,2)", pa.string())]
DOCS = [
    ("id", "bigint", pa.int64()),
    ("title", "character varying(40)", pa.string()),
    ("body", "text", pa.string()),
    ("blob", "bytea", pa.binary()),
]


def delta_rows(spark: Any, path: str, columns: Sequence[str], key: Sequence[str] = ("id",)) -> list[dict[str, Any]]:
    rows = [r.asDict() for r in spark.read.format("delta").load(path).select(*[f"`{c}`" for c in columns]).collect()]
    return sorted(({c: r[c] for c in columns} for r in rows), key=lambda r: tuple((r[k] is None, r[k]) for k in key))


def delta_version(spark: Any, path: str) -> int:
    from delta.tables import DeltaTable

    return DeltaTable.forPath(spark, path).history(1).collect()[0]["version"]


def history(spark: Any, path: str) -> list[tuple[int, str]]:
    from delta.tables import DeltaTable

    return [(r["version"], r["operation"]) for r in DeltaTable.forPath(spark, path).history().collect()]


def decimal(text: str | None) -> Decimal | None:
    return Decimal(text) if text is not None else None


def orders_state(model: Model) -> list[dict[str, Any]]:
    rows = model.state(["id", "note", "amount", "_pg_commit_lsn"])
    for row in rows:
        row["amount"] = decimal(row["amount"])
    return rows


# --------------------------------------------------------------------------------------------


def test_insert_update_delete_nulls_and_awkward_text(spark: Any, tmp_path: Path) -> None:
    awkward = 'it\'s "quoted",\nmulti-line\ttext; with \\ backslash and ünïcødé'
    first = (
        TableChanges("public", "orders", ORDERS)
        .insert(100, id=1, note="one", amount="10.50")
        .insert(100, id=2, note=awkward, amount=None)
        .insert(100, id=3, note=None, amount="-0.01")
        .insert(200, id=4, note="four", amount="4.00")
        .update(300, id=1, note="one, updated", amount="11.00")
        .update(300, id=1, note="one, updated twice", amount=None)  # last state within a transaction
        .delete(400, id=3)
        .insert(500, id=3, note="three again", amount="3.33")  # re-insert after delete
        .delete(500, id=4)
    )
    batch = write_batch(tmp_path / "staging", SLOT, 90, 510, [first])
    summary = merge_batches(spark, [batch], str(tmp_path / "delta"))

    path = str(tmp_path / "delta" / "public" / "orders")
    result = summary["tables"]["public.orders"]
    assert result["status"] == "merged" and result["created"] is True
    assert (result["inserted"], result["updated"], result["deleted"]) == (3, 0, 0)
    assert result["watermark_lsn"] == "0/1FE"
    expected = orders_state(Model().apply(first))
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == expected
    assert [r["note"] for r in expected if r["id"] == 2] == [awkward]

    # An independent reader (delta-rs) sees the same rows and the watermark as a Delta txn.
    import deltalake

    table = deltalake.DeltaTable(path)
    assert table.transaction_version(f"pgdecode:{SLOT}") == 510
    read = pa.table(
        deltalake.QueryBuilder().register("t", table).execute("select id, note from t order by id").read_all()
    )
    assert read.to_pylist() == [{"id": r["id"], "note": r["note"]} for r in expected]

    # Second batch against the existing table: updates, deletes, inserts in one MERGE.
    second = (
        TableChanges("public", "orders", ORDERS)
        .update(600, id=2, note=None, amount="2.00")
        .delete(600, id=1)
        .insert(700, id=5, note="five", amount="5.55")
    )
    before = delta_version(spark, path)
    summary = merge_batches(
        spark, [write_batch(tmp_path / "staging", SLOT, 510, 710, [second])], str(tmp_path / "delta")
    )
    result = summary["tables"]["public.orders"]
    assert (result["inserted"], result["updated"], result["deleted"]) == (1, 1, 1)
    assert delta_version(spark, path) == before + 1
    assert history(spark, path)[0] == (before + 1, "MERGE")
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(
        Model().apply(first, second)
    )


def test_primary_key_change_moves_the_row(spark: Any, tmp_path: Path) -> None:
    first = (
        TableChanges("public", "orders", ORDERS)
        .insert(100, id=1, note="a", amount="1.00")
        .insert(100, id=2, note="b", amount="2.00")
        .insert(100, id=3, note="c", amount="3.00")
    )
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [first])], str(tmp_path / "d"))
    second = (
        TableChanges("public", "orders", ORDERS)
        .update(200, old_key={"id": 1}, id=10, note="a moved", amount="1.00")  # a Delta row moves
        .update(300, old_key={"id": 10}, id=11, note="a moved again", amount="1.00")
        .insert(300, id=20, note="new", amount="20.00")
        .update(400, old_key={"id": 20}, id=21, note="new moved", amount="21.00")
        .delete(450, id=3)
        .update(500, old_key={"id": 2}, id=3, note="b takes freed key 3", amount="2.00")
    )
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 510, [second])], str(tmp_path / "d"))
    path = str(tmp_path / "d" / "public" / "orders")
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(
        Model().apply(first, second)
    )
    assert [r["id"] for r in delta_rows(spark, path, ["id"])] == [3, 11, 21]
    result = summary["tables"]["public.orders"]
    assert (result["inserted"], result["deleted"]) == (2, 2)  # 11 and 21 in; 1 and 2 out; 3 replaced


def test_truncate_mid_batch_then_changes_in_one_commit(spark: Any, tmp_path: Path) -> None:
    first = TableChanges("public", "orders", ORDERS)
    for i in range(1, 6):
        first.insert(100, id=i, note=f"old {i}", amount=f"{i}.00")
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [first])], str(tmp_path / "d"))
    path = str(tmp_path / "d" / "public" / "orders")
    before = delta_version(spark, path)

    second = (
        TableChanges("public", "orders", ORDERS)
        .update(200, id=1, note="changed before truncate", amount="9.00")
        .insert(200, id=6, note="inserted before truncate", amount="6.00")
        .insert(300, id=7, note="same tx, before the truncate", amount="7.00")
        .truncate(300)
        .insert(300, id=2, note="same tx, after the truncate", amount="2.50")
        .insert(400, id=8, note="after", amount="8.00")
        .update(500, id=8, note="after, updated", amount="8.50")
        .insert(500, id=9, note="after, deleted", amount="9.00")
        .delete(600, id=9)
    )
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 610, [second])], str(tmp_path / "d"))
    expected = orders_state(Model().apply(first, second))
    assert [r["id"] for r in expected] == [2, 8]
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == expected
    # One Delta commit for the whole batch, TRUNCATE included.
    # (the first batch, inserts into a new table, was appended: a WRITE)
    assert history(spark, path)[:2] == [(before + 1, "MERGE"), (before, "WRITE")]
    result = summary["tables"]["public.orders"]
    # 1, 3, 4, 5 deleted by the TRUNCATE; 2 existed before it and is written again after it.
    assert result["truncated"] is True
    assert (result["inserted"], result["updated"], result["deleted"]) == (1, 1, 4)


def test_unchanged_toast_keeps_delta_value_or_earlier_batch_value(spark: Any, tmp_path: Path) -> None:
    big = "x" * 5000
    first = TableChanges("public", "docs", DOCS)
    for i in range(1, 7):
        first.insert(100, id=i, title=f"t{i}", body=f"{big}-{i}", blob=bytes([i]) * 3000)
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [first])], str(tmp_path / "d"))

    second = (
        TableChanges("public", "docs", DOCS)
        # 1: unchanged TOAST only: keeps what Delta has.
        .update(200, id=1, title="t1 new", body=UNCHANGED, blob=UNCHANGED)
        # 2: an earlier change in the batch sets body (to NULL!), a later one leaves it unchanged.
        .update(200, id=2, title="t2 a", body=None, blob=UNCHANGED)
        .update(300, id=2, title="t2 b", body=UNCHANGED, blob=UNCHANGED)
        # 3: set, then unchanged twice.
        .update(200, id=3, title="t3 a", body="short body", blob=UNCHANGED)
        .update(300, id=3, title="t3 b", body=UNCHANGED, blob=UNCHANGED)
        .update(400, id=3, title="t3 c", body=UNCHANGED, blob=b"new blob")
        # 4: deleted and inserted again: the insert's value, never the old Delta value.
        .delete(200, id=4)
        .insert(300, id=4, title="t4 again", body=None, blob=None)
        .update(400, id=4, title="t4 again b", body=UNCHANGED, blob=UNCHANGED)
        # 5: a key change carrying unchanged TOAST: the value follows the row from key 5 to 50 to 51.
        .update(500, old_key={"id": 5}, id=50, title="t5 moved", body=UNCHANGED, blob=UNCHANGED)
        .update(600, old_key={"id": 50}, id=51, title="t5 moved twice", body=UNCHANGED, blob=UNCHANGED)
        # 6: moved onto a key freed in the batch, body set before the move.
        .update(500, id=6, title="t6", body="set before move", blob=UNCHANGED)
        .update(700, old_key={"id": 6}, id=4000, title="t6 moved", body=UNCHANGED, blob=UNCHANGED)
    )
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 710, [second])], str(tmp_path / "d"))
    path = str(tmp_path / "d" / "public" / "docs")
    columns = ["id", "title", "body", "blob", "_pg_commit_lsn"]
    expected = Model().apply(first, second).state(columns)
    actual = delta_rows(spark, path, columns)
    assert [r["id"] for r in actual] == [r["id"] for r in expected]
    for got, want in zip(actual, expected):
        assert {**got, "blob": bytes(got["blob"]) if got["blob"] is not None else None} == want, want["id"]
    by_id = {r["id"]: r for r in actual}
    assert by_id[1]["body"] == f"{big}-1" and bytes(by_id[1]["blob"]) == bytes([1]) * 3000
    assert by_id[2]["body"] is None
    assert by_id[51]["body"] == f"{big}-5"
    assert by_id[4000]["body"] == "set before move" and bytes(by_id[4000]["blob"]) == bytes([6]) * 3000


def test_unchanged_toast_in_a_new_table_without_earlier_value(spark: Any, tmp_path: Path) -> None:
    batch = (
        TableChanges("public", "docs", DOCS)
        .insert(100, id=1, title="a", body="body a", blob=b"a")
        .update(200, id=1, title="a2", body=UNCHANGED, blob=UNCHANGED)
    )
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 210, [batch])], str(tmp_path / "d"))
    rows = delta_rows(spark, str(tmp_path / "d" / "public" / "docs"), ["id", "title", "body"])
    assert rows == [{"id": 1, "title": "a2", "body": "body a"}]


ALL_TYPES = [
    ("id", "integer", pa.int32(), 1),
    ("c_smallint", "smallint", pa.int16(), -32768),
    ("c_bigint", "bigint", pa.int64(), 9223372036854775807),
    ("c_oid", "oid", pa.int64(), 4294967295),
    ("c_real", "real", pa.float32(), float("nan")),
    ("c_double", "double precision", pa.float64(), float("-inf")),
    ("c_double_inf", "double precision", pa.float64(), float("inf")),
    ("c_numeric", "numeric(10,2)", pa.string(), "12345678.91"),
    ("c_numeric_nan", "numeric(10,2)", pa.string(), "NaN"),
    ("c_numeric_unbounded", "numeric", pa.string(), "-12345678901234567890.123456789012345678"),
    ("c_numeric_big", "numeric(50,2)", pa.string(), "123456789012345678901234567890123456789012345678.99"),
    ("c_bool", "boolean", pa.bool_(), True),
    ("c_text", "text", pa.string(), "tëxt"),
    ("c_varchar", "character varying(20)", pa.string(), "vc"),
    ("c_char", "character(3)", pa.string(), "ab "),
    ("c_date", "date", pa.date32(), dt.date(2024, 2, 29)),
    ("c_date_inf", "date", pa.date32(), dt.date(9999, 12, 31)),
    ("c_ts", "timestamp without time zone", pa.timestamp("us"), dt.datetime(2024, 1, 2, 3, 4, 5, 123456)),
    (
        "c_tstz",
        "timestamp with time zone",
        pa.timestamp("us", tz="UTC"),
        dt.datetime(2024, 1, 2, 3, 4, 5, 654321, tzinfo=dt.UTC),
    ),
    ("c_uuid", "uuid", pa.string(), "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("c_json", "json", pa.string(), '{"a": [1, 2]}'),
    ("c_jsonb", "jsonb", pa.string(), '{"b": null}'),
    ("c_bytea", "bytea", pa.binary(), b"\x00\xff\x10"),
    ("c_text_arr", "text[]", pa.list_(pa.string()), ["a", None, 'q"uote']),
    ("c_int_arr", "integer[]", pa.list_(pa.int32()), [1, None, 3]),
    ("c_num_arr", "numeric(6,2)[]", pa.list_(pa.string()), ["1.50", None, "NaN"]),
    ("c_mood", "mood", pa.string(), "happy"),
    ("c_interval", "interval", pa.string(), "1 day 02:00:00"),
    ("c_time", "time without time zone", pa.string(), "12:34:56"),
    ("c_bits", "bit varying(8)", pa.string(), "1010"),
]


def test_every_mapped_type(spark: Any, tmp_path: Path) -> None:
    columns = [(name, catalog, arrow) for name, catalog, arrow, _ in ALL_TYPES]
    values = {name: value for name, _, _, value in ALL_TYPES}
    batch = (
        TableChanges("public", "all_types", columns)
        .insert(100, **values)
        .insert(100, **{name: (2 if name == "id" else None) for name in values})
    )
    options = MergeOptions(type_overrides={"mood": "string"})
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [batch])], str(tmp_path / "d"), options)
    assert summary["tables"]["public.all_types"]["numeric_specials_nulled"] == {"c_numeric_nan": 1, "c_num_arr": 1}
    frame = spark.read.format("delta").load(str(tmp_path / "d" / "public" / "all_types"))
    types = {f.name: f.dataType.simpleString() for f in frame.schema.fields}
    assert types == {
        "id": "int",
        "c_smallint": "smallint",
        "c_bigint": "bigint",
        "c_oid": "bigint",
        "c_real": "float",
        "c_double": "double",
        "c_double_inf": "double",
        "c_numeric": "decimal(10,2)",
        "c_numeric_nan": "decimal(10,2)",
        "c_numeric_unbounded": "decimal(38,18)",
        "c_numeric_big": "string",
        "c_bool": "boolean",
        "c_text": "string",
        "c_varchar": "string",
        "c_char": "string",
        "c_date": "date",
        "c_date_inf": "date",
        "c_ts": "timestamp",
        "c_tstz": "timestamp",
        "c_uuid": "string",
        "c_json": "string",
        "c_jsonb": "string",
        "c_bytea": "binary",
        "c_text_arr": "array<string>",
        "c_int_arr": "array<int>",
        "c_num_arr": "array<decimal(6,2)>",
        "c_mood": "string",
        "c_interval": "string",
        "c_time": "string",
        "c_bits": "string",
        "_pg_commit_lsn": "bigint",
        "_pg_commit_time": "timestamp",
        "_pg_xid": "bigint",
    }
    comments = {f.name: f.metadata.get("comment") for f in frame.schema.fields}
    assert comments["c_numeric"] == "PostgreSQL numeric(10,2)" and comments["c_mood"] == "PostgreSQL mood"
    rows = {r["id"]: r.asDict() for r in frame.collect()}
    row = rows[1]
    assert row["c_smallint"] == -32768 and row["c_bigint"] == 9223372036854775807 and row["c_oid"] == 4294967295
    assert row["c_real"] != row["c_real"]  # NaN kept
    assert row["c_double"] == float("-inf") and row["c_double_inf"] == float("inf")
    assert row["c_numeric"] == Decimal("12345678.91")
    assert row["c_numeric_nan"] is None
    assert row["c_numeric_unbounded"] == Decimal("-12345678901234567890.123456789012345678")
    assert row["c_numeric_big"] == values["c_numeric_big"]
    assert row["c_bool"] is True and row["c_text"] == "tëxt" and row["c_char"] == "ab "
    assert row["c_date"] == dt.date(2024, 2, 29) and row["c_date_inf"] == dt.date(9999, 12, 31)
    # Both timestamps are UTC instants; the one without zone keeps its wall-clock time as UTC.
    utc = spark.sql("select 1").sparkSession.conf.get("spark.sql.session.timeZone")
    assert utc == "UTC"
    check = (
        frame.where("id = 1")
        .selectExpr(
            "date_format(c_ts, 'yyyy-MM-dd HH:mm:ss.SSSSSS') as ts",
            "date_format(c_tstz, 'yyyy-MM-dd HH:mm:ss.SSSSSS') as tstz",
        )
        .collect()[0]
    )
    assert (check["ts"], check["tstz"]) == ("2024-01-02 03:04:05.123456", "2024-01-02 03:04:05.654321")
    assert row["c_uuid"] == values["c_uuid"] and json.loads(row["c_json"]) == {"a": [1, 2]}
    assert row["c_jsonb"] == '{"b": null}' and bytes(row["c_bytea"]) == b"\x00\xff\x10"
    assert row["c_text_arr"] == ["a", None, 'q"uote'] and row["c_int_arr"] == [1, None, 3]
    assert row["c_num_arr"] == [Decimal("1.50"), None, None]
    assert (row["c_mood"], row["c_interval"], row["c_time"], row["c_bits"]) == (
        "happy",
        "1 day 02:00:00",
        "12:34:56",
        "1010",
    )
    assert all(value is None for name, value in rows[2].items() if name.startswith("c_"))


def test_schema_evolution_added_and_dropped_columns(spark: Any, tmp_path: Path) -> None:
    first = (
        TableChanges("public", "orders", ORDERS)
        .insert(100, id=1, note="a", amount="1.00")
        .insert(100, id=2, note="b", amount="2.00")
    )
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [first])], str(tmp_path / "d"))
    with_status = ORDERS + [("status", "text", pa.string())]
    # Column added in the middle of a batch: a new part file starts with the new column.
    second = (
        TableChanges("public", "orders", ORDERS)
        .update(200, id=1, note="a before alter", amount="1.50")
        .alter(with_status)
        .update(300, id=2, note="b after alter", amount="2.50", status="shipped")
        .insert(300, id=3, note="c", amount="3.00", status="new")
    )
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 310, [second])], str(tmp_path / "d"))
    assert summary["tables"]["public.orders"]["columns_added"] == ["status"]
    path = str(tmp_path / "d" / "public" / "orders")
    columns = ["id", "note", "amount", "status"]
    model = Model().apply(first, second)
    expected = model.state(columns)
    for row in expected:
        row["amount"] = decimal(row["amount"])
    assert delta_rows(spark, path, columns) == expected

    # Column dropped at the source (a later batch no longer has "note"): kept in Delta, not written.
    without_note = [c for c in with_status if c[0] != "note"]
    third = (
        TableChanges("public", "orders", without_note)
        .update(400, id=3, amount="3.50", status="paid")
        .insert(400, id=4, amount="4.00", status="new")
    )
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 310, 410, [third])], str(tmp_path / "d"))
    assert summary["tables"]["public.orders"]["columns_not_written"] == ["note"]
    rows = {r["id"]: r for r in delta_rows(spark, path, columns)}
    assert rows[3] == {"id": 3, "note": "c", "amount": Decimal("3.50"), "status": "paid"}  # last note kept
    assert rows[4] == {"id": 4, "note": None, "amount": Decimal("4.00"), "status": "new"}

    # A batch of deletes only stages the key alone (a DELETE carries its old key): no column is gone.
    deletes = TableChanges("public", "orders", ORDERS[:1]).delete(500, id=4)
    summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 410, 510, [deletes])], str(tmp_path / "d"))
    assert summary["tables"]["public.orders"]["columns_not_written"] == []
    assert summary["tables"]["public.orders"]["deleted"] == 1
    assert sorted(r["id"] for r in delta_rows(spark, path, columns)) == [1, 2, 3]


def test_replay_and_overlapping_batches_change_nothing(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = (
        TableChanges("public", "orders", ORDERS)
        .insert(100, id=1, note="a", amount="1.00")
        .insert(200, id=2, note="b", amount="2.00")
        .delete(300, id=1)
    )
    batch1 = write_batch(tmp_path / "s", SLOT, 90, 310, [first])
    root = str(tmp_path / "d")
    merge_batches(spark, [batch1], root)
    path = str(tmp_path / "d" / "public" / "orders")
    state, versions = delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]), history(spark, path)

    # The same batch again: nothing changes, not even the Delta version.
    with caplog.at_level(logging.WARNING, logger="airflow_provider_pgdecode"):
        summary = merge_batches(spark, [batch1], root)
    assert summary["tables"]["public.orders"]["status"] == "skipped"
    assert summary["tables"]["public.orders"]["reason"] == "already applied"
    assert "already applied" in caplog.text
    assert history(spark, path) == versions
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == state

    # An overlapping batch (re-extracted from LSN 150): the part already applied is left out; the
    # re-sent insert of 1 at LSN 100 is not in it, its delete at 300 is, and must not be re-applied
    # as anything; the new change at 400 applies.
    overlap = (
        TableChanges("public", "orders", ORDERS)
        .insert(200, id=2, note="b", amount="2.00")
        .delete(300, id=1)
        .update(400, id=2, note="b new", amount="2.20")
    )
    batch2 = write_batch(tmp_path / "s", SLOT, 150, 410, [overlap])
    summary = merge_batches(spark, [batch2], root)
    result = summary["tables"]["public.orders"]
    assert result["changes"] == 1 and result["changes_already_applied"] == 2
    assert (result["inserted"], result["updated"], result["deleted"]) == (0, 1, 0)
    after_overlap = history(spark, path)
    assert len(after_overlap) == len(versions) + 1
    expected = orders_state(Model().apply(first).apply(overlap, applied_through=310))
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == expected

    # Both again, in one run and in either order: nothing changes.
    summary = merge_batches(spark, [batch2, batch1], root)
    assert summary["tables"]["public.orders"]["batches_skipped"] == [f"{SLOT}:0/5A-0/136", f"{SLOT}:0/96-0/19A"]
    assert history(spark, path) == after_overlap
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == expected


def test_two_batches_in_one_run_are_one_merge_in_lsn_order(spark: Any, tmp_path: Path) -> None:
    a = TableChanges("public", "orders", ORDERS).insert(100, id=1, note="a", amount="1.00")
    b = (
        TableChanges("public", "orders", ORDERS)
        .update(200, id=1, note="a2", amount="1.10")
        .insert(200, id=2, note="b", amount="2.00")
    )
    batch_a = write_batch(tmp_path / "s", SLOT, 90, 110, [a])
    batch_b = write_batch(tmp_path / "s", SLOT, 110, 210, [b])
    summary = merge_batches(spark, [batch_b, batch_a], str(tmp_path / "d"))  # given out of order
    path = str(tmp_path / "d" / "public" / "orders")
    assert summary["end_lsn"] == "0/D2"
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(Model().apply(a, b))
    assert [op for _, op in history(spark, path)] == ["MERGE", "CREATE TABLE"]


def test_small_runs_evaluate_expressions_interpreted_for_that_run_only(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below codegen_min_changes the run's writes see Spark's interpreted settings; the session has
    its own settings back afterwards, and a run at or above the bound compiles."""
    from airflow_provider_pgdecode.spark import merge_job

    seen: list[dict[str, str | None]] = []
    original = merge_job.ensure_table

    def spy(session: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append({key: session.conf.get(key, None) for key in merge_job.SMALL_RUN_CONF})
        return original(session, *args, **kwargs)

    monkeypatch.setattr(merge_job, "ensure_table", spy)
    before = {key: spark.conf.get(key, None) for key in merge_job.SMALL_RUN_CONF}
    assert before != dict(merge_job.SMALL_RUN_CONF)
    a = TableChanges("public", "orders", ORDERS).insert(100, id=1, note="a", amount="1.00")
    b = TableChanges("public", "orders", ORDERS).update(200, id=1, note="a2", amount="1.10").delete(200, id=1)
    b.insert(200, id=2, note="b", amount="2.00")
    root = str(tmp_path / "d")
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [a])], root, MergeOptions(codegen_min_changes=2))
    assert seen[-1] == dict(merge_job.SMALL_RUN_CONF)
    assert {key: spark.conf.get(key, None) for key in merge_job.SMALL_RUN_CONF} == before
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 210, [b])], root, MergeOptions(codegen_min_changes=3))
    assert seen[-1] == before
    assert {key: spark.conf.get(key, None) for key in merge_job.SMALL_RUN_CONF} == before
    path = str(tmp_path / "d" / "public" / "orders")
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(Model().apply(a, b))


def test_inserts_only_into_a_new_table_are_appended_in_one_commit(spark: Any, tmp_path: Path) -> None:
    """An initial-snapshot-shaped batch (TRUNCATE, then inserts) into a new table: appended, not merged."""
    load = TableChanges("public", "orders", ORDERS).truncate(300)
    for i in range(1, 8):
        load.insert(300, id=i, note=f"row {i}", amount=f"{i}.25")
    batch = write_batch(tmp_path / "s", SLOT, 0, 300, [load])
    summary = merge_batches(spark, [batch], str(tmp_path / "d"))
    path = str(tmp_path / "d" / "public" / "orders")
    result = summary["tables"]["public.orders"]
    assert result["status"] == "merged" and result["created"] is True and result["truncated"] is True
    assert (result["inserted"], result["updated"], result["deleted"]) == (7, 0, 0)
    assert result["watermark_lsn"] == "0/12C"
    assert [op for _, op in history(spark, path)] == ["WRITE", "CREATE TABLE"]
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(Model().apply(load))
    replay = merge_batches(spark, [batch], str(tmp_path / "d"))
    assert replay["tables"]["public.orders"]["status"] == "skipped"
    assert [op for _, op in history(spark, path)] == ["WRITE", "CREATE TABLE"]
    # Later changes merge as usual on top of it.
    more = TableChanges("public", "orders", ORDERS).update(400, id=1, note="changed", amount="1.00").delete(400, id=2)
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 300, 410, [more])], str(tmp_path / "d"))
    assert delta_rows(spark, path, ["id", "note", "amount", "_pg_commit_lsn"]) == orders_state(
        Model().apply(load, more)
    )


# -- bad input: a clear error, and Delta unchanged ---------------------------------------------


def _existing_table(spark: Any, tmp_path: Path) -> tuple[str, str, list[tuple[int, str]]]:
    first = TableChanges("public", "orders", ORDERS).insert(100, id=1, note="a", amount="1.00")
    root = str(tmp_path / "d")
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 90, 110, [first])], root)
    path = str(tmp_path / "d" / "public" / "orders")
    return root, path, history(spark, path)


def test_bad_input_no_key_leaves_delta_unchanged(spark: Any, tmp_path: Path) -> None:
    root, path, versions = _existing_table(spark, tmp_path)
    good = TableChanges("public", "orders", ORDERS).insert(200, id=2, note="b", amount="2.00")
    keyless = TableChanges("public", "events", [("at", "text", pa.string())], key=()).insert(200, at="x")
    batch = write_batch(tmp_path / "s", SLOT, 110, 210, [good, keyless])
    with pytest.raises(MergeInputError, match=r"public\.events has no primary key"):
        merge_batches(spark, [batch], root)

    assert history(spark, path) == versions
    assert not (tmp_path / "d" / "public" / "events").exists()


def test_a_type_without_a_native_mapping_is_kept_as_its_text(spark: Any, tmp_path: Path) -> None:
    """An extension's type (PostGIS geometry, hstore): staged and kept as the text PostgreSQL
    printed; it used to be refused after the batch was published, one table per run (issue 35)."""
    columns = [("id", "integer", pa.int32()), ("shape", "geometry", pa.string()), ("tags", "hstore", pa.string())]
    places = TableChanges("public", "places", columns).insert(
        300, id=1, shape="0101000000000000000000F03F", tags='"a"=>"1"'
    )
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 210, 310, [places])], str(tmp_path / "d"))
    frame = spark.read.format("delta").load(str(tmp_path / "d" / "public" / "places"))
    assert dict(frame.dtypes)["shape"] == dict(frame.dtypes)["tags"] == "string"
    assert [(r["id"], r["shape"], r["tags"]) for r in frame.collect()] == [
        (1, "0101000000000000000000F03F", '"a"=>"1"')
    ]


def test_bad_input_missing_or_incomplete_batches_leave_delta_unchanged(spark: Any, tmp_path: Path) -> None:
    root, path, versions = _existing_table(spark, tmp_path)
    good = write_batch(
        tmp_path / "s",
        SLOT,
        110,
        210,
        [TableChanges("public", "orders", ORDERS).insert(200, id=2, note="b", amount="2.00")],
    )

    def changes(lsn: int) -> list[TableChanges]:
        return [TableChanges("public", "orders", ORDERS).insert(lsn, id=lsn, note="x", amount="1.00")]

    no_manifest = write_batch(tmp_path / "s", SLOT, 210, 310, changes(300), manifest=False)
    with pytest.raises(BatchError, match="manifest.json is missing"):
        merge_batches(spark, [good, no_manifest], root)

    incomplete = write_batch(tmp_path / "s", SLOT, 310, 410, changes(400), complete=False)
    with pytest.raises(BatchError, match="marked incomplete"):
        merge_batches(spark, [good, incomplete], root)

    missing_file = write_batch(tmp_path / "s", SLOT, 410, 510, changes(500))
    next(Path(missing_file).rglob("part-00000.parquet")).unlink()
    with pytest.raises(BatchError, match="missing"):
        merge_batches(spark, [good, missing_file], root)

    assert history(spark, path) == versions
    assert [r["id"] for r in delta_rows(spark, path, ["id"])] == [1]


def test_null_key_and_numeric_overflow_are_refused(spark: Any, tmp_path: Path) -> None:
    root, path, versions = _existing_table(spark, tmp_path)
    null_key = TableChanges("public", "orders", ORDERS).insert(200, id=None, note="no key", amount="1.00")
    with pytest.raises(MergeInputError, match="NULL key"):
        merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 210, [null_key])], root)
    wide = TableChanges("public", "wide", [("id", "integer", pa.int32()), ("n", "numeric", pa.string())])
    wide.insert(300, id=1, n="0." + "1" * 25)
    with pytest.raises(MergeInputError, match="do not fit the unbounded-numeric mapping"):
        merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 210, 310, [wide])], root)
    assert history(spark, path) == versions
    assert not (tmp_path / "d" / "public" / "wide").exists()
    # The documented way out: unbounded numeric as exact text.
    merge_batches(
        spark, [write_batch(tmp_path / "s2", SLOT, 210, 310, [wide])], root, MergeOptions(unbounded_numeric="string")
    )
    assert delta_rows(spark, str(tmp_path / "d" / "public" / "wide"), ["id", "n"]) == [{"id": 1, "n": "0." + "1" * 25}]


def test_older_batch_is_skipped_and_logged(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, path, _ = _existing_table(spark, tmp_path)
    newer = TableChanges("public", "orders", ORDERS).update(300, id=1, note="newer", amount="3.00")
    merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 110, 310, [newer])], root)
    versions = history(spark, path)
    older = TableChanges("public", "orders", ORDERS).update(200, id=1, note="older", amount="2.00")
    with caplog.at_level(logging.WARNING, logger="airflow_provider_pgdecode"):
        summary = merge_batches(spark, [write_batch(tmp_path / "s", SLOT, 150, 250, [older])], root)
    assert summary["tables"]["public.orders"]["status"] == "skipped"
    assert "0/96-0/FA" in caplog.text and "already applied" in caplog.text and "0/136" in caplog.text
    assert history(spark, path) == versions
    assert delta_rows(spark, path, ["id", "note"]) == [{"id": 1, "note": "newer"}]
