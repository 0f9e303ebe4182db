"""The merge operator: the spark-submit command it builds, its run through the hook, on_kill (no real Spark)."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyspark
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_pgdecode.batch.manifest import BatchManifest, ColumnSummary, TableSummary, batch_dir_name
from airflow_provider_pgdecode.cycle.merge import MergeJob
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import SparkConnectUnreachableError
from airflow_provider_pgdecode.operators.merge import MERGE_JOB_MODULE, PgDecodeMergeOperator, parse_batch_paths
from airflow_provider_pgdecode.spark.session import SPARK_JOB_ENTRY, delta_maven_coordinates

SLOT = "pgdecode_merge_op"
SPARK_LOCAL = json.dumps({"conn_type": "spark", "host": "local[*]"})


@pytest.fixture
def spark_conn(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", SPARK_LOCAL)
    return "spark_default"


def stage(root: Path, start: int, end: int, rows: int) -> str:
    """A complete batch directory; ``rows`` > 0 gives it one table (the Parquet file is a placeholder)."""
    directory = root / SLOT / batch_dir_name(Lsn(start), Lsn(end))
    tables = []
    if rows:
        (directory / "tables" / "public" / "orders").mkdir(parents=True)
        (directory / "tables" / "public" / "orders" / "part-00000.parquet").write_bytes(b"")
        tables.append(
            TableSummary(
                schema="public",
                table="orders",
                path="tables/public/orders",
                files=["part-00000.parquet"],
                rows=rows,
                inserts=rows,
                updates=0,
                deletes=0,
                truncates=0,
                min_commit_lsn=str(Lsn(start + 1)),
                max_commit_lsn=str(Lsn(end)),
                columns=[ColumnSummary("id", "integer", "int32", "integer")],
                key=["id"],
                replica_identity="default",
            )
        )
    directory.mkdir(parents=True, exist_ok=True)
    BatchManifest(
        slot=SLOT,
        plugin="test_decoding",
        database="shop",
        start_lsn=str(Lsn(start)),
        end_lsn=str(Lsn(end)),
        ceiling_lsn=str(Lsn(end)),
        transactions=1 if rows else 0,
        changes=rows,
        tables=tables,
        messages=None,
        prepared_pending=[],
        prepared_committed=[],
        prepared_rolled_back=[],
    ).write(directory)
    return str(directory)


def fake_spark_submit(tmp_path: Path, body: str) -> str:
    """An executable standing in for spark-submit: records its arguments and environment, then runs ``body``."""
    script = tmp_path / "spark-submit"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time\n"
        "args = sys.argv[1:]\n"
        f"json.dump({{'args': args, 'env': dict(os.environ)}}, open({str(tmp_path / 'call.json')!r}, 'w'))\n" + body
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_spark_jobs_start_from_a_folder_of_their_own() -> None:
    """spark-submit runs one entry file, alone in its folder with an ``__init__.py``: nothing there can
    shadow a module of Python's on the job's ``sys.path`` (the folder of the file Python runs)."""
    folder = SPARK_JOB_ENTRY.parent
    assert SPARK_JOB_ENTRY.is_file()
    assert sorted(p.name for p in folder.iterdir() if p.name != "__pycache__") == ["__init__.py", SPARK_JOB_ENTRY.name]


@pytest.fixture
def cold_ivy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An Ivy directory that has resolved nothing yet (no record of resolved jars)."""
    monkeypatch.delenv("AIRFLOW__PGDECODE__IVY_DIR", raising=False)
    monkeypatch.delenv("PGDECODE_DELTA_JARS", raising=False)
    monkeypatch.setenv("PGDECODE_IVY_DIR", str(tmp_path / "ivy"))
    return tmp_path / "ivy"


def test_spark_submit_command(spark_conn: str, cold_ivy: Path, tmp_path: Path) -> None:
    first, second = stage(tmp_path, 0x100, 0x200, 5), stage(tmp_path, 0x200, 0x300, 2)
    op = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=[first, second],
        delta_root=str(tmp_path / "delta"),
        conf={"spark.sql.shuffle.partitions": 2},
        merge_args=["--type-map", "mood=string"],
    )
    hook = op.get_hook([first, second], "/tmp/summary.json")
    command = hook._build_spark_submit_command(str(SPARK_JOB_ENTRY))

    assert command[0] == os.path.join(os.path.dirname(sys.executable), "spark-submit")
    assert command[command.index("--master") + 1] == "local[*]"
    assert command[command.index("--packages") + 1] == delta_maven_coordinates()
    assert delta_maven_coordinates().startswith("io.delta:delta-spark_4.2_2.13:")
    confs = [command[i + 1] for i, part in enumerate(command) if part == "--conf"]
    assert f"spark.jars.ivy={cold_ivy}" in confs
    assert "spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension" in confs
    assert "spark.sql.shuffle.partitions=2" in confs  # the task's conf wins over the defaults
    assert not any(c.startswith("spark.jars.packages=") for c in confs)
    assert command[command.index("--driver-memory") + 1] == "1g"
    assert command[command.index("--name") + 1] == "pgdecode-merge"
    app = command.index(str(SPARK_JOB_ENTRY))
    assert command[app + 1 :] == [
        MERGE_JOB_MODULE,
        "--delta-root",
        str(tmp_path / "delta"),
        "--batch",
        first,
        "--batch",
        second,
        "--summary-json",
        "/tmp/summary.json",
        "--type-map",
        "mood=string",
    ]
    # Pitfall P2: the venv's Spark and Python, whatever PATH says.
    assert hook._env is not None
    assert hook._env["SPARK_HOME"] == os.path.dirname(pyspark.__file__)
    assert hook._env["PYSPARK_PYTHON"] == sys.executable
    # A local master: the driver binds and advertises loopback.
    assert hook._env["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert not any(c.startswith("spark.driver.host=") for c in confs)


def test_remote_master_driver_advertises_the_connections_driver_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With a standalone master the driver's address is the connection's (never a forced loopback),
    and an ``SPARK_LOCAL_IP`` of the worker's environment reaches spark-submit untouched."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_CLUSTER",
        json.dumps(
            {
                "conn_type": "spark",
                "host": "spark://spark-master",
                "port": 7077,
                "extra": {
                    "deploy-mode": "client",
                    "driver-host": "airflow-scheduler",
                    "driver-bind-address": "0.0.0.0",
                },
            }
        ),
    )
    monkeypatch.setenv("SPARK_LOCAL_IP", "10.1.2.3")
    binary = fake_spark_submit(tmp_path, "sys.exit(0)\n")
    batch = stage(tmp_path, 1, 2, 1)
    op = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=batch,
        delta_root=str(tmp_path / "delta"),
        conn_id="spark_cluster",
        spark_binary=binary,
        asset_alias=None,
    )
    hook = op.get_hook([batch])
    command = hook._build_spark_submit_command(str(SPARK_JOB_ENTRY))
    confs = [command[i + 1] for i, part in enumerate(command) if part == "--conf"]
    assert command[command.index("--master") + 1] == "spark://spark-master:7077"
    assert "spark.driver.host=airflow-scheduler" in confs
    assert "spark.driver.bindAddress=0.0.0.0" in confs
    assert hook._env is not None and "SPARK_LOCAL_IP" not in hook._env

    op.execute({})
    call = json.loads((tmp_path / "call.json").read_text())
    assert call["env"]["SPARK_LOCAL_IP"] == "10.1.2.3"

    # The task's conf wins over the connection's extra.
    op = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=batch,
        delta_root=str(tmp_path / "delta"),
        conn_id="spark_cluster",
        conf={"spark.driver.host": "10.9.9.9"},
    )
    command = op.get_hook([batch])._build_spark_submit_command(str(SPARK_JOB_ENTRY))
    assert "spark.driver.host=10.9.9.9" in command and "spark.driver.host=airflow-scheduler" not in command


def test_jars_ivy_resolved_before_are_loaded_by_path(spark_conn: str, cold_ivy: Path, tmp_path: Path) -> None:
    """Once a session recorded what Ivy resolved for the merge's packages, the next spark-submit
    loads those files by path: no --packages, no Ivy resolution (nor its lines in the task's log).
    A record whose files are gone is ignored and Ivy resolves again."""
    from airflow_provider_pgdecode.spark.jars import KEY_CONF, record_session_jars

    batch = stage(tmp_path, 0x100, 0x200, 5)

    def command() -> list[str]:
        op = PgDecodeMergeOperator(task_id="merge", batch_paths=batch, delta_root=str(tmp_path / "delta"))
        return op.get_hook([batch])._build_spark_submit_command(str(SPARK_JOB_ENTRY))

    first = command()
    confs = dict(c.split("=", 1) for c in (first[i + 1] for i, part in enumerate(first) if part == "--conf"))
    assert "--packages" in first and confs[KEY_CONF]
    # What a session started from that command finds in its configuration once Ivy resolved.
    jars = [tmp_path / "ivy" / "jars" / f"{name}.jar" for name in ("io.delta_delta-spark_4.2_2.13-4.4.0", "b")]
    jars[0].parent.mkdir(parents=True)
    for jar in jars:
        jar.write_bytes(b"PK")

    class Conf(dict):  # SparkConf.get
        pass

    class Session:
        class sparkContext:  # noqa: N801
            @staticmethod
            def getConf() -> Conf:  # noqa: N802
                return Conf(
                    {KEY_CONF: confs[KEY_CONF], "spark.jars.ivy": confs["spark.jars.ivy"]}
                    | {"spark.jars": ",".join(f"file://{j}" for j in jars)}
                )

    assert record_session_jars(Session()) is True
    second = command()
    assert "--packages" not in second and not any("spark.jars.packages" in part for part in second)
    assert f"spark.jars={','.join(map(str, jars))}" in second
    assert not any(part.startswith(("spark.jars.ivy=", f"{KEY_CONF}=")) for part in second)
    jars[1].unlink()
    assert "--packages" in command()


def test_missing_spark_connection_fails_instead_of_using_yarn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_NOWHERE", raising=False)
    op = PgDecodeMergeOperator(
        task_id="merge", batch_paths=stage(tmp_path, 1, 2, 1), delta_root=str(tmp_path), conn_id="spark_nowhere"
    )
    with pytest.raises(AirflowFailException, match="'spark_nowhere' not found.*yarn.*AIRFLOW_CONN_SPARK_NOWHERE"):
        op.execute({})


def test_execute_runs_the_job_through_the_hook(spark_conn: str, tmp_path: Path) -> None:
    empty = stage(tmp_path, 0x300, 0x300, 0)
    second, first = stage(tmp_path, 0x200, 0x300, 2), stage(tmp_path, 0x100, 0x200, 5)
    summary = {
        "tables": {"public.orders": {"status": "merged", "inserted": 7, "updated": 0, "deleted": 0}},
        "end_lsn": "0/300",
    }
    binary = fake_spark_submit(
        tmp_path,
        f"print('spark says hello')\njson.dump({summary!r}, open(args[args.index('--summary-json') + 1], 'w'))\n",
    )
    op = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=json.dumps([second, empty, first]),  # a rendered template of a list
        delta_root=str(tmp_path / "delta"),
        spark_binary=binary,
        env_vars={"EXTRA": "1"},
    )
    result = op.execute({})
    assert result["batches"] == [first, second]  # LSN order, empty batch left out
    assert result["skipped"] == [empty]
    assert result["end_lsn"] == "0/300"
    assert result["summary"] == summary
    call = json.loads((tmp_path / "call.json").read_text())
    assert call["args"][call["args"].index("--master") + 1] == "local[*]"
    assert call["args"].count("--batch") == 2 and empty not in call["args"]
    assert call["env"]["SPARK_HOME"] == os.path.dirname(pyspark.__file__)
    assert call["env"]["PYSPARK_PYTHON"] == sys.executable and call["env"]["EXTRA"] == "1"


def test_a_failing_job_fails_the_task(spark_conn: str, tmp_path: Path) -> None:
    binary = fake_spark_submit(tmp_path, "print('MergeInputError: table x has no key'); sys.exit(2)\n")
    op = PgDecodeMergeOperator(
        task_id="merge", batch_paths=stage(tmp_path, 1, 2, 1), delta_root=str(tmp_path), spark_binary=binary
    )
    with pytest.raises(AirflowException, match="Error code is: 2"):
        op.execute({})


def test_on_kill_stops_the_spark_submit_process(spark_conn: str, tmp_path: Path) -> None:
    # The stand-in job writes a marker if it ever gets past its long sleep: only a kill keeps it from doing so.
    finished = tmp_path / "finished"
    binary = fake_spark_submit(
        tmp_path, f"print('started', flush=True)\ntime.sleep(60)\nopen({str(finished)!r}, 'w').close()\n"
    )
    op = PgDecodeMergeOperator(
        task_id="merge", batch_paths=stage(tmp_path, 1, 2, 1), delta_root=str(tmp_path), spark_binary=binary
    )
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            op.execute({})
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    # Wait until the job runs (it wrote call.json) or execute() gave up; no clock involved.
    while thread.is_alive() and not (
        op._job is not None
        and op._job._hook is not None
        and op._job._hook._submit_sp is not None
        and (tmp_path / "call.json").exists()
    ):
        time.sleep(0.02)
    assert thread.is_alive(), f"execute() ended before the job started: {outcome.get('error')!r}"
    process = op._job._hook._submit_sp
    try:
        assert process.poll() is None  # running, in its sleep
        op.on_kill()
        thread.join()  # returns once the job process is gone, killed or (if on_kill failed) finished
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL  # ended by the kill, not by exiting
    assert not finished.exists()  # the job never got past its sleep
    assert isinstance(outcome.get("error"), AirflowException)  # the task fails rather than reporting success
    PgDecodeMergeOperator(task_id="m", batch_paths=[], delta_root="x").on_kill()  # before execute: no-op


def test_parse_batch_paths() -> None:
    assert parse_batch_paths("/a/b") == ["/a/b"]
    assert parse_batch_paths(" /a/b \n") == ["/a/b"]
    assert parse_batch_paths('["/a", "/b"]') == ["/a", "/b"]
    assert parse_batch_paths("['/a', '/b']") == ["/a", "/b"]  # a list rendered with str()
    assert parse_batch_paths(["/a", "", "/b"]) == ["/a", "/b"]
    assert parse_batch_paths(None) == [] and parse_batch_paths("") == []


def test_assets_name_each_delta_table_by_its_schema_and_table_even_with_dots_and_slashes(tmp_path: Path) -> None:
    from airflow.sdk import AssetAlias

    added: list[tuple[str, str]] = []

    class Events:
        def add(self, asset: Any, extra: dict[str, Any]) -> None:
            added.append((asset.name, asset.uri))

    operator = PgDecodeMergeOperator(task_id="merge", batch_paths=[], delta_root=str(tmp_path))
    merged = {"status": "merged", "inserted": 1, "updated": 0, "deleted": 0}
    summary = {
        "tables": {
            "my.schema.c/d": {**merged, "schema": "my.schema", "table": "c/d"},
            "public.orders": dict(merged),  # a summary of a merge job before the names were in it
            "public.skipped": {"status": "skipped"},
        }
    }
    job = MergeJob(operator.cycle_arguments(), operator.log)
    job._emit_assets({"outlet_events": {AssetAlias("pgdecode_delta_tables"): Events()}}, summary)  # type: ignore[arg-type]
    root = tmp_path.resolve()
    assert sorted(added) == [
        ((root / "my.schema" / "c%2Fd").as_uri(),) * 2,
        ((root / "public" / "orders").as_uri(),) * 2,
    ]


def test_spark_logs_at_the_spark_log_level_setting_from_the_drivers_first_line(
    spark_conn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver JVM gets the package's log4j2 file and the level: WARN by default, the setting raises it."""
    from airflow_provider_pgdecode.spark.session import LOG4J2_PROPERTIES

    batch = stage(tmp_path, 0x100, 0x200, 5)
    monkeypatch.delenv("AIRFLOW__PGDECODE__SPARK_LOG_LEVEL", raising=False)
    monkeypatch.delenv("PGDECODE_SPARK_LOG_LEVEL", raising=False)

    def java_options() -> str:
        op = PgDecodeMergeOperator(task_id="merge", batch_paths=batch, delta_root=str(tmp_path / "delta"))
        command = op.get_hook([batch])._build_spark_submit_command(str(SPARK_JOB_ENTRY))
        confs = [command[i + 1] for i, part in enumerate(command) if part == "--conf"]
        return next(c for c in confs if c.startswith("spark.driver.extraJavaOptions=")).split("=", 1)[1]

    assert LOG4J2_PROPERTIES.is_file()
    assert java_options().split() == [
        f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}",
        "-Dpgdecode.spark.log.level=WARN",
    ]
    monkeypatch.setenv("AIRFLOW__PGDECODE__SPARK_LOG_LEVEL", "info")
    assert "-Dpgdecode.spark.log.level=INFO" in java_options().split()
    monkeypatch.setenv("AIRFLOW__PGDECODE__SPARK_LOG_LEVEL", "LOUD")
    with pytest.raises(Exception, match="'LOUD'.*spark_log_level.*WARN"):
        java_options()


def test_a_spark_connect_connection_without_a_server_fails_at_once_saying_how_to_start_one(
    tmp_path: Path, unreachable_conn: Any
) -> None:
    conn_id, port = unreachable_conn("spark_connect")
    op = PgDecodeMergeOperator(
        task_id="merge", batch_paths=stage(tmp_path, 1, 2, 1), delta_root=str(tmp_path), conn_id=conn_id
    )
    with pytest.raises(
        SparkConnectUnreachableError,  # retryable: Airflow's retries apply, each try fails at once
        match=f"the Spark Connect server at sc://127.0.0.1:{port} \\(connection 'nowhere'\\) is not reachable: "
        f"nothing answers at 127.0.0.1:{port}.*--port {port}",
    ):
        op.execute({})
