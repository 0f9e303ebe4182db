"""Timestamps in Delta as every reader takes them: the merge writes TIMESTAMP_MICROS, not Spark's
INT96, which delta-rs and pyarrow read as nanoseconds (9999-12-31 23:59:59.999999, infinity's
clamp and many a "valid to", came back from them as 1816-03-30: issue 35)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.spark.merge_job import merge_batches
from tests.spark.staged import TableChanges, write_batch

pytestmark = pytest.mark.spark

COLUMNS = [
    ("id", "integer", pa.int32()),
    ("valid_to", "timestamp with time zone", pa.timestamp("us", tz="UTC")),
    ("local_ts", "timestamp without time zone", pa.timestamp("us")),
]
UTC = dt.UTC
VALUES = {
    1: (dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), dt.datetime(9999, 12, 31, 23, 59, 59, 999999)),
    2: (dt.datetime(1, 1, 1, tzinfo=UTC), dt.datetime(1, 1, 1)),
    3: (dt.datetime(2026, 11, 27, 10, 4, 5, 123456, tzinfo=UTC), dt.datetime(1900, 2, 28, 23, 0, 0, 1)),
}


def test_delta_rs_reads_the_extreme_timestamps_the_merge_wrote(spark: Any, tmp_path: Path) -> None:
    import deltalake

    changes = TableChanges("public", "validity", COLUMNS)
    for key, (valid_to, local) in VALUES.items():
        changes.insert(100 + key, id=key, valid_to=valid_to, local_ts=local)
    root = tmp_path / "delta"
    merge_batches(spark, [write_batch(tmp_path / "staging", "slot_ts", 90, 200, [changes])], str(root))

    table = deltalake.DeltaTable(str(root / "public" / "validity"))
    query = deltalake.QueryBuilder().register("t", table).execute("SELECT id, valid_to, local_ts FROM t")
    rows = {r["id"]: (r["valid_to"], r["local_ts"]) for r in pa.table(query.read_all()).to_pylist()}
    # A timestamp without time zone is kept as the UTC instant of its wall-clock time (docs/merge.md).
    assert rows == {k: (v[0], v[1].replace(tzinfo=UTC)) for k, v in VALUES.items()}
    # What Spark reads back too.
    # What Spark reads back too (as microseconds: PySpark's datetime conversion refuses year 1 off UTC).
    spark_rows = (
        spark.read.format("delta")
        .load(str(root / "public" / "validity"))
        .selectExpr("id", "unix_micros(valid_to) AS us")
    ).collect()
    epoch = dt.datetime(1970, 1, 1, tzinfo=UTC)
    expected = {k: (v[0] - epoch) // dt.timedelta(microseconds=1) for k, v in VALUES.items()}
    assert {r["id"]: r["us"] for r in spark_rows} == expected
