"""The Docker stack (docker/): the compose file validates with ``docker-compose config`` and has
the shape Airflow's own compose has; the image builds from Airflow's image without naming an
architecture. No Docker engine is needed (``config`` only reads and resolves the file)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
}


def _airflow_version() -> str:
    constraints = (REPO / "requirements" / "constraints.txt").read_text()
    match = re.search(r"^apache-airflow==(\S+)$", constraints, re.MULTILINE)
    assert match, "requirements/constraints.txt pins no apache-airflow"
    return match.group(1)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The compose file as ``docker-compose config`` resolves it (anchors merged, variables filled)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (scripts/ensure-system-deps.sh installs Debian's package)")
    completed = subprocess.run(
        [binary, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert completed.returncode == 0, f"docker-compose config refused {COMPOSE}:\n{completed.stderr}"
    parsed: dict[str, Any] = yaml.safe_load(completed.stdout)
    return parsed


def test_airflow_runs_as_separate_services_like_airflows_own_compose(config: dict[str, Any]) -> None:
    services = config["services"]
    for name, command in AIRFLOW_SERVICES.items():
        service = services[name]
        assert service["command"] in (command, [command]), name
        assert service["environment"]["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert service["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@airflow-db/airflow"), name
        assert service["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
        assert service["depends_on"]["airflow-db"]["condition"] == "service_healthy", name
        assert service["healthcheck"]["test"], name
        assert service["image"] == "pgdecode:local", name
    # One signing key for the services that issue and check task tokens.
    secrets = {services[name]["environment"]["AIRFLOW__API_AUTH__JWT_SECRET"] for name in AIRFLOW_SERVICES}
    assert len(secrets) == 1
    init = services["airflow-init"]["environment"]
    assert init["_AIRFLOW_DB_MIGRATE"] == "true" and init["_AIRFLOW_WWW_USER_CREATE"] == "true"
    assert services["airflow-apiserver"]["ports"][0]["published"] in (8080, "8080")


def test_source_database_has_logical_decoding(config: dict[str, Any]) -> None:
    command = config["services"]["postgres"]["command"]
    settings = {command[i + 1] for i, part in enumerate(command) if part == "-c"}
    assert {"wal_level=logical", "max_replication_slots=10", "max_wal_senders=10"} <= settings
    assert any(s.startswith("max_prepared_transactions=") and int(s.split("=")[1]) > 0 for s in settings)


def test_spark_workers_reach_the_driver_in_the_scheduler(config: dict[str, Any]) -> None:
    """Client mode: the driver runs where LocalExecutor runs tasks (the scheduler) and advertises
    a name the worker resolves on the compose network; both see the same /data."""
    services = config["services"]
    spark = json.loads(services["airflow-scheduler"]["environment"]["AIRFLOW_CONN_SPARK_DEFAULT"])
    assert spark["host"] == "spark://spark-master" and spark["extra"]["deploy-mode"] == "client"
    driver_host = spark["extra"]["driver-host"]
    assert driver_host not in ("localhost", "127.0.0.1")
    assert services["airflow-scheduler"]["hostname"] == driver_host
    assert driver_host in services  # a service name: Docker's DNS resolves it for the worker
    assert spark["extra"]["driver-bind-address"] == "0.0.0.0"
    assert "SPARK_LOCAL_IP" not in services["airflow-scheduler"]["environment"]
    assert "spark://spark-master:7077" in " ".join(services["spark-worker"]["command"])
    # The executors run the scheduler's Python and provider: the same image.
    assert services["spark-worker"]["image"] == services["spark-master"]["image"] == "pgdecode:local"

    def data_mount(name: str) -> set[str]:
        # docker-compose 1.x prints "source:target:mode", Compose v2 a mapping.
        mounts = [
            v.split(":")[:2] if isinstance(v, str) else [v["source"], v["target"]] for v in services[name]["volumes"]
        ]
        return {source for source, target in mounts if target == "/data"}

    assert data_mount("airflow-scheduler") == data_mount("spark-worker") == {"data"}


def test_spark_connect_server_is_a_service_the_tasks_reach(config: dict[str, Any]) -> None:
    """The warm Spark session: the package's own server module listening on the compose network,
    the Airflow services' spark_connect connection naming it, and the same /data as the tasks."""
    services = config["services"]
    server = services["spark-connect"]
    command = server["command"]
    assert command[:3] == ["python", "-m", "airflow_provider_pgdecode.spark.connect_server"]
    port = int(command[command.index("--port") + 1])
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert server["image"] == "pgdecode:local" and server["healthcheck"]["test"]
    assert str(port) in " ".join(server["healthcheck"]["test"])
    connection = json.loads(services["airflow-scheduler"]["environment"]["AIRFLOW_CONN_SPARK_CONNECT"])
    assert connection == {"conn_type": "spark_connect", "host": "spark-connect", "port": port}
    assert server["hostname"] == connection["host"]

    def data_mount(name: str) -> set[str]:
        mounts = [
            v.split(":")[:2] if isinstance(v, str) else [v["source"], v["target"]] for v in services[name]["volumes"]
        ]
        return {source for source, target in mounts if target == "/data"}

    assert data_mount("spark-connect") == data_mount("airflow-scheduler") == {"data"}


def test_image_builds_from_airflows_image_with_the_native_extract() -> None:
    dockerfile = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    assert args["AIRFLOW_IMAGE"] == f"apache/airflow:{_airflow_version()}-python3.11"
    stages = re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    assert stages == ["${AIRFLOW_IMAGE}", "${AIRFLOW_IMAGE}"]  # build stage (compiler) + final image
    assert "setup.py" in dockerfile and "gcc" in dockerfile
    assert "import airflow_provider_pgdecode.capture._native" in dockerfile
    assert "-c requirements/constraints.txt" in dockerfile
    assert "JAVA_HOME=/usr/lib/jvm/default-java" in dockerfile
    assert not re.search(r"amd64|x86_64|aarch64|arm64", dockerfile.replace("amd64 and arm64", ""))


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {
        ".git",
        ".venv/",
        ".cache/",
        "build/",
        "dist/",
        "**/*.so",
        "**/__pycache__/",
        "spark-warehouse/",
    } <= patterns
    assert "data/" in patterns
