"""`make demo`: the whole pgdecode cycle on embedded defaults, with real parts.

1. starts a throwaway PostgreSQL (wal_level=logical, prepared transactions on);
2. creates a small shop schema;
3. runs the ``pgdecode_incremental`` DAG with Airflow (SQLite metadata DB) and local Spark
   several times, with changes in between: inserts, updates, deletes, a key change, a TRUNCATE,
   an unchanged TOAST value, a prepared transaction committed in a later run and one rolled back;
   then brings a table whose rows predate the slot into the pipeline: ``pgdecode_backfill`` in
   ``add-table`` mode files the request, and the next incremental run copies it chunk by chunk;
4. prints, per table, the source row count, the Delta row count and whether they are equal,
   where the Delta tables are, and how to open the pgdecode view of the runs in Airflow's UI
   (an ``airflow api-server`` on the demo's Airflow home; docs/ui.md).

Everything lives under ``.demo/`` (removed and made anew on each run).

``make demo-s3`` (``scripts/demo.py --s3``) runs the same demo with the staged batches and the
Delta tables on a local S3-compatible server (moto's server mode, a process on 127.0.0.1): the
DAGs get ``staging_uri``/``delta_root`` as ``s3://`` locations and ``storage_conn_id`` naming an
Airflow ``aws`` connection with the server's ``endpoint_url``.

The merges run through a warm Spark Connect server (docs/spark-connect.md) that the script starts
on a free port of 127.0.0.1 (its output goes to ``.demo/logs/connect-server.log``) and stops at
the end, also on failure or Ctrl-C: the DAGs get ``spark_conn_id`` naming a ``spark_connect``
connection to it, and the final check reads Delta through it too. On S3 the server loads
hadoop-aws (``--object-store``) and gets the store's S3A settings as ``--conf
spark.hadoop.fs.s3a.*`` and its key pair as ``AWS_*`` environment. ``--spark-submit``
(``make demo SPARK=submit``) keeps the former path: one spark-submit per merge, and a local
Spark session for the check. Each run prints how long its merge task took.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # pgdecode_testing: the checkout's throwaway servers, not in the wheel
DEMO = REPO / ".demo"
SLOT = "pgdecode_demo"
TABLES = ("customers", "orders", "order_items", "suppliers")


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


@contextlib.contextmanager
def quiet_fds(log: Path):
    """Send what child processes (the JVM) write to stdout/stderr into ``log`` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


CONNECT_CONN_ID = "pgdecode_demo_connect"
CONNECT_START_TIMEOUT = 300.0
MERGE_SECONDS: list[tuple[str, float]] = []
"""(run, seconds of its merge task), for the closing summary."""


@contextlib.contextmanager
def connect_server(log: Path, *, s3_settings: Any = None) -> Iterator[int]:
    """A Spark Connect server (the package's server module) on a free port, its output in ``log``;
    yields the port once it accepts connections and stops it (SIGTERM, then SIGKILL) on the way out.
    It runs in a process group of its own: Ctrl-C reaches this script, whose ``finally`` stops it."""
    from pgdecode_testing.connect_server import ConnectServerError, LocalConnectServer

    log.parent.mkdir(parents=True, exist_ok=True)
    server = LocalConnectServer(master="local[*]", object_store=s3_settings, log_path=log)
    started = time.monotonic()
    try:
        try:
            server.start(timeout=CONNECT_START_TIMEOUT)
        except ConnectServerError as exc:
            raise SystemExit(f"{exc}\n(the whole log: {log})") from None
        print(f"    ready on {server.url} after {time.monotonic() - started:.0f} s (log: {log.relative_to(REPO)})")
        yield server.port
    finally:
        server.stop(grace=90)


def _log_time(line: str) -> datetime | None:
    try:
        return datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00"))
    except ValueError:
        return None


def task_seconds(lines: list[str], task_id: str) -> float | None:
    """How long ``airflow dags test`` ran the task: from its "starting" line to its "end task" line."""
    start = end = None
    for line in lines:
        if f"[DAG TEST] starting task_id={task_id} " in line:
            start = _log_time(line)
        elif f"[DAG TEST] end task task_id={task_id} " in line:
            end = _log_time(line)
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def run_dag(env: dict[str, str], conf: dict[str, object], label: str, dag_id: str = "pgdecode_incremental") -> None:
    banner(f"Airflow: airflow dags test {dag_id} ({label})")
    started = time.monotonic()
    airflow = str(Path(sys.executable).parent / "airflow")
    result = subprocess.run(
        [airflow, "dags", "test", dag_id, "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
    )
    log = DEMO / "logs" / f"{label.replace(' ', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stdout + result.stderr)
    states = [
        line for line in (result.stdout + result.stderr).splitlines() if "Marking run" in line or "state=" in line
    ]
    output = (result.stdout + result.stderr).splitlines()
    for line in output:
        if "Batch " in line and " LSN " in line and "changes in" in line:
            text = line[line.find("Batch ") :].replace(str(REPO) + "/", "")
            print("   ", text.split(" [")[0])
        elif "  snapshot " in line and ("chunk" in line or "TRUNCATE" in line):
            print("     ", line[line.find("snapshot ") :].split(" [")[0])
        elif "filed request" in line:
            print("     ", line[line.find("filed request") :])
        elif "prepared transaction" in line and (
            "committed at" in line or "rolled back at" in line or "still pending" in line
        ):
            print("     ", line[line.find("prepared transaction") :].split(" [")[0])
    merged = any("merge total: " in line and "merge total: 0 of " not in line for line in output)
    merge_seconds = task_seconds(output, "merge") if result.returncode == 0 else None
    if merge_seconds is not None and merged:
        print(f"    merge task: {merge_seconds:.1f} s")
        MERGE_SECONDS.append((label, merge_seconds))
    print(
        f"    finished in {time.monotonic() - started:.0f} s, exit code {result.returncode} (log: {log.relative_to(REPO)})"
    )
    if result.returncode != 0:
        print("\n".join((result.stdout + result.stderr).splitlines()[-40:]))
        raise SystemExit(f"the DAG run failed ({label}); see {log}")
    del states


def _local_check_session(on_s3: bool, store_env: dict[str, str]) -> Any:
    """A local Spark session for the final check (the ``--spark-submit`` path has no server)."""
    from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings
    from airflow_provider_pgdecode.spark.session import build_spark_session, configure_object_store

    with quiet_fds(DEMO / "logs" / "spark-check.log"):  # the JVM's start-up chatter
        spark = build_spark_session("local[2]", app_name="pgdecode-demo-check", object_store=on_s3)
        spark.sparkContext.setLogLevel("OFF")
        if on_s3:
            lake = json.loads(store_env["AIRFLOW_CONN_PGDECODE_LAKE"])
            configure_object_store(
                spark,
                ObjectStoreSettings(
                    endpoint_url=lake["extra"]["endpoint_url"],
                    region=lake["extra"]["region_name"],
                    access_key=lake["login"],
                    secret_key=lake["password"],
                ),
            )
    return spark


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/demo.py", description="The whole pgdecode cycle, with real parts.")
    parser.add_argument(
        "--s3", action="store_true", help="staged batches and Delta tables on a local S3-compatible server (moto)"
    )
    parser.add_argument(
        "--spark-submit",
        action="store_true",
        help="merge with one spark-submit per run (the spark connection), not through a warm Spark Connect server",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from pgdecode_testing.postgres_cluster import ThrowawayCluster
    from pgdecode_testing.s3_server import LocalS3Server

    args = build_argument_parser().parse_args(sys.argv[1:] if argv is None else argv)
    on_s3 = args.s3
    warnings.filterwarnings("ignore", category=FutureWarning)  # pyspark on pandas 3
    shutil.rmtree(DEMO, ignore_errors=True)
    (DEMO / "airflow").mkdir(parents=True)
    staging, delta_root = str(DEMO / "staging"), str(DEMO / "delta")

    with contextlib.ExitStack() as stack:
        store_env: dict[str, str] = {}
        if on_s3:
            banner("S3: starting a local S3-compatible server (moto) with bucket pgdecode-demo")
            server = stack.enter_context(LocalS3Server(log_path=DEMO / "s3-server.log"))
            bucket = server.create_bucket("pgdecode-demo")
            staging, delta_root = f"{bucket}/staging", f"{bucket}/delta"
            store_env = {"AIRFLOW_CONN_PGDECODE_LAKE": server.airflow_conn_json()}
            print(f"    {server.endpoint_url}: {staging}, {delta_root}")
        connect_port = None
        if not args.spark_submit:
            banner(
                "Spark Connect: starting a warm server for the merges"
                + (" (hadoop-aws, the S3 server's S3A settings)" if on_s3 else "")
                + "; --spark-submit merges without it"
            )
            connect_port = stack.enter_context(
                connect_server(DEMO / "logs" / "connect-server.log", s3_settings=server.settings if on_s3 else None)
            )
        code = run_demo(ThrowawayCluster, staging, delta_root, store_env, on_s3, connect_port)
        if MERGE_SECONDS:
            how = "through the Spark Connect server" if connect_port else "with spark-submit"
            seconds = [s for _, s in MERGE_SECONDS]
            print(
                f"\n    merge task {how}: {', '.join(f'{s:.1f}' for s in seconds)} s"
                f" (mean {sum(seconds) / len(seconds):.1f} s over {len(seconds)} merging runs)"
            )
        if connect_port:
            banner("Spark Connect: stopping the server")
        return code


def run_demo(
    cluster_type: type,
    staging: str,
    delta_root: str,
    store_env: dict[str, str],
    on_s3: bool,
    connect_port: int | None = None,
) -> int:
    banner("PostgreSQL: starting a throwaway cluster with logical decoding")
    with cluster_type() as cluster:
        cluster.create_database("shop")
        import psycopg

        with psycopg.connect(cluster.dsn("shop")) as conn:
            # PG_VERSION picks the major (make demo PG_VERSION=17); say which one this run is on.
            version = conn.execute("SHOW server_version").fetchone()
        print(f"    PostgreSQL {version[0] if version else '?'}: {cluster.dsn('shop')}")

        env = {
            **os.environ,
            "AIRFLOW_HOME": str(DEMO / "airflow"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW_CONN_PGDECODE_DEFAULT": cluster.airflow_conn_json("shop"),
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[*]"}),
            "AIRFLOW__PGDECODE__WAIT_SECONDS": "5",
            "SPARK_LOCAL_IP": "127.0.0.1",
            **store_env,
        }
        spark_conn_id = "spark_default"
        if connect_port is not None:
            spark_conn_id = CONNECT_CONN_ID
            env[f"AIRFLOW_CONN_{CONNECT_CONN_ID.upper()}"] = json.dumps(
                {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_port}
            )
        banner("Airflow: creating the SQLite metadata database")
        subprocess.run(
            [str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True
        )
        conf = {"slot_name": SLOT, "staging_uri": staging, "delta_root": delta_root, "spark_conn_id": spark_conn_id}
        if on_s3:
            conf["storage_conn_id"] = "pgdecode_lake"

        with psycopg.connect(cluster.dsn("shop"), autocommit=True) as c:
            banner("PostgreSQL: schema, and a first run that creates the slot (two-phase)")
            c.execute(
                "create type order_status as enum ('new', 'paid', 'shipped', 'cancelled');"
                " create table customers (id int primary key, name text not null, email text, notes text);"
                " alter table customers alter column notes set storage external;"
                " create table orders (id bigint primary key, customer_id int, status order_status,"
                "  total numeric(12,2), tags text[], placed_at timestamptz);"
                " create table order_items (order_id bigint, line int, sku text, qty int, price numeric(10,2),"
                "  primary key (order_id, line));"
                # rows that predate the slot: the slot never carries them (add-table, below)
                " create table suppliers (id int primary key, name text, country char(2));"
                " insert into suppliers select g, 'Supplier ' || g, 'NL' from generate_series(1, 200) g"
            )
            run_dag(env, conf, "run 1 - slot created")

            banner("PostgreSQL: initial data, one prepared transaction left open, one to roll back")
            c.execute(
                "insert into customers select g, 'Customer ' || g, 'c' || g || '@shop.test', repeat('note ', 800)"
                " from generate_series(1, 50) g"
            )
            c.execute(
                "insert into orders select g, 1 + g % 50, 'new', g * 3.5, array['web', 'promo' || g % 3],"
                " '2026-11-01 00:00:00+00'::timestamptz + g * interval '7 minutes' from generate_series(1, 300) g"
            )
            c.execute(
                "insert into order_items select o, l, 'SKU-' || (o * 10 + l), 1 + l, 9.99 * l"
                " from generate_series(1, 300) o, generate_series(1, 3) l"
            )
            c.execute("begin; update orders set status = 'paid' where id <= 40; prepare transaction 'pay-batch-1'")
            c.execute("begin; delete from orders where id > 280; prepare transaction 'mistake-1'")
            run_dag(env, conf, "run 2 - initial data")

            banner("PostgreSQL: COMMIT PREPARED, ROLLBACK PREPARED, updates, deletes, a key change")
            c.execute("commit prepared 'pay-batch-1'")
            c.execute("rollback prepared 'mistake-1'")
            c.execute("update customers set email = 'vip' || id || '@shop.test' where id <= 5")  # notes stay TOASTed
            c.execute("update customers set id = 1001 where id = 50")
            c.execute("delete from order_items where order_id between 100 and 120")
            c.execute("update orders set status = 'shipped', total = total + 1 where id between 10 and 20")
            run_dag(env, conf, "run 3 - prepared transactions resolved")

            banner("PostgreSQL: a TRUNCATE in the middle of a transaction, then more orders")
            with c.transaction():
                c.execute("truncate order_items")
                c.execute("insert into order_items values (1, 1, 'SKU-NEW', 2, 5.00), (2, 1, 'SKU-NEW2', 1, 7.50)")
            c.execute(
                "insert into orders select g, 1 + g % 50, 'new', g * 1.5, '{}', now() from generate_series(301, 320) g"
            )
            run_dag(env, conf, "run 4 - truncate")

            banner("Backfill: suppliers' 200 rows predate the slot; add the table while changes go on")
            c.execute("update suppliers set country = 'BE' where id <= 10")
            run_dag(
                env,
                {**conf, "mode": "add-table", "tables": ["public.suppliers"], "wait_seconds": 0},
                "add-table request",
                dag_id="pgdecode_backfill",
            )
            c.execute("update suppliers set name = name || ' (renamed)' where id between 5 and 15")
            run_dag(env, conf, "run 5 - suppliers copied in chunks")

            all_equal = report_result(c, staging, delta_root, store_env, on_s3, connect_port)
    return 0 if all_equal else 1


def report_result(
    c: Any, staging: str, delta_root: str, store_env: dict[str, str], on_s3: bool, connect_port: int | None
) -> bool:
    """PostgreSQL against Delta for every table (printed), where things are, and where to see the view."""
    banner("Result: PostgreSQL (the oracle) against Delta")
    from airflow_provider_pgdecode.spark.session import build_connect_session
    from pgdecode_testing.compare import compare_table

    if connect_port is not None:  # the warm server reads Delta too (with its own S3A settings)
        spark = build_connect_session(f"sc://127.0.0.1:{connect_port}")
    else:
        spark = _local_check_session(on_s3, store_env)
    all_equal = True
    print(f"    {'table':<22} {'PostgreSQL rows':>16} {'Delta rows':>11}  equal")
    for table in TABLES:
        result = compare_table(c, spark, delta_root, "public", table)
        all_equal &= result.equal
        print(
            f"    {'public.' + table:<22} {result.source_rows:>16} {result.delta_rows:>11}  {'yes' if result.equal else 'NO'}"
        )
        if not result.equal:
            print("     ", result.describe())
    spark.stop()
    slot = c.execute(
        "select confirmed_flush_lsn, pg_current_wal_lsn() from pg_replication_slots where slot_name = %s",
        (SLOT,),
    ).fetchone()
    print(f"\n    slot {SLOT}: confirmed up to {slot[0]} (server WAL at {slot[1]})")
    print(f"    Delta tables: {delta_root}/public/<table>")
    print(f"    staged batches: {staging}/{SLOT}/")
    print(f"    Airflow home (SQLite DB, task logs): {DEMO / 'airflow'}")
    print_view_hint()
    return all_equal


def print_view_hint(port: int = 8080) -> None:
    """Where to open the pgdecode view (docs/ui.md) of the runs above: an API server on the
    demo's Airflow home. Every visitor is an admin there (a local look, not a deployment)."""
    airflow = Path(sys.executable).parent / "airflow"
    print(
        "\n    The pgdecode view of these runs (sources, slot lag, tables, batches; docs/ui.md):\n"
        f"      AIRFLOW_HOME={DEMO / 'airflow'} AIRFLOW__CORE__DAGS_FOLDER={REPO / 'dags'} "
        f"AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True \\\n"
        f"        {airflow} api-server --port {port}\n"
        f"      then open http://localhost:{port}/plugin/pgdecode (in Airflow's UI; the page alone: "
        f"http://localhost:{port}/pgdecode/).\n"
        "      The demo's PostgreSQL is gone by then: the page says its slot is unreachable."
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # The context managers have stopped the Spark Connect server, PostgreSQL and the S3 server.
        print("\ninterrupted: the demo's servers are stopped; .demo/ keeps what was done", file=sys.stderr)
        sys.exit(130)
