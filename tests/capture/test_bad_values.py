"""Values the pipeline cannot carry, extracted from PostgreSQL: refused with the ways forward through
both paths, and a 100 MB value caught at staging by ``max_value_bytes`` (the merge into Delta:
tests/spark/test_bad_values.py)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError
from tests.capture.test_native import assert_same_batches
from tests.conftest import two_plugin_source

pytestmark = pytest.mark.postgres

PUBLICATION = "bv_pub"
TABLES = ("bv_readings", "bv_grid")
OPTIONS = {
    "public.bv_readings": {"on_bad_value": "quarantine", "max_value_bytes": 4096},
    "public.bv_grid": {"arrays": "json"},
}


@pytest.fixture()
def source(pg_conn: psycopg.Connection, slot_name: str):
    ddl = (
        "create table bv_readings (id int primary key, day date, tags int[], note text);"
        " create table bv_grid (id int primary key, m int[], t text[]);"
        " create table bv_big (id int primary key, body text)"
    )
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, [*TABLES, "bv_big"], ddl) as slot:
        yield slot


def workload(c: psycopg.Connection) -> None:
    """Good rows beside bad ones, and arrays of two dimensions."""
    c.execute("insert into bv_readings select g, '2024-01-02', array[g, g + 1], 'ok' from generate_series(1, 5) g")
    c.execute("insert into bv_readings values (6, '0044-03-15 BC', '{6}', 'before Christ')")
    c.execute("insert into bv_readings values (7, '2024-01-07', '{7}', repeat('x', 10000))")
    c.execute("update bv_readings set day = '10000-01-01' where id = 2")
    c.execute("update bv_readings set day = '2020-06-06', note = 'fixed' where id = 6")  # still applies
    c.execute("insert into bv_grid values (1, '{{1,2},{3,NULL}}', '{{a,\"b c\"},{d,e}}'), (2, '{5}', '{}')")


def extract(c: psycopg.Connection, plugin: str, slot: str, root: Path, native: bool, **kwargs) -> BatchManifest:
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    return extract_batch(c, slot, root, plugin=plugin, native=native, **extra, **kwargs)


def assert_same_quarantine(python: BatchManifest, native: BatchManifest) -> None:
    assert native.quarantine == python.quarantine
    for entry in python.quarantine:
        for name in entry["files"]:
            left = pq.read_table(Path(python.path) / entry["path"] / name)
            assert pq.read_table(Path(native.path) / entry["path"] / name).equals(left)


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_fail_policy_names_table_column_lsn_and_ways_forward(pg_conn, source, tmp_path, plugin):
    slot = source if plugin == "test_decoding" else source + "_po"
    pg_conn.execute("insert into bv_readings values (1, '2024-01-01', '{1}', 'ok')")
    lsn = Lsn.parse(str(pg_conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0]))
    pg_conn.execute("insert into bv_readings values (2, '10000-12-31', '{2}', 'far')")
    messages = []
    for native in (False, True) if load_native() is not None else (False,):
        with pytest.raises(ValueConversionError) as err:
            extract(pg_conn, plugin, slot, tmp_path / str(native), native)
        messages.append(str(err.value))
    assert len(set(messages)) == 1
    message = messages[0]
    assert "public.bv_readings" in message and "'day'" in message and "after year 9999" in message
    change_lsn = Lsn.parse(message.split("change at LSN ")[1].split(" ")[0])
    assert change_lsn >= lsn
    assert '"on_bad_value": "quarantine"' in message and "resnapshot" in message
    assert not list((tmp_path / "False").glob(f"{slot}/0*"))  # no batch published


def test_a_100_mb_value_is_caught_at_staging_with_the_setting_named(pg_conn, source, tmp_path):
    pg_conn.execute("insert into bv_big values (1, 'small')")
    pg_conn.execute("insert into bv_big values (2, repeat('y', 100 * 1024 * 1024))")
    pg_conn.execute("insert into bv_big values (3, 'after')")
    limit = {"public.bv_big": {"max_value_bytes": 1024 * 1024}}
    with pytest.raises(ValueConversionError) as err:
        extract(pg_conn, "test_decoding", source, tmp_path / "refused", None, table_options=limit)
    assert "104857600 bytes" in str(err.value) and "max_value_bytes" in str(err.value)
    assert "public.bv_big" in str(err.value) and "'body'" in str(err.value)

    quarantine = {"public.bv_big": {"max_value_bytes": 1024 * 1024, "on_bad_value": "quarantine"}}
    manifest = extract(pg_conn, "test_decoding", source, tmp_path / "staging", None, table_options=quarantine)
    assert manifest.summary()["quarantined"] == {"public.bv_big": 1}
    (summary,) = manifest.tables
    assert summary.rows == 2 and summary.inserts == 2  # the staged table part: the merge never sees the value
    staged = pq.read_table(Path(manifest.path) / summary.path / summary.files[0])
    assert staged.column("id").to_pylist() == [1, 3]
    (entry,) = manifest.quarantine
    (row,) = pq.read_table(Path(manifest.path) / entry["path"] / entry["files"][0]).to_pylist()
    assert (row["value_bytes"], row["value_truncated"], len(row["value"])) == (100 * 1024 * 1024, True, 1024)
    assert "max_value_bytes=1048576" in row["reason"]


def test_snapshots_stage_arrays_as_the_table_options_say_and_name_bad_values(
    pg_conn, pg_dsn, source, slot_name, tmp_path
) -> None:
    workload(pg_conn)
    pg_conn.execute("update bv_readings set day = '0001-01-01 BC' where id = 6")
    snap = f"{slot_name}_snap"
    try:
        with create_slot_with_snapshot(pg_dsn, snap) as (lsn, name):
            manifest = stage_snapshot(
                pg_dsn, name, lsn, snap, tmp_path / "grid", ["public.bv_grid"], table_options=OPTIONS
            )
            with pytest.raises(ValueConversionError) as err:
                stage_snapshot(pg_dsn, name, lsn, snap, tmp_path / "readings", ["public.bv_readings"])
    finally:
        pg_conn.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (snap,)
        )
    (grid,) = manifest.tables
    assert [c.arrow for c in grid.columns] == ["int32", "string", "string"]
    # The TRUNCATE row is a part of its own (part-truncate.parquet), the rows follow in chunk parts.
    staged = [row for file in grid.files for row in pq.read_table(Path(manifest.path) / grid.path / file).to_pylist()]
    assert [r["m"] for r in staged if r["_pg_op"] == "I"] == ["[[1,2],[3,null]]", "[5]"]
    message = str(err.value)
    assert "public.bv_readings" in message and "'day'" in message and "in the snapshot at LSN" in message
    assert "10000-01-01" in message and "fix the row in PostgreSQL" in message


@pytest.mark.skipif(load_native() is None, reason="the native extension is not built")
@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_both_paths_quarantine_alike_with_small_parts(pg_conn, source, tmp_path, plugin) -> None:
    slot = source if plugin == "test_decoding" else source + "_po"
    workload(pg_conn)
    pg_conn.execute("insert into bv_readings select g, '0001-01-01 BC', '{}', 'all bad' from generate_series(10, 12) g")
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    both = [
        extract(
            pg_conn, plugin, slot, tmp_path / str(native), native, upto_lsn=upto, table_options=OPTIONS, part_rows=3
        )
        for native in (False, True)
    ]
    assert_same_batches(*both)
    assert_same_quarantine(*both)
    (entry,) = both[0].quarantine
    assert entry["rows"] == 6 and len(entry["files"]) > 1
    readings = next(t for t in both[0].tables if t.table == "bv_readings")
    assert readings.rows == 6 and readings.inserts == 5 and readings.updates == 1
