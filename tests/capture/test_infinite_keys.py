"""``infinity`` / ``-infinity`` in a date or timestamp key column, extracted from PostgreSQL (issue 35).

Staged as the ends of Spark's range (as in other columns) such a key would become the same Delta row
as a real ``9999-12-31`` / ``0001-01-01`` key, which PostgreSQL keeps apart, and a DELETE of one
would delete both. In a key column it is a bad value instead: ``on_bad_value: fail`` names the
table, the column, the LSN and the ``type_map`` way forward; ``quarantine`` routes the change; with
``type_map`` the keys are staged as the text PostgreSQL printed, distinct. Both plugins, both
writers, the snapshots (the merge into Delta: tests/spark/test_type_map.py).
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError
from tests.capture.test_bad_values import assert_same_quarantine
from tests.capture.test_native import assert_same_batches
from tests.conftest import two_plugin_source

pytestmark = pytest.mark.postgres

PUBLICATION = "ik_pub"
TABLES = ("ik_days", "ik_stamps", "ik_zoned")
WRITERS = (False, True) if load_native() is not None else (False,)
QUARANTINE = {f"public.{t}": {"on_bad_value": "quarantine"} for t in TABLES}
AS_TEXT = {
    "public.ik_days": {"type_map": {"date": "string"}},
    "public.ik_stamps": {"type_map": {"timestamp": "string"}},
    "public.ik_zoned": {"type_map": {"timestamptz": "string"}},
}


@pytest.fixture()
def source(pg_conn: psycopg.Connection, slot_name: str):
    ddl = (
        # A non-key infinity (ik_days.at) stays clamped, as documented.
        "create table ik_days (d date primary key, at timestamptz, note text);"
        " create table ik_stamps (t timestamp primary key, note text);"
        " create table ik_zoned (z timestamptz primary key, note text)"
    )
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, list(TABLES), ddl) as slot:
        yield slot


def workload(c: psycopg.Connection) -> None:
    """Each infinite key beside the real key it would be clamped to; a DELETE and an UPDATE of an
    infinite key; the real keys changed too."""
    c.execute(
        "insert into ik_days values ('infinity', 'infinity', 'inf'), ('9999-12-31', '2024-01-01', 'real max'),"
        " ('-infinity', null, '-inf'), ('0001-01-01', null, 'real min'), ('2024-05-01', 'infinity', 'plain')"
    )
    c.execute(
        "insert into ik_stamps values ('infinity', 'inf'), ('9999-12-31 23:59:59.999999', 'real max'),"
        " ('-infinity', '-inf'), ('0001-01-01 00:00:00', 'real min')"
    )
    c.execute("insert into ik_zoned values ('infinity', 'inf'), ('9999-12-31 23:59:59.999999+00', 'real max')")
    c.execute("delete from ik_days where d = 'infinity'")
    c.execute("update ik_days set note = 'real max, later' where d = '9999-12-31'")
    c.execute("update ik_stamps set note = 'inf, later' where t = 'infinity'")
    c.execute("delete from ik_zoned where z = 'infinity'")


def extract(c: psycopg.Connection, plugin: str, slot: str, root: Path, native: bool, **kwargs) -> BatchManifest:
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    return extract_batch(c, slot, root, plugin=plugin, native=native, **extra, **kwargs)


def staged_rows(manifest: BatchManifest, table: str, *columns: str) -> list[tuple]:
    summary = next(t for t in manifest.tables if t.table == table)
    rows = []
    for name in summary.files:
        part = pq.read_table(Path(manifest.path) / summary.path / name).to_pylist()
        rows += [(r["_pg_op"], *(r[c] for c in columns), r["_pg_old"] and r["_pg_old"][columns[0]]) for r in part]
    return rows


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_fail_names_the_table_column_lsn_and_the_type_map_way_forward(pg_conn, source, tmp_path, plugin):
    slot = source if plugin == "test_decoding" else source + "_po"
    before = Lsn.parse(str(pg_conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0]))
    workload(pg_conn)
    for table, column, pg_type, value, option in (
        ("ik_days", "d", "date", "infinity", "date"),
        ("ik_stamps", "t", "timestamp without time zone", "infinity", "timestamp"),
        ("ik_zoned", "z", "timestamp with time zone", "infinity", "timestamptz"),
    ):
        messages = set()
        for native in WRITERS:
            with pytest.raises(ValueConversionError) as err:
                extract(pg_conn, plugin, slot, tmp_path / f"{table}-{native}", native, tables=[f"public.{table}"])
            messages.add(str(err.value))
            assert not list((tmp_path / f"{table}-{native}").glob(f"{slot}/0*"))  # nothing published
        (message,) = messages  # both writers alike
        assert f"cannot stage table public.{table} column '{column}' ({pg_type}) of the change at LSN " in message
        assert Lsn.parse(message.split("change at LSN ")[1].split(" ")[0]) >= before
        assert f"{value!r} in a key column" in message and "9999-12-31" in message
        assert "same Delta row" in message and "PostgreSQL keeps apart" in message
        assert f'{{"public.{table}": {{"type_map": {{"{option}": "string"}}}}}}' in message
        assert f'{{"public.{table}": {{"on_bad_value": "quarantine"}}}}' in message


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_quarantine_routes_the_infinite_keys_and_keeps_the_real_ones(pg_conn, source, tmp_path, plugin):
    slot = source if plugin == "test_decoding" else source + "_po"
    workload(pg_conn)
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    both = [
        extract(pg_conn, plugin, slot, tmp_path / str(native), native, upto_lsn=upto, table_options=QUARANTINE)
        for native in WRITERS
    ]
    if len(both) == 2:
        assert_same_batches(*both)
        assert_same_quarantine(*both)
    batch = both[0]
    # ik_days: two inserts and the DELETE of 'infinity'; ik_stamps: two inserts and the UPDATE; ik_zoned: one and the DELETE.
    assert batch.summary()["quarantined"] == {"public.ik_days": 3, "public.ik_stamps": 3, "public.ik_zoned": 2}
    days = staged_rows(batch, "ik_days", "d", "at", "note")
    assert [(op, str(d), note) for op, d, _, note, _ in days] == [
        ("I", "9999-12-31", "real max"),
        ("I", "0001-01-01", "real min"),
        ("I", "2024-05-01", "plain"),
        ("U", "9999-12-31", "real max, later"),
    ]
    assert str(days[2][2]) == "9999-12-31 23:59:59.999999+00:00"  # not a key: clamped, as documented
    stamps = staged_rows(batch, "ik_stamps", "t", "note")
    assert [(op, str(t)) for op, t, _, _ in stamps] == [
        ("I", "9999-12-31 23:59:59.999999"),
        ("I", "0001-01-01 00:00:00"),
    ]
    zoned = staged_rows(batch, "ik_zoned", "z", "note")
    assert [(op, str(z)) for op, z, _, _ in zoned] == [("I", "9999-12-31 23:59:59.999999+00:00")]

    quarantined = {}
    for entry in batch.quarantine:
        for name in entry["files"]:
            for row in pq.read_table(Path(batch.path) / entry["path"] / name).to_pylist():
                quarantined.setdefault(entry["table"], []).append(row)
    days_q = quarantined["ik_days"]
    assert [(r["_pg_op"], r["source_column"], r["value"]) for r in days_q] == [
        ("I", "d", "infinity"),
        ("I", "d", "-infinity"),
        ("D", "_pg_old.d", "infinity"),
    ]
    assert "'infinity' in a key column" in days_q[0]["reason"] and "the key 9999-12-31" in days_q[0]["reason"]
    assert "'-infinity' in a key column" in days_q[1]["reason"] and "the key 0001-01-01" in days_q[1]["reason"]
    assert [(r["_pg_op"], r["value"]) for r in quarantined["ik_stamps"]] == [
        ("I", "infinity"),
        ("I", "-infinity"),
        ("U", "infinity"),
    ]
    assert "9999-12-31 23:59:59.999999" in quarantined["ik_stamps"][0]["reason"]
    assert [(r["_pg_op"], r["value"]) for r in quarantined["ik_zoned"]] == [("I", "infinity"), ("D", "infinity")]


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_type_map_stages_every_key_as_its_text_distinct(pg_conn, source, tmp_path, plugin):
    slot = source if plugin == "test_decoding" else source + "_po"
    workload(pg_conn)
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    both = [
        extract(pg_conn, plugin, slot, tmp_path / str(native), native, upto_lsn=upto, table_options=AS_TEXT)
        for native in WRITERS
    ]
    if len(both) == 2:
        assert_same_batches(*both)
    batch = both[0]
    assert not batch.quarantine
    days = staged_rows(batch, "ik_days", "d", "note")
    assert [(op, d, old) for op, d, _, old in days] == [
        ("I", "infinity", None),
        ("I", "9999-12-31", None),
        ("I", "-infinity", None),
        ("I", "0001-01-01", None),
        ("I", "2024-05-01", None),
        ("D", None, "infinity"),
        ("U", "9999-12-31", None),
    ]
    stamps = staged_rows(batch, "ik_stamps", "t", "note")
    assert [(op, t) for op, t, _, _ in stamps] == [
        ("I", "infinity"),
        ("I", "9999-12-31 23:59:59.999999"),
        ("I", "-infinity"),
        ("I", "0001-01-01 00:00:00"),
        ("U", "infinity"),
    ]
    zoned = staged_rows(batch, "ik_zoned", "z", "note")
    assert [(op, z, old) for op, z, _, old in zoned] == [
        ("I", "infinity", None),
        ("I", "9999-12-31 23:59:59.999999+00", None),
        ("D", None, "infinity"),
    ]


def test_snapshots_refuse_an_infinite_key_with_the_same_reason_and_stage_it_as_text(
    pg_conn, pg_dsn, source, slot_name, tmp_path
):
    pg_conn.execute("insert into ik_days values ('infinity', null, 'inf'), ('9999-12-31', null, 'real max')")
    snap = f"{slot_name}_snap"
    try:
        with create_slot_with_snapshot(pg_dsn, snap) as (lsn, name):
            with pytest.raises(ValueConversionError) as err:
                stage_snapshot(pg_dsn, name, lsn, snap, tmp_path / "refused", ["public.ik_days"])
            kept = stage_snapshot(pg_dsn, name, lsn, snap, tmp_path / "text", ["public.ik_days"], table_options=AS_TEXT)
    finally:
        pg_conn.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (snap,)
        )
    message = str(err.value)
    assert "cannot stage table public.ik_days column 'd' (date) in the snapshot at LSN" in message
    assert "'infinity' in a key column" in message and "the key 9999-12-31" in message
    assert '{"public.ik_days": {"type_map": {"date": "string"}}}' in message
    (summary,) = kept.tables
    rows = [r for f in summary.files for r in pq.read_table(Path(kept.path) / summary.path / f).to_pylist()]
    assert sorted(r["d"] for r in rows if r["_pg_op"] == "I") == ["9999-12-31", "infinity"]

    # A table snapshot (add-table, copied inside an extract) gives its request up with the same reason.
    request = request_table_snapshot(tmp_path / "staging", slot_name, ["public.ik_days"], "add-table")
    manifest = extract_batch(pg_conn, slot_name, tmp_path / "staging", tables=["public.ik_zoned"])
    error = manifest.snapshots[request.id]["error"]
    assert "column 'd' (date)" in error and "'infinity' in a key column" in error
    assert '{"public.ik_days": {"type_map": {"date": "string"}}}' in error


@pytest.mark.parametrize("native", WRITERS)
def test_a_key_unknown_at_staging_is_checked_once_known(pg_conn, source, tmp_path, native):
    """pgoutput names a table renamed after its changes by its name then: the writers, which read
    the keys by the names now, do not know its key, so the clamp is found after staging."""
    slot = source + "_po"
    pg_conn.execute("insert into ik_days values ('infinity', null, 'inf'), ('9999-12-31', null, 'real max')")
    pg_conn.execute("alter table ik_days rename to ik_days_renamed")
    try:
        with pytest.raises(ValueConversionError) as err:
            extract(pg_conn, "pgoutput", slot, tmp_path, native, table_options=QUARANTINE)
    finally:
        pg_conn.execute("alter table ik_days_renamed rename to ik_days")
    message = str(err.value)
    assert "cannot stage table public.ik_days column 'd' (date) of the change at LSN" in message
    assert "'infinity' in a key column" in message and "key (d) was not known" in message
    assert '{"public.ik_days": {"type_map": {"date": "string"}}}' in message
    assert not list(tmp_path.glob(f"{slot}/0*"))
