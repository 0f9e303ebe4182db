"""The merge job with batches and Delta tables on S3-compatible storage (the local moto server of
the ``s3_server`` fixture), through real Spark (s3a://, hadoop-aws) and real Delta.

Batches are staged locally by the helpers of :mod:`tests.spark.staged`, then uploaded with the
storage layer, manifest last, as the extract commits a batch on object storage.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage
from airflow_provider_pgdecode.errors import BatchError
from airflow_provider_pgdecode.spark.delta_state import app_id, read_delta_state
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from pgdecode_testing.s3_server import ACCESS_KEY, REGION, SECRET_KEY, LocalS3Server
from tests.spark.staged import UNCHANGED, Model, TableChanges, write_batch

pytestmark = [pytest.mark.spark, pytest.mark.s3]

SLOT = "pgdecode_s3"
ORDERS = [("id", "integer", pa.int32()), ("note", "text", pa.string()), ("amount", "numeric(10,2)", pa.string())]


@pytest.fixture
def s3_env(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> ObjectStoreSettings:
    """The server's settings as the ``AWS_*`` environment, which is how the job gets them."""
    settings = s3_server.settings
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    return settings


def upload(local_batch: str, bucket: str, settings: ObjectStoreSettings) -> str:
    """Copy a locally staged batch to ``<bucket>/staging/<slot>/<name>``, manifest last."""
    staging = Storage(f"{bucket}/staging", settings)
    relative = f"{SLOT}/{Path(local_batch).name}"
    staging.upload_tree(local_batch, relative, last="manifest.json")
    return staging.uri(relative)


def batches(root: Path) -> tuple[list[str], list[TableChanges]]:
    first = TableChanges("public", "orders", ORDERS)
    for i in range(1, 31):
        first.insert(100 + i, id=i, note=f"order {i}", amount=f"{i}.50")
    first.update(200, id=1, note=UNCHANGED, amount="99.99").delete(200, id=2)
    second = TableChanges("public", "orders", ORDERS)
    second.update(300, old_key={"id": 3}, id=300, note="key changed", amount="3.00")
    second.truncate(400).insert(500, id=7, note="after truncate", amount=None).insert(500, id=8, note="x", amount="1")
    third = TableChanges("sales", "Customer List", [("id", "bigint", pa.int64()), ("name", "text", pa.string())])
    third.insert(310, id=1, name='ünïcødé, "quoted"').insert(320, id=2, name=None)
    return [
        write_batch(root, SLOT, 100, 250, [first]),
        write_batch(root, SLOT, 250, 510, [second, third]),
    ], [first, second, third]


def delta_rows(spark: Any, path: str) -> list[dict[str, Any]]:
    rows = [r.asDict() for r in spark.read.format("delta").load(path).collect()]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """A merge summary without where things live."""
    keep = ("status", "changes", "inserted", "updated", "deleted", "truncated", "created", "watermark_lsn")
    return {
        "end_lsn": summary["end_lsn"],
        "tables": {name: {k: t[k] for k in keep} for name, t in summary["tables"].items()},
    }


def test_batches_on_s3_merge_into_delta_on_s3_as_they_do_locally(
    spark: Any, tmp_path: Path, s3_bucket: str, s3_env: ObjectStoreSettings
) -> None:
    local, changes = batches(tmp_path / "staging")
    local_summary = merge_batches(spark, local, str(tmp_path / "delta"))
    remote = [upload(batch, s3_bucket, s3_env) for batch in local]
    assert all(uri.startswith(f"{s3_bucket}/staging/") for uri in remote)

    summary = merge_batches(spark, remote, f"{s3_bucket}/delta")

    assert comparable(summary) == comparable(local_summary)
    assert summary["tables"]["public.orders"]["status"] == "merged"
    for schema, table in (("public", "orders"), ("sales", "Customer List")):
        on_s3 = summary["tables"][f"{schema}.{table}"]["delta_path"]
        assert on_s3 == f"s3a://{s3_bucket[len('s3://') :]}/delta/{schema}/{table}"
        assert delta_rows(spark, on_s3) == delta_rows(spark, str(tmp_path / "delta" / schema / table))
    expected = Model().apply(*changes[:2]).state(["id", "note"])
    orders = summary["tables"]["public.orders"]["delta_path"]
    assert sorted(({k: r[k] for k in ("id", "note")} for r in delta_rows(spark, orders)), key=lambda r: r["id"]) == (
        expected
    )
    # The Delta log is on the store, beside the data: nothing of it on the local disk.
    store = Storage(f"{s3_bucket}/delta", s3_env)
    assert "public/orders/_delta_log/00000000000000000000.json" in store.walk_files()

    # Applying the batches again changes nothing (the watermark is read from the Delta log on S3).
    again = merge_batches(spark, remote, f"{s3_bucket}/delta")
    assert {t["status"] for t in again["tables"].values()} == {"skipped"}
    assert delta_rows(spark, orders) == delta_rows(spark, str(tmp_path / "delta" / "public" / "orders"))


def test_a_small_run_on_s3_is_committed_by_delta_rs_as_deltas_merge_would(
    spark: Any, tmp_path: Path, s3_bucket: str, s3_env: ObjectStoreSettings
) -> None:
    local, changes = batches(tmp_path / "staging")
    remote = [upload(batch, s3_bucket, s3_env) for batch in local]
    delta_only = MergeOptions(light_write_max_bytes=0)
    local_summaries = [merge_batches(spark, [batch], str(tmp_path / "delta"), delta_only) for batch in local]
    summaries = [merge_batches(spark, [batch], f"{s3_bucket}/delta") for batch in remote]

    assert [comparable(s) for s in summaries] == [comparable(s) for s in local_summaries]
    orders = summaries[1]["tables"]["public.orders"]
    assert orders["status"] == "merged" and orders["truncated"] is True
    assert delta_rows(spark, orders["delta_path"]) == delta_rows(spark, str(tmp_path / "delta" / "public" / "orders"))
    # The second run (a key change and a TRUNCATE into the existing table) was delta-rs's commit,
    # on the store, with the watermark Delta's readers see.
    log = Storage(f"{s3_bucket}/delta/public/orders/_delta_log", s3_env)
    newest = max(name for name in log.walk_files() if name.endswith(".json"))
    assert '"engineInfo":"delta-rs' in log.read_text(newest)
    assert read_delta_state(spark, orders["delta_path"], app_id(SLOT)).watermark == 510


def test_a_manifest_naming_a_missing_object_fails_and_writes_nothing(
    spark: Any, tmp_path: Path, s3_bucket: str, s3_env: ObjectStoreSettings
) -> None:
    local, _ = batches(tmp_path / "staging")
    remote = [upload(batch, s3_bucket, s3_env) for batch in local]
    lost = "tables/sales/Customer%20List/part-00000.parquet"
    Storage(remote[1], s3_env).delete_file(lost)

    with pytest.raises(BatchError) as failure:
        merge_batches(spark, remote, f"{s3_bucket}/delta")

    message = str(failure.value)
    assert lost in message and remote[1] in message and "extract again" in message
    assert Storage(f"{s3_bucket}/delta", s3_env).walk_files() == []


def test_a_damaged_part_on_s3_fails_before_any_write_naming_it(
    spark: Any, tmp_path: Path, s3_bucket: str, s3_env: ObjectStoreSettings
) -> None:
    local, _ = batches(tmp_path / "staging")
    remote = [upload(batch, s3_bucket, s3_env) for batch in local]
    damaged = "tables/public/orders/part-00000.parquet"
    Storage(remote[1], s3_env).write_bytes(damaged, b"PAR1 not a parquet file")

    with pytest.raises(BatchError, match="staged part .*part-00000.parquet of table public.orders cannot be read"):
        merge_batches(spark, remote, f"{s3_bucket}/delta")

    assert Storage(f"{s3_bucket}/delta", s3_env).walk_files() == []


# --------------------------------------------------------------------------------------------
# The merge operator through spark-submit: the secret key stays in its connection
# --------------------------------------------------------------------------------------------


def test_merge_operator_on_s3_keeps_the_secret_out_of_command_log_event_log_and_xcom(
    tmp_path: Path,
    s3_server: LocalS3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
    from airflow_provider_pgdecode.spark.session import SPARK_JOB_ENTRY

    for name in ObjectStoreSettings.ENV.values():  # the job may get its settings from nowhere else
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.setenv(
        "AIRFLOW_CONN_LAKE",
        json.dumps(
            {
                "conn_type": "aws",
                "login": ACCESS_KEY,
                "password": SECRET_KEY,
                "extra": {"endpoint_url": s3_server.endpoint_url, "region_name": REGION},
            }
        ),
    )
    local, _ = batches(tmp_path / "staging")
    remote = [upload(batch, s3_bucket, s3_server.settings) for batch in local]
    events = tmp_path / "events"
    events.mkdir()
    operator = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=remote,
        delta_root=f"{s3_bucket}/delta",
        storage_conn_id="lake",
        conf={
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": events.as_uri(),
            "spark.eventLog.compress": "false",  # searched as text below
            "spark.sql.shuffle.partitions": "2",
        },
    )
    caplog.set_level(logging.DEBUG)

    result = operator.execute({})

    assert result["summary"]["tables"]["public.orders"]["status"] == "merged"
    assert result["summary"]["tables"]["public.orders"]["delta_path"].startswith("s3a://")
    # The command line spark-submit ran with (what ps shows): hadoop-aws (its coordinates, or its jar
    # once resolved: spark/jars.py), and no credential.
    assert operator._job is not None and operator._job._hook is not None
    command = " ".join(operator._job._hook._build_spark_submit_command(str(SPARK_JOB_ENTRY)))
    assert "org.apache.hadoop:hadoop-aws:" in command or "/org.apache.hadoop_hadoop-aws-" in command
    assert SECRET_KEY not in command
    # The task log (the operator's and the hook's lines, spark-submit's output relayed by the hook).
    captured = capfd.readouterr()
    task_log = caplog.text + captured.out + captured.err
    assert "Spark-Submit cmd" in task_log and "PGDECODE_MERGE_SUMMARY" in task_log
    assert SECRET_KEY not in task_log
    # The Spark event log: written, and without the secret (the Hadoop settings are not SparkConf).
    logs = [p for p in events.rglob("*") if p.is_file()]
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in logs)
    assert "SparkListenerApplicationStart" in text and "s3a://" in text
    assert SECRET_KEY not in text
    # XCom (the return value) and the operator's rendered fields.
    assert SECRET_KEY not in json.dumps(result)
    assert SECRET_KEY not in json.dumps(operator.env_vars) and SECRET_KEY not in json.dumps(operator.conf)
    assert not os.environ.get("AWS_SECRET_ACCESS_KEY")


def test_verify_job_compares_a_copy_on_s3_with_delta_on_s3(
    spark: Any, tmp_path: Path, s3_bucket: str, s3_env: ObjectStoreSettings
) -> None:
    from airflow_provider_pgdecode.spark.verify_job import verify_tables

    local, changes = batches(tmp_path / "staging")
    remote = [upload(batch, s3_bucket, s3_env) for batch in local]
    merge_batches(spark, remote, f"{s3_bucket}/delta")
    # The source as of the last batch's end, staged as inserts (a verify snapshot's shape), one row off.
    copy = TableChanges("public", "orders", ORDERS)
    for row in Model().apply(*changes[:2]).state(["id", "note", "amount"]):
        copy.insert(600, **{**row, "note": "changed" if row["id"] == 7 else row["note"]})
    snapshot = upload(write_batch(tmp_path / "copy", SLOT, 0, 510, [copy]), s3_bucket, s3_env)

    report = verify_tables(spark, snapshot, f"{s3_bucket}/delta", SLOT, "0/1FE", ["public.orders"])

    orders = report["tables"]["public.orders"]
    assert report["equal"] is False and orders["differing_keys"] == 1
    assert orders["keys"][0]["key"] == {"id": 7} and orders["keys"][0]["columns"] == ["note"]
