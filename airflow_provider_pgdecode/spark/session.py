"""Spark sessions and spark-submit settings for the Delta merge job.

Delta's jars are not in the ``delta-spark`` wheel: Spark's packages mechanism
(``spark.jars.packages`` / ``--packages``) fetches them from Maven Central through Ivy.
:func:`ivy_dir` gives a project-local Ivy directory (``spark.jars.ivy``), so every run
after the first finds the jars in the cache and downloads nothing.

Locations on S3-compatible object storage (``s3://``, read and written by Spark as ``s3a://``)
need Hadoop's S3A filesystem: :func:`hadoop_aws_maven_coordinates` (``hadoop-aws`` of the Hadoop
release bundled in pip's pyspark, with its AWS SDK bundle) joins Delta's coordinates only when a
run touches object storage (:func:`spark_packages`), and :func:`configure_object_store` puts the
store's settings, credentials included, on the running session's Hadoop configuration (never on
a command line or in SparkConf, which the event log records).

Plain PySpark: importable without Airflow.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_pgdecode.errors import ConfigurationError, SparkConnectUnreachableError
from airflow_provider_pgdecode.spark.jars import KEY_CONF, record_session_jars, recorded_jars, resolution_key

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings

IVY_DIR_ENV = "PGDECODE_IVY_DIR"
"""Environment variable naming the Ivy directory (``spark.jars.ivy``) to use instead of the default."""

DELTA_JARS_ENV = "PGDECODE_DELTA_JARS"
"""Environment variable with a comma-separated list of Delta jars (or a folder of jars) to use
instead of resolving ``spark.jars.packages`` (for machines without Maven Central)."""

DELTA_PACKAGE_ENV = "PGDECODE_DELTA_PACKAGE"
"""Environment variable overriding the Maven coordinates of Delta's Spark artifact."""

DELTA_JAR_VERSION = "4.4.0"
"""Delta release whose jars the job loads. The Python package is delta-spark 4.4.1, but 4.4.1's
jars are not published on Maven Central (its metadata lists 4.4.0 as the latest release), so the
jar version is pinned here rather than read from the installed wheel. 4.4.0 is built for Spark 4.2.0."""

HADOOP_AWS_VERSION = "3.5.0"
"""The Hadoop release bundled in pip's pyspark 4.2.0, and so the version of ``hadoop-aws`` (S3A):
hadoop-aws must match the Hadoop it runs in (it calls Hadoop's internals), so it follows the
``hadoop-client-api`` jar of the installed pyspark (:func:`bundled_hadoop_version`) and falls back
to this when that jar is not found."""

HADOOP_AWS_PACKAGE_ENV = "PGDECODE_HADOOP_AWS_PACKAGE"
"""Environment variable overriding the Maven coordinates of ``hadoop-aws``."""

HADOOP_EXCLUDES = "org.apache.hadoop:hadoop-client-api,org.apache.hadoop:hadoop-client-runtime"
"""Hadoop jars that Delta's dependencies pull from Maven (3.4.x) beside pyspark's own (3.5.0): left
out of a run with hadoop-aws, so that one Hadoop is on the classpath, the one hadoop-aws matches."""

OBJECT_STORE_JARS_DIR = "object-store"
"""Sub-folder of ``$PGDECODE_DELTA_JARS`` holding hadoop-aws and its AWS SDK (the Maven fallback of
scripts/fetch_delta_jars.py puts them there), used only by runs that touch object storage."""

MAVEN_REPOSITORY_ENV = "PGDECODE_MAVEN_REPOSITORY"
"""Environment variable with the Maven repository URL Delta's jars come from (default Maven Central)."""

MAVEN_CENTRAL = "https://repo1.maven.org/maven2/"
IVY_SETTINGS = Path(__file__).resolve().parent / "ivysettings.xml"

LOG4J2_PROPERTIES = Path(__file__).resolve().parent / "log4j2.properties"
"""Spark's logging configuration in pgdecode's Spark processes: everything at one level."""

FAIR_SCHEDULER_XML = Path(__file__).resolve().parent / "fairscheduler.xml"
"""The pools of the Connect server pgdecode starts: its default pool runs its jobs FAIR."""

SPARK_LOG_LEVEL_ENV = "PGDECODE_SPARK_LOG_LEVEL"
"""Environment variable with the level of Spark's own logging (``[pgdecode] spark_log_level``)."""

DEFAULT_SPARK_LOG_LEVEL = "WARN"
LOG_LEVELS = ("OFF", "FATAL", "ERROR", "WARN", "INFO", "DEBUG", "TRACE", "ALL")

CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
"""The Spark Connect server's main class (in pip pyspark's ``jars/spark-connect_2.13-*.jar``)."""

DEFAULT_CONNECT_PORT = 15002

PARQUET_TIMESTAMP_CONF = "spark.sql.parquet.outputTimestampType"
PARQUET_TIMESTAMP_TYPE = "TIMESTAMP_MICROS"
"""How the jobs write timestamps to Parquet (Delta's data files): microseconds, as Delta's protocol
and every reader take them."""

DEFAULT_MASTER = "local[*]"
DEFAULT_SHUFFLE_PARTITIONS = 8
SCALA_BINARY_VERSION = "2.13"

_PACKAGE_DIR = Path(__file__).resolve().parent.parent

SPARK_JOB_ENTRY = Path(__file__).resolve().parent / "entry" / "pgdecode_spark_job.py"
"""The file spark-submit runs for every pgdecode Spark job, the job's module named as its first
argument (:func:`spark_job_arguments`): alone in its folder, so that no module of the package can
shadow one of Python's on the job's ``sys.path``."""


def spark_job_arguments(job_module: str, job_args: Sequence[str] = ()) -> list[str]:
    """The application arguments of a spark-submit of :data:`SPARK_JOB_ENTRY` running ``job_module``
    (``airflow_provider_pgdecode.spark.merge_job``...) with ``job_args``."""
    return [job_module, *job_args]


def delta_maven_coordinates() -> str:
    """The Maven coordinates of Delta's Spark artifact for the installed pyspark.

    From Delta 4.1 the artifact name carries the Spark minor version:
    ``io.delta:delta-spark_<spark major.minor>_2.13:<delta version>``.
    ``$PGDECODE_DELTA_PACKAGE`` overrides the whole string.
    """
    configured = os.environ.get(DELTA_PACKAGE_ENV)
    if configured:
        return configured.strip()
    import pyspark

    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    return f"io.delta:delta-spark_{spark_minor}_{SCALA_BINARY_VERSION}:{DELTA_JAR_VERSION}"


def bundled_hadoop_version() -> str | None:
    """The version of the Hadoop jars inside the installed pyspark (``jars/hadoop-client-api-X.jar``)."""
    import pyspark

    for jar in sorted((Path(os.path.dirname(pyspark.__file__)) / "jars").glob("hadoop-client-api-*.jar")):
        return jar.name[len("hadoop-client-api-") : -len(".jar")]
    return None


def hadoop_aws_maven_coordinates() -> str:
    """The Maven coordinates of Hadoop's S3A filesystem (``org.apache.hadoop:hadoop-aws:<version>``)
    for the Hadoop bundled in the installed pyspark; ``$PGDECODE_HADOOP_AWS_PACKAGE`` overrides them.
    Its AWS SDK (``software.amazon.awssdk:bundle``) comes with it as a dependency."""
    configured = os.environ.get(HADOOP_AWS_PACKAGE_ENV)
    if configured:
        return configured.strip()
    return f"org.apache.hadoop:hadoop-aws:{bundled_hadoop_version() or HADOOP_AWS_VERSION}"


def spark_packages(*, object_store: bool = False) -> str:
    """``spark.jars.packages`` of a run: Delta's coordinates, and hadoop-aws when it touches object storage.

    Only then: hadoop-aws brings the AWS SDK bundle, a 686 MB jar. Measured here (pip pyspark 4.2,
    local[1], jars in the Ivy cache, 2 busy cores), a spark-submit whose session does one count
    took 30-32 s with Delta's jars and 33-59 s with hadoop-aws added (Ivy resolves 41 modules
    instead of 33, and the JVM opens the bundle); on a cluster every executor would also fetch
    the bundle from the driver. A run on local disks pays none of that.
    """
    packages = delta_maven_coordinates()
    return f"{packages},{hadoop_aws_maven_coordinates()}" if object_store else packages


def project_root() -> Path | None:
    """The source checkout holding this package, or ``None`` for an installed (non-editable) copy."""
    candidate = _PACKAGE_DIR.parent
    if (candidate / "setup.cfg").is_file() or (candidate / "pyproject.toml").is_file():
        return candidate
    return None


def ivy_dir() -> Path:
    """The Ivy directory for Delta's jars.

    ``$PGDECODE_IVY_DIR`` when set; else ``<checkout>/.cache/ivy`` when the package runs from
    a source checkout; else ``$XDG_CACHE_HOME/pgdecode/ivy`` (``~/.cache/pgdecode/ivy``).
    """
    configured = os.environ.get(IVY_DIR_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    root = project_root()
    if root is not None:
        return root / ".cache" / "ivy"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "pgdecode" / "ivy"


def delta_jar_list(*, object_store: bool = False) -> list[str] | None:
    """Jars named by ``$PGDECODE_DELTA_JARS`` (a comma-separated list or a folder), or ``None``.

    With ``object_store``, a folder's ``object-store`` sub-folder (hadoop-aws and its AWS SDK) too."""
    configured = os.environ.get(DELTA_JARS_ENV)
    if not configured:
        return None
    entries = [entry.strip() for entry in configured.split(",") if entry.strip()]
    jars: list[str] = []
    for entry in entries:
        path = Path(entry).expanduser()
        if path.is_dir():
            jars.extend(str(jar) for jar in sorted(path.glob("*.jar")))
            if object_store:
                extra = sorted((path / OBJECT_STORE_JARS_DIR).glob("*.jar"))
                if not extra:
                    raise ConfigurationError(
                        f"${DELTA_JARS_ENV}={configured!r} has no {OBJECT_STORE_JARS_DIR}/ folder of jars, and this "
                        f"run reads or writes s3:// locations, which need {hadoop_aws_maven_coordinates()}: run "
                        "scripts/fetch_delta_jars.py --maven to copy them there"
                    )
                jars.extend(str(jar) for jar in extra)
        else:
            jars.append(str(path))
    if not jars:
        raise RuntimeError(f"${DELTA_JARS_ENV}={configured!r} names no jar files")
    return jars


def delta_spark_conf(
    *,
    shuffle_partitions: int = DEFAULT_SHUFFLE_PARTITIONS,
    ivy: Path | None = None,
    object_store: bool = False,
) -> dict[str, str]:
    """The Spark configuration every run of the merge job needs (also usable as ``--conf`` pairs);
    with ``object_store``, also what reading and writing ``s3a://`` needs (hadoop-aws; no secret)."""
    conf: dict[str, str] = {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        # Delta rebuilds a table's state (files, transaction ids) with this many tasks; its
        # default of 50 makes every snapshot cost seconds on a small cluster.
        "spark.databricks.delta.snapshotPartitions": str(shuffle_partitions),
        # Delta's VACUUM lists a table's files in this many Spark tasks (Spark's default: 10,000):
        # 15-45 s of task scheduling for a table of a few files here, 2 s with 8. pgdecode's
        # tables are not partitioned, so their files are in one directory.
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": str(shuffle_partitions),
        # Timestamps are UTC end to end: staged timestamptz is UTC, and timestamp without
        # time zone is kept as its wall-clock time read as UTC.
        "spark.sql.session.timeZone": "UTC",
        # Delta's Parquet timestamps as TIMESTAMP_MICROS, not Spark's default INT96, which readers
        # such as delta-rs and pyarrow take as nanoseconds: 9999-12-31 23:59:59.999999 (infinity's
        # clamp, and many a "valid to") came back from them as 1816-03-30.
        PARQUET_TIMESTAMP_CONF: PARQUET_TIMESTAMP_TYPE,
        # PostgreSQL column names are case-sensitive.
        "spark.sql.caseSensitive": "true",
        # Jobs submitted at once (tables merged side by side, other sources' merges on a shared
        # Connect server) share the executors, instead of each waiting for every task of the jobs
        # before it (FIFO): table_workers gives each worker's jobs a pool of its own, and the
        # Connect server pgdecode starts runs its default pool FAIR (fairscheduler.xml).
        "spark.scheduler.mode": "FAIR",
        # PySpark records each DataFrame call's Python call site on the JVM for error messages
        # (several Py4J round trips per column expression, an import attempt of IPython each
        # time): a quarter of a small merge's driver time building its DataFrames, for context
        # pgdecode's own errors already name.
        "spark.python.sql.dataFrameDebugging.enabled": "false",
        # Spark's own logging at [pgdecode] spark_log_level (WARN) from the driver's first line.
        "spark.driver.extraJavaOptions": log_java_options(),
    }
    conf.update(delta_jars_conf(ivy=ivy, object_store=object_store))
    return conf


def delta_jars_conf(*, ivy: Path | None = None, object_store: bool = False) -> dict[str, str]:
    """Where a job's Delta jars (and hadoop-aws with ``object_store``) come from: the files of
    ``$PGDECODE_DELTA_JARS``; else the files Ivy resolved for the same packages before, recorded in
    the Ivy directory (:mod:`~airflow_provider_pgdecode.spark.jars`: no resolution, no Ivy lines in
    the log); else ``spark.jars.packages`` through Ivy, whose session records what it resolved."""
    jars = delta_jar_list(object_store=object_store)
    if jars is not None:
        return {"spark.jars": ",".join(jars)}
    ivy = ivy or ivy_dir()
    packages = spark_packages(object_store=object_store)
    excludes = HADOOP_EXCLUDES if object_store else None
    key = resolution_key(packages, excludes, os.environ.get(MAVEN_REPOSITORY_ENV) or MAVEN_CENTRAL)
    recorded = recorded_jars(ivy, key)
    if recorded is not None:
        return {"spark.jars": ",".join(recorded)}
    conf = {"spark.jars.packages": packages, "spark.jars.ivy": str(ivy), KEY_CONF: key}
    if excludes:
        conf["spark.jars.excludes"] = excludes
    # Maven Central only (see ivysettings.xml for why not Spark's default resolver chain).
    conf["spark.jars.ivySettings"] = str(ivy_settings(ivy))
    return conf


def spark_log_level(level: str | None = None) -> str:
    """The level of Spark's own logging: ``level``, else ``$PGDECODE_SPARK_LOG_LEVEL``, else ``WARN``."""
    value = (level or os.environ.get(SPARK_LOG_LEVEL_ENV) or DEFAULT_SPARK_LOG_LEVEL).strip().upper()
    if value == "WARNING":
        value = "WARN"
    if value not in LOG_LEVELS:
        raise ConfigurationError(
            f"Spark log level {value!r} (the [pgdecode] spark_log_level setting, ${SPARK_LOG_LEVEL_ENV}) is not one "
            f"of {', '.join(LOG_LEVELS)}: set it to WARN (the default) or INFO"
        )
    return value


def log_java_options(level: str | None = None) -> str:
    """JVM options that give a Spark driver (or the Connect server) pgdecode's log4j2 configuration
    at :func:`spark_log_level`: Spark reads it before its first line, so even the lines logged before
    a session exists follow it (``SparkContext.setLogLevel`` would come too late for those)."""
    return (
        f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()} -Dpgdecode.spark.log.level={spark_log_level(level)}"
    )


def ivy_settings(ivy: Path) -> Path:
    """The Ivy settings file: the shipped one, or a copy naming ``$PGDECODE_MAVEN_REPOSITORY``."""
    repository = os.environ.get(MAVEN_REPOSITORY_ENV)
    if not repository:
        return IVY_SETTINGS
    ivy.mkdir(parents=True, exist_ok=True)
    custom = ivy / "ivysettings.xml"
    custom.write_text(IVY_SETTINGS.read_text(encoding="utf-8").replace(MAVEN_CENTRAL, repository), encoding="utf-8")
    return custom


LOOPBACK = "127.0.0.1"
"""The address a driver with a local master binds and advertises (``SPARK_LOCAL_IP``)."""


def is_local_master(master: str | None) -> bool:
    """Whether ``master`` runs the executors beside the driver (``local``, ``local[*]``,
    ``local-cluster[...]``; ``None`` is pgdecode's default, ``local[*]``)."""
    return master is None or master.strip().lower().startswith("local")


def driver_address_env(master: str | None) -> dict[str, str]:
    """``SPARK_LOCAL_IP=127.0.0.1`` for a local master, nothing for a remote one.

    With a local master, executors live in the driver's JVM: loopback always works, and it spares
    Spark a host name that resolves to an address nobody can reach. With a remote master
    (``spark://``, ``yarn``, ``k8s://``) executors on other machines connect back to the driver in
    client mode, so the driver must advertise an address they reach: Spark takes
    ``spark.driver.host`` (and binds ``spark.driver.bindAddress``), else ``SPARK_LOCAL_IP`` of the
    environment, else the machine's host name. None of those is forced here.
    """
    return {"SPARK_LOCAL_IP": LOOPBACK} if is_local_master(master) else {}


def spark_submit_env(master: str | None = None) -> dict[str, str]:
    """Environment for a ``spark-submit`` child process run from this Python (pitfall P2), for
    ``master`` (default ``local[*]``): loopback for the driver only with a local master
    (:func:`driver_address_env`; an ``SPARK_LOCAL_IP`` already in the environment wins)."""
    import pyspark

    # A classic job never inherits pyspark's Connect mode (a Connect session in this process).
    env = {k: v for k, v in os.environ.items() if k not in (CONNECT_MODE_ENV, "SPARK_REMOTE")}
    for key, value in driver_address_env(master).items():
        env.setdefault(key, value)
    env["SPARK_HOME"] = os.path.dirname(pyspark.__file__)
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return env


def spark_bin(name: str = "spark-submit") -> str:
    """Absolute path of a Spark launcher script (``spark-submit``, ``spark-class``) of this venv."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    import pyspark

    return str(Path(os.path.dirname(pyspark.__file__)) / "bin" / name)


def spark_submit_command(
    job_module: str,
    job_args: Sequence[str],
    *,
    master: str = DEFAULT_MASTER,
    driver_memory: str = "1g",
    extra_conf: Mapping[str, str] | None = None,
    object_store: bool = False,
) -> list[str]:
    """A ``spark-submit`` command line running the job ``job_module`` with Delta configured (and
    hadoop-aws with ``object_store``; the store's settings travel as ``AWS_*`` environment)."""
    conf = delta_spark_conf(object_store=object_store)
    conf.update(extra_conf or {})
    command = [spark_bin("spark-submit"), "--master", master, "--driver-memory", driver_memory]
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    return [*command, str(SPARK_JOB_ENTRY), *spark_job_arguments(job_module, job_args)]


def launched_by_spark_submit() -> bool:
    """True inside an application that spark-submit started (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build_spark_session(
    master: str | None = None,
    *,
    app_name: str = "pgdecode-merge",
    extra_conf: Mapping[str, str] | None = None,
    object_store: bool = False,
) -> SparkSession:
    """A SparkSession with Delta Lake configured (or the active one when already running).

    ``master`` defaults to spark-submit's ``--master`` when launched by it, else ``local[*]``.
    ``object_store`` adds hadoop-aws (s3a://) to the jars when this call starts the JVM; under
    spark-submit the jars are its ``--packages`` (the operators add hadoop-aws there).

    A JVM started here for a local master binds the driver to loopback (``SPARK_LOCAL_IP``
    unless the environment sets it); for a remote master give ``spark.driver.host`` in
    ``extra_conf`` (or ``SPARK_LOCAL_IP``) so that executors reach the driver.
    """
    if master is None and not launched_by_spark_submit():
        master = DEFAULT_MASTER
    if not launched_by_spark_submit():
        for key, value in driver_address_env(master).items():
            os.environ.setdefault(key, value)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    conf = delta_spark_conf(object_store=object_store)
    conf.update(extra_conf or {})
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    record_session_jars(spark)
    return spark


def configure_object_store(spark: SparkSession, settings: ObjectStoreSettings | None = None) -> None:
    """Set the object store's S3A settings (``fs.s3a.*``, credentials included) on the running
    session's Hadoop configuration: Spark's file reads and Delta use it, and hand it to executors
    inside tasks. Never as ``--conf`` (a command line, seen by ``ps``) nor SparkConf (the event log).

    ``settings`` default to the ``AWS_*`` environment (what the operators pass to spark-submit).
    Raises :class:`~airflow_provider_pgdecode.errors.ConfigurationError` when the session has no
    S3A filesystem (hadoop-aws is not on its classpath). A Spark Connect session is left as it is:
    its server reads object storage with its own S3A settings (docs/spark-connect.md).
    """
    if is_connect_session(spark):
        return
    from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings

    settings = settings if settings is not None else ObjectStoreSettings.from_env()
    jsc: Any = spark.sparkContext._jsc
    hadoop_conf = jsc.hadoopConfiguration()
    for key, value in settings.hadoop_conf().items():
        hadoop_conf.set(key, value)
    jvm: Any = spark._jvm
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass("s3a", hadoop_conf)
    except Exception as exc:
        raise ConfigurationError(
            f"this Spark session cannot read or write s3a:// locations: Hadoop's S3A filesystem is not on its "
            f"classpath ({str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}). "
            f"Start Spark with {hadoop_aws_maven_coordinates()} in spark.jars.packages (--packages), as the merge "
            "and verify operators do when a location is s3://, or run scripts/fetch_delta_jars.py and build the "
            "session with build_spark_session(object_store=True)"
        ) from None


def is_connect_session(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect client session (no JVM in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


@contextmanager
def active_connect_session(spark: Any) -> Iterator[None]:
    """Make ``spark`` this thread's active session for the block when it is a Spark Connect client.

    pyspark's Connect client binds the DataFrame a ``localCheckpoint()`` returns to the thread's
    *active* session (``SparkSession.active()``), not to the session that made it: in a process
    with more than one Connect session (two slots' merges, a test), the checkpoint would be looked
    up in the wrong server session (``CONNECT_INVALID_PLAN.DATAFRAME_NOT_FOUND``). A classic
    session needs nothing."""
    if not is_connect_session(spark):
        yield
        return
    holder = type(spark)._active_session
    previous = getattr(holder, "session", None)
    holder.session = spark
    try:
        with connect_mode():
            yield
    finally:
        holder.session = previous


CONNECT_MODE_ENV = "SPARK_CONNECT_MODE_ENABLED"
"""pyspark's process-wide switch: set, ``pyspark.sql.functions`` build Connect columns and a
classic ``SparkSession.builder.getOrCreate()`` refuses to start (``CONNECT_URL_NOT_SET``)."""


_connect_mode_lock = threading.Lock()
_connect_mode_holders = 0
_connect_mode_before: str | None = None


@contextmanager
def connect_mode() -> Iterator[None]:
    """pyspark's Connect mode while any block of this is running, then as before.

    pyspark switches a whole process to Connect mode for good when a Connect session is created:
    a later classic session in it (a test's, a verify job's spark-submit that inherits the
    environment, another task under ``airflow dags test``) would fail. pgdecode keeps the switch
    on only while a Connect session is created or a merge runs on one. Counted, not saved and
    restored per block: two merges in two threads (two slots on one server) overlap, and the
    last one out restores the environment as it was before the first."""
    global _connect_mode_holders, _connect_mode_before
    with _connect_mode_lock:
        if _connect_mode_holders == 0:
            _connect_mode_before = os.environ.get(CONNECT_MODE_ENV)
            os.environ[CONNECT_MODE_ENV] = "1"
        _connect_mode_holders += 1
    try:
        yield
    finally:
        with _connect_mode_lock:
            _connect_mode_holders -= 1
            if _connect_mode_holders == 0:
                if _connect_mode_before is None:
                    os.environ.pop(CONNECT_MODE_ENV, None)
                else:
                    os.environ[CONNECT_MODE_ENV] = _connect_mode_before


CONNECT_SESSION_CONF: Mapping[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    PARQUET_TIMESTAMP_CONF: PARQUET_TIMESTAMP_TYPE,
    "spark.sql.caseSensitive": "true",
    "spark.sql.shuffle.partitions": str(DEFAULT_SHUFFLE_PARTITIONS),
    "spark.databricks.delta.snapshotPartitions": str(DEFAULT_SHUFFLE_PARTITIONS),
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": str(DEFAULT_SHUFFLE_PARTITIONS),
}
"""The session-scoped settings of :func:`delta_spark_conf` a Connect client sets on its own session
(the server's settings, Delta's extension and catalog among them, are the server's)."""


def connect_address(url: str) -> tuple[str, int]:
    """Host and port of a Spark Connect URL (``sc://host[:port][/;params]``; port 15002 by default)."""
    from urllib.parse import urlparse

    parsed = urlparse(url.split(";", 1)[0])
    if parsed.scheme != "sc" or not parsed.hostname:
        raise ConfigurationError(f"{url.split(';', 1)[0]!r} is not a Spark Connect URL: write sc://host:port")
    return parsed.hostname, parsed.port or DEFAULT_CONNECT_PORT


def connect_unreachable_error(url: str, cause: str, *, conn_id: str | None = None) -> SparkConnectUnreachableError:
    """The one error of a Spark Connect server that cannot be reached (nothing listens, or it went
    away mid-run): names the server as ``sc://host:port`` (the URL's parameters, a token among them,
    left out), the connection when known, the ``cause`` and the way forward."""
    host, port = connect_address(url)
    connection = f" (connection {conn_id!r})" if conn_id else ""
    return SparkConnectUnreachableError(
        f"the Spark Connect server at sc://{host}:{port}{connection} is not reachable: {cause}. Start it with "
        f"python -m airflow_provider_pgdecode.spark.connect_server --port {port} (docs/spark-connect.md), or point "
        f"the spark_connect connection's host and port at a running server, then run the task again"
    )


def _check_reachable(url: str, timeout: float = 10.0, *, conn_id: str | None = None) -> None:
    """Fail at once, with the way forward, when nothing listens at the URL's address (the Connect
    client would otherwise retry before giving up)."""
    import socket

    host, port = connect_address(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        raise connect_unreachable_error(
            url, f"nothing answers at {host}:{port} ({exc.strerror or exc})", conn_id=conn_id
        ) from None


@contextmanager
def connect_server_named(spark: Any, url: str, *, conn_id: str | None = None) -> Iterator[None]:
    """Run the block on the Connect session ``spark`` of the server at ``url``: an error raised in it
    that means the server went away (:func:`~airflow_provider_pgdecode.spark.connect_client.server_gone`:
    gRPC ``UNAVAILABLE``, the client's retries used up, the session lost to a restart) becomes
    :func:`connect_unreachable_error`, the original kept as its ``__cause__``; pgdecode's own errors
    and the job's other errors pass unchanged."""
    from airflow_provider_pgdecode.errors import PgDecodeError
    from airflow_provider_pgdecode.spark.connect_client import server_gone

    try:
        yield
    except PgDecodeError:
        raise
    except Exception as error:
        gone = server_gone(error, spark)
        if gone is None:
            raise
        raise connect_unreachable_error(url, f"it went away while the task ran ({gone})", conn_id=conn_id) from error


def build_connect_session(
    url: str, *, extra_conf: Mapping[str, str] | None = None, conn_id: str | None = None
) -> SparkSession:
    """A new Spark Connect client session on the server at ``url`` (``sc://host:port``).

    Always a session of its own (``create()``, never a shared default one): on the server every
    client session is a separate Spark session, with its own settings and temporary views, so
    two merges through one server never see each other's settings or Delta transaction ids.
    Its client retries under :func:`~airflow_provider_pgdecode.spark.connect_client.bounded_retry_policy`
    (a server that is gone is given up within a minute, not pyspark's ten). Raises
    :class:`~airflow_provider_pgdecode.errors.SparkConnectUnreachableError` when the server cannot
    be reached (``conn_id``, the Airflow connection of ``url``, is named in it) and
    :class:`~airflow_provider_pgdecode.errors.ConfigurationError` when it has no Delta Lake extension.
    """
    from pyspark.sql import SparkSession

    from airflow_provider_pgdecode.spark.connect_client import bounded_retry_policy, server_gone

    _check_reachable(url, conn_id=conn_id)
    spark = None
    try:
        with connect_mode():
            spark = SparkSession.builder.remote(url).create()
        # Before the session's first call (create() makes none): every call of it retries under these bounds.
        spark.client.set_retry_policies([bounded_retry_policy()])
        for key, value in {**CONNECT_SESSION_CONF, **(extra_conf or {})}.items():
            spark.conf.set(key, value)
        extensions = str(spark.conf.get("spark.sql.extensions", "") or "")
    except ConfigurationError:
        raise
    except Exception as exc:
        gone = server_gone(exc, spark)
        if gone is not None:
            raise connect_unreachable_error(url, gone, conn_id=conn_id) from None
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(
            f"cannot open a Spark Connect session on {url.split(';', 1)[0]} ({detail}). Start the server first: "
            "python -m airflow_provider_pgdecode.spark.connect_server --port PORT (docs/spark-connect.md), "
            "or point the spark_connect connection's host and port at a running one"
        ) from None
    if "io.delta.sql.DeltaSparkSessionExtension" not in extensions:
        spark.stop()
        raise ConfigurationError(
            f"the Spark Connect server at {url.split(';', 1)[0]} runs without Delta Lake (spark.sql.extensions={extensions!r}): "
            "start it with python -m airflow_provider_pgdecode.spark.connect_server, which loads Delta's jars "
            "and extension, or add io.delta.sql.DeltaSparkSessionExtension and Delta's catalog to its settings"
        )
    return spark


SHARED_SERVER_CONF = {"spark.executor.killOnFatalError.depth": "0"}
"""Settings of the Connect server pgdecode starts: a task that runs out of memory fails its merge,
reported to it as out of memory (``MergeOutOfMemoryError``), instead of Spark exiting the JVM (code
52), which would stop every source's merges on the shared server. ``--conf`` overrides it."""


def connect_server_command(
    port: int = DEFAULT_CONNECT_PORT,
    *,
    master: str = DEFAULT_MASTER,
    host: str = LOOPBACK,
    driver_memory: str = "1g",
    extra_conf: Mapping[str, str] | None = None,
    object_store: bool = False,
) -> list[str]:
    """The ``spark-submit`` command line of a Spark Connect server in the foreground, listening on
    ``host:port``, with Delta's jars (Ivy cache or ``$PGDECODE_DELTA_JARS``), Delta's extension and
    catalog, pgdecode's session defaults and logging at :func:`spark_log_level`; with
    ``object_store``, hadoop-aws too (``s3a://``; the store's settings are the server's own)."""
    conf = delta_spark_conf(object_store=object_store)
    conf.update(SHARED_SERVER_CONF)
    conf["spark.scheduler.allocation.file"] = str(FAIR_SCHEDULER_XML)
    conf["spark.connect.grpc.binding.port"] = str(port)
    conf["spark.connect.grpc.binding.address"] = host
    conf.update(extra_conf or {})
    command = [
        spark_bin("spark-submit"),
        "--master",
        master,
        "--driver-memory",
        driver_memory,
        "--name",
        "pgdecode-connect",
        "--class",
        CONNECT_SERVER_CLASS,
    ]
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    return command
