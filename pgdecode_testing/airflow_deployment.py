"""A real Airflow deployment for tests: scheduler, DAG processor, triggerer and API server as
separate processes, a PostgreSQL metadata database and the LocalExecutor.

Example::

    from pgdecode_testing.airflow_deployment import AirflowDeployment

    with AirflowDeployment(
        tmp_path / "airflow",
        metadata_dsn="postgresql+psycopg2://postgres@127.0.0.1:5432/airflow",
        dags_folder=tmp_path / "dags",
        env={"AIRFLOW_CONN_PGDECODE_DEFAULT": "..."},
    ) as airflow:
        airflow.cli("dags", "unpause", "pgdecode_incremental")
        airflow.wait_for(lambda: ..., what="a successful run", timeout=300)

:meth:`AirflowDeployment.start` gives the deployment its own ``AIRFLOW_HOME`` (its
``airflow.cfg``, task logs and one log file per process under ``<home>/process-logs``), runs
``airflow db migrate`` against the metadata database, then starts ``airflow scheduler``,
``airflow dag-processor``, ``airflow triggerer`` and ``airflow api-server --port N``, each in a
process group of its own, and waits until the API server answers. :meth:`stop` sends SIGTERM to
each group, waits, and SIGKILLs what is left (with every descendant, such as task processes and
Spark); it runs on leaving the ``with`` block, also when the block failed, and at interpreter
exit. The child processes get the caller's environment without its ``AIRFLOW*`` variables, the
deployment's settings, then ``env``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")

#: The Airflow components a deployment runs, each as ``airflow <args>`` (the API server's port is added).
COMPONENTS: dict[str, tuple[str, ...]] = {
    "api-server": ("api-server", "--workers", "1"),
    "scheduler": ("scheduler",),
    "dag-processor": ("dag-processor",),
    "triggerer": ("triggerer",),
}


class DeploymentError(RuntimeError):
    """A component failed to start or died, or a wait ran out; the message has the logs' tails."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM ``proc``'s process group, wait ``grace`` seconds, then SIGKILL the group and every
    descendant of ``proc`` (also those that left the group)."""
    try:
        import psutil

        descendants = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        descendants = []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants:
        try:
            child.kill()
        except Exception:
            pass
    if proc.poll() is None:
        proc.wait(timeout=30)


def _stop_all(procs: dict[str, subprocess.Popen[bytes]], grace: float) -> None:
    # The scheduler first (no new task processes), the API server last (tasks report to it).
    for name in ("scheduler", "triggerer", "dag-processor", "api-server"):
        if name in procs:
            _stop_group(procs.pop(name), grace)
    for proc in procs.values():
        _stop_group(proc, grace)
    procs.clear()


class AirflowDeployment:
    """Airflow's components as separate processes (module docstring).

    :param home: the deployment's ``AIRFLOW_HOME`` (created when missing).
    :param metadata_dsn: the SQLAlchemy URL of the metadata database
        (``postgresql+psycopg2://user@host:port/db``).
    :param dags_folder: the DAGs folder.
    :param env: more environment for every process (connections, ``[pgdecode]`` settings ...).
    :param api_port: the API server's port; default a free one.
    :param parallelism: tasks the LocalExecutor runs at once.
    :param airflow: the ``airflow`` command; default the one next to this interpreter.
    :param components: which of :data:`COMPONENTS` to start (default all; ``("api-server",)``
        serves the UI and the API over a metadata database that something else fills).
    """

    def __init__(
        self,
        home: Path,
        *,
        metadata_dsn: str,
        dags_folder: Path,
        env: Mapping[str, str] | None = None,
        api_port: int | None = None,
        parallelism: int = 4,
        airflow: str | None = None,
        components: Sequence[str] = tuple(COMPONENTS),
    ) -> None:
        unknown = [c for c in components if c not in COMPONENTS]
        if unknown:
            raise ValueError(f"unknown Airflow components {unknown}; the components are {', '.join(COMPONENTS)}")
        self.components = tuple(components)
        self.home = Path(home)
        self.metadata_dsn = metadata_dsn
        self.dags_folder = Path(dags_folder)
        self.extra_env = dict(env or {})
        self.api_port = api_port or free_port()
        self.parallelism = parallelism
        self.airflow = airflow or str(Path(sys.executable).parent / "airflow")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._finalizer: weakref.finalize[..., AirflowDeployment] | None = None
        self.env = self._environment()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def log_dir(self) -> Path:
        """One ``<component>.log`` per process."""
        return self.home / "process-logs"

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.metadata_dsn,
                "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "3",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
                "AIRFLOW__API__BASE_URL": self.api_url,
                "AIRFLOW__API__PORT": str(self.api_port),
                # Every component signs and checks the same tokens.
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
                "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                # A test deployment: new and changed DAG files are seen in seconds.
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> AirflowDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 240) -> None:
        """Migrate the metadata database, start the components and wait for the API server.

        :raises DeploymentError: the migration failed, or a component died or the API server did
            not answer within ``timeout`` seconds (the processes are stopped again).
        """
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        migrate = self.cli("db", "migrate", check=False, timeout=timeout)
        if migrate.returncode != 0:
            raise DeploymentError(
                f"`airflow db migrate` on {self._db_name()} failed ({migrate.returncode}):\n{migrate.stdout[-4000:]}"
            )
        self._finalizer = weakref.finalize(self, _stop_all, self.procs, 5.0)
        try:
            for name, args in COMPONENTS.items():
                if name not in self.components:
                    continue
                extra = ("--port", str(self.api_port)) if name == "api-server" else ()
                log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
                self._logs[name] = log
                self.procs[name] = subprocess.Popen(
                    [self.airflow, *args, *extra],
                    env=self.env,
                    cwd=str(self.home),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.wait_for(self._api_ready, timeout=timeout, what=f"the API server on {self.api_url}")
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 20) -> None:
        """Stop every component: SIGTERM, ``grace`` seconds, then SIGKILL of what is left."""
        _stop_all(self.procs, grace)
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def _db_name(self) -> str:
        return self.metadata_dsn.rpartition("@")[2]  # host:port/db, without the user

    def _api_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/api/v2/monitor/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    # -- use -----------------------------------------------------------------------------------

    def cli(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """Run ``airflow <args>`` in the deployment's environment; output in ``stdout`` (with stderr).

        :raises DeploymentError: with ``check``, a non-zero exit (its output in the message).
        """
        done = subprocess.run(
            [self.airflow, *args],
            env=self.env,
            cwd=str(self.home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise DeploymentError(f"`airflow {' '.join(args)}` failed ({done.returncode}):\n{done.stdout[-4000:]}")
        return done

    def log(self, name: str) -> str:
        """The output of component ``name`` so far."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def task_logs(self, dag_id: str) -> dict[str, str]:
        """Task logs of ``dag_id`` under ``<home>/logs``: relative path -> text."""
        root = self.home / "logs" / f"dag_id={dag_id}"
        return {
            str(p.relative_to(root)): p.read_text(errors="replace") for p in sorted(root.rglob("*.log")) if p.is_file()
        }

    def check_alive(self) -> None:
        """:raises DeploymentError: a component exited (with its log's tail)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise DeploymentError(f"airflow {name} exited with {proc.returncode}; its log ends:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def wait_for(
        self, probe: Callable[[], T], *, timeout: float, what: str, interval: float = 1.0, tails: Sequence[str] = ()
    ) -> T:
        """Call ``probe`` until it returns something true, and return that.

        :raises DeploymentError: a component died, or ``timeout`` seconds passed (naming ``what``,
            with the tails of the logs of ``tails``, default every component).
        """
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n} ---\n{self.tail(n)}" for n in (tails or self.procs))
                raise DeploymentError(f"waited {timeout:.0f}s for {what}, in vain; the logs end:\n{logs}")
            time.sleep(interval)

    def describe(self) -> dict[str, Any]:
        """Process ids and ports, for a test's report."""
        return {"api_url": self.api_url, "pids": {n: p.pid for n, p in self.procs.items()}, "home": str(self.home)}
