#!/usr/bin/env python
"""What a user installs is what we test: the built wheel, installed (not editable) into fresh
virtualenvs of every declared Python, runs real CDC cycles as the README's quick start sets them up.

    .venv/bin/python scripts/check_installed.py [--python 3.12] [--dist dist]

``make dist-check`` runs it after building the distributions (scripts/check_dist.py). For each
declared Python (scripts/lock_constraints.py ``PYTHONS``), from a temporary directory outside the
checkout:

1. a fresh virtualenv with the manylinux wheel of that Python and its ``[spark-submit]`` extra,
   installed with ``-c requirements/constraints-<python>.txt``; ``pip check``;
2. Airflow (``airflow dags test``, SQLite metadata database) runs ``pgdecode_incremental`` from a
   ``dags/`` folder holding only the file the README's quick start tells users to write, with the
   README's connections (a ``pgdecode`` source, a ``spark`` connection of master ``local[*]``),
   against a throwaway PostgreSQL where a workload ran: the merge goes through spark-submit;
3. on the first Python (the Connect client is the same code on each; a Connect server costs a
   minute of CI per Python), more changes, then a second run whose merge goes through a Spark
   Connect server started from the installed wheel (``python -m
   airflow_provider_pgdecode.spark.connect_server``);
4. after each run, every Delta table equals its source table as a multiset, Delta read by delta-rs
   (an independent reader) in the checkout's environment; and the run's log (its output and task
   logs) holds no ERROR or ``[error]`` line, no Ivy resolution line and none of the warnings a user
   cannot act on.

On the first Python, the Connect-only form too: the wheel without the extra installs no JVM Spark
(``pip list`` shows ``pyspark-client`` and no ``pyspark``; the list is printed) and runs a third
cycle through the Connect server, on the same Airflow metadata database.

Needs the checkout's dev environment (pgdecode_testing, deltalake, psycopg), the interpreters of
every declared Python, a filled Ivy cache (``make delta-jars``) and PyPI or pip's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # pgdecode_testing: the checkout's throwaway servers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lock_constraints import PYTHONS, constraints_file, interpreter  # noqa: E402

PACKAGE = "airflow_provider_pgdecode"
START = time.monotonic()
TABLES = ("customers", "orders")

BAD_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b|\[\s*(?:error|critical)\s*\]|Traceback \(most recent call last\)")
"""A line a successful run must not log: an error, however it is spelled."""
IVY_LINE = re.compile(r":: resolving dependencies ::|:: retrieving ::|Ivy Default Cache set to|artifacts copied")
"""A line of Ivy's resolution report (a job that resolved its packages instead of loading jars)."""
NOISE_LINE = re.compile(
    r"FutureWarning|Failed to translate filter|pandas >= 3|lineage has been truncated|Truncated the string"
    r"|Warning\b.*airflow_provider_pgdecode|airflow_provider_pgdecode.*Warning\b"
)
"""Warnings a user cannot act on: PySpark's under pandas 3, the Spark job's internals (Delta's filter
translation, the merge's local checkpoints, plan strings), any Python warning of pgdecode's own code.
Airflow's own notices (an Asset created by its first event, ``airflow dags test``'s in-process API
client) are printed, not refused: they are Airflow's, and a deployment's scheduler ends the first."""


WARNING_LINE = re.compile(r"\[\s*warning\s*\]|\d\d:\d\d:\d\d WARN |\bWARNING:|Warning: ")
"""A line at warning level: Airflow's ``[warning ]``, Spark's ``WARN``, the JVM's and Python's."""


class InstalledCheckError(Exception):
    """The installed wheel does not install, or its cycle does not run or diverges."""


def log(message: str) -> None:
    print(f"[check_installed {time.monotonic() - START:6.1f}s] {message}", flush=True)


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without what would reach into the checkout or its settings."""
    scrubbed = ("AIRFLOW", "PGDECODE_", "PYTHON", "VIRTUAL_ENV", "SPARK_", "PYSPARK_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(scrubbed)}
    env.update(extra)
    return env


def run(cmd: Sequence[str | os.PathLike[str]], *, env: dict[str, str], cwd: Path, timeout: float = 1200) -> str:
    """Run ``cmd``; its output (stdout and stderr) is returned, and shown when it fails."""
    text = [str(c) for c in cmd]
    log("$ " + " ".join(text)[:300])
    try:
        done = subprocess.run(text, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise InstalledCheckError(f"{text[0]} did not finish within {timeout:.0f}s: {' '.join(text)[:300]}") from exc
    output = done.stdout + done.stderr
    if done.returncode != 0:
        sys.stderr.write(output[-30000:])
        raise InstalledCheckError(f"exit status {done.returncode} from: {' '.join(text)[:300]} (its output is above)")
    return output


# -- what the README tells a new user ------------------------------------------------------------


@dataclass(frozen=True)
class QuickStart:
    """The README's quick start, as the check follows it: the DAG file and the connections."""

    dag_file: str
    dag_text: str
    connections: dict[str, dict[str, Any]]


def read_quick_start(readme: Path = ROOT / "README.md") -> QuickStart:
    """The DAG file (the fenced block whose first line is ``# dags/<name>.py``) and the
    ``export AIRFLOW_CONN_<ID>='<json>'`` lines of the README's quick start."""
    text = readme.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:python|sh)\n(.*?)```", section, re.DOTALL)
    dags = [b for b in blocks if re.match(r"# dags/[\w.]+\.py\n", b)]
    if len(dags) != 1:
        raise InstalledCheckError(
            f"the README's quick start should show one dags/ file (a block starting '# dags/'), shows {len(dags)}"
        )
    dag_file = dags[0].split("\n", 1)[0].removeprefix("# dags/")
    connections = {
        conn_id.lower(): json.loads(value)
        for conn_id, value in re.findall(r"export AIRFLOW_CONN_(\w+)='(\{.*?\})'", section, re.DOTALL)
    }
    if not connections:
        raise InstalledCheckError("the README's quick start exports no AIRFLOW_CONN_* connection")
    return QuickStart(dag_file, dags[0], connections)


# -- environments --------------------------------------------------------------------------------


def wheel_for(dist: Path, python: str) -> Path:
    tag = f"cp{python.replace('.', '')}"
    found = sorted(dist.glob(f"{PACKAGE}-*-{tag}-{tag}-manylinux*.whl"))
    if len(found) != 1:
        raise InstalledCheckError(f"expected one manylinux wheel for Python {python} in {dist}, found {found}")
    return found[0]


def make_venv(python: str, wheel: Path, target: Path, *, extra: str | None, home: Path) -> Path:
    """A fresh virtualenv of ``python`` at ``target`` with ``wheel`` (``[extra]``) installed with
    that Python's constraints (this interpreter's pip installs into it); ``pip check`` passes."""
    run([interpreter(python), "-m", "venv", "--without-pip", target], env=clean_env(), cwd=home)
    venv_python = target / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(venv_python)]
    requirement = f"{wheel}[{extra}]" if extra else str(wheel)
    constraints = constraints_file(python)
    run(
        [*pip, "install", "--quiet", "--no-compile", "-c", constraints, requirement],
        env=clean_env(),
        cwd=home,
        timeout=1800,
    )
    run([*pip, "check"], env=clean_env(), cwd=home)
    log(f"Python {python}: {wheel.name}{f'[{extra}]' if extra else ''} installed with -c {constraints.name}")
    return venv_python


def installed_distributions(venv_python: Path, home: Path) -> dict[str, str]:
    """``{name: version}`` of what ``pip list`` shows in the virtualenv."""
    out = run(
        [sys.executable, "-m", "pip", "--python", str(venv_python), "list", "--format", "json"],
        env=clean_env(),
        cwd=home,
    )
    return {p["name"].lower(): p["version"] for p in json.loads(out[out.index("[") :])}


# -- the cycle -----------------------------------------------------------------------------------


@dataclass
class Pipeline:
    """One source database, its slot and Delta root, and the Airflow home that runs its cycles."""

    python: str
    cluster: Any
    home: Path
    quick_start: QuickStart
    database: str = ""
    slot: str = ""
    runs: int = 0
    reports: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        suffix = self.python.replace(".", "")
        self.database, self.slot = f"shop_py{suffix}", f"pgdecode_shop_py{suffix}"
        self.cluster.create_database(self.database)
        with self.cluster.connect(self.database) as conn:
            conn.execute(
                "CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, note text);"
                " CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int, amount numeric(10,2),"
                "  status text, created_at timestamptz DEFAULT now())"
            )
            # As the DAG's ensure_slot makes it: two-phase (PostgreSQL 14+).
            conn.execute(f"SELECT pg_create_logical_replication_slot('{self.slot}', 'test_decoding', false, true)")
        (self.home / "dags").mkdir(parents=True)
        (self.home / "dags" / self.quick_start.dag_file).write_text(self.quick_start.dag_text, encoding="utf-8")

    @property
    def delta_root(self) -> Path:
        return self.home / "data" / "delta"

    def env(self, spark_connection: dict[str, Any]) -> dict[str, str]:
        """The environment of an ``airflow`` command: the README's connections, the source pointed
        at the throwaway cluster, ``spark_default`` as given; the Ivy cache of the checkout
        (``[pgdecode] ivy_dir``: filled by ``make delta-jars``, as a deployment's is after its first run)."""
        connections = dict(self.quick_start.connections)
        source = next(conn_id for conn_id, c in connections.items() if c.get("conn_type") == "pgdecode")
        connections[source] = {
            **connections[source],
            "host": self.cluster.host,
            "port": self.cluster.port,
            "login": self.cluster.user,
            "schema": self.database,
        }
        connections[source].pop("password", None)  # trust authentication
        connections["spark_default"] = spark_connection
        return clean_env(
            AIRFLOW_HOME=str(self.home / "airflow"),
            AIRFLOW__CORE__DAGS_FOLDER=str(self.home / "dags"),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__PGDECODE__DATA_DIR=str(self.home / "data"),
            AIRFLOW__PGDECODE__IVY_DIR=str(ROOT / ".cache" / "ivy"),
            AIRFLOW__PGDECODE__WAIT_SECONDS="30",
            **{f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(conn) for conn_id, conn in connections.items()},
        )

    def workload(self) -> None:
        """A round of changes: inserts, updates, deletes, a key change, a TRUNCATE with rows after it
        in one transaction, and a prepared transaction committed."""
        n = self.runs * 1000
        with self.cluster.connect(self.database) as conn:
            conn.execute(
                f"INSERT INTO customers SELECT g, 'customer ' || g, repeat('n', g % 7) FROM generate_series({n + 1}, {n + 40}) g;"
                f" INSERT INTO orders (id, customer_id, amount, status) SELECT g, {n} + g % 40 + 1, g * 1.25, 'new'"
                f"  FROM generate_series({n + 1}, {n + 200}) g;"
                f" UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id % 3 = 0 AND id > {n};"
                f" DELETE FROM orders WHERE id % 10 = 0 AND id > {n};"
                f" UPDATE customers SET id = id + 500 WHERE id = {n + 40};"
            )
            if self.runs == 1:
                conn.execute(
                    "BEGIN; TRUNCATE customers; INSERT INTO customers SELECT g, 'again ' || g, NULL"
                    f" FROM generate_series({n + 1}, {n + 25}) g; COMMIT"
                )
            conn.execute(f"BEGIN; INSERT INTO orders (id, customer_id, status) VALUES ({n + 900}, 1, '2pc')")
            conn.execute(f"PREPARE TRANSACTION 'pgdecode_check_{self.runs}'")
            conn.execute(f"COMMIT PREPARED 'pgdecode_check_{self.runs}'")

    def cycle(self, venv_python: Path, spark_connection: dict[str, Any], label: str) -> None:
        """Changes, one ``airflow dags test pgdecode_incremental`` from ``venv_python``'s Airflow,
        then Delta against PostgreSQL and the run's log."""
        self.workload()
        self.runs += 1
        env = self.env(spark_connection)
        airflow = venv_python.parent / "airflow"
        if not (self.home / "airflow" / "airflow.db").exists():
            run([airflow, "db", "migrate"], env=env, cwd=self.home)
        conf = {"slot_name": self.slot, "plugin": "test_decoding"}
        logs_before = set(self.task_logs())
        output = run([airflow, "dags", "test", "pgdecode_incremental", "-c", json.dumps(conf)], env=env, cwd=self.home)
        task_logs = "".join(p.read_text(errors="replace") for p in self.task_logs() if p not in logs_before)
        (self.home / f"run-{self.runs}.log").write_text(output + task_logs, encoding="utf-8")
        if "DagRunState.SUCCESS" not in output and "state=success" not in output.lower():
            sys.stderr.write(output[-20000:])
            raise InstalledCheckError(
                f"Python {self.python}, {label}: the DAG run did not succeed (its output is above)"
            )
        self.check_delta(label)
        self.check_log(output + task_logs, label)

    def test_connection(self, venv_python: Path) -> None:
        """The README's ``airflow connections test`` of the source succeeds, and what it ran is
        pgdecode's readiness check (the CLI prints no message on success: asked through Python)."""
        env = {**self.env(self.quick_start.connections["spark_default"]), "AIRFLOW__CORE__TEST_CONNECTION": "Enabled"}
        source = next(c for c, conn in self.quick_start.connections.items() if conn.get("conn_type") == "pgdecode")
        output = run([venv_python.parent / "airflow", "connections", "test", source], env=env, cwd=self.home)
        probe = (
            "from airflow.models.connection import Connection; "
            f"print(*Connection.get_connection_from_secrets({source!r}).test_connection())"
        )
        message = run([venv_python, "-c", probe], env=env, cwd=self.home).strip().splitlines()[-1]
        if "Connection success!" not in output or not message.startswith("True ready for test_decoding slots"):
            sys.stderr.write(output[-5000:] + message)
            raise InstalledCheckError(
                f"Python {self.python}: `airflow connections test {source}` did not run pgdecode's checks"
            )
        log(f"Python {self.python}: airflow connections test {source}: Connection success! ({message[5:200]})")

    def task_logs(self) -> list[Path]:
        return sorted((self.home / "airflow" / "logs").rglob("*.log"))

    def check_delta(self, label: str) -> None:
        """Every table equal to its source as a multiset, Delta read by delta-rs."""
        import deltalake
        import pyarrow as pa

        from pgdecode_testing.compare import canonical, source_rows

        with self.cluster.connect(self.database) as conn:
            for table in TABLES:
                names, rows = source_rows(conn, "public", table)
                # delta-rs's SQL engine reads what the merge writes (column mapping, deletion vectors).
                query = deltalake.QueryBuilder().register(
                    "t", deltalake.DeltaTable(str(self.delta_root / "public" / table))
                )
                delta = pa.table(query.execute("SELECT " + ", ".join(f'"{n}"' for n in names) + " FROM t").read_all())
                left = Counter(tuple(canonical(v) for v in row) for row in rows)
                right = Counter(tuple(canonical(row[n]) for n in names) for row in delta.to_pylist())
                if left != right:
                    raise InstalledCheckError(
                        f"Python {self.python}, {label}: public.{table} differs: {len(rows)} rows in PostgreSQL, "
                        f"{delta.num_rows} in Delta; only in PostgreSQL {list((left - right).elements())[:3]}, "
                        f"only in Delta {list((right - left).elements())[:3]}"
                    )
                self.reports.append(f"Python {self.python}, {label}: public.{table} {len(rows)} rows, equal")
        log(f"Python {self.python}, {label}: PostgreSQL equals Delta (read by delta-rs) in {', '.join(TABLES)}")

    def check_log(self, text: str, label: str) -> None:
        """No error, no Ivy resolution, no warning a user cannot act on."""
        lines = text.splitlines()
        found = {
            "error": [line for line in lines if BAD_LINE.search(line)],
            "Ivy": [line for line in lines if IVY_LINE.search(line)],
            "unactionable warning": [line for line in lines if NOISE_LINE.search(line)],
        }
        warnings = [line for line in lines if WARNING_LINE.search(line)]
        log(
            f"Python {self.python}, {label}: {len(lines)} log lines, {len(found['error'])} error, "
            f"{len(found['Ivy'])} Ivy, {len(warnings)} warning lines"
        )
        for line in warnings:
            print(f"    warning: {line.strip()[:240]}")
        bad = {kind: hits for kind, hits in found.items() if hits}
        if bad:
            listed = "\n".join(f"  {kind}: {line.strip()[:300]}" for kind, hits in bad.items() for line in hits[:10])
            raise InstalledCheckError(f"Python {self.python}, {label}: a successful run logged\n{listed}")


@contextmanager
def connect_server(venv_python: Path, home: Path) -> Iterator[dict[str, Any]]:
    """A Spark Connect server started from the installed wheel; yields its ``spark_connect`` connection."""
    from pgdecode_testing.connect_server import LocalConnectServer

    env = clean_env(PGDECODE_IVY_DIR=str(ROOT / ".cache" / "ivy"))
    server = LocalConnectServer(python=str(venv_python), env=env, log_path=home / "connect-server.log")
    server.env = env  # the installed server's whole environment: nothing of the checkout's
    with server:
        log(f"Spark Connect server from {venv_python.parent.parent.name} on {server.url}")
        yield json.loads(server.airflow_conn_json)


def check_python(
    python: str, dist: Path, cluster: Any, quick_start: QuickStart, work: Path, *, first: bool
) -> list[str]:
    home = work / f"py{python}"
    home.mkdir()
    wheel = wheel_for(dist, python)
    venv_python = make_venv(python, wheel, home / "venv", extra="spark-submit", home=home)
    # From outside the checkout: the C module loads from the installed wheel, Airflow lists the provider.
    installed: list[str | os.PathLike[str]] = [
        venv_python,
        Path(__file__).resolve().parent / "check_dist.py",
        "installed",
    ]
    log(run([*installed, "--native", "--airflow-home", home / "airflow-providers"], env=clean_env(), cwd=home).strip())
    pipeline = Pipeline(python, cluster, home, quick_start)
    pipeline.test_connection(venv_python)
    pipeline.cycle(venv_python, quick_start.connections["spark_default"], "spark-submit")
    if not first:
        return pipeline.reports
    with connect_server(venv_python, home) as connect:
        pipeline.cycle(venv_python, connect, "Spark Connect")
        slim = make_venv(python, wheel, home / "venv-connect", extra=None, home=home)
        listed = installed_distributions(slim, home)
        log(f"Python {python}, Connect-only install: pip list: {json.dumps(listed, sort_keys=True)}")
        if "pyspark" in listed or "pyspark-client" not in listed:
            raise InstalledCheckError(
                f"the Connect-only install should hold pyspark-client and no pyspark (a JVM Spark), holds "
                f"pyspark={listed.get('pyspark')}, pyspark-client={listed.get('pyspark-client')}"
            )
        if list((slim.parent.parent / "lib").glob("python*/site-packages/pyspark/jars")):
            raise InstalledCheckError("the Connect-only install holds pyspark/jars (a JVM Spark)")
        pipeline.cycle(slim, connect, "Spark Connect, Connect-only install")
        # The pure-Python wheel in its place: the extract's Python path, the provider still listed.
        pure = only_one(sorted(dist.glob(f"{PACKAGE}-*-py3-none-any.whl")), f"pure wheel in {dist}")
        pip = [sys.executable, "-m", "pip", "--python", str(slim)]
        run([*pip, "install", "--quiet", "--no-deps", "--force-reinstall", pure], env=clean_env(), cwd=home)
        slim_installed: list[str | os.PathLike[str]] = [slim, *installed[1:]]
        log(
            run([*slim_installed, "--pure", "--airflow-home", home / "airflow-pure"], env=clean_env(), cwd=home).strip()
        )
    return pipeline.reports


def only_one(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        raise InstalledCheckError(f"expected one {what}, found {[p.name for p in paths]}")
    return paths[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--python", action="append", choices=PYTHONS, help="only these (default: every declared one)")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where the wheels are (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    args = parser.parse_args(argv)
    pythons = args.python or list(PYTHONS)
    from pgdecode_testing.postgres_cluster import ThrowawayCluster

    reports: list[str] = []
    try:
        quick_start = read_quick_start()
        with ExitStack() as stack:
            work = Path(tempfile.mkdtemp(prefix="pgdecode-installed-"))
            if not args.keep:
                stack.callback(shutil.rmtree, work, ignore_errors=True)
            log(f"working in {work}")
            cluster = stack.enter_context(ThrowawayCluster())
            for python in pythons:
                reports += check_python(python, args.dist, cluster, quick_start, work, first=python == pythons[0])
    except InstalledCheckError as exc:
        print(f"check_installed: {exc}", file=sys.stderr)
        return 1
    for line in reports:
        log(line)
    log(f"done: the installed wheel ran {len(reports) // len(TABLES)} cycles on Python {', '.join(pythons)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
