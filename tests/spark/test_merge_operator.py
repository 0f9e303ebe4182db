"""The merge operator with a real spark-submit: a refused batch fails the task for good when
parking is off (``--no-park``; by default the refused table is parked, tests/operators/test_parking.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from tests.spark.staged import TableChanges, write_batch

pytestmark = pytest.mark.spark


def test_a_batch_the_job_refuses_fails_without_retry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    keyless = TableChanges("public", "keyless", [("a", "integer", pa.int32())], key=())
    keyless.insert(100, a=1)
    batch = write_batch(tmp_path / "staging", "slot_refused", 10, 100, [keyless])
    operator = PgDecodeMergeOperator(
        task_id="merge", batch_paths=batch, delta_root=str(tmp_path / "delta"), merge_args=["--no-park"]
    )
    with pytest.raises(AirflowFailException, match="job refused: MergeInputError: .*keyless"):
        operator.execute({})
    assert not (tmp_path / "delta" / "public" / "keyless").exists()
