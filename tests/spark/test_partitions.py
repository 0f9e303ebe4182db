"""A partitioned table lands as its root: one Delta table, equal to the root, through both plugins
and whatever the publication's publish_via_partition_root says (issue 37). Rows moving across
partitions, a partition truncated, detached or attached; the initial load of the root."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.rewrites import snapshot_pending
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.capture.table_snapshot import write_snapshot_states
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import full_only_test

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "pt_pub"
DDL = """
create table pt_orders (id int, region text, amount int, primary key (id, region)) partition by list (region);
create table pt_orders_eu partition of pt_orders for values in ('eu');
create table pt_orders_us partition of pt_orders for values in ('us');
create table pt_orders_asia partition of pt_orders for values in ('asia');
"""
TABLES = "pt_orders_old, pt_orders_later, pt_orders_asia, pt_orders_us, pt_orders_eu, pt_orders"


@pytest.fixture()
def partitioned(pg_conn) -> Iterator[psycopg.Connection]:
    pg_conn.execute(f"drop table if exists {TABLES} cascade; drop publication if exists {PUBLICATION}")
    pg_conn.execute(DDL)
    yield pg_conn
    pg_conn.execute(f"drop publication if exists {PUBLICATION}")
    pg_conn.execute(f"drop table if exists {TABLES} cascade")


SOURCES = [
    pytest.param("test_decoding", None, id="test_decoding"),
    pytest.param("pgoutput", False, id="pgoutput"),  # changes published under the partitions' names
    pytest.param(  # publish_via_partition_root: under the root's
        "pgoutput",
        True,
        id="pgoutput-via-root",
        marks=full_only_test(
            "the root's own name and OID flow as an ordinary table's; a partition's TRUNCATE, DETACH and ATTACH "
            "are found in the catalog as for the other two"
        ),
    ),
]


@pytest.mark.parametrize(("plugin", "via_root"), SOURCES)
def test_a_partitioned_table_lands_as_its_root(partitioned, slot_name, spark, tmp_path: Path, plugin, via_root):
    c = partitioned
    extra = {}
    if plugin == "pgoutput":
        c.execute(
            f"create publication {PUBLICATION} for table pt_orders "
            f"with (publish_via_partition_root = {str(via_root).lower()})"
        )
        extra = {"publication": PUBLICATION}
    # Two-phase, as pgdecode creates slots; pgoutput decodes it from PostgreSQL 15 (protocol 3) on.
    two_phase = plugin == "test_decoding" or c.info.server_version >= 150000
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (slot_name, plugin, two_phase))
    root = str(tmp_path / "delta")
    staging = tmp_path / "staging"
    checkpoint: Checkpoint | None = None

    def cycle() -> None:
        nonlocal checkpoint
        batch = extract_batch(
            c, slot_name, staging, plugin=plugin, checkpoint=checkpoint, tables=["public.pt_orders"], **extra
        )
        merge_batches(spark, [str(batch.path)], root)
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot_name, str(batch.end_lsn)))
        checkpoint = Checkpoint.from_manifest(batch)
        write_snapshot_states(staging, slot_name, checkpoint.snapshots)  # as the confirm task does

    def equal() -> None:
        result = compare_table(c, spark, root, "public", "pt_orders")
        assert result.equal, result.describe()
        assert sorted(p.name for p in (Path(root) / "public").iterdir()) == ["pt_orders"]  # no Delta per partition

    def resnapshotted() -> None:
        """The run that finds the partition's change files a resnapshot of the root; the next copies it."""
        cycle()
        assert snapshot_pending(staging, slot_name) == {("public", "pt_orders")}
        cycle()
        assert snapshot_pending(staging, slot_name) == set()
        equal()

    c.execute(
        "insert into pt_orders select g, (array['eu', 'us', 'asia'])[g % 3 + 1], g * 10 from generate_series(1, 30) g"
    )
    cycle()
    equal()
    # Rows moving across partitions (a DELETE in one, an INSERT in another), in place, deleted; a
    # partition created (empty: nothing to resnapshot) and written to.
    c.execute("update pt_orders set region = 'us' where region = 'eu' and id < 10")
    c.execute("update pt_orders set amount = amount + 1 where region = 'asia'")
    c.execute("delete from pt_orders where id in (28, 29)")
    c.execute("create table pt_orders_later partition of pt_orders for values in ('later')")
    c.execute("insert into pt_orders values (31, 'eu', 1), (32, 'asia', 2), (33, 'later', 3)")
    cycle()
    assert snapshot_pending(staging, slot_name) == set()
    equal()
    # One partition truncated (pgoutput through the root does not even send it): the root is resnapshotted.
    c.execute("truncate pt_orders_us")
    c.execute("insert into pt_orders values (34, 'us', 4)")
    resnapshotted()
    # One detached: its rows leave the root.
    c.execute("alter table pt_orders detach partition pt_orders_asia")
    resnapshotted()
    # Attached with rows of its own: they join the root.
    c.execute("alter table pt_orders detach partition pt_orders_later")
    resnapshotted()
    c.execute("insert into pt_orders_later values (40, 'later', 40)")
    c.execute("alter table pt_orders attach partition pt_orders_later for values in ('later')")
    resnapshotted()


def test_the_initial_load_copies_a_partitioned_root(partitioned, pg_dsn, spark, tmp_path: Path) -> None:
    c = partitioned
    c.execute(
        "insert into pt_orders select g, (array['eu', 'us', 'asia'])[g % 3 + 1], g from generate_series(1, 3000) g"
    )
    slot = "pt_snapshot"
    try:
        with create_slot_with_snapshot(pg_dsn, slot, two_phase=False) as (lsn, name):
            batch = stage_snapshot(
                pg_dsn, name, lsn, slot, tmp_path / "staging", ["public.pt_orders"], chunk_pages=2, workers=2
            )
    finally:
        c.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (slot,))
    assert [(t.schema, t.table) for t in batch.tables] == [("public", "pt_orders")]
    # Copied leaf by leaf, each in ctid chunks, by two workers: as many parts as chunks.
    info = json.loads((Path(batch.path) / "snapshot.json").read_text())["tables"][0]
    leaves = {leaf["table"]: leaf["chunks"] for leaf in info["leaves"]}
    assert set(leaves) == {"pt_orders_eu", "pt_orders_us", "pt_orders_asia"} and min(leaves.values()) >= 2, info
    assert info["chunks"] == sum(leaves.values()) == len([f for f in info["files"] if "truncate" not in f]), info
    root = str(tmp_path / "delta")
    merge_batches(spark, [str(batch.path)], root)
    result = compare_table(c, spark, root, "public", "pt_orders")
    assert result.equal and result.source_rows == 3000, result.describe()


LEAVES = ("pt_orders_asia", "pt_orders_eu", "pt_orders_us")
KEEP_LEAVES = {"public.pt_orders": {"partitions": "leaves"}}


LEAF_SOURCES = [
    SOURCES[0],
    pytest.param(
        "pgoutput",
        False,
        id="pgoutput",
        marks=full_only_test("test_decoding runs the same leaves; the publication's refusal is tested below"),
    ),
]


@pytest.mark.parametrize(("plugin", "via_root"), LEAF_SOURCES)
def test_a_partitioned_table_kept_as_leaves(partitioned, pg_dsn, spark, tmp_path: Path, plugin, via_root) -> None:
    """``partitions = 'leaves'``: the initial load copies each leaf, and each leaf partition lands
    in a Delta table of its own, equal to it, through rows moving across partitions, a partition's
    TRUNCATE (decoded as any table's), one created, and one attached with rows (resnapshotted)."""
    from airflow_provider_pgdecode.capture.tables import resolve_tables
    from airflow_provider_pgdecode.postgres.catalog import Catalog

    c = partitioned
    extra: dict[str, str] = {}
    if plugin == "pgoutput":
        c.execute(f"create publication {PUBLICATION} for table pt_orders with (publish_via_partition_root = false)")
        extra = {"publication": PUBLICATION}
    c.execute(
        "insert into pt_orders select g, (array['eu', 'us', 'asia'])[g % 3 + 1], g * 10 from generate_series(1, 90) g"
    )
    tables = resolve_tables(lambda: Catalog(c), ["public.pt_orders"], table_options=KEEP_LEAVES, **extra)
    assert tables == [("public", leaf) for leaf in LEAVES]
    root = str(tmp_path / "delta")
    staging = tmp_path / "staging"
    slot = f"pt_leaves_{plugin}"
    two_phase = plugin == "test_decoding" or c.info.server_version >= 150000
    with create_slot_with_snapshot(pg_dsn, slot, plugin=plugin, two_phase=two_phase) as (lsn, name):
        batch = stage_snapshot(pg_dsn, name, lsn, slot, staging, tables, chunk_rows=10)
    try:
        merge_batches(spark, [str(batch.path)], root)
        checkpoint = Checkpoint.from_manifest(batch)

        def cycle() -> None:
            nonlocal checkpoint
            batch = extract_batch(
                c,
                slot,
                staging,
                plugin=plugin,
                checkpoint=checkpoint,
                tables=["public.pt_orders"],
                table_options=KEEP_LEAVES,
                **extra,
            )
            merge_batches(spark, [str(batch.path)], root)
            c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batch.end_lsn)))
            checkpoint = Checkpoint.from_manifest(batch)
            write_snapshot_states(staging, slot, checkpoint.snapshots)

        def equal(*leaves: str) -> None:
            for leaf in leaves:
                result = compare_table(c, spark, root, "public", leaf)
                assert result.equal, result.describe()
            assert not (Path(root) / "public" / "pt_orders").exists()  # no Delta table of the root

        equal(*LEAVES)
        c.execute("update pt_orders set region = 'us' where region = 'eu' and id < 30")
        c.execute("delete from pt_orders where id in (88, 89)")
        c.execute("truncate pt_orders_asia")
        c.execute("insert into pt_orders values (100, 'asia', 1)")
        c.execute("create table pt_orders_later partition of pt_orders for values in ('later')")
        c.execute("insert into pt_orders values (101, 'later', 2)")
        cycle()
        assert snapshot_pending(staging, slot) == set()
        equal(*LEAVES, "pt_orders_later")
        # Attached with rows of its own: that leaf alone is resnapshotted.
        c.execute("create table pt_orders_old (like pt_orders including all)")
        c.execute("insert into pt_orders_old select g, 'old', g from generate_series(200, 240) g")
        c.execute("alter table pt_orders attach partition pt_orders_old for values in ('old')")
        cycle()
        assert snapshot_pending(staging, slot) == {("public", "pt_orders_old")}
        cycle()
        assert snapshot_pending(staging, slot) == set()
        equal(*LEAVES, "pt_orders_later", "pt_orders_old")
    finally:
        c.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (slot,))


def test_leaves_are_refused_under_publish_via_partition_root(partitioned, slot_name, tmp_path: Path) -> None:
    from airflow_provider_pgdecode.capture.tables import resolve_tables
    from airflow_provider_pgdecode.errors import ConfigurationError
    from airflow_provider_pgdecode.postgres.catalog import Catalog

    c = partitioned
    c.execute(f"create publication {PUBLICATION} for table pt_orders with (publish_via_partition_root = true)")
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name,))
    refusal = f"publication '{PUBLICATION}' sets publish_via_partition_root = true.*ALTER PUBLICATION {PUBLICATION}"
    with pytest.raises(ConfigurationError, match=refusal):
        resolve_tables(lambda: Catalog(c), [], publication=PUBLICATION, table_options=KEEP_LEAVES)
    with pytest.raises(ConfigurationError, match=refusal):
        extract_batch(
            c,
            slot_name,
            tmp_path,
            plugin="pgoutput",
            publication=PUBLICATION,
            tables=["public.pt_orders"],
            table_options=KEEP_LEAVES,
        )
    # Following the way forward, the leaves are listed.
    c.execute(f"alter publication {PUBLICATION} set (publish_via_partition_root = false)")
    tables = resolve_tables(lambda: Catalog(c), [], publication=PUBLICATION, table_options=KEEP_LEAVES)
    assert [t for t in tables if t[1].startswith("pt_")] == [("public", leaf) for leaf in LEAVES]


def test_a_root_with_a_foreign_partition_is_copied_whole(pg_conn) -> None:
    """A root's chunks are its heap leaves' ctid ranges; a foreign partition has no pages to range
    over, so a root with one is read by one COPY."""
    from airflow_provider_pgdecode.capture.snapshot_chunks import ChunkRead, chunk_reads, plan_chunks

    c = pg_conn
    c.execute(
        "drop table if exists pt_logs cascade; drop server if exists pt_nowhere cascade;"
        " create table pt_logs (id int, region text) partition by list (region);"
        " create table pt_logs_eu partition of pt_logs for values in ('eu');"
        " create table pt_logs_us partition of pt_logs for values in ('us');"
        " insert into pt_logs select g, 'eu' from generate_series(1, 2000) g"
    )
    try:
        with c.transaction():
            heap = plan_chunks(c, "public", "pt_logs", 100, 1)
        assert [leaf["table"] for leaf in heap["leaves"]] == ["pt_logs_eu", "pt_logs_us"]
        eu = heap["leaves"][0]
        assert eu["chunks"] == eu["pages"] > 1 and heap["chunks"] == eu["chunks"]  # the empty leaf has none
        assert chunk_reads("public", "pt_logs", heap, 1) == ChunkRead("public", "pt_logs_eu", 1, 2, 1)
        c.execute(
            "create extension if not exists postgres_fdw;"
            " create server pt_nowhere foreign data wrapper postgres_fdw options (dbname 'nowhere');"
            " create foreign table pt_logs_far partition of pt_logs for values in ('far') server pt_nowhere"
        )
        with c.transaction():
            whole = plan_chunks(c, "public", "pt_logs", 100, 1)
        assert "leaves" not in whole and whole["chunks"] == 1
        assert chunk_reads("public", "pt_logs", whole, 0) == ChunkRead("public", "pt_logs", None, None, 1)
    finally:
        c.execute("drop table if exists pt_logs cascade; drop server if exists pt_nowhere cascade")
