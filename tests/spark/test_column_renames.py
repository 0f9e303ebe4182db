"""RENAME COLUMN, from PostgreSQL into Delta: the Delta column is renamed and keeps its values,
whether the rename comes between batches or inside one (changes staged under both names), twice
in a row, and when a batch only holds changes from before it (issue 35)."""

from __future__ import annotations

import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark import column_renames
from airflow_provider_pgdecode.spark.merge_job import delta_ref, merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import full_only, two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "cr_pub"


@pytest.fixture()
def source(pg_conn, slot_name):
    ddl = "create table cr_items (id int primary key, title text, n int)"
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["cr_items"], ddl) as slot:
        yield slot


def test_the_rename_rule_follows_attribute_numbers() -> None:
    # title (2) renamed to heading: rename the Delta column, read parts staged as title as heading.
    assert column_renames.renames({"id": 1, "heading": 2}, {"id": 1, "title": 2}, ["id", "title"]) == (
        {"title": "heading"},
        {"heading": ("title",)},
    )
    # Renamed already (a run stopped after the RENAME): nothing to rename, parts still read.
    assert column_renames.renames({"heading": 2}, {"title": 2, "heading": 2}, ["heading"]) == (
        {},
        {"heading": ("title",)},
    )
    # Dropped and added again under its name: a new number, not a rename.
    assert column_renames.renames({"title": 3}, {"title": 2}, ["title"]) == ({}, {})
    assert column_renames.numbers_after({"title": 2}, {"heading": 2}) == {"title": 2, "heading": 2}


def one_cycle(c, spark, source: str, plugin: str, tmp_path, root: str):
    """Extract the slot of ``plugin`` up to the server's WAL position, merge, advance the slot."""
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}

    def cycle() -> None:
        upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
        batch = extract_batch(c, slot, tmp_path / "staging", plugin=plugin, upto_lsn=upto, **extra)
        merge_batches(spark, [str(batch.path)], root)
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batch.end_lsn)))

    return cycle


@pytest.mark.parametrize(
    "plugin", ["test_decoding", full_only("pgoutput", "attribute numbers come from the catalog for both plugins")]
)
def test_a_renamed_column_is_renamed_in_delta_with_its_values(pg_conn, source, spark, tmp_path, plugin):
    c = pg_conn
    root = str(tmp_path / "delta")
    path = f"{root}/public/cr_items"

    cycle = one_cycle(c, spark, source, plugin, tmp_path, root)

    def delta_columns() -> list[str]:
        return [f.name for f in spark.read.format("delta").load(path).schema.fields if not f.name.startswith("_pg")]

    c.execute("insert into cr_items select g, 't' || g, g from generate_series(1, 4) g")
    cycle()
    # In one batch: a change under the old name, the rename, changes under the new one.
    c.execute("update cr_items set title = 'before', n = 20 where id = 2")
    c.execute("alter table cr_items rename column title to heading")
    c.execute("update cr_items set heading = 'after' where id = 3")
    c.execute("insert into cr_items values (5, 'new', 5)")
    cycle()
    assert delta_columns() == ["id", "heading", "n"]  # no title left, no NULL heading added
    result = compare_table(c, spark, root, "public", "cr_items")
    assert result.equal, result.describe()

    # Renamed again, the batch holds only a change from before that rename; then one after.
    c.execute("update cr_items set heading = 'under heading' where id = 1")
    c.execute("alter table cr_items rename column heading to headline")
    cycle()
    c.execute("update cr_items set headline = 'under headline' where id = 4")
    cycle()
    assert delta_columns() == ["id", "headline", "n"]
    result = compare_table(c, spark, root, "public", "cr_items")
    assert result.equal, result.describe()
    history = spark.sql(f"DESCRIBE HISTORY {delta_ref(path)}").collect()
    assert sum(1 for h in history if h["operation"] == "RENAME COLUMN") == 2


@pytest.mark.parametrize(
    "plugin", ["test_decoding", full_only("pgoutput", "attribute numbers come from the catalog for both plugins")]
)
def test_a_renamed_key_column_is_followed_in_delta(pg_conn, source, spark, tmp_path, plugin):
    """The primary key's column renamed: the Delta column and the table's recorded key follow it,
    and changes staged before the rename (their old-key images under the former name) still
    find their rows."""
    c = pg_conn
    root = str(tmp_path / "delta")
    path = f"{root}/public/cr_items"

    cycle = one_cycle(c, spark, source, plugin, tmp_path, root)

    c.execute("insert into cr_items select g, 't' || g, g from generate_series(1, 6) g")
    cycle()
    # In one batch: a key change and a delete under the old name, the rename, changes under the new one.
    c.execute("update cr_items set id = 60 where id = 6")
    c.execute("delete from cr_items where id = 5")
    c.execute("alter table cr_items rename column id to item_id")
    c.execute("update cr_items set title = 'after' where item_id = 3")
    c.execute("delete from cr_items where item_id = 4")
    c.execute("insert into cr_items values (7, 'new', 7)")
    cycle()
    table = spark.read.format("delta").load(path)
    assert [f.name for f in table.schema.fields if not f.name.startswith("_pg")] == ["item_id", "title", "n"]
    result = compare_table(c, spark, root, "public", "cr_items")
    assert result.equal, result.describe()
    properties = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES {delta_ref(path)}").collect()}
    assert properties["pgdecode.key"] == '["item_id"]'

    # A later batch keys on the new name only; an update and a delete find their rows.
    c.execute("update cr_items set n = 100 where item_id = 1")
    c.execute("delete from cr_items where item_id = 2")
    cycle()
    result = compare_table(c, spark, root, "public", "cr_items")
    assert result.equal, result.describe()
