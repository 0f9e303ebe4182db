"""Quiet, useful task logs: a real spark-submit merge through the operator logs none of Spark's INFO
lines by default (spark/log4j2.properties at [pgdecode] spark_log_level), and the task log has the
merge's one line per table and its total."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from tests.conftest import _fetch_delta_jars
from tests.spark.staged import TableChanges, write_batch
from tests.spark.test_connect import RecordingLog, _spark_info_lines

pytestmark = pytest.mark.spark


def test_spark_submit_merge_logs_no_spark_info_and_one_line_per_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fetch_delta_jars()
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.delenv("AIRFLOW__PGDECODE__SPARK_LOG_LEVEL", raising=False)
    monkeypatch.delenv("PGDECODE_SPARK_LOG_LEVEL", raising=False)
    tables = []
    for name in ("orders", "customers"):
        changes = TableChanges("public", name, [("id", "integer", pa.int32()), ("v", "text", pa.string())])
        for i in range(1, 11):
            changes.insert(100 + i, id=i, v=f"{name} {i}")
        tables.append(changes)
    batch = write_batch(tmp_path / "staging", "pgdecode_quiet", 100, 200, tables)

    submit_output: list[str] = []
    original = SparkSubmitHook._process_spark_submit_log

    def recording(self: SparkSubmitHook, itr: Iterator[Any]) -> None:
        def lines() -> Iterator[Any]:
            for line in itr:
                submit_output.append(str(line).rstrip("\n"))
                yield line

        original(self, lines())

    monkeypatch.setattr(SparkSubmitHook, "_process_spark_submit_log", recording)
    task_log = RecordingLog()
    monkeypatch.setattr(PgDecodeMergeOperator, "log", property(lambda self: task_log))

    result = PgDecodeMergeOperator(task_id="merge", batch_paths=batch, delta_root=str(tmp_path / "delta")).execute({})

    assert result["summary"]["tables"]["public.orders"]["status"] == "merged"
    assert any("PGDECODE_MERGE_SUMMARY" in line for line in submit_output), submit_output[-20:]
    assert not _spark_info_lines(submit_output), _spark_info_lines(submit_output)[:10]
    assert any(
        line.startswith("table public.orders: merged, 10 inserted, 0 updated, 0 deleted") for line in task_log.lines
    )
    assert any(line.startswith("table public.customers: merged, 10 inserted") for line in task_log.lines)
    assert any(line.startswith("merge total: 2 of 2 table(s) merged, 20 inserted") for line in task_log.lines)
