"""SlotChangesEventTrigger: JSON-only arguments, an Asset of its own, and one event per pending
position of a real slot, which it never advances."""

from __future__ import annotations

import asyncio
import importlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from airflow.triggers.base import BaseEventTrigger

from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.triggers.slot_changes import SlotChangesTrigger
from airflow_provider_pgdecode.triggers.slot_event import (
    STATE_KEY,
    SlotChangesEventTrigger,
    should_fire,
    slot_asset,
)
from pgdecode_testing.postgres_cluster import ThrowawayCluster


@pytest.fixture
def source_conn(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    return "pgdecode_default"


class Events:
    """The events of a running trigger, collected by a background task."""

    def __init__(self, trigger: SlotChangesEventTrigger) -> None:
        self.trigger = trigger
        self.payloads: list[dict[str, Any]] = []
        self._stream: AsyncIterator[Any] = trigger.run()
        self._task = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        async for event in self._stream:
            self.payloads.append(dict(event.payload))

    async def wait_for(self, count: int, timeout: float = 20) -> list[dict[str, Any]]:
        for _ in range(int(timeout / 0.05)):
            if len(self.payloads) >= count or self._task.done():
                break
            await asyncio.sleep(0.05)
        if self._task.done():
            self._task.result()  # raises what the trigger raised
        assert len(self.payloads) >= count, f"{len(self.payloads)} event(s) after {timeout}s: {self.payloads}"
        return self.payloads

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class MemoryStore:
    """The watched Asset's state store as the triggerer hands it over (``aget``/``aset``); the
    real one talks to the triggerer's supervisor, which runs in the deployment test."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        json.dumps(value)  # the store keeps JSON
        self.values[key] = value


def test_serialize_round_trips_with_json_only_and_the_hash_names_the_slot() -> None:
    trigger = SlotChangesEventTrigger(
        slot_name="pgdecode_shop",
        postgres_conn_id="src",
        poll_interval=5,
        min_lag_bytes=4096,
        advance_lag_bytes=1 << 30,
        probe_rows=20,
        publication="pub",
        staging_root="s3://lake/staging",
        storage_conn_id="lake",
        refire_interval=None,
    )
    assert isinstance(trigger, BaseEventTrigger)
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is SlotChangesEventTrigger
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert cls(**kwargs).serialize() == (classpath, kwargs)
    assert kwargs["refire_interval"] is None and kwargs["poll_interval"] == 5.0
    # Watchers of two slots are two triggers; the same arguments are the same trigger.
    other = SlotChangesEventTrigger(**{**kwargs, "slot_name": "pgdecode_other"}).serialize()
    assert BaseEventTrigger.hash(classpath, kwargs) == BaseEventTrigger.hash(*cls(**kwargs).serialize())
    assert BaseEventTrigger.hash(classpath, kwargs) != BaseEventTrigger.hash(*other)
    # Its probe is the changes sensor's, with the same arguments.
    probe = trigger.changes_trigger()
    assert isinstance(probe, SlotChangesTrigger)
    assert {k: v for k, v in probe.serialize()[1].items()} == {
        k: v for k, v in kwargs.items() if k != "refire_interval"
    }
    with pytest.raises(ValueError, match="poll_interval of the trigger of slot 'x' must be positive"):
        SlotChangesEventTrigger(slot_name="x", poll_interval=0)


def test_the_slot_asset_is_watched_by_the_trigger_of_that_slot() -> None:
    asset = slot_asset("shop", postgres_conn_id="db")
    assert (asset.name, asset.uri, asset.group) == ("pgdecode_slot_shop", "pgdecode-slot://db/shop", "pgdecode")
    (watcher,) = asset.watchers
    assert isinstance(watcher.trigger, SlotChangesEventTrigger)
    assert (watcher.trigger.slot_name, watcher.trigger.postgres_conn_id) == ("shop", "db")
    with pytest.raises(ValueError, match="the Asset of slot 'shop' is watched by a trigger of slot 'other'"):
        slot_asset("shop", trigger=SlotChangesEventTrigger(slot_name="other"))


def test_should_fire_once_per_pending_position() -> None:
    report = {"confirmed_flush_lsn": "0/100", "changes": 3}
    assert should_fire(report, None, 0.0, 60) == "first changes seen"
    fired = {"status": "success", "confirmed_flush_lsn": "0/100", "changes": 3, "fired_at": 1000.0}
    assert should_fire(report, fired, 1010.0, 60) == ""  # the same changes, not yet confirmed
    assert should_fire({**report, "changes": 2}, fired, 1010.0, 60) == ""
    assert "new changes arrived" in should_fire({**report, "changes": 5}, fired, 1010.0, 60)
    assert "confirmed past 0/100" in should_fire({**report, "confirmed_flush_lsn": "0/200"}, fired, 1010.0, 60)
    assert "did the run fail?" in should_fire(report, fired, 1060.0, 60)
    assert should_fire(report, fired, 1e9, None) == ""  # refire_interval None: never by time
    assert should_fire(report, {**fired, "status": "error"}, 1010.0, 60) == "first changes seen"


def slot_lsn(conn: psycopg.Connection[Any], slot: str) -> str:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return row.fetchone()[0]  # type: ignore[index]


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_one_event_per_pending_position_and_the_slot_is_never_advanced(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    table = f"ev_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        hook.emit_heartbeat()  # not a change
    created_at = slot_lsn(pg_conn, slot_name)
    store = MemoryStore()
    trigger = SlotChangesEventTrigger(slot_name=slot_name, poll_interval=0.05, refire_interval=None)
    trigger.asset_state_store = store  # type: ignore[assignment]
    events = Events(trigger)
    try:
        await asyncio.sleep(0.5)
        assert events.payloads == []  # only a heartbeat
        await asyncio.to_thread(pg_conn.execute, f"INSERT INTO {table} VALUES (1)")
        (first,) = await events.wait_for(1)
        assert first["status"] == "success" and first["fire_reason"] == "first changes seen"
        assert first["changes"] == 1 and first["confirmed_flush_lsn"] == created_at
        json.dumps(first)
        await asyncio.sleep(0.5)  # about ten polls: the same changes fire nothing more
        assert len(events.payloads) == 1
        assert store.values[STATE_KEY]["confirmed_flush_lsn"] == created_at

        # new changes before a run confirmed the first ones: one more event
        await asyncio.to_thread(pg_conn.execute, f"INSERT INTO {table} VALUES (2)")
        second = (await events.wait_for(2))[1]
        assert second["changes"] == 2 and "new changes arrived" in second["fire_reason"]
        await asyncio.sleep(0.5)
        assert len(events.payloads) == 2
        assert slot_lsn(pg_conn, slot_name) == created_at  # the trigger never moves the slot

        # a confirm (what the DAG's confirm task does) with nothing left: quiet
        await asyncio.to_thread(
            pg_conn.execute, "SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot_name,)
        )
        confirmed = slot_lsn(pg_conn, slot_name)
        await asyncio.sleep(0.5)
        assert len(events.payloads) == 2
        # changes beyond the confirmed position: the next cycle's event
        await asyncio.to_thread(pg_conn.execute, f"INSERT INTO {table} VALUES (3)")
        third = (await events.wait_for(3))[2]
        assert third["confirmed_flush_lsn"] == confirmed and third["changes"] == 1
        assert f"confirmed past {created_at}" in third["fire_reason"]
    finally:
        await events.close()

    # A restarted triggerer (a new instance, the same Asset state) does not fire for them again.
    again = SlotChangesEventTrigger(slot_name=slot_name, poll_interval=0.05, refire_interval=None)
    again.asset_state_store = store  # type: ignore[assignment]
    events = Events(again)
    try:
        await asyncio.sleep(0.5)
        assert events.payloads == []
    finally:
        await events.close()
    # Without the state, a new instance fires once for the pending changes.
    events = Events(SlotChangesEventTrigger(slot_name=slot_name, poll_interval=0.05))
    try:
        (fresh,) = await events.wait_for(1)
        assert fresh["confirmed_flush_lsn"] == confirmed
        await asyncio.sleep(0.3)
        assert len(events.payloads) == 1
    finally:
        await events.close()
    assert slot_lsn(pg_conn, slot_name) == confirmed


@pytest.mark.postgres
@pytest.mark.asyncio
async def test_a_missing_slot_fires_once_so_that_a_run_creates_it(source_conn: str, slot_name: str) -> None:
    events = Events(SlotChangesEventTrigger(slot_name=slot_name, poll_interval=0.05))
    try:
        (event,) = await events.wait_for(1)
        assert event["status"] == "error" and event["slot_name"] == slot_name
        assert f"replication slot '{slot_name}' does not exist" in event["message"]
        await asyncio.sleep(0.4)
        assert len(events.payloads) == 1  # once per distinct error, not once per poll
        with PgDecodeHook() as hook:
            await asyncio.to_thread(hook.ensure_slot, slot_name)
        await asyncio.sleep(0.4)
        assert len(events.payloads) == 1  # a new slot without changes: quiet
    finally:
        await events.close()


@pytest.mark.asyncio
async def test_an_unreachable_database_is_retried_not_fired(unreachable_conn: Any) -> None:
    conn_id, _ = unreachable_conn("postgres")
    events = Events(SlotChangesEventTrigger(slot_name="s1", postgres_conn_id=conn_id, poll_interval=0.05))
    try:
        await asyncio.sleep(1.0)
        assert events.payloads == []
        assert not events._task.done()  # still polling
    finally:
        await events.close()
