"""A table's ``type_map`` option, from PostgreSQL through staging into Delta: numeric kept as the
text PostgreSQL printed carries what a decimal cannot (NaN and Infinity, a NaN key beside others,
values past decimal(38,18)), through a snapshot and incremental batches of both plugins and both
writers, and the other tables keep their native types; a date or timestamp key ``infinity`` beside
``9999-12-31`` stays two Delta rows, quarantined or kept as text (issue 35)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from tests.capture.test_native import assert_same_batches
from tests.conftest import two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "tm_pub"
OPTIONS = {"public.tm_prices": {"type_map": {"numeric": "string", "timestamptz": "string"}}}
TEXT_OF = {
    "tm_prices": "select id::text, amount::text, at::text, tags::text[] from tm_prices",
    # Not in the option: numeric stays a decimal, read back as PostgreSQL's text of it.
    "tm_plain": "select id, amount::text from tm_plain",
}


@pytest.fixture()
def source(pg_conn, slot_name):
    ddl = (
        "create table tm_prices (id numeric primary key, amount numeric, at timestamptz, tags numeric[]);"
        " create table tm_plain (id int primary key, amount numeric(12,2))"
    )
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["tm_prices", "tm_plain"], ddl) as slot:
        pg_conn.execute("set timezone = 'UTC'")
        yield slot


def delta_rows(spark, root: str, table: str) -> list[tuple]:
    frame = spark.read.format("delta").load(f"{root}/public/{table}")
    if table == "tm_plain":
        return sorted((r["id"], None if r["amount"] is None else f"{r['amount']:.2f}") for r in frame.collect())
    return sorted(
        (r["id"], r["amount"], r["at"], None if r["tags"] is None else list(r["tags"])) for r in frame.collect()
    )


def source_rows(pg_conn, table: str) -> list[tuple]:
    return sorted(tuple(row) for row in pg_conn.execute(TEXT_OF[table]).fetchall())


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_numeric_kept_as_text_carries_nan_keys_infinities_and_huge_values(
    pg_conn, pg_dsn, source, spark, tmp_path, plugin
):
    slot = source if plugin == "test_decoding" else source + "_po"
    c = pg_conn
    c.execute(
        "insert into tm_prices values ('NaN', 'Infinity', 'infinity', '{NaN,1.50}'), (1.5, 1e40, '2024-01-02 03:04:05+00', null),"
        " (2, '-Infinity', '-infinity', '{}'), (3, 'NaN', null, '{\"-Infinity\"}')"
    )
    c.execute("insert into tm_plain values (1, 10.25), (2, null)")
    root = str(tmp_path / "delta")

    # The initial load's snapshot (bounded numeric would be staged as decimal128: not a kept one).
    snap = f"{slot}_snap"
    try:
        with create_slot_with_snapshot(pg_dsn, snap) as (lsn, name):
            initial = stage_snapshot(
                pg_dsn,
                name,
                lsn,
                snap,
                tmp_path / "snapshot",
                ["public.tm_prices", "public.tm_plain"],
                table_options=OPTIONS,
            )
    finally:
        c.execute("select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (snap,))
    staged = {t.table: t for t in initial.tables}
    assert staged["tm_prices"].type_map == OPTIONS["public.tm_prices"]["type_map"] and not staged["tm_plain"].type_map
    assert [col.arrow for col in staged["tm_prices"].columns] == ["string", "string", "string", "list<item: string>"]
    merge_batches(spark, [str(initial.path)], str(tmp_path / "snapshot-delta"))
    for table in TEXT_OF:
        assert delta_rows(spark, str(tmp_path / "snapshot-delta"), table) == source_rows(c, table), table

    # The slot's changes since before the first row: a NaN key updated and one deleted, a key beside it, huge and infinite values.
    c.execute("update tm_prices set amount = 12345678901234567890123456789012345678901234567890.5 where id = 'NaN'")
    c.execute("delete from tm_prices where id = 3")
    c.execute("insert into tm_prices values (3, 3, now(), '{3}'), ('-0.0', 0, null, null)")
    c.execute("update tm_prices set tags = '{Infinity,NaN}' where id = 2")
    c.execute("update tm_plain set amount = 7.5 where id = 2")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}

    def extract(root: Path, native: bool) -> BatchManifest:
        return extract_batch(c, slot, root, plugin=plugin, native=native, upto_lsn=upto, table_options=OPTIONS, **extra)

    batch = extract(tmp_path / "python", False)
    if load_native() is not None:
        assert_same_batches(batch, extract(tmp_path / "native", True))
    prices = next(t for t in batch.tables if t.table == "tm_prices")
    assert prices.type_map == OPTIONS["public.tm_prices"]["type_map"]
    merge_batches(spark, [str(batch.path)], root)
    for table in TEXT_OF:
        assert delta_rows(spark, root, table) == source_rows(c, table), table
    fields = spark.read.format("delta").load(f"{root}/public/tm_prices").schema.fields
    schema = {f.name: f.dataType.simpleString() for f in fields if not f.name.startswith("_pg_")}
    assert schema == {"id": "string", "amount": "string", "at": "string", "tags": "array<string>"}
    plain = spark.read.format("delta").load(f"{root}/public/tm_plain").schema["amount"].dataType.simpleString()
    assert plain == "decimal(12,2)"


def test_a_nan_key_is_refused_by_name_and_the_advice_followed_lands_it(pg_conn, source, spark, tmp_path):
    from airflow_provider_pgdecode.errors import MergeInputError

    c = pg_conn
    c.execute("insert into tm_prices values ('NaN', 1, null, null), (1, 2, null, null)")
    c.execute("delete from tm_prices where id = 'NaN'")
    c.execute("insert into tm_prices values ('NaN', 3, null, null)")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    first = extract_batch(c, source, staging, upto_lsn=upto, tables=["public.tm_prices"])
    with pytest.raises(MergeInputError) as refused:
        merge_batches(spark, [str(first.path)], root)
    message = str(refused.value)
    assert "table public.tm_prices: 3 change(s) have a numeric key ['id'] that is NaN or ±Infinity" in message
    assert "NULL key" not in message and "Nothing was written" in message
    advice = '{"public.tm_prices": {"type_map": {"numeric": "string"}}}'
    assert f"table_options {advice}" in message

    # The advice: the option, then the next extract of the same (unconfirmed) range replaces the batch.
    again = extract_batch(
        c, source, staging, upto_lsn=upto, tables=["public.tm_prices"], table_options=json.loads(advice)
    )
    assert again.path == first.path and again.tables[0].type_map == {"numeric": "string"}
    merge_batches(spark, [str(again.path)], root)
    assert (
        delta_rows(spark, root, "tm_prices")
        == source_rows(c, "tm_prices")
        == [("1", "2", None, None), ("NaN", "3", None, None)]
    )


@pytest.fixture()
def infinite_keys(pg_conn, slot_name):
    with two_plugin_source(
        pg_conn, slot_name, PUBLICATION, ["tm_days"], "create table tm_days (d date primary key, note text)"
    ) as slot:
        yield slot


def test_an_infinite_key_and_the_key_it_would_be_clamped_to_stay_two_delta_rows(
    pg_conn, infinite_keys, spark, tmp_path
):
    c = pg_conn
    c.execute(
        "insert into tm_days values ('infinity', 'inf'), ('9999-12-31', 'max'), ('-infinity', '-inf'), ('0001-01-01', 'min')"
    )
    c.execute("delete from tm_days where d = 'infinity'")  # PostgreSQL keeps 9999-12-31
    c.execute("update tm_days set note = 'max, later' where d = '9999-12-31'")
    upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    staging, root = tmp_path / "staging", str(tmp_path / "delta")

    # Refused at staging under the default on_bad_value (tests/capture/test_infinite_keys.py: the
    # wording, quarantine, timestamps): clamped, the two keys would become one Delta row.
    with pytest.raises(ValueConversionError, match="'infinity' in a key column"):
        extract_batch(c, infinite_keys, staging, upto_lsn=upto, tables=["public.tm_days"])

    # The way forward the reason names: the same range staged with type_map lands every key, distinct.
    options = {"public.tm_days": {"type_map": {"date": "string"}}}
    batch = extract_batch(c, infinite_keys, staging, upto_lsn=upto, tables=["public.tm_days"], table_options=options)
    merge_batches(spark, [str(batch.path)], root)
    delta = sorted((r["d"], r["note"]) for r in spark.read.format("delta").load(f"{root}/public/tm_days").collect())
    postgres = sorted(tuple(r) for r in c.execute("select d::text, note from tm_days").fetchall())
    assert delta == postgres == [("-infinity", "-inf"), ("0001-01-01", "min"), ("9999-12-31", "max, later")]
