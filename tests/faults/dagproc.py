"""Run ``airflow dags test pgdecode_incremental`` in a child process group, and kill it on cue.

A :class:`DagProcess` starts each cycle as its own process group (``start_new_session``), so
the Airflow CLI, the in-process task runner, spark-submit, the Spark JVM and its Python driver
all share one group. The child's output goes line by line to a log file; a :class:`KillPlan`
names a line to wait for (a regular expression) and a delay after it, and then the whole group
(and any descendant that left it) gets SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.jars import cached_delta_jars

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).parent / "airflow")

#: Where in a cycle a kill is aimed: the line it waits for.
MARKERS: dict[str, str] = {
    # the sensors before the extract (cheap kills: nothing staged yet)
    "sensors": r"\[DAG TEST\] starting task_id=wait_for_changes",
    # the extract: peek, stage, publish (the operator logs this line just before extract_batch)
    "extract": r"Extracting slot \S+ from \S+ up to",
    # spark-submit: JVM start, reading the batch, the MERGEs
    "merge": r"Merging \d+ batch\(es\)",
    # a table's MERGE is committed (the watermark with it); others or the confirm may not be
    "commit": r"airflow_provider_pgdecode\.spark\.merge: table \S+: (merged|appended|created)",
    # the confirm task: advance the slot, push the checkpoint
    "confirm": r"\[DAG TEST\] starting task_id=confirm",
    # the drain task's loop of bounded batches (extract, merge, confirm each), after the cycle's own
    "drain": r"draining the backlog batch by batch",
}


@dataclass
class KillPlan:
    """Kill the cycle ``delay`` seconds after its first line matching ``MARKERS[phase]``."""

    phase: str
    delay: float

    def describe(self) -> str:
        return f"SIGKILL {self.delay:.2f}s after {self.phase!r} ({MARKERS[self.phase]})"


@dataclass
class RunResult:
    returncode: int | None
    killed: bool
    seconds: float
    log: Path
    marks: dict[str, float] = field(default_factory=dict)  # phase -> seconds after start

    @property
    def succeeded(self) -> bool:
        return not self.killed and self.returncode == 0

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_tree(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and every descendant, wherever its group."""
    escaped = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for proc in escaped:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


class DagProcess:
    """Cycles of ``pgdecode_incremental`` through ``airflow dags test`` with a given environment."""

    def __init__(self, env: dict[str, str], conf: dict[str, Any], log_dir: Path) -> None:
        self.env = env
        self.conf = conf
        self.log_dir = log_dir
        self.runs = 0

    def run(self, kill: KillPlan | None = None, timeout: float = 300, conf: dict[str, Any] | None = None) -> RunResult:
        """One cycle; ``conf`` overrides this process's DAG run conf for this cycle only."""
        self.runs += 1
        log = self.log_dir / f"run-{self.runs:03d}.log"
        started = time.monotonic()
        proc = subprocess.Popen(
            [AIRFLOW, "dags", "test", "pgdecode_incremental", "-c", json.dumps({**self.conf, **(conf or {})})],
            env=self.env,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        killed = threading.Event()
        marks: dict[str, float] = {}
        patterns = {phase: re.compile(pattern) for phase, pattern in MARKERS.items()}
        timer: threading.Timer | None = None

        def fire() -> None:
            killed.set()
            _kill_tree(proc.pid)

        assert proc.stdout is not None
        try:
            with open(log, "w", encoding="utf-8", errors="replace") as out:
                for raw in proc.stdout:
                    line = raw.decode("utf-8", errors="replace")
                    now = time.monotonic() - started
                    out.write(f"{now:8.2f} {line}")
                    for phase, pattern in patterns.items():
                        if phase not in marks and pattern.search(line):
                            marks[phase] = now
                            if kill is not None and kill.phase == phase and timer is None:
                                timer = threading.Timer(kill.delay, fire)
                                timer.start()
                    if now > timeout and not killed.is_set():
                        out.write(f"{now:8.2f} [faults] timeout after {timeout}s: killing the cycle\n")
                        fire()
                proc.wait(timeout=60)
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
        # The group is gone once its leader is reaped and killpg finds nobody.
        for _ in range(100):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            _kill_tree(proc.pid)
            time.sleep(0.05)
        return RunResult(proc.returncode, killed.is_set(), time.monotonic() - started, log, marks)


def airflow_env(airflow_home: Path, source_conn_json: str, *, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child ``airflow`` process: its own home and SQLite DB, the DAGs of
    this checkout, the source and Spark connections, and Delta's jars from the local Ivy cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW_CONN_PGDECODE_DEFAULT": source_conn_json,
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
            "PGDECODE_WAIT_SECONDS": "2",
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        }
    )
    jars = cached_delta_jars()
    if jars:
        # The jars spark.jars.packages would resolve, without Ivy's few seconds per spark-submit.
        env["PGDECODE_DELTA_JARS"] = jars
    env.update(extra or {})
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, cwd=str(REPO))
    return env
