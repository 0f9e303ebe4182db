"""The Docker stack (docker/): the compose file validates with ``docker-compose config`` and has
the shape Airflow's own compose has; the image builds from Airflow's image without naming an
architecture, keeps the base image's installed set, runs for any ``AIRFLOW_UID`` of group 0 and
takes its DAGs from a mount. No Docker engine is needed (``config`` only reads and resolves the
file; the Dockerfile's inline scripts run here on made-up inputs)."""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from airflow_provider_pgdecode.get_provider_info import get_provider_info

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCS = REPO / "docs" / "docker.md"
IMAGE = "pgdecode:local"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
}
SPARK_SERVICES = ("spark-master", "spark-worker", "spark-connect")
# Variables of the user's environment or docker/.env that the compose file reads: the tests
# resolve it without them (and without a developer's docker/.env), then with chosen values.
COMPOSE_VARIABLES = re.compile(r"(?<!\$)\$\{(\w+)(?::?-[^}]*)?\}")


# --- the Dockerfile, read as Docker reads it -------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` of each instruction: continuation lines joined (a trailing ``\\``
    and its newline removed), comment lines dropped, as Docker's parser does."""
    instructions: list[tuple[str, str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None and (not stripped or stripped.startswith("#")):
            continue
        if current is not None and stripped.startswith("#"):
            continue
        continued = line.rstrip().endswith("\\")
        part = line.rstrip()[:-1] if continued else line
        current = [*(current or []), part]
        if not continued:
            keyword, _, arguments = "".join(current).strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            current = None
    assert current is None, "the Dockerfile ends inside a continued instruction"
    return instructions


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions(DOCKERFILE.read_text())
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def _global_args() -> dict[str, str]:
    """The ARGs before the first FROM, defaults resolved as Docker resolves them (in order)."""
    args: dict[str, str] = {}
    for keyword, arguments in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in arguments:
            name, _, default = arguments.partition("=")
            args[name] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], default)
    return args


def _env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, arguments in _final_stage():
        if keyword == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", arguments)))
    return env


def _runs_as(user: str) -> list[str]:
    """The final stage's RUN commands executed as ``user``."""
    current, runs = "", []
    for keyword, arguments in _final_stage():
        if keyword == "USER":
            current = arguments
        elif keyword == "RUN" and current == user:
            runs.append(arguments)
    return runs


def _run_command(marker: str) -> str:
    """The one final-stage RUN command containing ``marker``."""
    found = [arguments for keyword, arguments in _final_stage() if keyword == "RUN" and marker in arguments]
    assert len(found) == 1, f"{len(found)} RUN instructions contain {marker!r}"
    return found[0]


def _recursive_paths(command: str, program: str) -> set[str]:
    """The paths of every ``<program> -R <mode> <paths...>`` in a shell command."""
    paths: set[str] = set()
    for match in re.finditer(rf"\b{program} -R (\S+) ([^&;|]+)", command):
        paths.update(match.group(2).split())
    return paths


def _covered(path: str, roots: set[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(root) for root in roots)


def _shells() -> list[str]:
    # The Airflow image's RUNs use bash (its SHELL); sh (dash) is Docker's default elsewhere.
    return [shell for shell in ("/bin/sh", "/bin/bash") if Path(shell).exists()]


def _airflow_version() -> str:
    python = _global_args()["PYTHON_VERSION"]
    constraints = (REPO / "requirements" / f"constraints-{python}.txt").read_text()
    match = re.search(r"^apache-airflow==(\S+)$", constraints, re.MULTILINE)
    assert match, f"requirements/constraints-{python}.txt pins no apache-airflow"
    return match.group(1)


# --- the compose file, as docker-compose resolves it ------------------------------------------


def _compose_config(tmp_path_factory: pytest.TempPathFactory, **variables: str) -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (scripts/ensure-system-deps.sh installs Debian's package)")
    names = set(COMPOSE_VARIABLES.findall(COMPOSE.read_text()))
    env = {key: value for key, value in os.environ.items() if key not in names}
    env.update(variables)
    empty = tmp_path_factory.mktemp("compose-env") / "empty.env"
    empty.write_text("")
    completed = subprocess.run(
        [binary, "-f", str(COMPOSE), "--env-file", str(empty), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert completed.returncode == 0, f"docker-compose config refused {COMPOSE}:\n{completed.stderr}"
    parsed: dict[str, Any] = yaml.safe_load(completed.stdout)
    return parsed


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The compose file as ``docker-compose config`` resolves it (anchors merged, variables filled
    with their defaults)."""
    return _compose_config(tmp_path_factory)


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(source, target, read_only)`` of a service's volumes: docker-compose 1.x prints
    "source:target:mode", Compose v2 a mapping."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts.append((source, target, "ro" in ",".join(mode).split(",")))
        else:
            mounts.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return mounts


def _image_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in config["services"].items() if service.get("image") == IMAGE}


# --- the stack's shape -----------------------------------------------------------------------


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
        assert service["image"] == IMAGE, name
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


def test_source_connection_is_of_type_pgdecode_and_testable(config: dict[str, Any]) -> None:
    """The connection a user copies: the hook's default id and connection type (whose test runs
    pgdecode's readiness checks), pointing at the source service, with testing turned on."""
    hook = next(
        node
        for node in ast.parse((REPO / "airflow_provider_pgdecode" / "hooks" / "pgdecode.py").read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "PgDecodeHook"
    )
    attributes: dict[str, str] = {
        target.id: statement.value.value
        for statement in hook.body
        if isinstance(statement, ast.Assign)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
        for target in statement.targets
        if isinstance(target, ast.Name)
    }
    variable = f"AIRFLOW_CONN_{attributes['default_conn_name'].upper()}"
    assert variable == "AIRFLOW_CONN_PGDECODE_DEFAULT"
    registered = {entry["connection-type"] for entry in get_provider_info()["connection-types"]}
    source = config["services"]["postgres"]
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        environment = config["services"][name]["environment"]
        connection = json.loads(environment[variable])
        assert connection["conn_type"] == attributes["conn_type"] == "pgdecode", name
        assert connection["conn_type"] in registered, name
        assert (connection["host"], connection["port"]) == ("postgres", 5432), name
        assert connection["schema"] == source["environment"]["POSTGRES_DB"], name
        assert connection["password"] == source["environment"]["POSTGRES_PASSWORD"], name
        assert environment["AIRFLOW__CORE__TEST_CONNECTION"] == "Enabled", name
        assert not any(key.startswith("AIRFLOW_CONN_PGDECODE_") and key != variable for key in environment), name


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
    assert services["spark-worker"]["image"] == services["spark-master"]["image"] == IMAGE

    def data_mount(name: str) -> set[str]:
        return {source for source, target, _ in _mounts(services[name]) if target == "/data"}

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
    assert server["image"] == IMAGE and server["healthcheck"]["test"]
    assert str(port) in " ".join(server["healthcheck"]["test"])
    connection = json.loads(services["airflow-scheduler"]["environment"]["AIRFLOW_CONN_SPARK_CONNECT"])
    assert connection == {"conn_type": "spark_connect", "host": "spark-connect", "port": port}
    assert server["hostname"] == connection["host"]

    def data_mount(name: str) -> set[str]:
        return {source for source, target, _ in _mounts(services[name]) if target == "/data"}

    assert data_mount("spark-connect") == data_mount("airflow-scheduler") == {"data"}


# --- any AIRFLOW_UID, group 0 ----------------------------------------------------------------


def test_every_service_of_the_image_runs_as_airflow_uid_of_group_0(
    config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """As Airflow's own compose: ``user: "${AIRFLOW_UID:-50000}:0"`` on every service of the image,
    the default being the image's airflow user and the variable (``docker/.env``) any uid."""
    raw = yaml.safe_load(COMPOSE.read_text())  # PyYAML merges the << anchors
    images = {name for name, service in raw["services"].items() if service.get("image") == IMAGE}
    assert images == {*AIRFLOW_SERVICES, "airflow-init", *SPARK_SERVICES}
    for name in images:
        assert raw["services"][name]["user"] == "${AIRFLOW_UID:-50000}:0", name
    assert {name: service["user"] for name, service in _image_services(config).items()} == dict.fromkeys(
        images, "50000:0"
    )
    mine = _compose_config(tmp_path_factory, AIRFLOW_UID="4321")
    assert {name: service["user"] for name, service in _image_services(mine).items()} == dict.fromkeys(images, "4321:0")


def test_spark_services_start_through_airflows_entrypoint(config: dict[str, Any]) -> None:
    """No entrypoint override: Airflow's entrypoint gives an unknown uid a passwd entry (Spark's
    Hadoop login needs a user name) and umask 0002, then runs ``bash``/``python`` commands as
    given; with CONNECTION_CHECK_MAX_COUNT=0 it never waits for Airflow's database."""
    for name, service in _image_services(config).items():
        assert "entrypoint" not in service, name
    for name in SPARK_SERVICES:
        service = config["services"][name]
        assert service["command"][0] in ("bash", "python"), name
        assert str(service["environment"]["CONNECTION_CHECK_MAX_COUNT"]) == "0", name


def test_image_makes_every_directory_the_stack_writes_group_0_writable() -> None:
    dockerfile = DOCKERFILE.read_text()
    env = _env()
    root = " && ".join(_runs_as("root"))
    owned, writable = _recursive_paths(root, "chown"), _recursive_paths(root, "chmod")
    assert re.search(r"\bchown -R airflow:0 ", root) and re.search(r"\bchmod -R g\+rwX ", root)
    workdir = [arguments for keyword, arguments in _final_stage() if keyword == "WORKDIR"][-1]
    written = {
        env["AIRFLOW__PGDECODE__DATA_DIR"],
        env["AIRFLOW__PGDECODE__IVY_DIR"],
        env["PGDECODE_IVY_DIR"],
        env["SPARK_WORKER_DIR"],
        workdir,
    }
    assert env["AIRFLOW__PGDECODE__IVY_DIR"] == env["PGDECODE_IVY_DIR"]
    for path in written:
        assert _covered(path, owned), f"{path} is not under a chown -R airflow:0"
        assert _covered(path, writable), f"{path} is not under a chmod -R g+rwX"
        assert re.search(rf"mkdir -p [^&]*{re.escape(path)}\b", root), f"{path} is not created"
    # The Ivy cache is filled after that chmod, as the airflow user: made group-writable in the
    # same RUN as the fetch (a later RUN would store the jars twice), after it.
    fetch = _run_command("fetch_delta_jars.py")
    assert fetch in _runs_as("airflow")
    assert fetch.index("fetch_delta_jars.py") < fetch.index(f"chmod -R g+rwX {env['PGDECODE_IVY_DIR']}")
    # Files the airflow user installs stay group-writable, like the rest of Airflow's virtualenv.
    assert "umask 0002" in fetch and "umask 0002" in _run_command("[spark-submit]")
    assert "chmod 777" not in dockerfile and "o+w" not in dockerfile


def test_volumes_start_with_the_images_modes(config: dict[str, Any]) -> None:
    """The services write only to named volumes, which Docker initialises from the image (owner
    and modes): directories the Dockerfile makes group-writable, or Airflow's own /opt/airflow.
    A bind mount would be created by Docker as root (docs/docker.md: mkdir -p it first)."""
    root = " && ".join(_runs_as("root"))
    writable = _recursive_paths(root, "chmod") | {"/opt/airflow"}
    named = set(config["volumes"])
    for name, service in _image_services(config).items():
        for source, target, read_only in _mounts(service):
            if read_only:
                continue
            assert source in named, f"{name} writes to {target} on a bind mount ({source})"
            assert _covered(target, writable), f"{name}: {target} is not a group-writable directory of the image"
    assert {"data", "airflow-logs"} <= named


# --- DAGs mounted, not baked -----------------------------------------------------------------


def test_dags_are_mounted_not_baked(config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    for keyword, arguments in _instructions(DOCKERFILE.read_text()):
        if keyword in ("COPY", "ADD"):
            sources = [part for part in arguments.split() if not part.startswith("--")][:-1]
            assert not any(s == "dags" or s.startswith(("dags/", "./dags")) for s in sources), arguments
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert "dags/" in ignored
    dags_folder = _env()["AIRFLOW__CORE__DAGS_FOLDER"]
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        service = config["services"][name]
        assert service["environment"]["AIRFLOW__CORE__DAGS_FOLDER"] == dags_folder, name
        mounts = [(source, read_only) for source, target, read_only in _mounts(service) if target == dags_folder]
        assert mounts == [(str(REPO / "dags"), True)], name
    elsewhere = _compose_config(tmp_path_factory, PGDECODE_DAGS_DIR="/srv/my-dags")
    scheduler = elsewhere["services"]["airflow-scheduler"]
    assert ("/srv/my-dags", dags_folder, True) in _mounts(scheduler)


# --- the image: base, Python, constraints -----------------------------------------------------


def test_image_builds_from_airflows_image_with_the_native_extract() -> None:
    dockerfile = DOCKERFILE.read_text()
    args = _global_args()
    assert args["AIRFLOW_VERSION"] == _airflow_version()
    assert args["AIRFLOW_IMAGE"] == f"apache/airflow:{_airflow_version()}-python3.11"
    stages = re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    assert stages == ["${AIRFLOW_IMAGE}", "${AIRFLOW_IMAGE}"]  # build stage (compiler) + final image
    assert "setup.py" in dockerfile and "gcc" in dockerfile
    assert "import airflow_provider_pgdecode.capture._native" in _run_command("[spark-submit]")
    assert "JAVA_HOME=/usr/lib/jvm/default-java" in dockerfile
    assert not re.search(r"amd64|x86_64|aarch64|arm64", dockerfile.replace("amd64 and arm64", ""))


def test_python_version_names_base_image_and_constraints_file(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``PYTHON_VERSION=3.12`` builds from apache/airflow:<version>-python3.12 with
    constraints-3.12.txt; the build refuses a base image of another Python."""
    args = _global_args()
    assert args["PYTHON_VERSION"] == "3.11"
    raw_args = [arguments for keyword, arguments in _instructions(DOCKERFILE.read_text()) if keyword == "ARG"]
    assert "AIRFLOW_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python${PYTHON_VERSION}" in raw_args
    assert ("ARG", "PYTHON_VERSION") in _final_stage()  # visible to the final stage's instructions
    copies = [a for k, a in _final_stage() if k == "COPY" and "requirements/" in a]
    assert copies == ["--chown=airflow:0 requirements/constraints-${PYTHON_VERSION}.txt constraints/project.txt"]
    setup = configparser.ConfigParser(interpolation=None)
    setup.read(REPO / "setup.cfg")
    pythons = re.findall(r"Programming Language :: Python :: (3\.\d+)$", setup["metadata"]["classifiers"], re.M)
    assert pythons == ["3.11", "3.12", "3.13"]
    for python in pythons:
        constraints = (REPO / "requirements" / f"constraints-{python}.txt").read_text()
        assert f"apache-airflow=={args['AIRFLOW_VERSION']}\n" in constraints, python
    # The compose file passes PGDECODE_PYTHON_VERSION as the build argument.
    built = _compose_config(tmp_path_factory, PGDECODE_PYTHON_VERSION="3.12")
    for name, service in _image_services(built).items():
        assert service["build"]["args"] == {"PYTHON_VERSION": "3.12"}, name
        assert service["build"]["dockerfile"] == "docker/Dockerfile" and service["build"]["context"] == str(REPO)

    # The check itself, run as the build runs it (ARGs are environment variables of a RUN).
    check = _run_command("sys.version_info")
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    for shell in _shells():
        same = subprocess.run([shell, "-c", check], env={"PATH": path, "PYTHON_VERSION": running}, capture_output=True)
        assert same.returncode == 0, same.stderr
        other = subprocess.run([shell, "-c", check], env={"PATH": path, "PYTHON_VERSION": "2.7"}, capture_output=True)
        assert other.returncode != 0
        assert f"runs Python {running}, PYTHON_VERSION is 2.7" in other.stderr.decode()


def test_install_keeps_the_base_images_set_and_adds_spark_submit() -> None:
    """The base image's ``pip freeze --all`` (taken before anything is installed) and the
    project's pins of what it lacks constrain the one install: the wheel with ``[spark-submit]``;
    then ``pip check`` fails the build on a conflict."""
    stage = _final_stage()
    runs = [arguments for keyword, arguments in stage if keyword == "RUN"]
    freeze = runs.index(_run_command("pip freeze"))
    install = runs.index(_run_command("pip install"))
    check = runs.index("pip check")
    assert freeze < runs.index(_run_command("> constraints/added.txt")) < install < check
    assert not any("pip install" in run or "uv " in run for run in runs[:install])
    assert re.fullmatch(r"pip freeze --all > constraints/base-image\.txt", runs[freeze])
    command = runs[install]
    assert "-c constraints/base-image.txt -c constraints/added.txt" in command
    assert re.search(r'"\$1\[spark-submit\]"', command) and "set -- /tmp/wheels/*.whl" in command
    assert runs.count("pip check") == 1  # its own RUN, nothing after it to mask a failure
    extras = configparser.ConfigParser(interpolation=None)
    extras.read(REPO / "setup.cfg")
    spark_submit = extras["options.extras_require"]["spark-submit"]
    assert "pyspark" in spark_submit and "apache-airflow-providers-apache-spark[pyspark]" in spark_submit
    dockerfile = DOCKERFILE.read_text()
    assert "requirements/constraints.txt" not in dockerfile and "dev-constraints" not in dockerfile
    assert not re.search(r"delta[-_]spark", dockerfile, re.IGNORECASE)


@pytest.mark.parametrize("shell", _shells())
def test_constraints_filter_keeps_only_what_the_image_lacks(shell: str, tmp_path: Path) -> None:
    """The Dockerfile's inline filter, run as the build runs it: a package the image has (in any
    spelling of its name, pinned or by URL, pip and setuptools included) keeps the image's version;
    the project's pins of the others are added."""
    command = _run_command("> constraints/added.txt")
    (tmp_path / "constraints").mkdir()
    (tmp_path / "constraints" / "base-image.txt").write_text(
        "apache-airflow==3.3.2\n"
        "Apache_Airflow_Providers_Postgres==6.0.0\n"
        "zope.interface==7.2\n"
        "grpcio==1.70.0\n"
        "pip==25.0\n"
        "setuptools==80.0.0\n"
        "some-local-pkg @ file:///tmp/some_local_pkg-1.0-py3-none-any.whl\n"
    )
    (tmp_path / "constraints" / "project.txt").write_text(
        "# What airflow-provider-pgdecode[spark-submit] needs\n"
        "apache-airflow==3.3.2\n"
        "apache-airflow-providers-postgres==7.1.1\n"
        "apache-airflow-providers-apache-spark==6.3.4\n"
        "zope-interface==8.0\n"
        "GRPCIO==1.75.0\n"
        "\n"
        "setuptools==84.2.1\n"
        "Some_Local.Pkg==2.0\n"
        "pyspark==4.2.0\n"
        "py4j==0.10.9.9\n"
        "PySpark_Client==4.2.0\n"
    )
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    completed = subprocess.run(
        [shell, "-c", command], cwd=tmp_path, env={"PATH": path}, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    added = (tmp_path / "constraints" / "added.txt").read_text()
    assert added.splitlines() == [
        "apache-airflow-providers-apache-spark==6.3.4",
        "pyspark==4.2.0",
        "py4j==0.10.9.9",
        "PySpark_Client==4.2.0",
    ]

    # On the real constraints file: an image without anything gets every pin, an image with all
    # of them gets none.
    project = (REPO / "requirements" / f"constraints-{_global_args()['PYTHON_VERSION']}.txt").read_text()
    pins = [line for line in project.splitlines() if line and not line.startswith("#")]
    assert len(pins) > 100 and all("==" in pin for pin in pins)
    (tmp_path / "constraints" / "project.txt").write_text(project)
    for image, expected in (("", pins), (project, [])):
        (tmp_path / "constraints" / "base-image.txt").write_text(image)
        completed = subprocess.run(
            [shell, "-c", command], cwd=tmp_path, env={"PATH": path}, capture_output=True, text=True, timeout=60
        )
        assert completed.returncode == 0, completed.stderr
        assert (tmp_path / "constraints" / "added.txt").read_text().splitlines() == expected


# --- context and documentation ---------------------------------------------------------------


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
        "dags/",
        "**/.env",
    } <= patterns
    assert "data/" in patterns
    # What the Dockerfile copies from the context is not ignored.
    copied = {"setup.py", "airflow_provider_pgdecode", "scripts/fetch_delta_jars.py", "requirements/"}
    assert not copied & patterns


def test_docs_name_every_setting_of_the_compose_file() -> None:
    docs = DOCS.read_text()
    for variable in set(COMPOSE_VARIABLES.findall(COMPOSE.read_text())):
        assert f"`{variable}`" in docs, variable
    assert 'echo "AIRFLOW_UID=$(id -u)" > docker/.env' in docs
    assert "mkdir -p ./data" in docs and "pip check" in docs and "[spark-submit]" in docs
    assert "requirements/constraints.txt" not in docs
