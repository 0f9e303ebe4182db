"""Wait until a table snapshot request is carried out, logging its confirmed progress.

A request filed by
:class:`~airflow_provider_pgdecode.operators.table_snapshot.PgDecodeTableSnapshotOperator` is
copied chunk by chunk by the slot's incremental runs; each confirm writes the request's
progress to ``<staging_root>/<slot>/snapshot-requests/<id>.state.json``
(:mod:`airflow_provider_pgdecode.capture.table_snapshot`). Only confirmed progress is read: a
chunk counts once it is merged into Delta and the slot has moved past it.

Example::

    from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor

    wait = PgDecodeTableSnapshotSensor(
        task_id="wait_for_snapshot",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
        request_id="{{ ti.xcom_pull(task_ids='request_snapshot') }}",
        wait_seconds=6 * 3600,
        poke_interval=60,
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout

from airflow_provider_pgdecode.capture.table_snapshot import (
    describe_progress,
    list_snapshot_requests,
    read_snapshot_state,
)
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


class PgDecodeTableSnapshotSensor(BaseSensorOperator):
    """Wait until a table snapshot request is done; log its progress on every poke.

    Each poke logs the request's confirmed progress (chunks and rows per table, done or not).
    The sensor succeeds when every table of the request is copied and confirmed; its XCom value
    is then the request's state (``done``, ``tables`` with ``chunks`` and ``rows``). It fails
    without a retry when the request is not filed under ``staging_root`` or when the request
    failed (no such table, no primary key, not in the publication: the message says which and
    what to do). The copy is done by the slot's incremental runs, not by this sensor: if none
    runs, the sensor times out, and the request stays filed.

    It waits in ``reschedule`` mode by default, so no worker slot is held while it waits.

    Example::

        from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor

        wait = PgDecodeTableSnapshotSensor(
            task_id="wait_for_snapshot",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            request_id="rebuild-orders",
            poke_interval=30,
        )

    :param slot_name: the slot whose incremental runs carry out the request. (templated)
    :param staging_root: the root of the slot's staged batches, a local directory or
        ``s3://bucket/prefix``. (templated)
    :param request_id: the request's id, as the request task returned it. (templated)
    :param wait_seconds: how long to wait, counted from the first poke; it replaces
        ``timeout`` when given. 0 does not wait at all: the task succeeds at once (the request
        stays filed and is carried out anyway). (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    :param kwargs: :class:`~airflow.sdk.BaseSensorOperator` arguments (``poke_interval``,
        ``timeout``, ``mode`` ...).
    """

    template_fields: Sequence[str] = ("slot_name", "staging_root", "request_id", "wait_seconds", "storage_conn_id")
    ui_color = "#f0e9d9"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        request_id: str,
        wait_seconds: float | str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("mode", "reschedule")
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.staging_root = staging_root
        self.request_id = request_id
        self.wait_seconds = wait_seconds
        self.storage_conn_id = storage_conn_id

    def _wait_seconds(self) -> float | None:
        if self.wait_seconds is None or self.wait_seconds == "":
            return None
        try:
            wait = float(self.wait_seconds)
        except (TypeError, ValueError):
            wait = -1.0
        if wait < 0:
            raise ConfigurationError(f"wait_seconds must be a number of seconds, 0 or more, not {self.wait_seconds!r}")
        return wait

    def execute(self, context: Context) -> Any:
        with fail_fast():
            wait = self._wait_seconds()
        if wait == 0:
            self.log.info("not waiting for request %s (wait_seconds=0)", self.request_id)
            return None
        if wait is not None:
            self.timeout = wait
        try:
            return super().execute(context)
        except AirflowSensorTimeout as exc:
            raise AirflowSensorTimeout(
                f"snapshot request {self.request_id} is not done after {self.timeout:g} s; is pgdecode_incremental "
                "running? The request stays filed: re-run this task to keep waiting"
            ) from exc

    def poke(self, context: Context) -> PokeReturnValue:
        with fail_fast():
            return self._check()

    def _check(self) -> PokeReturnValue:
        slot, staging, request_id = str(self.slot_name), str(self.staging_root), str(self.request_id or "")
        root = storage_for(staging, self.storage_conn_id)
        if request_id not in {r.id for r in list_snapshot_requests(root, slot)}:
            raise ConfigurationError(
                f"no snapshot request {request_id!r} of slot {slot!r} is filed under {staging}: file it first "
                "(PgDecodeTableSnapshotOperator, or pgdecode_backfill in mode 'add-table' or 'resnapshot') and pass "
                "the id it returns"
            )
        state = read_snapshot_state(root, slot, request_id)
        self.log.info("request %s: %s", request_id, describe_progress(state) if state else "no chunk confirmed yet")
        if state and state.get("error"):
            raise CatalogError(
                f"snapshot request {request_id} failed: {str(state['error']).rstrip('.')}. The request is given up (the pipeline's "
                "other tables were not held up); fix the cause and file a new request with another request_id"
            )
        if state and state.get("done"):
            return PokeReturnValue(is_done=True, xcom_value=state)
        return PokeReturnValue(is_done=False)
