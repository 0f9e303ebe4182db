"""Keyless REPLICA IDENTITY FULL tables merge as multisets: identical rows stay distinct.

PostgreSQL is the oracle (testing/compare.py compares as multisets: duplicates count).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql.types import ArrayType, IntegerType, MapType, StringType, StructField, StructType

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.spark.multiset import uncomparable_columns
from pgdecode_testing.compare import compare_table
from tests.conftest import PLUGIN_REPEAT, full_only
from tests.spark.staged import TableChanges, write_batch

TABLE = "ms_full"
PUBLICATION = "ms_pub"


def one(condition: str) -> str:
    """``ctid = (...)``: exactly one copy of the rows matching ``condition``."""
    return f"ctid = (select ctid from {TABLE} where {condition} limit 1)"


def test_uncomparable_columns_are_maps_at_any_depth() -> None:
    types = {
        "a": IntegerType(),
        "m": MapType(StringType(), StringType()),
        "l": ArrayType(MapType(StringType(), IntegerType())),
        "s": StructType([StructField("x", ArrayType(StringType()))]),
    }
    assert uncomparable_columns(types) == ["m", "l"]


@pytest.fixture()
def full_table(pg_conn: psycopg.Connection, slot_name: str) -> Any:
    c = pg_conn
    c.execute(f"drop table if exists {TABLE}; drop publication if exists {PUBLICATION}")
    c.execute(
        f"create table {TABLE} (a int, b text, f float8, big text); alter table {TABLE} replica identity full;"
        f" alter table {TABLE} alter column big set storage external; create publication {PUBLICATION} for table {TABLE}"
    )
    yield c
    c.execute(f"drop publication if exists {PUBLICATION}")


@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.slow  # five extract+merge cycles per plugin: 70-90 s each on a loaded 2-core machine
@pytest.mark.parametrize("plugin", [full_only("test_decoding", PLUGIN_REPEAT), "pgoutput"])
def test_keyless_full_table_is_a_multiset_across_batches(
    full_table: psycopg.Connection, slot_name: str, spark: Any, tmp_path: Path, plugin: str
) -> None:
    c = full_table
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    path = f"{delta_root}/public/{TABLE}"
    batches: list[str] = []
    checkpoint: Checkpoint | None = None

    def cycle() -> dict[str, Any]:
        nonlocal checkpoint
        manifest = extract_batch(c, slot_name, staging, plugin=plugin, publication=publication, checkpoint=checkpoint)
        summary = merge_batches(spark, [str(manifest.path)], delta_root)
        c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))
        result = compare_table(c, spark, delta_root, "public", TABLE)
        assert result.equal, result.describe()
        assert manifest.tables[0].key_source == "all columns"
        return summary["tables"][f"public.{TABLE}"]

    # Duplicates, NULLs anywhere (an all-NULL row too), NaN, a TOASTed value.
    c.execute(
        f"insert into {TABLE} values (1, 'x', null, null), (1, 'x', null, null), (1, 'x', null, null),"
        " (2, null, 1.5, null), (2, null, 1.5, null), (null, null, null, null), (null, null, null, null),"
        " (3, 't', 'NaN', repeat('z', 5000)), (3, 't', 'NaN', repeat('z', 5000))"
    )
    first = cycle()
    assert first["status"] == "merged" and first["inserted"] == 9

    # One copy each: a delete, updates (one leaves its TOAST value unchanged), an all-NULL row.
    c.execute(f"delete from {TABLE} where {one('a = 1')}")
    c.execute(f"update {TABLE} set b = 'y' where {one('a = 2')}")
    c.execute(f"update {TABLE} set a = 4 where {one('a is null')}")
    c.execute(f"update {TABLE} set b = 'toast kept' where {one('a = 3')}")
    c.execute(f"insert into {TABLE} values (1, 'x', null, null)")
    second = cycle()
    assert (second["inserted"], second["deleted"]) == (3, 3)  # the re-inserted (1, x) nets out
    assert c.execute(f"select count(*) from {TABLE} where a = 1").fetchall() == [(3,)]

    # One batch: a value inserted and changed within it, every copy of a value deleted, and a
    # prepared transaction still pending at the batch end.
    with c.transaction():
        c.execute(f"insert into {TABLE} values (5, 'five', 5, null), (5, 'five', 5, null)")
        c.execute(f"update {TABLE} set f = 6 where {one('a = 5')}")
        c.execute(f"delete from {TABLE} where a = 2")
    c.execute(f"begin; insert into {TABLE} values (7, 'prepared', null, null); prepare transaction 'ms_later'")
    cycle()

    c.execute("commit prepared 'ms_later'")
    c.execute(f"delete from {TABLE} where {one('a = 3')}")
    cycle()

    # A TRUNCATE within the batch: copies before it go, copies after it stay.
    with c.transaction():
        c.execute(f"insert into {TABLE} values (8, 'gone', null, null)")
        c.execute(f"truncate {TABLE}")
        c.execute(f"insert into {TABLE} values (9, 'after', null, null), (9, 'after', null, null)")
    c.execute(f"delete from {TABLE} where {one('a = 9')}")
    cycle()

    # Merging every batch again changes nothing.
    from delta.tables import DeltaTable

    version = DeltaTable.forPath(spark, path).history(1).collect()[0]["version"]
    summary = merge_batches(spark, batches, delta_root)
    assert summary["tables"][f"public.{TABLE}"]["status"] == "skipped"
    assert DeltaTable.forPath(spark, path).history(1).collect()[0]["version"] == version
    assert compare_table(c, spark, delta_root, "public", TABLE).equal

    if plugin != "test_decoding":
        return
    # Delta lost a copy behind the pipeline's back: deleting both source copies is refused by name.
    spark.sql(f"DELETE FROM delta.`{path}` WHERE a = 9")
    c.execute(f"insert into {TABLE} values (9, 'after', null, null)")
    c.execute(f"delete from {TABLE} where a = 9")
    manifest = extract_batch(c, slot_name, staging, plugin=plugin, checkpoint=checkpoint)
    before = DeltaTable.forPath(spark, path).history(1).collect()[0]["version"]
    with pytest.raises(MergeInputError, match=rf"table public\.{TABLE} .*diverged.*resnapshot"):
        merge_batches(spark, [str(manifest.path)], delta_root)
    assert DeltaTable.forPath(spark, path).history(1).collect()[0]["version"] == before


def _with_manifest_fields(batch: str, **fields: Any) -> str:
    """Set ``fields`` on every table entry of a synthetic batch's manifest (as a newer extract writes them)."""
    manifest = Path(batch) / "manifest.json"
    document = json.loads(manifest.read_text(encoding="utf-8"))
    for entry in document["tables"]:
        entry.update(fields)
    manifest.write_text(json.dumps(document, sort_keys=True), encoding="utf-8")
    return batch


@pytest.mark.spark
def test_changes_a_keyless_or_append_only_merge_cannot_apply_are_refused_before_writing(
    spark: Any, tmp_path: Path
) -> None:
    columns = [("a", "integer", pa.int32()), ("b", "text", pa.string())]
    # An UPDATE without an old row (the table was not REPLICA IDENTITY FULL when it was logged).
    keyless = TableChanges("public", "no_old", columns, key=("a", "b"))
    keyless.insert(100, a=1, b="x").update(200, a=1, b="y")
    batch = write_batch(tmp_path / "s", "slot", 90, 210, [keyless])
    _with_manifest_fields(batch, key_source="all columns", replica_identity="full")
    with pytest.raises(MergeInputError, match=r"table public\.no_old .*1 UPDATE\(s\)/DELETE\(s\) carry no old row"):
        merge_batches(spark, [batch], str(tmp_path / "d"))
    # A DELETE of an append_only table (the extract refuses it; the merge does not trust that).
    log = TableChanges("public", "log", columns, key=()).insert(300, a=1, b="x").delete(300, a=1, b="x")
    batch = write_batch(tmp_path / "s", "slot", 210, 310, [log])
    _with_manifest_fields(batch, mode="append_only")
    with pytest.raises(MergeInputError, match=r"table public\.log is loaded append_only, .*1 DELETE\(s\)"):
        merge_batches(spark, [batch], str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()
