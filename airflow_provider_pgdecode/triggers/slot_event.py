"""An event trigger for data-aware scheduling: a DAG runs when its replication slot has changes.

Use it in an :class:`~airflow.sdk.AssetWatcher` on an Asset that stands for the slot
(:func:`slot_asset` builds one), and schedule the DAG on that Asset::

    from airflow_provider_pgdecode.triggers.slot_event import SlotChangesEventTrigger, slot_asset

    SLOT = slot_asset(
        "pgdecode_shop",
        postgres_conn_id="shop_db",
        trigger=SlotChangesEventTrigger(slot_name="pgdecode_shop", postgres_conn_id="shop_db", poll_interval=10),
    )
    with DAG(dag_id="shop_cdc", schedule=[SLOT], ...):
        ...

What counts as changes is decided by the changes sensor's own check
(:meth:`~airflow_provider_pgdecode.triggers.slot_changes.SlotChangesTrigger.check`: the slot's
lag first, then a peek of a few rows, never consuming); ``min_lag_bytes``,
``advance_lag_bytes``, ``publication`` and ``staging_root`` mean what they mean there. The
trigger never reads the slot with ``get``, never advances it and never writes to the database:
only the DAG's confirm task moves the slot.

**Firing once per pending position.** The triggerer runs an event trigger for as long as the
Asset is watched, and a trigger that returns is started again. A slot keeps its changes until
the DAG's confirm advances it, so "the slot has changes" stays true from the commit until the
confirm, minutes later; a trigger that fired whenever it is true would queue a DAG run per poll.
This trigger keeps polling and remembers the position it fired for (the slot's
``confirmed_flush_lsn``, the number of change rows its probe saw, the time). It fires again
only when:

1. the slot's confirmed position moved (the DAG, or anyone, confirmed past it) and there are
   changes beyond the new position: the next cycle;
2. at the same confirmed position, the probe sees more change rows than when it fired: new
   changes arrived before the DAG ran (a probe that filled ``probe_rows`` cannot tell new rows
   from old ones; the run that is due takes them, or case 1 fires after its confirm);
3. ``refire_interval`` seconds passed and the slot is still not confirmed past that position:
   the run failed, or was cleared; firing again lets the pipeline recover without a clock.

The remembered position lives in the trigger and, when the triggerer hands it the watched
Asset's state store (Airflow 3.3), under :data:`STATE_KEY` in that store, so a restarted or
re-assigned triggerer does not fire twice for the same changes.

**Errors.** A missing, lost or unusable slot (or one of another plugin) fires once per distinct
error message (``status: "error"``, the message in ``message``): a run of the DAG creates a
missing slot (its ``ensure_slot`` task), after which the trigger waits for changes beyond the new
slot's position, or fails loudly in its health check, rather than the pipeline going silent. A
slot in use (an extract is reading it) or a lost connection is only logged; the next poll retries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk import Asset, AssetWatcher
from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from asgiref.sync import sync_to_async

from airflow_provider_pgdecode.errors import PgDecodeError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import DEFAULT_HEARTBEAT_PREFIX, DEFAULT_PROBE_ROWS
from airflow_provider_pgdecode.triggers.slot_changes import SlotChangesTrigger

#: The key of the last fired position in the watched Asset's state store.
STATE_KEY = "pgdecode_fired"
#: The scheme of the Assets that stand for replication slots (:func:`slot_asset`).
SLOT_ASSET_SCHEME = "pgdecode-slot"


def slot_asset_uri(slot_name: str, postgres_conn_id: str = PgDecodeHook.default_conn_name) -> str:
    """``pgdecode-slot://<postgres_conn_id>/<slot_name>``: the URI of the Asset of a slot."""
    return f"{SLOT_ASSET_SCHEME}://{postgres_conn_id}/{slot_name}"


def slot_asset(
    slot_name: str,
    *,
    postgres_conn_id: str = PgDecodeHook.default_conn_name,
    trigger: SlotChangesEventTrigger | None = None,
    watcher_name: str | None = None,
) -> Asset:
    """The Asset that stands for ``slot_name``, watched by ``trigger`` (default: a
    :class:`SlotChangesEventTrigger` of the slot with its default arguments).

    Named ``pgdecode_slot_<slot_name>``; its URI is :func:`slot_asset_uri`.
    """
    trigger = trigger or SlotChangesEventTrigger(slot_name=slot_name, postgres_conn_id=postgres_conn_id)
    if trigger.slot_name != slot_name:
        raise ValueError(
            f"the Asset of slot {slot_name!r} is watched by a trigger of slot {trigger.slot_name!r}: give both "
            "the same slot name"
        )
    return Asset(
        name=f"pgdecode_slot_{slot_name}",
        uri=slot_asset_uri(slot_name, postgres_conn_id),
        group="pgdecode",
        watchers=[AssetWatcher(name=watcher_name or f"pgdecode_slot_{slot_name}_changes", trigger=trigger)],
    )


def should_fire(report: dict[str, Any], fired: dict[str, Any] | None, now: float, refire_interval: float | None) -> str:
    """Why a check's ``report`` (the slot has changes) warrants an event after the last one,
    ``fired`` (module docstring); empty: it does not."""
    if not fired or fired.get("status") != "success":
        return "first changes seen"
    if report.get("confirmed_flush_lsn") != fired.get("confirmed_flush_lsn"):
        return f"the slot was confirmed past {fired.get('confirmed_flush_lsn')} and has changes again"
    if int(report.get("changes") or 0) > int(fired.get("changes") or 0):
        return (
            f"new changes arrived ({fired.get('changes')} change rows seen at the last event, {report['changes']} now)"
        )
    if refire_interval is not None and now - float(fired.get("fired_at") or 0) >= refire_interval:
        return (
            f"the slot is still at {fired.get('confirmed_flush_lsn')} {refire_interval:.0f}s after the last event "
            "(did the run fail?)"
        )
    return ""


class SlotChangesEventTrigger(BaseEventTrigger):
    """Fire an Asset event each time a replication slot has changes the DAG has not confirmed yet.

    For an :class:`~airflow.sdk.AssetWatcher` (module docstring: when it fires, and why not
    twice for the same changes). Holds only JSON-able arguments; each poll runs the changes
    sensor's check (:class:`~airflow_provider_pgdecode.triggers.slot_changes.SlotChangesTrigger`)
    in a worker thread, so the triggerer's event loop never blocks. An event's payload (the
    Asset event's ``extra["payload"]``) is the check's report: ``status``, ``reason``,
    ``fire_reason``, ``slot_name``, ``confirmed_flush_lsn``, ``current_lsn``, ``lag_bytes``,
    ``changes``, ``first_change_lsn``.

    :param slot_name: the replication slot.
    :param postgres_conn_id: the Airflow connection of the slot's database.
    :param poll_interval: seconds between polls.
    :param min_lag_bytes: do not probe before the slot lags the WAL by this many bytes (bigger,
        fewer runs).
    :param advance_lag_bytes: also fire when the slot retains this much WAL and a heartbeat is
        pending (an idle database's slot gets advanced).
    :param probe_rows: rows peeked per probe.
    :param heartbeat_prefix: the prefix of heartbeat messages, which are not changes.
    :param publication: the publication of a pgoutput slot.
    :param staging_root: the staging root of the slot's batches; a table snapshot request in
        progress under it also counts as work.
    :param storage_conn_id: the Airflow ``aws`` connection of an ``s3://`` staging root.
    :param refire_interval: seconds after which the same pending position fires again when the
        DAG has not confirmed past it; ``None``: never.
    """

    def __init__(
        self,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        poll_interval: float = 30.0,
        min_lag_bytes: int = 1,
        advance_lag_bytes: int | None = None,
        probe_rows: int = DEFAULT_PROBE_ROWS,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
        staging_root: str | None = None,
        storage_conn_id: str | None = None,
        refire_interval: float | None = 3600.0,
    ) -> None:
        super().__init__()
        if float(poll_interval) <= 0:
            raise ValueError(
                f"poll_interval of the trigger of slot {slot_name!r} must be positive, got {poll_interval}"
            )
        # The changes sensor's trigger of the same slot holds (and normalises) the probe's arguments.
        self._changes = SlotChangesTrigger(
            slot_name=slot_name,
            postgres_conn_id=postgres_conn_id,
            poll_interval=poll_interval,
            min_lag_bytes=min_lag_bytes,
            advance_lag_bytes=advance_lag_bytes,
            probe_rows=probe_rows,
            heartbeat_prefix=heartbeat_prefix,
            publication=publication or None,
            staging_root=staging_root,
            storage_conn_id=storage_conn_id,
        )
        self.slot_name = self._changes.slot_name
        self.postgres_conn_id = self._changes.postgres_conn_id
        self.poll_interval = self._changes.poll_interval
        self.refire_interval = None if refire_interval is None else float(refire_interval)
        self._fired: dict[str, Any] | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {**self._changes.serialize()[1], "refire_interval": self.refire_interval},
        )

    def changes_trigger(self) -> SlotChangesTrigger:
        """The changes sensor's trigger of the same slot: its :meth:`~SlotChangesTrigger.check` is
        this trigger's probe."""
        return self._changes

    # --- the last fired position: in memory, and in the watched Asset's state store ----------

    async def _load_fired(self) -> dict[str, Any] | None:
        store = self.asset_state_store
        if store is None:
            return self._fired
        try:
            value = await store.aget(STATE_KEY)
        except Exception as exc:  # several watched Assets, or a store that cannot be reached
            self.log.warning(
                "Slot %s: the Asset state store is not readable (%s); keeping state in memory", self.slot_name, exc
            )
            return self._fired
        if isinstance(value, dict) and value.get("slot_name") == self.slot_name:
            return value
        return self._fired

    async def _save_fired(self, fired: dict[str, Any]) -> None:
        self._fired = fired
        store = self.asset_state_store
        if store is None:
            return
        try:
            await store.aset(STATE_KEY, fired)
        except Exception as exc:
            self.log.warning(
                "Slot %s: the Asset state store is not writable (%s); keeping state in memory", self.slot_name, exc
            )

    async def poll(self, fired: dict[str, Any] | None) -> dict[str, Any] | None:
        """One check; the payload of an event to fire after ``fired``, or ``None``."""
        check = sync_to_async(self.changes_trigger().check, thread_sensitive=False)
        try:
            done, report = await check()
        except PgDecodeError as exc:
            if exc.retryable:
                self.log.warning("Slot %s: %s; next poll in %.0fs", self.slot_name, exc, self.poll_interval)
                return None
            if fired and fired.get("status") == "error" and fired.get("message") == str(exc):
                self.log.error("Slot %s: %s (event fired already)", self.slot_name, exc)
                return None
            return {
                "status": "error",
                "slot_name": self.slot_name,
                "message": str(exc),
                "fire_reason": "the slot cannot be read: a run creates a missing slot or fails loudly in its "
                "health check",
            }
        except Exception as exc:
            self.log.warning(
                "Slot %s: checking for changes failed (%s: %s); next poll in %.0fs",
                self.slot_name,
                type(exc).__name__,
                exc,
                self.poll_interval,
            )
            return None
        if not done:
            self.log.debug("Slot %s: %s", self.slot_name, report["reason"])
            return None
        why = should_fire(report, fired, time.time(), self.refire_interval)
        if not why:
            self.log.debug("Slot %s: %s; an event was fired for it already", self.slot_name, report["reason"])
            return None
        return {"status": "success", **report, "fire_reason": why}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        fired = await self._load_fired()
        if fired:
            self.log.info(
                "Slot %s: last event fired at confirmed position %s (%s change rows)",
                self.slot_name,
                fired.get("confirmed_flush_lsn"),
                fired.get("changes"),
            )
        while True:
            payload = await self.poll(fired)
            if payload is not None:
                fired = {**payload, "fired_at": time.time()}
                await self._save_fired(fired)
                self.log.info("Slot %s: %s: %s", self.slot_name, payload["fire_reason"], payload.get("reason", ""))
                yield TriggerEvent(payload)
            await asyncio.sleep(self.poll_interval)
