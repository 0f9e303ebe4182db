"""OPTIMIZE and VACUUM pgdecode's Delta tables with the maintenance job shipped in the package.

The job (``spark/maintenance_job.py``) runs by spark-submit or in this task as a client session of a
Spark Connect server, as the merge and verify jobs do. docs/maintenance.md says what it runs, why its
retention settings are safe for exactly-once, and how it lives beside the incremental DAG.

Example::

    from airflow_provider_pgdecode.operators.maintenance import PgDecodeDeltaMaintenanceOperator

    maintenance = PgDecodeDeltaMaintenanceOperator(
        task_id="maintenance",
        delta_root="/data/delta",
        tables=[],  # every pgdecode table under delta_root
        zorder=False,
        retention_hours=None,  # each table's delta.deletedFileRetentionDuration (7 days by default)
    )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings
from airflow_provider_pgdecode.errors import MaintenanceError
from airflow_provider_pgdecode.hooks.object_store import object_store_settings
from airflow_provider_pgdecode.hooks.spark_job import (
    SparkJobTask,
    refusal_error,
    submit_hook,
    uses_object_store,
)
from airflow_provider_pgdecode.utils.arguments import parse_batch_paths
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

MAINTENANCE_JOB_MODULE = "airflow_provider_pgdecode.spark.maintenance_job"


def _flag(value: Any) -> bool:
    """A boolean argument, also as a rendered template (``"False"``, ``"true"``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _hours(value: Any) -> float | None:
    """Hours from a number, or a rendered template of one; ``None``/empty: the table's own."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None", "null")):
        return None
    return float(value)


class PgDecodeDeltaMaintenanceOperator(SparkJobTask, BaseOperator):
    """OPTIMIZE (optionally ``ZORDER BY`` the key) and VACUUM pgdecode's Delta tables, keeping every
    slot's transaction id (the merge's exactly-once watermark).

    As the merge operator's job: by spark-submit when ``conn_id`` is a ``spark`` connection, or in
    this task as a client session of the server of a ``spark_connect`` connection.

    Every table is checked before anything is written, and the task fails without a retry
    (:class:`~airflow_provider_pgdecode.errors.MaintenanceRefusedError`) naming the table and the
    way forward when a table's ``delta.setTransactionRetentionDuration`` is shorter than
    ``min_txn_retention_hours`` (Delta would forget a slot's watermark, and a batch merged again
    would be applied twice), or when ``retention_hours`` is below Delta's VACUUM safety check (the
    table's ``delta.deletedFileRetentionDuration``) and ``allow_short_retention`` is not set. After
    each table the slots' transaction ids are read again: a lost one fails the task.

    An OPTIMIZE that conflicts with a concurrent merge of the same table is retried by the job
    (``optimize_attempts`` in ``maintenance_args``); a merge that loses the conflict fails its own
    task, which Airflow retries, and its slot is not advanced before it succeeds.

    Returns (to XCom) ``{"delta_root", "tables": {"schema.table": {...}}, "seconds"}``, per table:
    ``files_before``/``files_after``, ``bytes_before``/``bytes_after``,
    ``version_before``/``version_after``, ``files_compacted``, ``files_written``, ``zorder_by``,
    ``files_removed`` (by VACUUM), ``retention_hours``, and ``transactions_before`` /
    ``transactions_after`` (each slot's app id and version: equal, or higher after a concurrent merge).

    Example::

        from airflow_provider_pgdecode.operators.maintenance import PgDecodeDeltaMaintenanceOperator

        maintenance = PgDecodeDeltaMaintenanceOperator(
            task_id="maintenance",
            delta_root="/data/delta",
            tables=["public.orders"],  # empty: every pgdecode table under delta_root
            zorder=True,
            conn_id="spark_default",
        )

    :param delta_root: the root of the pipeline's Delta tables. (templated)
    :param tables: ``schema.table`` names, a JSON list of them, or empty for every pgdecode table
        under ``delta_root`` (found by their ``pgdecode.source`` property). (templated)
    :param conn_id: the Spark connection: ``spark`` (spark-submit) or ``spark_connect`` (a client
        session of that server; ``conf`` entries become settings of the session). (templated)
    :param optimize: run OPTIMIZE. (templated)
    :param zorder: OPTIMIZE ... ZORDER BY the table's key (rewrites the whole table each run). (templated)
    :param purge_deletion_vectors: also ``REORG TABLE ... APPLY (PURGE)`` (rewrite every file that
        still has a deletion vector). (templated)
    :param vacuum: run VACUUM. (templated)
    :param retention_hours: VACUUM's retention; ``None``: each table's
        ``delta.deletedFileRetentionDuration`` (7 days unless set). (templated)
    :param allow_short_retention: allow a retention below Delta's safety check (only when no job reads
        versions that old). (templated)
    :param min_txn_retention_hours: the shortest ``delta.setTransactionRetentionDuration`` accepted
        (default 720, 30 days; unset never expires). (templated)
    :param maintenance_args: more arguments of the job, e.g. ``["--optimize-attempts", "5"]``. (templated)
    :param spark_binary: the ``spark-submit`` to run; default the one beside ``sys.executable``.
    :param packages: Maven coordinates for ``--packages``; default Delta's. (templated)
    :param conf: Spark configuration, merged over pgdecode's defaults. (templated)
    :param env_vars: environment of spark-submit, merged over the defaults. (templated)
    :param storage_conn_id: the ``aws`` connection of an ``s3://`` Delta root, as the merge
        operator's; its settings reach spark-submit as ``AWS_*`` environment only. (templated)
    :param driver_memory: ``--driver-memory``.
    :param executor_memory: ``--executor-memory``.
    """

    template_fields: Sequence[str] = (
        "delta_root",
        "tables",
        "conn_id",
        "optimize",
        "zorder",
        "purge_deletion_vectors",
        "vacuum",
        "retention_hours",
        "allow_short_retention",
        "min_txn_retention_hours",
        "maintenance_args",
        "packages",
        "conf",
        "env_vars",
        "storage_conn_id",
    )
    template_fields_renderers = {"conf": "json", "env_vars": "json"}
    ui_color = "#e4e4f0"

    def __init__(
        self,
        *,
        delta_root: str,
        tables: str | Sequence[str] | None = None,
        conn_id: str = "spark_default",
        optimize: bool | str = True,
        zorder: bool | str = False,
        purge_deletion_vectors: bool | str = False,
        vacuum: bool | str = True,
        retention_hours: float | str | None = None,
        allow_short_retention: bool | str = False,
        min_txn_retention_hours: float | str = 720,
        maintenance_args: Sequence[str] | None = None,
        spark_binary: str | None = None,
        packages: str | None = None,
        conf: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        driver_memory: str | None = "1g",
        executor_memory: str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.delta_root = delta_root
        self.tables = tables
        self.conn_id = conn_id
        self.optimize = optimize
        self.zorder = zorder
        self.purge_deletion_vectors = purge_deletion_vectors
        self.vacuum = vacuum
        self.retention_hours = retention_hours
        self.allow_short_retention = allow_short_retention
        self.min_txn_retention_hours = min_txn_retention_hours
        self.maintenance_args = list(maintenance_args or [])
        self.spark_binary = spark_binary
        self.packages = packages
        self.conf = dict(conf or {})
        self.env_vars = dict(env_vars or {})
        self.driver_memory = driver_memory
        self.executor_memory = executor_memory
        self.storage_conn_id = storage_conn_id

    def job_args(self, summary_path: str | None = None) -> list[str]:
        """The maintenance job's arguments (spark-submit's command line, or parsed for a Connect session)."""
        args = ["--delta-root", str(self.delta_root)]
        for table in parse_batch_paths(self.tables):  # a name, a list, or a JSON list of names
            args += ["--table", table]
        if not _flag(self.optimize):
            args.append("--no-optimize")
        if _flag(self.zorder):
            args.append("--zorder")
        if _flag(self.purge_deletion_vectors):
            args.append("--purge-deletion-vectors")
        if not _flag(self.vacuum):
            args.append("--no-vacuum")
        hours = _hours(self.retention_hours)
        if hours is not None:
            args += ["--retention-hours", f"{hours:g}"]
        if _flag(self.allow_short_retention):
            args.append("--allow-short-retention")
        args += ["--min-txn-retention-hours", f"{float(self.min_txn_retention_hours):g}"]
        if summary_path is not None:
            args += ["--summary-json", summary_path]
        return args + [str(a) for a in self.maintenance_args]

    def get_hook(
        self, summary_path: str, settings: ObjectStoreSettings | None = None, context: Context | None = None
    ) -> SparkSubmitHook:
        """The SparkSubmitHook that runs the maintenance job (settings and ``context`` as the merge
        operator's)."""
        return submit_hook(
            self,
            job=MAINTENANCE_JOB_MODULE,
            name="pgdecode-maintenance",
            args=self.job_args(summary_path),
            object_store=uses_object_store(str(self.delta_root)),
            settings=settings,
            context=context,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            return self._maintain(context)

    def _maintain(self, context: Context) -> dict[str, Any]:
        settings = object_store_settings(self.storage_conn_id)
        self.log.info("Maintaining the pgdecode Delta tables under %s: %s", self.delta_root, self.job_args())
        summary = self.run_job(
            "maintenance",
            submit=lambda path: self.get_hook(path, settings, context),
            in_session=self._maintain_in_session,
            settings=settings,
        )
        if summary is not None and "error" in summary:
            raise refusal_error("maintenance", summary)
        if summary is None or "tables" not in summary:
            raise MaintenanceError(f"the maintenance job wrote no summary for {self.delta_root} (its log says why)")
        from airflow_provider_pgdecode.spark.maintenance_job import table_line

        for name, entry in sorted(summary["tables"].items()):
            self.log.info("%s", table_line(name, entry))
        if not summary["tables"]:
            self.log.warning("No pgdecode Delta table under %s: nothing to do", self.delta_root)
        return summary

    def _maintain_in_session(self, spark: Any) -> dict[str, Any]:
        """The maintenance job's core run in this task as a client session of the Spark Connect
        server of ``conn_id``: its summary or refusal."""
        from airflow_provider_pgdecode.spark.maintenance_job import build_argument_parser, run_maintenance_job

        return run_maintenance_job(spark, build_argument_parser().parse_args(self.job_args()))[1]
