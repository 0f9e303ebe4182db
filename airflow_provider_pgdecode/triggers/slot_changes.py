"""A trigger that waits until a replication slot has changes to extract, in the triggerer.

How "has changes" is decided is the slot probe's (:mod:`~airflow_provider_pgdecode.hooks.slot_probe`),
shared with the changes sensor and the health sensor's heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from asgiref.sync import sync_to_async

from airflow_provider_pgdecode.capture.table_snapshot import pending_snapshot_requests
from airflow_provider_pgdecode.errors import PgDecodeError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import DEFAULT_HEARTBEAT_PREFIX, DEFAULT_PROBE_ROWS, check_slot_changes


class SlotChangesTrigger(BaseTrigger):
    """Poll a replication slot until it has changes to extract (see the module docstring).

    Holds only JSON-able arguments. Each poll opens a connection through
    :class:`PgDecodeHook` in a worker thread (``sync_to_async``), so the triggerer's event
    loop never blocks, and closes it before sleeping. Yields one event:
    ``{"status": "success", "reason", "changes", "lag_bytes", ...}``, or
    ``{"status": "error", "fatal": bool, "message": ...}`` (fatal: the slot is missing, lost
    or unusable; retrying cannot help).

    :param slot_name: the replication slot.
    :param postgres_conn_id: the Airflow connection of the slot's database.
    :param poll_interval: seconds between polls.
    :param min_lag_bytes: do not probe before the slot lags the WAL by this many bytes.
    :param advance_lag_bytes: also succeed when the slot retains this much WAL and a
        heartbeat is pending (idle databases).
    :param probe_rows: rows peeked per probe.
    :param heartbeat_prefix: the prefix of heartbeat messages, which are not changes.
    :param publication: the publication of a pgoutput slot.
    :param staging_root: the staging root of the slot's batches (a local directory or
        ``s3://bucket/prefix``); when given, a table snapshot request still in progress under it
        (:func:`~airflow_provider_pgdecode.capture.table_snapshot.pending_snapshot_requests`) also
        fires the trigger, so that its chunks get copied while the database is idle.
    :param storage_conn_id: the Airflow ``aws`` connection of an ``s3://`` staging root, resolved
        in the triggerer at each poll (only its id is serialized).
    """

    def __init__(
        self,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        poll_interval: float = 60.0,
        min_lag_bytes: int = 1,
        advance_lag_bytes: int | None = None,
        probe_rows: int = DEFAULT_PROBE_ROWS,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
        staging_root: str | None = None,
        storage_conn_id: str | None = None,
    ) -> None:
        super().__init__()
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = float(poll_interval)
        self.min_lag_bytes = int(min_lag_bytes)
        self.advance_lag_bytes = None if advance_lag_bytes is None else int(advance_lag_bytes)
        self.probe_rows = int(probe_rows)
        self.heartbeat_prefix = heartbeat_prefix
        self.publication = publication
        self.staging_root = None if staging_root is None else str(staging_root)
        self.storage_conn_id = storage_conn_id or None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "slot_name": self.slot_name,
                "postgres_conn_id": self.postgres_conn_id,
                "poll_interval": self.poll_interval,
                "min_lag_bytes": self.min_lag_bytes,
                "advance_lag_bytes": self.advance_lag_bytes,
                "probe_rows": self.probe_rows,
                "heartbeat_prefix": self.heartbeat_prefix,
                "publication": self.publication,
                "staging_root": self.staging_root,
                "storage_conn_id": self.storage_conn_id,
            },
        )

    def check(self) -> tuple[bool, dict[str, Any]]:
        """One blocking check (:func:`check_slot_changes`, then the snapshot requests under
        ``staging_root``); :meth:`run` calls it in a worker thread, the changes sensor's poke in its task."""
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            done, report = check_slot_changes(
                hook,
                self.slot_name,
                min_lag_bytes=self.min_lag_bytes,
                advance_lag_bytes=self.advance_lag_bytes,
                probe_rows=self.probe_rows,
                heartbeat_prefix=self.heartbeat_prefix,
                publication=self.publication,
            )
        if done or not self.staging_root:
            return done, report
        waiting = pending_snapshot_requests(storage_for(self.staging_root, self.storage_conn_id), self.slot_name)
        if waiting:
            return True, {
                **report,
                "snapshot_requests": waiting,
                "reason": f"table snapshot request(s) in progress: {', '.join(waiting)}",
            }
        return False, report

    async def run(self) -> AsyncIterator[TriggerEvent]:
        check = sync_to_async(self.check, thread_sensitive=False)
        polls = 0
        while True:
            polls += 1
            try:
                done, report = await check()
            except PgDecodeError as exc:
                # A slot in use or a lost connection is worth a retry; a missing or lost slot (or an
                # unreadable snapshot request) is not.
                fatal = not exc.retryable
                yield TriggerEvent(
                    {"status": "error", "fatal": fatal, "slot_name": self.slot_name, "message": str(exc)}
                )
                return
            except Exception as exc:
                yield TriggerEvent(
                    {
                        "status": "error",
                        "fatal": False,
                        "slot_name": self.slot_name,
                        "message": f"checking replication slot {self.slot_name!r} failed: {type(exc).__name__}: {exc}",
                    }
                )
                return
            if done:
                self.log.info("Slot %s: %s (poll %d)", self.slot_name, report["reason"], polls)
                yield TriggerEvent({"status": "success", "polls": polls, **report})
                return
            self.log.info("Slot %s: %s; next poll in %.0fs", self.slot_name, report["reason"], self.poll_interval)
            await asyncio.sleep(self.poll_interval)
