"""Object storage benchmark: extract and merge on a local S3-compatible server against a local disk.

In one run, on one throwaway PostgreSQL cluster, one local S3 server (moto, a process on
127.0.0.1) and one workload of ``--changes`` changes in one ``test_decoding`` slot:

1. extract to a local staging root, and the same slot range to ``s3://bench/staging``
   (the batch is written in the local spool and uploaded, manifest last);
2. the merge job, in one local Spark session, of the local batch into a local Delta table and of
   the S3 batch into a Delta table on S3 (``s3a://``), each into an empty table and then a second
   batch of updates merged into it.

Prints each time and the ratios S3 ÷ local (above 1: slower on S3). moto keeps objects in its
process's memory, so this measures the protocol and the upload path, not a real network.
Usage::

    make bench-s3            # or: .venv/bin/python -m bench.object_store_bench --changes 200000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import psycopg

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from pgdecode_testing.s3_server import LocalS3Server

SLOT = "bench_s3"


def timed(label: str, action: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - started
    print(f"  {label:<44} {seconds:8.2f} s")
    return seconds, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=200_000)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)

    from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
    from airflow_provider_pgdecode.spark.session import build_spark_session, configure_object_store

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    with (
        tempfile.TemporaryDirectory(prefix="pgdecode-s3-bench-") as work,
        ThrowawayCluster() as cluster,
        LocalS3Server() as server,
    ):
        bucket = server.create_bucket("bench")
        # The merge job reads manifests with the AWS_* environment, as under spark-submit.
        os.environ.update(server.settings.to_env())
        s3 = Storage(bucket, server.settings)
        local = Storage(Path(work) / "local")
        dsn = cluster.create_database("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create table orders (id bigint primary key, customer text, amount numeric(12,2), note text)")
            conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (SLOT,))
            conn.execute(
                "insert into orders select g, 'customer ' || (g % 997), g * 1.25, md5(g::text)"
                f" from generate_series(1, {args.changes}) g"
            )
            ceiling = Lsn.parse(conn.execute("select pg_current_wal_flush_lsn()::text").fetchone()[0])
            print(f"Workload: {args.changes} inserts in one slot; extract up to {ceiling}")
            t_local, first_local = timed(
                "extract -> local disk", lambda: extract_batch(conn, SLOT, local, upto_lsn=ceiling)
            )
            t_s3, first_s3 = timed(
                "extract -> S3", lambda: extract_batch(conn, SLOT, s3.child("staging"), upto_lsn=ceiling)
            )
            conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (SLOT, first_local.end_lsn))
            conn.execute("update orders set amount = amount + 1 where id % 4 = 0")
            second_local = extract_batch(conn, SLOT, local, checkpoint=Checkpoint.from_manifest(first_local))
            second_s3 = extract_batch(
                conn,
                SLOT,
                s3.child("staging"),
                checkpoint=Checkpoint.from_manifest(first_s3),
                upto_lsn=Lsn.parse(second_local.ceiling_lsn),
            )

        spark = build_spark_session("local[2]", app_name="pgdecode-s3-bench", object_store=True)
        spark.sparkContext.setLogLevel("ERROR")
        configure_object_store(spark, server.settings)
        options = MergeOptions()
        try:
            print("Merge job (one Spark session, local[2]):")
            timed(
                "warm-up (not counted): batch 1 -> scratch Delta",
                lambda: merge_batches(spark, [first_local.path], local.uri("warm-up"), options),
            )
            m_local_1, _ = timed(
                "merge batch 1 local -> local Delta (insert)",
                lambda: merge_batches(spark, [first_local.path], local.uri("delta"), options),
            )
            m_s3_1, _ = timed(
                "merge batch 1 S3 -> S3 Delta (insert)",
                lambda: merge_batches(spark, [first_s3.path], s3.uri("delta"), options),
            )
            m_local_2, _ = timed(
                "merge batch 2 local -> local Delta (update)",
                lambda: merge_batches(spark, [second_local.path], local.uri("delta"), options),
            )
            m_s3_2, _ = timed(
                "merge batch 2 S3 -> S3 Delta (update)",
                lambda: merge_batches(spark, [second_s3.path], s3.uri("delta"), options),
            )
        finally:
            spark.stop()
        print("Ratios, S3 / local (one run):")
        print(f"  extract                 {t_s3 / t_local:6.2f}")
        print(f"  merge, insert batch     {m_s3_1 / m_local_1:6.2f}")
        print(f"  merge, update batch     {m_s3_2 / m_local_2:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
