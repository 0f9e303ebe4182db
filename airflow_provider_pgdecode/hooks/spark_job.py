"""Running pgdecode's Spark jobs (merge, verify, maintenance) from Airflow: one room for both ways.

A job runs either as a spark-submit of the job file shipped in the package (the Spark provider's
:class:`SparkSubmitHook`, its environment carrying the object store's settings, never its command
line), or, when the task's Spark connection is of type ``spark_connect``, as a client session of
that Spark Connect server (the job's core runs in the task, its Spark work on the server). This
module decides which (:func:`spark_connection_type`), builds either, reads the JSON object a
submitted job writes (its summary or its refusal), and stops the job on ``on_kill``
(:class:`SparkJobTask`). The operators parse their arguments, call it, and push XCom.

A spark-submit carries the OpenLineage parent job of the task that submits it (and the transport),
as the Spark provider's ``SparkSubmitOperator`` does, when the OpenLineage provider's configuration
asks for it (:func:`openlineage_spark_conf`); a Spark Connect session does not (:func:`connect_session`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseHook, Context
from airflow.sdk.exceptions import AirflowException

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, is_object_store
from airflow_provider_pgdecode.errors import (
    ConfigurationError,
    MaintenanceError,
    MaintenanceRefusedError,
    MergeInputError,
    MergeOutOfMemoryError,
    PgDecodeError,
    VerifyError,
)
from airflow_provider_pgdecode.spark.session import SPARK_JOB_ENTRY, spark_job_arguments
from airflow_provider_pgdecode.utils.config import exported, pgdecode_env, pgdecode_environment

log = logging.getLogger(__name__)

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
    session's client retries under bounds: spark/connect_client.py).

    No OpenLineage parent job or transport is set here (:func:`openlineage_spark_conf` is for
    spark-submit): OpenLineage's Spark listener on the server reads them from the configuration its
    SparkContext started with, one for every session of the server, so a session's settings would
    not reach it (and a transport's key would be readable by the server's other users). The task's
    own OpenLineage events carry what the job read and wrote (docs/lineage.md)."""
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


#: Keys of the OpenLineage transport that hold or may hold a secret (an API key, a header's token):
#: never put on a spark-submit command line (:func:`openlineage_spark_conf`).
OPENLINEAGE_SECRET_KEYS = (".auth.", ".headers.")


def openlineage_spark_conf(conf: Mapping[str, str], context: Context | None) -> dict[str, str]:
    """``conf`` with the OpenLineage properties the Spark provider's ``SparkSubmitOperator`` adds for
    ``context``'s task, under the same switches: the OpenLineage provider's ``[openlineage]
    spark_inject_parent_job_info`` (``spark.openlineage.parentJobNamespace``, ``parentJobName``,
    ``parentRunId`` and the root job's: the Spark job's lineage becomes a child of the task's run)
    and ``spark_inject_transport_info`` (the provider's HTTP transport, so that the job sends its
    events where Airflow sends the task's). Properties ``conf`` sets already win, as there. Without
    the provider, or without ``context``, ``conf`` as it is.

    One departure: a transport's authentication and headers are left out, with a warning. The
    provider would put them on the spark-submit command line, where every user of the machine
    reads them (pgdecode keeps secrets off command lines); give the Spark side its key in its own
    configuration (``spark.openlineage.transport.auth.*`` in the spark-defaults.conf of the Spark
    that runs the job)."""
    properties = {str(k): str(v) for k, v in conf.items()}
    if context is None:
        return properties
    try:
        from airflow.providers.openlineage import conf as openlineage_conf
        from airflow.providers.openlineage.utils.spark import (
            inject_parent_job_information_into_spark_properties,
            inject_transport_information_into_spark_properties,
        )
    except ImportError:  # the openlineage extra is not installed
        return properties
    injected: dict[str, Any] = dict(properties)
    if openlineage_conf.spark_inject_parent_job_info():
        injected = inject_parent_job_information_into_spark_properties(injected, context)
    if openlineage_conf.spark_inject_transport_info():
        injected = inject_transport_information_into_spark_properties(injected, context)
    secret = sorted(k for k in injected if k not in properties and any(s in k for s in OPENLINEAGE_SECRET_KEYS))
    if secret:
        log.warning(
            "OpenLineage transport settings %s are not passed to spark-submit: its command line is readable by "
            "every user of the machine. Set them in the spark-defaults.conf of the Spark that runs the job instead",
            ", ".join(secret),
        )
    return {k: str(v) for k, v in injected.items() if k not in secret}


def submit_hook(
    operator: Any,
    *,
    job: str,
    name: str,
    args: Sequence[str],
    object_store: bool,
    settings: ObjectStoreSettings | None,
    context: Context | None = None,
    **spark: Any,
) -> SparkSubmitHook:
    """The SparkSubmitHook that runs the pgdecode Spark job ``job`` (its module) for ``operator`` (its ``conn_id``,
    ``conf``, ``packages``, ``driver_memory``, ``executor_memory``, ``env_vars``, ``spark_binary``
    and ``storage_conn_id``); ``spark``: more SparkSubmitHook arguments. ``settings`` (the storage
    connection's) reach the spark-submit process as ``AWS_*`` environment only, once the Spark
    connection says they stay off the command line (never ``env_vars``: a template field, which
    Airflow stores rendered). With the running task's ``context``, the conf carries the OpenLineage
    properties the ``[openlineage]`` configuration asks for (:func:`openlineage_spark_conf`)."""
    conf, packages = spark_submit_settings(
        operator.conn_id, operator.conf, operator.packages, object_store=object_store
    )
    conf = openlineage_spark_conf(conf, context)

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


#: What a Spark job's refusal (``{"error": <class name>, "message": ...}``) becomes in the task,
#: per job: errors raised as themselves, by class name, and the job's error for any other refusal.
#: The one table of it; :func:`refusal_error` reads it.
REFUSAL_ERRORS: dict[str, tuple[type[PgDecodeError], dict[str, type[PgDecodeError]]]] = {
    "merge": (MergeInputError, {MergeOutOfMemoryError.__name__: MergeOutOfMemoryError}),
    "verify": (VerifyError, {}),
    "maintenance": (
        ConfigurationError,
        {MaintenanceRefusedError.__name__: MaintenanceRefusedError, MaintenanceError.__name__: MaintenanceError},
    ),
}


def refusal_error(job: str, refusal: Mapping[str, Any], detail: str | None = None) -> PgDecodeError:
    """The error a job's refusal raises in the task (:data:`REFUSAL_ERRORS`); ``detail`` (or the
    refusal's own ``detail``) is added to an error raised as itself (the task's memory settings for
    an out-of-memory). A refusal means
    the job left its output unchanged: every such error is deterministic, retrying cannot help."""
    default, as_itself = REFUSAL_ERRORS[job]
    kind, message = str(refusal.get("error")), str(refusal.get("message"))
    detail = str(refusal["detail"]) if refusal.get("detail") else detail
    if kind in as_itself:
        return as_itself[kind](f"{message} ({detail})" if detail else message)
    return default(f"the {job} job refused: {kind}: {message}")


class SparkJobTask:
    """What pgdecode's Spark-job operators (merge, verify, maintenance) share: running a job one way
    or the other (:meth:`run_job`, the one place that decides), reading the JSON object a submitted
    job writes, and ``on_kill`` stopping the job they run (spark-submit or a Spark Connect client
    session)."""

    conn_id: str
    conf: Mapping[str, Any]
    log: Any
    _hook: SparkSubmitHook | None = None
    _connect_session: Any = None

    def run_job(
        self,
        kind: str,
        *,
        submit: Callable[[str], SparkSubmitHook],
        in_session: Callable[[Any], dict[str, Any] | None],
        settings: ObjectStoreSettings | None,
    ) -> dict[str, Any] | None:
        """The job's summary or refusal: ``in_session(spark)`` as a client session of the Spark
        Connect server when ``conn_id`` is a ``spark_connect`` connection, else the spark-submit of
        the hook ``submit`` makes (:meth:`submit_job`)."""
        if spark_connection_type(self.conn_id) == SPARK_CONNECT_CONN_TYPE:
            with connect_session(self.conn_id, self.conf, settings, self.log) as spark:
                self._connect_session = spark
                try:
                    return in_session(spark)
                finally:
                    self._connect_session = None
        return self.submit_job(submit, kind)

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


def read_json_object(path: str) -> dict[str, Any] | None:
    """The JSON object a Spark job wrote to ``path`` (its summary or refusal); ``None`` when the
    file is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
