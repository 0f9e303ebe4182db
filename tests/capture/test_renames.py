"""Renamed and dropped source tables are followed by OID through the extract, with both plugins."""

from __future__ import annotations

import logging

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import TableSummary
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.renames import KnownTables, follow_selection, follow_staged
from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.postgres.catalog import Catalog

pytestmark = pytest.mark.postgres

PUBLICATION = "rn_pub"


@pytest.fixture()
def tables(pg_conn: psycopg.Connection):
    c = pg_conn
    c.execute("drop table if exists rn_orders, rn_orders_v2, rn_gone, rn_early, rn_early_v2")
    c.execute(f"drop publication if exists {PUBLICATION}")
    c.execute("create table rn_orders (id int primary key, v text)")
    c.execute("create table rn_gone (id int primary key, v text)")
    c.execute("create table rn_early (id int primary key, v text)")
    c.execute(f"create publication {PUBLICATION} for all tables")
    yield
    c.execute("drop table if exists rn_orders, rn_orders_v2, rn_gone, rn_early, rn_early_v2")
    c.execute(f"drop publication if exists {PUBLICATION}")


def oid_of(conn: psycopg.Connection, name: str) -> int:
    return int(conn.execute("select %s::regclass::oid::int8", (name,)).fetchone()[0])


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_a_table_renamed_mid_batch_keeps_its_delta_table(
    pg_conn, slot_name, tables, tmp_path, plugin, caplog: pytest.LogCaptureFixture
) -> None:
    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    oid = oid_of(c, "rn_orders")

    c.execute("insert into rn_orders values (1, 'a'), (2, 'b')")
    first = extract_batch(c, slot_name, tmp_path, plugin=plugin, publication=publication, tables=["public.rn_orders"])
    assert [(t.table, t.oid, t.target) for t in first.tables] == [("rn_orders", oid, ("public", "rn_orders"))]
    assert {o: {k: e[k] for k in ("names", "delta_table")} for o, e in first.table_oids.items()} == {
        str(oid): {"names": [["public", "rn_orders"]], "delta_table": ["public", "rn_orders"]}
    }
    assert first.table_oids[str(oid)]["columns"] == "1:23:-1,2:25:-1"  # how a rewrite is told (capture/rewrites.py)
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))

    # Within one batch: a change under the old name, the rename, changes under the new name.
    c.execute("update rn_orders set v = 'before' where id = 1")
    c.execute("alter table rn_orders rename to rn_orders_v2")
    c.execute("insert into rn_orders_v2 values (3, 'after')")
    caplog.set_level(logging.INFO, logger="airflow_provider_pgdecode.capture.renames")
    second = extract_batch(
        c,
        slot_name,
        tmp_path,
        plugin=plugin,
        publication=publication,
        checkpoint=Checkpoint.from_manifest(first),
        tables=["public.rn_orders"],  # the tables param still says the old name
    )
    staged = {t.table: (t.oid, t.target, t.rows, tuple(t.key)) for t in second.tables}
    assert staged == {
        "rn_orders": (oid, ("public", "rn_orders"), 1, ("id",)),
        "rn_orders_v2": (oid, ("public", "rn_orders"), 1, ("id",)),
    }
    assert {k: second.table_oids[str(oid)][k] for k in ("names", "delta_table")} == {
        "names": [["public", "rn_orders"], ["public", "rn_orders_v2"]],
        "delta_table": ["public", "rn_orders"],
    }
    assert (
        f"public.rn_orders is now public.rn_orders_v2 (OID {oid}); its changes keep flowing into Delta table "
        "public.rn_orders" in caplog.messages
    )
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, second.end_lsn))

    # Later batches: only the new name, still selected through the old one, still into the old Delta table.
    c.execute("delete from rn_orders_v2 where id = 2")
    third = extract_batch(
        c,
        slot_name,
        tmp_path,
        plugin=plugin,
        publication=publication,
        checkpoint=Checkpoint.from_manifest(second),
        tables=["public.rn_orders"],
    )
    assert [(t.table, t.target, t.deletes) for t in third.tables] == [("rn_orders_v2", ("public", "rn_orders"), 1)]


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_a_dropped_table_stops_without_blocking_the_others(
    pg_conn, slot_name, tables, tmp_path, plugin, caplog: pytest.LogCaptureFixture
) -> None:
    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    selected = ["public.rn_orders", "public.rn_gone"]
    c.execute("insert into rn_gone values (1, 'a')")
    first = extract_batch(c, slot_name, tmp_path, plugin=plugin, publication=publication, tables=selected)
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))

    c.execute("insert into rn_gone values (2, 'b')")
    c.execute("drop table rn_gone")
    c.execute("insert into rn_orders values (1, 'kept')")
    caplog.set_level(logging.WARNING, logger="airflow_provider_pgdecode.capture.renames")
    second = extract_batch(
        c,
        slot_name,
        tmp_path,
        plugin=plugin,
        publication=publication,
        tables=selected,
        checkpoint=Checkpoint.from_manifest(first),
    )
    assert [(t.table, t.rows) for t in second.tables] == [("rn_orders", 1)]
    assert second.skipped["dropped_table_changes"] == 1
    assert any("public.rn_gone" in m and "was dropped" in m for m in caplog.messages)


def test_test_decoding_refuses_a_selected_name_it_cannot_follow(pg_conn, slot_name, tables, tmp_path) -> None:
    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    # Renamed before any batch recorded its OID: test_decoding's names alone cannot tell what it became.
    c.execute("insert into rn_early values (1, 'a')")
    c.execute("alter table rn_early rename to rn_early_v2")
    with pytest.raises(CatalogError, match=r"rn_early has changes in this batch.*resnapshot the table") as error:
        extract_batch(c, slot_name, tmp_path, tables=["public.rn_early"])
    assert "replace public.rn_early in the tables list by its new name" in str(error.value)
    # The way forward it names: select the new name; the run goes on.
    manifest = extract_batch(c, slot_name, tmp_path, tables=["public.rn_early_v2"])
    assert manifest.tables == []
    assert manifest.skipped["excluded_table_changes"] == 1


def test_selection_follows_a_rename_through_the_recorded_oid(pg_conn, tables) -> None:
    oid = oid_of(pg_conn, "rn_orders")
    known = KnownTables.from_record(
        {str(oid): {"names": [["public", "rn_orders"]], "delta_table": ["public", "rn_orders"]}}
    )
    pg_conn.execute("alter table rn_orders rename to rn_orders_v2")
    catalog = Catalog(pg_conn)
    assert follow_selection(catalog, {("public", "rn_orders")}, known) == {
        ("public", "rn_orders"),
        ("public", "rn_orders_v2"),
    }
    # Selected by the new name: the old name is kept for changes made before the rename.
    assert follow_selection(catalog, {("public", "rn_orders_v2")}, known) == {
        ("public", "rn_orders"),
        ("public", "rn_orders_v2"),
    }
    assert follow_selection(catalog, None, known) is None


def test_a_snapshot_under_the_new_name_moves_the_table_to_a_delta_table_of_that_name(pg_conn, tables) -> None:
    oid = oid_of(pg_conn, "rn_orders")
    record = {str(oid): {"names": [["public", "rn_orders"]], "delta_table": ["public", "rn_orders"]}}
    pg_conn.execute("alter table rn_orders rename to rn_orders_v2")

    def staged() -> list[TableSummary]:
        return [
            TableSummary("public", "rn_orders_v2", "tables/public/rn_orders_v2", [], 1, 1, 0, 0, 0, "0/10", "0/10", [])
        ]

    catalog = Catalog(pg_conn)
    kept = follow_staged(catalog, staged(), KnownTables.from_record(record), {}, None)
    assert kept.tables[0].target == ("public", "rn_orders")
    assert kept.current == {("public", "rn_orders_v2"): ("public", "rn_orders_v2")}
    # resnapshot (or add-table) of public.rn_orders_v2 starting in this batch: the new name's Delta table.
    moved = follow_staged(catalog, staged(), KnownTables.from_record(record), {}, None, ["public.rn_orders_v2"])
    assert moved.tables[0].target == ("public", "rn_orders_v2") and moved.tables[0].delta_table is None
    assert moved.known.record()[str(oid)]["delta_table"] == ["public", "rn_orders_v2"]


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_a_table_dropped_and_created_again_flows_as_a_new_table_with_a_warning(
    pg_conn, slot_name, tables, tmp_path, plugin, caplog: pytest.LogCaptureFixture
) -> None:
    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    c.execute("insert into rn_gone values (1, 'a')")
    first = extract_batch(c, slot_name, tmp_path, plugin=plugin, publication=publication)
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))
    old = oid_of(c, "rn_gone")

    c.execute("drop table rn_gone")
    c.execute("create table rn_gone (id int primary key, v text)")
    c.execute("insert into rn_gone values (7, 'new')")
    new = oid_of(c, "rn_gone")
    caplog.set_level(logging.WARNING, logger="airflow_provider_pgdecode.capture.renames")
    second = extract_batch(
        c, slot_name, tmp_path, plugin=plugin, publication=publication, checkpoint=Checkpoint.from_manifest(first)
    )
    assert [(t.table, t.oid, t.target, t.rows) for t in second.tables] == [("rn_gone", new, ("public", "rn_gone"), 1)]
    assert f"public.rn_gone was dropped and re-created (OID {old}, now {new})" in " ".join(caplog.messages)


def test_a_table_renamed_after_its_initial_snapshot_keeps_the_snapshot_delta_table(
    pg_conn, pg_dsn, slot_name, tables, tmp_path
) -> None:
    from airflow_provider_pgdecode.batch.manifest import BatchManifest
    from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot

    oid = oid_of(pg_conn, "rn_orders")
    pg_conn.execute("insert into rn_orders values (1, 'a')")
    with create_slot_with_snapshot(pg_dsn, slot_name, "test_decoding", two_phase=True) as (lsn, name):
        snapshot = stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path, [("public", "rn_orders")])
    assert [(t.table, t.oid) for t in snapshot.tables] == [("rn_orders", oid)]
    assert snapshot.table_oids[str(oid)]["delta_table"] == ["public", "rn_orders"]

    pg_conn.execute("alter table rn_orders rename to rn_orders_v2")
    pg_conn.execute("insert into rn_orders_v2 values (2, 'b')")
    checkpoint = Checkpoint.from_manifest(BatchManifest.read(snapshot.path))
    follow = extract_batch(pg_conn, slot_name, tmp_path, checkpoint=checkpoint, tables=["public.rn_orders"])
    assert [(t.table, t.target, t.rows) for t in follow.tables] == [("rn_orders_v2", ("public", "rn_orders"), 1)]


def test_a_resnapshot_under_the_new_name_moves_the_table_to_that_names_delta_table(
    pg_conn, slot_name, tables, tmp_path
) -> None:
    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    c.execute("insert into rn_orders select g, 'v' from generate_series(1, 5) g")
    first = extract_batch(c, slot_name, tmp_path, tables=["public.rn_orders"])
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))
    c.execute("alter table rn_orders rename to rn_orders_v2")
    c.execute("update rn_orders_v2 set v = 'w' where id = 1")

    request_table_snapshot(tmp_path, slot_name, [("public", "rn_orders_v2")], "resnapshot")
    moved = extract_batch(
        c, slot_name, tmp_path, tables=["public.rn_orders"], checkpoint=Checkpoint.from_manifest(first)
    )
    assert any(chunk["kind"] == "truncate" for chunk in moved.snapshot_chunks)
    assert {(t.table, t.target) for t in moved.tables} == {("rn_orders_v2", ("public", "rn_orders_v2"))}
    oid = oid_of(c, "rn_orders_v2")
    assert moved.table_oids[str(oid)]["delta_table"] == ["public", "rn_orders_v2"]
    # Later batches follow the move.
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, moved.end_lsn))
    c.execute("delete from rn_orders_v2 where id = 2")
    later = extract_batch(
        c, slot_name, tmp_path, tables=["public.rn_orders"], checkpoint=Checkpoint.from_manifest(moved)
    )
    assert [(t.table, t.target, t.deletes) for t in later.tables] == [("rn_orders_v2", ("public", "rn_orders_v2"), 1)]


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_a_table_moved_to_another_schema_is_followed_like_a_rename(
    pg_conn, slot_name, tables, tmp_path, plugin
) -> None:
    c = pg_conn
    c.execute("drop schema if exists rn_other cascade; create schema rn_other")
    try:
        c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
        publication = PUBLICATION if plugin == "pgoutput" else None
        c.execute("insert into rn_orders values (1, 'a')")
        first = extract_batch(
            c, slot_name, tmp_path, plugin=plugin, publication=publication, tables=["public.rn_orders"]
        )
        c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, first.end_lsn))
        c.execute("update rn_orders set v = 'before' where id = 1")
        c.execute("alter table rn_orders set schema rn_other")
        c.execute("insert into rn_other.rn_orders values (2, 'after')")
        second = extract_batch(
            c,
            slot_name,
            tmp_path,
            plugin=plugin,
            publication=publication,
            tables=["public.rn_orders"],
            checkpoint=Checkpoint.from_manifest(first),
        )
        assert sorted((t.schema, t.target, t.rows) for t in second.tables) == [
            ("public", ("public", "rn_orders"), 1),
            ("rn_other", ("public", "rn_orders"), 1),
        ]
    finally:
        c.execute("drop schema if exists rn_other cascade")
