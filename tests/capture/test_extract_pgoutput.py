"""Extract through pgoutput; parity with test_decoding on the same workload."""

from __future__ import annotations

import math
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, SlotError
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


@pytest.mark.pg_matrix
def test_origin_none_skips_replicated_transactions_through_pgoutput(pg_conn, slot_name, tmp_path, pg_version) -> None:
    # 16+ filters on the server (pgoutput's origin option); 14 and 15 lack it, so the extract drops
    # the transactions that carry an Origin message, and says how many in the manifest.
    c = pg_conn
    c.execute(f"drop table if exists po_looped; drop publication if exists {PUBLICATION}")
    c.execute(
        f"create table po_looped (id int primary key, source text); create publication {PUBLICATION} for table po_looped"
    )
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name,))
    c.execute("insert into po_looped values (1, 'local')")
    c.execute(
        "select pg_replication_origin_create('po_replica') where not exists"
        " (select 1 from pg_replication_origin where roname = 'po_replica')"
    )
    c.execute("select pg_replication_origin_session_setup('po_replica')")
    try:
        c.execute("insert into po_looped values (2, 'replicated')")
        with c.transaction():  # large enough to be streamed: the Origin comes with its first block
            c.execute("insert into po_looped select g, 'replicated' from generate_series(100, 1100) g")
    finally:
        c.execute("select pg_replication_origin_session_reset()")
    c.execute("insert into po_looped values (3, 'local')")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    kwargs: dict[str, Any] = {"plugin": "pgoutput", "publication": PUBLICATION, "upto_lsn": upto}
    everything = extract_batch(c, slot_name, tmp_path / "all", **kwargs)
    local = extract_batch(c, slot_name, tmp_path / "local", origin="none", **kwargs)
    assert len(table_rows(everything, "public", "po_looped")) == 1004
    assert [r["id"] for r in table_rows(local, "public", "po_looped")] == [1, 3]
    assert local.skipped.get("replicated_transactions") == (2 if pg_version < 16 else None)
    c.execute(f"drop publication {PUBLICATION}")


def _generated_table(c: psycopg.Connection, slot_name: str, publication_options: str = "") -> str:
    """A table with a stored generated column, a publication of it, a pgoutput and a test_decoding
    slot, and one insert and one update; returns the test_decoding slot's name."""
    c.execute(f"drop table if exists po_gen; drop publication if exists {PUBLICATION}")
    c.execute("create table po_gen (id int primary key, a int, doubled int generated always as (a * 2) stored)")
    c.execute(f"create publication {PUBLICATION} for table po_gen {publication_options}")
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name,))
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (f"{slot_name}_td",))
    c.execute("insert into po_gen (id, a) values (1, 21)")
    c.execute("update po_gen set a = 5")
    return f"{slot_name}_td"


def _staged_gen(c: psycopg.Connection, slot: str, path, plugin: str) -> tuple[BatchManifest, list[dict[str, Any]]]:
    options: dict[str, Any] = {"plugin": plugin, "publication": PUBLICATION if plugin == "pgoutput" else None}
    manifest = extract_batch(c, slot, path, **options)
    return manifest, table_rows(manifest, "public", "po_gen")


@pytest.mark.pg_matrix
def test_stored_generated_columns_are_staged_or_named_as_not_staged(pg_conn, slot_name, tmp_path) -> None:
    c = pg_conn
    td_slot = _generated_table(c, slot_name)
    try:
        td, td_rows = _staged_gen(c, td_slot, tmp_path / "td", "test_decoding")
        po, po_rows = _staged_gen(c, slot_name, tmp_path / "po", "pgoutput")
    finally:
        c.execute("select pg_drop_replication_slot(%s)", (td_slot,))
    # test_decoding sends stored generated columns on every version.
    assert [r["doubled"] for r in td_rows] == [42, 10] and td.tables[0].generated_not_staged is None
    # pgoutput leaves them out unless the publication asks for them (18): named, not silently absent.
    assert all("doubled" not in r for r in po_rows) and [r["a"] for r in po_rows] == [21, 5]
    assert po.tables[0].generated_not_staged == ["doubled"]
    assert "generated_not_staged" not in td.tables[0].to_dict()


@pytest.mark.pg_matrix(since=18)
def test_publish_generated_columns_stages_them_through_pgoutput_on_18(pg_conn, slot_name, tmp_path) -> None:
    c = pg_conn
    td_slot = _generated_table(c, slot_name, "with (publish_generated_columns = stored)")
    c.execute("select pg_drop_replication_slot(%s)", (td_slot,))
    po, po_rows = _staged_gen(c, slot_name, tmp_path / "po", "pgoutput")
    assert [(r["a"], r["doubled"]) for r in po_rows] == [(21, 42), (5, 10)]
    assert po.tables[0].generated_not_staged is None


@pytest.mark.pg_matrix(since=18)
def test_virtual_generated_columns_are_never_staged_as_nulls(pg_conn, slot_name, tmp_path) -> None:
    c = pg_conn
    c.execute(f"drop table if exists po_virt; drop publication if exists {PUBLICATION}")
    c.execute("create table po_virt (id int primary key, a int, tripled int generated always as (a * 3) virtual)")
    c.execute(f"create publication {PUBLICATION} for table po_virt with (publish_generated_columns = stored)")
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name,))
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (f"{slot_name}_td",))
    c.execute("insert into po_virt (id, a) values (1, 7)")
    try:
        # test_decoding prints a virtual column as null: refused, naming the table and the way out.
        with pytest.raises(CatalogError, match=r"public\.po_virt has virtual generated column\(s\) tripled.*pgoutput"):
            extract_batch(c, f"{slot_name}_td", tmp_path / "td")
    finally:
        c.execute("select pg_drop_replication_slot(%s)", (f"{slot_name}_td",))
    po = extract_batch(c, slot_name, tmp_path / "po", plugin="pgoutput", publication=PUBLICATION)
    assert [r["a"] for r in table_rows(po, "public", "po_virt")] == [7]
    assert po.tables[0].generated_not_staged == ["tripled"]
