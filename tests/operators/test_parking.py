"""A table whose Delta table cannot be read is parked: the others flow and the slot moves; once
fixed it catches up from its kept batches, exactly once (issue 35). Real PostgreSQL, the
extract, merge (through the session's Spark Connect server) and confirm operators as a DAG run
chains them, Delta read back by delta-rs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from airflow.sdk.exceptions import AirflowException
from deltalake import DeltaTable, QueryBuilder

from airflow_provider_pgdecode.batch.manifest import list_batches
from airflow_provider_pgdecode.batch.parking import PARKED_FILE, read_parked
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeExtractOperator,
    PgDecodeMergeOperator,
)
from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLES = ("park_a", "park_b", "park_c")


def source_rows(conn: psycopg.Connection[Any], table: str) -> list[tuple[int, str]]:
    return sorted(conn.execute(f"select id, v from {table}").fetchall())


def delta_rows(root: Path, table: str) -> list[tuple[int, str]]:
    query = QueryBuilder().register("t", DeltaTable(str(root / "public" / table))).execute("select id, v from t")
    return sorted((row["id"], row["v"]) for row in pa.table(query.read_all()).to_pylist())


def workload(conn: psycopg.Connection[Any], run: int) -> None:
    """Inserts, an update and a delete in every table: applied twice, the counts would show it."""
    for table in TABLES:
        conn.execute(f"insert into {table} select g, 'r{run}' from generate_series({run * 10}, {run * 10 + 3}) g")
        conn.execute(f"update {table} set v = v || '+u{run}' where id = {run * 10}")
        conn.execute(f"delete from {table} where id = {run * 10 + 1}")


def confirmed(conn: psycopg.Connection[Any], slot: str) -> Lsn:
    row = conn.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,))
    return Lsn.parse(row.fetchone()[0])


def test_a_table_with_a_damaged_delta_log_is_parked_and_catches_up_exactly_once(
    source_conn: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    make_context: Any,
    spark_connect_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connect_server.airflow_conn_json)
    for table in TABLES:
        pg_conn.execute(f"drop table if exists {table}; create table {table} (id int primary key, v text)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    staging, delta = tmp_path / "staging", tmp_path / "delta"
    # Only its own tables: other tests' tables share the database (and one has no key).
    extract = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(staging), tables=[f"public.{t}" for t in TABLES]
    )
    merge = PgDecodeMergeOperator(task_id="merge", batch_paths="(set per run)", delta_root=str(delta))
    confirm = PgDecodeConfirmOperator(
        task_id="confirm", slot_name=slot_name, batch_path="(set per run)", retention_days=0, retention_batches=0
    )
    checkpoint: dict[str, Any] | None = None

    def cycle(run: int) -> tuple[dict[str, Any], dict[str, Any]]:
        nonlocal checkpoint
        workload(pg_conn, run)
        batch = extract.execute(make_context(**({"confirm": checkpoint} if checkpoint else {})))
        merge.batch_paths = batch["path"]
        merged = merge.execute(make_context())
        json.dumps(merged)  # XCom
        confirm.batch_path = batch["path"]
        checkpoint = confirm.execute(make_context(merge=merged))
        assert confirmed(pg_conn, slot_name) == Lsn.parse(batch["end_lsn"])  # the slot moves every run
        return batch, merged

    cycle(1)
    assert all(delta_rows(delta, t) == source_rows(pg_conn, t) for t in TABLES)

    # Damage park_c's newest commit as a torn write would.
    log_dir = delta / "public" / "park_c" / "_delta_log"
    newest = max(log_dir.glob("*.json"))
    original = newest.read_bytes()
    newest.write_bytes(original[: len(original) // 2])

    parked_batches = []
    for run in (2, 3, 4):
        batch, merged = cycle(run)
        tables = merged["summary"]["tables"]
        assert tables["public.park_c"]["status"] == "parked"
        assert "is damaged" in tables["public.park_c"]["reason"] and newest.name in tables["public.park_c"]["reason"]
        assert list(merged["parked"]) == ["public.park_c"]
        for table in ("park_a", "park_b"):  # the others flow, each run's changes once
            assert tables[f"public.{table}"]["status"] == "merged"
            assert tables[f"public.{table}"]["changes"] == batch["tables"][f"public.{table}"]
            assert tables[f"public.{table}"]["changes_already_applied"] == 0
            assert delta_rows(delta, table) == source_rows(pg_conn, table)
        parked_batches.append(batch)
    parked = read_parked(str(staging), slot_name)
    assert list(parked) == ["public.park_c"] and parked["public.park_c"].runs == 3
    assert parked["public.park_c"].since_lsn == parked_batches[0]["start_lsn"]
    kept = set(list_batches(str(staging), slot_name))
    assert all(b["path"] in kept for b in parked_batches)  # retention (0 days, 0 batches) keeps them

    # The health check names it: fails while it is parked longer than allowed, passes with it listed.
    health = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name, staging_root=str(staging))
    with pytest.raises(AirflowException, match=r"public\.park_c parked through more than 0 merge run.*is damaged"):
        health.poke(make_context())
    health.max_parked_runs = 3
    assert list(health.poke(make_context()).xcom_value["parked_tables"]) == ["public.park_c"]

    newest.write_bytes(original)  # the cause fixed
    batch, merged = cycle(5)
    tables = merged["summary"]["tables"]
    assert merged["parked"] == {} and not (staging / slot_name / PARKED_FILE).exists()
    staged_c = sum(b["tables"]["public.park_c"] for b in [*parked_batches, batch])
    assert tables["public.park_c"]["status"] == "merged"
    assert tables["public.park_c"]["changes"] == staged_c  # runs 2 to 5, in one commit, once
    assert tables["public.park_c"]["changes_already_applied"] == 0
    for table in ("park_a", "park_b"):  # the batches given back are not theirs to apply again
        assert tables[f"public.{table}"]["changes"] == batch["tables"][f"public.{table}"]
        assert tables[f"public.{table}"]["changes_already_applied"] == 0
    assert all(delta_rows(delta, t) == source_rows(pg_conn, t) for t in TABLES)
    # Nothing holds the batches any more: retention removes what parking kept.
    assert not any(b["path"] in set(list_batches(str(staging), slot_name)) for b in parked_batches)
