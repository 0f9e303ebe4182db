"""Server faults in the middle of an extract: the backend reading the slot terminated
(``pg_terminate_backend``), and PostgreSQL restarted (``pg_ctl restart -m fast``).

The extract fails with an error Airflow retries (not a deterministic pgdecode error), nothing
is staged or confirmed, and the next cycle catches Delta up with the source.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import SlotConnectionLostError, is_deterministic
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from tests.faults.conftest import slot_position

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

BACKLOG_ROWS = 120_000  # enough for the peek to run a while: the fault lands as soon as it holds the slot


def cycle(dsn: str, slot: str, staging: Path, delta_root: str, spark: Any, native: bool) -> BatchManifest:
    """Extract, merge, confirm: one incremental cycle without Airflow."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        manifest = extract_batch(conn, slot, staging, native=native)
    if manifest.tables:
        merge_batches(spark, [str(manifest.path)], delta_root)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, manifest.end_lsn))
    return manifest


def peeking_backend(dsn: str, slot: str, timeout: float = 60) -> int:
    """The pid of the backend running the slot's peek, once it runs."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            # The backend decoding the slot holds it (active_pid) while the peek runs.
            row = conn.execute(
                "select active_pid from pg_replication_slots where slot_name = %s and active_pid is not null", (slot,)
            ).fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.01)
    raise AssertionError(f"no backend peeked slot {slot} within {timeout}s")


def extract_under_fault(
    dsn: str, slot: str, staging: Path, native: bool, fault: Callable[[int], None]
) -> BaseException | None:
    """Run an extract in a thread, apply ``fault(pid of the peeking backend)``, return its error."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                extract_batch(conn, slot, staging, native=native, chunk_rows=2000)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        fault(peeking_backend(dsn, slot))
    finally:
        thread.join(timeout=300)
    assert outcome, "the extract did not end"
    return outcome[0]


@pytest.fixture
def source(pg_dsn: str, slot_name: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("drop table if exists sf_items; create table sf_items (id int primary key, label text)")
        conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
        conn.execute("insert into sf_items select g, 'first' from generate_series(1, 100) g")
    yield {"staging": tmp_path / "staging", "delta": str(tmp_path / "delta")}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("drop table sf_items")


def backlog(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "insert into sf_items select g, md5(g::text) from generate_series(1000, 999 + %s) g", (BACKLOG_ROWS,)
        )
        conn.execute("update sf_items set label = 'second' where id <= 50")
        conn.execute("delete from sf_items where id between 51 and 60")


def assert_nothing_moved(
    dsn: str, slot: str, staging: Path, merged: BatchManifest, error: BaseException | None
) -> None:
    assert error is not None, "the fault came too late: the extract finished first"
    # Retrying helps: Airflow's retries apply (fail_fast lets it through), and the message says what happened.
    assert not is_deterministic(error), repr(error)
    assert isinstance(error, (SlotConnectionLostError, psycopg.OperationalError)), repr(error)
    assert list_batches(staging, slot) == [merged.path]  # nothing new staged
    assert [p.name for p in (staging / slot).iterdir()] == [Path(merged.path).name]  # no temporary left
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert slot_position(conn, slot) == merged.end_lsn  # nothing confirmed past what was merged


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_backend_terminated_mid_peek(pg_dsn, slot_name, source, spark, native) -> None:
    merged = cycle(pg_dsn, slot_name, source["staging"], source["delta"], spark, native)
    backlog(pg_dsn)

    def terminate(pid: int) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert conn.execute("select pg_terminate_backend(%s)", (pid,)).fetchone()[0]

    error = extract_under_fault(pg_dsn, slot_name, source["staging"], native, terminate)
    assert_nothing_moved(pg_dsn, slot_name, source["staging"], merged, error)
    assert isinstance(error, SlotConnectionLostError), repr(error)
    message = str(error)
    assert slot_name in message and "terminating connection" in message, message  # what, and the cause
    assert "connection to the server was lost" in message and "retried" in message, message

    cycle(pg_dsn, slot_name, source["staging"], source["delta"], spark, native)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        result = compare_table(conn, spark, source["delta"], "public", "sf_items")
    assert result.equal, result.describe()


def test_postgres_restarted_mid_extract(pg_cluster: ThrowawayCluster, pg_dsn, slot_name, source, spark) -> None:
    merged = cycle(pg_dsn, slot_name, source["staging"], source["delta"], spark, True)
    backlog(pg_dsn)

    error = extract_under_fault(pg_dsn, slot_name, source["staging"], True, lambda pid: pg_cluster.restart("fast"))
    assert_nothing_moved(pg_dsn, slot_name, source["staging"], merged, error)

    cycle(pg_dsn, slot_name, source["staging"], source["delta"], spark, True)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        result = compare_table(conn, spark, source["delta"], "public", "sf_items")
    assert result.equal, result.describe()
