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
from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot
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


class Cycles:
    """The extract, merge (through the session's Spark Connect server) and confirm tasks of one
    pipeline over ``TABLES``, run as a DAG run chains them."""

    def __init__(self, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any) -> None:
        for table in TABLES:
            pg_conn.execute(f"drop table if exists {table}; create table {table} (id int primary key, v text)")
        with PgDecodeHook() as hook:
            hook.ensure_slot(slot_name)
        self.conn, self.slot, self.make_context = pg_conn, slot_name, make_context
        self.staging, self.delta = tmp_path / "staging", tmp_path / "delta"
        # Only its own tables: other tests' tables share the database (and one has no key).
        self.extract = PgDecodeExtractOperator(
            task_id="extract",
            slot_name=slot_name,
            staging_root=str(self.staging),
            tables=[f"public.{t}" for t in TABLES],
        )
        self.merge = PgDecodeMergeOperator(task_id="merge", batch_paths="(set per run)", delta_root=str(self.delta))
        self.confirm = PgDecodeConfirmOperator(
            task_id="confirm", slot_name=slot_name, batch_path="(set per run)", retention_days=0, retention_batches=0
        )
        self.checkpoint: dict[str, Any] | None = None

    def __call__(self, run: int) -> tuple[dict[str, Any], dict[str, Any]]:
        workload(self.conn, run)
        batch = self.extract.execute(self.make_context(**({"confirm": self.checkpoint} if self.checkpoint else {})))
        self.merge.batch_paths = batch["path"]
        merged = self.merge.execute(self.make_context())
        json.dumps(merged)  # XCom
        self.confirm.batch_path = batch["path"]
        self.checkpoint = self.confirm.execute(self.make_context(merge=merged))
        assert confirmed(self.conn, self.slot) == Lsn.parse(batch["end_lsn"])  # the slot moves every run
        return batch, merged

    def assert_the_others_flow(self, batch: dict[str, Any], merged: dict[str, Any], parked: str) -> None:
        """``parked`` is parked; every other table took this run's changes once and equals its source."""
        tables = merged["summary"]["tables"]
        assert tables[f"public.{parked}"]["status"] == "parked"
        assert list(merged["parked"]) == [f"public.{parked}"]
        for table in (t for t in TABLES if t != parked):
            assert tables[f"public.{table}"]["status"] == "merged"
            assert tables[f"public.{table}"]["changes"] == batch["tables"][f"public.{table}"]
            assert tables[f"public.{table}"]["changes_already_applied"] == 0
            assert delta_rows(self.delta, table) == source_rows(self.conn, table)


@pytest.fixture
def cycle(
    source_conn: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    make_context: Any,
    spark_connect_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> Cycles:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connect_server.airflow_conn_json)
    return Cycles(pg_conn, slot_name, tmp_path, make_context)


def test_a_table_with_a_damaged_delta_log_is_parked_and_catches_up_exactly_once(
    cycle: Cycles, pg_conn: psycopg.Connection[Any], slot_name: str, make_context: Any
) -> None:
    staging, delta = cycle.staging, cycle.delta
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
        reason = merged["summary"]["tables"]["public.park_c"]["reason"]
        assert "is damaged" in reason and newest.name in reason
        cycle.assert_the_others_flow(batch, merged, "park_c")
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


def test_a_table_whose_changes_are_refused_is_parked_and_a_resnapshot_replaces_them(
    cycle: Cycles, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    """A refusal of one table's staged changes (here its key changed) parks that table only; the
    refusal's way forward (a rebuilt Delta table) works after the slot moved on: the table's
    Delta directory moved aside and the table resnapshotted, its refused batches are replaced."""
    cycle(1)
    pg_conn.execute("alter table park_c drop constraint park_c_pkey, add primary key (id, v)")  # no rewrite
    for run in (2, 3):
        batch, merged = cycle(run)
        reason = merged["summary"]["tables"]["public.park_c"]["reason"]
        assert "keyed on ['id'], the source now on ['id', 'v']" in reason, reason
        cycle.assert_the_others_flow(batch, merged, "park_c")
    assert read_parked(str(cycle.staging), slot_name)["public.park_c"].runs == 2

    # The refusal's way forward, now that its changes cannot be re-extracted: a rebuilt table.
    table_dir = cycle.delta / "public" / "park_c"
    table_dir.rename(table_dir.with_name("park_c.aside"))
    request = request_table_snapshot(str(cycle.staging), slot_name, ["public.park_c"], "resnapshot")
    batch, merged = cycle(4)
    chunks = json.loads((Path(batch["path"]) / "manifest.json").read_text())["snapshot_chunks"]
    assert [c["kind"] for c in chunks if c["request"] == request.id][0] == "truncate"  # one run copies it all
    tables = merged["summary"]["tables"]
    assert tables["public.park_c"]["status"] == "merged", tables["public.park_c"]
    assert merged["parked"] == {} and not (cycle.staging / slot_name / PARKED_FILE).exists()
    assert all(delta_rows(cycle.delta, t) == source_rows(pg_conn, t) for t in TABLES)
    assert DeltaTable(str(table_dir)).metadata().configuration["pgdecode.key"] == '["id", "v"]'
