"""A Spark standalone cluster of pip's pyspark (``spark-class``): a master and one-machine workers,
for the tests and benchmarks that need executors of their own::

    with standalone_cluster(tmp_path, "127.0.0.1", workers=2) as (master_url, master_ui):
        ...   # spark://127.0.0.1:<port>; master_state(master_ui) is the master's JSON status

Returns once the master is alive and every worker has registered; stops them all on exit.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from typing import Any

from airflow_provider_pgdecode.spark.session import spark_bin, spark_submit_env


def free_port(host: str = "127.0.0.1") -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def master_state(ui_port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """The master's status (``/json/``): ``status``, ``aliveworkers``, ``activeapps``, ``completedapps``..."""
    with urllib.request.urlopen(f"http://{host}:{ui_port}/json/", timeout=5) as response:
        return json.loads(response.read())


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``predicate()``'s first true value, tried every half second; raises naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as error:  # noqa: BLE001 - the master is still starting
            last_error = error
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error})")


@contextmanager
def standalone_cluster(
    work: Path, host: str = "127.0.0.1", workers: int = 1, *, cores: int = 1, memory: str = "1g"
) -> Iterator[tuple[str, int]]:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, bound to ``host``,
    their logs and work directories under ``work``; yields the master's URL and web UI port."""
    env = spark_submit_env(f"spark://{host}")
    env.update(
        {
            "SPARK_LOG_DIR": str(work / "logs"),
            "SPARK_WORKER_DIR": str(work / "work"),
            "SPARK_LOCAL_DIRS": str(work / "local"),
            # The master's and workers' RPC and web UIs listen on ``host`` (not on loopback).
            "SPARK_LOCAL_IP": host,
        }
    )
    master_port, master_ui = free_port(), free_port()
    spark_class = spark_bin("spark-class")
    with ExitStack() as stack:
        processes: list[subprocess.Popen[bytes]] = []

        def start(args: list[str], log_name: str) -> None:
            log = stack.enter_context(open(work / log_name, "wb"))
            processes.append(subprocess.Popen([spark_class, *args], env=env, stdout=log, stderr=subprocess.STDOUT))

        try:
            master = ["org.apache.spark.deploy.master.Master", "--host", host, "--port", str(master_port)]
            start([*master, "--webui-port", str(master_ui)], "master.log")
            master_url = f"spark://{host}:{master_port}"
            wait_for(lambda: master_state(master_ui, host)["status"] == "ALIVE", 60, "the master")
            for index in range(workers):
                worker = ["org.apache.spark.deploy.worker.Worker", "--host", host, "--port", str(free_port())]
                worker += ["--webui-port", str(free_port()), "--cores", str(cores), "--memory", memory]
                start([*worker, "--work-dir", str(work / f"work-{index}"), master_url], f"worker-{index}.log")
            wait_for(lambda: master_state(master_ui, host)["aliveworkers"] == workers, 60, f"{workers} worker(s)")
            yield master_url, master_ui
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
