"""pgdecode's metrics, sent through Airflow's own metrics facade: the one table of their names.

Airflow's task runner sets its facade up from ``[metrics]`` (StatsD, Datadog's DogStatsD or
OpenTelemetry), so what a deployment already collects receives these too; with metrics off they
cost nothing. Each metric goes out under its name with tags (``slot``, and ``table`` for a table's)
for backends that keep tags, and under its name followed by the slot for plain StatsD, which
drops them (as Airflow's own ``dagrun.duration.success.<dag_id>``). docs/metrics.md is this table.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from airflow.sdk.observability import stats

log = logging.getLogger(__name__)

PREFIX = "pgdecode"

#: name -> (kind, what it measures); ``gauge`` or ``timing`` (milliseconds).
METRICS: dict[str, tuple[str, str]] = {
    "slot.lag_bytes": (
        "gauge",
        "WAL between the server's position and the slot's confirmed position, after the confirm",
    ),
    "slot.wal_status": (
        "gauge",
        "the slot's wal_status as a number: 0 reserved, 1 extended, 2 unreserved, 3 lost (4: unknown)",
    ),
    "slot.safe_wal_size_bytes": ("gauge", "WAL that can still be written before the slot is lost (when limited)"),
    "extract.changes": ("gauge", "changes staged by the batch"),
    "extract.transactions": ("gauge", "transactions staged by the batch"),
    "extract.quarantined": ("gauge", "changes of the batch quarantined (values the pipeline cannot carry)"),
    "extract.duration": ("timing", "the extract's time"),
    "extract.changes_per_second": ("gauge", "changes staged per second of the extract"),
    "merge.duration": ("timing", "the merge's time"),
    "merge.tables": ("gauge", "tables merged by the run"),
    "merge.parked": ("gauge", "tables parked after the run (docs/merge.md, 'Parked tables')"),
    "slot.lag_seconds": (
        "gauge",
        "at the confirm, seconds since the newest commit the confirmed batch carried: how far Delta trails the "
        "source (a batch without changes sends none)",
    ),
    "slot.oldest_prepared_age_seconds": (
        "gauge",
        "at the confirm, the age of the oldest transaction prepared and not yet committed or rolled back in the "
        "slot's database (0: none); its changes wait in the checkpoint until it is resolved",
    ),
    "confirm.released_bytes": ("gauge", "WAL released by advancing the slot"),
    "confirm.duration": ("timing", "the confirm's time (advance and checkpoint)"),
    "drain.backlog_bytes": ("gauge", "WAL left to drain after each batch of a drain"),
    "drain.eta_seconds": ("gauge", "the drain's time left at the rates so far (sent while it has an end)"),
    "table.changes": ("gauge", "a table's changes in the batch (tag table)"),
    "table.rows_written": ("gauge", "a table's rows inserted, updated and deleted in Delta by the merge (tag table)"),
    "table.last_commit_lsn": ("gauge", "at the confirm, the newest commit LSN merged into the table, as a number"),
    "table.freshness_seconds": (
        "gauge",
        "at the confirm, seconds since the newest commit merged into the table (parked tables are not sent)",
    ),
}
WAL_STATUS = {"reserved": 0, "extended": 1, "unreserved": 2, "lost": 3}


def emit(metric: str, value: float, slot: str, table: str | None = None) -> None:
    """Send one metric of :data:`METRICS` for ``slot`` (and ``table``)."""
    kind, _ = METRICS[metric]
    tags: dict[str, Any] = {"slot": slot, **({"table": table} if table is not None else {})}
    scoped = ".".join(part for part in (PREFIX, metric, slot, table) if part)
    try:
        for name, name_tags in ((f"{PREFIX}.{metric}", tags), (stats.normalize_name_for_stats(scoped, False), None)):
            if kind == "timing":
                stats.timing(name, value, tags=name_tags)
            else:
                stats.gauge(name, value, tags=name_tags)
    except Exception as error:  # a metric never fails the step it measures
        log.warning("Could not send metric %s.%s: %s", PREFIX, metric, error)


def slot_state(slot: str, lag_bytes: int | None, wal_status: str | None, safe_wal_size: int | None) -> None:
    """The slot's lag and WAL reservation (``pg_replication_slots``)."""
    if lag_bytes is not None:
        emit("slot.lag_bytes", lag_bytes, slot)
    emit("slot.wal_status", WAL_STATUS.get(str(wal_status), 4), slot)
    if safe_wal_size is not None:
        emit("slot.safe_wal_size_bytes", safe_wal_size, slot)


def extract_done(summary: Mapping[str, Any], seconds: float) -> None:
    """The extract task's summary (``BatchManifest.summary``) and its time."""
    slot = str(summary["slot"])
    changes = int(summary.get("changes") or 0)
    emit("extract.changes", changes, slot)
    emit("extract.transactions", int(summary.get("transactions") or 0), slot)
    emit("extract.quarantined", sum((summary.get("quarantined") or {}).values()), slot)
    emit("extract.duration", seconds * 1000, slot)
    emit("extract.changes_per_second", changes / seconds if seconds > 0 else 0.0, slot)
    for table, rows in (summary.get("tables") or {}).items():
        emit("table.changes", rows, slot, table)


def merge_done(slot: str, summary: Mapping[str, Any], seconds: float) -> None:
    """The merge job's summary (``merge_batches``) and its time."""
    tables = summary.get("tables") or {}
    emit("merge.duration", seconds * 1000, slot)
    emit("merge.tables", sum(1 for t in tables.values() if t.get("status") == "merged"), slot)
    emit("merge.parked", len(summary.get("parked") or []), slot)
    for table, result in tables.items():
        written = sum(int(result.get(k) or 0) for k in ("inserted", "updated", "deleted"))
        emit("table.rows_written", written, slot, table)


def confirmed(
    slot: str,
    newest: Mapping[tuple[str, str], datetime],
    last_lsns: Mapping[tuple[str, str], int],
    parked: Collection[str],
    oldest_prepared: datetime | None,
    now: datetime,
) -> None:
    """What the confirm knows: per merged table its newest commit LSN and time, the slot's lag in
    seconds (the batch's newest commit), the oldest prepared transaction's age."""
    for target, lsn in last_lsns.items():
        name = ".".join(target)
        if name in parked:
            continue
        emit("table.last_commit_lsn", lsn, slot, name)
        if target in newest:
            emit("table.freshness_seconds", (now - newest[target]).total_seconds(), slot, name)
    if newest:
        emit("slot.lag_seconds", (now - max(newest.values())).total_seconds(), slot)
    emit("slot.oldest_prepared_age_seconds", (now - oldest_prepared).total_seconds() if oldest_prepared else 0.0, slot)
