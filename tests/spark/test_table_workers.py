"""Tables merged side by side (``MergeOptions.table_workers``, issue 39): each table in a session of
its own of one Spark application, through a classic application and a Spark Connect server. Delta
equal to PostgreSQL, each table's commit carrying its own transaction id (a setting of the session:
shared, two tables written at once would mix them up), a second run of the same batch applied
nowhere, and a refused table parked alone."""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark.delta_state import app_id
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from airflow_provider_pgdecode.spark.table_workers import run_sharded, table_sessions
from pgdecode_testing.compare import compare_table
from tests.spark.read_only import immutable_directory

TABLES = [f"tw_{i}" for i in range(5)]


def last_txn(root: str, table: str) -> dict | None:
    """The transaction id of the newest commit of ``public.<table>``'s Delta log."""
    log = sorted((Path(root) / "public" / table / "_delta_log").glob("*.json"))[-1]
    actions = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    txn = next((a["txn"] for a in actions if "txn" in a), None)
    return {"appId": txn["appId"], "version": txn["version"]} if txn else None


@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.parametrize("session_kind", ["classic", "connect"])
def test_tables_merged_side_by_side(request, pg_conn, slot_name, tmp_path, caplog, session_kind) -> None:
    spark = request.getfixturevalue("spark" if session_kind == "classic" else "connect")
    c = pg_conn
    c.execute("; ".join(f"drop table if exists {t}" for t in TABLES))
    for t in TABLES:
        c.execute(f"create table {t} (id int primary key, v text)")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    options = MergeOptions(table_workers=3)
    refused = TABLES[1]  # its log takes no commit in the second round

    def equal_and_committed_by(batch, tables: list[str]) -> None:
        for t in tables:
            result = compare_table(c, spark, root, "public", t)
            assert result.equal, result.describe()
            # Each commit holds the batch's own transaction id, whatever the others did meanwhile.
            assert last_txn(root, t) == {"appId": app_id(slot_name), "version": int(Lsn.parse(batch.end_lsn))}

    checkpoint = None
    try:
        for round_ in range(2):
            for n, t in enumerate(TABLES):
                if round_ == 0:
                    c.execute(f"insert into {t} select g, 'v' || g from generate_series(1, {20 + n}) g")
                else:
                    c.execute(f"update {t} set v = 'changed' where id % 3 = 0; delete from {t} where id % 5 = 0")
                    c.execute(f"insert into {t} values (100, 'new')")
            batch = extract_batch(c, slot_name, staging, checkpoint=checkpoint, tables=[f"public.{t}" for t in TABLES])
            caplog.clear()  # each round's merge must say it again
            with (
                caplog.at_level(logging.INFO, logger="airflow_provider_pgdecode.spark.table_workers"),
                immutable_directory(Path(root) / "public" / refused / "_delta_log") if round_ else nullcontext(),
            ):
                summary = merge_batches(spark, [str(batch.path)], root, options)
            assert "Merging 5 table(s) with 3 sessions side by side" in caplog.text
            statuses = {name: t["status"] for name, t in summary["tables"].items()}
            if round_:  # the refused table alone parked, the others merged beside it
                assert statuses.pop(f"public.{refused}") == "parked"
                assert summary["parked"] == [f"public.{refused}"]
            assert statuses == {f"public.{t}": "merged" for t in TABLES if round_ == 0 or t != refused}
            equal_and_committed_by(batch, [t for t in TABLES if round_ == 0 or t != refused])
            c.execute("select pg_replication_slot_advance(%s, %s)", (slot_name, batch.end_lsn))
            checkpoint = Checkpoint.from_manifest(batch)
        # Writable again: the same batch merges the parked table, and only it.
        again = merge_batches(spark, [str(batch.path)], root, options)
        assert {name: t["status"] for name, t in again["tables"].items()} == {
            f"public.{t}": "merged" if t == refused else "skipped" for t in TABLES
        }
        equal_and_committed_by(batch, TABLES)
        again = merge_batches(spark, [str(batch.path)], root, options)
        assert {t["status"] for t in again["tables"].values()} == {"skipped"}
    finally:
        c.execute("select pg_drop_replication_slot(%s)", (slot_name,))
        c.execute("; ".join(f"drop table if exists {t}" for t in TABLES))


def _slow_job(session, tasks: int, seconds: float) -> None:
    """A Spark job of ``tasks`` tasks, each ``seconds`` long (the JVM's sleep: no Python worker)."""
    millis = int(seconds * 1000)
    session.sql(
        f"SELECT reflect('java.lang.Thread', 'sleep', CAST({millis} AS BIGINT)) FROM range(0, {tasks}, 1, {tasks})"
    ).collect()


@pytest.mark.spark
@pytest.mark.parametrize("session_kind", ["classic", "connect"])
def test_the_workers_jobs_share_the_executors_fairly(request, session_kind) -> None:
    """A worker's job of many tasks does not hold back a worker's job submitted after it: on two
    cores, eight tasks of a second each, then one task a second later. One after another (FIFO),
    the small job's task would start once all eight had started (4 s in) and end after them."""
    spark = request.getfixturevalue("spark" if session_kind == "classic" else "connect")
    ended: dict[str, float] = {}

    def work(session, job: tuple[str, int, float]) -> None:
        name, tasks, delay = job
        time.sleep(delay)
        _slow_job(session, tasks, 1.0)
        ended[name] = time.monotonic()

    with table_sessions(spark, 2, 2) as sessions:
        jobs = [("many tasks", 8, 0.0), ("one task", 1, 1.0)]
        run_sharded(jobs, lambda job: sessions[jobs.index(job)], work)
    assert ended["one task"] < ended["many tasks"]


def test_run_sharded_runs_each_session_in_its_own_thread_and_raises_the_earliest_error() -> None:
    first, second = object(), object()
    ran: list[tuple[int, str]] = []

    def work(session: object, item: int) -> int:
        ran.append((item, threading.current_thread().name))
        if item in (3, 4):
            raise ValueError(f"item {item}")
        return item * 10

    session_of = {0: first, 1: second, 2: first, 3: second, 4: first, 5: second}.__getitem__
    assert run_sharded([0, 1, 2], session_of, work) == [0, 10, 20]
    assert len({name for _, name in ran}) == 2  # two sessions, two threads
    ran.clear()
    with pytest.raises(ValueError, match="item 3"):
        run_sharded([0, 1, 2, 3, 4, 5], session_of, work)
    # Each session stops at its own first error; the other goes on until its own.
    assert sorted(item for item, _ in ran) == [0, 1, 2, 3, 4]
    # One session: in the caller's thread, one item after another.
    ran.clear()
    assert run_sharded([0, 2], session_of, work) == [0, 20]
    assert {name for _, name in ran} == {threading.current_thread().name}
