"""A Spark Connect server with Delta Lake, in the foreground: the warm Spark session merges use.

Run it where the Airflow workers reach it::

    python -m airflow_provider_pgdecode.spark.connect_server --port 15002 [--master local[*]] [--host 0.0.0.0]

It runs pip pyspark's ``SparkConnectServer`` through ``spark-submit`` with Delta's jars (the
project's Ivy cache, or ``$PGDECODE_DELTA_JARS``, as :mod:`.session` resolves them for the merge
job), Delta's SQL extension and catalog, and Spark's logging at ``$PGDECODE_SPARK_LOG_LEVEL``
(WARN). It prints one line when the port accepts connections::

    pgdecode Spark Connect server ready on sc://127.0.0.1:15002

Before that line it warms the server up (``--warm-up-rounds``, 3 by default; local masters only): a
few small Delta writes and MERGEs of the merge job's shape on a scratch table in a temporary
directory, so that the first merges an Airflow task sends do not pay for loading and compiling
Spark's and Delta's classes (measured: a cold server's first merge takes several times a warm
one's). It stops the server (and exits) on SIGTERM or SIGINT. Point a ``spark_connect`` Airflow
connection (host and port) at it and give that connection to the DAG's ``spark_conn_id``
(docs/spark-connect.md). Plain Python: no Airflow.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from airflow_provider_pgdecode.spark.session import (
    DEFAULT_CONNECT_PORT,
    DEFAULT_MASTER,
    LOOPBACK,
    connect_server_command,
    spark_log_level,
    spark_submit_env,
)

log = logging.getLogger("airflow_provider_pgdecode.spark.connect_server")

READY_PREFIX = "pgdecode Spark Connect server ready on "
"""The start of the line printed once the server accepts connections (what scripts wait for)."""

DEFAULT_WARM_UP_ROUNDS = 3

SPARK_OUT_OF_MEMORY_EXIT = 52
"""Spark's exit code when its JVM runs out of memory (``SparkExitCode.OOM``)."""

DEFAULT_START_TIMEOUT = 300.0
"""Seconds to wait for the port: the first start resolves Delta's jars from Maven Central."""


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _probe_host(host: str) -> str:
    return LOOPBACK if host in ("0.0.0.0", "", "::") else host


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_provider_pgdecode.spark.connect_server",
        description="Run a Spark Connect server with Delta Lake in the foreground (stop it with SIGTERM).",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_CONNECT_PORT, help="gRPC port (default %(default)s)")
    parser.add_argument(
        "--host",
        default=LOOPBACK,
        help="address to listen on (default %(default)s; 0.0.0.0 for workers on other machines)",
    )
    parser.add_argument("--master", default=DEFAULT_MASTER, help="Spark master (default %(default)s)")
    parser.add_argument("--driver-memory", default="1g", help="the server's heap (default %(default)s)")
    parser.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="more Spark settings; repeat for more"
    )
    parser.add_argument(
        "--object-store",
        action="store_true",
        help="also load hadoop-aws, for s3:// batches and Delta roots (S3A settings: --conf spark.hadoop.fs.s3a.*, "
        "credentials in the AWS_* environment)",
    )
    parser.add_argument(
        "--log-level", default=None, help="Spark's own logging (default $PGDECODE_SPARK_LOG_LEVEL, else WARN)"
    )
    parser.add_argument(
        "--warm-up-rounds",
        type=int,
        default=DEFAULT_WARM_UP_ROUNDS,
        metavar="N",
        help="small MERGEs on a scratch Delta table before the ready line (default %(default)s; 0: none; "
        "local masters only)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT,
        help="seconds to wait for the port before giving up (default %(default)s)",
    )
    return parser


def warm_up(url: str, rounds: int = DEFAULT_WARM_UP_ROUNDS) -> float:
    """Run ``rounds`` small MERGEs of the merge job's shape (deletes, updates, inserts, the
    transaction id, both ways of evaluating expressions) on a scratch Delta table in a temporary
    directory of this host, through a client session of the server at ``url``; return the seconds
    taken. The directory is removed afterwards."""
    import shutil
    import tempfile

    from airflow_provider_pgdecode.spark.merge_job import (
        DEFAULT_TABLE_PROPERTIES,
        SMALL_RUN_CONF,
        delta_ref,
        transaction_id,
    )
    from airflow_provider_pgdecode.spark.session import build_connect_session

    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="pgdecode-warm-up-")
    spark = build_connect_session(url)
    try:
        path = f"{scratch}/warm_up"
        table = delta_ref(path)
        properties = ", ".join(f"'{k}' = '{v}'" for k, v in DEFAULT_TABLE_PROPERTIES.items())
        spark.sql(f"CREATE TABLE {table} (id INT, name STRING, lsn BIGINT) USING delta TBLPROPERTIES ({properties})")
        spark.range(200).selectExpr("CAST(id AS INT) AS id", "CAST(id AS STRING) AS name", "0L AS lsn").write.format(
            "delta"
        ).mode("append").save(path)
        for round_ in range(1, rounds + 1):
            settings = SMALL_RUN_CONF if round_ % 2 else {}
            for key, value in settings.items():
                spark.conf.set(key, value)
            source = spark.range(round_ * 50, round_ * 50 + 200).selectExpr(
                "CAST(id AS INT) AS id",
                f"CAST(id * {round_} AS STRING) AS name",
                f"CAST({round_} AS BIGINT) AS lsn",
                "CASE WHEN id % 7 = 0 THEN 'D' ELSE 'U' END AS kind",
            )
            source.groupBy("kind").count().collect()
            source.createOrReplaceTempView("pgdecode_warm_up_source")
            with transaction_id(spark, "warm_up", round_):
                spark.sql(
                    f"MERGE INTO {table} AS t USING pgdecode_warm_up_source AS s ON t.id = s.id "
                    "WHEN MATCHED AND s.kind = 'D' AND t.lsn < s.lsn THEN DELETE "
                    "WHEN MATCHED AND s.kind = 'U' AND t.lsn < s.lsn THEN UPDATE SET name = s.name, lsn = s.lsn "
                    "WHEN NOT MATCHED AND s.kind = 'U' THEN INSERT (id, name, lsn) VALUES (s.id, s.name, s.lsn)"
                )
            for key in settings:
                spark.conf.unset(key)
    finally:
        spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return time.monotonic() - started


def _parse_conf(pairs: Sequence[str]) -> dict[str, str]:
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--conf expects KEY=VALUE, got {pair!r}")
        conf[key.strip()] = value
    return conf


def _warm_up_before_ready(url: str, master: str, rounds: int) -> None:
    """:func:`warm_up` on a local master; a failed warm-up is logged and the server still serves
    (it costs only the first merges' speed)."""
    if rounds <= 0:
        return
    if not master.startswith("local"):
        log.info(
            "no warm-up: the scratch table would be on this host, which a %s cluster's executors may not reach", master
        )
        return
    try:
        seconds = warm_up(url, rounds)
    except Exception as exc:
        log.warning("the warm-up failed (the server still serves; its first merges are slower): %s", exc)
        return
    log.info("warmed up with %d small MERGEs in %.1f s", rounds, seconds)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    probe = _probe_host(args.host)
    if port_open(probe, args.port):
        print(
            f"port {args.port} on {probe} is already in use (another Spark Connect server?): "
            "stop it or choose another --port",
            file=sys.stderr,
        )
        return 1
    import os

    if args.log_level:
        os.environ["PGDECODE_SPARK_LOG_LEVEL"] = spark_log_level(args.log_level)
    command = connect_server_command(
        args.port,
        master=args.master,
        host=args.host,
        driver_memory=args.driver_memory,
        extra_conf=_parse_conf(args.conf),
        object_store=args.object_store,
    )
    process = subprocess.Popen(command, env=spark_submit_env(args.master))
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if process.poll() is None:
            process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + args.start_timeout
    ready = False
    while process.poll() is None and not stopping:
        if not ready and port_open(probe, args.port, timeout=0.5):
            ready = True
            _warm_up_before_ready(f"sc://{probe}:{args.port}", args.master, args.warm_up_rounds)
            if stopping or process.poll() is not None:
                break
            print(f"{READY_PREFIX}sc://{probe}:{args.port}", flush=True)
        elif not ready and time.monotonic() > deadline:
            print(
                f"the Spark Connect server did not accept connections on port {args.port} within "
                f"{args.start_timeout:.0f} s; see its log above. Stopping it",
                file=sys.stderr,
            )
            process.terminate()
            break
        time.sleep(0.5 if not ready else 1.0)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if stopping:
        log.info("Spark Connect server on port %d stopped", args.port)
        return 0
    if code == SPARK_OUT_OF_MEMORY_EXIT:
        print(
            f"the Spark Connect server on port {args.port} ran out of memory (exit code {code}, Spark's "
            "out-of-memory exit; its log above names the java.lang.OutOfMemoryError): start it again with more "
            f"--driver-memory (now {args.driver_memory})",
            file=sys.stderr,
        )
    elif ready:
        print(f"the Spark Connect server on port {args.port} exited (code {code})", file=sys.stderr)
    return code if code else 1


if __name__ == "__main__":
    sys.exit(main())
