"""A cycle over many small tables through both plugins (issue 39): N tables ``(id int primary key,
v text, n int)`` and three of other shapes (a composite key, a keyless REPLICA IDENTITY FULL table
with duplicate rows, a table whose TOASTed value an update leaves unchanged), loaded by the initial
load and merged; then one cycle whose changes touch every table (inserts only on some, updates,
deletes and key changes on others, a TRUNCATE on one), merged four tables at a time
(``MergeOptions(table_workers=4)``). Every table is merged and equal to PostgreSQL as a multiset:
every plain table read by delta-rs, the others and the first plain tables of each kind by Spark too;
the summary's counts are checked for one table of each kind."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import PLUGIN_REPEAT, full_only_test

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "mt_pub"
SEED_ROWS = 20
COMPOSITE, KEYLESS, TOASTED = "mt_composite", "mt_keyless", "mt_toast"
TRUNCATED = 1  # the plain table truncated (and filled again) in the cycle
BIG = 6000  # characters of the TOASTed value (stored external: out of line, uncompressed)
KINDS = ("inserts", "updates", "deletes", "key changes")

FEWER = full_only_test("the 200-table cycle runs the same changes over more tables")
VARIANTS = [
    pytest.param("pgoutput", 200, id="pgoutput-200"),
    pytest.param("test_decoding", 200, id="test_decoding-200", marks=full_only_test(PLUGIN_REPEAT)),
    pytest.param("pgoutput", 20, id="pgoutput-20", marks=FEWER),
    pytest.param("test_decoding", 20, id="test_decoding-20", marks=FEWER),
]


def plain(count: int) -> list[str]:
    return [f"mt_{i:03d}" for i in range(count)]


def kind(i: int) -> str:
    """What the cycle does to plain table ``i`` (other than the truncated one)."""
    return KINDS[i % len(KINDS)]


def create_tables(c: Any, count: int) -> None:
    for name in plain(count):
        c.execute(
            f"create table {name} (id int primary key, v text, n int);"
            f" insert into {name} select g, 'seed ' || g, g from generate_series(1, {SEED_ROWS}) g"
        )
    c.execute(
        f"create table {COMPOSITE} (k1 int, k2 text, v text, primary key (k1, k2));"
        f" insert into {COMPOSITE} select g % 5, 'k' || g, 'seed ' || g from generate_series(1, {SEED_ROWS}) g;"
        f" create table {KEYLESS} (a int, b text); alter table {KEYLESS} replica identity full;"
        f" insert into {KEYLESS} values (1, 'twin'), (1, 'twin'), (1, 'twin'), (2, null), (3, 'c'), (3, 'c');"
        f" create table {TOASTED} (id int primary key, big text, small int);"
        f" alter table {TOASTED} alter column big set storage external;"
        f" insert into {TOASTED} select g, repeat(chr(64 + g), {BIG}), g from generate_series(1, 4) g"
    )


def write_cycle(c: Any, count: int) -> None:
    """Changes touching every table, ten plain tables to a transaction."""
    names = plain(count)
    for first in range(0, count, 10):
        with c.transaction():
            for i in range(first, min(first + 10, count)):
                t = names[i]
                if i == TRUNCATED:
                    c.execute(f"insert into {t} values (100, 'before the truncate', 0)")
                    c.execute(f"truncate {t}")
                    c.execute(f"insert into {t} values (1, 'after the truncate', 1), (200, 'after', 2)")
                elif kind(i) == "inserts":
                    c.execute(f"insert into {t} select g, 'new ' || g, g from generate_series(101, 103) g")
                elif kind(i) == "updates":
                    c.execute(f"update {t} set v = 'changed', n = n * 10 where id <= 3")
                    c.execute(f"update {t} set n = null where id = 4")
                elif kind(i) == "deletes":
                    c.execute(f"delete from {t} where id in (2, 4)")
                else:  # a key moved, one updated, one deleted and a new row taking its key
                    c.execute(f"update {t} set id = 1000 + id, v = 'moved' where id = 1")
                    c.execute(f"update {t} set v = 'changed' where id = 2")
                    c.execute(f"delete from {t} where id = 3")
                    c.execute(f"insert into {t} values (3, 'reborn', -3)")
    with c.transaction():
        c.execute(f"update {COMPOSITE} set v = 'changed' where k1 = 1")
        c.execute(f"update {COMPOSITE} set k2 = k2 || '-moved' where k1 = 2")
        c.execute(f"delete from {COMPOSITE} where k1 = 3")
        c.execute(f"insert into {COMPOSITE} values (9, 'k9', 'new')")
    with c.transaction():
        # One of three identical rows updated, one of two deleted: a multiset, not a set.
        c.execute(f"update {KEYLESS} set b = 'one twin' where ctid = (select min(ctid) from {KEYLESS} where a = 1)")
        c.execute(f"delete from {KEYLESS} where ctid = (select min(ctid) from {KEYLESS} where a = 3)")
        c.execute(f"insert into {KEYLESS} values (2, null), (4, 'd')")
    with c.transaction():
        c.execute(f"update {TOASTED} set small = small * 100 where id in (1, 2)")  # big unchanged: not sent
        c.execute(f"update {TOASTED} set big = repeat('z', {BIG}) where id = 3")
        c.execute(f"delete from {TOASTED} where id = 4")


def counts(summary: dict[str, Any], table: str) -> tuple[int, int, int]:
    entry = summary["tables"][f"public.{table}"]
    return entry["inserted"], entry["updated"], entry["deleted"]


def delta_rows(root: str, table: str, columns: str) -> Counter[tuple[Any, ...]]:
    """The table's rows as delta-rs reads them, independently of Spark."""
    query = QueryBuilder().register("t", DeltaTable(f"{root}/public/{table}")).execute(f"select {columns} from t")
    return Counter(tuple(row.values()) for row in pa.table(query.read_all()).to_pylist())


@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("plugin", "count"), VARIANTS)
def test_a_cycle_over_many_tables_equals_postgres(pg_conn, pg_dsn, slot_name, spark, tmp_path: Path, plugin, count):
    c = pg_conn
    tables = [*plain(count), COMPOSITE, KEYLESS, TOASTED]
    drop = f"drop table if exists {', '.join(tables)}; drop publication if exists {PUBLICATION}"
    c.execute(drop)
    create_tables(c, count)
    extra: dict[str, str] = {}
    if plugin == "pgoutput":
        c.execute(f"create publication {PUBLICATION} for table {', '.join(tables)}")
        extra = {"publication": PUBLICATION}
    qualified = [("public", t) for t in tables]
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    options = MergeOptions(table_workers=4)
    two_phase = plugin == "test_decoding" or c.info.server_version >= 150000
    try:
        with create_slot_with_snapshot(pg_dsn, slot_name, plugin=plugin, two_phase=two_phase) as (lsn, name):
            loaded = stage_snapshot(pg_dsn, name, lsn, slot_name, staging, qualified, plugin=plugin, **extra)
        first = merge_batches(spark, [str(loaded.path)], root, options)
        assert {t: e["status"] for t, e in first["tables"].items()} == {f"public.{t}": "merged" for t in tables}
        assert counts(first, plain(count)[0]) == (SEED_ROWS, 0, 0)

        write_cycle(c, count)
        batch = extract_batch(
            c, slot_name, staging, plugin=plugin, checkpoint=Checkpoint.from_manifest(loaded), tables=qualified, **extra
        )
        assert {f"{e.schema}.{e.table}" for e in batch.tables} == {f"public.{t}" for t in tables}
        summary = merge_batches(spark, [str(batch.path)], root, options)
        assert {t: e["status"] for t, e in summary["tables"].items()} == {f"public.{t}": "merged" for t in tables}
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot_name, str(batch.end_lsn)))

        by_kind = {kind(i): plain(count)[i] for i in range(len(KINDS), 2 * len(KINDS))}
        assert counts(summary, by_kind["inserts"]) == (3, 0, 0)
        assert counts(summary, by_kind["updates"]) == (0, 4, 0)
        assert counts(summary, by_kind["deletes"]) == (0, 0, 2)
        # 1001 in and 1 out; 3 deleted and inserted again in one batch: its row replaced.
        assert counts(summary, by_kind["key changes"]) == (1, 2, 1)
        truncated = summary["tables"][f"public.{plain(count)[TRUNCATED]}"]
        assert truncated["truncated"] is True
        assert counts(summary, plain(count)[TRUNCATED]) == (1, 1, SEED_ROWS - 1), truncated

        # Through Spark: the tables of other shapes and the first plain tables of each kind.
        through_spark = [*plain(count)[: 2 * len(KINDS)], COMPOSITE, KEYLESS, TOASTED]
        unequal = [
            r.describe() for r in (compare_table(c, spark, root, "public", t) for t in through_spark) if not r.equal
        ]
        assert not unequal, unequal
        # Every plain table through delta-rs, the independent reader (milliseconds a table, where
        # Spark takes seconds): as multisets, duplicates counted.
        unequal = [
            t
            for t in plain(count)
            if delta_rows(root, t, "id, v, n") != Counter(c.execute(f"select id, v, n from {t}").fetchall())
        ]
        assert not unequal, unequal
        # delta-rs: the keyless table's duplicates and the TOASTed values kept by the update.
        assert delta_rows(root, KEYLESS, "a, b") == Counter(c.execute(f"select a, b from {KEYLESS}").fetchall())
        assert delta_rows(root, TOASTED, "id, big, small") == Counter(
            c.execute(f"select id, big, small from {TOASTED}").fetchall()
        )
        assert delta_rows(root, TOASTED, "id, length(big)")[(1, BIG)] == 1
    finally:
        c.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (slot_name,)
        )
        c.execute(drop)
