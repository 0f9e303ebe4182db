"""A lost slot recovered by a new snapshot (``on_slot_lost: resnapshot``). Plain Python.

A slot read only by scheduled runs can be invalidated between them (``wal_removed`` past
``max_slot_wal_keep_size``, 18's ``idle_timeout``, ``rows_removed`` on a standby): the changes
since its confirmed position are gone. With the policy ``fail`` (the default) the extract stops
with the slot's error. With ``resnapshot`` the extract itself recovers, at most
``max_per_day`` times in 24 hours:

1. the lost slot is dropped and created again with an exported snapshot (:mod:`.snapshot`);
2. every table of the pipeline is copied inside it and staged as one batch with a TRUNCATE
   before each table's rows (the initial load's path, ``replace=True``), so that merging it
   replaces each Delta table's contents in one commit: readers see the old rows or the new,
   never a half-loaded table;
3. the recovery is recorded in ``<staging_root>/<slot>/recoveries.json`` (what was lost, why,
   when, the new slot's consistent point), which bounds how often it may happen.

The batch goes through the cycle's merge and confirm like any other; its end is the new slot's
consistent point, where the next extract resumes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.options import TableOptions
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.capture.tables import parse_table_names
from airflow_provider_pgdecode.errors import ConfigurationError, SlotError, StagingError
from airflow_provider_pgdecode.postgres.health import describe_loss, lost_reason
from airflow_provider_pgdecode.postgres.slot import SlotInfo
from airflow_provider_pgdecode.postgres.standby import PrimaryLink

log = logging.getLogger(__name__)

FAIL = "fail"
RESNAPSHOT = "resnapshot"
POLICIES = (FAIL, RESNAPSHOT)
"""What the extract does with a lost slot: stop with its error, or recover by a new snapshot."""

DEFAULT_MAX_PER_DAY = 1
"""Recoveries allowed in 24 hours before the policy stops and the slot's error stands."""

RECOVERIES_NAME = "recoveries.json"


def check_policy(policy: str, max_per_day: int) -> None:
    """:class:`ConfigurationError` for a policy or a daily bound that is not one."""
    if policy not in POLICIES:
        raise ConfigurationError(f"on_slot_lost must be one of {', '.join(POLICIES)}, not {policy!r}")
    if max_per_day < 1:
        raise ConfigurationError(f"max_slot_recoveries_per_day must be at least 1, not {max_per_day}")


def read_recoveries(staging: Storage, slot_name: str) -> list[dict[str, Any]]:
    """The recoveries recorded for the slot, oldest first."""
    try:
        text = staging.read_text(f"{slot_name}/{RECOVERIES_NAME}")
    except FileNotFoundError:
        return []
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise StagingError(
            f"unreadable recovery record {staging.uri(slot_name, RECOVERIES_NAME)}: {exc}. Fix or remove it (it only bounds "
            "how often a lost slot is recovered)"
        ) from None
    return list(entries) if isinstance(entries, list) else []


def recoveries_within(entries: list[dict[str, Any]], now: datetime, window: timedelta = timedelta(days=1)) -> int:
    """How many recorded recoveries happened in the ``window`` before ``now``."""
    return sum(1 for e in entries if now - datetime.fromisoformat(str(e["at"])) < window)


def recover_lost_slot(
    dsn: str,
    info: SlotInfo,
    staging: Storage,
    tables: Collection[str | tuple[str, str]],
    *,
    max_per_day: int = DEFAULT_MAX_PER_DAY,
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
    publication: str | None = None,
    primary: PrimaryLink | None = None,
    drop_slot: Callable[[str], Any],
    now: datetime | None = None,
) -> BatchManifest:
    """Recreate the lost slot ``info`` with a snapshot and stage every table of ``tables`` in it as
    one replacing batch (module doc); returns its manifest.

    :param dsn: the source database's DSN (a replication connection creates the slot).
    :param info: the lost slot, as described.
    :param staging: the staging root: the batch and the recovery record go under ``<slot>/``.
    :param tables: the pipeline's tables (each needs a key as for an initial load, or ``append_only``).
    :param max_per_day: recoveries allowed in 24 hours; past it the slot's error stands, with why.
    :param drop_slot: drops a slot by name (the hook's, so a standby's slot is dropped where it lives).
    :raises SlotError: past the daily bound.
    """
    reason = lost_reason(info)
    if reason is None:
        raise SlotError(f"replication slot {info.slot_name!r} is not lost; nothing to recover")
    now = now or datetime.now(UTC)
    entries = read_recoveries(staging, info.slot_name)
    recent = recoveries_within(entries, now)
    if recent >= max_per_day:
        raise SlotError(
            f"replication slot {info.slot_name!r} was lost ({describe_loss(reason)}), and on_slot_lost = resnapshot "
            f"already recovered it {recent} time(s) in the last 24 hours (max_slot_recoveries_per_day = {max_per_day}): "
            "the pipeline stops rather than reload its tables again. Find why the slot keeps being lost (a schedule "
            "too sparse for max_slot_wal_keep_size or idle_replication_slot_timeout), then raise the bound or wait, "
            f"and the next run recovers it (the record of recoveries is {staging.uri(info.slot_name, RECOVERIES_NAME)})"
        )
    names = sorted(parse_table_names(tables))
    log.error(
        "Replication slot %s was lost (%s) at %s: the changes since its confirmed position %s are gone. "
        "on_slot_lost = resnapshot: recreating it and reloading %d table(s) from a new snapshot "
        "(recovery %d of at most %d in 24 hours)",
        info.slot_name,
        describe_loss(reason),
        info.inactive_since or "an unknown time",
        info.confirmed_flush_lsn,
        len(names),
        recent + 1,
        max_per_day,
    )
    drop_slot(info.slot_name)
    with create_slot_with_snapshot(
        dsn, info.slot_name, str(info.plugin), two_phase=info.two_phase, primary=primary
    ) as snap:
        manifest = stage_snapshot(
            dsn,
            snap.snapshot_name,
            snap.consistent_lsn,
            info.slot_name,
            staging,
            names,
            plugin=str(info.plugin),
            replace=True,
            table_options=table_options,
            publication=publication,
        )
    entries.append(
        {
            "at": now.isoformat(),
            "reason": reason,
            "lost_at_lsn": None if info.confirmed_flush_lsn is None else str(info.confirmed_flush_lsn),
            "new_slot_lsn": str(snap.consistent_lsn),
            "tables": [f"{s}.{t}" for s, t in names],
            "batch": str(manifest.path),
        }
    )
    staging.write_text(f"{info.slot_name}/{RECOVERIES_NAME}", json.dumps(entries, indent=2) + "\n")
    return manifest


__all__ = [
    "DEFAULT_MAX_PER_DAY",
    "FAIL",
    "POLICIES",
    "RECOVERIES_NAME",
    "RESNAPSHOT",
    "check_policy",
    "read_recoveries",
    "recover_lost_slot",
    "recoveries_within",
]
