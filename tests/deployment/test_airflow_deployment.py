"""The DAGs on a real Airflow deployment: scheduler, DAG processor, triggerer and API server as
separate processes (:class:`~pgdecode_testing.airflow_deployment.AirflowDeployment`),
the throwaway PostgreSQL as the metadata database, the LocalExecutor, real Spark and Delta. The
merges run as client sessions of the test session's Spark Connect server (a ``spark_connect``
``spark_default``), as a deployment that wants its lake seconds behind PostgreSQL would run them;
the DAG tests in tests/dags/ run the spark-submit path.

One deployment serves the module, in order:

1. a DAG scheduled on the slot's Asset through the event trigger: changes committed in
   PostgreSQL reach Delta with no manual trigger, twice in a row, one run each;
2. the cron-scheduled ``pgdecode_incremental`` (``[pgdecode] schedule`` every minute): a run
   catches up, and the next one's deferred sensor waits in the triggerer until changes arrive;
3. ``airflow backfill create`` of ``pgdecode_backfill`` (replay) over two logical dates:
   two runs under the scheduler, the Delta tables written by the first and unchanged by the
   repeat, and equal to the source (with ``PGDECODE_FULL_TESTS=1``).

Nothing here triggers a DAG run by hand: runs come from the trigger, the clock and the backfill.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgdecode_testing.airflow_deployment import AirflowDeployment
from pgdecode_testing.compare import compare_table
from pgdecode_testing.connect_server import LocalConnectServer
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from tests.conftest import full_only_test

# A real deployment: migrating its database and starting four components take minutes.
pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
SOURCE_DB, METADATA_DB = "deploy_source", "deploy_airflow"
EVENT_DAG, EVENT_SLOT = "deploy_event", "deploy_event"
CRON_SLOT = "pgdecode"  # pgdecode_incremental's default: its scheduled runs take the defaults
TABLES = ("dep_customers", "dep_orders")
RUN_TIMEOUT = 420.0

EVENT_DAG_FILE = f'''"""The airflow dag {EVENT_DAG}: pgdecode_event_driven's cycle on the test's slot."""

from airflow_provider_pgdecode.example_dags.pgdecode_event_driven import event_driven_dag

dag = event_driven_dag({EVENT_DAG!r}, slot_name={EVENT_SLOT!r}, poll_interval=2, data_dir={{data_dir!r}})
'''


@dataclass
class Deployment:
    airflow: AirflowDeployment
    cluster: ThrowawayCluster
    data_dir: Path

    def source(self) -> psycopg.Connection[Any]:
        return self.cluster.connect(SOURCE_DB)

    def meta(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Rows of a query on Airflow's metadata database."""
        with self.cluster.connect(METADATA_DB) as conn:
            return conn.execute(query, params).fetchall()

    def runs(self, dag_id: str) -> list[tuple[str, str, str]]:
        """``(run_id, run_type, state)`` of ``dag_id``'s runs, oldest first."""
        rows = self.meta("SELECT run_id, run_type, state FROM dag_run WHERE dag_id = %s ORDER BY id", dag_id)
        return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    def wait_for_runs(self, dag_id: str, count: int, *, run_type: str | None = None) -> list[tuple[str, str, str]]:
        """Wait until ``dag_id`` has ``count`` finished runs (of ``run_type``); fail on a failed one."""

        def finished() -> list[tuple[str, str, str]] | None:
            runs = [r for r in self.runs(dag_id) if run_type is None or r[1] == run_type]
            failed = [r for r in runs if r[2] == "failed"]
            assert not failed, f"{dag_id}: failed run(s) {failed}; task states {self.task_states(dag_id)}"
            done = [r for r in runs if r[2] == "success"]
            return done if len(done) >= count else None

        return self.airflow.wait_for(
            finished, timeout=RUN_TIMEOUT * count, what=f"{count} successful run(s) of {dag_id}", interval=2
        )

    def task_states(self, dag_id: str) -> list[tuple[str, str, str]]:
        rows = self.meta(
            "SELECT run_id, task_id, state FROM task_instance WHERE dag_id = %s ORDER BY run_id, task_id", dag_id
        )
        return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    def assert_delta_equals_source(self, spark: Any, delta_root: Path) -> None:
        with self.source() as conn:
            for table in TABLES:
                result = compare_table(conn, spark, str(delta_root), "public", table)
                assert result.equal, result.describe()


@pytest.fixture(scope="module")
def deployment(
    pg_cluster: ThrowawayCluster, spark_connect_server: LocalConnectServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deployment")
    data_dir, dags = root / "data", root / "dags"
    dags.mkdir()
    for name in ("pgdecode_incremental", "pgdecode_backfill"):
        shutil.copy(REPO / "dags" / f"{name}.py", dags / f"{name}.py")
    (dags / f"{EVENT_DAG}.py").write_text(EVENT_DAG_FILE.format(data_dir=str(data_dir / "event")), encoding="utf-8")

    pg_cluster.create_database(SOURCE_DB)
    pg_cluster.create_database(METADATA_DB)
    with pg_cluster.connect(SOURCE_DB) as conn:
        conn.execute(
            "CREATE TABLE dep_customers (id int PRIMARY KEY, name text, note text);"
            " CREATE TABLE dep_orders (id bigint PRIMARY KEY, customer_id int, amount numeric(10,2), status text)"
        )
        # Both pipelines' slots exist before the first row: each sees every change (the DAGs'
        # ensure_slot would create them too, after the rows already there).
        for slot in (EVENT_SLOT, CRON_SLOT):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot,))
    env = {
        "AIRFLOW_CONN_PGDECODE_DEFAULT": pg_cluster.airflow_conn_json(SOURCE_DB),
        "AIRFLOW_CONN_SPARK_DEFAULT": spark_connect_server.airflow_conn_json,
        "AIRFLOW__PGDECODE__DATA_DIR": str(data_dir),
        "AIRFLOW__PGDECODE__SCHEDULE": "* * * * *",
        "AIRFLOW__PGDECODE__WAIT_SECONDS": "600",  # the deferred sensor waits for the test's commit
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": str(REPO),
    }
    airflow = AirflowDeployment(
        root / "airflow",
        metadata_dsn=f"postgresql+psycopg2://{pg_cluster.user}@{pg_cluster.host}:{pg_cluster.port}/{METADATA_DB}",
        dags_folder=dags,
        env=env,
        parallelism=3,
    )
    try:
        with airflow:
            deployment = Deployment(airflow, pg_cluster, data_dir)
            airflow.wait_for(
                lambda: len(deployment.meta("SELECT dag_id FROM dag WHERE NOT is_stale")) >= 3,
                timeout=180,
                what="the DAG processor to store the three DAGs",
                tails=("dag-processor",),
            )
            yield deployment
    finally:
        with pg_cluster.connect(SOURCE_DB) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN (%s, %s)"
                " AND NOT active",
                (EVENT_SLOT, CRON_SLOT),
            )


def test_event_driven_runs_bring_each_commit_to_delta(deployment: Deployment, spark: Any) -> None:
    airflow = deployment.airflow
    airflow.cli("dags", "unpause", EVENT_DAG)
    # Unpaused, the DAG's Asset is watched: its trigger is stored and the triggerer runs it.
    trigger_id = airflow.wait_for(
        lambda: deployment.meta(
            "SELECT id FROM trigger WHERE classpath LIKE %s AND triggerer_id IS NOT NULL", "%.SlotChangesEventTrigger"
        ),
        timeout=120,
        what="the triggerer to run the slot's event trigger",
        tails=("dag-processor", "triggerer"),
    )[0][0]

    with deployment.source() as c:
        c.execute("INSERT INTO dep_customers SELECT g, 'c' || g, repeat('x', 3000) FROM generate_series(1, 20) g")
        c.execute("INSERT INTO dep_orders SELECT g, g % 20, g * 2.5, 'new' FROM generate_series(1, 100) g")
    (first,) = deployment.wait_for_runs(EVENT_DAG, 1)
    assert first[1] == "asset_triggered"
    deployment.assert_delta_equals_source(spark, deployment.data_dir / "event" / "delta")

    with deployment.source() as c:  # deletes too: no timestamp column, the slot sees them
        c.execute("UPDATE dep_orders SET status = 'paid' WHERE id <= 30")
        c.execute("DELETE FROM dep_orders WHERE id > 90")
        c.execute("UPDATE dep_customers SET name = 'renamed' WHERE id = 3")  # note: unchanged TOAST
    runs = deployment.wait_for_runs(EVENT_DAG, 2)
    deployment.assert_delta_equals_source(spark, deployment.data_dir / "event" / "delta")

    # One run per commit: the trigger did not fire again for changes a run had confirmed.
    assert (
        [(r[1], r[2]) for r in deployment.runs(EVENT_DAG)]
        == [("asset_triggered", "success")] * 2
        == [(r[1], r[2]) for r in runs]
    )
    events = deployment.meta(
        "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE a.uri = %s ORDER BY e.id",
        f"pgdecode-slot://pgdecode_default/{EVENT_SLOT}",
    )
    payloads = [(e[0] if isinstance(e[0], dict) else json.loads(e[0]))["payload"] for e in events]
    assert [p["status"] for p in payloads] == ["success", "success"]
    assert payloads[1]["confirmed_flush_lsn"] != payloads[0]["confirmed_flush_lsn"]
    # The watcher's own log lines go to the triggerer's output (it has no task log).
    assert f"ID {trigger_id}" in airflow.log("triggerer")
    airflow.cli("dags", "pause", EVENT_DAG)


def test_cron_runs_and_a_deferred_sensor_waits_in_the_triggerer(deployment: Deployment, spark: Any) -> None:
    airflow = deployment.airflow
    airflow.cli("dags", "unpause", "pgdecode_incremental")
    # The first scheduled run catches up with the slot (every change so far).
    (first,) = deployment.wait_for_runs("pgdecode_incremental", 1, run_type="scheduled")
    deployment.assert_delta_equals_source(spark, deployment.data_dir / "delta")

    # The next minute's run finds nothing: its sensor defers (default_deferrable) to the triggerer.
    deferred = airflow.wait_for(
        lambda: deployment.meta(
            "SELECT ti.run_id, ti.trigger_id, t.classpath FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id"
            " WHERE ti.dag_id = 'pgdecode_incremental' AND ti.task_id = 'wait_for_changes' AND ti.state = 'deferred'"
        ),
        timeout=RUN_TIMEOUT,
        what="a deferred wait_for_changes of pgdecode_incremental",
        tails=("scheduler", "triggerer"),
    )
    run_id, trigger_id, classpath = deferred[0]
    assert classpath == "airflow_provider_pgdecode.triggers.slot_changes.SlotChangesTrigger"

    def polled_in_the_triggerer() -> bool:
        # The trigger's lines go to the task's trigger log (<attempt>.log.trigger.<job id>.log);
        # "next poll in" is written by SlotChangesTrigger.run, which only the triggerer runs.
        logs = airflow.task_logs("pgdecode_incremental")
        return any(
            f"run_id={run_id}" in path
            and "task_id=wait_for_changes" in path
            and ".trigger." in path
            and "next poll in" in text
            for path, text in logs.items()
        ) or f"pgdecode_incremental/{run_id}/wait_for_changes" in airflow.log("triggerer")

    airflow.wait_for(
        polled_in_the_triggerer, timeout=90, what=f"the triggerer to run trigger {trigger_id}", tails=("triggerer",)
    )

    with deployment.source() as c:
        c.execute("INSERT INTO dep_orders SELECT g, 7, 1.25, 'late' FROM generate_series(200, 220) g")
        c.execute("DELETE FROM dep_customers WHERE id = 5")
    runs = deployment.wait_for_runs("pgdecode_incremental", 2, run_type="scheduled")
    airflow.cli("dags", "pause", "pgdecode_incremental")
    assert run_id in [r[0] for r in runs]
    states = {t: s for r, t, s in deployment.task_states("pgdecode_incremental") if r == run_id}
    assert states["wait_for_changes"] == "success" and states["confirm"] == "success", states
    deployment.assert_delta_equals_source(spark, deployment.data_dir / "delta")


def delta_commits(table: Path) -> list[int]:
    """The commit timestamps (ms) of a Delta table, in version order, read from its log."""
    stamps = []
    for entry in sorted((table / "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "commitInfo" in action:
                stamps.append(int(action["commitInfo"]["timestamp"]))
    return stamps


@full_only_test(
    "the backfill DAG's replays are tested in tests/dags/test_pgdecode_backfill.py; this adds the scheduler's"
    " backfill runs in a deployment"
)
def test_airflow_backfill_create_replays_two_dates_idempotently(deployment: Deployment, spark: Any) -> None:
    airflow = deployment.airflow
    airflow.cli("dags", "unpause", "pgdecode_backfill")  # the scheduler runs a paused DAG's backfills not
    airflow.cli(
        "backfill",
        "create",
        "--dag-id",
        "pgdecode_backfill",
        "--from-date",
        "2026-03-01",
        "--to-date",
        "2026-03-02",
        "--max-active-runs",
        "1",
        "--dag-run-conf",
        json.dumps({"mode": "replay"}),
    )
    runs = deployment.wait_for_runs("pgdecode_backfill", 2, run_type="backfill")
    airflow.cli("dags", "pause", "pgdecode_backfill")
    assert len(runs) == 2
    ends = deployment.meta(
        "SELECT logical_date, end_date FROM dag_run WHERE dag_id = 'pgdecode_backfill' AND run_type = 'backfill'"
        " ORDER BY logical_date"
    )
    assert [d.day for d, _ in ends] == [1, 2]
    merges = {r: s for r, t, s in deployment.task_states("pgdecode_backfill") if t == "merge"}
    assert sorted(merges[r[0]] for r in runs) == ["success"] * 2  # each run merged (no skip)

    replayed = deployment.data_dir / "delta_backfill"
    deployment.assert_delta_equals_source(spark, replayed)
    # The first run wrote the tables; the repeat committed nothing to them.
    first_end_ms = min(end for _, end in ends).timestamp() * 1000
    for table in TABLES:
        commits = delta_commits(replayed / "public" / table)
        assert commits, table
        assert max(commits) <= first_end_ms, (
            f"{table}: a repeat committed to Delta ({commits}, first run ended at {first_end_ms})"
        )
