"""The first step of a verify run: copy the pipeline's tables as of a fresh consistent LSN X.

A temporary slot exports a snapshot at its consistent point X; the tables are copied inside it
into the verify area of the pipeline's slot (:mod:`airflow_provider_pgdecode.capture.verify`).
Writers keep writing; the pipeline's slot is not touched. Downstream, the pipeline's slot is
extracted up to X (:class:`~airflow_provider_pgdecode.operators.extract.PgDecodeExtractOperator`
with ``upto_lsn``) and merged, and
:class:`~airflow_provider_pgdecode.operators.verify.PgDecodeVerifyOperator` compares.

Example::

    from airflow_provider_pgdecode.operators.verify_snapshot import PgDecodeVerifySnapshotOperator

    verify_snapshot = PgDecodeVerifySnapshotOperator(
        task_id="verify_snapshot",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
    )
    # downstream: upto_lsn="{{ ti.xcom_pull(task_ids='verify_snapshot')['lsn'] }}"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.options import as_table_options
from airflow_provider_pgdecode.capture.snapshot import DEFAULT_SNAPSHOT_CHUNK_ROWS
from airflow_provider_pgdecode.capture.tables import as_table_names, resolve_tables
from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError, SlotError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.utils.config import pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


class PgDecodeVerifySnapshotOperator(BaseOperator):
    """Copy ``tables`` as of a new consistent LSN X into ``<staging_root>/<slot_name>/verify/``.

    The copy is taken in the snapshot a *temporary* logical slot exports when it is created (the
    connection's user needs the REPLICATION attribute); the slot is gone when the copy ends.
    Creating it waits until the transactions running at that moment have ended, prepared ones
    included. The copy costs what an initial load of the tables costs (page-range chunks read by
    ``workers`` connections, staged as Parquet).

    Returns (to XCom) ``{"slot", "lsn", "path", "tables"}``: the pipeline's slot, X as ``X/Y``,
    the staged copy and every table copied.

    Example::

        from airflow_provider_pgdecode.operators.verify_snapshot import PgDecodeVerifySnapshotOperator

        verify_snapshot = PgDecodeVerifySnapshotOperator(
            task_id="verify_snapshot",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            tables=["public.orders", "public.customers"],
        )
        # downstream: upto_lsn="{{ ti.xcom_pull(task_ids='verify_snapshot')['lsn'] }}"

    :param slot_name: the pipeline's slot (must exist; it is not read or moved). (templated)
    :param staging_root: the pipeline's staging root, a local directory or ``s3://bucket/prefix``.
        (templated)
    :param plugin: the pipeline's output plugin, used for the temporary slot. (templated)
    :param tables: ``schema.table`` names or patterns to verify, as the extract takes them
        (:func:`~airflow_provider_pgdecode.capture.tables.resolve_tables`); default (empty) the
        tables the extract loads by default (every table outside the system schemas, in
        ``publication`` for pgoutput, minus ``exclude_tables``). (templated)
    :param exclude_tables: ``schema.table`` names or patterns the pipeline leaves out. (templated)
    :param table_options: the pipeline's per-table options (give the extract's). (templated)
    :param publication: the pipeline's publication (pgoutput). (templated)
    :param postgres_conn_id: the Airflow connection of the source database. (templated)
    :param chunk_rows: the target rows per copied chunk. (templated)
    :param workers: chunks copied at once; ``None`` or 0 picks ``min(4, cores)``. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "staging_root",
        "plugin",
        "tables",
        "exclude_tables",
        "table_options",
        "publication",
        "postgres_conn_id",
        "chunk_rows",
        "workers",
        "storage_conn_id",
    )
    ui_color = "#d9e8f0"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        plugin: str = "test_decoding",
        tables: Sequence[str] | None = None,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        chunk_rows: int | str = DEFAULT_SNAPSHOT_CHUNK_ROWS,
        workers: int | str | None = None,
        exclude_tables: Sequence[str] | None = None,
        table_options: Mapping[str, Mapping[str, Any]] | None = None,
        publication: str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.exclude_tables = exclude_tables
        self.table_options = table_options
        self.publication = publication
        self.slot_name = slot_name
        self.staging_root = staging_root
        self.plugin = plugin
        self.tables = tables
        self.postgres_conn_id = postgres_conn_id
        self.chunk_rows = chunk_rows
        self.workers = workers
        self.storage_conn_id = storage_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast(), pgdecode_environment():  # [pgdecode] spool_dir
            return self._copy()

    def _copy(self) -> dict[str, Any]:
        slot = str(self.slot_name)
        try:
            chunk_rows, workers = int(self.chunk_rows), int(self.workers or 0) or None
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"chunk_rows and workers must be whole numbers, not {self.chunk_rows!r} and {self.workers!r}"
            ) from None
        named = as_table_names(self.tables)
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            if not hook.get_slot_client().exists(slot):
                raise SlotError(
                    f"replication slot {slot!r} does not exist: a verify run checks the Delta tables of a running "
                    "pipeline against its source. Check slot_name, or start the pipeline (pgdecode_incremental, or "
                    "pgdecode_backfill mode 'initial')"
                )
            options = as_table_options(self.table_options)
            tables: list[str | tuple[str, str]] = list(
                resolve_tables(
                    hook.get_catalog,
                    named,
                    publication=str(self.publication) if self.publication and self.plugin == "pgoutput" else None,
                    exclude_tables=as_table_names(self.exclude_tables),
                    table_options=options,
                )
            )
            dsn = hook.dsn()
            primary = hook.primary_link()
        if not tables:
            raise CatalogError("no table to verify: the database has no table the pipeline loads; name the tables")
        snapshot = stage_verify_snapshot(
            dsn,
            slot,
            storage_for(str(self.staging_root), self.storage_conn_id),
            tables,
            plugin=str(self.plugin),
            chunk_rows=chunk_rows,
            workers=workers,
            table_options=options,
            primary=primary,
        )
        self.log.info(
            "Verify of slot %s: %d table(s) copied as of LSN %s into %s; Delta must now be brought to that LSN",
            slot,
            len(snapshot.tables),
            snapshot.lsn,
            snapshot.path,
        )
        return snapshot.to_dict()
