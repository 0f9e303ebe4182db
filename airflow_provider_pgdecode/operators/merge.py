"""Merge staged batches into Delta tables with the Spark job shipped in the package."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import AssetAlias, BaseOperator, Context

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.parking import (
    Parking,
    catch_up_batches,
    read_parked,
    settle_parked,
    staging_root_of,
    write_parked,
)
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, is_object_store
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import MergeOutOfMemoryError
from airflow_provider_pgdecode.hooks.object_store import object_store_settings, storage_for
from airflow_provider_pgdecode.hooks.spark_job import (
    SparkJobTask,
    read_json_object,
    refusal_error,
    submit_hook,
    uses_object_store,
)
from airflow_provider_pgdecode.utils.arguments import parse_batch_paths
from airflow_provider_pgdecode.utils.assets import delta_table_asset, location_asset
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

__all__ = ["PgDecodeMergeOperator", "delta_table_asset", "location_asset", "parse_batch_paths"]

MERGE_JOB_MODULE = "airflow_provider_pgdecode.spark.merge_job"
DEFAULT_ASSET_ALIAS = "pgdecode_delta_tables"


def read_manifest(path: str, settings: ObjectStoreSettings | None) -> BatchManifest:
    """A batch's manifest: local, or on object storage with the storage connection's settings."""
    location: Any = Storage(path, settings) if settings is not None and is_object_store(path) else path
    return BatchManifest.read(location)


class PgDecodeMergeOperator(SparkJobTask, BaseOperator):
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
        self._lineage: tuple[list[BatchManifest], dict[str, Any] | None] = ([], None)
        self._parking_args: list[str] = []

    def read_batches(
        self, settings: ObjectStoreSettings | None = None
    ) -> tuple[list[BatchManifest], list[BatchManifest]]:
        """The batches' manifests, split into those with rows to merge (table changes, quarantined
        changes, logical decoding messages) and those without."""
        to_merge: list[BatchManifest] = []
        empty: list[BatchManifest] = []
        for path in parse_batch_paths(self.batch_paths):
            with fail_fast():
                manifest = read_manifest(path, settings)
            has_rows = any(t.rows for t in manifest.tables) or bool(manifest.quarantine) or bool(manifest.messages)
            (to_merge if has_rows else empty).append(manifest)
        order = lambda m: (Lsn.parse(m.start_lsn), Lsn.parse(m.end_lsn))  # noqa: E731
        return sorted(to_merge, key=order), sorted(empty, key=order)

    def get_hook(
        self,
        batches: Sequence[str],
        summary_path: str | None = None,
        settings: ObjectStoreSettings | None = None,
    ) -> SparkSubmitHook:
        """The SparkSubmitHook that runs the merge job over ``batches``; ``settings`` (the storage
        connection's) reach it as ``AWS_*`` environment of the spark-submit process only."""
        args = ["--delta-root", str(self.delta_root)]
        for batch in batches:
            args += ["--batch", str(batch)]
        if summary_path:
            args += ["--summary-json", summary_path]
        args += [str(a) for a in self.merge_args]
        args += self._parking_args
        return submit_hook(
            self,
            job=MERGE_JOB_MODULE,
            name=self.spark_name,
            args=args,
            object_store=uses_object_store(str(self.delta_root), *map(str, batches)),
            settings=settings,
            executor_cores=self.executor_cores,
            total_executor_cores=self.total_executor_cores,
            num_executors=self.num_executors,
            verbose=self.verbose,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        return self.merge(context)

    def merge(self, context: Context) -> dict[str, Any]:
        """Merge ``batch_paths``; returns what :meth:`execute` returns (the drain task calls this
        once per batch)."""
        with fail_fast():
            return self._merge(context)

    def _merge(self, context: Context) -> dict[str, Any]:
        settings = object_store_settings(self.storage_conn_id)
        to_merge, empty = self.read_batches(settings)
        for manifest in empty:
            self.log.info(
                "Batch %s (LSN %s to %s) has no table rows (%d transactions, %d prepared pending): nothing to merge",
                manifest.path,
                manifest.start_lsn,
                manifest.end_lsn,
                manifest.transactions,
                len(manifest.prepared_pending),
            )
        all_batches = sorted([*to_merge, *empty], key=lambda m: Lsn.parse(m.end_lsn))
        result: dict[str, Any] = {
            "delta_root": str(self.delta_root),
            "batches": [str(m.path) for m in to_merge],
            "skipped": [str(m.path) for m in empty],
            "end_lsn": all_batches[-1].end_lsn if all_batches else None,
            "summary": None,
            "parked": {},
        }
        parking = self._parking(to_merge, all_batches, settings)
        self._parking_args = parking.merge_args() if parking else []
        if not to_merge and not (parking and parking.catch_up):
            self.log.info("No batch has changes: the merge job is not submitted")
            return result
        rows: dict[str, int] = {}
        for manifest in to_merge:
            for table in manifest.tables:
                key = f"{table.schema}.{table.table}"
                rows[key] = rows.get(key, 0) + table.rows
        if to_merge:
            self.log.info(
                "Merging %d batch(es), LSN %s to %s, into %s: %s",
                len(to_merge),
                to_merge[0].start_lsn,
                to_merge[-1].end_lsn,
                self.delta_root,
                ", ".join(f"{name} {n} rows" for name, n in sorted(rows.items())),
            )
        paths = [str(m.path) for m in to_merge]
        summary = self.run_job(
            "merge",
            submit=lambda path: self.get_hook(paths, path, settings),
            in_session=lambda spark: self._merge_in_session(spark, paths),
            settings=settings,
        )
        if summary is not None and "error" in summary:
            # The job refused the input and left Delta unchanged, or ran out of memory: retrying
            # with the same input and memory fails the same way.
            raise refusal_error(
                "merge",
                summary,
                f"this task: driver_memory={self.driver_memory!r}, executor_memory={self.executor_memory!r}, "
                f"conf={self._memory_conf()}",
            )
        summary = self._report_summary(summary)
        result["summary"] = summary
        result["parked"] = self._settle_parking(parking, summary)
        self._emit_assets(context, summary)
        self._lineage = (to_merge, summary)
        return result

    def _parking(
        self, to_merge: Sequence[BatchManifest], batches: Sequence[BatchManifest], settings: ObjectStoreSettings | None
    ) -> Parking | None:
        """The slot's parked tables and the earlier batches they still need (batch/parking.py)."""
        if not batches or "--no-park" in self.merge_args:
            return None
        first = batches[0]
        staging = storage_for(staging_root_of(str(first.path)), self.storage_conn_id)
        parked = read_parked(staging, first.slot)
        if not parked:
            return Parking(staging, first.slot, {}, [], to_merge[0].start if to_merge else None)
        before = to_merge[0].start if to_merge else batches[-1].end
        catch_up = catch_up_batches(staging, first.slot, parked, before)
        for name, entry in sorted(parked.items()):
            self.log.warning(
                "Table %s is parked since LSN %s (%s, %d run(s)): %s. Its staged changes from there on are merged "
                "again for it in this run (%d earlier batch(es))",
                name,
                entry.since_lsn,
                entry.parked_at,
                entry.runs,
                entry.reason,
                len(catch_up),
            )
        return Parking(staging, first.slot, parked, catch_up, to_merge[0].start if to_merge else None)

    def _settle_parking(self, parking: Parking | None, summary: Mapping[str, Any] | None) -> dict[str, Any]:
        """Record which tables this run parked and which caught up; the parked tables, for XCom."""
        if parking is None or summary is None:
            return {}
        since = parking.since or Lsn.parse(str(summary.get("end_lsn")))
        now = datetime.now(UTC).isoformat(timespec="seconds")
        parked, newly, caught_up = settle_parked(parking.parked, summary.get("tables") or {}, since, now)
        write_parked(parking.staging, parking.slot, parked)
        for name in newly:
            self.log.warning(
                "Table %s is parked: %s. Nothing of it was written; every other table was merged and the slot moves "
                "on. Its staged batches from LSN %s on are kept (retention too) and merged again for it by each run: "
                "fix the cause and the next run applies them in order, exactly once",
                name,
                parked[name].reason,
                parked[name].since_lsn,
            )
        for name in caught_up:
            self.log.info("Table %s caught up: its parked changes are merged", name)
        return {name: asdict(entry) for name, entry in parked.items()}

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """OpenLineage of the run (Airflow's OpenLineage provider calls it after success): inputs,
        the PostgreSQL tables the merged batches held; outputs, the Delta tables it changed, with
        schemas, row counts and the ``pgdecode`` run facet (slot, LSN range). See docs/lineage.md."""
        from airflow_provider_pgdecode.utils.openlineage import merge_lineage

        batches, summary = self._lineage
        return merge_lineage(batches, summary)

    def _merge_in_session(self, spark: Any, batches: Sequence[str]) -> dict[str, Any]:
        """The merge as a client session of the Spark Connect server of ``conn_id``: the merge job's
        own core (:func:`~airflow_provider_pgdecode.spark.merge_job.run_merge_job`) runs in this
        task, its Spark work on the server (a session of its own, stopped at the end: the server
        and its warm JVM stay; ``conf`` entries become settings of this session only). Its summary,
        or its refusal."""
        from airflow_provider_pgdecode.spark.merge_job import (
            build_argument_parser,
            options_from_args,
            out_of_memory_error,
            run_merge_job,
        )

        args = ["--delta-root", str(self.delta_root)]
        for batch in batches:
            args += ["--batch", batch]
        parsed = build_argument_parser().parse_args([*args, *(str(a) for a in self.merge_args), *self._parking_args])
        workdir = tempfile.mkdtemp(prefix="pgdecode-merge-")
        refusal_path = str(Path(workdir) / "summary.json")
        try:
            code, summary = run_merge_job(
                spark, list(batches), str(self.delta_root), options_from_args(parsed), refusal_path
            )
            refusal = read_json_object(refusal_path) if code else None
        except Exception as error:
            memory = out_of_memory_error(error, self._memory_conf())
            if memory is not None:
                raise memory from None
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if summary is not None:
            return summary
        if code == 3:  # out of memory: the refusal's message, the session's memory settings
            message = str((refusal or {}).get("message") or "the merge ran out of memory")
            return {
                "error": MergeOutOfMemoryError.__name__,
                "message": message,
                "detail": f"this task: conf={self._memory_conf()}",
            }
        if refusal is not None and "error" in refusal:
            return refusal
        return {"error": "error", "message": "see the merge job's error above"}

    def _log_summary(self, summary: Mapping[str, Any]) -> None:
        """One line per table and the total (:func:`~airflow_provider_pgdecode.spark.merge_job.summary_lines`),
        the same from spark-submit and from Spark Connect."""
        from airflow_provider_pgdecode.spark.merge_job import summary_lines

        for line in summary_lines(summary):
            self.log.info("%s", line)

    def _emit_assets(self, context: Context, summary: dict[str, Any] | None) -> None:
        """One Asset event per Delta table this run changed, through the task's AssetAlias."""
        if self.asset_alias is None or not summary or "outlet_events" not in context:
            return
        events = context["outlet_events"][AssetAlias(self.asset_alias)]
        root = str(self.delta_root)
        for name, info in sorted((summary.get("tables") or {}).items()):
            if not isinstance(info, dict) or info.get("status") != "merged":
                continue
            schema, table = info.get("schema"), info.get("table")
            if not schema or not table:  # a summary of a job before the names were in it
                schema, _, table = name.partition(".")
            events.add(
                delta_table_asset(root, schema, table),
                extra={k: info.get(k) for k in ("inserted", "updated", "deleted", "delta_version", "watermark_lsn")},
            )

    def _report_summary(self, summary: dict[str, Any] | None) -> dict[str, Any] | None:
        """Log the job's summary: a line per table and the total, and a warning per table with
        quarantined changes; the same from spark-submit and from Spark Connect."""
        if summary is None:
            # Cluster deploy mode: the driver wrote it on another machine.
            self.log.info("The merge job's summary is not on this machine; see the Spark driver's log")
            return None
        if isinstance(summary.get("tables"), dict):
            self._log_summary(summary)
        quarantine = summary.get("quarantine")
        if isinstance(quarantine, dict):
            for name, count in sorted((quarantine.get("tables") or {}).items()):
                self.log.warning(
                    "  %s: %s change(s) quarantined (%s) in %s: each holds a value the pipeline cannot carry; "
                    "the Delta row of its key may be stale until the source value is fixed and the table "
                    "resnapshotted (docs/merge.md)",
                    name,
                    count,
                    quarantine.get("status"),
                    quarantine.get("path"),
                )
        return summary

    def _memory_conf(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.conf.items() if k in ("spark.driver.memory", "spark.executor.memory")}
