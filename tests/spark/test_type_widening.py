"""A source column's type change, from PostgreSQL through staging into Delta: a widening (``int`` to
``bigint``, ``real`` to ``double``, more numeric digits, a longer ``varchar``) is applied with
Delta's type widening, also when the change falls inside a batch; a narrowing fails naming the
column and the way forward, and writes nothing; each way forward, followed, ends with Delta equal
to PostgreSQL."""

from __future__ import annotations

import logging
import shutil

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.table_snapshot import (
    read_snapshot_state,
    request_table_snapshot,
    write_snapshot_states,
)
from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.spark.merge_job import merge_batches, read_delta_state
from pgdecode_testing.compare import compare_table
from tests.conftest import PLUGIN_REPEAT, full_only, two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "tw_pub"


@pytest.fixture
def source(pg_conn: psycopg.Connection, slot_name: str):
    ddl = "create table tw_items (id int primary key, qty int, ratio real, price numeric(8,2), code varchar(5))"
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["tw_items"], ddl) as slot:
        yield slot


@pytest.mark.parametrize("plugin", ["test_decoding", full_only("pgoutput", PLUGIN_REPEAT)])
def test_a_widened_column_flows_and_a_narrowed_one_is_refused(pg_conn, source, spark, tmp_path, plugin) -> None:
    c = pg_conn
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    delta_root = str(tmp_path / "delta")
    path = f"{delta_root}/public/tw_items"

    def extract(name: str, after=None):
        checkpoint = Checkpoint.from_manifest(after) if after is not None else None
        return extract_batch(c, slot, tmp_path / name, plugin=plugin, checkpoint=checkpoint, **extra)

    c.execute("insert into tw_items select g, g, g / 3.0, g * 1.25, 'c' || g from generate_series(1, 20) g")
    first = extract("b1")
    merge_batches(spark, [str(first.path)], delta_root)
    assert _delta_types(spark, path) == {
        "id": "int",
        "qty": "int",
        "ratio": "float",
        "price": "decimal(8,2)",
        "code": "string",
    }

    # The widening falls inside the second batch: rows staged before it, rows after.
    c.execute("update tw_items set qty = qty + 1 where id <= 5")
    c.execute(
        "alter table tw_items alter column qty type bigint, alter column ratio type double precision,"
        " alter column price type numeric(14,4), alter column code type varchar(40)"
    )
    c.execute("insert into tw_items values (21, 9000000000, 1e300, 1234567890.1234, repeat('x', 40))")
    c.execute("update tw_items set qty = 5000000000, price = 0.0001 where id = 3")
    second = extract("b2", first)
    summary = merge_batches(spark, [str(second.path)], delta_root)
    table = summary["tables"]["public.tw_items"]
    assert table["status"] == "merged"
    assert table["columns_widened"] == {
        "qty": "int -> bigint",
        "ratio": "float -> double",
        "price": "decimal(8,2) -> decimal(14,4)",
    }
    assert _delta_types(spark, path) == {
        "id": "int",
        "qty": "bigint",
        "ratio": "double",
        "price": "decimal(14,4)",
        "code": "string",
    }
    result = compare_table(c, spark, delta_root, "public", "tw_items")
    assert result.equal, result.describe()

    # Narrowing back (the values fit, so PostgreSQL allows it) is refused before anything is written.
    c.execute("delete from tw_items where id = 21")
    c.execute("update tw_items set qty = 7 where id = 3")
    c.execute("alter table tw_items alter column qty type integer")
    c.execute("insert into tw_items values (22, 22, 1, 1, 'n')")
    third = extract("b3", second)
    before = read_delta_state(spark, path, f"pgdecode:{slot}")
    with pytest.raises(MergeInputError) as refused:
        merge_batches(spark, [str(third.path)], delta_root)
    message = str(refused.value)
    assert "table public.tw_items column 'qty' changed type from bigint" in message
    assert "'integer'" in message and "narrowing or incompatible" in message
    assert "resnapshot public.tw_items (pgdecode_backfill mode=resnapshot)" in message and path in message
    after = read_delta_state(spark, path, f"pgdecode:{slot}")
    assert (after.version, after.watermark) == (before.version, before.watermark)
    assert _delta_types(spark, path)["qty"] == "bigint"

    # The refusal's ways forward, followed. Changing the column back helps here, as integer widens
    # to bigint: the refused range is extracted again, its rows staged under integer merged as they are.
    c.execute("alter table tw_items alter column qty type bigint")
    c.execute("insert into tw_items values (23, 6000000000, 1, 1, 'b')")
    fourth = extract("b4", second)
    assert merge_batches(spark, [str(fourth.path)], delta_root)["tables"]["public.tw_items"]["status"] == "merged"
    assert _delta_types(spark, path)["qty"] == "bigint"
    result = compare_table(c, spark, delta_root, "public", "tw_items")
    assert result.equal, result.describe()

    # Text to integer widens to nothing Delta holds: the other way, the Delta table moved aside and
    # the table resnapshotted, re-creates it with the new type, equal to PostgreSQL.
    c.execute("alter table tw_items alter column code type integer using length(code)")
    c.execute("update tw_items set code = 99 where id = 1")
    with pytest.raises(MergeInputError, match=r"column 'code' changed type from string .*move the Delta table"):
        merge_batches(spark, [str(extract("b5", fourth).path)], delta_root)
    shutil.move(path, str(tmp_path / "tw_items-aside"))
    staging = tmp_path / "b6"
    request = request_table_snapshot(staging, slot, ["public.tw_items"], "resnapshot")
    checkpoint, state = Checkpoint.from_manifest(fourth), None
    for _ in range(5):
        batch = extract_batch(c, slot, staging, plugin=plugin, checkpoint=checkpoint, **extra)
        merge_batches(spark, [str(batch.path)], delta_root)
        checkpoint = Checkpoint.from_manifest(batch)
        write_snapshot_states(staging, slot, checkpoint.snapshots)
        state = read_snapshot_state(staging, slot, request.id)
        if state is not None and state["done"]:
            break
    assert state is not None and state["done"] and not state["error"], state
    assert _delta_types(spark, path)["code"] == "int"
    result = compare_table(c, spark, delta_root, "public", "tw_items")
    assert result.equal, result.describe()


def _delta_types(spark, path: str) -> dict[str, str]:
    schema = spark.read.format("delta").load(path).schema
    return {f.name: f.dataType.simpleString() for f in schema.fields if not f.name.startswith("_pg_")}


@pytest.fixture
def text_source(pg_conn: psycopg.Connection, slot_name: str):
    with two_plugin_source(
        pg_conn, slot_name, "tb_pub", ["tb_items"], "create table tb_items (id int primary key, v text, d text)"
    ) as slot:
        yield slot


@pytest.mark.parametrize("plugin", ["test_decoding", full_only("pgoutput", PLUGIN_REPEAT)])
def test_columns_changed_from_text_and_back_flow_again(pg_conn, text_source, spark, tmp_path, plugin, caplog) -> None:
    """text -> integer and text -> date are refused (Delta holds strings); changed back to text,
    the rows staged while v was an integer are merged as their text (PostgreSQL converted its own
    rows with the same cast), d's dates as Spark prints them, with a warning, where both used to be
    refused on every run ('staged as int, but catalog type 'text' is staged as string'). The
    rewrite's resnapshot runs alongside; Delta ends equal."""
    c = pg_conn
    slot = text_source if plugin == "test_decoding" else text_source + "_po"
    extra = {"publication": "tb_pub"} if plugin == "pgoutput" else {}
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    checkpoint: Checkpoint | None = None

    def cycle() -> dict:
        nonlocal checkpoint
        batch = extract_batch(c, slot, staging, plugin=plugin, checkpoint=checkpoint, **extra)
        summary = merge_batches(spark, [str(batch.path)], root)
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batch.end_lsn)))
        checkpoint = Checkpoint.from_manifest(batch)
        write_snapshot_states(staging, slot, checkpoint.snapshots)  # as the confirm task does
        return summary

    c.execute("insert into tb_items select g, g::text, '2024-01-0' || g from generate_series(1, 5) g")
    cycle()
    c.execute(
        "alter table tb_items alter column v type integer using v::integer, alter column d type date using d::date"
    )
    c.execute("insert into tb_items values (6, 6, '2024-02-06')")
    with pytest.raises(MergeInputError, match=r"column 'v' changed type from string .* to 'integer'"):
        cycle()
    c.execute("alter table tb_items alter column v type text, alter column d type text")
    c.execute("insert into tb_items values (7, 'seven', 'a week')")
    with caplog.at_level(logging.WARNING, logger="airflow_provider_pgdecode.spark.merge"):
        assert cycle()["tables"]["public.tb_items"]["status"] == "merged"
    warned = [r.getMessage() for r in caplog.records if "before the column became text" in r.getMessage()]
    assert len(warned) == 1 and "column d: 1 part(s) staged as date" in warned[0], warned
    for _ in range(3):  # the resnapshot request the rewrites filed, carried out
        cycle()
    result = compare_table(c, spark, root, "public", "tb_items")
    assert result.equal, result.describe()
    assert _delta_types(spark, f"{root}/public/tb_items")["v"] == "string"
