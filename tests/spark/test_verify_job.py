"""The verify job: Delta against a copy of PostgreSQL as of one LSN, narrowed to the differing keys.

The narrowing logic alone first; then real PostgreSQL, Spark and Delta: a pipeline under a
concurrent writer verifies equal, and rows changed in Delta by hand are named by key.
"""

from __future__ import annotations

import datetime
import decimal
import json
import random
import threading
from pathlib import Path

import psycopg
import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot
from airflow_provider_pgdecode.errors import VerifyError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.spark.verify_job import (
    Fingerprint,
    describe_difference,
    differing_buckets,
    differing_columns,
    json_value,
    summarize,
    total,
    verify_tables,
)

# -- narrowing, pure ----------------------------------------------------------------------------


def test_buckets_that_differ_are_found_also_when_absent_on_one_side() -> None:
    source = {0: Fingerprint(2, 10), 1: Fingerprint(1, 5), 3: Fingerprint(1, 7)}
    delta = {0: Fingerprint(2, 10), 1: Fingerprint(1, 6), 2: Fingerprint(1, 1)}
    assert differing_buckets(source, delta) == [1, 2, 3]
    assert differing_buckets(source, dict(source)) == []
    assert total(source) == Fingerprint(4, 22)
    # Multiset: one row twice is not the same as the row once (the sum keeps duplicates).
    assert differing_buckets({0: Fingerprint(2, 2 * 99)}, {0: Fingerprint(1, 99)}) == [0]


def test_a_difference_is_described_by_the_rows_on_each_side() -> None:
    assert describe_difference(1, 0, keyless=False) == "missing in Delta"
    assert describe_difference(0, 1, keyless=False) == "not in PostgreSQL"
    assert describe_difference(1, 2, keyless=True) == "1 row(s) in PostgreSQL, 2 in Delta"
    assert describe_difference(1, 1, keyless=False) == "rows differ"
    nan = float("nan")
    source = {"id": 1, "name": "a", "v": nan, "tags": [1, 2]}
    assert differing_columns(source, {"id": 1, "name": "b", "v": nan, "tags": [1, 2]}, ["id", "name", "v", "tags"]) == [
        "name"
    ]
    assert differing_columns(source, {**source, "tags": [1]}, ["tags"]) == ["tags"]


def test_values_in_the_report_are_json() -> None:
    assert json_value(decimal.Decimal("1.50")) == "1.50"
    assert json_value(datetime.date(2026, 1, 2)) == "2026-01-02"
    assert json_value(b"\x01\xff") == "\\x01ff"
    assert json_value([1, float("inf")]) == [1, "inf"]
    report = {
        "slot": "s",
        "lsn": "0/10",
        "equal": False,
        "tables": {
            "public.a": {"equal": True},
            "public.b": {"equal": False, "source_rows": 3, "delta_rows": 2, "differing_keys": 1},
        },
    }
    assert summarize(report) == {
        "slot": "s",
        "lsn": "0/10",
        "equal": False,
        "tables_checked": 2,
        "differing_tables": {"public.b": {"source_rows": 3, "delta_rows": 2, "keys": 1}},
    }


# -- against PostgreSQL, Spark and Delta -------------------------------------------------------

TABLES = ["public.vj_items", "public.vj_log", "public.vj_empty"]


class Writer(threading.Thread):
    """Inserts, updates (a key change too) and deletes in short transactions until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.ops = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(13)
        next_id = 10_000
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop.is_set():
                    r, k = rng.random(), rng.randint(1, 300)
                    if r < 0.35:
                        next_id += 1
                        c.execute("insert into vj_items values (%s, 'new', 1.25, now())", (next_id,))
                    elif r < 0.6:
                        c.execute("update vj_items set amount = amount + 1, name = name || '+' where id = %s", (k,))
                    elif r < 0.65:
                        c.execute("update vj_items set id = id + 1000000 where id = %s", (k,))
                    elif r < 0.75:
                        c.execute("delete from vj_items where id = %s", (k,))
                    else:  # distinct rows: duplicates of a keyless table are issue #13's merge fix
                        next_id += 1
                        c.execute("insert into vj_log values (%s, 'event')", (next_id,))
                    self.ops += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture
def pipeline(pg_conn, pg_dsn, slot_name, tmp_path, spark):
    """A slot with its initial load merged into Delta; yields (staging, delta_root)."""
    c = pg_conn
    c.execute("drop table if exists vj_items, vj_log, vj_empty")
    c.execute(
        "create table vj_items (id int primary key, name text, amount numeric(10,2), at timestamptz);"
        " create table vj_log (n int, what text); alter table vj_log replica identity full;"
        " create table vj_empty (id int primary key)"
    )
    c.execute("insert into vj_items select g, 'item ' || g, g * 0.5, now() from generate_series(1, 300) g")
    c.execute("insert into vj_log select g, 'start' from generate_series(1, 20) g")
    staging, delta = tmp_path / "staging", str(tmp_path / "delta")
    with create_slot_with_snapshot(pg_dsn, slot_name) as snapshot:
        load = stage_snapshot(pg_dsn, snapshot.snapshot_name, snapshot.consistent_lsn, slot_name, staging, TABLES)
    merge_batches(spark, [str(load.path)], delta)
    return staging, delta


@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.slow
def test_equal_under_a_concurrent_writer_then_a_changed_row_is_named(
    pg_conn, pg_dsn, slot_name, spark, pipeline
) -> None:
    from delta.tables import DeltaTable

    staging, delta = pipeline
    writer = Writer(pg_dsn)
    writer.start()
    try:
        while writer.ops < 100 and writer.error is None:
            threading.Event().wait(0.01)
        snapshot = stage_verify_snapshot(pg_dsn, slot_name, staging, TABLES)
        ops_at_copy = writer.ops
        # Delta to X while the writer goes on: the extract's ceiling is the copy's LSN.
        batch = extract_batch(pg_conn, slot_name, staging, upto_lsn=snapshot.lsn, tables=TABLES)
        merge_batches(spark, [str(batch.path)], delta)
        while writer.ops < ops_at_copy + 50 and writer.error is None:
            threading.Event().wait(0.01)
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None, writer.error

    report = verify_tables(spark, snapshot.path, delta, slot_name, snapshot.lsn, snapshot.tables)
    assert report["equal"], json.dumps(report["tables"], indent=1)
    items = report["tables"]["public.vj_items"]
    assert items["source_rows"] == items["delta_rows"] > 0
    assert report["tables"]["public.vj_empty"] == {
        **report["tables"]["public.vj_empty"],
        "equal": True,
        "delta_rows": 0,
    }
    assert writer.ops >= ops_at_copy + 50  # ...while the writer went on past X

    # One Delta row changed by hand, one deleted, and a keyless row duplicated.
    path = f"{delta}/public/vj_items"
    changed = spark.read.format("delta").load(path).orderBy("id").first()["id"]
    gone = spark.read.format("delta").load(path).orderBy("id", ascending=False).first()["id"]
    DeltaTable.forPath(spark, path).update(f"id = {changed}", {"name": "'tampered'"})
    DeltaTable.forPath(spark, path).delete(f"id = {gone}")
    log_path = f"{delta}/public/vj_log"
    spark.read.format("delta").load(log_path).where("n = 7 and what = 'start'").write.format("delta").mode(
        "append"
    ).save(log_path)

    report = verify_tables(spark, snapshot.path, delta, slot_name, snapshot.lsn, snapshot.tables, buckets=16)
    assert not report["equal"]
    assert report["differing_tables"] == ["public.vj_items", "public.vj_log"]
    items = report["tables"]["public.vj_items"]
    assert items["delta_rows"] == items["source_rows"] - 1
    assert items["differing_keys"] == 2
    assert items["keys"] == [
        {"key": {"id": changed}, "source_rows": 1, "delta_rows": 1, "difference": "rows differ", "columns": ["name"]},
        {"key": {"id": gone}, "source_rows": 1, "delta_rows": 0, "difference": "missing in Delta"},
    ]
    log = report["tables"]["public.vj_log"]
    assert log["keyless"] and log["differing_keys"] == 1
    assert log["keys"] == [
        {
            "key": {"n": 7, "what": "start"},
            "source_rows": 1,
            "delta_rows": 2,
            "difference": "1 row(s) in PostgreSQL, 2 in Delta",
        }
    ]
    # A bounded list: the count stays exact.
    short = verify_tables(spark, snapshot.path, delta, slot_name, snapshot.lsn, snapshot.tables, max_keys=1)
    assert short["tables"]["public.vj_items"]["differing_keys"] == 2
    assert len(short["tables"]["public.vj_items"]["keys"]) == 1

    # Delta merged past X meanwhile: the two sides are no longer of one moment.
    later = extract_batch(pg_conn, slot_name, staging, tables=TABLES)
    merge_batches(spark, [str(later.path)], delta)
    with pytest.raises(VerifyError, match=r"past the verify LSN .*public\.vj_items.*Run the verify again"):
        verify_tables(spark, snapshot.path, delta, slot_name, snapshot.lsn, snapshot.tables)
    assert Path(snapshot.path).is_dir()
