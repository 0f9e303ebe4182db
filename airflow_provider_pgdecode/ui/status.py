"""What the pgdecode view shows, assembled from what the pipeline recorded: plain functions of
plain records, no Airflow, no database, no storage (``readers.py`` fetches the records, ``page.py``
draws them).

A cycle's tasks leave, per DAG run (:class:`RunRecord`): the health check's slot state and lag
(``slot_health``), the extract's batch summary (slot, LSN range, changes, rows per table,
quarantined changes), the merge's result (each table merged, skipped or parked, with its Delta
version) and the confirm's checkpoint, each as its ``return_value`` XCom, and their rendered
arguments (connection, slot, staging and Delta locations). A source is one DAG reading one slot
(:func:`group_sources`); :func:`source_status` turns its recent runs, plus what was read live
(the slot, the parked-tables file, the snapshot requests, the batches' commit times), into a
:class:`SourceStatus`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

#: The kind of each pgdecode task, by its operator's class name (``TaskInstance.operator``).
TASK_KINDS: dict[str, str] = {
    "PgDecodeSlotHealthSensor": "health",
    "PgDecodeSlotChangesSensor": "changes",
    "PgDecodeExtractOperator": "extract",
    "PgDecodeMergeOperator": "merge",
    "PgDecodeConfirmOperator": "confirm",
    "PgDecodeDrainOperator": "drain",
}


@dataclass(frozen=True)
class TaskRecord:
    """One pgdecode task of a DAG run: its state, its ``return_value`` XCom (``None`` when it
    pushed none) and its rendered template fields."""

    task_id: str
    kind: str
    state: str | None = None
    end_date: datetime | None = None
    value: Any = None
    rendered: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunRecord:
    """One DAG run of a pgdecode DAG, with its pgdecode tasks."""

    dag_id: str
    run_id: str
    state: str | None
    start_date: datetime | None
    end_date: datetime | None
    tasks: tuple[TaskRecord, ...]

    def task(self, kind: str) -> TaskRecord | None:
        """The run's (first) task of ``kind``."""
        return next((t for t in self.tasks if t.kind == kind), None)

    def value(self, kind: str) -> dict[str, Any]:
        """The ``return_value`` of the run's task of ``kind`` when it is a mapping, else ``{}``."""
        task = self.task(kind)
        return task.value if task is not None and isinstance(task.value, dict) else {}

    def rendered(self, name: str) -> str | None:
        """The first non-empty rendered argument ``name`` among the run's tasks."""
        for task in self.tasks:
            value = task.rendered.get(name)
            if value not in (None, "", "None"):
                return str(value)
        return None

    @property
    def slot(self) -> str | None:
        """The slot the run read: its extract's or health check's record, else a task's argument."""
        return self.value("extract").get("slot") or self.value("health").get("slot_name") or self.rendered("slot_name")


@dataclass(frozen=True)
class SourceRef:
    """Where a source lives, from its latest run's records."""

    dag_id: str
    slot: str
    postgres_conn_id: str | None
    plugin: str | None
    staging_root: str | None
    storage_conn_id: str | None
    delta_root: str | None


@dataclass(frozen=True)
class SlotReading:
    """The slot as read live from ``pg_replication_slots`` (``info``: ``SlotInfo.to_dict()``), or
    why it could not be read (``error``)."""

    info: Mapping[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class LagPoint:
    """The slot's lag (bytes of WAL behind the server) when a run's health check looked."""

    run_id: str
    at: datetime | None
    lag_bytes: int


@dataclass(frozen=True)
class BatchSummary:
    """A batch a run staged: its LSN range, changes and rows per table."""

    path: str | None
    start_lsn: str | None
    end_lsn: str | None
    changes: int
    transactions: int
    tables: Mapping[str, int]
    quarantined: Mapping[str, int]
    bounded_by: str | None


@dataclass(frozen=True)
class RunSummary:
    """One recent run: its state and batches, and the slot's lag when it started."""

    run_id: str
    state: str | None
    start_date: datetime | None
    end_date: datetime | None
    lag_bytes: int | None
    batches: tuple[BatchSummary, ...]
    drained_batches: int
    merged_tables: tuple[str, ...]
    parked_tables: tuple[str, ...]


@dataclass(frozen=True)
class TableStatus:
    """A table of the source: when its changes last reached Delta, how fresh they are, and its
    quarantined changes (in the runs looked at) and parking."""

    name: str
    last_merged_run: str | None
    merged_at: datetime | None
    newest_commit: datetime | None
    freshness_seconds: float | None
    delta_version: int | None
    delta_path: str | None
    last_rows: int
    quarantined: int
    parked: Mapping[str, Any] | None


@dataclass(frozen=True)
class SourceStatus:
    """Everything the view shows of one source."""

    dag_id: str
    slot: str
    postgres_conn_id: str | None
    plugin: str | None
    staging_root: str | None
    delta_root: str | None
    slot_state: SlotReading
    health: str
    lag: tuple[LagPoint, ...]
    tables: tuple[TableStatus, ...]
    runs: tuple[RunSummary, ...]
    parked: Mapping[str, Mapping[str, Any]]
    quarantined: int
    snapshot_requests: tuple[Mapping[str, Any], ...]
    problems: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: times in ISO 8601."""
        return _jsonable(asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _newest_first(runs: Iterable[RunRecord]) -> list[RunRecord]:
    def key(run: RunRecord) -> tuple[bool, datetime | str]:
        return (run.start_date is not None, run.start_date or run.run_id)

    return sorted(runs, key=key, reverse=True)


def group_sources(runs: Iterable[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    """Runs by source (``(dag_id, slot)``), newest first; runs whose slot is unknown (no pgdecode
    task got as far as rendering its arguments) are left out."""
    grouped: dict[tuple[str, str], list[RunRecord]] = {}
    for run in runs:
        slot = run.slot
        if slot:
            grouped.setdefault((run.dag_id, slot), []).append(run)
    return {key: _newest_first(value) for key, value in sorted(grouped.items())}


def source_ref(dag_id: str, slot: str, runs: Sequence[RunRecord]) -> SourceRef:
    """Where the source lives, from its newest run that says (``runs`` newest first)."""

    def first(name: str) -> str | None:
        return next((v for v in (run.rendered(name) for run in runs) if v), None)

    delta_root = first("delta_root") or next(
        (run.value("merge").get("delta_root") for run in runs if run.value("merge").get("delta_root")), None
    )
    plugin = next((run.value("extract").get("plugin") for run in runs if run.value("extract").get("plugin")), None)
    return SourceRef(
        dag_id=dag_id,
        slot=slot,
        postgres_conn_id=first("postgres_conn_id"),
        plugin=plugin or first("plugin"),
        staging_root=first("staging_root"),
        storage_conn_id=first("storage_conn_id"),
        delta_root=delta_root,
    )


def lag_series(runs: Sequence[RunRecord]) -> tuple[LagPoint, ...]:
    """The slot's lag at each run's health check, oldest first (runs without one are left out)."""
    points = []
    for run in runs:
        value = run.value("health")
        if value.get("lag_bytes") is None:
            continue
        task = run.task("health")
        at = (task.end_date if task is not None else None) or run.start_date
        points.append(LagPoint(run.run_id, at, _int(value["lag_bytes"])))
    return tuple(reversed(points))


def batch_of(run: RunRecord) -> BatchSummary | None:
    """The batch the run's extract staged, or ``None`` (skipped, failed, not run)."""
    value = run.value("extract")
    if not value.get("end_lsn"):
        return None
    return BatchSummary(
        path=value.get("path"),
        start_lsn=value.get("start_lsn"),
        end_lsn=value.get("end_lsn"),
        changes=_int(value.get("changes")),
        transactions=_int(value.get("transactions")),
        tables={str(k): _int(v) for k, v in (value.get("tables") or {}).items()},
        quarantined={str(k): _int(v) for k, v in (value.get("quarantined") or {}).items()},
        bounded_by=value.get("bounded_by"),
    )


def merged_tables(run: RunRecord) -> dict[str, Mapping[str, Any]]:
    """The tables the run's merge job wrote (status ``merged``), with the job's entry for each."""
    summary = run.value("merge").get("summary") or {}
    tables = summary.get("tables") if isinstance(summary, Mapping) else None
    return {
        str(name): entry
        for name, entry in (tables or {}).items()
        if isinstance(entry, Mapping) and entry.get("status") == "merged"
    }


def run_summary(run: RunRecord) -> RunSummary:
    batch = batch_of(run)
    health = run.value("health")
    merge = run.value("merge")
    return RunSummary(
        run_id=run.run_id,
        state=run.state,
        start_date=run.start_date,
        end_date=run.end_date,
        lag_bytes=None if health.get("lag_bytes") is None else _int(health.get("lag_bytes")),
        batches=(batch,) if batch is not None else (),
        drained_batches=_int(run.value("drain").get("batches")),
        merged_tables=tuple(sorted(merged_tables(run))),
        parked_tables=tuple(sorted(merge.get("parked") or {})),
    )


def table_names(runs: Sequence[RunRecord], parked: Mapping[str, Any]) -> list[str]:
    """Every table the runs staged or merged, and the parked ones."""
    names: set[str] = set(parked)
    for run in runs:
        batch = batch_of(run)
        if batch is not None:
            names.update(batch.tables)
            names.update(batch.quarantined)
        names.update(merged_tables(run))
    return sorted(names)


def last_merges(runs: Sequence[RunRecord]) -> dict[str, tuple[RunRecord, Mapping[str, Any]]]:
    """Per table, the newest run whose merge wrote it, with the merge job's entry."""
    found: dict[str, tuple[RunRecord, Mapping[str, Any]]] = {}
    for run in runs:
        for name, entry in merged_tables(run).items():
            found.setdefault(name, (run, entry))
    return found


def table_statuses(
    runs: Sequence[RunRecord],
    *,
    parked: Mapping[str, Mapping[str, Any]],
    commit_times: Mapping[str, Mapping[str, datetime]],
    delta_commit_times: Mapping[tuple[str, int], datetime],
    now: datetime,
) -> tuple[TableStatus, ...]:
    """Each table's status.

    :param commit_times: per batch path, per table, the newest source commit time among the
        batch's staged changes (the Parquet statistics; ``readers.batch_commit_times``).
    :param delta_commit_times: per ``(delta_path, version)``, when Delta committed that version.
    :param now: the time freshness is measured at.
    """
    merges = last_merges(runs)
    out = []
    for name in table_names(runs, parked):
        quarantined = sum(
            (batch.quarantined.get(name, 0) for batch in (batch_of(run) for run in runs) if batch is not None), 0
        )
        merge = merges.get(name)
        run, entry = merge if merge is not None else (None, {})
        batch = batch_of(run) if run is not None else None
        newest = commit_times.get(batch.path or "", {}).get(name) if batch is not None else None
        version = entry.get("delta_version")
        delta_path = entry.get("delta_path")
        merged_at = None
        if run is not None:
            merged_at = delta_commit_times.get((str(delta_path), _int(version))) if version is not None else None
            if merged_at is None:
                task = run.task("merge")
                merged_at = task.end_date if task is not None else None
        out.append(
            TableStatus(
                name=name,
                last_merged_run=run.run_id if run is not None else None,
                merged_at=merged_at,
                newest_commit=newest,
                freshness_seconds=(now - newest).total_seconds() if newest is not None else None,
                delta_version=None if version is None else _int(version),
                delta_path=None if delta_path is None else str(delta_path),
                last_rows=batch.tables.get(name, 0) if batch is not None else 0,
                quarantined=quarantined,
                parked=parked.get(name),
            )
        )
    return tuple(out)


def health_of(reading: SlotReading, parked: Mapping[str, Any], max_lag_bytes: int | None = None) -> str:
    """One word for the slot: ``unreachable``, ``missing``, ``lost``, ``unreserved``, ``lagging``
    (past ``max_lag_bytes``), ``parked`` (a table waits), ``healthy``."""
    if reading.error is not None:
        return "missing" if "does not exist" in reading.error else "unreachable"
    info = reading.info or {}
    if info.get("wal_status") == "lost" or info.get("invalidation_reason"):
        return "lost"
    if info.get("wal_status") == "unreserved":
        return "unreserved"
    if max_lag_bytes is not None and _int(info.get("lag_bytes")) > max_lag_bytes:
        return "lagging"
    if parked:
        return "parked"
    return "healthy"


def source_status(
    ref: SourceRef,
    runs: Sequence[RunRecord],
    *,
    slot_state: SlotReading,
    parked: Mapping[str, Mapping[str, Any]],
    snapshot_requests: Sequence[Mapping[str, Any]] = (),
    commit_times: Mapping[str, Mapping[str, datetime]] | None = None,
    delta_commit_times: Mapping[tuple[str, int], datetime] | None = None,
    problems: Sequence[str] = (),
    now: datetime,
    max_lag_bytes: int | None = None,
) -> SourceStatus:
    """The status of the source ``ref`` from its ``runs`` (newest first) and what was read live."""
    tables = table_statuses(
        runs,
        parked=parked,
        commit_times=commit_times or {},
        delta_commit_times=delta_commit_times or {},
        now=now,
    )
    return SourceStatus(
        dag_id=ref.dag_id,
        slot=ref.slot,
        postgres_conn_id=ref.postgres_conn_id,
        plugin=ref.plugin,
        staging_root=ref.staging_root,
        delta_root=ref.delta_root,
        slot_state=slot_state,
        health=health_of(slot_state, parked, max_lag_bytes),
        lag=lag_series(runs),
        tables=tables,
        runs=tuple(run_summary(run) for run in runs),
        parked=parked,
        quarantined=sum(t.quarantined for t in tables),
        snapshot_requests=tuple(snapshot_requests),
        problems=tuple(problems),
    )


__all__ = [
    "TASK_KINDS",
    "BatchSummary",
    "LagPoint",
    "RunRecord",
    "RunSummary",
    "SlotReading",
    "SourceRef",
    "SourceStatus",
    "TableStatus",
    "TaskRecord",
    "group_sources",
    "source_ref",
    "source_status",
]
