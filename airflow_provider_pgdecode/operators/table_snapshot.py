"""Bring a table into a running pipeline, or copy it again: file a table snapshot request.

A running slot has no snapshot to offer and the pipeline must not stop, so the copy happens
inside the incremental extract, chunk by chunk between watermarks, while every other table keeps
flowing (:mod:`airflow_provider_pgdecode.capture.table_snapshot`, docs/backfill.md). This
operator only files the request (``<staging_root>/<slot>/snapshot-requests/<id>.json``);
the next runs of the slot's extract carry it out, and
:class:`~airflow_provider_pgdecode.sensors.table_snapshot.PgDecodeTableSnapshotSensor` waits
for it and logs its progress.

Repeatable: filing the same request id again with the same tables returns the request already
filed, so a re-run never snapshots twice.

Example::

    from airflow_provider_pgdecode.operators.table_snapshot import PgDecodeTableSnapshotOperator
    from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor

    request = PgDecodeTableSnapshotOperator(
        task_id="request_snapshot",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
        tables=["public.refunds"],
        mode="add-table",
    )
    wait = PgDecodeTableSnapshotSensor(
        task_id="wait_for_snapshot",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
        request_id="{{ ti.xcom_pull(task_ids='request_snapshot') }}",
    )
    request >> wait
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.options import as_table_options, options_for, parse_table_options, qualified_name
from airflow_provider_pgdecode.capture.table_snapshot import DEFAULT_CHUNK_ROWS, MODES, request_table_snapshot
from airflow_provider_pgdecode.capture.tables import TableSelection, as_table_names, is_table_pattern, resolve_tables
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError, SlotError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.catalog import Catalog
from airflow_provider_pgdecode.utils.config import pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


class PgDecodeTableSnapshotOperator(BaseOperator):
    """File a request for the slot's next extracts to copy ``tables``; return the request id.

    ``mode`` ``add-table`` brings tables the pipeline did not stage so far into it (they stay in
    it afterwards); ``resnapshot`` copies staged tables again, e.g. after their Delta tables
    were deleted or damaged. Both stage a TRUNCATE of the Delta table before the first chunk.
    For a ``pgoutput`` slot, add the tables to the publication first.

    The slot must exist (the request is carried out by the pipeline reading it): a missing
    slot, an unknown mode, no tables, or a request id already filed with other settings fail
    the task without a retry and say what to do.

    Returns (to XCom) the request id, as filed (characters other than letters, digits and
    ``_.+-`` become ``_``).

    Example::

        from airflow_provider_pgdecode.operators.table_snapshot import PgDecodeTableSnapshotOperator

        resnapshot = PgDecodeTableSnapshotOperator(
            task_id="request_snapshot",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            tables=["public.orders"],
            mode="resnapshot",
            request_id="rebuild-orders",
        )

    :param slot_name: the running pipeline's slot. (templated)
    :param staging_root: the root of the slot's staged batches, a local directory or
        ``s3://bucket/prefix`` (the request is filed under it). (templated)
    :param tables: ``schema.table`` names or glob patterns (``public.order_*``, matched against
        the catalog when the task runs; the request names the tables they matched) to copy, at
        least one. (templated)
    :param mode: ``add-table`` or ``resnapshot``. (templated)
    :param request_id: the request's id (letters, digits, ``_.+-``); default ``<mode>-<run_id>``,
        one request per DAG run. (templated)
    :param chunk_rows: rows per chunk (one query, one Parquet part). (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database. (templated)
    :param exclude_tables: ``schema.table`` names or patterns left out of ``tables`` (the pipeline's own
        exclusions, so that one list serves every mode). (templated)
    :param table_options: the pipeline's per-table options; a table loaded ``append_only``
        without a key cannot be copied chunk by chunk into a running pipeline (a chunk's rows
        cannot be told from the inserts logged while it was read) and is refused by name.
        (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "staging_root",
        "tables",
        "exclude_tables",
        "table_options",
        "mode",
        "request_id",
        "chunk_rows",
        "postgres_conn_id",
        "storage_conn_id",
    )
    ui_color = "#f0e9d9"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        tables: Sequence[str] | None = None,
        mode: str = "add-table",
        request_id: str | None = None,
        chunk_rows: int | str = DEFAULT_CHUNK_ROWS,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        exclude_tables: Sequence[str] | None = None,
        table_options: Mapping[str, Mapping[str, Any]] | str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.exclude_tables = exclude_tables
        self.table_options = table_options
        self.slot_name = slot_name
        self.staging_root = staging_root
        self.tables = tables
        self.mode = mode
        self.request_id = request_id
        self.chunk_rows = chunk_rows
        self.postgres_conn_id = postgres_conn_id
        self.storage_conn_id = storage_conn_id

    def execute(self, context: Context) -> str:
        with fail_fast(), pgdecode_environment():  # [pgdecode] spool_dir
            return self._file(context)

    def _arguments(self) -> tuple[list[str], int]:
        mode = self.mode
        if mode not in MODES:
            raise ConfigurationError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        tables = as_table_names(self.tables)
        TableSelection.parse(tables)  # a bad pattern is refused before anything is filed
        excluded = TableSelection.parse(as_table_names(self.exclude_tables))
        left_out = [t for t in tables if not is_table_pattern(t) and excluded.matches(*qualified_name(t))]
        if left_out:
            self.log.warning("left out of the request (in exclude_tables): %s", ", ".join(left_out))
            tables = [t for t in tables if t not in left_out]
        if not tables:
            raise ConfigurationError(
                f"mode {mode!r} needs the tables to copy (param 'tables')"
                + (f"; exclude_tables left out every one named: {', '.join(left_out)}" if left_out else "")
            )
        parse_table_options(as_table_options(self.table_options))  # refused before anything is filed
        try:
            chunk_rows = int(self.chunk_rows)
        except (TypeError, ValueError):
            chunk_rows = 0
        if chunk_rows < 1:
            raise ConfigurationError(f"chunk_rows must be a whole number of at least 1, not {self.chunk_rows!r}")
        return tables, chunk_rows

    def _check_append_only(self, catalog: Catalog, tables: list[tuple[str, str]], mode: str) -> None:
        """Refuse keyless ``append_only`` tables: chunks need a key to be placed among logged inserts."""
        options = parse_table_options(as_table_options(self.table_options))
        for schema, table in tables:
            if options_for(options, schema, table).mode != "append_only":
                continue
            try:
                catalog.table_key(schema, table)
            except CatalogError:
                raise CatalogError(
                    f"table {schema}.{table} is loaded append_only and has no key, so mode {mode!r} cannot copy it "
                    "into the running pipeline: a chunk's rows cannot be told apart from the inserts logged while it "
                    "was read. Give the table a primary key (or REPLICA IDENTITY FULL and mode 'merge'), or load it "
                    "with a new pipeline (pgdecode_backfill mode 'initial'), or leave it out of the request"
                ) from None

    def _file(self, context: Context) -> str:
        slot, mode = str(self.slot_name), str(self.mode)
        tables, chunk_rows = self._arguments()
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            if not hook.get_slot_client().exists(slot):
                raise SlotError(
                    f"slot {slot!r} does not exist: mode {mode!r} loads tables into a running pipeline. Run "
                    "pgdecode_incremental (it creates the slot) or pgdecode_backfill with mode 'initial' first"
                )
            # Patterns are matched against the catalog now (the request names the tables they matched).
            pairs = resolve_tables(
                hook.get_catalog,
                tables,
                exclude_tables=as_table_names(self.exclude_tables),
                table_options=as_table_options(self.table_options),
            )
            if not pairs:
                raise ConfigurationError(f"mode {mode!r}: exclude_tables leaves out every table of {tables}")
            self._check_append_only(hook.get_catalog(), pairs, mode)
        request_id = self.request_id or f"{mode}-{context['run_id']}"
        try:
            request = request_table_snapshot(
                storage_for(str(self.staging_root), self.storage_conn_id),
                slot,
                pairs,
                mode,
                request_id=request_id,
                chunk_rows=chunk_rows,
            )
        except ValueError as exc:  # the request's own argument checks (e.g. an unusable id)
            raise ConfigurationError(f"cannot file the snapshot request: {exc}") from exc
        self.log.info(
            "filed request %s: pgdecode_incremental copies %s",
            request.id,
            ", ".join(".".join(t) for t in request.tables),
        )
        return request.id
