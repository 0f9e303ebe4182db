"""Merge benchmark: our job against a bare Delta MERGE, and a 1M-row table against a 10M-row one.

    .venv/bin/python -m bench.merge_bench [--changes 100000] [--small 1000000] [--large 10000000]

One run, one local Spark (local[*]):

1. Two Delta tables are created the way the job creates them (a one-row batch), then filled with
   ``spark.range`` (``--small`` and ``--large`` rows, ids in order, so files cover key ranges).
   A copy of the small table is kept for the bare MERGE.
2. One staged batch of ``--changes`` changes is written per docs/staging-format.md: 60% updates
   (some keys several times), 10% deletes of existing keys, 30% inserts of new keys, each in its
   own transaction, in random key order.
3. Timed, each twice on fresh copies of the tables (the best run counts): the bare MERGE of the already-collapsed rows (the floor: no planning, collapse, TOAST
   or exactly-once work) into the small table; our job into the small table; our job into the
   large table. Each result is checked against the expected row count.

Prints the times and the ratios job/bare (aim: at most 1.5) and large/small (aim: well under 10),
and writes them to bench/results/merge_bench.json.
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

from airflow_provider_pgdecode.spark.merge_job import merge_batches  # noqa: E402
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


def make_changes(changes: int, small: int, seed: int = 42) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """The staged rows, the same rows collapsed to the last state per key, and expected counts."""
    rng = np.random.default_rng(seed)
    n_delete, n_insert = changes // 10, (changes * 3) // 10
    n_update = changes - n_delete - n_insert
    deleted = rng.choice(small, size=n_delete, replace=False)
    alive = np.setdiff1d(np.arange(small), deleted)
    updated = rng.choice(alive, size=n_update, replace=True)  # repeats: collapsed to the last
    inserted = NEW_KEYS_FROM + np.arange(n_insert)
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


def create_table(spark: Any, work: Path, delta_root: str, rows: int, name: str) -> str:
    """A table created by the job (its schema and properties), filled with ``rows`` rows in key order."""
    seed = staged_table(np.array([-1]), np.array(["I"]), np.array([64]))
    merge_batches(spark, [write_batch(work / f"seed-{name}", 1, 128, seed)], delta_root + "/" + name)
    path = f"{delta_root}/{name}/public/items"
    files = max(1, rows // 250_000)
    (
        spark.range(0, rows, 1, files)
        .selectExpr(
            "id",
            "concat('name-', id) as name",
            "cast((id % 100000) / 100 as decimal(12,2)) as amount",
            "timestamp_micros(1600000000000000 + id) as updated_at",
            "cast(96 as bigint) as _pg_commit_lsn",
            "timestamp_micros(1600000000000000) as _pg_commit_time",
            "cast(7 as bigint) as _pg_xid",
        )
        .write.format("delta")
        .mode("append")
        .save(path)
    )
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--work", default=str(Path(__file__).resolve().parent / ".work" / "merge"))
    parser.add_argument("--driver-memory", default="8g")
    args = parser.parse_args(argv)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    delta_root = str(work / "delta")
    spark = build_spark_session(
        "local[*]", app_name="pgdecode-merge-bench", extra_conf={"spark.driver.memory": args.driver_memory}
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        print(
            f"building tables of {args.small:,} and {args.large:,} rows and a batch of {args.changes:,} changes",
            flush=True,
        )
        started = time.perf_counter()
        small = create_table(spark, work, delta_root, args.small, "small")
        large = create_table(spark, work, delta_root, args.large, "large")
        # Each measurement runs twice, on fresh copies of the same table; the best run counts.
        copies = {
            "bare": [shutil.copytree(small, str(work / f"bare-{i}" / "items")) for i in range(REPEATS)],
            "small": [shutil.copytree(small, f"{delta_root}/small-{i}/public/items") for i in range(REPEATS)],
            "large": [shutil.copytree(large, f"{delta_root}/large-{i}/public/items") for i in range(REPEATS)],
        }
        staged, collapsed, expected = make_changes(args.changes, args.small)
        collapsed_file = str(work / "collapsed.parquet")
        pq.write_table(collapsed, collapsed_file)
        batch = write_batch(work / "staging", 0x1_0000_0000, 0x1_0000_0000 + (args.changes + 1) * 64, staged)
        print(f"  set-up {time.perf_counter() - started:.0f} s", flush=True)

        # Warm the JVM (JIT, class loading) on a throwaway table so no measured run pays for it.
        warm_staged, warm_collapsed, _ = make_changes(2_000, 10_000, seed=7)
        warm = create_table(spark, work, str(work / "warm"), 10_000, "t")
        pq.write_table(warm_collapsed, str(work / "warm.parquet"))
        bare_merge(spark, warm, str(work / "warm.parquet"))
        merge_batches(
            spark,
            [write_batch(work / "warm-staging", 0x1_0000_0000, 0x2_0000_0000, warm_staged)],
            str(work / "warm" / "t"),
        )

        print("timings:", flush=True)
        results: dict[str, Any] = {}
        best: dict[str, float] = {}
        for run in range(REPEATS):
            best["bare"] = min(
                best.get("bare", 1e9),
                timed(
                    f"bare MERGE of collapsed rows, {args.small:,} rows",
                    lambda run=run: bare_merge(spark, copies["bare"][run], collapsed_file),
                ),
            )
            best["small"] = min(
                best.get("small", 1e9),
                timed(
                    f"pgdecode job, {args.small:,} rows",
                    lambda run=run: results.__setitem__(
                        f"small-{run}", merge_batches(spark, [batch], f"{delta_root}/small-{run}")
                    ),
                ),
            )
            best["large"] = min(
                best.get("large", 1e9),
                timed(
                    f"pgdecode job, {args.large:,} rows",
                    lambda run=run: results.__setitem__(
                        f"large-{run}", merge_batches(spark, [batch], f"{delta_root}/large-{run}")
                    ),
                ),
            )
        bare_small, job_small, job_large = best["bare"], best["small"], best["large"]

        for name, paths, base in (
            ("bare", copies["bare"], args.small),
            ("small", copies["small"], args.small),
            ("large", copies["large"], args.large),
        ):
            for path in paths:
                count = spark.read.format("delta").load(path).count()
                want = base + 1 + expected["inserts"] - expected["deletes"]
                assert count == want, f"{name}: {count} rows, expected {want}"
        for summary in results.values():
            table = summary["tables"]["public.items"]
            assert (table["inserted"], table["deleted"]) == (expected["inserts"], expected["deletes"]), table
            assert table["updated"] == expected["updates"], table

        report = {
            "changes": args.changes,
            "small_rows": args.small,
            "large_rows": args.large,
            "collapsed_rows": collapsed.num_rows,
            "bare_merge_small_s": round(bare_small, 2),
            "job_small_s": round(job_small, 2),
            "job_large_s": round(job_large, 2),
            "job_over_bare": round(job_small / bare_small, 2),
            "large_over_small": round(job_large / job_small, 2),
            "cores": os.cpu_count(),
        }
        print(f"ratio job / bare MERGE ({args.small:,} rows):      {report['job_over_bare']:.2f}x  (aim <= 1.5x)")
        print(
            f"ratio {args.large:,} / {args.small:,} rows (job):  {report['large_over_small']:.2f}x  (aim well under 10x)"
        )
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        (out / "merge_bench.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
