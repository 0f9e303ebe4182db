"""Extract through pgoutput; parity with test_decoding on the same workload."""

from __future__ import annotations

import math
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import SlotError
from tests.capture.test_extract import advance, table_rows

pytestmark = pytest.mark.postgres

PUBLICATION = "parity_pub"


def normalised(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as comparable dicts: old images without NULL fields, NaN made comparable."""
    out = []
    for row in rows:
        row = dict(row)
        old = row.pop("_pg_old", None)
        row["_pg_old"] = {k: v for k, v in old.items() if v is not None} if old else None
        out.append({k: ("NaN" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
    return out


def staged(manifest: BatchManifest) -> dict[str, list[dict[str, Any]]]:
    return {f"{t.schema}.{t.table}": normalised(table_rows(manifest, t.schema, t.table)) for t in manifest.tables}


def two_phase_for_both(conn: psycopg.Connection) -> bool:
    """pgoutput decodes prepared transactions from PostgreSQL 15 (protocol 3)."""
    return int(conn.info.server_version) >= 150000


@pytest.fixture()
def two_slots(pg_conn: psycopg.Connection, slot_name: str):
    c = pg_conn
    c.execute(
        f"drop table if exists par_a, par_b, par_full, par_toast cascade; drop publication if exists {PUBLICATION}"
    )
    c.execute(
        "create type par_mood as enum ('ok', 'meh');"
        if not c.execute("select 1 from pg_type where typname = 'par_mood'").fetchone()
        else "select 1"
    )
    c.execute(
        "create table par_a (id int primary key, t text, n numeric(10,3), f float8, b bool, d date, ts timestamptz,"
        " j jsonb, by bytea, arr int[], m par_mood, v varchar(5));"
        " create table par_b (k1 int, k2 text, v text, primary key (k1, k2));"
        " create table par_full (a int, b text); alter table par_full replica identity full;"
        " create table par_toast (id int primary key, big text, small int);"
        " alter table par_toast alter column big set storage external;"
        f" create publication {PUBLICATION} for table par_a, par_b, par_full, par_toast"
    )
    c.execute("insert into par_toast values (1, repeat('x', 4000), 1)")
    c.execute("insert into par_full values (1, null), (2, 'b')")
    other = f"{slot_name}_po"
    # Both slots two-phase where pgoutput can decode it (15+), so that they stage the same.
    two_phase = two_phase_for_both(c)
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, %s)", (slot_name, two_phase))
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (other, two_phase))
    yield slot_name, other
    c.execute("select pg_drop_replication_slot(%s)", (other,))
    c.execute(f"drop publication {PUBLICATION}")


def workload(c: psycopg.Connection) -> None:
    c.execute(
        "insert into par_a values (1, e'q''uote\\nnew', 12.5, 'NaN', true, '2024-02-29', '2024-01-01 10:00:00+02',"
        " '{\"k\": [1]}', '\\x00ff', '{1,NULL}', 'meh', 'abc'), (2, null, null, '-Infinity', false, 'infinity',"
        " null, null, null, '{}', null, null)"
    )
    c.execute("update par_a set t = 'changed', id = 3 where id = 2")
    c.execute("insert into par_b values (1, 'x', 'one'), (1, 'y', 'two')")
    c.execute("update par_b set k2 = 'z' where k2 = 'y'")
    c.execute("delete from par_b where k1 = 1 and k2 = 'x'")
    c.execute("update par_full set b = 'c' where a = 1")
    c.execute("delete from par_full where a = 2")
    c.execute("update par_toast set small = 5")
    with c.transaction():
        c.execute(
            "insert into par_b select g, 's', repeat('s', 300) from generate_series(100, 600) g"
        )  # streamed by pgoutput
        c.execute("select pg_logical_emit_message(true, 'par', 'msg')")
        c.execute("truncate par_full")
        c.execute("insert into par_full values (9, 'after truncate')")
    c.execute("begin; insert into par_b values (7, 'p', 'prepared'); prepare transaction 'par_g'")


@pytest.mark.pg_matrix
def test_both_plugins_stage_the_same_changes(pg_conn, two_slots, tmp_path) -> None:
    td_slot, po_slot = two_slots
    workload(pg_conn)
    ceiling = pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]
    from airflow_provider_pgdecode.decoding.lsn import Lsn

    upto = Lsn.parse(str(ceiling))
    td = extract_batch(pg_conn, td_slot, tmp_path / "td", upto_lsn=upto)
    po = extract_batch(pg_conn, po_slot, tmp_path / "po", plugin="pgoutput", publication=PUBLICATION, upto_lsn=upto)
    td_rows, po_rows = staged(td), staged(po)
    assert set(td_rows) == set(po_rows) == {"public.par_a", "public.par_b", "public.par_full", "public.par_toast"}
    for table in td_rows:
        assert po_rows[table] == td_rows[table], table
    assert (td.transactions, td.changes) == (po.transactions, po.changes)
    assert [t.key for t in td.tables] == [t.key for t in po.tables]
    pending = ["par_g"] if two_phase_for_both(pg_conn) else []  # 14: staged at COMMIT PREPARED
    assert [p["gid"] for p in td.prepared_pending] == [p["gid"] for p in po.prepared_pending] == pending
    assert len(td_rows["public.par_b"]) > 500

    # The prepared transaction resolves in the next batch, the same way through both plugins.
    advance(pg_conn, td_slot, td)
    advance(pg_conn, po_slot, po)
    pg_conn.execute("commit prepared 'par_g'")
    upto = Lsn.parse(str(pg_conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    td2 = extract_batch(pg_conn, td_slot, tmp_path / "td", upto_lsn=upto, checkpoint=Checkpoint.from_manifest(td))
    po2 = extract_batch(
        pg_conn,
        po_slot,
        tmp_path / "po",
        plugin="pgoutput",
        publication=PUBLICATION,
        upto_lsn=upto,
        checkpoint=Checkpoint.from_manifest(po),
    )
    assert staged(td2) == staged(po2)
    assert [r["k2"] for r in staged(po2)["public.par_b"]] == ["p"]


def test_pgoutput_needs_a_publication(pg_conn, two_slots, tmp_path) -> None:
    _, po_slot = two_slots
    with pytest.raises(SlotError, match="needs a publication.*CREATE PUBLICATION"):
        extract_batch(pg_conn, po_slot, tmp_path, plugin="pgoutput")
    with pytest.raises(SlotError, match="uses output plugin 'pgoutput'"):
        extract_batch(pg_conn, po_slot, tmp_path, plugin="test_decoding")


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_missing_publication_is_named_not_reported_as_a_missing_slot(pg_conn, slot_name, tmp_path, native) -> None:
    table = f"po_nopub_{slot_name}"
    pg_conn.execute(f"create table {table} (id int primary key)")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name,))
    pg_conn.execute(f"insert into {table} values (1)")
    with pytest.raises(SlotError, match=r'publication "no_such_pub" does not exist.*CREATE PUBLICATION') as raised:
        extract_batch(pg_conn, slot_name, tmp_path, plugin="pgoutput", publication="no_such_pub", native=native)
    assert "does not exist (looked in" not in str(raised.value)
