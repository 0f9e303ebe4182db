"""The initial load's chunk copy as Spark tasks (capture/snapshot_spark.py), on real PostgreSQL and Spark.

One task per chunk, each importing the slot's exported snapshot over its own connection: the staged
batch equals the thread path's, file for file, while the source is written during the copy, and
merged it gives Delta what the snapshot shows, then the slot's next batch catches up exactly. A task
whose Python worker dies mid-chunk on its first attempt (a ``local[2,3]`` master retries it) has its
chunk copied again: the job finishes, the batch holds each chunk's part once and whole, and Delta
equals PostgreSQL as a multiset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, snapshot_workdir, stage_snapshot
from airflow_provider_pgdecode.capture.snapshot_spark import FAULT_ENV
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.s3_server import LocalS3Server
from tests.capture.test_snapshot import (
    TABLES,
    Writer,
    assert_delta_equals_postgres,
    merge_then_follow,
    source,  # noqa: F401 (a fixture)
    wait_for_ops,
)

pytestmark = [pytest.mark.postgres, pytest.mark.spark]


def staged_files(batch: BatchManifest) -> dict[str, list[str]]:
    """Every file under each table's directory of the published batch."""
    return {t.table: sorted(p.name for p in (Path(batch.path) / t.path).iterdir()) for t in batch.tables}


def assert_parts_once_and_whole(batch: BatchManifest) -> None:
    """Each table's directory holds exactly its manifest's parts; their rows add up, no key twice."""
    for table in batch.tables:
        assert staged_files(batch)[table.table] == sorted(table.files), table.table
        rows = pq.read_table(Path(batch.path) / table.path, columns=[*table.key, "_pg_op"]).to_pylist()
        inserted = [tuple(r[k] for k in table.key) for r in rows if r["_pg_op"] == "I"]
        assert len(inserted) == table.inserts, table.table
        twice = [key for key, n in Counter(inserted).items() if n > 1]
        assert not twice, (table.table, twice[:5])


def test_spark_copy_equals_the_thread_copy_under_concurrent_writes(
    pg_conn,
    pg_dsn,
    source,  # noqa: F811
    slot_name,
    spark,
    tmp_path: Path,
) -> None:
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    writer = Writer(pg_dsn)
    writer.start()
    try:
        wait_for_ops(writer, 20)
        with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
            wait_for_ops(writer, 20)  # committed after the consistent point: not in the copy
            spark.sparkContext.setJobGroup("pgdecode-copy-test", "the copy on Spark")
            on_spark = stage_snapshot(pg_dsn, name, lsn, slot_name, staging, TABLES, chunk_pages=4, spark=spark)
            jobs = spark.sparkContext.statusTracker().getJobIdsForGroup("pgdecode-copy-test")
            spark.sparkContext.setJobGroup("", "")
            wait_for_ops(writer, 20)
            threads = stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path / "threads", TABLES, chunk_pages=4)
            with psycopg.connect(pg_dsn) as reader:  # what the exported snapshot shows, read independently
                reader.execute("begin isolation level repeatable read")
                reader.execute(f"set transaction snapshot '{name}'")
                in_snapshot = sorted(r[0] for r in reader.execute("select id from snap_items"))
                now = sorted(r[0] for r in pg_conn.execute("select id from snap_items"))
        wait_for_ops(writer, 30)
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.error is None, writer.error

    assert len(jobs) == 1  # one Spark job copied the chunks
    stage = spark.sparkContext.statusTracker().getJobInfo(jobs[0]).stageIds[0]
    info = json.loads((Path(on_spark.path) / "snapshot.json").read_text())
    tasks = spark.sparkContext.statusTracker().getStageInfo(stage).numTasks
    assert tasks == sum(t["chunks"] for t in info["tables"]) > 4  # one task per chunk
    assert on_spark.contents() == threads.contents()
    items = next(t for t in on_spark.tables if t.table == "snap_items")
    assert len(items.snapshot_files) > 4
    for table in on_spark.tables:
        for file in table.files:
            a = pq.read_table(Path(on_spark.path) / table.path / file)
            assert a.equals(pq.read_table(Path(threads.path) / table.path / file)), (table.table, file)
    assert_parts_once_and_whole(on_spark)
    staged = pq.read_table(Path(on_spark.path) / items.path, columns=["id", "_pg_op"]).to_pydict()
    assert sorted(i for i, op in zip(staged["id"], staged["_pg_op"]) if op == "I") == in_snapshot != now
    merge_then_follow(pg_conn, spark, slot_name, on_spark, staging, delta_root)


CHILD = """
import json, logging, os, sys
import pyarrow.parquet as pq
from airflow_provider_pgdecode.batch.storage import as_storage
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, snapshot_workdir, stage_snapshot
from airflow_provider_pgdecode.errors import StagingError
from airflow_provider_pgdecode.spark.session import build_spark_session
logging.basicConfig(level=logging.INFO)
a = json.loads(sys.argv[1])
spark = build_spark_session(a["master"], app_name="pgdecode-copy-retry",
                            extra_conf={"spark.driver.memory": "1g", "spark.ui.enabled": "false"})
spark.sparkContext.setLogLevel("ERROR")
if a["fault"]:
    spark.sparkContext.environment[a["fault_env"]] = a["fault"]
recorded = []  # the chunks each call recorded
def stage(name, lsn):
    recorded.append([])
    return stage_snapshot(a["dsn"], name, lsn, a["slot"], a["staging"], [tuple(t) for t in a["tables"]],
                          chunk_rows=a["chunk_rows"], chunk_pages=a["pages"], spark=spark,
                          on_chunk=lambda schema, table, chunk, rows: recorded[-1].append([table, chunk]))
with create_slot_with_snapshot(a["dsn"], a["slot"]) as (lsn, name):
    if a["always"]:  # every attempt of one chunk dies: the job fails; what does it leave?
        spark.sparkContext.environment[a["fault_env"]] = a["always"]
        try:
            stage(name, lsn)
            error = None
        except StagingError as exc:
            error = str(exc)
        workdir = snapshot_workdir(as_storage(a["staging"]), a["slot"], name)
        files = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file())
        torn = []
        for p in workdir.rglob("part-*.parquet"):
            try:
                pq.read_metadata(p)
            except Exception:
                torn.append(p.name)
        print("FAILED " + json.dumps({"error": error, "files": files, "torn": torn}), flush=True)
    spark.sparkContext.environment[a["fault_env"]] = a["fault"]
    batch = stage(name, lsn)
print("BATCH " + json.dumps({"path": str(batch.path), "recorded": recorded}), flush=True)
spark.stop()
"""


def run_child(arguments: dict[str, object]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    return subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(arguments)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_an_executor_killed_mid_chunk_has_its_chunk_redone_nothing_twice(
    pg_conn,
    pg_dsn,
    source,  # noqa: F811
    slot_name,
    spark,
    tmp_path: Path,
) -> None:
    staging, delta_root, marker = tmp_path / "staging", str(tmp_path / "delta"), tmp_path / "killed"
    # Chunks of 15 pages (hundreds of rows), written in row groups of 100 rows. A first job: chunk
    # 2 of snap_items dies after its first row group at every attempt; the job fails. The call
    # again: chunk 2 dies at its first attempt only, and its retry copies it whole.
    arguments = {
        "master": "local[2,3]",  # two task slots, up to three attempts per task
        "dsn": pg_dsn,
        "slot": slot_name,
        "staging": str(staging),
        "tables": [list(t) for t in TABLES],
        "chunk_rows": 100,
        "pages": 15,
        "fault_env": FAULT_ENV,
        "fault": f"public.snap_items:2:{marker}",
        "always": "public.snap_items:2:",  # first a job whose chunk 2 dies at every attempt
    }
    child = run_child(arguments)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.split("BATCH ", 1)[1])
    batch = BatchManifest.read(result["path"])

    # The job that failed (chunk 2 died three times) said so, and left no torn part under a
    # part's name: only its attempts' temporary files, which the next call discarded.
    failed = json.loads(child.stdout.split("FAILED ", 1)[1].splitlines()[0])
    assert failed["error"] and "on Spark failed" in failed["error"], failed
    assert failed["torn"] == [], failed
    assert any("part-00002.parquet." in f and f.endswith(".part") for f in failed["files"]), failed

    killed_after = int(marker.read_text().split()[1])  # the first attempt died, with rows written
    info = json.loads((Path(batch.path) / "snapshot.json").read_text())
    items = next(t for t in info["tables"] if t["table"] == "snap_items")
    assert items["chunks"] >= 3
    path = Path(batch.path) / next(t.path for t in batch.tables if t.table == "snap_items")
    assert 0 < killed_after < pq.read_metadata(path / "part-00002.parquet").num_rows  # killed mid-chunk
    # The chunks the failed job finished were kept, the others copied by the second call: each once.
    first, second = ([tuple(c) for c in call] for call in result["recorded"])
    assert first and ("snap_items", 2) not in first and ("snap_items", 2) in second, result
    assert sorted(first + second) == sorted([(t["table"], i) for t in info["tables"] for i in range(t["chunks"])]), (
        result
    )
    assert_parts_once_and_whole(batch)

    summary = merge_batches(spark, [str(batch.path)], delta_root)
    assert all(t["status"] == "merged" for t in summary["tables"].values()), summary
    assert_delta_equals_postgres(pg_conn, spark, delta_root)


def test_a_copy_on_spark_refuses_what_its_executors_cannot_do(pg_dsn, spark, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="DSN"):
        stage_snapshot(lambda: psycopg.connect(pg_dsn), "00000003-1", "0/1", "s", tmp_path, TABLES, spark=spark)


@pytest.fixture
def s3_env(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> ObjectStoreSettings:
    """The server's settings, also as the ``AWS_*`` environment (how the merge job gets them)."""
    for name, value in s3_server.settings.to_env().items():
        monkeypatch.setenv(name, value)
    return s3_server.settings


@pytest.mark.s3
def test_spark_copy_uploads_its_parts_to_object_storage(
    pg_conn,
    pg_dsn,
    source,  # noqa: F811
    slot_name,
    spark,
    s3_bucket: str,
    s3_env: ObjectStoreSettings,
    tmp_path: Path,
) -> None:
    store = Storage(f"{s3_bucket}/staging", s3_env)
    with create_slot_with_snapshot(pg_dsn, slot_name) as (lsn, name):
        on_s3 = stage_snapshot(pg_dsn, name, lsn, slot_name, store, TABLES, chunk_pages=4, spark=spark)
        local = stage_snapshot(pg_dsn, name, lsn, slot_name, tmp_path / "threads", TABLES, chunk_pages=4)

    assert str(on_s3.path).startswith(f"{s3_bucket}/staging/") and on_s3.contents() == local.contents()
    batch = store.at(str(on_s3.path))
    # Exactly the manifest's parts, beside the manifest and snapshot.json: nothing twice, no temporary file.
    expected = {f"{t.path}/{f}" for t in on_s3.tables for f in t.files} | {"manifest.json", "snapshot.json"}
    assert set(batch.walk_files()) == expected
    for table in on_s3.tables:
        for file in table.files:
            remote = pq.read_table(pa.BufferReader(batch.read_bytes(f"{table.path}/{file}")))
            assert remote.equals(pq.read_table(Path(local.path) / table.path / file)), (table.table, file)
    assert not list(snapshot_workdir(store, slot_name, name).parent.glob("*snapshot*"))  # the local copy is gone

    summary = merge_batches(spark, [str(on_s3.path)], str(tmp_path / "delta"))
    assert all(t["status"] == "merged" for t in summary["tables"].values()), summary
    assert_delta_equals_postgres(pg_conn, spark, str(tmp_path / "delta"))
