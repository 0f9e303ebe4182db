"""Confirm a merged batch: advance the slot to its end and hand the checkpoint to the next run."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.retention import DEFAULT_KEEP_BATCHES, prune_batches
from airflow_provider_pgdecode.batch.storage import Storage, is_object_store, spark_uri
from airflow_provider_pgdecode.capture.table_snapshot import describe_progress, write_snapshot_states
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.utils.config import pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.xcom import checkpoint_xcom_key


def _same_path(a: str, b: str) -> bool:
    if is_object_store(a) or is_object_store(b):
        return spark_uri(a).rstrip("/") == spark_uri(b).rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _staging_root_of(batch: Storage) -> Storage:
    """The staging root a batch lives in: ``<staging_root>/<slot>/<batch>``."""
    return batch.at(posixpath.dirname(posixpath.dirname(batch.root)))


class PgDecodeConfirmOperator(BaseOperator):
    """Advance the slot to a merged batch's end LSN and return the checkpoint for the next run.

    Run it downstream of the merge task with the default trigger rule (``all_success``): the
    slot may only move past changes that are durably in Delta. As a second guard, the task
    checks the merge task's XCom (``merge_task_id``) of the same DAG run: the batch must be
    among those it merged or found empty, or the task fails without touching the slot.

    The slot never moves backwards (``pg_replication_slot_advance``). The return value (XCom)
    is the checkpoint, ``Checkpoint.to_dict()``: ``slot``, ``end_lsn``, ``prepared_pending``
    (prepared transactions still open, with the paths of their staged items) and
    ``batch_path``; the next run's extract task starts from it.

    Example::

        from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator

        confirm = PgDecodeConfirmOperator(
            task_id="confirm",
            slot_name="pgdecode_shop",
            batch_path="{{ ti.xcom_pull(task_ids='extract')['path'] }}",
            merge_task_id="merge",
        )

    :param slot_name: the replication slot. (templated)
    :param batch_path: the merged batch's location (a local directory or an ``s3://`` URI, as the
        extract task returned it). (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database. (templated)
    :param merge_task_id: the merge task whose XCom must list the batch; ``None`` skips this
        check (when the merge is done elsewhere). (templated)
    :param retention_days: after confirming, remove the slot's staged batches older than this
        many days that nothing needs any more
        (:func:`~airflow_provider_pgdecode.batch.retention.prune_batches`: pending prepared
        transactions and the newest ``retention_batches`` batches are kept). ``None`` keeps
        every batch. (templated)
    :param retention_batches: the newest confirmed batches always kept.
    :param storage_conn_id: the Airflow ``aws`` connection of the batch (and its staging root) on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "batch_path",
        "postgres_conn_id",
        "merge_task_id",
        "retention_days",
        "storage_conn_id",
    )
    ui_color = "#e3d9f0"

    def __init__(
        self,
        *,
        slot_name: str,
        batch_path: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        merge_task_id: str | None = "merge",
        retention_days: float | str | None = None,
        retention_batches: int = DEFAULT_KEEP_BATCHES,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.retention_days = retention_days
        self.retention_batches = retention_batches
        self.slot_name = slot_name
        self.batch_path = batch_path
        self.postgres_conn_id = postgres_conn_id
        self.merge_task_id = merge_task_id
        self.storage_conn_id = storage_conn_id

    def _check_merged(self, context: Context, path: str) -> None:
        if not self.merge_task_id:
            return
        merged = context["ti"].xcom_pull(task_ids=self.merge_task_id)
        if not isinstance(merged, Mapping):
            raise ConfigurationError(
                f"the merge task {self.merge_task_id!r} left no result in this DAG run, so batch {path} may not be "
                "in Delta; the slot was not advanced. Run this task downstream of the merge task, set "
                "merge_task_id to that task's id, or merge_task_id=None if the merge is checked elsewhere"
            )
        handled = [*(merged.get("batches") or []), *(merged.get("skipped") or [])]
        if not any(_same_path(path, str(done)) for done in handled):
            raise ConfigurationError(
                f"batch {path} is not among the batches the merge task {self.merge_task_id!r} handled "
                f"({', '.join(map(str, handled)) or 'none'}); the slot was not advanced. Pass the same batch path "
                "to the merge and confirm tasks"
            )

    def execute(self, context: Context) -> dict[str, Any]:
        return self.confirm(context)

    def confirm(self, context: Context) -> dict[str, Any]:
        """Advance the slot to ``batch_path``'s end; returns the checkpoint :meth:`execute` returns
        (the drain task calls this once per batch)."""
        with fail_fast(), pgdecode_environment():  # [pgdecode] spool_dir
            return self._confirm(context)

    def _confirm(self, context: Context) -> dict[str, Any]:
        path = str(self.batch_path)
        batch = storage_for(path, self.storage_conn_id)
        manifest = BatchManifest.read(batch)
        if manifest.slot != self.slot_name:
            raise ConfigurationError(
                f"batch {path} belongs to replication slot {manifest.slot!r}, not {self.slot_name!r}"
            )
        self._check_merged(context, path)
        end = Lsn.parse(manifest.end_lsn)
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            with fail_fast(f"batch {path} is merged, but the slot could not be advanced to {end}"):
                before = hook.describe_slot(self.slot_name).confirmed_flush_lsn
                position = hook.advance_slot(self.slot_name, end)
        if position > end:
            self.log.warning(
                "Slot %s was already at %s, beyond this batch's end %s: something else advanced it. The next "
                "extract fails unless staged batches lead there",
                self.slot_name,
                position,
                end,
            )
        else:
            released = int(end) - int(before) if before is not None and end > before else 0
            self.log.info(
                "Confirmed slot %s: %s -> %s (%d bytes of WAL released)", self.slot_name, before, position, released
            )
        checkpoint = Checkpoint.from_manifest(manifest)
        self.log.info(
            "Checkpoint for the next run: end LSN %s, %d prepared transaction(s) pending",
            checkpoint.end_lsn,
            len(checkpoint.prepared_pending),
        )
        if checkpoint.snapshots:
            # Whoever waits on a table snapshot request (pgdecode_backfill) reads the confirmed state.
            write_snapshot_states(_staging_root_of(batch), self.slot_name, checkpoint.snapshots)
            for request_id, state in checkpoint.snapshots.items():
                if manifest.snapshot_chunks or not state.get("done"):
                    self.log.info("Snapshot request %s: %s", request_id, describe_progress(state))
        context["ti"].xcom_push(key=checkpoint_xcom_key(self.slot_name), value=checkpoint.to_dict())
        if self.retention_days not in (None, ""):
            removed = prune_batches(
                _staging_root_of(batch),
                checkpoint,
                keep_days=float(self.retention_days),
                keep_batches=self.retention_batches,
            )
            self.log.info(
                "Retention (%s days, newest %d kept): removed %d staged batch(es)",
                self.retention_days,
                self.retention_batches,
                len(removed),
            )
        return checkpoint.to_dict()
