"""Merge staged batches into Delta tables with the Spark job shipped in the package."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import Asset, AssetAlias, BaseHook, BaseOperator, Context
from airflow.sdk.exceptions import AirflowException

from airflow_provider_pgdecode.batch.format import delta_path_part
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
from airflow_provider_pgdecode.errors import ConfigurationError, MergeInputError, MergeOutOfMemoryError
from airflow_provider_pgdecode.hooks.object_store import object_store_settings, storage_for
from airflow_provider_pgdecode.spark.session import SPARK_JOB_ENTRY, spark_job_arguments
from airflow_provider_pgdecode.utils.config import exported, pgdecode_env, pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

MERGE_JOB_MODULE = "airflow_provider_pgdecode.spark.merge_job"
DEFAULT_ASSET_ALIAS = "pgdecode_delta_tables"
SPARK_CONNECT_CONN_TYPE = "spark_connect"
"""The Spark provider's connection type of a Spark Connect server (host + port): a merge whose
``conn_id`` names one runs as a client session of that server instead of a spark-submit."""


def spark_connection_type(conn_id: str) -> str | None:
    """The type of the Spark connection ``conn_id`` (``spark``, ``spark_connect``...), or ``None``
    when there is no such connection (the spark-submit path then says what to create)."""
    try:
        return BaseHook.get_connection(conn_id).conn_type
    except AirflowException:
        return None


def connect_url(conn_id: str) -> str:
    """The ``sc://host:port`` URL of a ``spark_connect`` connection, as the Spark provider's
    :class:`~airflow.providers.apache.spark.hooks.spark_connect.SparkConnectHook` builds it."""
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

    try:
        return SparkConnectHook(conn_id=conn_id).get_connection_url()
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigurationError(
            f"Spark Connect connection {conn_id!r} gives no usable server address ({exc}): set its host "
            "(e.g. 127.0.0.1 or sc://spark-connect) and port (e.g. 15002)"
        ) from None


@contextmanager
def connect_session(
    conn_id: str, conf: Mapping[str, Any], settings: ObjectStoreSettings | None, log: Any
) -> Iterator[Any]:
    """A client session of the Spark Connect server of ``conn_id``, stopped on exit (the server
    and its warm JVM stay), for a job whose core runs in this task and its Spark work on the
    server; ``log`` is the task's logger. ``conf`` entries become settings of this session only.
    The store's settings reach the manifests' and footers' reads in this process (the server
    reads Parquet and Delta with its own S3A settings: docs/spark-connect.md); the [pgdecode]
    settings too. A server that goes away meanwhile fails the job with
    :class:`~airflow_provider_pgdecode.errors.SparkConnectUnreachableError` within a minute (the
    session's client retries under bounds: spark/connect_client.py)."""
    from airflow_provider_pgdecode.spark.session import build_connect_session, connect_server_named

    url = connect_url(conn_id)
    session_conf = {str(k): str(v) for k, v in conf.items() if not str(k).startswith("spark.jars")}
    log.info("Running through the Spark Connect server %s (connection %s)", url.split(";")[0], conn_id)
    with pgdecode_environment(), exported(settings.to_env() if settings is not None else {}):
        spark = build_connect_session(url, extra_conf=session_conf, conn_id=conn_id)
        try:
            with connect_server_named(spark, url, conn_id=conn_id):
                yield spark
        finally:
            try:
                spark.stop()
            except Exception as exc:  # a lost server: the job's own outcome matters more
                log.warning("Could not close the Spark Connect session: %s", exc)


def interrupt_connect_session(session: Any) -> None:
    """Stop a task's Spark work on a Spark Connect server (``on_kill``); the server stays."""
    if session is not None:
        try:
            session.interruptAll()
        finally:
            session.stop()


def default_spark_binary() -> str:
    """The ``spark-submit`` of the Python running Airflow (pip's pyspark puts it beside python)."""
    from airflow_provider_pgdecode.spark.session import spark_bin

    return spark_bin("spark-submit")


DRIVER_ADDRESS_EXTRAS = {"driver-host": "spark.driver.host", "driver-bind-address": "spark.driver.bindAddress"}
"""Keys of the Spark connection's extra that set the driver's advertised and bound address."""


def default_env_vars(master: str | None = None) -> dict[str, str]:
    """Environment that makes the venv's ``spark-submit`` find its Spark and Python (pitfall P2);
    ``SPARK_LOCAL_IP=127.0.0.1`` only for a local ``master`` (for a remote one the driver must
    advertise an address the executors reach: see :func:`driver_address_conf`), and the
    ``[pgdecode]`` settings the Spark side reads (as their ``PGDECODE_*`` variables)."""
    import pyspark

    from airflow_provider_pgdecode.spark.session import driver_address_env

    return {
        **pgdecode_env(),
        "SPARK_HOME": os.path.dirname(pyspark.__file__),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        **driver_address_env(master),
    }


def driver_address_conf(extra: Mapping[str, Any]) -> dict[str, str]:
    """``spark.driver.host`` / ``spark.driver.bindAddress`` from a Spark connection's extra
    (``driver-host``, ``driver-bind-address``): the address executors on a remote master use to
    reach a client-mode driver, and the local address it listens on (e.g. ``0.0.0.0``)."""
    return {conf: str(extra[key]) for key, conf in DRIVER_ADDRESS_EXTRAS.items() if extra.get(key)}


def hook_master(hook: SparkSubmitHook) -> str | None:
    """The master the hook resolved from its Spark connection (``None`` when unknown)."""
    connection = getattr(hook, "_connection", None) or {}
    return str(connection["master"]) if connection.get("master") else None


def default_spark_conf(*, object_store: bool = False) -> dict[str, str]:
    """Delta's session settings and where its jars come from (``spark.jars.packages`` + a project Ivy
    dir); with ``object_store``, hadoop-aws for ``s3a://`` too (no secret: those travel as environment)."""
    from airflow_provider_pgdecode.spark.session import delta_spark_conf

    with pgdecode_environment():  # [pgdecode] ivy_dir, delta_jars, delta_package ... (AIRFLOW__PGDECODE__*)
        return delta_spark_conf(object_store=object_store)


def spark_submit_settings(
    conn_id: str, conf: Mapping[str, Any], packages: str | None, *, object_store: bool = False
) -> tuple[dict[str, str], str | None]:
    """The ``conf`` and ``packages`` of a pgdecode spark-submit (the merge and verify jobs): Delta's
    defaults (with hadoop-aws when ``object_store``) under the operator's ``conf``, with
    ``spark.jars.packages`` moved to ``packages``.

    Checks first that the Spark connection exists: without it spark-submit would run on YARN.
    The connection's ``driver-host`` / ``driver-bind-address`` extras become ``spark.driver.host``
    / ``spark.driver.bindAddress`` (:func:`driver_address_conf`), under the operator's ``conf``.
    """
    try:
        connection = BaseHook.get_connection(conn_id)
    except AirflowException as exc:
        raise ConfigurationError(
            f"Spark connection {conn_id!r} not found ({exc}). Without it spark-submit would silently "
            "use master 'yarn'. Create it, e.g. for local mode "
            f'AIRFLOW_CONN_{conn_id.upper()}=\'{{"conn_type": "spark", "host": "local[*]"}}\''
        ) from exc
    merged = {
        **default_spark_conf(object_store=object_store),
        **driver_address_conf(connection.extra_dejson),
        **{k: str(v) for k, v in conf.items()},
    }
    jars = merged.pop("spark.jars.packages", None)
    return merged, packages or jars


def submit_hook(
    operator: Any,
    *,
    job: str,
    name: str,
    args: Sequence[str],
    object_store: bool,
    settings: ObjectStoreSettings | None,
    **spark: Any,
) -> SparkSubmitHook:
    """The SparkSubmitHook that runs the pgdecode Spark job ``job`` (its module) for ``operator`` (its ``conn_id``,
    ``conf``, ``packages``, ``driver_memory``, ``executor_memory``, ``env_vars``, ``spark_binary``
    and ``storage_conn_id``); ``spark``: more SparkSubmitHook arguments. ``settings`` (the storage
    connection's) reach the spark-submit process as ``AWS_*`` environment only, once the Spark
    connection says they stay off the command line (never ``env_vars``: a template field, which
    Airflow stores rendered)."""
    conf, packages = spark_submit_settings(
        operator.conn_id, operator.conf, operator.packages, object_store=object_store
    )

    def build(env_vars: dict[str, str]) -> SparkSubmitHook:
        return SparkSubmitHook(
            conf=conf,
            conn_id=operator.conn_id,
            packages=packages or None,
            driver_memory=operator.driver_memory,
            executor_memory=operator.executor_memory,
            name=name,
            application_args=spark_job_arguments(job, args),
            env_vars=env_vars,
            spark_binary=operator.spark_binary or default_spark_binary(),
            **spark,
        )

    hook = build(dict(operator.env_vars))
    # Loopback for the driver only with a local master (the hook resolved it from the connection).
    env_vars = {**default_env_vars(hook_master(hook)), **operator.env_vars}
    return build({**env_vars, **object_store_env(hook, settings, operator.storage_conn_id)})


class SparkJobTask:
    """What pgdecode's Spark-job operators (merge, verify, maintenance) share: the spark-submit of
    a job that writes its result as JSON, and ``on_kill`` stopping the job they run (spark-submit
    or a Spark Connect client session)."""

    _hook: SparkSubmitHook | None = None
    _connect_session: Any = None

    def submit_job(self, get_hook: Callable[[str], SparkSubmitHook], kind: str) -> dict[str, Any] | None:
        """spark-submit the job of the hook ``get_hook`` makes and read the JSON object it writes to the path given to
        ``get_hook``: its summary, or its refusal (an object with ``error`` and ``message``) when it
        refused its input and exited non-zero. Any other failure of the submit raises. ``None``:
        nothing readable here (cluster deploy mode: the driver wrote it on another machine)."""
        workdir = tempfile.mkdtemp(prefix=f"pgdecode-{kind}-")
        try:
            path = str(Path(workdir) / f"{kind}.json")
            self._hook = get_hook(path)
            try:
                self._hook.submit(str(SPARK_JOB_ENTRY))
            except AirflowException:
                refusal = read_json_object(path)
                if refusal is not None and "error" in refusal:
                    return refusal
                raise
            return read_json_object(path)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def on_kill(self) -> None:
        """Stop the spark-submit process (and the driver or application in cluster modes), or this
        task's Spark work on a Spark Connect server."""
        if self._hook is not None:
            self._hook.on_kill()
        interrupt_connect_session(self._connect_session)


def object_store_env(
    hook: SparkSubmitHook, settings: ObjectStoreSettings | None, storage_conn_id: str | None
) -> dict[str, str]:
    """The ``AWS_*`` environment that carries a storage connection's settings to the Spark job.

    spark-submit gets them as its process environment, never as arguments. The Spark provider's
    hook puts ``env_vars`` on the command line as ``--conf`` for a YARN or Kubernetes master (and
    refuses them in standalone cluster mode), so a connection holding a secret is refused there.
    """
    if settings is None:
        return {}
    connection = getattr(hook, "_connection", None) or {}
    master = str(connection.get("master") or "")
    if settings.secrets and ("yarn" in master or "k8s" in master or connection.get("deploy_mode") == "cluster"):
        raise ConfigurationError(
            f"storage_conn_id={storage_conn_id!r} holds a secret key, and with master {master!r} "
            f"(deploy mode {connection.get('deploy_mode')!r}) the Spark provider would pass it on the spark-submit "
            "command line. Give the cluster its own S3 credentials instead (an instance or pod role, or fs.s3a.* in "
            "its core-site.xml) and use a connection without a key pair (endpoint_url and region_name only), or "
            "run the job in client mode on a standalone master or local[*]"
        )
    return settings.to_env()


def uses_object_store(*locations: str) -> bool:
    """Whether any location is on object storage (``s3://``, ``s3a://``)."""
    return any(is_object_store(str(location)) for location in locations if location)


def read_manifest(path: str, settings: ObjectStoreSettings | None) -> BatchManifest:
    """A batch's manifest: local, or on object storage with the storage connection's settings."""
    location: Any = Storage(path, settings) if settings is not None and is_object_store(path) else path
    return BatchManifest.read(location)


def parse_batch_paths(value: str | Sequence[str] | None) -> list[str]:
    """Batch directories from a path, a list of paths, or a rendered template of either (a JSON list)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError:
                import ast

                parsed = ast.literal_eval(text)
            return [str(p) for p in parsed if p]
        return [text] if text else []
    return [str(p) for p in value if p]


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
        if spark_connection_type(self.conn_id) == SPARK_CONNECT_CONN_TYPE:
            connect_summary = self._merge_connect([str(m.path) for m in to_merge], settings)
            result["summary"] = connect_summary
            result["parked"] = self._settle_parking(parking, connect_summary)
            self._emit_assets(context, connect_summary)
            self._lineage = (to_merge, connect_summary)
            return result
        paths = [str(m.path) for m in to_merge]
        summary = self.submit_job(lambda path: self.get_hook(paths, path, settings), "merge")
        if summary is not None and "error" in summary:
            kind, message = str(summary["error"]), str(summary.get("message"))
            if kind == MergeOutOfMemoryError.__name__:
                # Retrying with the same memory fails the same way.
                raise MergeOutOfMemoryError(
                    f"{message} (this task: driver_memory={self.driver_memory!r}, "
                    f"executor_memory={self.executor_memory!r}, conf={self._memory_conf()})"
                )
            # The job refused the input and left Delta unchanged: retrying cannot help.
            raise MergeInputError(f"the merge job refused the batch: {kind}: {message}")
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

    def _merge_connect(self, batches: Sequence[str], settings: ObjectStoreSettings | None) -> dict[str, Any]:
        """The merge as a client session of the Spark Connect server of ``conn_id``: the merge job's
        own core (:func:`~airflow_provider_pgdecode.spark.merge_job.run_merge_job`) runs in this
        task, its Spark work on the server. A session of its own, stopped at the end (the server
        and its warm JVM stay); ``conf`` entries become settings of this session only."""
        from airflow_provider_pgdecode.spark.merge_job import build_argument_parser, options_from_args, run_merge_job

        args = ["--delta-root", str(self.delta_root)]
        for batch in batches:
            args += ["--batch", batch]
        parsed = build_argument_parser().parse_args([*args, *(str(a) for a in self.merge_args), *self._parking_args])
        options = options_from_args(parsed)
        with connect_session(self.conn_id, self.conf, settings, self.log) as spark:
            self._connect_session = spark
            workdir = tempfile.mkdtemp(prefix="pgdecode-merge-")
            refusal_path = str(Path(workdir) / "summary.json")
            try:
                code, summary = run_merge_job(spark, list(batches), str(self.delta_root), options, refusal_path)
                refusal = read_json_object(refusal_path) if code else None
            except Exception as error:
                from airflow_provider_pgdecode.spark.merge_job import out_of_memory_error

                memory = out_of_memory_error(error, self._memory_conf())
                if memory is not None:
                    raise memory from None
                raise
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
                self._connect_session = None
        if summary is None:
            kind, message = ("error", "see the merge job's error above")
            if refusal is not None and "error" in refusal:
                kind, message = str(refusal["error"]), str(refusal.get("message"))
            if code == 3:
                raise MergeOutOfMemoryError(f"{message} (this task: conf={self._memory_conf()})")
            raise MergeInputError(f"the merge job refused the batch: {kind}: {message}")
        self._report_summary(summary)
        return summary

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


def location_asset(location: str | Path) -> Asset:
    """The Airflow Asset of a directory: named by its URI (``name == uri``), a ``file://`` URI of
    the resolved path for a local directory, ``s3://bucket/...`` (percent-encoded) for one on
    object storage (other schemes normalise badly). Exactly ``Asset(uri)``: what the provider
    emits and what a DAG schedules on are one Asset, which Airflow keeps active."""
    text = str(location)
    if is_object_store(text):
        bucket, _, prefix = text.split("://", 1)[1].partition("/")
        uri = f"s3://{bucket}/" + "/".join(quote(p, safe="") for p in prefix.split("/") if p)
    else:
        uri = Path(text).resolve().as_uri()
    return Asset(uri)


def delta_table_asset(delta_root: str | Path, schema: str, table: str) -> Asset:
    """The Airflow Asset of one Delta table, ``<delta_root>/<schema>/<table>`` as the merge job
    writes it (:func:`~airflow_provider_pgdecode.batch.format.delta_path_part`). The merge emits it
    for each table it changed; schedule a DAG on the same call::

        schedule=[delta_table_asset("/data/delta", "public", "orders")]

    (equal to ``Asset("file:///data/delta/public/orders")``: name and URI are the table's URI)."""
    root = str(delta_root)
    if is_object_store(root):
        return location_asset(f"{root.rstrip('/')}/{delta_path_part(schema)}/{delta_path_part(table)}")
    return location_asset(Path(root) / delta_path_part(schema) / delta_path_part(table))


def read_json_object(path: str) -> dict[str, Any] | None:
    """The JSON object a Spark job wrote to ``path`` (its summary or refusal); ``None`` when the
    file is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
