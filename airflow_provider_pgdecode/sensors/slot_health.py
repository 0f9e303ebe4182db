"""A health check of a replication slot: fails loudly before the slot costs data or disk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.health import check_readable
from airflow_provider_pgdecode.postgres.slot import SlotInfo
from airflow_provider_pgdecode.triggers.slot_changes import DEFAULT_HEARTBEAT_PREFIX, probe_changes
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} bytes"  # pragma: no cover


class PgDecodeSlotHealthSensor(BaseSensorOperator):
    """Check a logical replication slot; fail with a specific message when it is unhealthy.

    The checks, in order:

    * the slot is missing → :class:`AirflowFailException` (retrying cannot help);
    * it uses another output plugin than ``plugin`` (when given) → :class:`AirflowFailException`;
    * ``wal_status = 'lost'``: the WAL it needed was removed, changes are gone →
      :class:`AirflowFailException` with the recovery steps;
    * ``wal_status = 'unreserved'``: it retains more WAL than ``max_slot_wal_keep_size`` and
      will be lost at the server's next checkpoint unless it advances →
      :class:`AirflowException` (a retry after the pipeline advanced the slot can pass);
    * ``lag_bytes > max_lag_bytes`` (when given) → :class:`AirflowException`;
    * other logical slots of the cluster that no process uses and that hold back more than
      ``max_lag_bytes`` of WAL (when given) → a warning naming each and how to drop it, since the
      server keeps that WAL for them (a source removed from the sources file keeps its slot); the
      check still passes: only whoever knows what reads a slot can drop it.

    With ``heartbeat=True`` the check also writes a heartbeat (a non-transactional logical
    message, ``pg_logical_emit_message``) when the slot has nothing pending to decode, so that
    the next extract has a position to advance the slot to even if its database is idle while
    the rest of the cluster writes WAL. It writes none while a heartbeat or real changes are
    still pending, and none while another process holds the slot. The heartbeat is written
    before the lag check, so an idle slot can still recover.

    On success the XCom value is the slot's description (``SlotInfo.to_dict()``) plus
    ``heartbeat_lsn`` and ``idle_slots`` (the names warned about). The check passes or fails on
    its first poke: it never waits.

    Place it where its failure alerts without blocking the extract (e.g. a parallel branch):
    the extract, merge and confirm are what advance a lagging or unreserved slot.

    Example::

        from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor

        health = PgDecodeSlotHealthSensor(
            task_id="slot_health",
            slot_name="pgdecode_shop",
            max_lag_bytes=8 * 1024**3,
            heartbeat=True,
        )

    :param slot_name: the replication slot. (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database. (templated)
    :param max_lag_bytes: fail when the slot lags the server's WAL position by more bytes.
    :param plugin: fail unless the slot uses this output plugin. (templated)
    :param heartbeat: write a heartbeat when the slot has nothing pending.
    :param heartbeat_prefix: the heartbeat messages' prefix. (templated)
    :param publication: for pgoutput slots, the publication (needed to look for pending
        changes before a heartbeat). (templated)
    """

    template_fields: Sequence[str] = ("slot_name", "postgres_conn_id", "plugin", "heartbeat_prefix", "publication")
    ui_color = "#f7e3d9"

    def __init__(
        self,
        *,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        max_lag_bytes: int | None = None,
        plugin: str | None = None,
        heartbeat: bool = False,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poke_interval", 0)
        kwargs.setdefault("timeout", 0)
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.max_lag_bytes = max_lag_bytes
        self.plugin = plugin
        self.heartbeat = heartbeat
        self.heartbeat_prefix = heartbeat_prefix
        self.publication = publication

    def poke(self, context: Context) -> PokeReturnValue:
        name = self.slot_name
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            with fail_fast():
                info = hook.describe_slot(name)
                check_readable(info, self.plugin)
            self._check_state(info)
            heartbeat_lsn = self._maybe_heartbeat(hook, info) if self.heartbeat else None
            idle = hook.idle_slots(self.max_lag_bytes, besides=name) if self.max_lag_bytes is not None else []
        # Said before this slot's own lag may fail the check: both hold WAL back.
        for other in idle:
            self.log.warning(
                "replication slot %r (database %s, plugin %s) is not in use and holds back %s of WAL on this server, "
                "more than max_lag_bytes %s: if no pipeline reads it any more (a source removed from the sources "
                "file keeps its slot), drop it with SELECT pg_drop_replication_slot('%s')",
                other.slot_name,
                other.database,
                other.plugin,
                _size(other.lag_bytes),
                _size(self.max_lag_bytes),
                other.slot_name,
            )
        lag = info.lag_bytes or 0
        if self.max_lag_bytes is not None and lag > self.max_lag_bytes:
            raise AirflowException(
                f"replication slot {name!r} lags the server's WAL by {_size(lag)} (confirmed at "
                f"{info.confirmed_flush_lsn}, server at {info.current_lsn}), more than max_lag_bytes "
                f"{_size(self.max_lag_bytes)}; the server retains that WAL for it. Run the pipeline (extract, "
                "merge, confirm) to advance the slot, check that its DAG is not paused or failing, or drop the "
                "slot if nothing reads it any more"
            )
        self.log.info(
            "Slot %s is healthy: plugin %s, wal_status %s, confirmed %s, lag %s, safe_wal_size %s%s",
            name,
            info.plugin,
            info.wal_status,
            info.confirmed_flush_lsn,
            _size(lag),
            _size(info.safe_wal_size) if info.safe_wal_size is not None else "unlimited",
            f", heartbeat at {heartbeat_lsn}" if heartbeat_lsn is not None else "",
        )
        return PokeReturnValue(
            is_done=True,
            xcom_value={
                **info.to_dict(),
                "heartbeat_lsn": None if heartbeat_lsn is None else str(heartbeat_lsn),
                "idle_slots": [other.slot_name for other in idle],
            },
        )

    def _check_state(self, info: SlotInfo) -> None:
        name = info.slot_name
        if info.wal_status == "unreserved":
            raise AirflowException(
                f"replication slot {name!r} has wal_status = unreserved: it retains {_size(info.lag_bytes)} of "
                f"WAL, beyond max_slot_wal_keep_size (safe_wal_size {_size(info.safe_wal_size)}), and the server "
                "will remove that WAL at its next checkpoint, losing the slot. Advance it now: run the pipeline "
                "(extract, merge, confirm), or raise max_slot_wal_keep_size"
            )

    def _maybe_heartbeat(self, hook: PgDecodeHook, info: SlotInfo) -> Any:
        if info.active:
            self.log.info("Slot %s is in use by another process: no heartbeat", info.slot_name)
            return None
        if not info.lag_bytes:
            return None
        try:
            probe = probe_changes(
                hook, info, probe_rows=10, heartbeat_prefix=self.heartbeat_prefix, publication=self.publication
            )
        except SlotError as exc:
            self.log.warning("Slot %s: cannot look for pending changes (%s): no heartbeat", info.slot_name, exc)
            return None
        if probe.changes or probe.heartbeats:
            self.log.info(
                "Slot %s has %d change(s) and %d heartbeat(s) pending: no heartbeat needed",
                info.slot_name,
                probe.changes,
                probe.heartbeats,
            )
            return None
        lsn = hook.emit_heartbeat(prefix=self.heartbeat_prefix)
        self.log.info(
            "Slot %s has nothing pending while lagging %s: wrote a heartbeat at %s so the next extract can advance it",
            info.slot_name,
            _size(info.lag_bytes),
            lsn,
        )
        return lsn
