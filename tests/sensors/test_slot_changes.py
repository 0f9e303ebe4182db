"""The changes sensor against a real slot: what counts as a change, deferral, and its failures."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import check_slot_changes
from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
from airflow_provider_pgdecode.triggers.slot_changes import SlotChangesTrigger

pytestmark = pytest.mark.postgres


def new_table(conn: psycopg.Connection[Any]) -> str:
    name = f"sc_{uuid.uuid4().hex[:10]}"
    conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY)")
    return name


def test_empty_transactions_and_heartbeats_are_not_changes(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    table = new_table(pg_conn)
    sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        assert sensor.poke({}).is_done is False

        pg_conn.execute("SELECT txid_current()")  # a transaction with an xid and a commit record, no change
        hook.emit_heartbeat()
        done, report = check_slot_changes(hook, slot_name)
        assert done is False
        assert report["lag_bytes"] > 0 and report["changes"] == 0 and report["heartbeats"] == 1
        assert sensor.poke({}).is_done is False

        pg_conn.execute(f"INSERT INTO {table} VALUES (1), (2)")
        returned = sensor.poke({})
        assert returned.is_done is True
        report = returned.xcom_value
        assert report["slot_name"] == slot_name
        assert report["changes"] == 2 and report["heartbeats"] == 1
        assert report["first_change_lsn"] is not None and "change row(s) pending" in report["reason"]
        json.dumps(report)

        # Thresholds: not probed below min_lag_bytes; a small probe stops early but still sees the change.
        lazy = PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name, min_lag_bytes=1 << 40)
        assert lazy.poke({}).is_done is False
        done, report = check_slot_changes(hook, slot_name, min_lag_bytes=1 << 40)
        assert done is False and "not probed" in report["reason"] and report["changes"] == 0
        assert check_slot_changes(hook, slot_name, probe_rows=1)[0] is True


def test_heartbeats_count_when_the_slot_must_advance(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        hook.emit_heartbeat()
        assert check_slot_changes(hook, slot_name)[0] is False
        # The slot retains more WAL than advance_lag_bytes, and a heartbeat lets it move.
        done, report = check_slot_changes(hook, slot_name, advance_lag_bytes=1)
        assert done is True and "retains" in report["reason"]
        assert check_slot_changes(hook, slot_name, advance_lag_bytes=1 << 40)[0] is False
        # A probe filled with heartbeats cannot rule changes out: an extract moves past them.
        hook.emit_heartbeat()
        hook.emit_heartbeat()
        done, report = check_slot_changes(hook, slot_name, probe_rows=2)
        assert done is True and report["heartbeats"] == 2 and "heartbeat message(s) pending" in report["reason"]


def test_missing_slot_fails_at_once(source_conn: str, slot_name: str) -> None:
    sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name, timeout=60, poke_interval=1)
    with pytest.raises(AirflowFailException, match=f"replication slot '{slot_name}' does not exist"):
        sensor.execute({})


def test_deferrable_sensor_defers_to_the_trigger_only_when_needed(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    sensor = PgDecodeSlotChangesSensor(
        task_id="wait", slot_name=slot_name, deferrable=True, poke_interval=5, timeout=600, advance_lag_bytes=1 << 30
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout == timedelta(seconds=600)
    trigger = deferred.value.trigger
    assert isinstance(trigger, SlotChangesTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider_pgdecode.triggers.slot_changes.SlotChangesTrigger"
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert kwargs["slot_name"] == slot_name and kwargs["postgres_conn_id"] == "pgdecode_default"
    assert kwargs["poll_interval"] == 5 and kwargs["advance_lag_bytes"] == 1 << 30

    pg_conn.execute(f"INSERT INTO {table} VALUES (1)")
    report = sensor.execute({})  # changes already there: no deferral
    assert report["changes"] == 1


def test_execute_complete() -> None:
    sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name="s1", deferrable=True)
    event = {"status": "success", "reason": "1+ change row(s) pending", "changes": 1}
    assert sensor.execute_complete({}, event) == event
    with pytest.raises(AirflowFailException, match="does not exist"):
        sensor.execute_complete({}, {"status": "error", "fatal": True, "message": "slot 's1' does not exist"})
    with pytest.raises(AirflowException, match="connection refused") as caught:
        sensor.execute_complete({}, {"status": "error", "fatal": False, "message": "connection refused"})
    assert not isinstance(caught.value, AirflowFailException)  # retries apply
    with pytest.raises(AirflowException, match="no event"):
        sensor.execute_complete({}, None)


def test_pgoutput_slot_is_probed_with_its_publication(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    table = new_table(pg_conn)
    other = new_table(pg_conn)
    publication = f"pub_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE PUBLICATION {publication} FOR TABLE {table}")
    try:
        with PgDecodeHook() as hook:
            hook.create_slot(slot_name, plugin="pgoutput")
            hook.emit_heartbeat()
            pg_conn.execute(f"INSERT INTO {other} VALUES (1)")  # not published: not a change
            done, report = check_slot_changes(hook, slot_name, publication=publication)
            assert done is False and report["heartbeats"] == 1 and report["changes"] == 0
            pg_conn.execute(f"INSERT INTO {table} VALUES (1)")
            done, report = check_slot_changes(hook, slot_name, publication=publication)
            assert done is True and report["changes"] == 1
        sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name)
        with pytest.raises(AirflowFailException, match="uses pgoutput: probing it for changes needs the publication"):
            sensor.poke({})
    finally:
        pg_conn.execute(f"DROP PUBLICATION {publication}")


def test_pgoutput_probe_decodes_every_builtin_type(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    """Geometric, range, multirange and macaddr8 columns: pgoutput sends no Type message for
    built-in types, and the probe named none of these, so it failed and the cycle's sensor,
    soft-failing, skipped every run while the slot's lag grew (issue 35). It counts them now."""
    table = f"sc_types_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(
        f"CREATE TABLE {table} (id int PRIMARY KEY, p point, c circle, b box, l line, s lseg, pa path,"
        " pg polygon, m8 macaddr8, r int4range, mr int8multirange, ms macaddr[], bits bit(3)[], rs tsrange[])"
    )
    publication = f"pub_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE PUBLICATION {publication} FOR TABLE {table}")
    try:
        with PgDecodeHook() as hook:
            hook.create_slot(slot_name, plugin="pgoutput")
            pg_conn.execute(
                f"INSERT INTO {table} VALUES (1, '(1,2)', '<(0,0),1>', '((0,0),(1,1))', '{{1,-1,0}}', '[(0,0),(1,1)]',"
                " '((0,0),(1,1),(2,0))', '((0,0),(1,1),(2,0))', '08:00:2b:01:02:03:04:05', '[1,5)',"
                " '{[1,3), [7,9)}', '{08:00:2b:01:02:03}', '{101,010}', '{\"[2026-01-01,2026-02-01)\"}')"
            )
            done, report = check_slot_changes(hook, slot_name, publication=publication)
            assert done is True and report["changes"] == 1, report
            sensor = PgDecodeSlotChangesSensor(
                task_id="wait", slot_name=slot_name, publication=publication, skip_on_timeout=True
            )
            returned = sensor.poke({})
            assert returned.is_done is True and returned.xcom_value["changes"] == 1
    finally:
        pg_conn.execute(f"DROP PUBLICATION {publication}")


def test_only_the_timeout_skips_an_error_fails(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    """skip_on_timeout: no change within the timeout skips the cycle; a slot the sensor cannot read
    fails it, never skips it. soft_fail, which would skip on a failure, is refused."""
    from airflow.sdk.exceptions import AirflowSkipException

    from airflow_provider_pgdecode.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="skip_on_timeout=True"):
        PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name, soft_fail=True)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    idle = PgDecodeSlotChangesSensor(
        task_id="wait", slot_name=slot_name, timeout=1, poke_interval=0.2, skip_on_timeout=True, deferrable=False
    )
    with pytest.raises(AirflowSkipException, match=f"no change in slot '{slot_name}' within 1 s"):
        idle.execute({})
    missing = PgDecodeSlotChangesSensor(
        task_id="wait", slot_name=slot_name + "_gone", timeout=1, poke_interval=0.2, skip_on_timeout=True
    )
    with pytest.raises(AirflowFailException, match="does not exist"):
        missing.execute({})


def test_a_slot_held_by_another_process_is_waited_for(
    source_conn: str, pg_dsn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    import time

    import psycopg2
    import psycopg2.extras

    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {table} VALUES (1)")
    replication = psycopg2.connect(pg_dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)

    def active() -> bool:
        row = pg_conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot_name,)).fetchone()
        return bool(row and row[0])

    try:
        replication.cursor().start_replication(slot_name=slot_name, decode=False)
        deadline = time.monotonic() + 10
        while not active():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with PgDecodeHook() as hook:
            done, report = check_slot_changes(hook, slot_name)
        assert done is False and "in use by another process" in report["reason"]
        assert PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name).poke({}).is_done is False
    finally:
        replication.close()
    deadline = time.monotonic() + 10
    while active():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name).poke({}).is_done is True


def test_a_table_snapshot_request_in_progress_counts_as_work(source_conn: str, slot_name: str, tmp_path: Any) -> None:
    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot, write_snapshot_states

    staging = str(tmp_path)
    sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot_name, staging_root=staging)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    assert sensor.poke({}).is_done is False  # idle database, no request
    request = request_table_snapshot(staging, slot_name, ["public.some_table"], "add-table", request_id="r1")
    returned = sensor.poke({})
    assert returned.is_done is True and "r1" in returned.xcom_value["reason"]
    write_snapshot_states(staging, slot_name, {request.id: {"done": True, "tables": {}}})
    assert sensor.poke({}).is_done is False  # done: nothing to do again


def test_a_snapshot_request_filed_while_deferred_wakes_the_sensor(
    source_conn: str, slot_name: str, tmp_path: Any
) -> None:
    import asyncio

    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

    staging = str(tmp_path)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    sensor = PgDecodeSlotChangesSensor(
        task_id="wait",
        slot_name=slot_name,
        staging_root=staging,
        storage_conn_id="lake",
        deferrable=True,
        poke_interval=0.1,
        timeout=600,
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})  # an idle slot, no request: defers
    trigger = deferred.value.trigger
    assert isinstance(trigger, SlotChangesTrigger)
    kwargs = trigger.serialize()[1]
    assert (kwargs["staging_root"], kwargs["storage_conn_id"]) == (staging, "lake")  # JSON-able, no secret

    async def run_trigger_and_file_a_request() -> dict[str, Any]:
        events = trigger.run()
        try:
            waiting = asyncio.ensure_future(events.__anext__())
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await asyncio.to_thread(
                request_table_snapshot, staging, slot_name, ["public.orders"], "add-table", request_id="late"
            )
            event = await asyncio.wait_for(waiting, 30)
        finally:
            await events.aclose()
        return dict(event.payload)

    event = asyncio.run(run_trigger_and_file_a_request())
    report = sensor.execute_complete({}, event)
    assert report["status"] == "success" and report["snapshot_requests"] == ["late"]
    assert report["reason"] == "table snapshot request(s) in progress: late"


def test_execute_complete_of_a_snapshot_request_event() -> None:
    sensor = PgDecodeSlotChangesSensor(task_id="wait", slot_name="s1", staging_root="/staging", deferrable=True)
    event = {
        "status": "success",
        "slot_name": "s1",
        "changes": 0,
        "snapshot_requests": ["r1", "r2"],
        "reason": "table snapshot request(s) in progress: r1, r2",
    }
    assert sensor.execute_complete({}, event) == event
    with pytest.raises(AirflowFailException, match="unreadable snapshot request file"):
        sensor.execute_complete(
            {}, {"status": "error", "fatal": True, "message": "unreadable snapshot request file /staging/s1/x.json"}
        )


@pytest.mark.parametrize("setting", ["True", "False"])
def test_deferrable_follows_airflows_default_deferrable_setting(setting: str) -> None:
    """Airflow's ``[operators] default_deferrable`` decides when the DAG does not say: wherever a
    triggerer runs, a waiting cycle holds no worker slot. Read when the sensor module is imported,
    as Airflow's own providers do, so a fresh interpreter sees each setting."""
    import os
    import subprocess
    import sys

    code = (
        "from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor as S\n"
        "print(S(task_id='w', slot_name='s').deferrable, S(task_id='x', slot_name='s', deferrable=False).deferrable)"
    )
    env = {**os.environ, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split()[-2:] == [setting, "False"]
