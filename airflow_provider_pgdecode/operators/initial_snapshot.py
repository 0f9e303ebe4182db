"""The initial load of a new pipeline: create the slot with an exported snapshot and stage the copy.

A slot's changes start at its consistent point; the rows a table held before that point come
from a copy taken inside the snapshot the slot exports when it is created
(:mod:`airflow_provider_pgdecode.capture.snapshot`). Staged as one batch whose rows carry the
consistent point as their commit LSN, the copy and the slot's later batches fit exactly: nothing
missed, nothing applied twice. The operator returns the batch path(s) for
:class:`~airflow_provider_pgdecode.operators.merge.PgDecodeMergeOperator`.

Repeatable: once the slot exists, its staged initial load is returned again (merging it twice
equals merging it once) instead of taking another snapshot, which could not fit the slot.

Example::

    from airflow_provider_pgdecode.operators.initial_snapshot import PgDecodeInitialSnapshotOperator
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

    initial_load = PgDecodeInitialSnapshotOperator(
        task_id="initial_load",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
        tables=["public.orders", "public.customers"],
        workers=4,
    )
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths="{{ ti.xcom_pull(task_ids='initial_load') }}",
        delta_root="/data/delta",
    )
    initial_load >> merge
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.chains import find_initial_load
from airflow_provider_pgdecode.batch.options import as_table_options, parse_table_options
from airflow_provider_pgdecode.capture.snapshot import (
    DEFAULT_SNAPSHOT_CHUNK_ROWS,
    create_slot_with_snapshot,
    stage_snapshot,
)
from airflow_provider_pgdecode.capture.tables import TableSelection, as_table_names, resolve_tables
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError, SlotError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.spark.session import build_spark_session
from airflow_provider_pgdecode.utils.config import pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COPY_ON = ("workers", "spark")
"""Where the initial load's chunks are copied: threads of the task, or Spark tasks."""


class PgDecodeInitialSnapshotOperator(BaseOperator):
    """Create a slot with an exported snapshot, copy the tables inside it, return the staged batch.

    The slot is created over a replication connection (the connection's user needs the
    REPLICATION attribute) and its snapshot is held while ``tables`` are copied in page-range
    chunks by ``workers`` connections and staged as the batch
    ``<staging_root>/<slot_name>/0000000000000000-<consistent point>`` (each table's rows after a
    TRUNCATE, so merging it replaces what a Delta table held). A copy that fails drops the slot
    again; a run that was killed part-way leaves the slot behind (see below).

    When the slot already exists, its staged initial load (the batch starting at ``0/0``) is
    returned instead; without one the task fails without a retry and says what to do: an
    existing slot cannot be given a consistent copy any more (use
    :class:`~airflow_provider_pgdecode.operators.table_snapshot.PgDecodeTableSnapshotOperator`
    to load tables into a running pipeline, or drop the slot and start again).

    Returns (to XCom) the list of batch paths to merge, one path.

    Example::

        from airflow_provider_pgdecode.operators.initial_snapshot import PgDecodeInitialSnapshotOperator

        initial_load = PgDecodeInitialSnapshotOperator(
            task_id="initial_load",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            plugin="pgoutput",
        )
        # downstream: batch_paths="{{ ti.xcom_pull(task_ids='initial_load') }}"

    :param slot_name: the new slot (``[a-z0-9_]``, up to 63 characters). (templated)
    :param staging_root: the root of staged batches: a local directory or ``s3://bucket/prefix``.
        (templated)
    :param plugin: the slot's output plugin, ``test_decoding`` or ``pgoutput``. (templated)
    :param tables: ``schema.table`` names or glob patterns (``public.order_*``) to copy;
        default (empty) every ordinary and partitioned table outside the system schemas (for
        pgoutput with ``publication``: in the publication), minus ``exclude_tables``. Patterns
        are matched against the catalog when the task runs; one that matches no table fails it.
        With the default or a pattern, a table without a usable key that is not loaded
        ``append_only`` fails the task before the slot is created, in one error naming every
        such table and the ways forward. (templated)
    :param exclude_tables: ``schema.table`` names or patterns never to copy. (templated)
    :param table_options: per-table options, ``{"schema.table": {"mode": "append_only"}}``
        (:class:`~airflow_provider_pgdecode.batch.options.TableOptions`): an ``append_only``
        table needs no key; ``arrays`` and ``max_value_bytes`` apply to the copy (docs/merge.md,
        "Values the pipeline cannot carry"). Give the incremental extract the same. (templated)
    :param publication: for a pgoutput slot, the publication the pipeline reads: with the default
        ``tables`` only its tables are copied. (templated)
    :param postgres_conn_id: the Airflow connection of the source database. (templated)
    :param two_phase: create the slot with two-phase decoding (PostgreSQL 15+ with an exported
        snapshot, and ``max_prepared_transactions > 0``); fixed when the slot is created.
    :param chunk_rows: the target rows per copied chunk (one Parquet part each); it also bounds
        the rows a worker holds in memory. (templated)
    :param workers: chunks copied at once, each on its own connection; ``None`` or 0 picks
        ``min(4, cores)``. The staged batch does not depend on it. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    :param copy_on: where the chunks are copied: ``workers`` (default: ``workers`` threads in this
        task) or ``spark``: one Spark task per chunk, on the executors of a Spark application this
        task drives (``spark_master``), each importing the snapshot over its own connection and
        writing its part straight to the staging root, so the copy scales with executors.
        ``spark`` needs a ``staging_root`` on object storage (the executors upload their parts;
        the store's settings travel with the tasks) or a local one that every executor mounts at
        the same path, and executors whose Python has this package and psycopg
        (``PYSPARK_PYTHON``, set to this worker's Python; for a cluster, install the package there).
        The staged batch is the same either way (docs/backfill.md, "How the initial copy works").
        (templated)
    :param spark_master: with ``copy_on="spark"``, the Spark master (``spark://host:7077``,
        ``local[4]``); default ``local[*]``. (templated)
    :param spark_conf: with ``copy_on="spark"``, extra Spark settings (``spark.executor.cores``,
        ``spark.task.maxFailures``, ``spark.driver.host`` for a remote master, ...).
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
        "copy_on",
        "spark_master",
    )
    ui_color = "#e8f0d9"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        plugin: str = "test_decoding",
        tables: Sequence[str] | None = None,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        two_phase: bool = True,
        chunk_rows: int | str = DEFAULT_SNAPSHOT_CHUNK_ROWS,
        workers: int | str | None = None,
        exclude_tables: Sequence[str] | None = None,
        table_options: Mapping[str, Mapping[str, Any]] | str | None = None,
        publication: str | None = None,
        storage_conn_id: str | None = None,
        copy_on: str = "workers",
        spark_master: str | None = None,
        spark_conf: Mapping[str, str] | None = None,
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
        self.two_phase = two_phase
        self.chunk_rows = chunk_rows
        self.workers = workers
        self.storage_conn_id = storage_conn_id
        self.copy_on = copy_on
        self.spark_master = spark_master
        self.spark_conf = spark_conf

    def execute(self, context: Context) -> list[str]:
        with fail_fast(), pgdecode_environment():  # [pgdecode] spool_dir
            return self._load()

    def _settings(self) -> tuple[int, int | None]:
        try:
            chunk_rows = int(self.chunk_rows)
            workers = int(self.workers or 0) or None
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"chunk_rows and workers must be whole numbers, not {self.chunk_rows!r} and {self.workers!r}"
            ) from None
        if self.copy_on not in COPY_ON:
            raise ConfigurationError(f"copy_on must be one of {', '.join(COPY_ON)}, not {self.copy_on!r}")
        if chunk_rows < 1 or (workers is not None and workers < 1):
            raise ConfigurationError(
                f"chunk_rows must be at least 1 and workers at least 0 (0: the default), not {chunk_rows} and "
                f"{self.workers}"
            )
        return chunk_rows, workers

    def _load(self) -> list[str]:
        slot, staging = str(self.slot_name), str(self.staging_root)
        chunk_rows, workers = self._settings()
        named = as_table_names(self.tables)
        excluded = as_table_names(self.exclude_tables)
        TableSelection.parse(named)  # a bad pattern is refused before anything is done
        options = as_table_options(self.table_options)
        parse_table_options(options)
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            exists = hook.get_slot_client().exists(slot)
            tables: list[tuple[str, str]] = []
            if not exists:  # (an existing slot's staged load is merged again: no tables to choose)
                publication = str(self.publication) if self.publication and self.plugin == "pgoutput" else None
                tables = resolve_tables(
                    hook.get_catalog, named, publication=publication, exclude_tables=excluded, table_options=options
                )
            dsn = hook.dsn()
            primary = hook.primary_link()
        root = storage_for(staging, self.storage_conn_id)
        if exists:
            staged = find_initial_load(root, slot)
            if staged is None:
                raise SlotError(
                    f"slot {slot!r} already exists and has no staged initial load under {staging}, so its tables "
                    f"cannot be loaded consistently with it from here. To load tables into the running pipeline use "
                    f"mode 'add-table' or 'resnapshot' (PgDecodeTableSnapshotOperator); to start over drop the slot "
                    f"(SELECT pg_drop_replication_slot('{slot}')) and run mode 'initial' again"
                )
            self.log.info(
                "initial load of slot %s was staged before (up to %s): merging it again", slot, staged.end_lsn
            )
            return [str(staged.path)]
        if not tables:
            raise CatalogError(
                "no table to load: the database has no table outside the system schemas (and exclude_tables, and "
                "the publication for pgoutput). Create the tables first, or name the tables to copy"
            )
        self.log.info("initial load: creating slot %s and copying %d table(s)", slot, len(tables))
        with (
            self._copy_session(slot) as spark,
            create_slot_with_snapshot(
                dsn, slot, str(self.plugin), two_phase=bool(self.two_phase), primary=primary
            ) as snapshot,
        ):
            manifest = stage_snapshot(
                dsn,
                snapshot.snapshot_name,
                snapshot.consistent_lsn,
                slot,
                root,
                tables,
                plugin=str(self.plugin),
                chunk_rows=chunk_rows,
                workers=workers,
                table_options=options,
                publication=self.publication if self.plugin == "pgoutput" else None,
                spark=spark,
            )
        return [str(manifest.path)]

    @contextmanager
    def _copy_session(self, slot: str) -> Iterator[SparkSession | None]:
        """The Spark session the chunks are copied by (``copy_on="spark"``), else ``None``; one
        started here is stopped after the copy (an active one, e.g. a test's, is left running)."""
        if self.copy_on != "spark":
            yield None
            return
        from pyspark import SparkContext

        master = str(self.spark_master) if self.spark_master else None
        # A JVM already running in this process (getOrCreate returns its session) is not ours to stop.
        running = getattr(SparkContext, "_active_spark_context", None) is not None
        self.log.info("initial load: copying the chunks as Spark tasks (master %s)", master or "local[*]")
        spark = build_spark_session(
            master, app_name=f"pgdecode-initial-load-{slot}", extra_conf=dict(self.spark_conf or {})
        )
        try:
            yield spark
        finally:
            if not running:
                spark.stop()
