"""Staging on a full filesystem: a small tmpfs as the staging root, a batch larger than it.

The extract fails with a StagingError that names the path, the cause and the way forward;
nothing half-written is visible to readers; the slot does not move. Once the filesystem is
made larger, the next run stages the batch and Delta catches up.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.chains import staged_ranges
from airflow_provider_pgdecode.batch.manifest import list_batches, read_batches
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import StagingError, is_deterministic
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from tests.faults.conftest import slot_position

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards."""
    mount_point = tmp_path / "staging"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_full_staging_filesystem_names_the_path_and_moves_nothing(
    pg_conn, slot_name, small_tmpfs, tmp_path, spark, native
) -> None:
    pg_conn.execute("drop table if exists fs_items; create table fs_items (id int primary key, payload text)")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    before = slot_position(pg_conn, slot_name)
    # ~40k rows of random text: several MiB of Parquet, far more than the 1 MiB filesystem
    pg_conn.execute(
        "insert into fs_items select g, md5(random()::text) || md5(random()::text) from generate_series(1, 40000) g"
    )

    with pytest.raises(StagingError) as caught:
        extract_batch(pg_conn, slot_name, small_tmpfs, part_rows=5000, native=native)
    message = str(caught.value)
    assert "No space left on device" in message, message
    assert str(small_tmpfs / slot_name) in message, message  # the path
    assert "free space" in message and "run the task again" in message, message  # the way forward
    assert isinstance(caught.value.__cause__, OSError)
    assert is_deterministic(caught.value)

    # Nothing half-written is visible: no batch, no temporary directory left behind.
    assert list_batches(small_tmpfs, slot_name) == []
    assert staged_ranges(small_tmpfs, slot_name) == []
    assert list((small_tmpfs / slot_name).iterdir()) == []
    assert slot_position(pg_conn, slot_name) == before

    # Space freed: the same root, remounted larger. The next run stages the whole batch.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    pg_conn.execute("update fs_items set payload = 'after' where id % 1000 = 0")
    manifest = extract_batch(pg_conn, slot_name, small_tmpfs, part_rows=5000, native=native)
    assert manifest.start_lsn == before
    [batch] = read_batches([str(p) for p in list_batches(small_tmpfs, slot_name)])
    assert batch.changes == 40040
    if native:  # the Python path stages the same batch (tests/capture): one merge proves the catch-up
        delta_root = str(tmp_path / "delta")
        merge_batches(spark, [str(manifest.path)], delta_root)
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        result = compare_table(pg_conn, spark, delta_root, "public", "fs_items")
        assert result.equal, result.describe()
    pg_conn.execute("drop table fs_items")


def test_writer_and_reader_agree_on_an_unpublished_batch(tmp_path) -> None:
    """A temporary batch directory (what a crash leaves) is never listed as a batch."""
    base = tmp_path / "slot"
    (base / ".tmp-0000000000000010-abcdef").mkdir(parents=True)
    assert list_batches(tmp_path, "slot") == []
