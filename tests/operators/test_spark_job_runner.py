"""One room runs pgdecode's Spark jobs (hooks/spark_job.py): one place decides spark-submit or
Spark Connect, and one table turns a job's refusal into the task's error (issue 36)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from airflow_provider_pgdecode.errors import (
    ConfigurationError,
    MaintenanceError,
    MaintenanceRefusedError,
    MergeInputError,
    MergeOutOfMemoryError,
    VerifyError,
    is_deterministic,
)
from airflow_provider_pgdecode.hooks.spark_job import REFUSAL_ERRORS, refusal_error

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_provider_pgdecode"
AIRFLOW_LAYER = ("operators", "hooks", "sensors", "triggers", "utils", "example_dags")


def test_one_place_decides_spark_submit_or_spark_connect() -> None:
    deciding = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for folder in AIRFLOW_LAYER
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"SPARK_CONNECT_CONN_TYPE\b.*==|==\s*SPARK_CONNECT_CONN_TYPE|\bconnect_session\(", line)
        and not line.lstrip().startswith(("def ", "#", '"', "``"))
    ]
    assert deciding and all(entry.startswith("hooks/spark_job.py:") for entry in deciding), deciding


@pytest.mark.parametrize(
    ("job", "kind", "expected", "wording"),
    [
        ("merge", "MergeInputError", MergeInputError, "the merge job refused: MergeInputError: it said so"),
        ("merge", "MergeOutOfMemoryError", MergeOutOfMemoryError, "it said so (this task: conf={})"),
        ("verify", "VerifyError", VerifyError, "the verify job refused: VerifyError: it said so"),
        ("maintenance", "MaintenanceRefusedError", MaintenanceRefusedError, "it said so"),
        ("maintenance", "MaintenanceError", MaintenanceError, "it said so"),
        ("maintenance", "ValueError", ConfigurationError, "the maintenance job refused: ValueError: it said so"),
    ],
)
def test_one_table_turns_each_refusal_into_a_deterministic_error(job, kind, expected, wording) -> None:
    detail = "this task: conf={}" if job == "merge" else None
    error = refusal_error(job, {"error": kind, "message": "it said so"}, detail)
    assert type(error) is expected and str(error) == wording
    assert is_deterministic(error)  # a refusal left the job's output unchanged: no retry


def test_a_refusal_s_own_detail_wins() -> None:
    refusal = {"error": "MergeOutOfMemoryError", "message": "out", "detail": "this task: conf={'a': 1}"}
    assert str(refusal_error("merge", refusal, "ignored")) == "out (this task: conf={'a': 1})"
    assert set(REFUSAL_ERRORS) == {"merge", "verify", "maintenance"}
