"""Initial-load benchmark: the snapshot copy against a bare COPY, and the load into Delta.

    make bench-snapshot        # or: .venv/bin/python -m bench.snapshot_bench [--rows 2000000]

One run, one throwaway PostgreSQL cluster, one table of ``--rows`` rows with a realistic mix of
types (bigint key, text, numeric, timestamptz, boolean, jsonb, a nullable text), vacuumed and
analysed, and one slot created with an exported snapshot (held for the whole run):

1. floor:  ``COPY (SELECT * FROM t) TO STDOUT`` read fully by the client (psycopg 3
           ``cursor.copy``, data discarded): what any client pays to get the rows out (best of 2);
2. stage:  :func:`stage_snapshot` alone, to Parquet, with ``workers=1`` and with the default
           workers (``min(4, cores)``);
3. load:   the initial load into Delta: :func:`stage_snapshot` (default workers) followed by
           the Spark merge job (``merge_batches``, local[*]) creating the Delta table, both ways
           on the same staged batch: the snapshot's parts committed into the new table's log as
           staged (the default, spark/delta_commit.py), and read, checked and appended through
           Spark (``MergeOptions(snapshot_commit=False)``, the path before). The JVM's start-up
           (the SparkSession) is timed and printed apart, not included; a short warm-up (one small
           Parquet and Delta write) runs before, so that neither path pays the first-use JIT.
           The two tables are checked to be equal (rows, schema, properties, watermark).

Prints the rates (rows/s) and the ratios ours / COPY floor, and writes them to
bench/results/snapshot_bench.json. ``--profile`` also prints where a ``workers=1`` copy spends
its time (cProfile, top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
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
from pgdecode_testing.postgres_cluster import ThrowawayCluster  # noqa: E402

SLOT = "bench_snapshot"
TABLE = ("public", "orders")
SERVER_SETTINGS = {
    "shared_buffers": "1GB",
    "work_mem": "64MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "1h",
}


def make_table(conn: psycopg.Connection, rows: int) -> None:
    conn.execute(
        "create table orders (id bigint primary key, customer text not null, amount numeric(12,2),"
        " created timestamptz not null, paid boolean, attrs jsonb, note text)"
    )
    step = 500_000
    for start in range(1, rows + 1, step):
        stop = min(start + step - 1, rows)
        conn.execute(
            "insert into orders select g, 'customer ' || (g %% 99991), (g %% 1000000) / 100.0,"
            " timestamptz '2025-01-01' + g * interval '7 second', g %% 3 <> 0,"
            " jsonb_build_object('channel', case g %% 4 when 0 then 'web' when 1 then 'shop' else 'app' end,"
            "   'items', g %% 17, 'gift', g %% 11 = 0),"
            " case when g %% 5 = 0 then null else 'note ' || md5(g::text) end"
            " from generate_series(%s::bigint, %s::bigint) g",
            (start, stop),
        )
    conn.execute("vacuum (analyze, freeze) orders")


def copy_floor(dsn: str) -> tuple[int, float]:
    """Read the whole table through COPY TO STDOUT, discarding the data."""
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        size = 0
        with conn.cursor() as cur, cur.copy("COPY (SELECT * FROM orders) TO STDOUT") as copy:
            for block in copy:
                size += len(block)
        elapsed = time.perf_counter() - started
        rows = conn.execute("select count(*) from orders").fetchone()[0]
    print(f"  COPY floor: {rows:,} rows, {size / 2**20:,.0f} MiB of text, {elapsed:.2f} s", flush=True)
    return rows, elapsed


def timed_stage(dsn: str, name: str, lsn: Any, staging: Path, workers: int, profile: bool = False) -> tuple[Any, float]:
    shutil.rmtree(staging, ignore_errors=True)
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    manifest = stage_snapshot(dsn, name, lsn, SLOT, staging, [TABLE], workers=workers)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - started
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())
    return manifest, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, default=DEFAULT_SNAPSHOT_WORKERS, help="the 'default workers' run")
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--profile", action="store_true", help="cProfile the workers=1 copy")
    parser.add_argument("--skip-delta", action="store_true", help="no Spark: floor and stage-only rates")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("airflow_provider_pgdecode.capture.snapshot").setLevel(logging.INFO)

    work = Path(tempfile.mkdtemp(prefix="pgdecode-snapbench-"))
    report: dict[str, Any] = {"rows": args.rows, "cores": os.cpu_count(), "default_workers": args.workers}
    spark = None
    try:
        with ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"table: {args.rows:,} rows ...", flush=True)
                started = time.perf_counter()
                make_table(conn, args.rows)
                report["table_mib"] = round(conn.execute("select pg_table_size('orders')").fetchone()[0] / 2**20, 1)
                print(f"  built in {time.perf_counter() - started:.0f} s, {report['table_mib']} MiB", flush=True)
            with create_slot_with_snapshot(dsn, SLOT) as (lsn, name):
                print("timings:", flush=True)
                floor = min(copy_floor(dsn)[1] for _ in range(2))
                manifest, one = timed_stage(dsn, name, lsn, work / "stage-1", 1, args.profile)
                assert manifest.tables[0].inserts == args.rows, manifest.tables[0]
                print(f"  stage_snapshot workers=1: {one:.2f} s", flush=True)
                manifest, many = timed_stage(dsn, name, lsn, work / "stage-n", args.workers)
                assert manifest.tables[0].inserts == args.rows, manifest.tables[0]
                print(f"  stage_snapshot workers={args.workers}: {many:.2f} s", flush=True)
                report.update(
                    copy_floor_s=round(floor, 2),
                    copy_floor_rows_per_s=round(args.rows / floor),
                    stage_w1_s=round(one, 2),
                    stage_w1_rows_per_s=round(args.rows / one),
                    stage_default_s=round(many, 2),
                    stage_default_rows_per_s=round(args.rows / many),
                    stage_w1_over_floor=round(floor / one, 2),
                    stage_default_over_floor=round(floor / many, 2),
                    parts=len(manifest.tables[0].files),
                )
                if not args.skip_delta:
                    from airflow_provider_pgdecode.spark.merge_job import merge_batches
                    from airflow_provider_pgdecode.spark.session import build_spark_session

                    started = time.perf_counter()
                    spark = build_spark_session(
                        "local[*]",
                        app_name="pgdecode-snapshot-bench",
                        extra_conf={"spark.driver.memory": args.driver_memory},
                    )
                    spark.sparkContext.setLogLevel("ERROR")
                    # Warm-up: the first Parquet read and Delta write of a session load and JIT a
                    # lot of code (about 5 s here); neither contender should pay it.
                    warm = spark.range(100_000).selectExpr("id", "cast(id as string) as s")
                    warm.write.parquet(str(work / "warm-parquet"))
                    spark.read.parquet(str(work / "warm-parquet")).write.format("delta").save(str(work / "warm-delta"))
                    # and the first CREATE TABLE of a session (about 3 s here), which both paths make.
                    spark.sql(f"CREATE TABLE delta.`{work / 'warm-ddl'}` (id bigint NOT NULL) USING delta")
                    jvm = time.perf_counter() - started
                    print(f"  Spark session (JVM start-up and warm-up, not counted): {jvm:.2f} s", flush=True)
                    from airflow_provider_pgdecode.spark.merge_job import MergeOptions, app_id, read_delta_state

                    delta_root = str(work / "delta")
                    started = time.perf_counter()
                    manifest, stage = timed_stage(dsn, name, lsn, work / "stage-load", args.workers)
                    merge_started = time.perf_counter()
                    summary = merge_batches(spark, [str(manifest.path)], delta_root)
                    load = time.perf_counter() - started
                    merge = time.perf_counter() - merge_started
                    table = summary["tables"]["public.orders"]
                    assert table["status"] == "merged" and table["inserted"] == args.rows, table
                    print(
                        f"  initial load into Delta, parts committed as staged: stage {stage:.2f} s"
                        f" + merge job {merge:.2f} s = {load:.2f} s",
                        flush=True,
                    )
                    # The path before: the same staged batch read, checked and appended by Spark.
                    old_root = str(work / "delta-spark")
                    started = time.perf_counter()
                    summary = merge_batches(spark, [str(manifest.path)], old_root, MergeOptions(snapshot_commit=False))
                    old_merge = time.perf_counter() - started
                    table = summary["tables"]["public.orders"]
                    assert table["status"] == "merged" and table["inserted"] == args.rows, table
                    print(
                        f"  initial load into Delta, appended through Spark: stage {stage:.2f} s"
                        f" + merge job {old_merge:.2f} s = {stage + old_merge:.2f} s",
                        flush=True,
                    )
                    new = spark.read.format("delta").load(f"{delta_root}/public/orders")
                    old = spark.read.format("delta").load(f"{old_root}/public/orders")
                    assert new.count() == args.rows and new.exceptAll(old).count() == 0, "tables differ"
                    assert new.schema == old.schema, (new.schema, old.schema)
                    for root in (delta_root, old_root):
                        state = read_delta_state(spark, f"{root}/public/orders", app_id(SLOT))
                        assert state.watermark == int(lsn), state
                    report.update(
                        old_load_merge_s=round(old_merge, 2),
                        old_load_s=round(stage + old_merge, 2),
                        old_load_rows_per_s=round(args.rows / (stage + old_merge)),
                        old_load_over_floor=round(floor / (stage + old_merge), 2),
                    )
                    # Option (a) of the issue, measured: the same parts made a Delta table by
                    # CONVERT TO DELTA (statistics collected, which reads every file). Not usable as
                    # is (no column mapping, no properties, no txn, the staged columns kept).
                    convert_dir = work / "convert"
                    convert_dir.mkdir()
                    entry = manifest.tables[0]
                    for file in entry.snapshot_files or []:
                        os.link(Path(manifest.path) / entry.path / file, convert_dir / file)
                    started = time.perf_counter()
                    spark.sql(f"CONVERT TO DELTA parquet.`{convert_dir}`")
                    convert = time.perf_counter() - started
                    print(f"  CONVERT TO DELTA of the staged parts (statistics): {convert:.2f} s", flush=True)
                    report.update(convert_to_delta_s=round(convert, 2))
                    # Spark's own floor on these 2 cores: the staged Parquet written as a Delta
                    # table with nothing else (no checks, no types, no idempotence), warm JVM.
                    staged = [str(Path(manifest.path) / entry.path / f) for f in entry.snapshot_files or []]
                    started = time.perf_counter()
                    spark.read.parquet(*staged).write.format("delta").save(str(work / "bare"))
                    bare = time.perf_counter() - started
                    print(f"  bare Delta write of the staged Parquet: {bare:.2f} s", flush=True)
                    report.update(bare_delta_write_s=round(bare, 2), merge_over_bare_write=round(merge / bare, 2))
                    report.update(
                        spark_startup_s=round(jvm, 2),
                        load_stage_s=round(stage, 2),
                        load_merge_s=round(merge, 2),
                        load_s=round(load, 2),
                        load_rows_per_s=round(args.rows / load),
                        load_over_floor=round(floor / load, 2),
                    )
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    rows = args.rows
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]  # other work on the host skews rates
    print()
    print(
        f"== snapshot of {rows:,} rows ({report['table_mib']} MiB heap), {report['cores']} cores,"
        f" load average {report['load_average_at_end'][1]} (5 min)"
    )
    print(f"COPY floor (client reads COPY text)  : {report['copy_floor_rows_per_s']:>12,} rows/s")
    print(
        f"stage_snapshot, workers=1            : {report['stage_w1_rows_per_s']:>12,} rows/s"
        f"  ratio to floor {report['stage_w1_over_floor']:.2f}"
    )
    print(
        f"stage_snapshot, workers={args.workers:<2}           : {report['stage_default_rows_per_s']:>12,} rows/s"
        f"  ratio to floor {report['stage_default_over_floor']:.2f}"
    )
    if "load_rows_per_s" in report:
        print(
            f"initial load into Delta (stage+merge): {report['load_rows_per_s']:>12,} rows/s"
            f"  ratio to floor {report['load_over_floor']:.2f}"
            f"  (parts committed as staged; JVM start-up and warm-up {report['spark_startup_s']:.1f} s not counted)"
        )
        print(
            f"  the same through Spark (path before): {report['old_load_rows_per_s']:>12,} rows/s"
            f"  ratio to floor {report['old_load_over_floor']:.2f}"
            f"  (merge job {report['old_load_merge_s']:.1f} s against {report['load_merge_s']:.1f} s)"
        )
        print(
            f"merge job / bare Delta write of the same Parquet: {report['merge_over_bare_write']:.2f}"
            f"  ({report['load_merge_s']:.1f} s vs {report['bare_delta_write_s']:.1f} s)"
        )
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "snapshot_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
