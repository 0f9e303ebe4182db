"""pgdecode's metrics, sent through Airflow's own metrics facade: the one table of their names.

Airflow's task runner sets its facade up from ``[metrics]`` (StatsD, Datadog's DogStatsD or
OpenTelemetry), so what a deployment already collects receives these too; with metrics off they
cost nothing. Each metric goes out under its name with tags (``slot``, and ``table`` for a table's)
for backends that keep tags, and under its name followed by the slot for plain StatsD, which
drops them (as Airflow's own ``dagrun.duration.success.<dag_id>``). docs/metrics.md is this table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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
    "confirm.released_bytes": ("gauge", "WAL released by advancing the slot"),
    "table.changes": ("gauge", "a table's changes in the batch (tag table)"),
    "table.rows_written": ("gauge", "a table's rows inserted, updated and deleted in Delta by the merge (tag table)"),
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
