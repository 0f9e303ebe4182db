"""Where the pgdecode view's data comes from: the records a cycle left in Airflow's metadata
database, and short, read-only looks at the slot, the staging area and the Delta logs.

Nothing here writes anything or waits long. The slot is read with one ``SELECT`` on
``pg_replication_slots`` in a read-only session whose connect, statement and lock timeouts are a
few seconds (:data:`SLOT_TIMEOUT_SECONDS`), so a slow or unreachable source costs the page that
long and a cycle nothing: the view takes no lock a cycle could wait on and never peeks or
advances the slot. Files (the parked-tables file, snapshot requests, a batch's Parquet footers,
a Delta commit) are read through the staging layer; a batch's commit times and a Delta commit's
time never change, so they are cached. :func:`gather` runs the looks in a thread pool and gives up
on those still running after :data:`GATHER_TIMEOUT_SECONDS`, naming them in the source's problems.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, TypeVar

from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.ui.status import (
    TASK_KINDS,
    RunRecord,
    SlotReading,
    SourceRef,
    SourceStatus,
    TaskRecord,
    group_sources,
    source_ref,
    source_status,
)

T = TypeVar("T")

#: Connect, statement and lock timeout of the slot's read, in seconds.
SLOT_TIMEOUT_SECONDS = 3
#: How long one page waits for the slots and files of all sources together.
GATHER_TIMEOUT_SECONDS = 8.0
#: Runs per DAG the view looks at (the lag chart's points, the last runs, quarantine counts).
RUNS_PER_DAG = 20
#: How long the set of DAGs with pgdecode tasks, and a slot's reading, are reused.
DAGS_TTL_SECONDS = 60.0
SLOT_TTL_SECONDS = 5.0

_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pgdecode-view")


class _Ttl:
    """A small time-bounded cache of one function's results by key (thread-safe)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._values: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, compute: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._lock:
            hit = self._values.get(key)
            if hit is not None and now - hit[0] < self.seconds:
                return hit[1]
        value = compute()
        with self._lock:
            self._values[key] = (now, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


_dags_cache = _Ttl(DAGS_TTL_SECONDS)
_slot_cache = _Ttl(SLOT_TTL_SECONDS)


# --- Airflow's records -------------------------------------------------------------------------


def pgdecode_dag_ids(session: Any, among: Collection[str] | None = None) -> list[str]:
    """The DAGs with pgdecode cycle tasks that ran (task instances of pgdecode's operators),
    limited to ``among`` when given."""
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import select

    def query() -> list[str]:
        stmt = select(TaskInstance.dag_id).where(TaskInstance.operator.in_(list(TASK_KINDS))).distinct()
        return sorted(str(d) for d in session.scalars(stmt))

    found = _dags_cache.get("dags", query)
    return [d for d in found if among is None or d in among]


def recent_runs(session: Any, dag_ids: Iterable[str], per_dag: int = RUNS_PER_DAG) -> list[RunRecord]:
    """The newest ``per_dag`` runs of each DAG with their pgdecode tasks: state, ``return_value``
    XCom and rendered arguments."""
    from airflow.models.dagrun import DagRun
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XCOM_RETURN_KEY, XComModel
    from sqlalchemy import select, tuple_

    records: list[RunRecord] = []
    for dag_id in dag_ids:
        runs = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()).limit(per_dag)
        ).all()
        if not runs:
            continue
        run_ids = [run.run_id for run in runs]
        tis = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id.in_(run_ids),
                TaskInstance.operator.in_(list(TASK_KINDS)),
                TaskInstance.map_index == -1,
            )
        ).all()
        keys = [(ti.run_id, ti.task_id) for ti in tis]
        values: dict[tuple[str, str], Any] = {}
        rendered: dict[tuple[str, str], Mapping[str, Any]] = {}
        if keys:
            for xcom in session.scalars(
                select(XComModel).where(
                    XComModel.dag_id == dag_id,
                    XComModel.key == XCOM_RETURN_KEY,
                    XComModel.map_index == -1,
                    tuple_(XComModel.run_id, XComModel.task_id).in_(keys),
                )
            ):
                values[(xcom.run_id, xcom.task_id)] = XComModel.deserialize_value(xcom)
            for fields in session.scalars(
                select(RenderedTaskInstanceFields).where(
                    RenderedTaskInstanceFields.dag_id == dag_id,
                    RenderedTaskInstanceFields.map_index == -1,
                    tuple_(RenderedTaskInstanceFields.run_id, RenderedTaskInstanceFields.task_id).in_(keys),
                )
            ):
                if isinstance(fields.rendered_fields, Mapping):
                    rendered[(fields.run_id, fields.task_id)] = fields.rendered_fields
        by_run: dict[str, list[TaskRecord]] = {}
        for ti in tis:
            by_run.setdefault(ti.run_id, []).append(
                TaskRecord(
                    task_id=ti.task_id,
                    kind=TASK_KINDS[ti.operator],
                    state=None if ti.state is None else str(ti.state),
                    end_date=ti.end_date,
                    value=values.get((ti.run_id, ti.task_id)),
                    rendered=rendered.get((ti.run_id, ti.task_id), {}),
                )
            )
        for run in runs:
            records.append(
                RunRecord(
                    dag_id=dag_id,
                    run_id=run.run_id,
                    state=None if run.state is None else str(run.state),
                    start_date=run.start_date,
                    end_date=run.end_date,
                    tasks=tuple(sorted(by_run.get(run.run_id, []), key=lambda t: t.task_id)),
                )
            )
    return records


def configured_sources(dags_folder: str | None) -> list[SourceRef]:
    """The sources of the sources file (``[pgdecode] sources``, else ``pgdecode_sources.yaml`` in
    the DAGs folder, as ``dags/pgdecode_sources.py`` reads it), also those that never ran: each
    as the ``pgdecode_<name>_incremental`` DAG that reads its slot. None without a file.

    :raises ConfigurationError: the file is configured but missing, or has problems.
    """
    from pathlib import Path

    from airflow_provider_pgdecode.utils.config import pgdecode_setting
    from airflow_provider_pgdecode.utils.sources import (
        DEFAULT_FILE_NAME,
        incremental_dag_id,
        load_sources,
        sources_file,
    )

    default = Path(dags_folder or ".") / DEFAULT_FILE_NAME
    path = sources_file(pgdecode_setting("sources"), default)
    if path is None:
        return []
    return [
        SourceRef(
            dag_id=incremental_dag_id(source.name),
            slot=source.slot,
            postgres_conn_id=source.postgres_conn_id,
            plugin=source.plugin,
            staging_root=source.staging_uri,
            storage_conn_id=source.storage_conn_id,
            delta_root=source.delta_root,
        )
        for source in load_sources(path, data_dir=pgdecode_setting("data_dir"))
    ]


# --- the slot ----------------------------------------------------------------------------------


def read_slot(postgres_conn_id: str | None, slot: str) -> SlotReading:
    """The slot's row of ``pg_replication_slots`` with the server's WAL position, read in a
    read-only session bounded by :data:`SLOT_TIMEOUT_SECONDS`; reused for :data:`SLOT_TTL_SECONDS`."""
    if not postgres_conn_id:
        return SlotReading(error="no connection recorded for this source (no task rendered postgres_conn_id yet)")
    return _slot_cache.get((postgres_conn_id, slot), lambda: _read_slot(postgres_conn_id, slot))


class BoundedSlotHook(PgDecodeHook):
    """A :class:`PgDecodeHook` whose session cannot write nor wait long: read-only, with connect,
    statement and lock timeouts of :data:`SLOT_TIMEOUT_SECONDS` (shorter ones of the connection's
    extra kept), named ``pgdecode-view`` in ``pg_stat_activity``."""

    def _create_connection(self, conn_args: dict[str, Any]) -> Any:
        ms = SLOT_TIMEOUT_SECONDS * 1000
        bounds = f"-c statement_timeout={ms} -c lock_timeout={ms} -c default_transaction_read_only=on"
        conn_args["options"] = f"{conn_args.get('options') or ''} {bounds}".strip()
        given = int(conn_args.get("connect_timeout") or SLOT_TIMEOUT_SECONDS)
        conn_args["connect_timeout"] = max(1, min(given, SLOT_TIMEOUT_SECONDS))
        conn_args["application_name"] = "pgdecode-view"
        return super()._create_connection(conn_args)


def _read_slot(postgres_conn_id: str, slot: str) -> SlotReading:
    try:
        with BoundedSlotHook(postgres_conn_id=postgres_conn_id) as hook:
            return SlotReading(info=hook.describe_slot(slot).to_dict())
    except Exception as exc:  # the page says what went wrong, per source
        return SlotReading(error=f"{type(exc).__name__}: {exc}".strip())


# --- the staging area and the Delta logs -----------------------------------------------------


def _storage(location: str, storage_conn_id: str | None) -> Any:
    from airflow_provider_pgdecode.hooks.object_store import storage_for

    return storage_for(location, storage_conn_id or None)


def read_parked_tables(ref: SourceRef) -> dict[str, dict[str, Any]]:
    """The slot's parked tables (``<staging_root>/<slot>/parked-tables.json``)."""
    if not ref.staging_root:
        return {}
    from airflow_provider_pgdecode.batch.parking import read_parked

    parked = read_parked(_storage(ref.staging_root, ref.storage_conn_id), ref.slot)
    return {name: asdict(entry) for name, entry in sorted(parked.items())}


def read_snapshot_requests(ref: SourceRef) -> list[dict[str, Any]]:
    """The slot's table snapshot requests not done yet, with their confirmed progress."""
    if not ref.staging_root:
        return []
    from airflow_provider_pgdecode.capture.table_snapshot import (
        describe_progress,
        list_snapshot_requests,
        read_snapshot_state,
    )

    store = _storage(ref.staging_root, ref.storage_conn_id)
    out = []
    for request in list_snapshot_requests(store, ref.slot):
        state = read_snapshot_state(store, ref.slot, request.id)
        if state is not None and state.get("done"):
            continue
        out.append(
            {
                "id": request.id,
                "mode": request.mode,
                "tables": [".".join(t) for t in request.tables],
                "created": request.created,
                "progress": describe_progress(state) if state is not None else "waiting for the next run",
            }
        )
    return out


@lru_cache(maxsize=512)
def batch_commit_times(path: str, storage_conn_id: str | None) -> dict[str, datetime]:
    """Per table (``schema.table``), the newest commit time of the batch's staged changes (its
    Parquet footers); a batch never changes, so the answer is kept."""
    from airflow_provider_pgdecode.batch.freshness import newest_commit_times
    from airflow_provider_pgdecode.batch.manifest import BatchManifest

    store = _storage(path, storage_conn_id)
    manifest = BatchManifest.read(store)
    return {f"{schema}.{table}": when for (schema, table), when in newest_commit_times(store, manifest).items()}


@lru_cache(maxsize=2048)
def delta_commit_time(delta_path: str, version: int, storage_conn_id: str | None) -> datetime | None:
    """When Delta committed ``version`` of the table at ``delta_path`` (its commit's
    ``commitInfo.timestamp``); ``None`` when the commit file has none."""
    text = _storage(delta_path, storage_conn_id).read_text(posixpath.join("_delta_log", f"{version:020d}.json"))
    for line in text.splitlines():
        try:
            action = json.loads(line) if line.strip() else {}
        except ValueError:  # a torn commit (its table is parked): no time from it
            continue
        info = action.get("commitInfo") if isinstance(action, Mapping) else None
        if isinstance(info, Mapping) and info.get("timestamp") is not None:
            return datetime.fromtimestamp(int(info["timestamp"]) / 1000, UTC)
    return None


# --- one page's worth ----------------------------------------------------------------------------


def _batches_to_time(runs: Sequence[RunRecord]) -> list[str]:
    """The batch of the newest merge of each table (the freshness needs no older one)."""
    from airflow_provider_pgdecode.ui.status import batch_of, last_merges

    paths = []
    for run, _ in last_merges(runs).values():
        batch = batch_of(run)
        if batch is not None and batch.path and batch.path not in paths:
            paths.append(batch.path)
    return paths


def gather(
    runs: Sequence[RunRecord],
    *,
    configured: Sequence[SourceRef] = (),
    now: datetime | None = None,
    timeout: float = GATHER_TIMEOUT_SECONDS,
    max_lag_bytes: int | None = None,
    slot_reader: Callable[[str | None, str], SlotReading] = read_slot,
) -> list[SourceStatus]:
    """The status of every source of ``runs`` and of every ``configured`` one (which may not have
    run yet): the slot, parked tables, snapshot requests, commit times read concurrently, each
    source's looks bounded together by ``timeout`` seconds (a look still running then is named in
    the source's problems and left out)."""
    from airflow_provider_pgdecode.ui.status import last_merges

    now = now or datetime.now(UTC)
    grouped = group_sources(runs)
    refs = {key: source_ref(key[0], key[1], source_runs) for key, source_runs in grouped.items()}
    for ref in configured:
        if (ref.dag_id, ref.slot) not in refs:
            grouped[(ref.dag_id, ref.slot)] = []
            refs[(ref.dag_id, ref.slot)] = ref
    futures: dict[tuple[tuple[str, str], str, Any], Future[Any]] = {}
    for key, ref in refs.items():
        conn = ref.storage_conn_id
        futures[(key, "slot", None)] = _pool.submit(slot_reader, ref.postgres_conn_id, ref.slot)
        futures[(key, "parked", None)] = _pool.submit(read_parked_tables, ref)
        futures[(key, "requests", None)] = _pool.submit(read_snapshot_requests, ref)
        for path in _batches_to_time(grouped[key]):
            futures[(key, "commits", path)] = _pool.submit(batch_commit_times, path, conn)
        for _, entry in last_merges(grouped[key]).values():
            if entry.get("delta_path") and entry.get("delta_version") is not None:
                target = (str(entry["delta_path"]), int(entry["delta_version"]))
                futures[(key, "delta", target)] = _pool.submit(delta_commit_time, *target, conn)
    wait(futures.values(), timeout=timeout)

    out = []
    for key, ref in refs.items():
        problems: list[str] = []
        results: dict[tuple[str, Any], Any] = {}
        for (source, what, arg), future in futures.items():
            if source != key:
                continue
            if not future.done():
                problems.append(f"{what} {arg or ''}: no answer within {timeout:.0f} s".replace("  ", " "))
                continue
            error = future.exception()
            if error is not None:
                problems.append(f"{what} {arg or ''}: {type(error).__name__}: {error}".replace("  ", " "))
                continue
            results[(what, arg)] = future.result()
        slot_state = results.get(("slot", None)) or SlotReading(error="the slot could not be read in time")
        out.append(
            source_status(
                ref,
                grouped[key],
                slot_state=slot_state,
                parked=results.get(("parked", None)) or {},
                snapshot_requests=results.get(("requests", None)) or [],
                commit_times={arg: value for (what, arg), value in results.items() if what == "commits"},
                delta_commit_times={
                    arg: value for (what, arg), value in results.items() if what == "delta" and value is not None
                },
                problems=problems,
                now=now,
                max_lag_bytes=max_lag_bytes,
            )
        )
    return out


__all__ = [
    "GATHER_TIMEOUT_SECONDS",
    "BoundedSlotHook",
    "SLOT_TIMEOUT_SECONDS",
    "batch_commit_times",
    "configured_sources",
    "delta_commit_time",
    "gather",
    "pgdecode_dag_ids",
    "read_parked_tables",
    "read_slot",
    "read_snapshot_requests",
    "recent_runs",
]
