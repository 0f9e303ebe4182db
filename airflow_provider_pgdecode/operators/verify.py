"""Compare the pipeline's Delta tables with the verify copy of their source, both as of LSN X.

The last step of a verify run (``dags/pgdecode_verify.py``): after
:class:`~airflow_provider_pgdecode.operators.verify_snapshot.PgDecodeVerifySnapshotOperator`
copied the tables as of X and the slot's changes up to X were merged, the verify job
(``spark/verify_job.py``, through spark-submit or a Spark Connect server as the merge job)
compares per table the row counts and a hash per key bucket, narrowing differing buckets to the
differing keys.

Example::

    from airflow_provider_pgdecode.operators.verify import PgDecodeVerifyOperator

    verify = PgDecodeVerifyOperator(
        task_id="verify",
        snapshot="{{ ti.xcom_pull(task_ids='verify_snapshot') }}",
        delta_root="/data/delta",
    )
"""

from __future__ import annotations

import ast
import json
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import Asset, AssetAlias, BaseOperator, Context

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, is_object_store
from airflow_provider_pgdecode.capture.verify import (
    VERIFY_DIR,
    VerifySnapshot,
    remove_verify_snapshot,
)
from airflow_provider_pgdecode.errors import VerifyError, VerifyMismatchError
from airflow_provider_pgdecode.hooks.object_store import object_store_settings
from airflow_provider_pgdecode.hooks.spark_job import (
    SparkJobTask,
    refusal_error,
    submit_hook,
    uses_object_store,
)
from airflow_provider_pgdecode.utils.assets import location_asset
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

VERIFY_JOB_MODULE = "airflow_provider_pgdecode.spark.verify_job"
DEFAULT_VERIFY_ALIAS = "pgdecode_verify"
DEFAULT_SNAPSHOT = "{{ ti.xcom_pull(task_ids='verify_snapshot') }}"
#: Differing keys named in the task's failure message per table (the report lists more).
KEYS_IN_MESSAGE = 5


def verify_area_of(snapshot: VerifySnapshot) -> str:
    """The verify area holding the snapshot (``<staging>/<slot>/verify``): a local path or an s3:// URI."""
    if is_object_store(snapshot.path):
        return posixpath.dirname(posixpath.dirname(snapshot.path.rstrip("/")))
    return str(Path(snapshot.path).parent.parent.resolve())


def verify_asset(snapshot: VerifySnapshot) -> Asset:
    """The Asset of a slot's verify results: its verify area (``file://<staging>/<slot>/verify``,
    or ``s3://bucket/<staging>/<slot>/verify``), named by its URI (see :func:`verify_results_asset`)."""
    return location_asset(verify_area_of(snapshot))


def verify_results_asset(staging_root: str | Path, slot_name: str) -> Asset:
    """The Asset the verify operator emits for the pipeline ``slot_name`` staged under
    ``staging_root``; schedule a DAG on it to act on each verify report::

        schedule=[verify_results_asset("/data/staging", "pgdecode_shop")]
    """
    root = str(staging_root)
    if is_object_store(root):
        return location_asset(f"{root.rstrip('/')}/{slot_name}/{VERIFY_DIR}")
    return location_asset(Path(root) / slot_name / VERIFY_DIR)


def parse_snapshot(value: Any) -> VerifySnapshot:
    """The verify snapshot from its XCom value: a dict, or a rendered template of one."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                pass
    return VerifySnapshot.from_dict(value)


def mismatch_message(report: Mapping[str, Any], report_path: str) -> str:
    """What differs, table by table with the first keys, and what to do (the task's failure message)."""
    parts = []
    for name in report.get("differing_tables") or []:
        table = report["tables"][name]
        if table.get("error"):
            parts.append(f"{name}: cannot be compared ({table['error']})")
            continue
        keys = [
            f"{json.dumps(k['key'], sort_keys=True)} ({k['difference']}"
            + (f": {', '.join(k['columns'])}" if k.get("columns") else "")
            + ")"
            for k in table.get("keys", [])[:KEYS_IN_MESSAGE]
        ]
        more = table.get("differing_keys", 0) - len(keys)
        parts.append(
            f"{name}: {table.get('source_rows')} rows in PostgreSQL, {table.get('delta_rows')} in Delta, "
            f"{table.get('differing_keys')} differing key(s): {', '.join(keys)}"
            + (f" and {more} more" if more > 0 else "")
        )
    names = json.dumps(list(report.get("differing_tables") or []))
    return (
        f"Delta differs from PostgreSQL as of LSN {report.get('lsn')} (slot {report.get('slot')!r}): "
        + "; ".join(parts)
        + f". Full report: {report_path}. To rebuild the differing tables from the source, run pgdecode_backfill "
        f'with {{"mode": "resnapshot", "tables": {names}}}'
    )


class PgDecodeVerifyOperator(SparkJobTask, BaseOperator):
    """Run the verify job for a verify snapshot and the Delta tables; report, emit, fail on a difference.

    As the merge operator's job: by spark-submit when ``conn_id`` is a ``spark`` connection, or
    in this task as a client session of the server of a ``spark_connect`` connection.

    Delta must be at the snapshot's LSN X: the slot's changes up to X merged (extract with
    ``upto_lsn`` X, then merge) and no table past X. A table merged past X meanwhile (another
    run of the pipeline) fails the task without a retry: run the verify again.

    The report (JSON, also kept as ``<staging_root>/<slot>/verify/report-<X>.json``) has per
    table ``equal``, ``source_rows``, ``delta_rows``, ``differing_keys`` and the first
    ``max_keys`` differing ``keys`` (key values, rows on each side, what differs, and the
    differing columns). It is logged and returned (XCom). An Asset event
    (``file://<staging_root>/<slot>/verify``, through the ``asset_alias`` alias) carries its
    summary as extra when the task succeeds. When tables differ and ``fail_on_difference`` is
    true, the report is pushed to XCom under the key ``report`` and the task fails without a
    retry, naming the tables and the first keys.

    The staged copy is removed after the comparison unless ``keep_snapshot``; it is kept when the
    job crashed, so that a retry compares the same copy.

    Example::

        from airflow_provider_pgdecode.operators.verify import PgDecodeVerifyOperator

        verify = PgDecodeVerifyOperator(
            task_id="verify",
            snapshot="{{ ti.xcom_pull(task_ids='verify_snapshot') }}",
            delta_root="/data/delta",
            conn_id="spark_default",
        )
        # on a difference: ti.xcom_pull(task_ids='verify', key='report')

    :param snapshot: the verify snapshot task's return value (a dict or its rendering); default
        the XCom of the task ``verify_snapshot``. (templated)
    :param delta_root: the root of the pipeline's Delta tables. (templated)
    :param conn_id: the Spark connection: ``spark`` (spark-submit) or ``spark_connect`` (a client
        session of that server; ``conf`` entries become settings of the session, the spark-submit
        parameters do not apply). (templated)
    :param buckets: hash buckets per table. (templated)
    :param max_keys: differing keys listed per table. (templated)
    :param verify_args: more arguments of the verify job: the merge's type options, e.g.
        ``["--type-map", "mood=string", "--unbounded-numeric", "string"]``. (templated)
    :param fail_on_difference: fail the task when a table differs (else succeed and report).
    :param keep_snapshot: keep the staged copy after the comparison.
    :param asset_alias: the :class:`~airflow.sdk.AssetAlias` the result is emitted through;
        ``None`` emits nothing.
    :param spark_binary: the ``spark-submit`` to run; default the one beside ``sys.executable``.
    :param packages: Maven coordinates for ``--packages``; default Delta's. (templated)
    :param conf: Spark configuration, merged over pgdecode's defaults. (templated)
    :param env_vars: environment of spark-submit, merged over the defaults. (templated)
    :param storage_conn_id: the ``aws`` connection of an ``s3://`` staging area and Delta root, as
        the merge operator's; its settings reach spark-submit as ``AWS_*`` environment only. (templated)
    :param driver_memory: ``--driver-memory``.
    :param executor_memory: ``--executor-memory``.
    """

    template_fields: Sequence[str] = (
        "snapshot",
        "delta_root",
        "conn_id",
        "buckets",
        "max_keys",
        "verify_args",
        "packages",
        "conf",
        "env_vars",
        "storage_conn_id",
    )
    template_fields_renderers = {"conf": "json", "env_vars": "json"}
    ui_color = "#d9f0df"

    def __init__(
        self,
        *,
        delta_root: str,
        snapshot: str | Mapping[str, Any] = DEFAULT_SNAPSHOT,
        conn_id: str = "spark_default",
        buckets: int | str = 1024,
        max_keys: int | str = 100,
        verify_args: Sequence[str] | None = None,
        fail_on_difference: bool = True,
        keep_snapshot: bool = False,
        asset_alias: str | None = DEFAULT_VERIFY_ALIAS,
        spark_binary: str | None = None,
        packages: str | None = None,
        conf: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        driver_memory: str | None = "1g",
        executor_memory: str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        if asset_alias is not None:
            kwargs["outlets"] = [*(kwargs.get("outlets") or []), AssetAlias(asset_alias)]
        super().__init__(**kwargs)
        self.snapshot = snapshot
        self.delta_root = delta_root
        self.conn_id = conn_id
        self.buckets = buckets
        self.max_keys = max_keys
        self.verify_args = list(verify_args or [])
        self.fail_on_difference = fail_on_difference
        self.keep_snapshot = keep_snapshot
        self.asset_alias = asset_alias
        self.spark_binary = spark_binary
        self.packages = packages
        self.conf = dict(conf or {})
        self.env_vars = dict(env_vars or {})
        self.driver_memory = driver_memory
        self.executor_memory = executor_memory
        self.storage_conn_id = storage_conn_id

    def _job_args(self, snapshot: VerifySnapshot, report_path: str | None = None) -> list[str]:
        """The verify job's arguments (spark-submit's command line, or parsed for a Connect session)."""
        args = [
            *("--snapshot", snapshot.path, "--delta-root", str(self.delta_root)),
            *("--slot", snapshot.slot, "--lsn", str(snapshot.lsn)),
            *("--buckets", str(int(self.buckets)), "--max-keys", str(int(self.max_keys))),
        ]
        if report_path is not None:
            args += ["--report-json", report_path]
        for table in snapshot.tables:
            args += ["--table", table]
        return args + [str(a) for a in self.verify_args]

    def get_hook(
        self,
        snapshot: VerifySnapshot,
        report_path: str,
        settings: ObjectStoreSettings | None = None,
        context: Context | None = None,
    ) -> SparkSubmitHook:
        """The SparkSubmitHook that runs the verify job (settings as the merge operator's; the
        storage connection's reach it as ``AWS_*`` environment only; the task's ``context``, its
        OpenLineage parent job)."""
        return submit_hook(
            self,
            job=VERIFY_JOB_MODULE,
            name="pgdecode-verify",
            args=self._job_args(snapshot, report_path),
            object_store=uses_object_store(snapshot.path, str(self.delta_root)),
            settings=settings,
            context=context,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            return self._verify(context)

    def _verify(self, context: Context) -> dict[str, Any]:
        snapshot = parse_snapshot(self.snapshot)
        settings = object_store_settings(self.storage_conn_id)
        self.log.info(
            "Comparing %d table(s) of slot %s with Delta at %s as of LSN %s",
            len(snapshot.tables),
            snapshot.slot,
            self.delta_root,
            snapshot.lsn,
        )
        report = self.run_job(
            "verify",
            submit=lambda path: self.get_hook(snapshot, path, settings, context),
            in_session=lambda spark: self._verify_in_session(spark, snapshot),
            settings=settings,
        )
        if report is not None and "error" in report:
            # A refusal is final for this copy: drop it, a new verify run takes another.
            self._remove(snapshot, settings)
            raise refusal_error("verify", report)
        if report is None or "tables" not in report:
            raise VerifyError(f"the verify job wrote no report for slot {snapshot.slot!r} (its log says why)")
        name = f"report-{int(snapshot.lsn):016X}.json"
        area = Storage(verify_area_of(snapshot), settings if is_object_store(snapshot.path) else None)
        area.write_text(name, json.dumps(report, indent=1, sort_keys=True) + "\n")
        kept = area.uri(name)
        self._remove(snapshot, settings)
        self._log_report(report, str(kept))
        if not report["equal"] and self.fail_on_difference:
            context["ti"].xcom_push(key="report", value=report)
            raise VerifyMismatchError(mismatch_message(report, str(kept)))
        self._emit(context, snapshot, report, str(kept))
        return report

    def _verify_in_session(self, spark: Any, snapshot: VerifySnapshot) -> dict[str, Any]:
        """The report (or the job's refusal) of the verify job's core run in this task as a client
        session of the Spark Connect server of ``conn_id``."""
        from airflow_provider_pgdecode.spark.verify_job import REFUSALS, build_argument_parser, verify_from_args

        args = build_argument_parser().parse_args(self._job_args(snapshot))
        try:
            return verify_from_args(spark, args)
        except REFUSALS as error:
            return {"error": type(error).__name__, "message": str(error)}

    def _remove(self, snapshot: VerifySnapshot, settings: ObjectStoreSettings | None = None) -> None:
        if self.keep_snapshot:
            return
        store = Storage(snapshot.path, settings) if is_object_store(snapshot.path) else None
        remove_verify_snapshot(snapshot, store)

    def _log_report(self, report: Mapping[str, Any], path: str) -> None:
        self.log.info(
            "Verify as of LSN %s: %s (report %s)", report["lsn"], "equal" if report["equal"] else "DIFFERENT", path
        )
        for name, table in sorted(report["tables"].items()):
            self.log.info(
                "  %s: %s, %s rows in PostgreSQL, %s in Delta%s",
                name,
                "equal" if table["equal"] else "DIFFERS",
                table.get("source_rows"),
                table.get("delta_rows"),
                f" ({table['error']})" if table.get("error") else "",
            )
            for key in table.get("keys", []):
                self.log.info(
                    "    key %s: %s%s",
                    json.dumps(key["key"], sort_keys=True),
                    key["difference"],
                    f" ({', '.join(key['columns'])})" if key.get("columns") else "",
                )

    def _emit(self, context: Context, snapshot: VerifySnapshot, report: Mapping[str, Any], path: str) -> None:
        if self.asset_alias is None or "outlet_events" not in context:
            return
        from airflow_provider_pgdecode.spark.verify_job import summarize

        events = context["outlet_events"][AssetAlias(self.asset_alias)]
        events.add(verify_asset(snapshot), extra={**summarize(report), "report": path})
