"""Merge staged batches into Delta tables with the Spark job shipped in the package."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import AssetAlias, BaseOperator, Context

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings
from airflow_provider_pgdecode.cycle import CycleTask
from airflow_provider_pgdecode.cycle.merge import MERGE_JOB_MODULE, MergeArguments, MergeJob
from airflow_provider_pgdecode.utils.arguments import parse_batch_paths
from airflow_provider_pgdecode.utils.assets import delta_table_asset, location_asset

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

__all__ = ["MERGE_JOB_MODULE", "PgDecodeMergeOperator", "delta_table_asset", "location_asset", "parse_batch_paths"]

DEFAULT_ASSET_ALIAS = "pgdecode_delta_tables"


class PgDecodeMergeOperator(CycleTask[MergeArguments], BaseOperator):
    """Submit the merge job (``spark/merge_job.py``) for one or more staged batches.

    Thin over :class:`~airflow.providers.apache.spark.hooks.spark_submit.SparkSubmitHook`:
    the Spark master and deploy mode come from the Spark connection (``conn_id``; a missing
    connection fails the task instead of silently falling back to YARN). Defaults that make a
    pip-installed Spark work from the Airflow worker: ``spark_binary`` is the ``spark-submit``
    beside the worker's Python; ``SPARK_HOME`` and ``PYSPARK_PYTHON`` are set, and
    ``SPARK_LOCAL_IP=127.0.0.1`` with a local master only. With a remote master in client mode the
    driver (in the Airflow worker) must advertise an address the executors reach: set the Spark
    connection's extra ``driver-host`` (and ``driver-bind-address``, e.g. ``0.0.0.0``), or
    ``spark.driver.host`` in ``conf``, or ``SPARK_LOCAL_IP`` in the worker's environment
    (docs/docker.md). Delta's jars come through ``--packages`` with a project-local Ivy cache
    (:func:`airflow_provider_pgdecode.spark.session.delta_spark_conf`).

    Batches whose tables hold no rows (only empty transactions, heartbeats, or prepared
    transactions still pending) are not submitted; when no batch has rows the job is not run
    at all, and the confirm step can still advance the slot. Quarantined changes (a table's
    ``on_bad_value: quarantine``) are appended to ``<delta_root>/_pgdecode_quarantine`` and logged
    per table. Logical decoding messages (``pg_logical_emit_message``: the non-transactional ones
    and those of committed transactions) are appended to ``<delta_root>/_pgdecode_messages``
    (docs/messages.md). A refused batch fails the task without retry (``MergeInputError``), and so does a
    Spark out-of-memory (``MergeOutOfMemoryError``, naming ``driver_memory`` / ``executor_memory``
    and ``spark.driver.memory`` / ``spark.executor.memory``). A table whose Delta table cannot be
    read or written is parked instead (docs/merge.md, "Parked tables"): the others are merged,
    the task succeeds with a warning, and later runs give the parked table its kept batches
    again until it catches up. Returns (to XCom) ``batches`` (the merged ones), ``skipped``,
    ``end_lsn``, ``parked`` (the parked tables, by name) and the job's ``summary``. ``on_kill`` stops
    the spark-submit process (and the driver in cluster modes) through the hook.

    Example::

        from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

        merge = PgDecodeMergeOperator(
            task_id="merge",
            batch_paths="{{ ti.xcom_pull(task_ids='extract')['path'] }}",
            delta_root="/data/delta",
            conn_id="spark_default",  # e.g. AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type":"spark","host":"local[*]"}'
        )

    :param batch_paths: a batch directory, a list of them, or a JSON list (in LSN order). (templated)
    :param delta_root: the root of the Delta tables (``<root>/<schema>/<table>``). (templated)
    :param conn_id: the Spark connection (master, deploy mode, queue). (templated)
    :param spark_binary: the ``spark-submit`` to run; default the one beside ``sys.executable``.
    :param packages: Maven coordinates for ``--packages``; default Delta's artifact for the
        installed pyspark, and ``hadoop-aws`` (Hadoop's S3A, with its AWS SDK) when a batch or the
        Delta root is on object storage. (templated)
    :param conf: Spark configuration, merged over pgdecode's defaults. (templated)
    :param env_vars: environment of the spark-submit process, merged over the defaults. (templated)
    :param storage_conn_id: an Airflow ``aws`` connection (key pair, ``region_name`` and, for an
        S3-compatible store, ``endpoint_url`` in the extra) for ``s3://`` batches and Delta root;
        empty: local paths, or the ``AWS_*`` environment and instance role for ``s3://``. Its
        settings reach spark-submit as ``AWS_*`` environment at run time, never as arguments,
        rendered fields, logs or XCom (docs/object-storage.md). (templated)
    :param merge_args: more arguments of the merge job (e.g. ``["--type-map", "mood=string"]``). (templated)
    :param driver_memory: ``--driver-memory``.
    :param executor_memory: ``--executor-memory``.
    :param executor_cores: ``--executor-cores``.
    :param total_executor_cores: ``--total-executor-cores`` (standalone).
    :param num_executors: ``--num-executors`` (YARN).
    :param spark_name: the Spark application name. (templated)
    :param verbose: ``--verbose``.
    :param asset_alias: name of an :class:`~airflow.sdk.AssetAlias` added to the task's outlets;
        each run emits one Asset event per Delta table it changed
        (``file://<delta_root>/<schema>/<table>``), so downstream DAGs can schedule on a table
        (``schedule=[Asset("file:///data/delta/public/orders")]``) or on the alias. ``None``
        emits nothing.
    """

    template_fields: Sequence[str] = (
        "batch_paths",
        "delta_root",
        "conn_id",
        "storage_conn_id",
        "packages",
        "conf",
        "env_vars",
        "merge_args",
        "spark_name",
    )
    template_fields_renderers = {"conf": "json", "env_vars": "json"}
    arguments_kind = MergeArguments
    ui_color = "#f0e4d9"

    def __init__(
        self,
        *,
        batch_paths: str | Sequence[str],
        delta_root: str,
        conn_id: str = "spark_default",
        spark_binary: str | None = None,
        packages: str | None = None,
        conf: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        merge_args: Sequence[str] | None = None,
        driver_memory: str | None = "1g",
        executor_memory: str | None = None,
        executor_cores: int | None = None,
        total_executor_cores: int | None = None,
        num_executors: int | None = None,
        spark_name: str = "pgdecode-merge",
        verbose: bool = False,
        asset_alias: str | None = DEFAULT_ASSET_ALIAS,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        if asset_alias is not None:
            kwargs["outlets"] = [*(kwargs.get("outlets") or []), AssetAlias(asset_alias)]
        super().__init__(**kwargs)
        self.asset_alias = asset_alias
        self.batch_paths = batch_paths
        self.delta_root = delta_root
        self.conn_id = conn_id
        self.storage_conn_id = storage_conn_id
        self.spark_binary = spark_binary
        self.packages = packages
        self.conf = dict(conf or {})
        self.env_vars = dict(env_vars or {})
        self.merge_args = list(merge_args or [])
        self.driver_memory = driver_memory
        self.executor_memory = executor_memory
        self.executor_cores = executor_cores
        self.total_executor_cores = total_executor_cores
        self.num_executors = num_executors
        self.spark_name = spark_name
        self.verbose = verbose
        self._job: MergeJob | None = None

    def get_hook(
        self,
        batches: Sequence[str],
        summary_path: str | None = None,
        settings: ObjectStoreSettings | None = None,
        context: Context | None = None,
    ) -> SparkSubmitHook:
        """What :meth:`MergeJob.get_hook <airflow_provider_pgdecode.cycle.merge.MergeJob.get_hook>`
        gives with this task's fields: the spark-submit of the merge job over ``batches``."""
        return MergeJob(self.cycle_arguments(), self.log).get_hook(batches, summary_path, settings, context)

    def execute(self, context: Context) -> dict[str, Any]:
        self._job = MergeJob(self.cycle_arguments(), self.log)
        return self._job.merge(context)

    def on_kill(self) -> None:
        """Stop the spark-submit process (and the driver or application in cluster modes), or this
        task's Spark work on a Spark Connect server."""
        if self._job is not None:
            self._job.on_kill()

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """OpenLineage of the run (Airflow's OpenLineage provider calls it after success): inputs,
        the PostgreSQL tables the merged batches held; outputs, the Delta tables it changed, with
        schemas, row counts and the ``pgdecode`` run facet (slot, LSN range). See docs/lineage.md."""
        from airflow_provider_pgdecode.utils.openlineage import merge_lineage

        batches, summary = self._job.lineage if self._job is not None else ([], None)
        return merge_lineage(batches, summary)
