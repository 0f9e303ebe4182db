"""PgDecodeReplayOperator over batches staged from a real PostgreSQL slot: chains, bounds, refusals."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeEnsureSlotOperator,
    PgDecodeExtractOperator,
    PgDecodeReplayOperator,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def batches(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> list[dict[str, Any]]:
    """Three confirmed batches of one slot, staged by the extract operator, in LSN order."""
    table = f"rp_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot_name).execute(make_context())
    extract = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path / "staging"), tables=[table]
    )
    confirm = PgDecodeConfirmOperator(task_id="confirm", slot_name=slot_name, batch_path="(set per run)")
    checkpoint = None
    staged = []
    for run in range(3):
        pg_conn.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (run,))
        summary = extract.execute(make_context(confirm=checkpoint))
        confirm.batch_path = summary["path"]
        checkpoint = confirm.execute(make_context(merge={"batches": [summary["path"]], "skipped": []}))
        staged.append(summary)
    return staged


def replay(slot: str, root: Path, **bounds: Any) -> PgDecodeReplayOperator:
    return PgDecodeReplayOperator(task_id="replay", slot_name=slot, staging_root=str(root / "staging"), **bounds)


def test_returns_the_retained_chain_between_two_lsns(
    batches: list[dict[str, Any]], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    paths = [b["path"] for b in batches]
    with structlog.testing.capture_logs() as logs:
        everything = replay(slot_name, tmp_path).execute(make_context())
    json.dumps(everything)  # an XCom value
    assert everything == paths
    assert f"replay: 3 batch(es) from {batches[0]['start_lsn']} to {batches[2]['end_lsn']}" in [
        e["event"] for e in logs
    ]
    # empty bounds (unset DAG params render as "") mean the whole retained range
    assert replay(slot_name, tmp_path, start_lsn="", end_lsn="").execute(make_context()) == paths
    tail = replay(slot_name, tmp_path, start_lsn=batches[1]["start_lsn"]).execute(make_context())
    assert tail == paths[1:]
    head = replay(slot_name, tmp_path, end_lsn=batches[1]["end_lsn"]).execute(make_context())
    assert head == paths[:2]
    middle = replay(slot_name, tmp_path, start_lsn=batches[1]["start_lsn"], end_lsn=batches[1]["end_lsn"])
    assert middle.execute(make_context()) == paths[1:2]


def test_a_range_that_is_not_retained_fails_without_retry_and_names_the_lsns(
    batches: list[dict[str, Any]], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    beyond = "FF/0"
    with pytest.raises(AirflowFailException, match=f"end at {batches[2]['end_lsn']}, before {beyond}"):
        replay(slot_name, tmp_path, end_lsn=beyond).execute(make_context())
    with pytest.raises(AirflowFailException, match="no retained batch .* starts at 0/1 .*give a start_lsn"):
        replay(slot_name, tmp_path, start_lsn="0/1").execute(make_context())
    shutil.rmtree(batches[1]["path"])  # a gap, e.g. removed by hand
    with pytest.raises(AirflowFailException, match=f"end at {batches[0]['end_lsn']}"):
        replay(slot_name, tmp_path, end_lsn=batches[2]["end_lsn"]).execute(make_context())


def test_a_malformed_lsn_or_nothing_staged_fails_without_retry(
    slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    with pytest.raises(AirflowFailException, match="start_lsn: not an LSN .*leave it empty"):
        replay(slot_name, tmp_path, start_lsn="16-B374").execute(make_context())
    with pytest.raises(AirflowFailException, match=f"no retained batch of slot '{slot_name}'"):
        replay(slot_name, tmp_path).execute(make_context())
