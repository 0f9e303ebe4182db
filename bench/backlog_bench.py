"""Backlog benchmark: a large backlog drained in bounded batches, against one raw decode of it.

In one run, on one throwaway PostgreSQL cluster and one ``--changes`` workload (default 5,000,000:
80% inserts, 10% updates, 10% deletes, in transactions of ``--txn-size``, with a CHECKPOINT every
``--checkpoint-every`` changes: the running-transactions records a backlog that accumulated over
minutes carries, which let a slot's restart point follow its confirms), for each output plugin:

1. raw:   ``select count(*)`` of one ``pg_logical_slot_peek_changes`` over the whole backlog
          (``peek_binary_changes`` for pgoutput), with the extract's options;
2. drain: in a child process (so its peak memory is its own), :func:`extract_batch` with
          ``BatchBounds(max_changes=--bound)`` and a confirm (``pg_replication_slot_advance``)
          after each batch, until a batch reaches the ceiling: the extract and confirm half of
          the DAG's drain loop (the merge is measured by bench-merge).

3. with ``--with-merges`` (one plugin, ``--merge-plugin``): the drain loop with its merges, in a
          child process, over the same backlog (more slots, made before it was written; a
          first round, not reported, warms the server up): the batches extracted (``--merge-bound`` changes each), merged into Delta through
          a warm Spark Connect server (started by the bench, ``local[*]``) and confirmed after their
          Delta commit, one step after another (``overlap=False``), with the extract of batch N+1
          in a thread while batch N merges (``overlap=True``: the drain's
          :class:`~airflow_provider_pgdecode.cycle.overlap.ExtractAhead`, joined before N is
          confirmed), and overlapped while the last overlapped step measured took less than the
          last step one after another (``overlap="auto"``, the drain's default). The Delta table is compared with PostgreSQL
          after each, 500,000 keys at a time (not timed).

Prints the batches, the largest batch, the drain's rate against the raw decode (the ratio), with
merges the CPU seconds of the drain's process and of PostgreSQL (and the ratio they allow on this
machine's cores, spread perfectly), and the drain's peak memory (max RSS of the child, and before its first batch); writes them to
bench/results/backlog_bench.json. Usage::

    make bench-backlog            # or: .venv/bin/python -m bench.backlog_bench --changes 5000000
    .venv/bin/python -m bench.backlog_bench --changes 300000 --plugins test_decoding --with-merges
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
from airflow_provider_pgdecode.postgres.slot import SlotClient, upper_slot_name
from bench.extract_bench import (
    PUBLICATION,
    SERVER_SETTINGS,
    SLOTS,
    TWO_PHASE,
    make_workload,
    plugin_options,
    raw_decode,
)
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


COMPARED = 500_000
"""Keys compared at a time (Spark's collect of a whole large table through Connect does not fit)."""

MERGE_SLOTS = {"warm_up": "bench_warm_up", "serial": "bench_serial", "overlap": "bench_overlap", "auto": "bench_auto"}
"""The slots of the drain with merges: a first round that warms the Connect server up (its first
MERGEs compile; not reported), one step after another, overlapped, and overlapped while it pays."""
MERGE_MODES: dict[str, bool | str] = {"warm_up": False, "serial": False, "overlap": True, "auto": "auto"}
"""Each round's ``overlap`` (the drain operator's, :class:`~airflow_provider_pgdecode.cycle.overlap.OverlapChoice`)."""


def create_merge_slots(conn: psycopg.Connection, plugin: str) -> None:
    """Before the backlog is written: one slot per mode, as the workload's own slots are made."""
    for slot in MERGE_SLOTS.values():
        conn.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (slot, plugin, TWO_PHASE))
        if TWO_PHASE and plugin == "test_decoding":
            SlotClient(conn).create(str(upper_slot_name(slot)), plugin, two_phase=True)


def server_cpu_seconds(conn: psycopg.Connection) -> float:
    """CPU seconds the PostgreSQL server behind ``conn`` has spent so far (this machine's): its
    postmaster, the processes it runs, and those that ended (it waited for them)."""
    backend = conn.execute("select pg_backend_pid()").fetchone()[0]
    postmaster = int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile: counted in its parent's
            continue
        if int(stat.parent.name) == postmaster:
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def merge_drain_in_child(dsn: str, plugin: str, work: Path, bound: int, mode: str, url: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.backlog_bench", "--merge-child", dsn, plugin, str(work), str(bound)]
        + [mode, url],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if out.returncode != 0:  # the child's own error, not only its exit status
        raise SystemExit(f"the drain with merges ({mode}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def merge_child(dsn: str, plugin: str, work: str, bound: str, mode: str, url: str) -> None:
    """The drain loop with merges: extract, merge through Connect, confirm after the Delta commit;
    with overlap, the next batch's extract runs in a thread while a batch merges."""
    from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
    from airflow_provider_pgdecode.batch.manifest import BatchManifest
    from airflow_provider_pgdecode.capture.bounds import BatchBounds
    from airflow_provider_pgdecode.capture.extract import extract_batch
    from airflow_provider_pgdecode.cycle.overlap import ExtractAhead, OverlapChoice
    from airflow_provider_pgdecode.spark.merge_job import merge_batches
    from airflow_provider_pgdecode.spark.session import build_connect_session
    from pgdecode_testing.compare import compare_table

    choice = OverlapChoice(MERGE_MODES[mode])
    slot, staging, delta = MERGE_SLOTS[mode], Path(work) / "staging", str(Path(work) / "delta")
    bounds = BatchBounds(max_changes=int(bound), max_wal_bytes=None)
    publication = PUBLICATION if plugin == "pgoutput" else None
    spark = build_connect_session(url)

    def extract(checkpoint: Checkpoint | None) -> BatchManifest:
        with psycopg.connect(dsn, autocommit=True) as own:  # a connection per extract: one may run in a thread
            return extract_batch(
                own, slot, staging, plugin=plugin, publication=publication, checkpoint=checkpoint, bounds=bounds
            )

    batches: list[dict] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        checkpoint, ahead = None, None
        extract_seconds = merge_seconds = ahead_wait_seconds = 0.0
        started, cpu_started, server_started = time.perf_counter(), time.process_time(), server_cpu_seconds(conn)
        while True:
            began = time.perf_counter()
            alone = ahead is None
            manifest = ahead.join()["manifest"] if ahead is not None else extract(checkpoint)
            extract_seconds += time.perf_counter() - began  # with overlap: only the wait for it
            if alone:
                choice.extracted_alone(time.perf_counter() - began)
            ahead = None
            if choice.ahead() and manifest.bounded_by is not None:
                following = Checkpoint.from_manifest(manifest)  # N+1 starts at N's end
                ahead = ExtractAhead(lambda _kill, cp=following: {"manifest": extract(cp)})
            began = time.perf_counter()
            merge_batches(spark, [str(manifest.path)], delta)
            merged_in = time.perf_counter() - began
            merge_seconds += merged_in
            choice.merged(merged_in)
            if ahead is not None:
                began = time.perf_counter()
                ahead.wait()  # the slot is free again
                ahead_wait_seconds += time.perf_counter() - began
                choice.overlapped(merged_in + time.perf_counter() - began)
            conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, manifest.end_lsn))
            checkpoint = Checkpoint.from_manifest(manifest)
            batches.append(
                {
                    "changes": manifest.changes,
                    "merge_seconds": round(merged_in, 3),
                    "extracted_ahead": not alone,
                    "peak_rss_mib": resource.getrusage(0).ru_maxrss / 1024,
                }
            )
            shutil.rmtree(str(manifest.path), ignore_errors=True)  # merged and confirmed
            if manifest.bounded_by is None:
                break
        elapsed = time.perf_counter() - started
        cpu = {
            "drain_process": time.process_time() - cpu_started,
            "postgres": server_cpu_seconds(conn) - server_started,
        }
        equal = mode == "warm_up" or all(
            compare_table(
                conn, spark, delta, "public", "orders", where=f"id BETWEEN {lo} AND {lo + COMPARED - 1}"
            ).equal
            for lo in range(0, conn.execute("select coalesce(max(id), 0) from orders").fetchone()[0] + 1, COMPARED)
        )
    spark.stop()
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "cpu_seconds": cpu,
                "extract_wait_seconds": extract_seconds,
                "ahead_wait_seconds": ahead_wait_seconds,
                "merge_seconds": merge_seconds,
                "batches": batches,
                "changes": sum(b["changes"] for b in batches),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "equal": equal,
            }
        )
    )


def cpu_floor(result: dict) -> float:
    """The least wall time a drain's CPU seconds (its process's and PostgreSQL's) fit in on this
    machine's cores, had they been spread perfectly."""
    return sum(result["cpu_seconds"].values()) / (os.cpu_count() or 1)


def drain_with_merges(conn: psycopg.Connection, dsn: str, args: argparse.Namespace, ceiling: Lsn, work: Path) -> dict:
    """The drain with merges after a warm-up round: one step after another, then overlapped; each
    rate as a ratio of the raw decode of the same slot."""
    from pgdecode_testing.connect_server import LocalConnectServer

    plugin = args.merge_plugin
    function = "pg_logical_slot_peek_changes" if plugin == "test_decoding" else "pg_logical_slot_peek_binary_changes"
    started = time.perf_counter()
    rows = conn.execute(
        f"select count(*) from {function}(%s, %s::pg_lsn, NULL, variadic %s::text[])",
        (MERGE_SLOTS["serial"], str(ceiling), plugin_options(conn, plugin)),
    ).fetchone()[0]
    raw_seconds = time.perf_counter() - started
    raw_rate = args.changes / raw_seconds
    report: dict = {"plugin": plugin, "bound": args.merge_bound, "raw_rows": rows, "raw_seconds": round(raw_seconds, 2)}
    print(f"{plugin}: raw decode {rows:,} rows in {raw_seconds:.1f} s ({raw_rate:,.0f} changes/s)", flush=True)
    with LocalConnectServer(master="local[*]", log_path=work / "connect-server.log") as server:
        for mode in MERGE_SLOTS:
            result = merge_drain_in_child(dsn, plugin, work / mode, args.merge_bound, mode, server.url)
            if mode == "warm_up":
                print(f"  warm-up round (not reported): {result['seconds']:.1f} s", flush=True)
                continue
            rate = result["changes"] / result["seconds"]
            report[mode] = {
                "seconds": round(result["seconds"], 2),
                "changes_per_s": round(rate),
                "ratio_to_raw": round(rate / raw_rate, 2),
                "merge_seconds": round(result["merge_seconds"], 2),
                "extract_wait_seconds": round(result["extract_wait_seconds"], 2),
                "ahead_wait_seconds": round(result["ahead_wait_seconds"], 2),
                "batches": len(result["batches"]),
                "extracted_ahead": sum(b["extracted_ahead"] for b in result["batches"]),
                "peak_rss_mib": round(result["peak_rss_mib"]),
                "peak_rss_mib_by_batch": [round(b["peak_rss_mib"]) for b in result["batches"]],
                "merge_seconds_by_batch": [b["merge_seconds"] for b in result["batches"]],
                "delta_equals_postgres": result["equal"],
                "cpu_seconds": {k: round(v, 1) for k, v in result["cpu_seconds"].items()},
                "cpu_floor_ratio": round(args.changes / (cpu_floor(result) or 1) / raw_rate, 2),
            }
            print(
                f"{plugin} drain with merges, overlap {MERGE_MODES[mode]}: {result['changes']:,} changes in "
                f"{len(result['batches'])} batches (bound {args.merge_bound:,}) in {result['seconds']:.1f} s "
                f"({rate:,.0f} changes/s) = {rate / raw_rate:.2f} of raw; merges {result['merge_seconds']:.1f} s, "
                f"waiting for extracts {result['extract_wait_seconds']:.1f} s (after merges "
                f"{result['ahead_wait_seconds']:.1f} s, {report[mode]['extracted_ahead']} extracted ahead); peak RSS {result['peak_rss_mib']:.0f} "
                f"MiB; Delta {'equals' if result['equal'] else 'DIFFERS FROM'} PostgreSQL",
                flush=True,
            )
            cpu = result["cpu_seconds"]
            print(
                f"  CPU: {cpu['drain_process']:.1f} s in the drain's process, {cpu['postgres']:.1f} s in PostgreSQL: "
                f"at least {cpu_floor(result):.1f} s on {os.cpu_count()} cores, at most "
                f"{report[mode]['cpu_floor_ratio']:.2f} of the raw decode",
                flush=True,
            )
            assert result["changes"] == args.changes and result["equal"], result
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=5_000_000)
    parser.add_argument("--txn-size", type=int, default=1_000)
    parser.add_argument("--bound", type=int, default=1_000_000, help="max_batch_changes of the drain")
    parser.add_argument("--plugins", nargs="+", default=list(SLOTS), choices=list(SLOTS))
    parser.add_argument("--with-merges", action="store_true", help="also the drain with merges, overlap off and on")
    parser.add_argument("--merge-plugin", default="test_decoding", choices=list(SLOTS))
    parser.add_argument("--merge-bound", type=int, default=50_000, help="max_batch_changes of the drain with merges")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=100_000,
        help="a CHECKPOINT (a running-transactions record, as PostgreSQL logs every 15 s) after about so many "
        "changes of the workload; 0: none, a backlog written all at once",
    )
    parser.add_argument("--child", nargs=4, metavar=("DSN", "PLUGIN", "STAGING", "BOUND"), help=argparse.SUPPRESS)
    parser.add_argument("--merge-child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.merge_child:
        merge_child(*args.merge_child)
        return 0

    report: dict = {
        "changes": args.changes,
        "txn_size": args.txn_size,
        "bound": args.bound,
        "checkpoint_every": args.checkpoint_every,
    }
    work = Path(tempfile.mkdtemp(prefix="pgdecode-backlog-"))
    try:
        with ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"backlog: {args.changes:,} changes in transactions of {args.txn_size:,} ...", flush=True)
                started = time.perf_counter()
                if args.with_merges:
                    create_merge_slots(conn, args.merge_plugin)
                make_workload(conn, args.changes, args.txn_size, args.checkpoint_every)
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
                        "seconds_by_batch": [round(b["seconds"], 2) for b in result["batches"]],
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
                if args.with_merges:
                    report["with_merges"] = drain_with_merges(conn, dsn, args, ceiling, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "backlog_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
