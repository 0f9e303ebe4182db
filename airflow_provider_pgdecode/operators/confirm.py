"""Confirm a merged batch: advance the slot to its end and hand the checkpoint to the next run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.retention import DEFAULT_KEEP_BATCHES
from airflow_provider_pgdecode.cycle import CycleTask
from airflow_provider_pgdecode.cycle.confirm import ConfirmArguments, confirm_once
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook


class PgDecodeConfirmOperator(CycleTask[ConfirmArguments], BaseOperator):
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
    arguments_kind = ConfirmArguments
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

    def execute(self, context: Context) -> dict[str, Any]:
        return confirm_once(self.cycle_arguments(), context, self.log)
