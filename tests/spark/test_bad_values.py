"""Values the pipeline cannot carry, from PostgreSQL through staging into Delta: quarantined beside
good rows (exactly once, both paths staging the same batch), and arrays of any dimension as JSON."""

from __future__ import annotations

import json

import pytest

from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.spark.side_tables import quarantine_table_path
from tests.capture.test_bad_values import OPTIONS, assert_same_quarantine, extract, source, workload  # noqa: F401
from tests.capture.test_native import assert_same_batches

pytestmark = [pytest.mark.postgres, pytest.mark.spark]


@pytest.mark.parametrize("plugin", ["test_decoding", pytest.param("pgoutput", marks=pytest.mark.slow)])
def test_quarantined_values_beside_good_rows_reach_delta_exactly_once(pg_conn, source, spark, tmp_path, plugin):  # noqa: F811
    slot = source if plugin == "test_decoding" else source + "_po"
    workload(pg_conn)
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    python = extract(pg_conn, plugin, slot, tmp_path / "python", False, upto_lsn=upto, table_options=OPTIONS)
    if load_native() is not None:
        native = extract(pg_conn, plugin, slot, tmp_path / "native", True, upto_lsn=upto, table_options=OPTIONS)
        assert_same_batches(python, native)
        assert_same_quarantine(python, native)
    assert python.summary()["quarantined"] == {"public.bv_readings": 3}

    delta_root = str(tmp_path / "delta")
    summary = merge_batches(spark, [str(python.path)], delta_root)
    assert summary["tables"]["public.bv_readings"]["quarantined"] == 3
    assert summary["quarantine"]["status"] == "appended" and summary["quarantine"]["rows"] == 3

    readings = {
        r["id"]: r.asDict() for r in spark.read.format("delta").load(f"{delta_root}/public/bv_readings").collect()
    }
    # Good rows land; key 6's later UPDATE applies; key 2 keeps its last good state (stale until
    # repaired); key 7's only change is quarantined.
    assert sorted(readings) == [1, 2, 3, 4, 5, 6]
    assert str(readings[6]["day"]) == "2020-06-06" and readings[6]["note"] == "fixed"
    assert str(readings[2]["day"]) == "2024-01-02"
    assert readings[1]["tags"] == [1, 2]

    grid = {r["id"]: r["m"] for r in spark.read.format("delta").load(f"{delta_root}/public/bv_grid").collect()}
    assert grid == {1: "[[1,2],[3,null]]", 2: "[5]"}
    texts = spark.read.format("delta").load(f"{delta_root}/public/bv_grid").where("id = 1").first()["t"]
    assert json.loads(texts) == [["a", "b c"], ["d", "e"]]

    quarantine = spark.read.format("delta").load(quarantine_table_path(delta_root))
    rows = sorted((r.asDict() for r in quarantine.collect()), key=lambda r: r["_pg_change_lsn"])
    assert [(r["source_column"], r["_pg_op"]) for r in rows] == [("day", "I"), ("note", "I"), ("day", "U")]
    bc, large, future = rows
    assert bc["value"] == "0044-03-15 BC" and "BC" in bc["reason"] and bc["slot"] == slot
    assert json.loads(bc["row"])["id"] == "6" and bc["source_table"] == "bv_readings"
    assert large["value_bytes"] == 10000 and large["value_truncated"] and "max_value_bytes=4096" in large["reason"]
    assert future["value"] == "10000-01-01" and "after year 9999" in future["reason"]
    assert all(r["_pg_commit_lsn"] > 0 and r["_pg_xid"] for r in rows)

    again = merge_batches(spark, [str(python.path)], delta_root)
    assert again["quarantine"]["status"] == "already applied"
    assert spark.read.format("delta").load(quarantine_table_path(delta_root)).count() == 3
