"""Extract benchmark: our extract to staged Parquet against a raw slot decode of the same data.

In one run, on one throwaway PostgreSQL cluster and one 500,000-change workload:

1. raw:     ``select count(*) from pg_logical_slot_peek_changes(slot, ceiling, NULL, <options>)``
2. extract: :func:`extract_batch` over the same slot and ceiling, to Parquet,
            in a child process so its peak memory (max RSS) is its own;
3. extract of the first fifth of the range, to show peak memory does not grow with batch size.

Prints both rates, their ratio, and the peak memory of both extracts. Usage::

    make bench-extract            # or: .venv/bin/python -m bench.extract_bench --changes 500000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.test_decoding import DEFAULT_OPTIONS
from airflow_provider_pgdecode.testing.postgres_cluster import ThrowawayCluster

SLOT = "bench_extract"
# Decoding of a 500k-change workload should not spill to disk in either run.
SERVER_SETTINGS = {
    "logical_decoding_work_mem": "1GB",
    "shared_buffers": "1GB",
    "work_mem": "256MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "1h",
}


def make_workload(conn: psycopg.Connection, changes: int, txn_size: int) -> None:
    """Inserts (80%), updates (10%) and deletes (10%) in transactions of ``txn_size`` changes."""
    conn.execute(
        "create table orders (id bigint primary key, customer text not null, amount numeric(12,2),"
        " status text, created timestamptz, paid boolean, tags text[])"
    )
    conn.execute(
        "select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (SLOT,)
    )
    inserts = changes * 8 // 10
    updates = changes // 10
    deletes = changes - inserts - updates
    for start in range(0, inserts, txn_size):
        stop = min(start + txn_size, inserts)
        conn.execute(
            "insert into orders select g, 'customer ' || (g %% 997), (g %% 100000) / 100.0, 'new',"
            " timestamptz '2026-01-01' + g * interval '1 second', g %% 2 = 0, array['a', 'b''' || g]"
            " from generate_series(%s::bigint, %s::bigint) g",
            (start + 1, stop),
        )
    for start in range(0, updates, txn_size):
        stop = min(start + txn_size, updates)
        conn.execute("update orders set status = 'paid', paid = true where id between %s and %s", (start + 1, stop))
    for start in range(0, deletes, txn_size):
        stop = min(start + txn_size, deletes)
        conn.execute("delete from orders where id between %s and %s", (inserts - stop + 1, inserts - start))


def raw_decode(conn: psycopg.Connection, ceiling: Lsn) -> tuple[int, float]:
    options = [v for pair in DEFAULT_OPTIONS for v in pair]
    started = time.perf_counter()
    rows = conn.execute(
        "select count(*) from pg_logical_slot_peek_changes(%s, %s::pg_lsn, NULL, variadic %s::text[])",
        (SLOT, str(ceiling), options),
    ).fetchone()[0]
    return rows, time.perf_counter() - started


def extract_in_child(dsn: str, ceiling: Lsn, staging: Path) -> dict:
    """Run the extract in a fresh interpreter; return its timing and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.extract_bench", "--child", dsn, str(ceiling), str(staging)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(dsn: str, ceiling: str, staging: str) -> None:
    from airflow_provider_pgdecode.staging.extract import extract_batch

    with psycopg.connect(dsn, autocommit=True) as conn:
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        manifest = extract_batch(conn, SLOT, staging, upto_lsn=Lsn.parse(ceiling))
        elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "rows": manifest.skipped["rows_read"],
                "changes": manifest.changes,
                "transactions": manifest.transactions,
                "peak_rss_mib": peak / 1024,
                "rss_before_mib": base_rss / 1024,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=500_000)
    parser.add_argument("--txn-size", type=int, default=1_000)
    parser.add_argument("--child", nargs=3, metavar=("DSN", "CEILING", "STAGING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0

    work = Path(tempfile.mkdtemp(prefix="pgdecode-bench-"))
    try:
        with ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"workload: {args.changes} changes in transactions of {args.txn_size} ...", flush=True)
                make_workload(conn, args.changes, args.txn_size)
                ceiling = Lsn.parse(str(conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
                first_fifth = Lsn.parse(
                    str(
                        conn.execute(
                            "select lsn from pg_logical_slot_peek_changes(%s, %s::pg_lsn, NULL) where data like 'COMMIT%%'"
                            " offset %s limit 1",
                            (SLOT, str(ceiling), max(args.changes // args.txn_size // 5 - 1, 0)),
                        ).fetchone()[0]
                    )
                )
                raw_decode(conn, ceiling)  # warm the caches for both contenders
                raw_rows, raw_seconds = raw_decode(conn, ceiling)
            full = extract_in_child(dsn, ceiling, work / "full")
            fifth = extract_in_child(dsn, first_fifth, work / "fifth")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw_rate = raw_rows / raw_seconds
    ours_rate = full["rows"] / full["seconds"]
    print()
    print(f"rows decoded (changes + BEGIN/COMMIT): raw {raw_rows}, extract {full['rows']} (changes staged: {full['changes']})")
    print(f"raw slot decode   : {raw_seconds:8.2f} s  {raw_rate:12,.0f} rows/s")
    print(f"extract to Parquet: {full['seconds']:8.2f} s  {ours_rate:12,.0f} rows/s")
    print(f"ratio extract/raw rate: {ours_rate / raw_rate:.2f}  (aim: >= 0.5)")
    print(
        f"extract peak RSS: {full['peak_rss_mib']:.0f} MiB for {full['rows']} rows; "
        f"{fifth['peak_rss_mib']:.0f} MiB for {fifth['rows']} rows (first fifth of the range); "
        f"interpreter+imports before extracting: {full['rss_before_mib']:.0f} MiB"
    )
    if raw_rows != full["rows"]:
        print("WARNING: raw and extract read different row counts", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
