"""A Spark Connect server with Delta Lake in the background, for tests, the demo and benchmarks.

Runs ``python -m airflow_provider_pgdecode.spark.connect_server`` (the module users run in the
foreground) as a child process, waits for its ready line and stops it with SIGTERM::

    with LocalConnectServer(master="local[2]") as server:
        spark = build_connect_session(server.url)   # sc://127.0.0.1:<free port>
        ...

Its output (the server's lines and Spark's, at WARN) is kept in :attr:`LocalConnectServer.output`
and, when ``log_path`` is given, written to that file as it comes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from airflow_provider_pgdecode.spark.connect_server import DEFAULT_START_TIMEOUT, READY_PREFIX
from pgdecode_testing.airflow_deployment import free_port

if TYPE_CHECKING:
    from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings

REPO = Path(__file__).resolve().parents[1]

_SECRET_S3A_KEYS = frozenset(
    {"fs.s3a.access.key", "fs.s3a.secret.key", "fs.s3a.session.token", "fs.s3a.aws.credentials.provider"}
)


def object_store_server_settings(settings: ObjectStoreSettings) -> tuple[dict[str, str], dict[str, str]]:
    """A Connect server's S3A settings for an object store: ``spark.hadoop.fs.s3a.*`` settings
    without the secrets, and the key pair as ``AWS_*`` environment (S3A's default credential
    chain reads it; a command line is seen by ``ps``)."""
    conf = {f"spark.hadoop.{k}": v for k, v in settings.hadoop_conf().items() if k not in _SECRET_S3A_KEYS}
    env = {k: v for k, v in settings.to_env().items() if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    if settings.session_token:
        env["AWS_SESSION_TOKEN"] = settings.session_token
    return conf, env


class ConnectServerError(RuntimeError):
    """The server did not become ready; the message holds the end of its output."""


class LocalConnectServer:
    """A Spark Connect server on 127.0.0.1 (a free port unless ``port`` is given), started by
    :meth:`start` (or ``with``) and stopped by :meth:`stop`; with ``object_store``, it reads and
    writes ``s3://`` locations of that store. ``python``: the interpreter whose installed
    pgdecode runs the server (default this one, with the checkout importable)."""

    def __init__(
        self,
        *,
        python: str | None = None,
        port: int | None = None,
        master: str = "local[2]",
        conf: Mapping[str, str] | None = None,
        object_store: ObjectStoreSettings | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        driver_memory: str | None = None,
        warm_up_rounds: int | None = None,
    ) -> None:
        self.python = python
        self.driver_memory = driver_memory
        self.warm_up_rounds = warm_up_rounds
        self.port = port or free_port()
        self.master = master
        self.conf = dict(conf or {})
        self.env = dict(env or {})
        self.object_store = object_store is not None
        if object_store is not None:  # hadoop-aws and the store's S3A settings (docs/spark-connect.md)
            store_conf, store_env = object_store_server_settings(object_store)
            self.conf = {**store_conf, **self.conf}
            self.env = {**store_env, **self.env}
        self.log_path = log_path
        self.output: list[str] = []
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        """The server's ``sc://`` URL."""
        return f"sc://127.0.0.1:{self.port}"

    @property
    def airflow_conn_json(self) -> str:
        """An Airflow ``spark_connect`` connection to this server, in ``AIRFLOW_CONN_*`` JSON form."""
        import json

        return json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": self.port})

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> LocalConnectServer:
        command = [
            self.python or sys.executable,
            "-m",
            "airflow_provider_pgdecode.spark.connect_server",
            "--port",
            str(self.port),
            "--master",
            self.master,
        ]
        if self.driver_memory is not None:
            command += ["--driver-memory", self.driver_memory]
        if self.warm_up_rounds is not None:
            command += ["--warm-up-rounds", str(self.warm_up_rounds)]
        for key, value in self.conf.items():
            command += ["--conf", f"{key}={value}"]
        if self.object_store:
            command.append("--object-store")
        env = {**os.environ, **self.env}
        if self.python is None:  # this interpreter's checkout; another's installed package stands alone
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        ready.wait(timeout=timeout)
        if not self.running() or not any(line.startswith(READY_PREFIX) for line in self.output):
            tail = "\n".join(self.output[-60:])
            self.stop()
            raise ConnectServerError(f"the Spark Connect server on port {self.port} did not start:\n{tail}")
        return self

    def _read(self, ready: threading.Event) -> None:
        assert self.process is not None and self.process.stdout is not None
        sink = open(self.log_path, "a", encoding="utf-8") if self.log_path else None  # noqa: SIM115
        try:
            for line in self.process.stdout:
                self.output.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if line.startswith(READY_PREFIX):
                    ready.set()
        finally:
            ready.set()  # the process ended
            if sink is not None:
                sink.close()

    def stop(self, grace: float = 60) -> int | None:
        """SIGTERM (the server stops Spark and exits), then SIGKILL of its process group after
        ``grace`` seconds. Returns the exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def __enter__(self) -> LocalConnectServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
