"""Cycle benchmark: one CDC cycle through Airflow with spark-submit against a warm Spark Connect server.

    .venv/bin/python -m bench.cycle_bench [--changes 1000] [--rounds 3] [--samples 3] [--no-deployment]

One run, one throwaway PostgreSQL cluster, one Spark Connect server started by the bench
(``python -m airflow_provider_pgdecode.spark.connect_server``, stopped with SIGTERM at the end):

1. **Cycles.** Two ``test_decoding`` slots over the same tables (one per path), so both paths see
   the same WAL. Each round commits ``--changes`` changes (half inserts, 35% updates, 15% deletes,
   over two tables, in transactions of ten) and then runs ``pgdecode_incremental`` once per path
   with ``airflow dags test`` (a fresh process per cycle, as a worker's task process is; SQLite
   metadata database), its ``spark_conn_id`` naming a ``spark`` connection (``local[*]``,
   spark-submit, Delta's packages resolved from the Ivy cache as a default install does) or a
   ``spark_connect`` connection (the bench's server). The order of the two paths alternates per
   round. A cycle's time is the first task's start to the ``confirm`` task's end, from the task
   instances in Airflow's metadata database; the first round (the server's first session: JIT,
   jar and class loading) is reported apart from the warm ones (second and later).
2. **Merge step alone.** Each cycle's ``merge`` task duration, and :class:`PgDecodeMergeOperator`
   run outside Airflow on the last round's staged batch, twice per path, each time into a fresh
   copy of the Delta tables as they were before that round; ratio Connect / spark-submit.
3. **Commit to Delta** under ``pgdecode_event_driven`` (scheduled on the slot's Asset through
   ``SlotChangesEventTrigger``, the trigger polling every ``--poll-interval`` seconds) on a real
   deployment (:class:`AirflowDeployment`: scheduler, DAG processor, triggerer and API server as
   processes, this cluster as the metadata database, LocalExecutor), merging through the Connect
   server: one row committed, the Delta table (read with ``deltalake``) polled until it holds the
   row; the first commit (cold: the deployment's first run) apart, then the median of ``--samples``.

``--only-commit-latency`` runs part 3 alone (its own cluster and server) and adds it to the
results of an earlier full run. Delta is checked against PostgreSQL for both paths at the end. Prints the times and ratios and
writes bench/results/cycle-bench.json and cycle-bench.md. Aims (issue 14, reported, not
asserted): a warm cycle under 10 s and a warm merge step under 3 s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from pgdecode_testing.airflow_deployment import AirflowDeployment, free_port
from pgdecode_testing.connect_server import LocalConnectServer
from pgdecode_testing.postgres_cluster import ThrowawayCluster

REPO = Path(__file__).resolve().parent.parent
DAG_ID = "pgdecode_incremental"
SOURCE_DB = "cycle_source"
TABLES = ("cycle_customers", "cycle_orders")
PATHS = ("spark_submit", "spark_connect")
CONN_IDS = {"spark_submit": "bench_spark", "spark_connect": "bench_spark_connect"}
SLOTS = {"spark_submit": "bench_submit", "spark_connect": "bench_connect"}
TXN_SIZE = 10
EVENT_DB, EVENT_META_DB, EVENT_DAG, EVENT_SLOT, EVENT_TABLE = (
    "cycle_event_source",
    "cycle_event_airflow",
    "bench_event",
    "bench_event",
    "cycle_events",
)
EVENT_DAG_FILE = '''"""The airflow dag {dag_id}: pgdecode_event_driven's cycle on the benchmark's slot."""

from airflow_provider_pgdecode.example_dags.pgdecode_event_driven import event_driven_dag

dag = event_driven_dag({dag_id!r}, slot_name={slot!r}, poll_interval={poll!r}, data_dir={data_dir!r})
'''


# -- the workload ------------------------------------------------------------------------------


def create_source(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE cycle_customers (id int PRIMARY KEY, name text, tier text, updated timestamptz);"
        " CREATE TABLE cycle_orders (id bigint PRIMARY KEY, customer_id int, amount numeric(12,2), status text,"
        " created timestamptz)"
    )
    for slot in SLOTS.values():
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot,))


class Workload:
    """``changes`` single-row changes per round, in transactions of ten: per transaction five
    inserts (two customers, three orders), three or four updates and one or two deletes of rows
    alive at that point (also rows inserted earlier in the same round)."""

    def __init__(self, changes: int) -> None:
        self.txns = max(1, changes // TXN_SIZE)
        self.alive: dict[str, list[int]] = {t: [] for t in TABLES}
        self.next_id = {t: 1 for t in TABLES}
        self.tick = 0

    def _pick(self, table: str) -> int:
        alive = self.alive[table]
        self.tick += 1
        return alive[(self.tick * 7919) % len(alive)]

    def commit_round(self, conn: psycopg.Connection[Any]) -> int:
        changes = 0
        for n in range(self.txns):
            with conn.transaction():
                for table, count in (("cycle_customers", 2), ("cycle_orders", 3)):
                    for _ in range(count):
                        key = self.next_id[table]
                        self.next_id[table] += 1
                        if table == "cycle_customers":
                            conn.execute(
                                "INSERT INTO cycle_customers VALUES (%s, %s, 'basic', now())", (key, f"customer {key}")
                            )
                        else:
                            conn.execute(
                                "INSERT INTO cycle_orders VALUES (%s, %s, %s, 'new', now())",
                                (key, 1 + key % max(1, self.next_id["cycle_customers"] - 1), key % 10_000 / 100),
                            )
                        self.alive[table].append(key)
                        changes += 1
                conn.execute(
                    "UPDATE cycle_customers SET tier = 'gold', updated = now() WHERE id = %s",
                    (self._pick("cycle_customers"),),
                )
                for _ in range(3 if n % 2 == 0 else 2):
                    conn.execute(
                        "UPDATE cycle_orders SET status = 'paid', amount = amount + 1 WHERE id = %s",
                        (self._pick("cycle_orders"),),
                    )
                changes += 4 if n % 2 == 0 else 3
                for _ in range(1 if n % 2 == 0 else 2):
                    table = (
                        "cycle_customers"
                        if (self.tick % 5 == 0 and len(self.alive["cycle_customers"]) > 1)
                        else "cycle_orders"
                    )
                    key = self._pick(table)
                    self.alive[table].remove(key)
                    conn.execute(f"DELETE FROM {table} WHERE id = %s", (key,))
                    changes += 1
        return changes


# -- the Spark Connect server ------------------------------------------------------------------


@contextmanager
def connect_server(port: int, log_path: Path) -> Iterator[str]:
    """``python -m airflow_provider_pgdecode.spark.connect_server --port N`` until its ready line;
    stopped with SIGTERM on the way out."""
    started = time.perf_counter()
    with LocalConnectServer(port=port, master="local[*]", log_path=log_path) as server:
        print(f"  Spark Connect server ready on port {port} in {time.perf_counter() - started:.1f} s", flush=True)
        yield server.url


# -- part 1: cycles through `airflow dags test` -------------------------------------------------


class DagsTest:
    """``airflow dags test pgdecode_incremental`` in a home of its own (SQLite metadata database)."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.db = home / "airflow.db"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        self.env.update(
            {
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db}",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                **env,
            }
        )
        self.airflow = str(Path(sys.executable).parent / "airflow")

    def cli(self, *args: str, log: Path | None = None) -> None:
        done = subprocess.run(
            [self.airflow, *args],
            env=self.env,
            cwd=str(self.home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=900,
        )
        if log is not None:
            log.write_text(done.stdout)
        if done.returncode != 0:
            raise RuntimeError(f"`airflow {' '.join(args[:2])}` failed ({done.returncode}):\n{done.stdout[-4000:]}")

    def run_cycle(self, conf: dict[str, Any], log: Path) -> dict[str, Any]:
        """One DAG run; its task instances' times (seconds from the first task's start)."""
        self.cli("dags", "test", DAG_ID, "-c", json.dumps(conf), log=log)
        import sqlite3

        with sqlite3.connect(self.db) as db:
            (run_id, state) = db.execute(
                "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (DAG_ID,)
            ).fetchone()
            rows = db.execute(
                "SELECT task_id, state, start_date, end_date FROM task_instance WHERE dag_id = ? AND run_id = ?",
                (DAG_ID, run_id),
            ).fetchall()
        tasks = {task: (state_, _when(start), _when(end)) for task, state_, start, end in rows}
        bad = {t: s for t, (s, _, _) in tasks.items() if s != "success"}
        if state != "success" or bad:
            raise RuntimeError(f"run {run_id} ended {state}, tasks {bad}; its output: {log}")
        first = min(start for _, start, _ in tasks.values())
        return {
            "run_id": run_id,
            "cycle_s": round(tasks["confirm"][2] - first, 2),
            "tasks": {
                t: {"start_s": round(s - first, 2), "duration_s": round(e - s, 2)}
                for t, (_, s, e) in sorted(tasks.items(), key=lambda kv: kv[1][1])
            },
        }


def _when(value: Any) -> float:
    """A metadata timestamp (datetime, or SQLite's text) as epoch seconds."""
    if isinstance(value, datetime):
        return value.timestamp()
    text = str(value).replace(" ", "T")
    return datetime.fromisoformat(text if ("+" in text[10:] or text.endswith("Z")) else text + "+00:00").timestamp()


def latest_batch(staging: Path, slot: str) -> str:
    batches = sorted(p for p in (staging / slot).iterdir() if (p / "manifest.json").is_file())
    return str(batches[-1])


def merge_alone(conn_id: str, batch: str, before: Path, target: Path, env: dict[str, str]) -> float:
    """:class:`PgDecodeMergeOperator` outside Airflow, in a fresh process (as a task's own process:
    a Connect session sets ``SPARK_CONNECT_MODE_ENABLED`` in its process's environment, which a later
    spark-submit from that process would inherit): ``batch`` into a fresh copy of ``before``."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(before, target)
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bench.cycle_bench", "--merge-alone", json.dumps([conn_id, batch, str(target)])],
        env=child_env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(f"the merge of {batch} into {target} failed:\n{done.stdout[-4000:]}")
    return float(json.loads(last)["seconds"])


def _merge_alone_child(spec: str) -> int:
    """The child of :func:`merge_alone`: time ``execute`` of the operator, print it as JSON."""
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

    conn_id, batch, target = json.loads(spec)
    operator = PgDecodeMergeOperator(task_id="merge", batch_paths=[batch], delta_root=target, conn_id=conn_id)
    started = time.perf_counter()
    result = operator.execute({})
    elapsed = time.perf_counter() - started
    tables = (result.get("summary") or {}).get("tables") or {}
    merged = [t for t in tables.values() if isinstance(t, dict) and t.get("status") == "merged"]
    if len(merged) != len(TABLES):
        print(f"the merge merged {len(merged)} tables: {result}")
        return 1
    print(json.dumps({"seconds": elapsed}))
    return 0


# -- part 3: commit -> Delta under the event-driven DAG ----------------------------------------


def delta_has(path: Path, key: int) -> bool:
    """Whether the Delta table at ``path`` holds row ``key`` (read by delta-rs; its SQL engine reads
    the deletion vectors and column mapping the merge's tables use)."""
    from deltalake import DeltaTable, QueryBuilder

    try:
        table = DeltaTable(str(path))
    except Exception:  # not created yet
        return False
    found = QueryBuilder().register("t", table).execute(f"SELECT count(*) AS n FROM t WHERE id = {int(key)}")
    return bool(found.read_all()[0][0].as_py() > 0)


def event_latency(cluster: ThrowawayCluster, work: Path, url: str, samples: int, poll: float) -> dict[str, Any]:
    root = work / "deployment"
    data_dir, dags = root / "data", root / "dags"
    dags.mkdir(parents=True)
    (dags / f"{EVENT_DAG}.py").write_text(
        EVENT_DAG_FILE.format(dag_id=EVENT_DAG, slot=EVENT_SLOT, poll=poll, data_dir=str(data_dir)), encoding="utf-8"
    )
    cluster.create_database(EVENT_DB)
    cluster.create_database(EVENT_META_DB)
    with cluster.connect(EVENT_DB) as conn:
        conn.execute(f"CREATE TABLE {EVENT_TABLE} (id int PRIMARY KEY, note text, at timestamptz)")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (EVENT_SLOT,))
    host, port = url.removeprefix("sc://").split(":")
    env = {
        "AIRFLOW_CONN_PGDECODE_DEFAULT": cluster.airflow_conn_json(EVENT_DB),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)}),
        "AIRFLOW__PGDECODE__DATA_DIR": str(data_dir),
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    airflow = AirflowDeployment(
        root / "airflow",
        metadata_dsn=f"postgresql+psycopg2://{cluster.user}@{cluster.host}:{cluster.port}/{EVENT_META_DB}",
        dags_folder=dags,
        env=env,
        parallelism=3,
    )
    table_path = data_dir / "delta" / "public" / EVENT_TABLE

    def meta(query: str, *params: Any) -> list[tuple[Any, ...]]:
        with cluster.connect(EVENT_META_DB) as conn:
            return conn.execute(query, params).fetchall()

    started = time.perf_counter()
    with airflow:
        airflow.wait_for(
            lambda: meta("SELECT dag_id FROM dag WHERE dag_id = %s AND NOT is_stale", EVENT_DAG),
            timeout=240,
            what=f"the DAG processor to store {EVENT_DAG}",
            tails=("dag-processor",),
        )
        airflow.cli("dags", "unpause", EVENT_DAG)
        airflow.wait_for(
            lambda: meta(
                "SELECT id FROM trigger WHERE classpath LIKE %s AND triggerer_id IS NOT NULL",
                "%.SlotChangesEventTrigger",
            ),
            timeout=180,
            what="the triggerer to run the slot's event trigger",
            tails=("dag-processor", "triggerer"),
        )
        print(f"  deployment up, trigger running, in {time.perf_counter() - started:.0f} s", flush=True)
        measured: list[dict[str, Any]] = []
        for key in range(1, samples + 2):
            with cluster.connect(EVENT_DB) as conn:
                conn.execute(f"INSERT INTO {EVENT_TABLE} VALUES (%s, 'sample', now())", (key,))
                committed = time.time()
            airflow.wait_for(
                functools.partial(delta_has, table_path, key),
                timeout=600,
                what=f"row {key} in {table_path}",
                interval=0.2,
                tails=("scheduler", "triggerer"),
            )
            latency = time.time() - committed

            def finished(key: int = key) -> list[tuple[Any, ...]] | None:
                rows = meta(
                    "SELECT run_id, state, queued_at, start_date, end_date FROM dag_run WHERE dag_id = %s ORDER BY id",
                    EVENT_DAG,
                )
                failed = [r for r in rows if r[1] == "failed"]
                if failed:
                    raise RuntimeError(f"{EVENT_DAG}: failed run(s) {failed}")
                done = [r for r in rows if r[1] == "success"]
                return done if len(done) >= key else None

            runs = airflow.wait_for(finished, timeout=600, what=f"run {key} of {EVENT_DAG} to finish", interval=0.5)
            assert runs is not None  # wait_for returns a true value
            run_id, _, queued, run_start, _ = runs[key - 1]
            queued = queued or run_start  # queued_at is set for triggered runs; the start otherwise
            tasks = meta(
                "SELECT task_id, start_date, end_date FROM task_instance WHERE dag_id = %s AND run_id = %s"
                " ORDER BY start_date",
                EVENT_DAG,
                run_id,
            )
            merge_end = next(end for task, _, end in tasks if task == "merge").timestamp()
            sample = {
                "commit_to_delta_s": round(latency, 2),
                "commit_to_run_queued_s": round(queued.timestamp() - committed, 2),
                "run_queued_to_first_task_s": round(min(s for _, s, _ in tasks).timestamp() - queued.timestamp(), 2),
                "first_task_to_merge_end_s": round(merge_end - min(s for _, s, _ in tasks).timestamp(), 2),
                "run_start_s_after_commit": round(run_start.timestamp() - committed, 2),
                "tasks": {task: round((end - start).total_seconds(), 2) for task, start, end in tasks},
            }
            label = "cold (first run)" if key == 1 else f"sample {key - 1}"
            print(
                f"  commit -> Delta, {label:<17} {latency:7.2f} s   (commit -> run queued "
                f"{sample['commit_to_run_queued_s']:.2f} s, queued -> first task {sample['run_queued_to_first_task_s']:.2f} s, "
                f"first task -> merge end {sample['first_task_to_merge_end_s']:.2f} s)",
                flush=True,
            )
            measured.append(sample)
            time.sleep(1)  # the trigger's next poll sees the confirmed slot, not the run's changes
        airflow.cli("dags", "pause", EVENT_DAG)
    warm = [s["commit_to_delta_s"] for s in measured[1:]]
    return {
        "poll_interval_s": poll,
        "cold": measured[0],
        "samples": measured[1:],
        "commit_to_delta_median_s": round(statistics.median(warm), 2),
    }


# -- the run -----------------------------------------------------------------------------------


def after_first_task(cycle: dict[str, Any]) -> float:
    """The cycle from the end of its first task (``ensure_slot``) to the end of ``confirm``."""
    first = min(cycle["tasks"].values(), key=lambda t: t["start_s"])
    return round(cycle["cycle_s"] - first["start_s"] - first["duration_s"], 2)


def summarise(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    first, warm = cycles[0], cycles[1:]
    return {
        "first_cycle_s": first["cycle_s"],
        "first_merge_s": first["tasks"]["merge"]["duration_s"],
        "warm_cycles_s": [c["cycle_s"] for c in warm],
        # ensure_slot, the first task of a `dags test` process, also pays that process's in-process
        # execution API start-up (seconds, not the task's own work): the cycle without it.
        "warm_cycles_after_first_task_s": [after_first_task(c) for c in warm],
        "warm_cycle_after_first_task_median_s": round(statistics.median(after_first_task(c) for c in warm), 2),
        "warm_cycle_median_s": round(statistics.median(c["cycle_s"] for c in warm), 2),
        "warm_merge_tasks_s": [c["tasks"]["merge"]["duration_s"] for c in warm],
        "warm_merge_task_median_s": round(statistics.median(c["tasks"]["merge"]["duration_s"] for c in warm), 2),
    }


def markdown(report: dict[str, Any]) -> str:
    sub, con = report["paths"]["spark_submit"], report["paths"]["spark_connect"]
    lines = [
        "# Cycle benchmark (`make bench-cycle`)",
        "",
        f"{report['changes']:,} changes per cycle over two tables, {report['rounds']} rounds, "
        f"{report['cores']} cores, measured {report['measured_at']} (load average at the start "
        f"{report['load_average_at_start']}, after the cycles {report.get('load_average_after_cycles')}: "
        "the machine was shared). Seconds.",
        "",
        "| | spark-submit | Spark Connect | Connect / spark-submit |",
        "|---|---:|---:|---:|",
        f"| first cycle (first task start to confirm end) | {sub['first_cycle_s']} | {con['first_cycle_s']} | "
        f"{report['ratios']['first_cycle']} |",
        f"| warm cycle, median of {len(sub['warm_cycles_s'])} | {sub['warm_cycle_median_s']} | "
        f"{con['warm_cycle_median_s']} | {report['ratios']['warm_cycle']} |",
        f"| warm cycle from the end of ensure_slot (without `dags test`'s start-up in it), median | "
        f"{sub['warm_cycle_after_first_task_median_s']} | {con['warm_cycle_after_first_task_median_s']} | "
        f"{round(con['warm_cycle_after_first_task_median_s'] / sub['warm_cycle_after_first_task_median_s'], 2)} |",
        f"| merge task, first cycle | {sub['first_merge_s']} | {con['first_merge_s']} | |",
        f"| merge task, warm median | {sub['warm_merge_task_median_s']} | {con['warm_merge_task_median_s']} | "
        f"{report['ratios']['warm_merge_task']} |",
        f"| merge operator alone, same batch, best of {len(sub['merge_alone_s'])} | {min(sub['merge_alone_s'])} | "
        f"{min(con['merge_alone_s'])} | {report['ratios']['merge_alone']} |",
        "",
        "Aims (issue 14): warm cycle under 10 s, warm merge step under 3 s (Spark Connect).",
        "",
        "Per-task durations of each cycle (`task: start offset + duration`):",
        "",
    ]
    for path in PATHS:
        for n, cycle in enumerate(report["cycles"][path]):
            tasks = ", ".join(f"{t} {v['start_s']}+{v['duration_s']}" for t, v in cycle["tasks"].items())
            lines.append(f"- {path} round {n}: {cycle['cycle_s']} s: {tasks}")
    event = report.get("event_driven")
    if event:
        lines += [
            "",
            f"Commit to Delta under `pgdecode_event_driven` (real deployment, Spark Connect, trigger poll "
            f"{event['poll_interval_s']} s{', measured ' + event['measured_at'] if 'measured_at' in event else ''}): "
            f"median {event['commit_to_delta_median_s']} s of "
            f"{[s['commit_to_delta_s'] for s in event['samples']]}; cold first run {event['cold']['commit_to_delta_s']} s.",
        ]
        for sample in event["samples"]:
            lines.append(
                f"- {sample['commit_to_delta_s']} s: commit -> run queued {sample['commit_to_run_queued_s']}, queued -> "
                f"first task {sample['run_queued_to_first_task_s']}, first task -> merge end "
                f"{sample['first_task_to_merge_end_s']}; tasks {sample['tasks']}"
            )
    elif report.get("event_driven_skipped"):
        lines += ["", f"Commit to Delta: not measured ({report['event_driven_skipped']})."]
    return "\n".join(lines) + "\n"


def commit_latency_only(args: argparse.Namespace) -> int:
    """Part 3 alone (its own cluster and Connect server), added to the results of a full run."""
    results = REPO / "bench" / "results" / "cycle-bench.json"
    report = json.loads(results.read_text())
    work = Path(args.work) / "commit-latency"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report.pop("event_driven_skipped", None)
    for path in PATHS:  # the summaries as this version of the bench makes them
        report["paths"][path].update(summarise(report["cycles"][path]))
    with ThrowawayCluster() as cluster, connect_server(free_port(), work / "connect-server.log") as url:
        report["event_driven"] = event_latency(cluster, work, url, args.samples, args.poll_interval)
    report["event_driven"]["measured_at"] = datetime.now().astimezone().isoformat(timespec="seconds")
    report["event_driven"]["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
    print(f"commit -> Delta (event-driven, Connect): median {report['event_driven']['commit_to_delta_median_s']:.2f} s")
    print(f"written: {', '.join(write_results(report))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--changes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="cycles per path (at least 2: the first is cold)")
    parser.add_argument("--samples", type=int, default=3, help="commit -> Delta samples after the cold one")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="the event trigger's poll interval")
    parser.add_argument("--no-deployment", action="store_true", help="skip part 3 (commit -> Delta)")
    parser.add_argument("--work", default=str(REPO / "bench" / ".work" / "cycle"))
    parser.add_argument("--merge-alone", help=argparse.SUPPRESS)  # the child of merge_alone()
    parser.add_argument(
        "--only-commit-latency",
        action="store_true",
        help="only part 3, added to the existing bench/results/cycle-bench.json",
    )
    args = parser.parse_args(argv)
    if args.merge_alone:
        return _merge_alone_child(args.merge_alone)
    if args.only_commit_latency:
        return commit_latency_only(args)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first cycle is reported apart)")

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    port = free_port()
    report: dict[str, Any] = {
        "changes": args.changes,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "measured_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_at_start": [round(x, 1) for x in os.getloadavg()],
    }
    connect_json = json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": port})
    spark_json = json.dumps({"conn_type": "spark", "host": "local[*]"})
    with ThrowawayCluster() as cluster:
        cluster.create_database(SOURCE_DB)
        with cluster.connect(SOURCE_DB) as conn:
            create_source(conn)
        env = {
            "AIRFLOW_CONN_PGDECODE_DEFAULT": cluster.airflow_conn_json(SOURCE_DB),
            f"AIRFLOW_CONN_{CONN_IDS['spark_submit'].upper()}": spark_json,
            f"AIRFLOW_CONN_{CONN_IDS['spark_connect'].upper()}": connect_json,
            "AIRFLOW__PGDECODE__WAIT_SECONDS": "60",
            "SPARK_LOCAL_IP": "127.0.0.1",
        }
        home = work / "airflow"
        home.mkdir()
        dags_test = DagsTest(home, env)
        print("migrating the metadata database (SQLite) and starting the Spark Connect server", flush=True)
        dags_test.cli("db", "migrate", log=work / "logs" / "db-migrate.log")
        with connect_server(port, work / "logs" / "connect-server.log") as url:
            workload = Workload(args.changes)
            cycles: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
            before_last: dict[str, Path] = {}
            print("cycles (first task start to confirm end):", flush=True)
            for n in range(args.rounds):
                if n == args.rounds - 1:  # the Delta tables before the last round, for the merge alone
                    for path in PATHS:
                        before_last[path] = work / "before-last" / path
                        shutil.copytree(work / path / "delta", before_last[path])
                with cluster.connect(SOURCE_DB) as conn:
                    changes = workload.commit_round(conn)
                for path in PATHS if n % 2 == 0 else tuple(reversed(PATHS)):
                    conf = {
                        "slot_name": SLOTS[path],
                        "plugin": "test_decoding",
                        "tables": [f"public.{t}" for t in TABLES],
                        "staging_uri": str(work / path / "staging"),
                        "delta_root": str(work / path / "delta"),
                        "spark_conn_id": CONN_IDS[path],
                    }
                    cycle = dags_test.run_cycle(conf, work / "logs" / f"cycle-{path}-{n}.log")
                    cycles[path].append(cycle)
                    tasks = "  ".join(f"{t} {v['duration_s']:.1f}" for t, v in cycle["tasks"].items())
                    label = f"round {n} ({'first' if n == 0 else 'warm'}), {path}, {changes} changes"
                    print(f"  {label:<46} {cycle['cycle_s']:7.2f} s   [{tasks}]", flush=True)

            print("merge operator alone, last round's batch, fresh copies of the tables before it:", flush=True)
            batch = latest_batch(work / "spark_submit" / "staging", SLOTS["spark_submit"])
            alone: dict[str, list[float]] = {p: [] for p in PATHS}
            for rep in range(2):
                for path in PATHS:
                    elapsed = merge_alone(
                        CONN_IDS[path], batch, before_last["spark_submit"], work / "alone" / f"{path}-{rep}", env
                    )
                    alone[path].append(round(elapsed, 2))
                    print(f"  {path:<14} run {rep + 1}  {elapsed:7.2f} s", flush=True)

            print("checking Delta against PostgreSQL", flush=True)
            from airflow_provider_pgdecode.spark.session import build_connect_session
            from pgdecode_testing.compare import compare_table

            spark = build_connect_session(url)
            try:
                with cluster.connect(SOURCE_DB) as conn:
                    for path in PATHS:
                        for table in TABLES:
                            result = compare_table(conn, spark, str(work / path / "delta"), "public", table)
                            if not result.equal:
                                raise RuntimeError(f"{path}: {result.describe()}")
            finally:
                spark.stop()

            paths = {p: {**summarise(cycles[p]), "merge_alone_s": alone[p]} for p in PATHS}
            sub, con = paths["spark_submit"], paths["spark_connect"]
            report.update(
                {
                    "paths": paths,
                    "ratios": {
                        "first_cycle": round(con["first_cycle_s"] / sub["first_cycle_s"], 2),
                        "warm_cycle": round(con["warm_cycle_median_s"] / sub["warm_cycle_median_s"], 2),
                        "warm_merge_task": round(con["warm_merge_task_median_s"] / sub["warm_merge_task_median_s"], 2),
                        "merge_alone": round(min(con["merge_alone_s"]) / min(sub["merge_alone_s"]), 2),
                    },
                    "cycles": cycles,
                }
            )

            report["load_average_after_cycles"] = [round(x, 1) for x in os.getloadavg()]
            write_results(report)  # parts 1 and 2, whatever becomes of part 3
            if args.no_deployment:
                report["event_driven_skipped"] = "--no-deployment"
            else:
                print("commit -> Delta under the event-driven DAG on a real deployment (Spark Connect):", flush=True)
                try:
                    report["event_driven"] = event_latency(cluster, work, url, args.samples, args.poll_interval)
                except Exception as error:  # parts 1 and 2 stand; say what stopped part 3
                    report["event_driven_skipped"] = f"{type(error).__name__}: {str(error)[:3000]}"
                    print(f"  not measured: {report['event_driven_skipped']}", flush=True)

    ratios = report["ratios"]
    print(
        f"warm cycle: spark-submit {sub['warm_cycle_median_s']:.2f} s, Spark Connect {con['warm_cycle_median_s']:.2f} s"
        f" (ratio {ratios['warm_cycle']:.2f}; aim under 10 s)"
    )
    print(
        f"merge step, warm: task {sub['warm_merge_task_median_s']:.2f} s vs {con['warm_merge_task_median_s']:.2f} s "
        f"(ratio {ratios['warm_merge_task']:.2f}); operator alone {min(sub['merge_alone_s']):.2f} s vs "
        f"{min(con['merge_alone_s']):.2f} s (ratio {ratios['merge_alone']:.2f}; aim under 3 s)"
    )
    if "event_driven" in report:
        print(
            f"commit -> Delta (event-driven, Connect): median {report['event_driven']['commit_to_delta_median_s']:.2f} s"
        )
    report["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
    print(f"written: {', '.join(write_results(report))}")
    return 0


def write_results(report: dict[str, Any]) -> list[str]:
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "cycle-bench.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "cycle-bench.md").write_text(markdown(report))
    return [str(out / "cycle-bench.json"), str(out / "cycle-bench.md")]


if __name__ == "__main__":
    sys.exit(main())
