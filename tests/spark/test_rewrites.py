"""Tables whose rows change without row changes in the WAL: a volatile ADD COLUMN default, a
rewriting ALTER COLUMN TYPE … USING, DROP + CREATE of one name. The extract finds each (file
node and columns, or a new OID behind the same Delta table) and files a resnapshot request, and
the next runs make Delta equal to PostgreSQL again; with on_rewrite stop the run stops naming the
table until a request is filed (issue 35)."""

from __future__ import annotations

import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.rewrites import snapshot_pending
from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot, write_snapshot_states
from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import full_only, two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "rw_pub"
TABLE = ("public", "rw_items")


@pytest.fixture()
def source(pg_conn, slot_name):
    ddl = "create table rw_items (id int primary key, v text)"
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["rw_items"], ddl) as slot:
        yield slot


@pytest.mark.parametrize(
    "plugin", ["test_decoding", full_only("pgoutput", "the catalog marks are the same; test_decoding follows by name")]
)
def test_rewritten_and_recreated_tables_are_resnapshotted_until_delta_equals_them(
    pg_conn, source, spark, tmp_path, plugin
):
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    c = pg_conn
    staging, root = tmp_path / "staging", str(tmp_path / "delta")

    checkpoint: Checkpoint | None = None

    def cycle() -> None:
        nonlocal checkpoint
        batch = extract_batch(c, slot, staging, plugin=plugin, checkpoint=checkpoint, **extra)
        merge_batches(spark, [str(batch.path)], root)
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batch.end_lsn)))
        checkpoint = Checkpoint.from_manifest(batch)
        write_snapshot_states(staging, slot, checkpoint.snapshots)  # as the confirm task does

    def caught_up() -> None:
        """The run that finds the rewrite files the request; the next copies the table."""
        cycle()
        assert snapshot_pending(staging, slot) == {TABLE}
        cycle()
        assert snapshot_pending(staging, slot) == set()
        result = compare_table(c, spark, root, *TABLE)
        assert result.equal, result.describe()

    c.execute("insert into rw_items select g, 'value ' || g from generate_series(1, 20) g")
    cycle()
    assert snapshot_pending(staging, slot) == set()

    c.execute("alter table rw_items add column r float8 default random()")  # each old row its own value
    caught_up()
    c.execute("alter table rw_items alter column v type varchar(4) using left(v, 4)")  # values cut, no WAL
    caught_up()
    c.execute("vacuum full rw_items")  # a new file node, the same rows: nothing to do
    c.execute("update rw_items set v = 'x' where id = 2")
    cycle()
    assert snapshot_pending(staging, slot) == set()
    c.execute("drop table rw_items")
    c.execute("create table rw_items (id int primary key, v text)")
    if plugin == "pgoutput":
        c.execute(f"alter publication {PUBLICATION} add table rw_items")
    c.execute("insert into rw_items values (1, 'new table')")
    caught_up()


def test_on_rewrite_stop_stops_the_run_until_a_request_is_filed(pg_conn, source, tmp_path):
    c = pg_conn
    staging = tmp_path / "staging"
    options = {"public.rw_items": {"on_rewrite": "stop"}}
    c.execute("insert into rw_items values (1, 'a'), (2, 'b')")
    first = extract_batch(c, source, staging, table_options=options)
    c.execute("select pg_replication_slot_advance(%s, %s)", (source, str(first.end_lsn)))
    checkpoint = Checkpoint.from_manifest(first)
    c.execute("alter table rw_items add column r float8 default random()")
    c.execute("insert into rw_items values (3, 'c')")
    with pytest.raises(CatalogError, match=r"public\.rw_items changed without their rows in the WAL .*rewritten"):
        extract_batch(c, source, staging, checkpoint=checkpoint, table_options=options)
    with pytest.raises(CatalogError, match="mode=resnapshot"):  # stays stopped: nothing was staged
        extract_batch(c, source, staging, checkpoint=checkpoint, table_options=options)
    request_table_snapshot(staging, source, ["public.rw_items"], "resnapshot")  # the way forward
    assert extract_batch(c, source, staging, checkpoint=checkpoint, table_options=options).tables
