"""The merge through a warm Spark Connect server: one real server (the package's own server module,
started once for the test session in a subprocess: tests/conftest.py), real PostgreSQL, real Delta."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import deltalake
import psycopg
import pyarrow as pa
import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.spark import merge_job
from airflow_provider_pgdecode.spark.connect_server import READY_PREFIX
from airflow_provider_pgdecode.spark.merge_job import (
    TXN_APP_ID_CONF,
    TXN_VERSION_CONF,
    MergeOptions,
    merge_batches,
    summary_lines,
    transaction_id,
)
from airflow_provider_pgdecode.spark.session import CONNECT_MODE_ENV, build_connect_session
from pgdecode_testing.compare import compare_table
from pgdecode_testing.connect_server import LocalConnectServer
from tests.conftest import REPO
from tests.spark.staged import Model, TableChanges, write_batch
from tests.spark.test_postgres_oracle import TABLES, round_one, round_two, source  # noqa: F401 - the fixture

pytestmark = [pytest.mark.spark]

COLUMNS = [("id", "integer", pa.int32()), ("name", "text", pa.string())]
LOG4J_INFO = " INFO "  # log4j's pattern (spark/log4j2.properties): "yy/MM/dd HH:mm:ss LEVEL logger: ..."


def _spark_info_lines(lines: list[str]) -> list[str]:
    """Lines Spark's log4j logged at INFO (``26/11/24 05:30:00 INFO SparkContext: ...``)."""
    return [line for line in lines if len(line) > 18 and line[2] == "/" and line[17:23] == LOG4J_INFO]


@pytest.fixture
def connect_server(spark_connect_server: LocalConnectServer) -> LocalConnectServer:
    """The session's Spark Connect server (tests/conftest.py)."""
    return spark_connect_server


@pytest.fixture
def connect(connect_server: LocalConnectServer) -> Iterator[Any]:
    if not connect_server.running():
        pytest.skip("the module's Spark Connect server was stopped")
    session = build_connect_session(connect_server.url)
    yield session
    session.stop()


class RecordingLog:
    """Stands in for an operator's task logger: keeps what it was told, formatted."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _record(self, message: str, *args: Any, **_: Any) -> None:
        self.lines.append(message % args if args else message)

    info = warning = error = debug = exception = _record


def _recording(monkeypatch: pytest.MonkeyPatch) -> RecordingLog:
    log = RecordingLog()
    monkeypatch.setattr(PgDecodeMergeOperator, "log", property(lambda self: log))
    return log


def _txn_versions(table_path: Path) -> list[tuple[str, int]]:
    """Every (app id, version) transaction id the table's Delta log holds, commit by commit."""
    found = []
    for commit in sorted((table_path / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                found.append((action["txn"]["appId"], int(action["txn"]["version"])))
    return found


def test_the_server_is_ready_with_delta_and_logs_no_info(connect_server: LocalConnectServer, connect: Any) -> None:
    assert f"{READY_PREFIX}{connect_server.url}" in connect_server.output
    # Warmed up before the ready line, its scratch table removed.
    ready_at = connect_server.output.index(f"{READY_PREFIX}{connect_server.url}")
    assert any("warmed up with 3 small MERGEs" in line for line in connect_server.output[:ready_at]), (
        connect_server.output[-20:]
    )
    assert not list(Path(tempfile.gettempdir()).glob("pgdecode-warm-up-*"))
    # pyspark's process-wide Connect switch is off again: a classic session can still start here.
    assert CONNECT_MODE_ENV not in os.environ
    assert "io.delta.sql.DeltaSparkSessionExtension" in connect.conf.get("spark.sql.extensions")
    assert connect.sql("select 1 + 1 as two").first()["two"] == 2
    assert not _spark_info_lines(connect_server.output), _spark_info_lines(connect_server.output)[:5]


def test_oracle_workload_through_the_connect_server_equals_the_source(
    pg_conn: psycopg.Connection[Any],
    source: str,  # noqa: F811 - the oracle's tables and slots
    connect_server: LocalConnectServer,
    connect: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the merge operator with a spark_connect connection: a prepared transaction across
    runs, TRUNCATE, unchanged TOAST and a key change (the oracle's workload), then a replay."""
    conn = json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_server.port})
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CONNECT_TEST", conn)
    log = _recording(monkeypatch)
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    batches: list[str] = []
    checkpoint = None

    def cycle() -> dict[str, Any]:
        nonlocal checkpoint
        from airflow_provider_pgdecode.batch.checkpoint import Checkpoint

        manifest = extract_batch(pg_conn, source, staging, checkpoint=checkpoint)
        operator = PgDecodeMergeOperator(
            task_id="merge", batch_paths=str(manifest.path), delta_root=delta_root, conn_id="spark_connect_test"
        )
        result = operator.execute({})
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (source, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))
        return result

    round_one(pg_conn)
    first = cycle()
    assert [p["gid"] for p in checkpoint.prepared_pending] == ["or_later", "or_never"]  # type: ignore[union-attr]
    assert first["summary"]["tables"]["public.or_orders"]["status"] == "merged"
    orders = compare_table(pg_conn, connect, delta_root, "public", "or_orders")
    assert orders.equal, orders.describe()
    # One summary line per table and the total, in the task log.
    for table in TABLES:
        assert any(line.startswith(f"table public.{table}: merged, ") for line in log.lines), log.lines
    assert any(line.startswith("merge total: 3 of 3 table(s) merged") for line in log.lines), log.lines

    round_two(pg_conn)
    cycle()
    for table in TABLES:
        result = compare_table(pg_conn, connect, delta_root, "public", table)
        assert result.equal, result.describe()
        assert result.source_rows > 0

    # Replaying every batch through the server changes nothing, not even Delta's versions.
    versions = {t: len(list((Path(delta_root) / "public" / t / "_delta_log").glob("*.json"))) for t in TABLES}
    summary = merge_batches(connect, batches, delta_root, MergeOptions())
    assert all(entry["status"] == "skipped" for entry in summary["tables"].values()), summary
    assert {t: len(list((Path(delta_root) / "public" / t / "_delta_log").glob("*.json"))) for t in TABLES} == versions


_CHILD = """
import json, sys
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.spark.session import CONNECT_MODE_ENV, build_connect_session
url, root, batches = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
merge_batches(build_connect_session(url), batches, root)
print("merged", flush=True)
"""


def _batch_of_tables(root: Path, slot: str, start: int, end: int, count: int) -> tuple[str, list[TableChanges]]:
    tables = []
    for index in range(count):
        changes = TableChanges("public", f"t{index}", COLUMNS)
        for i in range(1, 21):
            changes.insert(start + i, id=i, name=f"{slot} row {i} of t{index}")
        changes.update(end, id=1, name="updated").delete(end, id=2)
        tables.append(changes)
    return write_batch(root, slot, start, end, tables), tables


def test_a_merge_killed_midway_and_run_again_is_applied_once(
    connect_server: LocalConnectServer, connect: Any, tmp_path: Path
) -> None:
    """The client is killed (SIGKILL) once the first table's Delta commit exists and before the
    others': the same batch merged again through the same server finishes the rest, and every
    table holds the batch exactly once (one transaction id of the batch, the expected rows)."""
    slot = "pgdecode_connect_kill"
    batch, tables = _batch_of_tables(tmp_path / "staging", slot, 100, 400, 4)
    root = tmp_path / "delta"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, connect_server.url, str(root), json.dumps([batch])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    logs = [root / "public" / t.table / "_delta_log" for t in tables]

    def committed() -> list[bool]:
        # Version 0 creates a table; the batch's commit is the one carrying its transaction id.
        return [bool(_txn_versions(log.parent)) if log.is_dir() else False for log in logs]

    try:
        while child.poll() is None and not any(committed()):
            time.sleep(0.01)
        child.kill()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    at_kill = committed()
    assert child.returncode == -signal.SIGKILL, child.communicate()
    assert any(at_kill) and not all(at_kill), f"not killed mid-way: tables committed {at_kill}"

    summary = merge_batches(connect, [batch], str(root))
    statuses = {name: entry["status"] for name, entry in summary["tables"].items()}
    for table, done in zip(tables, at_kill, strict=True):
        assert statuses[f"public.{table.table}"] == ("skipped" if done else "merged"), statuses
    expected = Model().apply(tables[0]).state(["id", "name"])
    for table in tables:
        path = root / "public" / table.table
        assert _txn_versions(path) == [(f"pgdecode:{slot}", 400)]  # the batch, once
        rows = connect.read.format("delta").load(str(path)).orderBy("id").select("id", "name").collect()
        want = [dict(r, name=r["name"].replace("t0", table.table)) for r in expected]
        assert [r.asDict() for r in rows] == want


def test_two_slots_merging_at_once_on_one_server_do_not_share_settings(
    connect_server: LocalConnectServer, tmp_path: Path
) -> None:
    """Each merge is a session of its own on the server: a setting or transaction id set in one is
    not seen by the other, and two slots' merges run at the same time each record only their own."""
    first, second = build_connect_session(connect_server.url), build_connect_session(connect_server.url)
    try:
        with transaction_id(first, "slot_a", 123):
            first.conf.set("spark.pgdecode.probe", "a")
            assert first.conf.get(TXN_APP_ID_CONF) == "pgdecode:slot_a"
            assert second.conf.get(TXN_APP_ID_CONF, None) is None
            assert second.conf.get(TXN_VERSION_CONF, None) is None
            assert second.conf.get("spark.pgdecode.probe", None) is None
        assert first.conf.get(TXN_APP_ID_CONF, None) is None  # unset after its one write

        slots = {"pgdecode_connect_a": first, "pgdecode_connect_b": second}
        batches = {
            slot: [
                _batch_of_tables(tmp_path / "staging", slot, 100, 400, 2)[0],
                _batch_of_tables(tmp_path / "staging", slot, 400, 900, 2)[0],
            ]
            for slot in slots
        }
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(slots))

        def run(slot: str) -> None:
            try:
                barrier.wait(timeout=60)
                for batch in batches[slot]:
                    merge_batches(slots[slot], [batch], str(tmp_path / slot))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(slot,)) for slot in slots]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not errors, errors
        # Overlapping merges leave pyspark's process-wide Connect switch as it was before them.
        assert CONNECT_MODE_ENV not in os.environ
        for slot in slots:
            for table in ("t0", "t1"):
                assert _txn_versions(tmp_path / slot / "public" / table) == [
                    (f"pgdecode:{slot}", 400),
                    (f"pgdecode:{slot}", 900),
                ]
            state = merge_job.read_delta_state(first, str(tmp_path / slot / "public" / "t0"), f"pgdecode:{slot}")
            assert state.watermark == 900
            other = next(s for s in slots if s != slot)
            assert (
                merge_job.read_delta_state(first, str(tmp_path / slot / "public" / "t0"), f"pgdecode:{other}").watermark
                is None
            )
    finally:
        first.stop()
        second.stop()


def test_the_delta_log_reader_follows_checkpoints(connect: Any, tmp_path: Path) -> None:
    """The watermark, version, schema and properties read from the log itself, through checkpoints
    (a table written with delta.checkpointInterval=2 has several)."""
    slot = "pgdecode_connect_ckpt"
    root = str(tmp_path / "delta")
    options = MergeOptions(table_properties={**merge_job.DEFAULT_TABLE_PROPERTIES, "delta.checkpointInterval": "2"})
    end = 100
    for round_ in range(5):
        changes = TableChanges("public", "ck", COLUMNS)
        changes.insert(end + 1, id=round_, name=f"row {round_}")
        write_batch(tmp_path / "staging", slot, end, end + 10, [changes])
        merge_batches(connect, [str(tmp_path / "staging" / slot / f"{end:016X}-{end + 10:016X}")], root, options)
        end += 10
    log_dir = tmp_path / "delta" / "public" / "ck" / "_delta_log"
    assert list(log_dir.glob("*.checkpoint.parquet")), sorted(p.name for p in log_dir.iterdir())
    state = merge_job.read_delta_state(connect, str(tmp_path / "delta" / "public" / "ck"), f"pgdecode:{slot}")
    assert state.exists and state.watermark == end
    assert state.version == len(list(log_dir.glob("*.json"))) - 1
    assert state.properties["delta.checkpointInterval"] == "2" and state.properties["pgdecode.key"] == '["id"]'
    assert state.schema is not None and state.schema.fieldNames()[:2] == ["id", "name"]
    # delta-rs reads the same log independently: the same version, transaction version and properties.
    other = deltalake.DeltaTable(str(tmp_path / "delta" / "public" / "ck"))
    assert (other.version(), other.transaction_version(f"pgdecode:{slot}")) == (state.version, state.watermark)
    assert dict(other.metadata().configuration) == state.properties


def test_summary_lines_one_per_table_and_the_total() -> None:
    summary = {
        "end_lsn": "0/900",
        "seconds": 2.26,
        "tables": {
            "public.b": {
                "status": "merged",
                "inserted": 3,
                "updated": 2,
                "deleted": 1,
                "delta_version": 4,
                "seconds": 1.5,
            },
            "public.a": {"status": "skipped", "reason": "already applied", "delta_version": 7, "seconds": 0.0},
        },
    }
    assert summary_lines(summary) == [
        "table public.a: skipped (already applied), 0 inserted, 0 updated, 0 deleted, Delta version 7, 0.0 s",
        "table public.b: merged, 3 inserted, 2 updated, 1 deleted, Delta version 4, 1.5 s",
        "merge total: 1 of 2 table(s) merged, 3 inserted, 2 updated, 1 deleted, through LSN 0/900, 2.3 s",
    ]


def test_the_server_stops_cleanly_on_sigterm() -> None:
    """SIGTERM stops the server module and its Spark, and it exits 0 (a server of its own: the
    session's one serves other tests)."""
    server = LocalConnectServer(master="local[1]").start()
    assert server.running()
    assert server.stop() == 0
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0  # nothing listens any more
