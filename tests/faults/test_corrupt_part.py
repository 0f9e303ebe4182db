"""A staged batch with a damaged or missing Parquet part: the merge names the batch and the file
and writes nothing to Delta (no table created, no version added)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import BatchError, is_deterministic
from airflow_provider_pgdecode.spark.merge_job import merge_batches

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]


def delta_version(spark, path: str) -> int | None:
    from delta.tables import DeltaTable

    if not os.path.isdir(os.path.join(path, "_delta_log")):
        return None
    return int(DeltaTable.forPath(spark, path).history(1).collect()[0]["version"])


def part_of(manifest: BatchManifest, table: str) -> str:
    entry = next(t for t in BatchManifest.read(manifest.directory).tables if t.table == table)
    return entry.file_paths[0]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_part_is_named_and_nothing_is_written(pg_conn, slot_name, tmp_path, spark, damage) -> None:
    pg_conn.execute(
        "drop table if exists cp_good, cp_bad;"
        " create table cp_good (id int primary key, v text); create table cp_bad (id int primary key, v text)"
    )
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    pg_conn.execute("insert into cp_good select g, 'g' || g from generate_series(1, 50) g")
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    first = extract_batch(pg_conn, slot_name, staging)
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))
    merge_batches(spark, [str(first.path)], delta_root)
    good_path, bad_path = f"{delta_root}/public/cp_good", f"{delta_root}/public/cp_bad"
    good_before = delta_version(spark, good_path)
    assert good_before is not None

    # A batch changing both tables: the part of the second one is damaged after staging.
    pg_conn.execute("update cp_good set v = 'changed' where id <= 10")
    pg_conn.execute("insert into cp_bad select g, md5(g::text) from generate_series(1, 500) g")
    second = extract_batch(pg_conn, slot_name, staging)
    part = Path(part_of(second, "cp_bad"))
    if damage == "truncated":
        os.truncate(part, part.stat().st_size // 2)
    else:
        part.unlink()

    with pytest.raises(BatchError) as caught:
        merge_batches(spark, [str(second.path)], delta_root)
    message = str(caught.value)
    assert str(second.path) in message, message  # the batch
    assert part.name in message and "cp_bad" in message, message  # the file
    assert "run the extract again" in message, message  # the way forward
    assert is_deterministic(caught.value)
    # Nothing written by the failed merge: no table created, no version added to the other one.
    assert delta_version(spark, bad_path) is None
    assert not os.path.exists(bad_path) or not os.listdir(bad_path)
    assert delta_version(spark, good_path) == good_before
    pg_conn.execute("drop table cp_good, cp_bad")
