"""The maintenance operator: its job arguments from rendered params, and a refused table failing the
task without a retry through both Spark paths (spark-submit and the session's Spark Connect server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.operators.maintenance import PgDecodeDeltaMaintenanceOperator


def test_the_job_arguments_from_rendered_params() -> None:
    operator = PgDecodeDeltaMaintenanceOperator(task_id="m", delta_root="/data/delta")
    assert operator.job_args() == ["--delta-root", "/data/delta", "--min-txn-retention-hours", "720"]
    # what render_template_as_native_obj=False leaves: text
    operator = PgDecodeDeltaMaintenanceOperator(
        task_id="m",
        delta_root="/data/delta",
        tables='["public.orders", "public.items"]',
        zorder="True",
        optimize="False",
        retention_hours="None",
        allow_short_retention="false",
        maintenance_args=["--optimize-attempts", "5"],
    )
    assert operator.job_args("/tmp/s.json") == [
        *("--delta-root", "/data/delta", "--table", "public.orders", "--table", "public.items"),
        *("--no-optimize", "--zorder", "--min-txn-retention-hours", "720"),
        *("--summary-json", "/tmp/s.json", "--optimize-attempts", "5"),
    ]
    operator = PgDecodeDeltaMaintenanceOperator(
        task_id="m",
        delta_root="s3://lake/delta",
        tables=[],
        retention_hours=0,
        allow_short_retention=True,
        vacuum=False,
    )
    assert operator.job_args() == [
        *("--delta-root", "s3://lake/delta", "--no-vacuum", "--retention-hours", "0"),
        *("--allow-short-retention", "--min-txn-retention-hours", "720"),
    ]


@pytest.mark.spark
@pytest.mark.parametrize("path", ["spark-connect", "spark-submit"])
def test_a_refused_table_fails_the_task_without_retry(
    path: str, spark_connect_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_pgdecode.spark.merge_job import merge_batches
    from airflow_provider_pgdecode.spark.session import build_connect_session
    from tests.spark.staged import TableChanges, write_batch

    delta = tmp_path / "delta"
    connect = build_connect_session(spark_connect_server.url)
    try:
        table = TableChanges("public", "mt_op", [("id", "integer", pa.int32()), ("v", "text", pa.string())])
        table.insert(150, id=1, v="a")
        merge_batches(connect, [write_batch(tmp_path / "staging", "slot_op", 10, 200, [table])], str(delta))
    finally:
        connect.stop()
    log = delta / "public" / "mt_op" / "_delta_log"
    commits = sorted(p.name for p in log.iterdir())
    if path == "spark-connect":
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connect_server.airflow_conn_json)
    else:
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    operator = PgDecodeDeltaMaintenanceOperator(task_id="maintenance", delta_root=str(delta), retention_hours=24)
    with pytest.raises(AirflowFailException, match=r"table public\.mt_op .*24 hours .*allow_short_retention"):
        operator.execute({})
    assert sorted(p.name for p in log.iterdir()) == commits  # nothing written
    if path == "spark-connect":  # a table named that is not there: final too, and says what to check
        operator = PgDecodeDeltaMaintenanceOperator(
            task_id="maintenance", delta_root=str(delta), tables=["public.nope"]
        )
        with pytest.raises(AirflowFailException, match=r"no Delta table at .*public/nope.*schema\.table"):
            operator.execute({})
