"""AirflowDeployment's own parts that need no Airflow process: its environment, and stopping a
process group with every descendant."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pgdecode_testing.airflow_deployment import (
    AirflowDeployment,
    DeploymentError,
    _stop_group,
)


def test_the_environment_is_the_deployments_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEAK", "postgres://elsewhere")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "SequentialExecutor")
    deployment = AirflowDeployment(
        tmp_path / "home",
        metadata_dsn="postgresql+psycopg2://postgres@127.0.0.1:5999/meta",
        dags_folder=tmp_path / "dags",
        env={"AIRFLOW_CONN_SRC": "postgres://here"},
        api_port=8799,
    )
    env = deployment.env
    assert "AIRFLOW_CONN_LEAK" not in env  # the caller's Airflow settings do not leak in
    assert env["AIRFLOW_CONN_SRC"] == "postgres://here"
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == "postgresql+psycopg2://postgres@127.0.0.1:5999/meta"
    assert env["AIRFLOW_HOME"] == str(tmp_path / "home")
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(tmp_path / "dags")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:8799/execution/"
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"]  # one secret shared by every component
    assert env["PATH"] == os.environ["PATH"]


def test_stopping_a_group_ends_its_descendants_too(tmp_path: Path) -> None:
    # A parent that ignores SIGTERM and a child that left its process group (setsid), as a
    # stubborn component and a Spark JVM might.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    _stop_group(proc, grace=0.5)
    assert proc.returncode is not None
    for _ in range(100):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_failed_migration_says_which_database(tmp_path: Path) -> None:
    fake = tmp_path / "airflow"
    fake.write_text("#!/bin/sh\necho 'cannot connect to server' ; exit 3\n")
    fake.chmod(0o755)
    deployment = AirflowDeployment(
        tmp_path / "home",
        metadata_dsn="postgresql+psycopg2://postgres@127.0.0.1:5999/meta",
        dags_folder=tmp_path,
        airflow=str(fake),
    )
    with pytest.raises(DeploymentError, match=r"`airflow db migrate` on 127.0.0.1:5999/meta failed \(3\)"):
        deployment.start()
    assert deployment.procs == {}
