"""The provider's settings: the ``[pgdecode]`` section of Airflow's configuration.

Each setting is read here and nowhere else. Set it like any Airflow option, in ``airflow.cfg``::

    [pgdecode]
    data_dir = /data/pgdecode

or as ``AIRFLOW__PGDECODE__DATA_DIR=/data/pgdecode`` (``airflow config list --section pgdecode``
shows the values in force). The environment variables of earlier releases (``PGDECODE_DATA_DIR``
...) still work as a fallback: a value given through Airflow's configuration that differs from
the default wins over them, else the old variable, else the default.

The layers below Airflow (batch, capture, spark; the Spark jobs run where Airflow is absent)
never import this module: the Airflow layer reads a setting and hands it down, as an argument
or as the ``PGDECODE_*`` environment of the code it runs (:func:`pgdecode_env`,
:func:`pgdecode_environment`).

Example::

    from airflow_provider_pgdecode.utils.config import pgdecode_setting

    data_dir = pgdecode_setting("data_dir")
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.errors import ConfigurationError

SECTION = "pgdecode"
VERSION_ADDED = "0.1.0"


@dataclass(frozen=True)
class Setting:
    """One option of the ``[pgdecode]`` section."""

    name: str
    env: str
    """The environment variable of earlier releases (the fallback), also the one handed down."""
    default: str
    type: str
    description: str
    example: str | None = None
    handed_down: bool = False
    """Read below the Airflow layer (from ``env``): exported by :func:`pgdecode_env`."""


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "data_dir",
            "PGDECODE_DATA_DIR",
            "/tmp/pgdecode",
            "string",
            "The example DAGs' default location: staging in ``<data_dir>/staging``, Delta tables in "
            "``<data_dir>/delta`` (each DAG's ``staging_uri`` and ``delta_root`` params override it per run).",
            "/data/pgdecode",
        ),
        Setting(
            "schedule",
            "PGDECODE_SCHEDULE",
            "*/15 * * * *",
            "string",
            "The cron schedule of the example DAG pgdecode_incremental (one CDC cycle per run).",
            "*/5 * * * *",
        ),
        Setting(
            "sources",
            "PGDECODE_SOURCES",
            "",
            "string",
            "The sources file (YAML) that a DAG file in your DAGs folder turns into an incremental and a "
            "backfill DAG per source, by calling "
            "``airflow_provider_pgdecode.example_dags.sources.sources_dags(<default file>)`` (the file's format: "
            "the sources guide of the provider's documentation); a relative path is taken from the folder of "
            "that DAG file. Empty: the default file that DAG file names, usually ``pgdecode_sources.yaml`` next "
            "to it, when there is one (else no DAG). A file named here that does not exist fails the DAG "
            "file's parsing.",
            "/opt/airflow/dags/pgdecode_sources.yaml",
        ),
        Setting(
            "max_lag_bytes",
            "PGDECODE_MAX_LAG_BYTES",
            "",
            "integer",
            "pgdecode_incremental's slot health check fails when the slot retains more WAL than this "
            "many bytes; empty: no limit.",
            "10737418240",
        ),
        Setting(
            "wait_seconds",
            "PGDECODE_WAIT_SECONDS",
            "600",
            "integer",
            "How long a pgdecode_incremental run waits for changes before it skips the cycle.",
            "300",
        ),
        Setting(
            "retention_days",
            "PGDECODE_RETENTION_DAYS",
            "7",
            "integer",
            "Staged batches older than this many days that nothing needs any more are removed after "
            "each confirm of pgdecode_incremental; empty keeps every batch (they are the replay log of "
            "pgdecode_backfill).",
            "30",
        ),
        Setting(
            "spool_dir",
            "PGDECODE_SPOOL_DIR",
            "",
            "string",
            "Local directory where a batch bound for object storage (``s3://``) is written before its "
            "upload; empty: the system's temporary directory.",
            "/var/spool/pgdecode",
            handed_down=True,
        ),
        Setting(
            "native",
            "PGDECODE_NATIVE",
            "True",
            "boolean",
            "Extract through the native (C) scanner when it is built; False: the pure-Python path "
            "(the same batches, slower).",
            "False",
            handed_down=True,
        ),
        Setting(
            "two_sessions",
            "PGDECODE_TWO_SESSIONS",
            "True",
            "boolean",
            "Decode a large range (32 MiB of WAL or more) in two sessions at once, the upper half over a "
            "temporary copy of the slot (one more replication slot while the extract runs); False: one "
            "session (the same batches, slower).",
            "False",
            handed_down=True,
        ),
        Setting(
            "ivy_dir",
            "PGDECODE_IVY_DIR",
            "",
            "string",
            "Ivy directory (``spark.jars.ivy``) where spark-submit caches Delta's jars; empty: "
            "``$XDG_CACHE_HOME/pgdecode/ivy`` (``~/.cache/pgdecode/ivy``), or ``<checkout>/.cache/ivy`` when "
            "the package runs from a source checkout.",
            "/opt/airflow/.ivy",
            handed_down=True,
        ),
        Setting(
            "delta_jars",
            "PGDECODE_DELTA_JARS",
            "",
            "string",
            "A folder of jars or a comma-separated list of jars used instead of resolving Delta's "
            "packages from Maven (machines without Maven Central: copy Delta's artifact, see "
            "``delta_package``, with its dependencies into such a folder, e.g. with "
            "``mvn dependency:copy-dependencies``; runs on ``s3://`` also read hadoop-aws and its AWS SDK "
            "from the folder's ``object-store`` sub-folder).",
            "/opt/pgdecode/jars",
            handed_down=True,
        ),
        Setting(
            "delta_package",
            "PGDECODE_DELTA_PACKAGE",
            "",
            "string",
            "Maven coordinates of Delta's Spark artifact; empty: the release matching the installed pyspark.",
            "io.delta:delta-spark_4.2_2.13:4.4.0",
            handed_down=True,
        ),
        Setting(
            "hadoop_aws_package",
            "PGDECODE_HADOOP_AWS_PACKAGE",
            "",
            "string",
            "Maven coordinates of hadoop-aws (S3A, for ``s3://`` locations); empty: the version of the "
            "Hadoop bundled in the installed pyspark.",
            "org.apache.hadoop:hadoop-aws:3.5.0",
            handed_down=True,
        ),
        Setting(
            "maven_repository",
            "PGDECODE_MAVEN_REPOSITORY",
            "",
            "string",
            "Maven repository URL Delta's (and hadoop-aws's) jars come from; empty: Maven Central.",
            "https://nexus.example.com/repository/maven-central/",
            handed_down=True,
        ),
        Setting(
            "spark_log_level",
            "PGDECODE_SPARK_LOG_LEVEL",
            "WARN",
            "string",
            "Level of Spark's own logging in the merge and verify jobs (spark-submit's driver, from its first "
            "line): ``WARN`` keeps the task log to warnings, errors and pgdecode's own summary lines; ``INFO`` "
            "or ``DEBUG`` show Spark's progress (thousands of lines a run).",
            "INFO",
            handed_down=True,
        ),
    )
}


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of :func:`~airflow_provider_pgdecode.get_provider_info.get_provider_info`."""
    return {
        SECTION: {
            "description": "Settings of the pgdecode provider (batch CDC from PostgreSQL logical replication "
            "slots into Delta Lake). Each option also reads the PGDECODE_<NAME> environment variable of "
            "earlier releases when it is not set here.",
            "options": {
                s.name: {
                    "description": f"{s.description} Fallback: ``${s.env}``.",
                    "version_added": VERSION_ADDED,
                    "type": s.type,
                    "example": s.example,
                    "default": s.default,
                }
                for s in SETTINGS.values()
            },
        }
    }


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown pgdecode setting {name!r}: the [{SECTION}] section has {', '.join(sorted(SETTINGS))}"
        ) from None


def pgdecode_setting(name: str) -> str:
    """The value in force of ``[pgdecode] <name>`` as a string ("" when unset and without default).

    Airflow's configuration (``airflow.cfg``, ``AIRFLOW__PGDECODE__<NAME>``, ``_cmd``/``_secret``)
    when it differs from the default; else the old ``PGDECODE_<NAME>`` variable; else the default.
    """
    from airflow.configuration import conf

    setting = _setting(name)
    configured = conf.get(SECTION, name, fallback=setting.default)
    configured = setting.default if configured is None else str(configured)
    if configured != setting.default:
        return configured
    legacy = os.environ.get(setting.env)
    return legacy if legacy is not None else setting.default


def pgdecode_int(name: str) -> int | None:
    """An integer setting, ``None`` when empty; a clear error naming the option when it is not a number."""
    value = pgdecode_setting(name).strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"[{SECTION}] {name} = {value!r} is not a whole number: set AIRFLOW__{SECTION.upper()}__{name.upper()} "
            f"(or ${_setting(name).env}) to a number, or leave it empty"
        ) from None


def pgdecode_bool(name: str) -> bool:
    """A boolean setting (``True``/``False``, also ``1``/``0``, ``yes``/``no``, ``on``/``off``)."""
    value = pgdecode_setting(name)
    flag = yes_or_no(value)
    if flag is not None:
        return flag
    raise ConfigurationError(
        f"[{SECTION}] {name} = {value!r} is not a boolean: set AIRFLOW__{SECTION.upper()}__{name.upper()} "
        f"(or ${_setting(name).env}) to True or False"
    )


def pgdecode_env() -> dict[str, str]:
    """The settings read below the Airflow layer, as the ``PGDECODE_*`` environment they read.

    Only non-empty values; ``native`` as ``1``/``0``. Given to spark-submit (the merge and verify
    jobs) and exported around the code of a task by :func:`pgdecode_environment`.
    """
    env: dict[str, str] = {}
    for setting in SETTINGS.values():
        if not setting.handed_down:
            continue
        if setting.type == "boolean":
            env[setting.env] = "1" if pgdecode_bool(setting.name) else "0"
            continue
        value = pgdecode_setting(setting.name).strip()
        if value:
            env[setting.env] = value
    return env


@contextmanager
def exported(env: Mapping[str, str]) -> Iterator[Mapping[str, str]]:
    """``env`` in this process's environment for the block, then the former values."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def pgdecode_environment() -> Iterator[Mapping[str, str]]:
    """Export :func:`pgdecode_env` to this process's environment for the duration of the block,
    then restore it (the lower layers read their settings from ``PGDECODE_*``)."""
    with exported(pgdecode_env()) as env:
        yield env


__all__ = [
    "SECTION",
    "SETTINGS",
    "Setting",
    "exported",
    "pgdecode_bool",
    "pgdecode_env",
    "pgdecode_environment",
    "pgdecode_int",
    "pgdecode_setting",
    "provider_config",
]
