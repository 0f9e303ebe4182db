"""Extract benchmark: our extract to staged Parquet against a raw slot decode of the same data.

In one run, on one throwaway PostgreSQL cluster and one 500,000-change workload, for each output
plugin (a ``test_decoding`` slot and a ``pgoutput`` slot over the same WAL):

1. raw:     ``select count(*) from pg_logical_slot_peek_changes(slot, ceiling, NULL, <options>)``
            (``peek_binary_changes`` for pgoutput), with the options the extract uses;
2. floor:   the same peek as ``COPY (...) TO STDOUT (FORMAT BINARY)``, as the extract reads it,
            received by ``psql`` and dropped: the server's decode, its sending and a client that
            does nothing with the bytes, the most any extract that peeks can reach;
3. extract: :func:`extract_batch` over the same slot and ceiling, to Parquet, with the native
            fast path and its defaults (two decoding sessions where they apply:
            capture/sessions.py), in a child process so its peak memory (max RSS) is its own;
4. extract of the first fifth of the range, to show peak memory does not grow with batch size;
5. the same full extract through the pure-Python path (``native=False``), for comparison
   (``--no-python`` skips it);
6. walsender: the same changes streamed by ``START_REPLICATION`` (the streaming replication
   protocol, read and dropped here), against the peek, in server CPU seconds of the backend
   that decodes (``--no-walsender`` skips it): why the extract peeks instead of streaming
   while the server decodes (README, "Performance: the native extract");
7. busy: raw decode, floor and native extract again while ``--load`` processes (default: one per core)
   spin in a busy loop, started by the bench before these runs and killed after them
   (``--no-busy`` skips it).

The raw decode is measured right before and right after each extract (after one warm-up run),
under the same conditions, and the extract's ratio is taken against their mean, so that a
change of the machine's other load during the run weighs on both sides alike; ``--repeat``
(default 3) such extracts per plugin and mode, the median ratio shown. Prints the rates,
the native extract's ratio to the raw decode, quiet and busy, with the load average, and the
peak memory of the extracts. Usage::

    make bench-extract            # or: .venv/bin/python -m bench.extract_bench --changes 500000
    .venv/bin/python -m bench.extract_bench --one-phase   # slots without two-phase decoding
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
from airflow_provider_pgdecode.decoding.pgoutput import pgoutput_options
from airflow_provider_pgdecode.decoding.test_decoding import DEFAULT_OPTIONS
from airflow_provider_pgdecode.postgres.session import PINNED_GUCS
from airflow_provider_pgdecode.postgres.slot import SlotClient, upper_slot_name
from pgdecode_testing.postgres_cluster import ThrowawayCluster

SLOTS = {"test_decoding": "bench_td", "pgoutput": "bench_po"}
#: Two-phase slots, as the DAG makes them; ``--one-phase`` turns it off for the run. A two-phase
#: test_decoding slot's upper halves are decoded over its upper-half slot (capture/sessions.py),
#: which a first large batch creates; here it is created with the slot, as after that batch.
TWO_PHASE = True
PUBLICATION = "bench_pub"
# Decoding of a 500k-change workload should not spill to disk in either run.
SERVER_SETTINGS = {
    "logical_decoding_work_mem": "1GB",
    "shared_buffers": "1GB",
    "work_mem": "256MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "1h",
}


def make_workload(conn: psycopg.Connection, changes: int, txn_size: int, checkpoint_every: int = 0) -> None:
    """Inserts (80%), updates (10%) and deletes (10%) in transactions of ``txn_size`` changes.

    ``checkpoint_every``: a CHECKPOINT after about so many changes. Each logs the running
    transactions, as PostgreSQL also does every 15 s while WAL is written: a slot's restart point
    can only move to such a record, so a backlog written in seconds without them is decoded from
    its start again by every batch's peek, which a backlog that accumulated for minutes is not."""
    written = 0

    def wrote(count: int) -> None:
        nonlocal written
        if checkpoint_every and (written + count) // checkpoint_every > written // checkpoint_every:
            conn.execute("checkpoint")
        written += count

    conn.execute(
        "create table orders (id bigint primary key, customer text not null, amount numeric(12,2),"
        " status text, created timestamptz, paid boolean, tags text[])"
    )
    conn.execute(f"create publication {PUBLICATION} for table orders")
    for plugin, slot in SLOTS.items():
        conn.execute("select pg_create_logical_replication_slot(%s, %s, false, %s)", (slot, plugin, TWO_PHASE))
        if TWO_PHASE and plugin == "test_decoding":
            SlotClient(conn).create(str(upper_slot_name(slot)), plugin, two_phase=True)
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
        wrote(stop - start)
    for start in range(0, updates, txn_size):
        stop = min(start + txn_size, updates)
        conn.execute("update orders set status = 'paid', paid = true where id between %s and %s", (start + 1, stop))
        wrote(stop - start)
    for start in range(0, deletes, txn_size):
        stop = min(start + txn_size, deletes)
        conn.execute("delete from orders where id between %s and %s", (inserts - stop + 1, inserts - start))
        wrote(stop - start)


def plugin_options(conn: psycopg.Connection, plugin: str) -> list[str]:
    if plugin == "test_decoding":
        pairs = list(DEFAULT_OPTIONS)
    else:
        pairs = pgoutput_options(PUBLICATION, conn.info.server_version, two_phase=TWO_PHASE)
    return [v for pair in pairs for v in pair]


def raw_decode(conn: psycopg.Connection, plugin: str, ceiling: Lsn) -> tuple[int, float]:
    function = "pg_logical_slot_peek_changes" if plugin == "test_decoding" else "pg_logical_slot_peek_binary_changes"
    started = time.perf_counter()
    rows = conn.execute(
        f"select count(*) from {function}(%s, %s::pg_lsn, NULL, variadic %s::text[])",
        (SLOTS[plugin], str(ceiling), plugin_options(conn, plugin)),
    ).fetchone()[0]
    return rows, time.perf_counter() - started


def copy_floor(conn: psycopg.Connection, dsn: str, plugin: str, ceiling: Lsn) -> float | None:
    """Seconds of the peek's binary COPY received by ``psql`` into /dev/null (None without psql)."""
    psql = shutil.which("psql") or next(iter(sorted(map(str, Path("/usr/lib/postgresql").glob("*/bin/psql")))), None)
    if psql is None:
        return None
    function = "pg_logical_slot_peek_changes" if plugin == "test_decoding" else "pg_logical_slot_peek_binary_changes"
    options = ", ".join("'" + option.replace("'", "''") + "'" for option in plugin_options(conn, plugin))
    copy = (
        f"COPY (SELECT lsn, xid, data FROM {function}('{SLOTS[plugin]}', '{ceiling}'::pg_lsn, NULL, {options})) "
        "TO STDOUT (FORMAT BINARY)"
    )
    # The extract's pinned settings (test_decoding prints values with them), in the same session.
    settings = "; ".join(f"SET {name} = '{value}'" for name, value in PINNED_GUCS)
    started = time.perf_counter()
    subprocess.run([psql, dsn, "-X", "-q", "-c", settings, "-c", copy], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def backend_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a server process so far (``/proc``: the server is local)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peek_cpu(dsn: str, plugin: str, ceiling: Lsn) -> float:
    """Server CPU seconds of one raw decode (the peek)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = backend_cpu_seconds(conn.info.backend_pid)
        raw_decode(conn, plugin, ceiling)
        return backend_cpu_seconds(conn.info.backend_pid) - before


def walsender_decode(dsn: str, plugin: str, ceiling: Lsn) -> tuple[int, float]:
    """Stream the slot from its position to ``ceiling`` over the replication protocol, with the
    extract's plugin options, never confirming (standby status updates of 0/0); returns the
    changes' messages and the walsender's CPU seconds. The messages are counted and dropped."""
    conn = psycopg.connect(dsn, autocommit=True, replication="database")
    try:
        pgconn = conn.pgconn
        pid = conn.info.backend_pid
        pairs = plugin_options(conn, plugin)
        options = ", ".join(f"\"{name}\" '{value}'" for name, value in zip(pairs[::2], pairs[1::2]))
        before = backend_cpu_seconds(pid)
        pgconn.send_query(f"START_REPLICATION SLOT {SLOTS[plugin]} LOGICAL 0/0 ({options})".encode())
        result = pgconn.get_result()
        if result is None or result.status != psycopg.pq.ExecStatus.COPY_BOTH:
            raise RuntimeError(f"START_REPLICATION failed: {result.error_message if result else 'no result'!r}")
        messages = 0
        while True:
            size, data = pgconn.get_copy_data(0)
            if size < 0:
                break
            if data[0] == ord("w"):  # XLogData: 1 + dataStart, walEnd, sendTime (8 bytes each) + payload
                messages += 1
                continue
            # Keepalive: walEnd past the ceiling means everything up to it was sent.
            if int.from_bytes(data[1:9], "big") >= ceiling:
                break
            if data[17]:
                pgconn.put_copy_data(b"r" + bytes(33))  # nothing written, flushed or applied
                pgconn.flush()
        cpu = backend_cpu_seconds(pid) - before
        pgconn.put_copy_end(None)
        while pgconn.get_copy_data(0)[0] >= 0:
            pass
        while pgconn.get_result() is not None:
            pass
    finally:
        conn.close()
    with psycopg.connect(dsn, autocommit=True) as check:  # the slot is free again for the next reader
        for _ in range(200):
            if not check.execute(
                "select active from pg_replication_slots where slot_name = %s", (SLOTS[plugin],)
            ).fetchone()[0]:
                break
            time.sleep(0.05)
    return messages, cpu


class CpuLoad:
    """``count`` child processes that spin in a busy loop until the block ends (a competing load)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuLoad:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.5)  # let them get going
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def measure(dsn: str, plugin: str, ceiling: Lsn, staging: Path, repeat: int) -> dict:
    """``repeat`` native extracts, each between two raw decodes (after a warm-up raw decode).

    Each extract's ratio is taken against the mean of the raw decodes just before and after it;
    the result holds the median ratio, and the extract and raw times of that median pair.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_decode(conn, plugin, ceiling)  # warm the caches for both contenders
        raw_rows, first = raw_decode(conn, plugin, ceiling)
    raws = [first]
    pairs = []
    floors = []
    for _ in range(repeat):
        full = extract_in_child(dsn, plugin, ceiling, staging)
        shutil.rmtree(staging, ignore_errors=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            raws.append(raw_decode(conn, plugin, ceiling)[1])
            floor = copy_floor(conn, dsn, plugin, ceiling)
        raw_seconds = (raws[-2] + raws[-1]) / 2
        if floor is not None:
            floors.append(raw_seconds / floor)
        ratio = (full["rows"] / full["seconds"]) / (raw_rows / raw_seconds)
        pairs.append({"ratio": ratio, "raw_seconds": raw_seconds, "raw_each": (raws[-2], raws[-1]), "full": full})
    pairs.sort(key=lambda pair: pair["ratio"])
    median = pairs[len(pairs) // 2]
    return {
        **median,
        "raw_rows": raw_rows,
        "ratios": [pair["ratio"] for pair in pairs],
        "floor_ratios": sorted(floors),
        "loadavg": os.getloadavg()[0],
    }


def extract_in_child(dsn: str, plugin: str, ceiling: Lsn, staging: Path, native: bool = True) -> dict:
    """Run the extract in a fresh interpreter; return its timing and peak RSS."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.extract_bench",
            "--child",
            dsn,
            plugin,
            str(ceiling),
            str(staging),
            "1" if native else "0",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(dsn: str, plugin: str, ceiling: str, staging: str, native: str) -> None:
    from airflow_provider_pgdecode.capture.extract import extract_batch

    publication = PUBLICATION if plugin == "pgoutput" else None
    with psycopg.connect(dsn, autocommit=True) as conn:
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        manifest = extract_batch(
            conn,
            SLOTS[plugin],
            staging,
            plugin=plugin,
            publication=publication,
            upto_lsn=Lsn.parse(ceiling),
            native=native == "1",
        )
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
    parser.add_argument("--no-python", action="store_true", help="skip the pure-Python extract")
    parser.add_argument("--no-busy", action="store_true", help="skip the runs under a competing CPU load")
    parser.add_argument("--no-walsender", action="store_true", help="skip the replication protocol's server CPU")
    parser.add_argument("--one-phase", action="store_true", help="slots without two-phase decoding")
    parser.add_argument("--repeat", type=int, default=3, help="extracts per plugin and mode (the median is shown)")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy-loop processes of the busy runs")
    parser.add_argument(
        "--child", nargs=5, metavar=("DSN", "PLUGIN", "CEILING", "STAGING", "NATIVE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    global TWO_PHASE
    TWO_PHASE = not args.one_phase

    results: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="pgdecode-bench-"))
    try:
        with ThrowawayCluster(extra_settings=SERVER_SETTINGS) as cluster:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                print(f"workload: {args.changes} changes in transactions of {args.txn_size} ...", flush=True)
                make_workload(conn, args.changes, args.txn_size)
                ceiling = Lsn.parse(str(conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
                # The commit that ends the first fifth of the transactions.
                fifth = Lsn.parse(
                    str(
                        conn.execute(
                            "select lsn from pg_logical_slot_peek_changes(%s, %s::pg_lsn, NULL) where data like 'COMMIT%%'"
                            " offset %s limit 1",
                            (SLOTS["test_decoding"], str(ceiling), max(args.changes // args.txn_size // 5 - 1, 0)),
                        ).fetchone()[0]
                    )
                )
            for plugin in SLOTS:
                quiet = measure(dsn, plugin, ceiling, work / plugin / "full", args.repeat)
                part = extract_in_child(dsn, plugin, fifth, work / plugin / "fifth")
                python = None if args.no_python else extract_in_child(dsn, plugin, ceiling, work / plugin / "py", False)
                walsender = None
                if not args.no_walsender:
                    peek_seconds = peek_cpu(dsn, plugin, ceiling)
                    messages, stream_seconds = walsender_decode(dsn, plugin, ceiling)
                    walsender = {"peek_cpu": peek_seconds, "stream_cpu": stream_seconds, "messages": messages}
                results[plugin] = {
                    "quiet": quiet,
                    "fifth": part,
                    "python": python,
                    "busy": None,
                    "walsender": walsender,
                }
            if not args.no_busy:
                print(f"busy runs: {args.load} busy-loop processes ...", flush=True)
                with CpuLoad(args.load):
                    for plugin in SLOTS:
                        results[plugin]["busy"] = measure(dsn, plugin, ceiling, work / plugin / "busy", args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    status = 0
    for plugin, r in results.items():
        quiet, part = r["quiet"], r["fifth"]
        full = quiet["full"]
        raw_rate = quiet["raw_rows"] / quiet["raw_seconds"]
        ours_rate = full["rows"] / full["seconds"]
        print()
        print(
            f"== {plugin}: {full['changes']} changes staged, {full['rows']} slot rows read (raw: {quiet['raw_rows']})"
        )
        for mode in ("quiet", "busy"):
            m = r[mode]
            if m is None:
                continue
            raw = m["raw_rows"] / m["raw_seconds"]
            ours = m["full"]["rows"] / m["full"]["seconds"]
            each = ", ".join(f"{s:.2f}" for s in m["raw_each"])
            print(
                f"{mode:5s} raw slot decode   : {m['raw_seconds']:8.2f} s  {raw:12,.0f} rows/s  (before, after: {each} s)"
            )
            print(
                f"{mode:5s} extract to Parquet: {m['full']['seconds']:8.2f} s  {ours:12,.0f} rows/s  (native fast path)"
            )
            aim = 0.8 if mode == "quiet" else 0.6
            every = ", ".join(f"{r:.2f}" for r in m["ratios"])
            print(
                f"{mode:5s} ratio extract/raw : {ours / raw:.2f}  (median of {every}; aim: >= {aim}; "
                f"load average {m['loadavg']:.1f})"
            )
            if m["floor_ratios"]:
                floors = m["floor_ratios"]
                print(
                    f"{mode:5s} floor (COPY to psql): ratio {floors[len(floors) // 2]:.2f}  (median of "
                    f"{', '.join(f'{r:.2f}' for r in floors)}: the peek sent as COPY to a client that drops it)"
                )
            # pgoutput's second session sends the table's Relation message again: one row more.
            extra = m["full"]["rows"] - m["raw_rows"]
            if extra != 0 and not (plugin == "pgoutput" and extra == 1):
                print(f"WARNING: raw and extract read different row counts for {plugin} ({mode})", file=sys.stderr)
                status = 1
        if r["python"] is not None:
            py = r["python"]
            py_rate = py["rows"] / py["seconds"]
            print(
                f"Python path       : {py['seconds']:8.2f} s  {py_rate:12,.0f} rows/s  "
                f"(ratio {py_rate / raw_rate:.2f}; native is {ours_rate / py_rate:.1f}x; peak RSS {py['peak_rss_mib']:.0f} MiB)"
            )
        if r["walsender"] is not None:
            w = r["walsender"]
            print(
                f"server CPU to decode: peek {w['peek_cpu']:.2f} s, walsender streaming {w['stream_cpu']:.2f} s "
                f"({w['messages']} messages): {w['stream_cpu'] / w['peek_cpu']:.2f}x the peek's"
            )
        print(
            f"extract peak RSS: {full['peak_rss_mib']:.0f} MiB for {full['rows']} rows; "
            f"{part['peak_rss_mib']:.0f} MiB for {part['rows']} rows (first fifth of the range); "
            f"interpreter+imports before extracting: {full['rss_before_mib']:.0f} MiB"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
