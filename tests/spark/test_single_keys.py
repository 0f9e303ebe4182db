"""A table keyed by one column of each key type, merged by Delta's MERGE, whose ON condition holds
the batch's key bounds (:mod:`airflow_provider_pgdecode.spark.key_bounds`), with the driver in a time
zone other than the Spark session's UTC. A bound Spark read as another value made the MERGE miss the
rows it should match: a bytea key's bounds were the text of Python's bytes, a timestamp's the
driver's local time read as UTC, and their updates were inserted beside the rows and their deletes
lost. And the same through delta-rs's MERGE, its source built on the driver, which now takes a
single date, timestamp or bytes key too. Delta equal to PostgreSQL after inserts, then after updates
and deletes."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal

import pytest
from pyspark.sql.types import BinaryType, DateType, DecimalType, LongType, StringType, TimestampType

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.spark.key_bounds import bound_sql
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from pgdecode_testing.compare import compare_table

pytestmark = pytest.mark.spark

# table: (key type, the key of row g)
KEYS = {
    "sk_bytea": ("bytea", "decode(lpad(to_hex(g * 37), 8, '0'), 'hex')"),
    "sk_tstz": ("timestamptz", "timestamptz '2024-03-10 00:00:00+00' + g * interval '1 hour'"),
    "sk_ts": ("timestamp", "timestamp '2024-03-10 00:00:00' + g * interval '1 hour'"),
    "sk_date": ("date", "date '2024-01-01' + g"),
    "sk_numeric": ("numeric(12,2)", "g * 1.25"),
    "sk_text": ("text", "'it''s \\ ' || lpad(g::text, 3, '0')"),
    "sk_float": ("double precision", "g * 1.5"),
}
ROWS = 60
DRIVER_ZONE = "America/New_York"  # a daylight-saving change on 2024-03-10, inside the timestamp keys


@contextmanager
def driver_zone(zone: str) -> Iterator[None]:
    """This process in time zone ``zone`` for the block (the comparison reads timestamps in its own)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = zone
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


@pytest.mark.postgres
@pytest.mark.parametrize("writer", ["delta", "delta-rs"])
def test_a_single_key_of_each_type_is_matched_by_the_merge_in_any_driver_time_zone(
    pg_conn, slot_name, tmp_path, spark, writer
) -> None:
    c = pg_conn
    for table, (kind, _) in KEYS.items():
        c.execute(f"drop table if exists {table}; create table {table} (k {kind} primary key, v text)")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    # Delta's MERGE (its condition holds the bounds), or delta-rs's with the source the driver built
    options = MergeOptions(light_write_max_bytes=0) if writer == "delta" else MergeOptions()
    checkpoint = None
    try:
        for round_ in range(2):
            for table, (_, key) in KEYS.items():
                if round_ == 0:
                    c.execute(f"insert into {table} select {key}, 'v' || g from generate_series(1, {ROWS}) g")
                    continue
                chosen = f"select {key} from generate_series(1, {ROWS}) g"
                c.execute(f"update {table} set v = v || '+' where k in ({chosen} where g % 3 = {round_})")
                c.execute(f"delete from {table} where k in ({chosen} where g % 7 = {round_})")
            batch = extract_batch(c, slot_name, staging, checkpoint=checkpoint, tables=[f"public.{t}" for t in KEYS])
            with driver_zone(DRIVER_ZONE):
                summary = merge_batches(spark, [str(batch.path)], root, options)
            assert {t["status"] for t in summary["tables"].values()} == {"merged"}
            unequal = [r.describe() for r in (compare_table(c, spark, root, "public", t) for t in KEYS) if not r.equal]
            assert unequal == [], (round_, unequal)
            c.execute("select pg_replication_slot_advance(%s, %s)", (slot_name, batch.end_lsn))
            checkpoint = Checkpoint.from_manifest(batch)
    finally:
        c.execute("select pg_drop_replication_slot(%s)", (slot_name,))
        c.execute("; ".join(f"drop table if exists {t}" for t in KEYS))


BOUNDS = [
    (-(2**63), LongType()),
    ("it's a \\ back'slash, ünïcödé", StringType()),
    (Decimal("1E+2"), DecimalType(12, 2)),
    (Decimal("-0.01"), DecimalType(12, 2)),
    (b"\x00\xff'\\", BinaryType()),
    (dt.date(1, 1, 1), DateType()),
    (dt.date(9999, 12, 31), DateType()),
    (1_710_054_000_123_456, TimestampType()),  # microseconds: 2024-03-10 07:00:00.123456 UTC
    (-62_135_596_800_000_000, TimestampType()),  # 0001-01-01 00:00:00 UTC
]


def test_each_bound_is_read_back_by_spark_as_the_value_it_came_from(spark) -> None:
    for value, delta_type in BOUNDS:
        literal = bound_sql(value, delta_type)
        # A timestamp as its microseconds: Python's datetime would bring in the driver's zone.
        read_as = f"unix_micros({literal})" if isinstance(delta_type, TimestampType) else literal
        read = spark.sql(f"SELECT {read_as} AS b").collect()[0]["b"]
        assert read == value, (literal, read)
        assert spark.sql(f"SELECT typeof({literal}) AS t").collect()[0]["t"] == delta_type.simpleString()
    for no_bound in (True, None):
        with pytest.raises(TypeError):
            bound_sql(no_bound, LongType())
