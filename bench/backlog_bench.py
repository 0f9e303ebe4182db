"""Backlog benchmark: a large backlog drained in bounded batches, against one raw decode of it.

In one run, on one throwaway PostgreSQL cluster and one ``--changes`` workload (default 5,000,000:
80% inserts, 10% updates, 10% deletes, in transactions of ``--txn-size``), for each output plugin:

1. raw:   ``select count(*)`` of one ``pg_logical_slot_peek_changes`` over the whole backlog
          (``peek_binary_changes`` for pgoutput), with the extract's options;
2. drain: in a child process (so its peak memory is its own), :func:`extract_batch` with
          ``BatchBounds(max_changes=--bound)`` and a confirm (``pg_replication_slot_advance``)
          after each batch, until a batch reaches the ceiling: the extract and confirm half of
          the DAG's drain loop (the merge is measured by bench-merge).

Prints the batches, the largest batch, the drain's rate against the raw decode (the ratio), and
the drain's peak memory (max RSS of the child, and before its first batch); writes them to
bench/results/backlog_bench.json. Usage::

    make bench-backlog            # or: .venv/bin/python -m bench.backlog_bench --changes 5000000
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from airflow_provider_pgdecode.decoding.lsn import Lsn
from bench.extract_bench import PUBLICATION, SERVER_SETTINGS, SLOTS, make_workload, raw_decode
from pgdecode_testing.postgres_cluster import ThrowawayCluster

REPO = Path(__file__).resolve().parent.parent


def drain_in_child(dsn: str, plugin: str, staging: Path, bound: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.backlog_bench", "--child", dsn, plugin, str(staging), str(bound)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(dsn: str, plugin: str, staging: str, bound: str) -> None:
    from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
    from airflow_provider_pgdecode.capture.bounds import BatchBounds
    from airflow_provider_pgdecode.capture.extract import extract_batch

    bounds = BatchBounds(max_changes=int(bound), max_wal_bytes=None)
    publication = PUBLICATION if plugin == "pgoutput" else None
    batches: list[dict] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        checkpoint = None
        started = time.perf_counter()
        while True:
            began = time.perf_counter()
            manifest = extract_batch(
                conn,
                SLOTS[plugin],
                staging,
                plugin=plugin,
                publication=publication,
                checkpoint=checkpoint,
                bounds=bounds,
            )
            conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (SLOTS[plugin], manifest.end_lsn))
            checkpoint = Checkpoint.from_manifest(manifest)
            batches.append(
                {
                    "changes": manifest.changes,
                    "seconds": time.perf_counter() - began,
                    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                }
            )
            shutil.rmtree(str(manifest.path), ignore_errors=True)  # staging space is not what is measured
            if manifest.bounded_by is None:
                break
        elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "batches": batches,
                "changes": sum(b["changes"] for b in batches),
                "peak_rss_mib": peak / 1024,
                "rss_before_mib": base_rss / 1024,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=5_000_000)
    parser.add_argument("--txn-size", type=int, default=1_000)
    parser.add_argument("--bound", type=int, default=1_000_000, help="max_batch_changes of the drain")
    parser.add_argument("--plugins", nargs="+", default=list(SLOTS), choices=list(SLOTS))
    parser.add_argument("--child", nargs=4, metavar=("DSN", "PLUGIN", "STAGING", "BOUND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0

    report: dict = {"changes": args.changes, "txn_size": args.txn_size, "bound": args.bound}
    work = Path(tempfile.mkdtemp(prefix="pgdecode-backlog-"))
    try:
        with ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"backlog: {args.changes:,} changes in transactions of {args.txn_size:,} ...", flush=True)
                started = time.perf_counter()
                make_workload(conn, args.changes, args.txn_size)
                ceiling = Lsn.parse(str(conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
                print(f"  written in {time.perf_counter() - started:.0f} s, WAL up to {ceiling}", flush=True)
                for plugin in args.plugins:
                    rows, raw_seconds = raw_decode(conn, plugin, ceiling)
                    result = drain_in_child(dsn, plugin, work / plugin, args.bound)
                    sizes = [b["changes"] for b in result["batches"]]
                    raw_rate = args.changes / raw_seconds
                    rate = result["changes"] / result["seconds"]
                    report[plugin] = {
                        "raw_rows": rows,
                        "raw_seconds": round(raw_seconds, 2),
                        "raw_changes_per_s": round(raw_rate),
                        "drain_seconds": round(result["seconds"], 2),
                        "drain_changes_per_s": round(rate),
                        "ratio_to_raw": round(rate / raw_rate, 2),
                        "batches": len(sizes),
                        "largest_batch": max(sizes),
                        "staged_changes": result["changes"],
                        "peak_rss_mib": round(result["peak_rss_mib"]),
                        "peak_rss_mib_by_batch": [round(b["peak_rss_mib"]) for b in result["batches"]],
                        "rss_before_mib": round(result["rss_before_mib"]),
                    }
                    print(
                        f"{plugin}: raw decode {rows:,} rows in {raw_seconds:.1f} s ({raw_rate:,.0f} changes/s); "
                        f"drained {result['changes']:,} changes in {len(sizes)} batches (largest {max(sizes):,}, "
                        f"bound {args.bound:,}) in {result['seconds']:.1f} s ({rate:,.0f} changes/s) = "
                        f"{rate / raw_rate:.2f} of raw; peak RSS {result['peak_rss_mib']:.0f} MiB "
                        f"({result['rss_before_mib']:.0f} MiB before the first batch; after each batch "
                        f"{', '.join(str(round(b['peak_rss_mib'])) for b in result['batches'])})",
                        flush=True,
                    )
                    assert result["changes"] == args.changes, (result["changes"], args.changes)
                    assert max(sizes) <= args.bound, sizes
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "backlog_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
