"""Slot health: the one wording of each slot error, and the one check that a slot can be read.

Every module that finds a slot missing, lost, in use, of another plugin or of another kind
raises the error built here, so a user sees the same sentence and the same way forward from the
extract, the sensors, the trigger and the hook alike.

Example::

    from airflow_provider_pgdecode.postgres.health import check_readable

    check_readable(slots.describe("pgdecode_shop"), plugin="pgoutput")  # raises SlotError if not
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from airflow_provider_pgdecode.errors import SlotConnectionLostError, SlotError, SlotInUseError

if TYPE_CHECKING:
    from airflow_provider_pgdecode.postgres.slot import SlotInfo


def _drop(name: str) -> str:
    return f"SELECT pg_drop_replication_slot('{name}')"


def slot_missing(name: str, where: str) -> SlotError:
    """The slot does not exist; ``where`` says where we looked (database, host and port)."""
    return SlotError(
        f"replication slot {name!r} does not exist (looked in {where}); create it first "
        "(PgDecodeEnsureSlotOperator, PgDecodeHook.ensure_slot, or the pgdecode_backfill DAG's initial mode)"
    )


def slot_lost(name: str, detail: str | None = None) -> SlotError:
    """The server removed WAL the slot still needed: its changes are gone for good."""
    cause = f" ({detail})" if detail else ""
    return SlotError(
        f"replication slot {name!r} is lost (wal_status = lost){cause}: the server removed WAL it still needed, "
        f"so changes since its confirmed position are gone and it cannot be read any more. Drop it ({_drop(name)}), "
        "recreate it, and re-snapshot the tables with the pgdecode_backfill DAG (or set the DAG's on_slot_lost to "
        "resnapshot, and the next run does this itself); to keep this from recurring, run the pipeline more often "
        "or raise max_slot_wal_keep_size"
    )


_INVALIDATIONS: dict[str, tuple[str, str]] = {
    # reason (pg_replication_slots.invalidation_reason, 17+): (what happened, how to keep it from recurring)
    "wal_removed": (
        "the server removed WAL it still needed (max_slot_wal_keep_size)",
        "run the pipeline more often or raise max_slot_wal_keep_size",
    ),
    "idle_timeout": (
        "no process used it for longer than idle_replication_slot_timeout",
        "run the pipeline more often than idle_replication_slot_timeout, or raise that setting (0 disables it)",
    ),
    "rows_removed": (
        "catalog rows it still needed were removed (it conflicted with recovery on a standby)",
        "on a standby, turn hot_standby_feedback on and use a physical slot between primary and standby",
    ),
    "wal_level_insufficient": (
        "wal_level on the primary was lowered below logical",
        "keep wal_level = logical on the primary",
    ),
}


def idle_timeout_between_runs(name: str, timeout: timedelta, gap: timedelta) -> str:
    """One wording: the DAG leaves its slot unused longer than 18's ``idle_replication_slot_timeout``."""
    return (
        f"replication slot {name!r} is unused between two runs for up to {gap}, longer than the server's "
        f"idle_replication_slot_timeout ({timeout}): PostgreSQL will invalidate it (idle_timeout) and its changes "
        "since the last run will be lost. Schedule the DAG more often than that, or raise idle_replication_slot_timeout "
        "on the server (0 disables it)"
    )


def slot_invalidated(name: str, reason: str, inactive_since: datetime | None = None) -> SlotError:
    """The server invalidated the slot (PostgreSQL 17+ names why): its changes cannot be read any more."""
    what, prevent = _INVALIDATIONS.get(reason, (f"invalidation_reason = {reason}", "see the server log"))
    idle = f", inactive since {inactive_since.isoformat()}" if inactive_since is not None else ""
    return SlotError(
        f"replication slot {name!r} was invalidated (invalidation_reason = {reason}{idle}): {what}, so changes "
        f"since its confirmed position cannot be read any more. Drop it ({_drop(name)}), recreate it, and "
        "re-snapshot the tables with the pgdecode_backfill DAG (or set the DAG's on_slot_lost to resnapshot, and the "
        f"next run does this itself); to keep this from recurring, {prevent}"
    )


def slot_in_use(name: str, detail: str | None = None) -> SlotInUseError:
    """Another process holds the slot (transient: retried)."""
    cause = f": {detail}" if detail else ""
    return SlotInUseError(
        f"replication slot {name!r} is in use by another process{cause}; wait for it to finish, or stop the other "
        "consumer (pg_stat_replication / pg_replication_slots.active_pid names it)"
    )


def connection_lost(name: str, action: str, detail: str) -> SlotConnectionLostError:
    """The server connection broke mid-call (transient: retried). ``action``: ``peeking changes``,
    ``advancing``, ..."""
    if action == "advancing":
        state = (
            "The slot may or may not have been advanced; advancing again to the same LSN is safe, and a slot "
            "ahead of the checkpoint is reconciled from the staged batches"
        )
    else:
        state = "Nothing was consumed (the slot is only peeked) and nothing was staged or confirmed"
    return SlotConnectionLostError(
        f"{action} of replication slot {name!r} failed: the connection to the server was lost ({detail}), "
        f"e.g. its backend was terminated or the server restarted. {state}. The task is retried; if the server "
        "stays unreachable, check that it is up and accepts connections"
    )


def publication_missing(name: str, detail: str) -> SlotError:
    """The publication a pgoutput slot is read with does not exist (the slot itself may be fine)."""
    return SlotError(
        f"replication slot {name!r} cannot be read: {detail}. Create the publication in the slot's database "
        "(CREATE PUBLICATION pgdecode FOR ALL TABLES, or FOR TABLE ...) or set the DAG's publication parameter "
        "to one that exists"
    )


def wrong_plugin(name: str, actual: str | None, wanted: str) -> SlotError:
    """The slot was created with another output plugin than the one asked for."""
    return SlotError(
        f"replication slot {name!r} uses output plugin {actual!r}, but {wanted!r} was asked for. Set the DAG's "
        f"plugin parameter to {actual!r}, or drop the slot ({_drop(name)}), recreate it with {wanted!r} and "
        "re-snapshot the tables with the pgdecode_backfill DAG"
    )


def not_logical(name: str, slot_type: str) -> SlotError:
    """A physical slot was named where a logical one is needed."""
    return SlotError(
        f"replication slot {name!r} is a {slot_type} slot, not a logical one; use another slot name or drop that slot"
    )


def lost_reason(info: SlotInfo) -> str | None:
    """Why the slot can no longer be read (17+'s ``invalidation_reason``, else ``wal_removed`` for
    ``wal_status = lost``), or ``None`` while it can."""
    if info.invalidation_reason is not None:
        return str(info.invalidation_reason)
    return "wal_removed" if info.wal_status == "lost" else None


def describe_loss(reason: str) -> str:
    """The cause of a loss in words (``idle_timeout`` told apart from ``wal_removed``)."""
    return _INVALIDATIONS.get(reason, (f"invalidation_reason = {reason}", ""))[0]


def check_readable(info: SlotInfo, plugin: str | None = None) -> None:
    """Raise the slot's error when it cannot be read (as ``plugin``, when given): a physical slot,
    a lost slot, or a slot of another output plugin."""
    if info.slot_type != "logical":
        raise not_logical(info.slot_name, info.slot_type)
    # 17+ says why (an idle_timeout or rows_removed slot need not show wal_status = lost).
    if info.invalidation_reason is not None:
        raise slot_invalidated(info.slot_name, info.invalidation_reason, info.inactive_since)
    if info.wal_status == "lost":
        raise slot_lost(info.slot_name)
    if plugin is not None and info.plugin != plugin:
        raise wrong_plugin(info.slot_name, info.plugin, plugin)


__all__ = [
    "check_readable",
    "describe_loss",
    "lost_reason",
    "connection_lost",
    "not_logical",
    "publication_missing",
    "slot_in_use",
    "slot_invalidated",
    "slot_lost",
    "slot_missing",
    "wrong_plugin",
]
