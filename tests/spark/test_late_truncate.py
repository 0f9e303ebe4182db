"""A TRUNCATE that is a table's only change in a batch (issue 35, "One table stops every table"):
its manifest entry listed no columns, so the merge could not type the table's key and refused the
whole run, and every run after, for every table. With the pipeline running: a table created since
(added to the publication), filled, then truncated alone while its Delta table exists; one created
and truncated alone before it has a Delta table; one created, filled, truncated and filled again in
one batch; several tables truncated in one statement, one with rows after it. Both plugins stage the
same batches (both writers too); Delta equals PostgreSQL after every run, and the runs after flow."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from tests.capture.test_extract_pgoutput import staged
from tests.capture.test_native import assert_same_batches
from tests.conftest import PLUGIN_REPEAT, full_only, two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "lt_pub"
LATE = ("lt_late", "lt_empty", "lt_refill")
COLUMNS = "(id int primary key, v text, n numeric(10,2), tags text[], at timestamptz)"


def delta_rows(root: str, table: str) -> list[tuple[int, str]]:
    query = QueryBuilder().register("t", DeltaTable(f"{root}/public/{table}")).execute("select id, v from t")
    return sorted((row["id"], row["v"]) for row in pa.table(query.read_all()).to_pylist())


@pytest.fixture()
def source(pg_conn, slot_name):
    pg_conn.execute(f"drop table if exists {', '.join(LATE)}")
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["lt_base"], f"create table lt_base {COLUMNS}") as slot:
        yield slot
    pg_conn.execute(f"drop table if exists {', '.join(LATE)}")


@pytest.mark.parametrize("merged", ["pgoutput", full_only("test_decoding", PLUGIN_REPEAT)])
def test_a_table_truncated_alone_in_a_batch_merges_and_the_runs_after_flow(pg_conn, source, spark, tmp_path, merged):
    c = pg_conn
    root = str(tmp_path / "delta")
    runs = iter(range(100))

    def cycle(merge: tuple[str, ...], compare: tuple[str, ...], both_writers: bool = False) -> BatchManifest:
        """Extract through both plugins (equal batches), merge ``merged``'s, advance both slots."""
        upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
        run = next(runs)
        batches = {}
        for plugin, slot, extra in (
            ("test_decoding", source, {}),
            ("pgoutput", source + "_po", {"publication": PUBLICATION}),
        ):
            batches[plugin] = extract_batch(
                c, slot, tmp_path / f"{plugin}-{run}", plugin=plugin, native=False, upto_lsn=upto, **extra
            )
            if both_writers and load_native() is not None:
                native = extract_batch(
                    c, slot, tmp_path / f"{plugin}-{run}-native", plugin=plugin, native=True, upto_lsn=upto, **extra
                )
                assert_same_batches(batches[plugin], native)
            c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batches[plugin].end_lsn)))
        decoded, published = batches["test_decoding"], batches["pgoutput"]
        assert [t.to_dict() for t in decoded.tables] == [t.to_dict() for t in published.tables]
        assert staged(decoded) == staged(published)
        batch = batches[merged]
        result = merge_batches(spark, [str(batch.path)], root)
        assert {name: t["status"] for name, t in result["tables"].items()} == {f"public.{t}": "merged" for t in merge}
        for table in compare:  # read by delta-rs: no Spark job per check
            assert delta_rows(root, table) == sorted(c.execute(f"select id, v from {table}").fetchall()), table
        return batch

    # The pipeline runs.
    c.execute("insert into lt_base values (1, 'a', 1.5, '{x}', now()), (2, 'b', null, null, null)")
    cycle(merge=("lt_base",), compare=())

    # Tables created since: one filled, one left empty, one filled, truncated and filled in one batch.
    for table in LATE:
        c.execute(f"create table {table} {COLUMNS}")
        c.execute(f"alter publication {PUBLICATION} add table {table}")
    c.execute("insert into lt_late values (1, 'x', 2.25, '{p,q}', now()), (2, 'y', null, '{}', null)")
    c.execute("insert into lt_refill values (1, 'gone', null, null, null)")
    c.execute("truncate lt_refill")
    c.execute("insert into lt_refill values (2, 'kept', 3, '{k}', now())")
    filled = cycle(merge=("lt_late", "lt_refill"), compare=("lt_late", "lt_refill"))

    # One TRUNCATE of three tables: the only change of lt_late (its Delta table exists) and of
    # lt_empty (none yet); lt_base filled again after it in the same batch.
    c.execute("truncate lt_late, lt_empty, lt_base")
    c.execute("insert into lt_base values (3, 'after', 4, '{a}', now())")
    truncated = cycle(merge=("lt_base", "lt_empty", "lt_late"), compare=("lt_late", "lt_empty"), both_writers=True)
    entries = {t.table: t for t in truncated.tables}
    assert (entries["lt_late"].rows, entries["lt_late"].truncates, entries["lt_empty"].truncates) == (1, 1, 1)
    # Named, typed and staged as a row image of the table names them.
    assert entries["lt_late"].columns == entries["lt_empty"].columns == filled.tables[0].columns
    fields = [f.name for f in DeltaTable(f"{root}/public/lt_empty").schema().fields if not f.name.startswith("_pg_")]
    assert fields == ["id", "v", "n", "tags", "at"]

    # The runs after flow.
    c.execute("insert into lt_late values (5, 'then', 1, '{z}', now())")
    cycle(merge=("lt_late",), compare=("lt_late", "lt_base"))


def test_a_truncate_only_entry_lists_the_columns_a_row_would_carry(pg_conn, slot_name, tmp_path):
    """Generated columns left out (pgoutput leaves them out; test_decoding prints them), dropped ones
    too, in attribute order, with their catalog types."""
    c = pg_conn
    c.execute("drop table if exists lt_gen")
    c.execute(
        "create table lt_gen (a text, id bigint primary key, g int generated always as (2) stored, d int, v varchar(9))"
    )
    c.execute("alter table lt_gen drop column d")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    c.execute("truncate lt_gen")
    batch = extract_batch(c, slot_name, tmp_path, plugin="test_decoding")
    c.execute("drop table lt_gen")
    (entry,) = batch.tables
    assert [(col.name, col.type, col.catalog_type, col.arrow) for col in entry.columns] == [
        ("a", "text", "text", "string"),
        ("id", "bigint", "bigint", "int64"),
        ("v", "character varying", "character varying(9)", "string"),
    ]
    assert (entry.key, entry.truncates, entry.rows) == (["id"], 1, 1)
