"""The [pgdecode] section: defaults, Airflow's overrides, the old PGDECODE_* fallback, and the
settings reaching the code that uses them."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.utils.config import (
    SETTINGS,
    pgdecode_bool,
    pgdecode_env,
    pgdecode_environment,
    pgdecode_int,
    pgdecode_setting,
    provider_config,
)

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No [pgdecode] value from this shell: neither AIRFLOW__PGDECODE__* nor PGDECODE_*."""
    for setting in SETTINGS.values():
        monkeypatch.delenv(f"AIRFLOW__PGDECODE__{setting.name.upper()}", raising=False)
        monkeypatch.delenv(setting.env, raising=False)


def test_every_setting_is_documented_with_its_default() -> None:
    options = provider_config()["pgdecode"]["options"]
    assert set(options) == {
        "data_dir",
        "schedule",
        "sources",
        "max_lag_bytes",
        "wait_seconds",
        "retention_days",
        "spool_dir",
        "native",
        "two_sessions",
        "ivy_dir",
        "delta_jars",
        "delta_package",
        "hadoop_aws_package",
        "maven_repository",
        "spark_log_level",
    }
    for name, option in options.items():
        assert option["description"].endswith(f"Fallback: ``${SETTINGS[name].env}``."), name
        assert option["type"] in ("string", "integer", "boolean") and option["version_added"], name
    assert (options["data_dir"]["default"], options["schedule"]["default"]) == ("/tmp/pgdecode", "*/15 * * * *")
    assert (options["wait_seconds"]["default"], options["retention_days"]["default"]) == ("600", "7")


def test_defaults_then_the_old_variable_then_airflows_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pgdecode_setting("data_dir") == "/tmp/pgdecode"
    assert (pgdecode_int("wait_seconds"), pgdecode_int("max_lag_bytes"), pgdecode_bool("native")) == (600, None, True)
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "5")
    assert pgdecode_int("wait_seconds") == 5  # the old variable, as scripts/demo.py and the Makefile set it
    monkeypatch.setenv("AIRFLOW__PGDECODE__WAIT_SECONDS", "42")
    assert pgdecode_int("wait_seconds") == 42  # Airflow's configuration wins over it
    monkeypatch.setenv("PGDECODE_NATIVE", "0")
    assert pgdecode_bool("native") is False
    monkeypatch.setenv("AIRFLOW__PGDECODE__RETENTION_DAYS", "")
    monkeypatch.setenv("PGDECODE_RETENTION_DAYS", "")
    assert pgdecode_int("retention_days") is None  # empty keeps every batch


def test_a_bad_value_names_the_option_and_the_way_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__PGDECODE__WAIT_SECONDS", "ten minutes")
    with pytest.raises(
        ConfigurationError,
        match=r"\[pgdecode\] wait_seconds = 'ten minutes' is not a whole number: set AIRFLOW__PGDECODE__WAIT_SECONDS",
    ):
        pgdecode_int("wait_seconds")
    monkeypatch.setenv("AIRFLOW__PGDECODE__NATIVE", "maybe")
    with pytest.raises(ConfigurationError, match=r"native = 'maybe' is not a boolean"):
        pgdecode_bool("native")
    with pytest.raises(
        ConfigurationError, match="unknown pgdecode setting 'datadir': the \\[pgdecode\\] section has data_dir"
    ):
        pgdecode_setting("datadir")


def test_an_airflow_override_reaches_spark_submit_and_the_spark_conf(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from airflow_provider_pgdecode.hooks.spark_job import default_env_vars, default_spark_conf

    monkeypatch.setenv("AIRFLOW__PGDECODE__DELTA_PACKAGE", "io.delta:delta-spark_4.2_2.13:9.9.9")
    monkeypatch.setenv("AIRFLOW__PGDECODE__IVY_DIR", str(tmp_path / "ivy"))
    monkeypatch.setenv("AIRFLOW__PGDECODE__NATIVE", "False")
    conf = default_spark_conf()
    assert conf["spark.jars.packages"] == "io.delta:delta-spark_4.2_2.13:9.9.9"
    assert conf["spark.jars.ivy"] == str((tmp_path / "ivy").resolve())
    env = default_env_vars()  # spark-submit's environment: the Spark job reads PGDECODE_*
    assert env["PGDECODE_DELTA_PACKAGE"] == "io.delta:delta-spark_4.2_2.13:9.9.9"
    assert env["PGDECODE_NATIVE"] == "0" and "PGDECODE_DELTA_JARS" not in env
    assert "PGDECODE_DELTA_PACKAGE" not in os.environ  # exported only for the spark conf, then restored


def test_the_environment_is_restored_after_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGDECODE_SPOOL_DIR", "/old/spool")
    monkeypatch.setenv("AIRFLOW__PGDECODE__SPOOL_DIR", "/new/spool")
    from airflow_provider_pgdecode.batch.storage import SPOOL_ENV

    with pgdecode_environment() as env:
        assert os.environ[SPOOL_ENV] == env[SPOOL_ENV] == "/new/spool"
        assert os.environ["PGDECODE_NATIVE"] == "1"
    assert os.environ[SPOOL_ENV] == "/old/spool" and "PGDECODE_NATIVE" not in os.environ
    assert pgdecode_env()[SPOOL_ENV] == "/new/spool"


def test_airflow_config_list_shows_the_section_and_an_override(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__PGDECODE__SCHEDULE": "*/5 * * * *",
    }
    env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
    listed = subprocess.run(
        [AIRFLOW, "config", "list", "--section", "pgdecode", "--show-values", "--include-env-vars"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    lines = listed.stdout.splitlines()
    assert lines[0] == "[pgdecode]"
    assert "data_dir = /tmp/pgdecode" in lines and "wait_seconds = 600" in lines and "retention_days = 7" in lines
    assert "schedule = */5 * * * *" in lines  # AIRFLOW__PGDECODE__SCHEDULE
    assert "# Variable: AIRFLOW__PGDECODE__MAVEN_REPOSITORY" in lines


@pytest.mark.postgres
def test_airflows_native_setting_reaches_the_extract(
    pg_cluster: Any, pg_conn: Any, slot_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AIRFLOW__PGDECODE__NATIVE`` picks the extract's path (a spy on the capture's choice; both
    paths stage the same rows)."""
    from airflow_provider_pgdecode.capture import extract as capture_extract
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
    from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator

    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    table = f"cfg_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    with PgDecodeHook(postgres_conn_id="pgdecode_default") as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 5) g")
    chosen: list[bool | None] = []
    choose = capture_extract._native_module
    monkeypatch.setattr(
        capture_extract, "_native_module", lambda native, parser: chosen.append(native) or choose(native, parser)
    )
    rows = []
    for value in ("False", "True"):
        monkeypatch.setenv("AIRFLOW__PGDECODE__NATIVE", value)
        extract = PgDecodeExtractOperator(
            task_id="extract",
            slot_name=slot_name,
            staging_root=str(tmp_path / value),
            tables=[f"public.{table}"],
            checkpoint_task_id=None,
        )
        rows.append(extract.execute({})["tables"])  # type: ignore[arg-type]
    assert chosen == [False, True]
    assert rows[0] == rows[1] and rows[0]
    pg_conn.execute(f"DROP TABLE {table}")
