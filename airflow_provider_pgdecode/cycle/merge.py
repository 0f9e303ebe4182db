"""One merge: the merge job (``spark/merge_job.py``) over staged batches, by spark-submit or in a
Spark Connect session, with parked tables, quarantine, Assets and lineage
(:class:`~airflow_provider_pgdecode.operators.merge.PgDecodeMergeOperator` runs a :class:`MergeJob`,
the drain :func:`merge_once`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import AssetAlias, Context

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
from airflow_provider_pgdecode.cycle import KillSwitch
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
from airflow_provider_pgdecode.utils import metrics
from airflow_provider_pgdecode.utils.arguments import parse_batch_paths
from airflow_provider_pgdecode.utils.assets import delta_table_asset
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

MERGE_JOB_MODULE = "airflow_provider_pgdecode.spark.merge_job"


@dataclass(frozen=True)
class MergeArguments:
    """A merge task's rendered arguments (the operator's parameters of the same names)."""

    OPERATOR: ClassVar[str] = "PgDecodeMergeOperator"

    batch_paths: str | Sequence[str]
    delta_root: str
    conn_id: str
    storage_conn_id: str | None
    spark_binary: str | None
    packages: str | None
    conf: Mapping[str, Any]
    env_vars: Mapping[str, str]
    merge_args: Sequence[str]
    driver_memory: str | None
    executor_memory: str | None
    executor_cores: int | None
    total_executor_cores: int | None
    num_executors: int | None
    spark_name: str
    verbose: bool
    asset_alias: str | None


def read_manifest(path: str, settings: ObjectStoreSettings | None) -> BatchManifest:
    """A batch's manifest: local, or on object storage with the storage connection's settings."""
    location: Any = Storage(path, settings) if settings is not None and is_object_store(path) else path
    return BatchManifest.read(location)


def merge_once(arguments: MergeArguments, context: Context, log: Any, kill: KillSwitch | None = None) -> MergeJob:
    """Merge ``arguments.batch_paths``; returns the job, done (its :attr:`~MergeJob.lineage`: what it
    merged). ``kill``, while the job runs, stops it."""
    job = MergeJob(arguments, log)
    with (kill or KillSwitch()).armed(job.on_kill):
        job.merge(context)
    return job


class MergeJob(SparkJobTask):
    """One merge of a task's batches: reads their manifests, submits the job (or runs it in a Spark
    Connect session), settles parked tables, logs the summary, emits an Asset event per changed Delta
    table; :meth:`on_kill` stops the job. After :meth:`merge`, :attr:`lineage` holds the merged batches
    and the job's summary (the merge task's OpenLineage)."""

    def __init__(self, arguments: MergeArguments, log: Any) -> None:
        self.arguments = arguments
        self.conn_id = arguments.conn_id
        self.conf = arguments.conf
        self.log = log
        self.lineage: tuple[list[BatchManifest], dict[str, Any] | None] = ([], None)
        self._parking_args: list[str] = []

    def read_batches(
        self, settings: ObjectStoreSettings | None = None
    ) -> tuple[list[BatchManifest], list[BatchManifest]]:
        """The batches' manifests, split into those with rows to merge (table changes, quarantined
        changes, logical decoding messages) and those without."""
        to_merge: list[BatchManifest] = []
        empty: list[BatchManifest] = []
        for path in parse_batch_paths(self.arguments.batch_paths):
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
        context: Context | None = None,
    ) -> SparkSubmitHook:
        """The SparkSubmitHook that runs the merge job over ``batches``; ``settings`` (the storage
        connection's) reach it as ``AWS_*`` environment of the spark-submit process only; with the
        task's ``context``, its conf carries the OpenLineage parent job (and transport) the
        ``[openlineage]`` configuration asks for (:func:`~airflow_provider_pgdecode.hooks.spark_job.openlineage_spark_conf`)."""
        args = ["--delta-root", str(self.arguments.delta_root)]
        for batch in batches:
            args += ["--batch", str(batch)]
        if summary_path:
            args += ["--summary-json", summary_path]
        args += [str(a) for a in self.arguments.merge_args]
        args += self._parking_args
        return submit_hook(
            self.arguments,
            job=MERGE_JOB_MODULE,
            name=self.arguments.spark_name,
            args=args,
            object_store=uses_object_store(str(self.arguments.delta_root), *map(str, batches)),
            settings=settings,
            context=context,
            executor_cores=self.arguments.executor_cores,
            total_executor_cores=self.arguments.total_executor_cores,
            num_executors=self.arguments.num_executors,
            verbose=self.arguments.verbose,
        )

    def merge(self, context: Context) -> dict[str, Any]:
        """Merge ``batch_paths``; returns what the merge task returns."""
        with fail_fast():
            return self._merge(context)

    def _merge(self, context: Context) -> dict[str, Any]:
        settings = object_store_settings(self.arguments.storage_conn_id)
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
            "delta_root": str(self.arguments.delta_root),
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
                self.arguments.delta_root,
                ", ".join(f"{name} {n} rows" for name, n in sorted(rows.items())),
            )
        paths = [str(m.path) for m in to_merge]
        started = time.monotonic()
        summary = self.run_job(
            "merge",
            submit=lambda path: self.get_hook(paths, path, settings, context),
            in_session=lambda spark: self._merge_in_session(spark, paths),
            settings=settings,
        )
        if summary is not None and "error" in summary:
            # The job refused the input and left Delta unchanged, or ran out of memory: retrying
            # with the same input and memory fails the same way.
            raise refusal_error(
                "merge",
                summary,
                f"this task: driver_memory={self.arguments.driver_memory!r}, executor_memory={self.arguments.executor_memory!r}, "
                f"conf={self._memory_conf()}",
            )
        summary = self._report_summary(summary)
        result["summary"] = summary
        result["parked"] = self._settle_parking(parking, summary)
        if summary is not None:
            metrics.merge_done(to_merge[0].slot, {**summary, "parked": result["parked"]}, time.monotonic() - started)
        self._emit_assets(context, summary)
        self.lineage = (to_merge, summary)
        return result

    def _parking(
        self, to_merge: Sequence[BatchManifest], batches: Sequence[BatchManifest], settings: ObjectStoreSettings | None
    ) -> Parking | None:
        """The slot's parked tables and the earlier batches they still need (batch/parking.py)."""
        if not batches or "--no-park" in self.arguments.merge_args:
            return None
        first = batches[0]
        staging = storage_for(staging_root_of(str(first.path)), self.arguments.storage_conn_id)
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

        args = ["--delta-root", str(self.arguments.delta_root)]
        for batch in batches:
            args += ["--batch", batch]
        parsed = build_argument_parser().parse_args(
            [*args, *(str(a) for a in self.arguments.merge_args), *self._parking_args]
        )
        workdir = tempfile.mkdtemp(prefix="pgdecode-merge-")
        refusal_path = str(Path(workdir) / "summary.json")
        try:
            code, summary = run_merge_job(
                spark, list(batches), str(self.arguments.delta_root), options_from_args(parsed), refusal_path
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
        if self.arguments.asset_alias is None or not summary or "outlet_events" not in context:
            return
        events = context["outlet_events"][AssetAlias(self.arguments.asset_alias)]
        root = str(self.arguments.delta_root)
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
