"""The merge and verify operators with ``storage_conn_id`` and s3:// locations: what spark-submit gets
(no real Spark, no S3 server: the command and environment the hook builds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.cycle.merge import MergeJob
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator, delta_table_asset
from airflow_provider_pgdecode.operators.verify import PgDecodeVerifyOperator, verify_asset
from airflow_provider_pgdecode.spark.session import (
    HADOOP_EXCLUDES,
    SPARK_JOB_ENTRY,
    delta_maven_coordinates,
    hadoop_aws_maven_coordinates,
)

KEY, SECRET = "AKIAEXAMPLE", "never-on-a-command-line-7f3a"
BATCHES = ["s3://lake/staging/slot/0000000000000100-0000000000000200"]


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    # An Ivy directory that has resolved nothing yet: the jobs name their packages.
    monkeypatch.delenv("AIRFLOW__PGDECODE__IVY_DIR", raising=False)
    monkeypatch.delenv("PGDECODE_DELTA_JARS", raising=False)
    monkeypatch.setenv("PGDECODE_IVY_DIR", str(tmp_path / "ivy"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[*]"}))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_YARN", json.dumps({"conn_type": "spark", "host": "yarn"}))
    monkeypatch.setenv(
        "AIRFLOW_CONN_LAKE",
        json.dumps(
            {
                "conn_type": "aws",
                "login": KEY,
                "password": SECRET,
                "extra": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1"},
            }
        ),
    )
    return "lake"


def test_storage_conn_id_reaches_spark_submit_as_environment_only(connections: str) -> None:
    from airflow_provider_pgdecode.hooks.object_store import object_store_settings

    operator = PgDecodeMergeOperator(
        task_id="merge", batch_paths=BATCHES, delta_root="s3://lake/delta", storage_conn_id=connections
    )
    assert "storage_conn_id" in operator.template_fields
    hook = operator.get_hook(BATCHES, "/tmp/summary.json", object_store_settings(connections))
    command = hook._build_spark_submit_command(str(SPARK_JOB_ENTRY))

    assert command[command.index("--packages") + 1] == f"{delta_maven_coordinates()},{hadoop_aws_maven_coordinates()}"
    assert hadoop_aws_maven_coordinates() == "org.apache.hadoop:hadoop-aws:3.5.0"
    assert f"spark.jars.excludes={HADOOP_EXCLUDES}" in command
    assert SECRET not in " ".join(command) and KEY not in " ".join(command)
    assert hook._env is not None
    assert hook._env["AWS_SECRET_ACCESS_KEY"] == SECRET and hook._env["AWS_ACCESS_KEY_ID"] == KEY
    assert hook._env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9" and hook._env["AWS_REGION"] == "eu-west-1"
    # Not in the operator's own env_vars, a template field that Airflow stores rendered.
    assert operator.env_vars == {}


def test_local_locations_keep_delta_alone_on_the_classpath(connections: str, tmp_path: Path) -> None:
    operator = PgDecodeMergeOperator(task_id="merge", batch_paths=[str(tmp_path)], delta_root=str(tmp_path / "d"))
    command = operator.get_hook([str(tmp_path)])._build_spark_submit_command(str(SPARK_JOB_ENTRY))
    assert command[command.index("--packages") + 1] == delta_maven_coordinates()
    assert not any(part.startswith("spark.jars.excludes=") for part in command)


def test_a_secret_is_refused_where_the_spark_provider_would_put_it_on_the_command_line(connections: str) -> None:
    from airflow_provider_pgdecode.hooks.object_store import object_store_settings

    operator = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=BATCHES,
        delta_root="s3://lake/delta",
        conn_id="spark_yarn",
        storage_conn_id=connections,
    )
    with pytest.raises(ConfigurationError, match="'lake' holds a secret key.*'yarn'.*instance or pod role") as error:
        operator.get_hook(BATCHES, None, object_store_settings(connections))
    assert SECRET not in str(error.value)


def test_the_merge_task_fails_for_good_on_that_refusal(connections: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MergeJob, "read_batches", lambda self, settings=None: ([_manifest()], []))
    # No parked tables: the store behind this connection is not reachable, and the refusal is the point.
    monkeypatch.setattr(MergeJob, "_parking", lambda self, *args: None)
    operator = PgDecodeMergeOperator(
        task_id="merge", batch_paths=BATCHES, delta_root="s3://lake/d", conn_id="spark_yarn", storage_conn_id="lake"
    )
    with pytest.raises(AirflowFailException, match="holds a secret key"):
        operator.execute({})


def _manifest() -> BatchManifest:
    manifest = BatchManifest(
        slot="slot",
        plugin="pgoutput",
        database="shop",
        start_lsn="0/100",
        end_lsn="0/200",
        ceiling_lsn="0/200",
        transactions=1,
        changes=1,
        tables=[],
    )
    manifest.path = BATCHES[0]
    return manifest


def test_assets_of_delta_tables_and_verify_results_on_s3() -> None:
    from airflow_provider_pgdecode.capture.verify import VerifySnapshot
    from airflow_provider_pgdecode.decoding.lsn import Lsn

    asset = delta_table_asset("s3://lake/delta/", "sales", "Customer List")
    assert asset.uri == "s3://lake/delta/sales/Customer%20List" and asset.name == asset.uri
    snapshot = VerifySnapshot("slot", Lsn(5), "s3://lake/staging/slot/verify/pgdecode_verify_ab/0-5", ("public.t",))
    assert verify_asset(snapshot).uri == "s3://lake/staging/slot/verify"


def test_verify_operator_passes_storage_settings_as_environment(connections: str) -> None:
    from airflow_provider_pgdecode.capture.verify import VerifySnapshot
    from airflow_provider_pgdecode.decoding.lsn import Lsn
    from airflow_provider_pgdecode.hooks.object_store import object_store_settings

    operator = PgDecodeVerifyOperator(task_id="verify", delta_root="s3://lake/delta", storage_conn_id=connections)
    assert "storage_conn_id" in operator.template_fields
    snapshot = VerifySnapshot("slot", Lsn(5), "s3://lake/staging/slot/verify/pgdecode_verify_ab/0-5", ("public.t",))
    hook = operator.get_hook(snapshot, "/tmp/report.json", object_store_settings(connections))
    command = hook._build_spark_submit_command(str(SPARK_JOB_ENTRY))
    assert hadoop_aws_maven_coordinates() in command[command.index("--packages") + 1]
    assert SECRET not in " ".join(command)
    assert hook._env is not None and hook._env["AWS_SECRET_ACCESS_KEY"] == SECRET
