"""Scale benchmark: how a cycle's cost grows with the number of tables its changes touch (issue 39).

    .venv/bin/python -m bench.scale_bench [--tables 1,10,50,200] [--changes 1000] [--kind updates]
        [--table-workers 1,4] [--light-write-max-bytes 0,67108864] [--shape numeric-key] [--history 45]
    .venv/bin/python -m bench.scale_bench --smoke      # 1 and 5 tables, 100 changes

One run, one throwaway PostgreSQL cluster, one warm Spark Connect server (``local[*]``, started by
the bench, as a deployment that merges through Connect has one):

1. A warm-up round (one table, 100 changes: the server's first MERGE compiles), not reported.
   Then for each table count N (its own database): N tables ``(id int primary key, v text, n int)``
   (``--shape``: other keys and columns, :data:`SHAPES`) of 100 rows each, loaded by the initial
   load (a slot with an exported snapshot, ``stage_snapshot``, the merge committing the parts as
   staged): not timed.
2. The timed cycle: ``--changes`` changes spread round-robin over the N tables, in transactions
   of ten (``updates`` of existing rows, the default, or ``inserts`` of new keys; ``reloads``:
   each table truncated and refilled with its share in one transaction), then
   ``extract_batch`` and ``merge_batches`` (one session of the server; ``--table-workers`` K: the
   tables merged K at a time, each in a session of its own; ``--light-write-max-bytes`` 0: every
   table through Delta's MERGE, else small tables committed by delta-rs, ``spark/light_write.py``)
   timed apart. Several values of each are measured one after the other for each N (each on
   fresh tables), so their ratios come from one run. ``--history`` H: H such cycles run first,
   not timed, so that each table's log holds H more commits, as after H cycles of a day.
3. Every table compared with PostgreSQL as a multiset, read by delta-rs (the first through Spark
   too, ``pgdecode_testing.compare``), not timed.

Prints per N (and variant) the extract and merge seconds and the ratio of the cycle to the first
row (the issue's aim: at most 3x at 50 tables, 200 tables merged in under 2 minutes), with the load
average, and writes them to bench/results/scale_bench.json (``scale_bench-<shape>-<kind>-history<H>.json``
for another ``--shape``, ``--kind`` or ``--history``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint  # noqa: E402
from airflow_provider_pgdecode.capture.extract import extract_batch  # noqa: E402
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot  # noqa: E402
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches  # noqa: E402
from airflow_provider_pgdecode.spark.merge_plan import DEFAULT_LIGHT_WRITE_MAX_BYTES  # noqa: E402
from airflow_provider_pgdecode.spark.session import build_connect_session  # noqa: E402
from pgdecode_testing.compare import compare_table  # noqa: E402
from pgdecode_testing.connect_server import LocalConnectServer  # noqa: E402
from pgdecode_testing.postgres_cluster import ThrowawayCluster  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEED_ROWS = 100
SLOT = "scale"


def table_names(count: int) -> list[str]:
    return [f"t{i:03d}" for i in range(count)]


#: The tables' columns by ``--shape``: each has ``id``, ``v`` and ``n``, which the changes write.
SHAPES = {
    "plain": "id int primary key, v text, n int",
    # A key migrated from NUMBER(10,2): numeric text compared as its decimal.
    "numeric-key": "id numeric(12,2) primary key, v text, n int",
    # A partitioned table's key holds its partition column (the table itself is not partitioned).
    "timestamp-key": "id int, v text, n int, at timestamptz not null default '2026-01-01', primary key (id, at)",
    # A single date or timestamp key (a daily or an event table's), from the row's id.
    "date-key": "id int not null, v text, n int, day date generated always as (date '2000-01-01' + id) stored primary key",
    "single-timestamp-key": (
        "id int not null, v text, n int, at timestamptz generated always as (to_timestamp(1700000000 + id * 60)) stored"
        " primary key"
    ),
    # A numeric without a typmod: its values' digits checked against decimal(38,18).
    "unbounded-numeric": "id int primary key, v text, n int, amount numeric default 12.345",
    # A 4,000-byte document stored out of line (TOAST), which the updates leave unchanged.
    "toast": "id int primary key, v text, n int, doc text default repeat('x', 4000)",
}
#: What a shape sets up after creating a table, before its rows are inserted.
SHAPE_SETUP = {"toast": "alter table {name} alter column doc set storage external"}


def create_tables(conn: Any, count: int, shape: str = "plain") -> None:
    for name in table_names(count):
        conn.execute(f"create table {name} ({SHAPES[shape]})")
        if shape in SHAPE_SETUP:
            conn.execute(SHAPE_SETUP[shape].format(name=name))
        conn.execute(f"insert into {name} (id, v, n) select g, 'seed ' || g, g from generate_series(1, {SEED_ROWS}) g")


def write_changes(conn: Any, count: int, changes: int, kind: str) -> None:
    """``changes`` changes round-robin over the tables, ten per transaction; for ``reloads``, each
    table emptied (TRUNCATE) and refilled with its share of them in one transaction, as a lookup
    table is reloaded."""
    names = table_names(count)
    if kind == "reloads":
        for table in names:
            with conn.transaction():
                conn.execute(f"truncate {table}")
                conn.execute(
                    f"insert into {table} (id, v, n) select g, 'reloaded', g from generate_series(1, %s) g",
                    (max(1, changes // count),),
                )
        return
    for first in range(0, changes, 10):
        with conn.transaction():
            for i in range(first, min(first + 10, changes)):
                table, serial = names[i % count], i // count
                if kind == "inserts":
                    conn.execute(f"insert into {table} (id, v, n) values (%s, 'new', %s)", (SEED_ROWS + 1 + serial, i))
                else:
                    conn.execute(
                        f"update {table} set v = 'changed', n = n + 1 where id = %s", (1 + serial % SEED_ROWS,)
                    )


def delta_rows(root: str, table: str) -> Counter[tuple[Any, ...]]:
    """The table's rows as delta-rs reads them, as a multiset."""
    query = QueryBuilder().register("t", DeltaTable(f"{root}/public/{table}")).execute("select id, v, n from t")
    return Counter(tuple(row.values()) for row in pa.table(query.read_all()).to_pylist())


def one_count(
    cluster: ThrowawayCluster,
    spark: Any,
    work: Path,
    count: int,
    changes: int,
    kind: str,
    label: str = "",
    options: MergeOptions | None = None,
    shape: str = "plain",
    history: int = 0,
) -> dict[str, Any]:
    database = f"scale_{label}{count}"
    cluster.create_database(database)
    dsn = cluster.dsn(database)
    staging, delta = work / f"staging-{label}{count}", str(work / f"delta-{label}{count}")
    tables = [("public", name) for name in table_names(count)]
    with cluster.connect(database) as conn:
        create_tables(conn, count, shape)
        with create_slot_with_snapshot(dsn, SLOT) as (lsn, name):
            loaded = stage_snapshot(dsn, name, lsn, SLOT, staging, tables)
        merge_batches(spark, [str(loaded.path)], delta)
        batch = loaded
        for _ in range(history + 1):  # earlier cycles (not timed) add a commit to each table's log
            write_changes(conn, count, changes, kind)
            started = time.monotonic()
            batch = extract_batch(conn, SLOT, staging, checkpoint=Checkpoint.from_manifest(batch), tables=tables)
            extracted = time.monotonic()
            merge_batches(spark, [str(batch.path)], delta, options)
            merged = time.monotonic()
            conn.execute("select pg_replication_slot_advance(%s, %s)", (SLOT, str(batch.end_lsn)))
        # The first table through Spark, every table through delta-rs (milliseconds a table).
        unequal = [t for _, t in tables[:1] if not compare_table(conn, spark, delta, "public", t).equal]
        unequal += [t for _, t in tables if delta_rows(delta, t) != Counter(conn.execute(f"select id, v, n from {t}"))]
        conn.execute("select pg_drop_replication_slot(%s)", (SLOT,))
    return {
        "tables": count,
        "changes": batch.changes,
        "extract_seconds": round(extracted - started, 3),
        "merge_seconds": round(merged - extracted, 3),
        "cycle_seconds": round(merged - started, 3),
        "unequal_tables": unequal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="1,10,50,200", help="table counts, comma-separated")
    parser.add_argument("--changes", type=int, default=1000)
    parser.add_argument(
        "--kind",
        choices=("updates", "inserts", "reloads"),
        default="updates",
        help="updates of the seeded rows, inserts of new keys, or each table truncated and refilled (reloads)",
    )
    parser.add_argument(
        "--table-workers",
        default="1",
        help="tables merged side by side (MergeOptions.table_workers); several, comma-separated, are measured "
        "one after the other for each table count, in one run",
    )
    parser.add_argument(
        "--light-write-max-bytes",
        default=str(DEFAULT_LIGHT_WRITE_MAX_BYTES),
        help="MergeOptions.light_write_max_bytes (0: every table through Delta's MERGE); several, "
        "comma-separated, are measured one after the other for each table count, in one run",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="plain",
        help="the tables' columns: an int key (plain), a numeric(12,2) key, an (int, timestamptz) key, a "
        "numeric without a typmod beside an int key, or a TOAST document the updates leave unchanged",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="cycles run (not timed) before the timed one, each adding a commit to every table's log, as a day "
        "of cycles does",
    )
    parser.add_argument("--smoke", action="store_true", help="1 and 5 tables, 100 changes")
    args = parser.parse_args(argv)
    counts = [1, 5] if args.smoke else [int(n) for n in args.tables.split(",")]
    variants = [
        (int(k), int(b)) for k in str(args.table_workers).split(",") for b in str(args.light_write_max_bytes).split(",")
    ]
    changes = 100 if args.smoke else args.changes
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pgdecode-scale-") as tmp, ThrowawayCluster() as cluster:
        work = Path(tmp)
        with LocalConnectServer(master="local[*]", log_path=work / "connect-server.log") as server:
            spark = build_connect_session(server.url)
            one_count(cluster, spark, work, 1, 100, args.kind, label="warm_up_")  # the server's first MERGE: JIT
            for count in counts:
                for k, light in variants:
                    options = MergeOptions(table_workers=k, light_write_max_bytes=light)
                    label = f"w{k}_l{int(light > 0)}_"
                    row = one_count(
                        cluster,
                        spark,
                        work,
                        count,
                        changes,
                        args.kind,
                        label=label,
                        options=options,
                        shape=args.shape,
                        history=args.history,
                    )
                    row["table_workers"] = k
                    row["light_write_max_bytes"] = light
                    first = rows[0] if rows else row
                    row["ratio_to_first"] = round(row["cycle_seconds"] / max(first["cycle_seconds"], 1e-9), 2)
                    rows.append(row)
                    print(
                        f"{count:4d} tables, {k} worker(s), light write {'on' if light else 'off'}: "
                        f"{row['changes']} changes, extract {row['extract_seconds']:6.3f} s, merge "
                        f"{row['merge_seconds']:7.3f} s, cycle {row['cycle_seconds']:7.3f} s = "
                        f"{row['ratio_to_first']:.2f}x the first row"
                        f"{'; UNEQUAL: ' + ', '.join(row['unequal_tables']) if row['unequal_tables'] else ''}",
                        flush=True,
                    )
            spark.stop()
    report = {
        "kind": args.kind,
        "shape": args.shape,
        "changes": changes,
        "history": args.history,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "".join(f"-{name}" for name, default in ((args.shape, "plain"), (args.kind, "updates")) if name != default)
    suffix += f"-history{args.history}" if args.history else ""
    written = RESULTS / f"scale_bench{suffix}.json"
    written.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"load average {report['load_average']}; written to {written}")
    return 1 if any(row["unequal_tables"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
