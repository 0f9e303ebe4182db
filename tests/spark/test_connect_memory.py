"""A shared Spark Connect server is not run out of memory by one table: staged changes too large for
its heap are parked before they are sent, and a task that runs out of memory anyway fails its
merge, reported as out of memory, not the server (spark/memory_budget.py, SHARED_SERVER_CONF)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.errors import StagedTooLargeError
from airflow_provider_pgdecode.spark import memory_budget
from airflow_provider_pgdecode.spark.connect_client import server_gone
from airflow_provider_pgdecode.spark.memory_budget import LargestRead, ServerMemory, check_fits, memory_bytes
from airflow_provider_pgdecode.spark.merge_job import out_of_memory_error
from airflow_provider_pgdecode.spark.merge_plan import MergeOptions
from pgdecode_testing.connect_server import ConnectServerError, LocalConnectServer
from tests.spark.staged import TableChanges, write_batch

SLOT = "pgdecode_memory"
COLUMNS = [("id", "integer", pa.int32()), ("note", "text", pa.string())]
BIG_VALUE_MIB = 60


def test_memory_strings_are_read_as_spark_reads_them() -> None:
    assert memory_bytes("512m") == 512 * 1024 * 1024
    assert memory_bytes("2G") == 2 * 1024**3
    assert memory_bytes("1024") == 1024**3  # no unit: MiB, as spark.driver.memory
    assert memory_bytes("lots") is None


def test_the_largest_read_is_one_columnar_batch_of_a_row_group(tmp_path: Path) -> None:
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"v": ["x" * 1000] * 10_000}), path, row_group_size=10_000)
    read = memory_budget.largest_read(str(path), pq.read_metadata(path))
    assert read.rows == memory_budget.READ_BATCH_ROWS
    total = pq.read_metadata(path).row_group(0).total_byte_size
    assert read.batch_bytes == total * memory_budget.READ_BATCH_ROWS // 10_000


def test_a_read_over_the_servers_memory_is_refused_with_the_way_forward() -> None:
    server = ServerMemory("spark.driver.memory", "512m", 512 * 1024 * 1024)
    check_fits("public.small", LargestRead("part-00000.parquet", 100, 1024 * 1024), server)
    with pytest.raises(StagedTooLargeError) as refused:
        check_fits("public.big", LargestRead("/s/part-00000.parquet", 6, 360 * 1024 * 1024), server)
    message = str(refused.value)
    assert "table public.big" in message and "/s/part-00000.parquet" in message
    assert "spark.driver.memory=512m" in message and "--driver-memory" in message and "catch up" in message


def test_a_stopped_spark_context_is_named_as_the_server_going_away() -> None:
    error = Exception("(java.lang.IllegalStateException) Cannot call methods on a stopped SparkContext.")
    gone = server_gone(error)
    assert gone is not None and "exit code 52" in gone and "OutOfMemoryError" in gone


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalConnectServer]:
    """A Connect server with a 512 MiB heap, started as a deployment starts one (its own log)."""
    log = tmp_path_factory.mktemp("connect") / "server.log"
    server = LocalConnectServer(master="local[1]", driver_memory="512m", warm_up_rounds=0, log_path=log)
    try:
        server.start()
    except ConnectServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


def _batch(root: Path, start: int, big_rows: int) -> str:
    big = TableChanges("public", "big", COLUMNS)
    for row in range(big_rows):
        big.insert(start + 1 + row, id=row, note="x" * (BIG_VALUE_MIB * 1024 * 1024))
    small = TableChanges("public", "small", COLUMNS).insert(start + 50, id=start, note="kept")
    return write_batch(root, SLOT, start, start + 100, [big, small])


def _merge(url: str, batch: str, delta_root: Path, **options: Any) -> dict[str, Any]:
    from airflow_provider_pgdecode.spark.merge_job import merge_batches
    from airflow_provider_pgdecode.spark.session import build_connect_session

    spark = build_connect_session(url)
    try:
        return merge_batches(spark, [batch], str(delta_root), MergeOptions(park_refused=True, **options))
    finally:
        spark.stop()


@pytest.mark.spark
def test_a_table_too_large_for_the_server_is_parked_before_it_is_sent(small_server, tmp_path: Path) -> None:
    delta_root = tmp_path / "delta"
    summary = _merge(small_server.url, _batch(tmp_path / "staging", 1000, 6), delta_root)
    assert summary["parked"] == ["public.big"]
    reason = summary["tables"]["public.big"]["reason"]
    assert "need about" in reason
    assert "spark.driver.memory=512m" in reason
    assert summary["tables"]["public.small"]["status"] == "merged"
    assert not (delta_root / "public" / "big").exists()
    assert small_server.running()
    assert not any("OutOfMemoryError" in line for line in small_server.output)  # never sent

    # Sent anyway (the check off; the light write off too, or delta-rs would append these inserts
    # on the driver, the server never seeing them): the task runs out of memory, which the merge
    # reports as such; the server serves on, and with the check on again the table is parked and
    # the other one merges.
    batch = _batch(tmp_path / "staging", 2000, 6)
    with pytest.raises(Exception) as ran_out:
        _merge(small_server.url, batch, delta_root, memory_check=False, light_write_max_bytes=0)
    assert out_of_memory_error(ran_out.value, {"spark.driver.memory": "512m"}) is not None
    assert small_server.running()
    summary = _merge(small_server.url, batch, delta_root)
    assert summary["parked"] == ["public.big"] and summary["tables"]["public.small"]["status"] == "merged"
    from airflow_provider_pgdecode.spark.session import build_connect_session

    spark = build_connect_session(small_server.url)
    try:
        ids = sorted(r["id"] for r in spark.read.format("delta").load(str(delta_root / "public" / "small")).collect())
    finally:
        spark.stop()
    assert ids == [1000, 2000]


@pytest.mark.spark
def test_a_table_the_driver_appends_is_not_held_to_the_servers_memory(small_server, tmp_path: Path) -> None:
    # One 60 MiB insert: too large for the server's tasks (the first test parks such a table when
    # Spark must read it), but delta-rs appends it from the driver, and the server never sees it.
    delta_root = tmp_path / "delta"
    ran_out_before = sum("OutOfMemoryError" in line for line in small_server.output)  # an earlier test's
    summary = _merge(small_server.url, _batch(tmp_path / "staging", 1000, 1), delta_root)
    assert summary["parked"] == [] and summary["tables"]["public.big"]["status"] == "merged"
    assert summary["tables"]["public.big"]["inserted"] == 1
    from deltalake import DeltaTable, QueryBuilder

    table = DeltaTable(str(delta_root / "public" / "big"))
    assert table.history(1)[0]["operation"] == "WRITE"  # appended, not merged by Spark
    lengths = QueryBuilder().register("t", table).execute("select length(note) as n from t").read_all()
    assert lengths.column("n").to_pylist() == [BIG_VALUE_MIB * 1024 * 1024]
    assert sum("OutOfMemoryError" in line for line in small_server.output) == ran_out_before
    # Parked when Spark must read it: the driver's source off (the light write off)
    summary = _merge(
        small_server.url, _batch(tmp_path / "staging", 2000, 1), tmp_path / "other", light_write_max_bytes=0
    )
    assert summary["parked"] == ["public.big"]
