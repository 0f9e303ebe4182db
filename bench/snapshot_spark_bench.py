"""Initial-load benchmark on Spark executors: the chunk copy's rows/s with 1, 2 and 4 executors.

    make bench-snapshot-spark   # or: .venv/bin/python -m bench.snapshot_spark_bench [--rows 1000000]

One run: one throwaway PostgreSQL cluster with one table of ``--rows`` rows (the mix of
bench/snapshot_bench.py), one slot created with an exported snapshot (held for the whole run), and
a local Spark standalone cluster started from pip's pyspark with ``spark-class`` (a master and one
worker of ``--worker-cores`` cores, all on 127.0.0.1). For each executor count N the driver (this
process) starts an application of N one-core executors (``spark.cores.max=N``), waits until all of
them registered (their start-up is not timed), then times :func:`stage_snapshot` with
``spark=session``: the chunk plan, one task per chunk (each importing the snapshot over its own
connection and writing its part into the shared local staging root), the records and the publish.
The threads' copy (``workers=1`` and the default) is timed too, on the same snapshot, for reference.

Prints rows/s and the ratio to one executor; writes bench/results/snapshot_spark_bench.json. The
PostgreSQL server, the driver and the executors share this machine's cores: on a machine with
fewer cores than executors plus the server's backends, the curve says more about the machine than
about the copy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from airflow_provider_pgdecode.capture.snapshot import (  # noqa: E402
    DEFAULT_SNAPSHOT_WORKERS,
    create_slot_with_snapshot,
    stage_snapshot,
)
from airflow_provider_pgdecode.spark.session import build_spark_session  # noqa: E402
from bench.snapshot_bench import SERVER_SETTINGS, TABLE, make_table  # noqa: E402
from pgdecode_testing.postgres_cluster import ThrowawayCluster  # noqa: E402
from pgdecode_testing.standalone_cluster import standalone_cluster  # noqa: E402

SLOT = "bench_snapshot_spark"
HOST = "127.0.0.1"


def session_with_executors(master: str, executors: int) -> Any:
    spark = build_spark_session(
        master,
        app_name=f"pgdecode-snapshot-bench-{executors}",
        extra_conf={
            "spark.cores.max": str(executors),
            "spark.executor.cores": "1",
            "spark.executor.memory": "1g",
            "spark.driver.host": HOST,
            "spark.ui.enabled": "false",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.monotonic() + 120
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 < executors:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{executors} executor(s) did not register in 120 s")
        time.sleep(0.5)
    # Each executor's Python worker started once (imports paid), before the timed copy.
    spark.sparkContext.parallelize(range(executors * 4), executors * 4).map(lambda x: x).collect()
    return spark


def timed(dsn: str, name: str, lsn: Any, staging: Path, chunk_rows: int, **kwargs: Any) -> tuple[int, float]:
    shutil.rmtree(staging, ignore_errors=True)
    started = time.perf_counter()
    manifest = stage_snapshot(dsn, name, lsn, SLOT, staging, [TABLE], chunk_rows=chunk_rows, **kwargs)
    elapsed = time.perf_counter() - started
    rows = sum(t.inserts for t in manifest.tables)
    shutil.rmtree(staging, ignore_errors=True)
    return rows, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--executors", default="1,2,4")
    parser.add_argument("--worker-cores", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counts = [int(n) for n in args.executors.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pgdecode-snapsparkbench-"))
    os.environ.setdefault("SPARK_LOCAL_IP", HOST)
    report: dict[str, Any] = {"rows": args.rows, "chunk_rows": args.chunk_rows, "cores": os.cpu_count()}
    try:
        with (
            ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster,
            standalone_cluster(work, HOST, cores=args.worker_cores, memory="6g") as (master, _ui),
        ):
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"table: {args.rows:,} rows ...", flush=True)
                make_table(conn, args.rows)
            report["master"] = master
            with create_slot_with_snapshot(dsn, SLOT) as (lsn, name):
                for workers in sorted({1, DEFAULT_SNAPSHOT_WORKERS}):
                    rows, elapsed = timed(dsn, name, lsn, work / "staging", args.chunk_rows, workers=workers)
                    report[f"threads_{workers}_rows_per_s"] = round(rows / elapsed)
                    print(f"  threads, workers={workers}: {rows:,} rows in {elapsed:.2f} s", flush=True)
                for executors in counts:
                    spark = session_with_executors(master, executors)
                    try:
                        rows, elapsed = timed(dsn, name, lsn, work / "staging", args.chunk_rows, spark=spark)
                    finally:
                        spark.stop()
                    report[f"spark_{executors}_rows_per_s"] = round(rows / elapsed)
                    print(f"  spark, {executors} executor(s): {rows:,} rows in {elapsed:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = report[f"spark_{counts[0]}_rows_per_s"]
    print(f"\nInitial load, chunk copy on a standalone Spark cluster ({report['cores']} cores here):")
    for key in [k for k in report if k.startswith("threads_")]:
        print(f"  {key.replace('_rows_per_s', ''):<14}: {report[key]:>10,} rows/s")
    for executors in counts:
        rate = report[f"spark_{executors}_rows_per_s"]
        report[f"spark_{executors}_ratio"] = round(rate / base, 2)
        print(f"  {executors} executor(s)  : {rate:>10,} rows/s  {rate / base:.2f}x one executor")
    out = Path(__file__).resolve().parent / "results" / "snapshot_spark_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
