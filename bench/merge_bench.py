"""Merge benchmark: keys uniformly random over the whole table, 1M rows against 10M, job against bare MERGE.

    .venv/bin/python -m bench.merge_bench [--changes 100000] [--small 1000000] [--large 10000000]
    .venv/bin/python -m bench.merge_bench --smoke          # 2,000 changes, 20,000 / 200,000 rows

One run, one local Spark (local[*]):

1. For each size (``--small`` and ``--large`` rows), two Delta tables filled with ``spark.range``
   (ids in key order, one file per 250,000 rows, so files cover key ranges):
   * the job's table, created the way the job creates it (a one-row batch: its schema and the
     table properties pgdecode sets, docs/merge.md "Table properties pgdecode sets, and why");
   * the bare table: the same columns written by a plain ``df.write.format("delta")``, so it has
     Delta's DEFAULT properties (no deletion vectors, no column mapping, default file sizes and
     statistics on the first 32 columns) - the floor a user gets from Delta without pgdecode.
2. For each size, one staged batch of ``--changes`` changes (docs/staging-format.md) whose update
   and delete keys are uniformly random over THAT table's keys: 60% updates (some keys several
   times), 10% deletes of existing keys, 30% inserts of new keys, each in its own transaction, in
   random order. So every file of both tables is touched.
3. Timed, each ``--repeats`` times on fresh copies of the tables (the best run counts), in this
   order: bare MERGE of the already-collapsed rows (no planning, collapse, TOAST or exactly-once
   work) into the 1M table; the job into the 1M table; the same two into the 10M table. Each
   result is checked against the expected row count.

Prints the four times and the ratios job/bare per size (aim: at most 1.2) and job 10M / job 1M
(aim: at most 3), with the load average, and writes them to bench/results/merge_bench.json.
``--table-property KEY=VALUE`` (the job's tables) and ``--conf KEY=VALUE`` (the session) measure
other settings against the same floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from airflow_provider_pgdecode.spark.merge_job import (  # noqa: E402
    DEFAULT_TABLE_PROPERTIES,
    MergeOptions,
    merge_batches,
)
from airflow_provider_pgdecode.spark.session import build_spark_session  # noqa: E402

SLOT = "bench"
COLUMNS = [
    {"name": "id", "catalog_type": "bigint", "arrow": pa.int64()},
    {"name": "name", "catalog_type": "text", "arrow": pa.string()},
    {"name": "amount", "catalog_type": "numeric(12,2)", "arrow": pa.string()},
    {"name": "updated_at", "catalog_type": "timestamp with time zone", "arrow": pa.timestamp("us", tz="UTC")},
]
NEW_KEYS_FROM = 20_000_000
REPEATS = 2


def lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def write_batch(root: Path, start: int, end: int, table: pa.Table) -> str:
    """A staged batch of one table (public.items) holding ``table``'s rows."""
    directory = root / SLOT / f"{start:016X}-{end:016X}"
    (directory / "tables" / "public" / "items").mkdir(parents=True)
    pq.write_table(table, directory / "tables" / "public" / "items" / "part-00000.parquet")
    ops = table.column("_pg_op").to_pylist()
    lsns = table.column("_pg_commit_lsn").to_numpy()
    manifest = {
        "format": "pgdecode.batch/1",
        "slot": SLOT,
        "plugin": "pgoutput",
        "database": "bench",
        "start_lsn": lsn_text(start),
        "end_lsn": lsn_text(end),
        "ceiling_lsn": lsn_text(end),
        "transactions": len(ops),
        "changes": len(ops),
        "tables": [
            {
                "schema": "public",
                "table": "items",
                "path": "tables/public/items",
                "files": ["part-00000.parquet"],
                "rows": len(ops),
                "inserts": ops.count("I"),
                "updates": ops.count("U"),
                "deletes": ops.count("D"),
                "truncates": 0,
                "min_commit_lsn": lsn_text(int(lsns.min())),
                "max_commit_lsn": lsn_text(int(lsns.max())),
                "key": ["id"],
                "replica_identity": "default",
                "columns": [
                    {
                        "name": c["name"],
                        "type": c["catalog_type"],
                        "catalog_type": c["catalog_type"],
                        "arrow": str(c["arrow"]),
                    }
                    for c in COLUMNS
                ],
            }
        ],
        "messages": {"path": "messages", "files": [], "rows": 0},
        "prepared_pending": [],
        "prepared_committed": [],
        "prepared_rolled_back": [],
        "complete": True,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return str(directory)


def staged_table(ids: np.ndarray, ops: np.ndarray, lsns: np.ndarray) -> pa.Table:
    n = len(ids)
    upsert = ops != "D"
    names = np.where(upsert, np.char.add("name-", np.arange(n).astype(str)), None)
    amounts = np.where(upsert, np.char.mod("%.2f", (np.arange(n) % 100_000) / 100.0), None)
    times = pa.array(np.where(upsert, 1_700_000_000_000_000 + np.arange(n), 0), pa.timestamp("us", tz="UTC"))
    times = pa.compute.if_else(pa.array(upsert), times, pa.scalar(None, pa.timestamp("us", tz="UTC")))
    old = pa.StructArray.from_arrays([pa.array(ids, pa.int64())], names=["id"], mask=pa.array(ops != "D"))
    return pa.table(
        {
            "_pg_commit_lsn": pa.array(lsns, pa.int64()),
            "_pg_seq": pa.array(np.zeros(n, dtype=np.int32)),
            "_pg_op": pa.array(ops.astype(object), pa.string()),
            "_pg_xid": pa.array(1000 + np.arange(n), pa.int64()),
            "_pg_commit_time": pa.array(1_700_000_000_000_000 + np.arange(n), pa.timestamp("us", tz="UTC")),
            "_pg_change_lsn": pa.array(lsns - 32, pa.int64()),
            "_pg_unchanged_toast": pa.array([[] for _ in range(n)], pa.list_(pa.string())),
            "_pg_old": old,
            "id": pa.array(np.where(upsert, ids, 0), pa.int64(), mask=~upsert),
            "name": pa.array(names.astype(object), pa.string()),
            "amount": pa.array(amounts.astype(object), pa.string()),
            "updated_at": times,
        }
    )


def make_changes(
    changes: int, rows: int, seed: int = 42, new_keys_from: int = NEW_KEYS_FROM
) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """The staged rows, the same rows collapsed to the last state per key, and expected counts.
    Update and delete keys are uniformly random over the table's ``rows`` keys (0 .. rows-1)."""
    rng = np.random.default_rng(seed)
    n_delete, n_insert = changes // 10, (changes * 3) // 10
    n_update = changes - n_delete - n_insert
    deleted = rng.choice(rows, size=n_delete, replace=False)
    updated = rng.integers(0, rows, size=n_update * 2)
    updated = updated[~np.isin(updated, deleted)][:n_update]  # repeats: collapsed to the last
    assert len(updated) == n_update
    inserted = new_keys_from + np.arange(n_insert)
    ids = np.concatenate([updated, deleted, inserted]).astype(np.int64)
    ops = np.array(["U"] * n_update + ["D"] * n_delete + ["I"] * n_insert)
    order = rng.permutation(changes)
    ids, ops = ids[order], ops[order]
    lsns = 0x1_0000_0000 + (np.arange(changes, dtype=np.int64) + 1) * 64
    staged = staged_table(ids, ops, lsns)
    # Collapse independently: the last change per key (rows are in commit order).
    last = {}
    for position, key in enumerate(ids.tolist()):
        last[key] = position
    positions = np.array(sorted(last.values()))
    collapsed = staged.take(pa.array(positions)).select(
        ["_pg_op", "_pg_old", "id", "name", "amount", "updated_at", "_pg_commit_lsn", "_pg_commit_time", "_pg_xid"]
    )
    final_ops = collapsed.column("_pg_op").to_numpy(zero_copy_only=False)
    expected = {
        "deletes": int((final_ops == "D").sum()),
        "inserts": int((final_ops == "I").sum()),
        "updates": int((final_ops == "U").sum()),
    }
    key = pa.compute.coalesce(collapsed.column("id"), pa.compute.struct_field(collapsed.column("_pg_old"), [0]))
    collapsed = collapsed.drop_columns(["_pg_old", "id"]).append_column("id", key)
    collapsed = collapsed.set_column(
        collapsed.schema.get_field_index("amount"),
        "amount",
        pa.compute.cast(collapsed.column("amount"), pa.decimal128(12, 2)),
    )
    return staged, collapsed, expected


def fill_rows(spark: Any, rows: int) -> Any:
    """``rows`` rows, ids 0 .. rows-1 in order, one file per 250,000 rows."""
    return spark.range(0, rows, 1, max(1, rows // 250_000)).selectExpr(
        "id",
        "concat('name-', id) as name",
        "cast((id % 100000) / 100 as decimal(12,2)) as amount",
        "timestamp_micros(1600000000000000 + id) as updated_at",
        "cast(96 as bigint) as _pg_commit_lsn",
        "timestamp_micros(1600000000000000) as _pg_commit_time",
        "cast(7 as bigint) as _pg_xid",
    )


def create_job_table(spark: Any, work: Path, delta_root: str, rows: int, options: MergeOptions) -> str:
    """A table created by the job (its schema and properties, one seed row of key -1), then
    filled with ``rows`` rows in key order."""
    seed = staged_table(np.array([-1]), np.array(["I"]), np.array([64]))
    merge_batches(spark, [write_batch(work / "seed", 1, 128, seed)], delta_root, options)
    path = f"{delta_root}/public/items"
    fill_rows(spark, rows).write.format("delta").mode("append").save(path)
    return path


def create_bare_table(spark: Any, path: str, rows: int) -> str:
    """The same rows in a table with Delta's default properties (a plain write)."""
    fill_rows(spark, rows).write.format("delta").save(path)
    return path


def bare_merge(spark: Any, path: str, collapsed_file: str) -> None:
    spark.read.parquet(collapsed_file).createOrReplaceTempView("bench_collapsed")
    spark.sql(f"""
        MERGE INTO delta.`{path}` t USING bench_collapsed s ON t.id = s.id
        WHEN MATCHED AND s._pg_op = 'D' THEN DELETE
        WHEN MATCHED THEN UPDATE SET name = s.name, amount = s.amount, updated_at = s.updated_at,
            _pg_commit_lsn = s._pg_commit_lsn, _pg_commit_time = s._pg_commit_time, _pg_xid = s._pg_xid
        WHEN NOT MATCHED AND s._pg_op <> 'D' THEN INSERT (id, name, amount, updated_at, _pg_commit_lsn,
            _pg_commit_time, _pg_xid) VALUES (s.id, s.name, s.amount, s.updated_at, s._pg_commit_lsn,
            s._pg_commit_time, s._pg_xid)
    """)


def timed(label: str, action: Any) -> float:
    started = time.perf_counter()
    action()
    elapsed = time.perf_counter() - started
    print(f"  {label:<44} {elapsed:7.2f} s", flush=True)
    return elapsed


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    result = {}
    for pair in values:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes KEY=VALUE, not {pair!r}")
        result[key.strip()] = value.strip()
    return result


def _copy(path: str, to: Path) -> str:
    return shutil.copytree(path, str(to))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--smoke", action="store_true", help="2,000 changes into 20,000 and 200,000 rows")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--table-property", action="append", default=[], help="KEY=VALUE for the job's tables")
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE for the Spark session")
    parser.add_argument("--work", default=str(Path(__file__).resolve().parent / ".work" / "merge"))
    parser.add_argument("--driver-memory", default="8g")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "merge_bench.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.changes, args.small, args.large = 2_000, 20_000, 200_000

    properties = dict(DEFAULT_TABLE_PROPERTIES)
    properties.update(_pairs(args.table_property, "--table-property"))
    options = MergeOptions(table_properties=properties)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    load_before = os.getloadavg()
    conf = {"spark.driver.memory": args.driver_memory, **_pairs(args.conf, "--conf")}
    spark = build_spark_session("local[*]", app_name="pgdecode-merge-bench", extra_conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    sizes = {"small": args.small, "large": args.large}
    new_keys_from = max(NEW_KEYS_FROM, 2 * max(sizes.values()))
    try:
        print(
            f"building tables of {args.small:,} and {args.large:,} rows and per size a batch of {args.changes:,}"
            " changes keyed uniformly over that table",
            flush=True,
        )
        started = time.perf_counter()
        copies: dict[str, list[str]] = {}
        batches: dict[str, str] = {}
        collapsed_files: dict[str, str] = {}
        expected: dict[str, dict[str, int]] = {}
        collapsed_rows: dict[str, int] = {}
        for size, rows in sizes.items():
            job_table = create_job_table(
                spark, work / f"base-{size}", str(work / f"base-{size}" / "delta"), rows, options
            )
            bare_table = create_bare_table(spark, str(work / f"base-{size}" / "bare"), rows)
            # Each measurement runs on a fresh copy of its table.
            copies[f"bare-{size}"] = [_copy(bare_table, work / f"bare-{size}-{i}") for i in range(args.repeats)]
            copies[f"job-{size}"] = [
                _copy(job_table, work / f"job-{size}-{i}" / "public" / "items") for i in range(args.repeats)
            ]
            staged, collapsed, expected[size] = make_changes(args.changes, rows, new_keys_from=new_keys_from)
            collapsed_rows[size] = collapsed.num_rows
            collapsed_files[size] = str(work / f"collapsed-{size}.parquet")
            pq.write_table(collapsed, collapsed_files[size])
            batches[size] = write_batch(
                work / f"staging-{size}", 0x1_0000_0000, 0x1_0000_0000 + (args.changes + 1) * 64, staged
            )
        print(f"  set-up {time.perf_counter() - started:.0f} s", flush=True)

        # Warm the JVM (JIT, class loading) on throwaway tables so no measured run pays for it.
        warm_staged, warm_collapsed, _ = make_changes(2_000, 10_000, seed=7)
        create_job_table(spark, work / "warm", str(work / "warm" / "delta"), 10_000, options)
        warm_bare = create_bare_table(spark, str(work / "warm" / "bare"), 10_000)
        pq.write_table(warm_collapsed, str(work / "warm.parquet"))
        bare_merge(spark, warm_bare, str(work / "warm.parquet"))
        merge_batches(
            spark,
            [write_batch(work / "warm-staging", 0x1_0000_0000, 0x2_0000_0000, warm_staged)],
            str(work / "warm" / "delta"),
            options,
        )

        print("timings:", flush=True)
        summaries: list[tuple[str, dict[str, Any]]] = []
        best: dict[str, float] = {}
        for run in range(args.repeats):
            for size, rows in sizes.items():
                best[f"bare-{size}"] = min(
                    best.get(f"bare-{size}", 1e9),
                    timed(
                        f"bare MERGE, {rows:,} rows",
                        lambda run=run, size=size: bare_merge(
                            spark, copies[f"bare-{size}"][run], collapsed_files[size]
                        ),
                    ),
                )
                best[f"job-{size}"] = min(
                    best.get(f"job-{size}", 1e9),
                    timed(
                        f"pgdecode job, {rows:,} rows",
                        lambda run=run, size=size: summaries.append(
                            (size, merge_batches(spark, [batches[size]], str(work / f"job-{size}-{run}"), options))
                        ),
                    ),
                )

        for size, rows in sizes.items():
            for kind, seed_rows in (("bare", 0), ("job", 1)):
                for path in copies[f"{kind}-{size}"]:
                    count = spark.read.format("delta").load(path).count()
                    want = rows + seed_rows + expected[size]["inserts"] - expected[size]["deletes"]
                    assert count == want, f"{kind}-{size}: {count} rows, expected {want}"
        for size, summary in summaries:
            table = summary["tables"]["public.items"]
            want = expected[size]
            assert (table["inserted"], table["updated"], table["deleted"]) == (
                want["inserts"],
                want["updates"],
                want["deletes"],
            ), (size, table, want)

        report = {
            "changes": args.changes,
            "small_rows": args.small,
            "large_rows": args.large,
            "collapsed_rows_small": collapsed_rows["small"],
            "collapsed_rows_large": collapsed_rows["large"],
            "bare_merge_small_s": round(best["bare-small"], 2),
            "job_small_s": round(best["job-small"], 2),
            "bare_merge_large_s": round(best["bare-large"], 2),
            "job_large_s": round(best["job-large"], 2),
            "job_over_bare_small": round(best["job-small"] / best["bare-small"], 2),
            "job_over_bare_large": round(best["job-large"] / best["bare-large"], 2),
            "job_large_over_small": round(best["job-large"] / best["job-small"], 2),
            "bare_large_over_small": round(best["bare-large"] / best["bare-small"], 2),
            "repeats": args.repeats,
            "table_properties": properties,
            "conf": _pairs(args.conf, "--conf"),
            "cores": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        }
        print(
            f"ratio job / bare MERGE, {args.small:,} rows:   {report['job_over_bare_small']:.2f}x  (aim <= 1.2x)\n"
            f"ratio job / bare MERGE, {args.large:,} rows:  {report['job_over_bare_large']:.2f}x  (aim <= 1.2x)\n"
            f"ratio job {args.large:,} / {args.small:,} rows: {report['job_large_over_small']:.2f}x  (aim <= 3x)\n"
            f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(json.dumps(report))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
