"""One confirm: advance the slot to a merged batch's end and hand the checkpoint to the next run
(:class:`~airflow_provider_pgdecode.operators.confirm.PgDecodeConfirmOperator` and the drain call
:func:`confirm_once`)."""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

from airflow.sdk import Context

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.freshness import newest_commit_times
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.retention import prune_batches
from airflow_provider_pgdecode.batch.storage import Storage, is_object_store, spark_uri
from airflow_provider_pgdecode.capture.table_snapshot import describe_progress, write_snapshot_states
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.utils import metrics
from airflow_provider_pgdecode.utils.config import pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.xcom import checkpoint_xcom_key


@dataclass(frozen=True)
class ConfirmArguments:
    """A confirm task's rendered arguments (the operator's parameters of the same names)."""

    OPERATOR: ClassVar[str] = "PgDecodeConfirmOperator"

    slot_name: str
    batch_path: str
    postgres_conn_id: str
    merge_task_id: str | None
    retention_days: float | str | None
    retention_batches: int
    storage_conn_id: str | None


def _same_path(a: str, b: str) -> bool:
    if is_object_store(a) or is_object_store(b):
        return spark_uri(a).rstrip("/") == spark_uri(b).rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _staging_root_of(batch: Storage) -> Storage:
    """The staging root a batch lives in: ``<staging_root>/<slot>/<batch>``."""
    return batch.at(posixpath.dirname(posixpath.dirname(batch.root)))


def _check_merged(arguments: ConfirmArguments, context: Context, path: str) -> list[str]:
    """The tables the merge parked (their changes are not in Delta yet); fails when the merge did
    not handle the batch."""
    if not arguments.merge_task_id:
        return []
    merged = context["ti"].xcom_pull(task_ids=arguments.merge_task_id)
    if not isinstance(merged, Mapping):
        raise ConfigurationError(
            f"the merge task {arguments.merge_task_id!r} left no result in this DAG run, so batch {path} may not be "
            "in Delta; the slot was not advanced. Run this task downstream of the merge task, set "
            "merge_task_id to that task's id, or merge_task_id=None if the merge is checked elsewhere"
        )
    handled = [*(merged.get("batches") or []), *(merged.get("skipped") or [])]
    if not any(_same_path(path, str(done)) for done in handled):
        raise ConfigurationError(
            f"batch {path} is not among the batches the merge task {arguments.merge_task_id!r} handled "
            f"({', '.join(map(str, handled)) or 'none'}); the slot was not advanced. Pass the same batch path "
            "to the merge and confirm tasks"
        )
    return [str(name) for name in merged.get("parked") or []]


def _freshness_metrics(
    slot: str, batch: Storage, manifest: BatchManifest, parked: list[str], oldest_prepared: Any, log: Any
) -> None:
    """The confirmed batch's freshness metrics; reading its parts' footers never fails the confirm."""
    try:
        newest = newest_commit_times(batch, manifest)
    except Exception as exc:  # a metric never fails the step it measures
        log.warning("Could not read the commit times of batch %s for the freshness metrics: %s", batch.root, exc)
        newest = {}
    last = {t.target: int(t.max_commit) for t in manifest.tables if t.max_commit is not None}
    metrics.confirmed(slot, newest, last, parked, oldest_prepared, datetime.now(UTC))


def confirm_once(arguments: ConfirmArguments, context: Context, log: Any) -> dict[str, Any]:
    """Advance the slot to ``batch_path``'s end (checking first that the merge task handled the
    batch, unless ``merge_task_id`` is ``None``); push the checkpoint to XCom under the slot's key
    and return it, as the confirm task does."""
    with fail_fast(), pgdecode_environment():  # [pgdecode] spool_dir
        return _confirm(arguments, context, log)


def _confirm(arguments: ConfirmArguments, context: Context, log: Any) -> dict[str, Any]:
    path = str(arguments.batch_path)
    batch = storage_for(path, arguments.storage_conn_id)
    manifest = BatchManifest.read(batch)
    if manifest.slot != arguments.slot_name:
        raise ConfigurationError(
            f"batch {path} belongs to replication slot {manifest.slot!r}, not {arguments.slot_name!r}"
        )
    parked = _check_merged(arguments, context, path)
    end = Lsn.parse(manifest.end_lsn)
    started = time.monotonic()
    with PgDecodeHook(postgres_conn_id=arguments.postgres_conn_id) as hook:
        with fail_fast(f"batch {path} is merged, but the slot could not be advanced to {end}"):
            before = hook.describe_slot(arguments.slot_name).confirmed_flush_lsn
            position = hook.advance_slot(arguments.slot_name, end)
        after = hook.describe_slot(arguments.slot_name)
        oldest_prepared = hook.oldest_prepared()
    metrics.slot_state(arguments.slot_name, after.lag_bytes, after.wal_status, after.safe_wal_size)
    _freshness_metrics(arguments.slot_name, batch, manifest, parked, oldest_prepared, log)
    if position > end:
        log.warning(
            "Slot %s was already at %s, beyond this batch's end %s: something else advanced it. The next "
            "extract fails unless staged batches lead there",
            arguments.slot_name,
            position,
            end,
        )
    else:
        released = int(end) - int(before) if before is not None and end > before else 0
        metrics.emit("confirm.released_bytes", released, arguments.slot_name)
        log.info(
            "Confirmed slot %s: %s -> %s (%d bytes of WAL released)", arguments.slot_name, before, position, released
        )
    checkpoint = Checkpoint.from_manifest(manifest)
    log.info(
        "Checkpoint for the next run: end LSN %s, %d prepared transaction(s) pending",
        checkpoint.end_lsn,
        len(checkpoint.prepared_pending),
    )
    if checkpoint.snapshots:
        # Whoever waits on a table snapshot request (pgdecode_backfill) reads the confirmed state.
        write_snapshot_states(_staging_root_of(batch), arguments.slot_name, checkpoint.snapshots)
        for request_id, state in checkpoint.snapshots.items():
            if manifest.snapshot_chunks or not state.get("done"):
                log.info("Snapshot request %s: %s", request_id, describe_progress(state))
    context["ti"].xcom_push(key=checkpoint_xcom_key(arguments.slot_name), value=checkpoint.to_dict())
    metrics.emit("confirm.duration", (time.monotonic() - started) * 1000, arguments.slot_name)
    if arguments.retention_days not in (None, ""):
        removed = prune_batches(
            _staging_root_of(batch),
            checkpoint,
            keep_days=float(arguments.retention_days),
            keep_batches=arguments.retention_batches,
        )
        log.info(
            "Retention (%s days, newest %d kept): removed %d staged batch(es)",
            arguments.retention_days,
            arguments.retention_batches,
            len(removed),
        )
    return checkpoint.to_dict()
