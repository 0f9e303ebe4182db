"""The verify operator's own parts: reading the snapshot XCom, the failure message, the Asset.

The operator end to end (spark-submit, report, Asset event, failure on a difference) runs in
tests/dags/test_pgdecode_verify.py.
"""

from __future__ import annotations

import pytest

from airflow_provider_pgdecode.capture.verify import VerifySnapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.operators.verify import (
    PgDecodeVerifyOperator,
    mismatch_message,
    parse_snapshot,
    verify_asset,
)

SNAPSHOT = VerifySnapshot(
    "pgdecode_shop", Lsn.parse("0/1A2B3C8"), "/data/staging/pgdecode_shop/verify/pgdecode_verify_ab/0-1", ("public.a",)
)


def test_the_snapshot_is_read_from_a_dict_or_its_rendering() -> None:
    data = SNAPSHOT.to_dict()
    assert parse_snapshot(data) == SNAPSHOT
    assert parse_snapshot(str(data)) == SNAPSHOT  # a template rendered without native objects
    with pytest.raises(ConfigurationError, match="not a verify snapshot.*PgDecodeVerifySnapshotOperator"):
        parse_snapshot("None")


def test_the_failure_names_tables_keys_columns_and_the_way_forward() -> None:
    report = {
        "slot": "pgdecode_shop",
        "lsn": "0/1A2B3C8",
        "equal": False,
        "differing_tables": ["public.a", "public.b"],
        "tables": {
            "public.a": {
                "equal": False,
                "source_rows": 10,
                "delta_rows": 9,
                "differing_keys": 7,
                "keys": [
                    {"key": {"id": 3}, "difference": "rows differ", "columns": ["name", "amount"]},
                    {"key": {"id": 4}, "difference": "missing in Delta"},
                ],
            },
            "public.b": {"equal": False, "error": "table public.b column 'x' changed type", "keys": []},
        },
    }
    message = mismatch_message(report, "/r.json")
    assert message.startswith("Delta differs from PostgreSQL as of LSN 0/1A2B3C8 (slot 'pgdecode_shop')")
    assert 'public.a: 10 rows in PostgreSQL, 9 in Delta, 7 differing key(s): {"id": 3} (rows differ: name, amount)' in (
        message
    )
    assert '{"id": 4} (missing in Delta) and 5 more' in message
    assert "public.b: cannot be compared (table public.b column 'x' changed type)" in message
    assert "Full report: /r.json" in message
    assert '{"mode": "resnapshot", "tables": ["public.a", "public.b"]}' in message


def test_the_result_asset_is_the_slots_verify_area() -> None:
    asset = verify_asset(SNAPSHOT)
    assert asset.uri == "file:///data/staging/pgdecode_shop/verify"
    assert asset.name == asset.uri  # one Asset for producer and consumers (kept active by Airflow)
    operator = PgDecodeVerifyOperator(task_id="verify", delta_root="/data/delta")
    assert operator.snapshot == "{{ ti.xcom_pull(task_ids='verify_snapshot') }}"
    assert [o.name for o in operator.outlets] == ["pgdecode_verify"]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("path", ["spark-submit", "spark-connect"])
def test_a_refusal_of_the_job_fails_without_retry_and_drops_the_copy(
    request, path, tmp_path, monkeypatch, spark
) -> None:
    import json

    import pyarrow as pa
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_pgdecode.spark.merge_job import merge_batches
    from tests.spark.staged import TableChanges, write_batch

    if path == "spark-connect":  # the job's core in this process, a client session of the server
        server = request.getfixturevalue("spark_connect_server")
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", server.airflow_conn_json)
    else:
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    staging, delta = tmp_path / "staging", str(tmp_path / "delta")

    def items(lsn: int) -> TableChanges:
        table = TableChanges("public", "items", [("id", "integer", pa.int32()), ("v", "text", pa.string())])
        table.insert(lsn, id=1, v="a")
        return table

    # Delta holds changes through LSN 200; the copy is as of LSN 100.
    merge_batches(spark, [write_batch(staging, "slot_a", 10, 200, [items(150)])], delta)
    copy = write_batch(staging / "slot_a" / "verify", "pgdecode_verify_0123", 0, 100, [items(100)])
    snapshot = VerifySnapshot("slot_a", Lsn(100), copy, ("public.items",))
    operator = PgDecodeVerifyOperator(task_id="verify", snapshot=snapshot.to_dict(), delta_root=delta)
    with pytest.raises(AirflowFailException, match=r"refused: VerifyError: .*public\.items .*Run the verify again"):
        operator.execute({})
    assert not (staging / "slot_a" / "verify" / "pgdecode_verify_0123").exists()
