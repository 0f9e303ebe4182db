"""A pgdecode spark-submit carries the OpenLineage parent job of the Airflow task that submits it
(and the transport), under the OpenLineage provider's own switches, as the Spark provider's
SparkSubmitOperator does; a transport's key stays off the command line.

The task runs in a real DAG run (``dag.test``) with the OpenLineage provider's listener sending the
task's events over HTTP to a receiver of the test's: the spark-submit command line names the run
of the task's own events. The command line is the Spark provider's hook's, built as ``submit``
would run it; the job itself is not run (tests/spark/test_spark_submit.py runs spark-submit)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.spark.session import SPARK_JOB_ENTRY
from tests.dags.test_pgdecode_incremental import airflow_db  # noqa: F401 - fixture

COMMANDS: dict[str, list[str]] = {}

DAG_FILE = """
from datetime import datetime

from airflow.sdk import DAG

from tests.dags.test_openlineage_spark import SubmitCommandOnly

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    SubmitCommandOnly(task_id="merge", batch_paths=["{root}/batch"], delta_root="{root}/delta")
    SubmitCommandOnly(
        task_id="merge_own_parent",
        batch_paths=["{root}/batch"],
        delta_root="{root}/delta",
        conf={{"spark.openlineage.parentJobName": "mine"}},
    )
"""


class SubmitCommandOnly(PgDecodeMergeOperator):
    """The merge task, recording the spark-submit command line of its hook (built with the task's
    context, as the merge builds it) instead of running it."""

    def execute(self, context: Any) -> None:
        hook = self.get_hook([self.batch_paths[0]], "/nonexistent/summary.json", None, context)
        COMMANDS[self.task_id] = hook._build_spark_submit_command(str(SPARK_JOB_ENTRY))


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An OpenLineage HTTP endpoint on 127.0.0.1: its URL and the events posted to it."""
    events: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            events.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", events
    server.shutdown()
    server.server_close()


def run_dag(tmp_path, monkeypatch, dag_id: str) -> None:
    """Run the DAG of :data:`DAG_FILE` (spark_default: local mode), its tasks' command lines in :data:`COMMANDS`."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    dags = tmp_path / "dags"
    dags.mkdir(exist_ok=True)
    (dags / f"{dag_id}.py").write_text(DAG_FILE.format(dag_id=dag_id, root=tmp_path))
    bag = DagBag(dag_folder=str(dags))
    assert not bag.import_errors, bag.import_errors
    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
    sync_bag_to_db(bag, "dags-folder", None)  # dag.test runs serialized DAGs
    COMMANDS.clear()
    assert bag.dags[dag_id].test().state == DagRunState.SUCCESS


def confs(command: list[str]) -> dict[str, str]:
    """The ``--conf key=value`` pairs of a spark-submit command line."""
    pairs = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--conf"]
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.mark.usefixtures("airflow_db")
def test_spark_submit_names_the_task_s_run_as_its_openlineage_parent(
    tmp_path, monkeypatch, openlineage, receiver
) -> None:
    url, events = receiver
    transport = {
        "type": "http",
        "url": url,
        "endpoint": "api/v1/lineage",
        "auth": {"type": "api_key", "apiKey": "s3cret-ol-key"},
    }
    openlineage(transport, spark_inject_parent_job_info="True", spark_inject_transport_info="True")
    run_dag(tmp_path, monkeypatch, "ol_spark_submit")

    # The task's own events, through the provider's listener and transport.
    starts = {e["job"]["name"]: e for e in events if e["eventType"] == "START"}
    task_event = starts["ol_spark_submit.merge"]
    conf = confs(COMMANDS["merge"])
    assert conf["spark.openlineage.parentJobNamespace"] == "pgdecode_tests" == task_event["job"]["namespace"]
    assert conf["spark.openlineage.parentJobName"] == "ol_spark_submit.merge"
    assert conf["spark.openlineage.parentRunId"] == task_event["run"]["runId"]
    root = task_event["run"]["facets"]["parent"]  # the DAG run, the task's parent
    assert conf["spark.openlineage.rootParentRunId"] == root["run"]["runId"]
    assert conf["spark.openlineage.rootParentJobName"] == root["job"]["name"] == "ol_spark_submit"
    # The transport: where Airflow sends the task's events, without its key.
    assert conf["spark.openlineage.transport.type"] == "http"
    assert conf["spark.openlineage.transport.url"] == url
    assert conf["spark.openlineage.transport.endpoint"] == "api/v1/lineage"
    assert not any("s3cret-ol-key" in arg for arg in COMMANDS["merge"])
    assert not any(key.startswith("spark.openlineage.transport.auth") for key in conf)
    # Delta's settings are still there, and the job is pgdecode's merge job.
    assert conf["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert "airflow_provider_pgdecode.spark.merge_job" in COMMANDS["merge"]

    # A parent the task's conf names already wins (as in the Spark provider).
    own = confs(COMMANDS["merge_own_parent"])
    assert own["spark.openlineage.parentJobName"] == "mine"
    assert "spark.openlineage.parentRunId" not in own
    assert own["spark.openlineage.transport.url"] == url


@pytest.mark.usefixtures("airflow_db")
def test_without_the_switches_spark_submit_carries_no_openlineage_property(
    tmp_path, monkeypatch, openlineage, receiver
) -> None:
    url, events = receiver
    openlineage({"type": "http", "url": url, "endpoint": "api/v1/lineage"})  # the switches' defaults: off
    run_dag(tmp_path, monkeypatch, "ol_spark_submit_off")
    assert any(e["job"]["name"] == "ol_spark_submit_off.merge" for e in events)  # the provider is on
    assert not [arg for arg in COMMANDS["merge"] if "spark.openlineage." in arg]
