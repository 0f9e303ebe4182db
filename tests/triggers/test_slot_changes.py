"""SlotChangesTrigger: serialization, events from a real slot, and an event loop that never blocks."""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import uuid
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import classify_pgoutput_rows, classify_text_rows
from airflow_provider_pgdecode.triggers import slot_changes
from airflow_provider_pgdecode.triggers.slot_changes import SlotChangesTrigger
from pgdecode_testing.postgres_cluster import ThrowawayCluster


@pytest.fixture
def source_conn(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    return "pgdecode_default"


async def first_event(trigger: SlotChangesTrigger, timeout: float = 20) -> dict[str, Any]:
    events = trigger.run()
    try:
        event = await asyncio.wait_for(events.__anext__(), timeout)
    finally:
        await events.aclose()
    return dict(event.payload)


def test_serialize_round_trips_with_json_only() -> None:
    trigger = SlotChangesTrigger(
        slot_name="pgdecode_shop",
        postgres_conn_id="src",
        poll_interval=15,
        min_lag_bytes=1024,
        advance_lag_bytes=1 << 30,
        probe_rows=50,
        heartbeat_prefix="hb",
        publication="pub",
        staging_root="s3://lake/staging",
        storage_conn_id="lake",
    )
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is SlotChangesTrigger
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert kwargs == {
        "slot_name": "pgdecode_shop",
        "postgres_conn_id": "src",
        "poll_interval": 15.0,
        "min_lag_bytes": 1024,
        "advance_lag_bytes": 1 << 30,
        "probe_rows": 50,
        "heartbeat_prefix": "hb",
        "publication": "pub",
        "staging_root": "s3://lake/staging",
        "storage_conn_id": "lake",
    }
    assert cls(**kwargs).serialize() == (classpath, kwargs)
    # Triggers serialized before staging_root existed still load.
    old_kwargs = {k: v for k, v in kwargs.items() if k not in ("staging_root", "storage_conn_id")}
    assert cls(**old_kwargs).serialize()[1] == {**old_kwargs, "staging_root": None, "storage_conn_id": None}


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_fires_when_a_change_arrives(source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str) -> None:
    table = f"tr_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        hook.emit_heartbeat()  # not a change
    trigger = SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1)
    waiting = asyncio.ensure_future(first_event(trigger))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # only a heartbeat so far
    await asyncio.to_thread(pg_conn.execute, f"INSERT INTO {table} VALUES (1)")
    event = await waiting
    assert event["status"] == "success"
    assert event["slot_name"] == slot_name
    assert event["changes"] == 1 and event["heartbeats"] == 1
    assert event["polls"] >= 2
    assert Lsn.parse(event["first_change_lsn"]) > Lsn.parse(event["confirmed_flush_lsn"])
    json.dumps(event)


async def _wakes_on_a_snapshot_request(trigger: SlotChangesTrigger, file_request: Any) -> dict[str, Any]:
    """Run the trigger on an idle slot, file a request while it waits, and return its event."""
    waiting = asyncio.ensure_future(first_event(trigger, timeout=60))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # an idle slot, no request yet: the trigger keeps polling
    await asyncio.to_thread(file_request)
    return await waiting


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_a_snapshot_request_filed_while_deferred_fires(source_conn: str, slot_name: str, tmp_path: Any) -> None:
    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot, write_snapshot_states

    staging = str(tmp_path / "staging")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        hook.emit_heartbeat()  # WAL moves, but nothing to extract
    trigger = SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1, staging_root=staging)

    def file_request() -> None:
        request_table_snapshot(staging, slot_name, ["public.orders"], "add-table", request_id="r1")

    event = await _wakes_on_a_snapshot_request(trigger, file_request)
    assert event["status"] == "success" and event["slot_name"] == slot_name
    assert event["snapshot_requests"] == ["r1"]
    assert event["reason"] == "table snapshot request(s) in progress: r1"
    assert event["changes"] == 0 and event["polls"] >= 2
    json.dumps(event)

    # A request that is done is not work any more; the same trigger without a staging root never sees requests.
    write_snapshot_states(staging, slot_name, {"r1": {"done": True, "tables": {}}})
    done, report = await asyncio.to_thread(trigger.check)
    assert done is False and "snapshot_requests" not in report
    request_table_snapshot(staging, slot_name, ["public.items"], "add-table", request_id="r2")
    assert (await asyncio.to_thread(trigger.check))[0] is True
    blind = SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1)
    assert (await asyncio.to_thread(blind.check))[0] is False


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_a_snapshot_request_on_object_storage_fires_through_the_storage_connection(
    source_conn: str, slot_name: str, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_pgdecode.batch.storage import Storage
    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot
    from pgdecode_testing.s3_server import SECRET_KEY

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_LAKE", s3_server.airflow_conn_json())
    staging = f"{s3_bucket}/staging"
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    trigger = SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1, staging_root=staging, storage_conn_id="lake")
    assert SECRET_KEY not in json.dumps(trigger.serialize()[1])  # only the connection id travels

    def file_request() -> None:
        request_table_snapshot(Storage(staging, s3_server.settings), slot_name, ["public.orders"], request_id="s3r")

    event = await _wakes_on_a_snapshot_request(trigger, file_request)
    assert event["status"] == "success" and event["snapshot_requests"] == ["s3r"]


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_an_unreadable_snapshot_request_is_a_fatal_error_event(
    source_conn: str, slot_name: str, tmp_path: Any
) -> None:
    requests = tmp_path / slot_name / "snapshot-requests"
    requests.mkdir(parents=True)
    (requests / "broken.json").write_text("{not json")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    event = await first_event(SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1, staging_root=str(tmp_path)))
    assert event["status"] == "error" and event["fatal"] is True
    assert "unreadable snapshot request file" in event["message"] and "broken.json" in event["message"]


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_missing_slot_is_a_fatal_error_event(source_conn: str, slot_name: str) -> None:
    event = await first_event(SlotChangesTrigger(slot_name=slot_name, poll_interval=0.1))
    assert event["status"] == "error" and event["fatal"] is True
    assert f"replication slot '{slot_name}' does not exist" in event["message"]


@pytest.mark.asyncio
async def test_unreachable_database_is_a_retryable_error_event(unreachable_conn: Any) -> None:
    unreachable_conn("postgres")
    event = await first_event(SlotChangesTrigger(slot_name="s1", postgres_conn_id="nowhere"))
    assert event["status"] == "error" and event["fatal"] is False
    assert "checking replication slot 's1' failed" in event["message"]


@pytest.mark.asyncio
async def test_run_never_blocks_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check blocks its thread until a coroutine on the event loop lets it go: if a check
    ran on the loop's thread (or blocked it), that coroutine could never run and the check
    would report that nobody released it."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    entered = asyncio.Queue()  # check number, put from the check's thread through the loop
    release = [threading.Event(), threading.Event()]
    released_by_loop: list[bool] = []
    check_threads: list[int] = []

    def gated_check(hook: Any, slot_name: str, **kwargs: Any) -> tuple[bool, dict[str, Any]]:
        number = len(check_threads)
        check_threads.append(threading.get_ident())
        loop.call_soon_threadsafe(entered.put_nowait, number)
        # Blocks like a slow server. The timeout only keeps a broken trigger from hanging the test.
        released_by_loop.append(release[number].wait(timeout=30))
        return number == 1, {"reason": f"check {number + 1}", "changes": number}

    class NoConnectionHook:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> NoConnectionHook:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(slot_changes, "check_slot_changes", gated_check)
    monkeypatch.setattr(slot_changes, "PgDecodeHook", NoConnectionHook)
    ran_while_blocked: list[bool] = []

    async def gatekeeper() -> None:
        for _ in range(2):
            number = await entered.get()
            for _ in range(5):
                await asyncio.sleep(0)  # other coroutines get their turns meanwhile
            # Check `number` has not returned yet: it is still blocked in its thread.
            ran_while_blocked.append(len(released_by_loop) == number)
            release[number].set()

    keeper = asyncio.ensure_future(gatekeeper())
    try:
        event = await first_event(SlotChangesTrigger(slot_name="s1", poll_interval=0.01), timeout=60)
    finally:
        for gate in release:
            gate.set()
        keeper.cancel()
    assert event == {"status": "success", "polls": 2, "reason": "check 2", "changes": 1}
    assert released_by_loop == [True, True]  # both checks were let go by the loop while they blocked
    assert ran_while_blocked == [True, True]
    assert len(check_threads) == 2 and loop_thread not in check_threads


def test_classify_rows() -> None:
    text_rows = [
        ("0/10", "BEGIN"),
        ("0/11", "table public.t: INSERT: id[integer]:1"),
        ("0/12", "COMMIT"),
        ("0/13", "message: transactional: 0 prefix: pgdecode.heartbeat, sz: 0 content:"),
        ("0/14", "message: transactional: 0 prefix: app, sz: 1 content:x"),
        ("0/15", "PREPARE TRANSACTION 'g1'"),
    ]
    assert classify_text_rows(text_rows) == (3, 1, Lsn.parse("0/11"))
    assert classify_text_rows(text_rows[:1] + text_rows[2:4]) == (0, 1, None)

    def message(transactional: int, prefix: bytes) -> bytes:
        return b"M" + bytes([transactional]) + (0x20).to_bytes(8, "big") + prefix + b"\x00" + (0).to_bytes(4, "big")

    binary_rows = [
        ("0/20", b"B" + bytes(20)),
        # a Relation message (table public.t, one int4 key column id) and an Insert into it
        (
            "0/21",
            b"R"
            + (7).to_bytes(4, "big")
            + b"public\x00t\x00d"
            + (1).to_bytes(2, "big")
            + b"\x01id\x00"
            + (23).to_bytes(4, "big")
            + (-1).to_bytes(4, "big", signed=True),
        ),
        ("0/22", b"I" + (7).to_bytes(4, "big") + b"N" + (1).to_bytes(2, "big") + b"t" + (1).to_bytes(4, "big") + b"1"),
        ("0/23", b"C" + bytes(25)),
        ("0/24", message(0, b"pgdecode.heartbeat")),
        ("0/25", message(1, b"pgdecode.heartbeat")),  # transactional: not a heartbeat
        ("0/26", message(0, b"pgdecode.heartbeat.other")),
    ]
    assert classify_pgoutput_rows(binary_rows) == (3, 1, Lsn.parse("0/22"))
