"""The job file run by spark-submit: in local mode, and on a real standalone cluster
(a master and two workers started from the pip-installed pyspark with spark-class)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.spark import merge_job
from airflow_provider_pgdecode.spark.session import spark_submit_command, spark_submit_env
from pgdecode_testing.standalone_cluster import master_state
from pgdecode_testing.standalone_cluster import standalone_cluster as start_cluster
from tests.conftest import FULL_TESTS
from tests.spark.staged import Model, TableChanges, write_batch

pytestmark = pytest.mark.spark

SLOT = "pgdecode_submit"
COLUMNS = [("id", "integer", pa.int32()), ("name", "text", pa.string())]
# A proxy that refuses every connection: proves that jars come from the project-local Ivy cache.
NO_NETWORK = " ".join(
    f"-D{scheme}.{prop}={value}"
    for scheme in ("http", "https")
    for prop, value in (("proxyHost", "127.0.0.1"), ("proxyPort", "9"))
)


def _changes() -> tuple[TableChanges, TableChanges]:
    first = TableChanges("sales", "Customer List", COLUMNS)
    for i in range(1, 41):
        first.insert(100 + i, id=i, name=f"customer {i}")
    second = TableChanges("sales", "Customer List", COLUMNS)
    second.update(300, id=1, name="renamed").delete(300, id=2).truncate(400).insert(500, id=99, name="after truncate")
    return first, second


def _expected(first: TableChanges, second: TableChanges | None = None) -> list[dict[str, Any]]:
    tables = [first] + ([second] if second else [])
    return Model().apply(*tables).state(["id", "name"])


def _delta_rows(path: str) -> list[dict[str, Any]]:
    import deltalake

    table = deltalake.DeltaTable(path)
    rows = pa.table(
        deltalake.QueryBuilder().register("t", table).execute("select id, name from t order by id").read_all()
    )
    return rows.to_pylist()


def _submit(master: str, args: list[str], extra_conf: dict[str, str], timeout: int = 240) -> dict[str, Any]:
    command = spark_submit_command(merge_job.__name__, args, master=master, extra_conf=extra_conf)
    completed = subprocess.run(command, env=spark_submit_env(), capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("PGDECODE_MERGE_SUMMARY ")]
    assert lines, completed.stdout[-2000:] + completed.stderr[-2000:]
    summary: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    summary["_stderr"] = completed.stderr
    return summary


IVY_LINES = (":: resolving dependencies ::", ":: retrieving ::", "Ivy Default Cache set to")


def test_spark_submit_local_mode_offline_from_ivy_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first job of an Ivy directory resolves Delta's packages from its cache (offline: a proxy
    refuses every connection) and records the jar files; the next loads them by path, and Ivy
    never runs (none of its lines in the log)."""
    from airflow_provider_pgdecode.spark.jars import RECORD_NAME
    from airflow_provider_pgdecode.spark.session import ivy_dir

    ivy = tmp_path / "ivy"
    ivy.mkdir()
    (ivy / "cache").symlink_to(ivy_dir() / "cache")  # the checkout's filled cache, no record of resolved jars
    monkeypatch.delenv("PGDECODE_DELTA_JARS", raising=False)
    monkeypatch.setenv("PGDECODE_IVY_DIR", str(ivy))
    first, second = _changes()
    batch = write_batch(tmp_path / "staging", SLOT, 100, 150, [first])
    batch2 = write_batch(tmp_path / "staging", SLOT, 150, 510, [second])
    root = str(tmp_path / "delta")
    conf = {"spark.sql.shuffle.partitions": "2", "spark.driver.extraJavaOptions": NO_NETWORK}

    resolved = _submit("local[2]", ["--delta-root", root, "--batch", batch], conf)
    assert "artifacts copied" in resolved["_stderr"]
    assert (ivy / RECORD_NAME).is_file()
    loaded = _submit("local[2]", ["--delta-root", root, "--batch", batch2], conf)
    assert not [line for line in loaded["_stderr"].splitlines() if any(mark in line for mark in IVY_LINES)]

    table = loaded["tables"]["sales.Customer List"]
    assert table["status"] == "merged" and table["truncated"] is True
    assert loaded["end_lsn"] == "0/1FE"
    # Names as PostgreSQL stores them: a space in the table name, no quoting in the path.
    path = os.path.join(root, "sales", "Customer List")
    assert _delta_rows(path) == _expected(first, second) == [{"id": 99, "name": "after truncate"}]


@pytest.fixture()
def standalone_cluster(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Spark standalone master and two one-core workers on 127.0.0.1; stopped afterwards."""
    with start_cluster(tmp_path, "127.0.0.1", 2) as cluster:
        yield cluster


@pytest.mark.skipif(
    not FULL_TESTS,
    reason="the S3 test below runs the same job on the same two-worker cluster, through the object store; "
    "PGDECODE_FULL_TESTS=1 runs it",
)
def test_standalone_cluster_with_two_workers(standalone_cluster: tuple[str, int], tmp_path: Path) -> None:
    master_url, master_ui = standalone_cluster
    first, second = _changes()
    batches = [
        write_batch(tmp_path / "staging", SLOT, 100, 150, [first]),
        write_batch(tmp_path / "staging", SLOT, 150, 510, [second]),
    ]
    root = str(tmp_path / "delta")
    conf = {
        "spark.sql.shuffle.partitions": "4",
        "spark.executor.cores": "1",
        "spark.cores.max": "2",
        "spark.executor.memory": "1g",
    }
    summary = _submit(master_url, ["--delta-root", root, "--batch", batches[0], "--batch", batches[1]], conf)
    table = summary["tables"]["sales.Customer List"]
    assert table["status"] == "merged" and table["truncated"] is True and table["created"] is True
    assert _delta_rows(os.path.join(root, "sales", "Customer List")) == _expected(first, second)
    # The work ran on the cluster: the application completed there, with executors on both workers.
    state = master_state(master_ui)
    apps = [app for app in state["completedapps"] if app["name"] == "pgdecode-merge"]
    assert len(apps) == 1 and apps[0]["cores"] == 2, state["completedapps"]
    assert len(state["workers"]) == 2


@pytest.mark.s3
def test_standalone_cluster_sharing_no_disk_merges_from_s3_into_delta_on_s3(
    standalone_cluster: tuple[str, int], tmp_path: Path, s3_server: Any, s3_bucket: str, spark: Any
) -> None:
    """Batches staged on S3, Delta on S3: the local copies are gone before the job starts, so the
    data can only travel through the object store; the key reaches the job as environment only."""
    import shutil

    from airflow_provider_pgdecode.batch.storage import Storage

    master_url, master_ui = standalone_cluster
    first, second = _changes()
    settings = s3_server.settings
    staging = Storage(f"{s3_bucket}/staging", settings)
    batches = []
    for start, end, changes in ((100, 150, first), (150, 510, second)):
        local = write_batch(tmp_path / "staging", SLOT, start, end, [changes])
        staging.upload_tree(local, f"{SLOT}/{Path(local).name}", last="manifest.json")
        batches.append(staging.uri(SLOT, Path(local).name))
    shutil.rmtree(tmp_path / "staging")
    root = f"{s3_bucket}/delta"
    command = spark_submit_command(
        merge_job.__name__,
        ["--delta-root", root, "--batch", batches[0], "--batch", batches[1]],
        master=master_url,
        extra_conf={"spark.sql.shuffle.partitions": "4", "spark.cores.max": "2", "spark.executor.memory": "1g"},
        object_store=True,
    )
    assert settings.secret_key not in " ".join(command)
    completed = subprocess.run(
        command, env={**spark_submit_env(), **settings.to_env()}, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("PGDECODE_MERGE_SUMMARY ")]
    table = json.loads(lines[-1].split(" ", 1)[1])["tables"]["sales.Customer List"]
    assert table["status"] == "merged" and table["delta_path"].startswith("s3a://")
    assert table["truncated"] is True and table["created"] is True
    from airflow_provider_pgdecode.spark.session import configure_object_store

    configure_object_store(spark, settings)
    merged = spark.read.format("delta").load(table["delta_path"]).select("id", "name").orderBy("id").collect()
    assert [row.asDict() for row in merged] == _expected(first, second)
    # The work ran on the cluster: the application completed there, with executors on both workers.
    state = master_state(master_ui)
    apps = [app for app in state["completedapps"] if app["name"] == "pgdecode-merge"]
    assert len(apps) == 1 and apps[0]["cores"] == 2, state["completedapps"]
    assert len(state["workers"]) == 2
    # Nothing of the batches or the tables on the workers' disks.
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("_delta_log"))


def non_loopback_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None when it has none."""
    try:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as sock:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address selects the interface
            address = str(sock.getsockname()[0])
    except OSError:
        return None
    if address.startswith("127.") or address == "0.0.0.0":
        return None
    try:  # the address must be bindable here (a NAT'd or vanished address is not)
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.bind((address, 0))
    except OSError:
        return None
    return address


def test_operator_client_mode_driver_advertises_a_non_loopback_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compose stack's shape on one machine: master, worker and the driver on the machine's
    network address, none on loopback; the merge operator (client mode) takes the driver's address
    from the Spark connection's extra, and the executor connects back to the driver there."""
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind Spark's master, worker and driver to")
    first, second = _changes()
    batches = [
        write_batch(tmp_path / "staging", SLOT, 100, 150, [first]),
        write_batch(tmp_path / "staging", SLOT, 150, 510, [second]),
    ]
    root = str(tmp_path / "delta")
    events = tmp_path / "events"
    events.mkdir()
    with start_cluster(tmp_path, address, 1) as (master_url, master_ui):
        host, port = master_url.rsplit(":", 1)
        monkeypatch.setenv(
            "AIRFLOW_CONN_SPARK_LAN",
            json.dumps(
                {
                    "conn_type": "spark",
                    "host": host,
                    "port": int(port),
                    "extra": {"deploy-mode": "client", "driver-host": address, "driver-bind-address": address},
                }
            ),
        )
        # Nothing but the connection tells the driver where to listen (another test may have left loopback here).
        monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
        operator = PgDecodeMergeOperator(
            task_id="merge",
            batch_paths=batches,
            delta_root=root,
            conn_id="spark_lan",
            conf={
                "spark.sql.shuffle.partitions": "2",
                "spark.cores.max": "1",
                "spark.executor.memory": "1g",
                "spark.eventLog.enabled": "true",
                "spark.eventLog.dir": events.as_uri(),
                # One plain JSON-lines file (Spark 4 rolls and compresses event logs by default).
                "spark.eventLog.rolling.enabled": "false",
                "spark.eventLog.compress": "false",
            },
            asset_alias=None,
        )
        result = operator.execute({})
        state = master_state(master_ui, address)

    assert result["summary"]["tables"]["sales.Customer List"]["status"] == "merged"
    assert _delta_rows(os.path.join(root, "sales", "Customer List")) == _expected(first, second)
    apps = [app for app in state["completedapps"] if app["name"] == "pgdecode-merge"]
    assert len(apps) == 1 and apps[0]["cores"] == 1, state["completedapps"]
    # The driver advertised the network address (the event log records the application's properties) ...
    (log,) = [path for path in events.iterdir() if path.is_file()]
    environment = next(
        json.loads(line) for line in log.read_text().splitlines() if '"SparkListenerEnvironmentUpdate"' in line
    )
    assert environment["Spark Properties"]["spark.driver.host"] == address
    assert environment["Spark Properties"]["spark.driver.bindAddress"] == address
    # ... and the executor on the worker connected to the driver there.
    executor_logs = list((tmp_path / "work-0").rglob("stderr"))
    assert executor_logs, "the worker kept no executor log"
    assert any(
        f"Connecting to driver: spark://CoarseGrainedScheduler@{address}:" in log.read_text() for log in executor_logs
    )
