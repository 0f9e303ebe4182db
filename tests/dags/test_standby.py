"""pgdecode_incremental decoding on a physical standby (PostgreSQL 16+), with changes written on
the primary: a primary and a streaming standby started by the test from the same binaries.

The source connection points at the standby and names the primary as ``primary_conn_id``: the
slot is created on the standby (the primary asked to log its running transactions), peeked and
confirmed there, the heartbeat is written on the primary, an added table's watermarks too, and
Delta equals the primary's tables at the end. On 15 the same connection is refused with the reason.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest

from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot
from airflow_provider_pgdecode.errors import ServerNotReadyError, StandbyWriteError
from airflow_provider_pgdecode.postgres.slot import SlotClient
from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import ThrowawayCluster
from pgdecode_testing.postgres_standby import StandbyCluster
from tests.conftest import full_only_test, on_major

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ("sb_orders", "sb_notes")
SLOT = "pgdecode_on_standby"
"""The slot's name prefix: each test's is its own, so no test resumes from another's checkpoint in XCom."""


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.fixture
def topology(request):
    """A primary of the parametrized major and its hot standby, with a ``shop`` database."""
    with ThrowawayCluster(pg_version=request.param) as primary:
        primary.create_database("shop")
        with StandbyCluster(primary) as standby:
            yield primary, standby


def connections(monkeypatch, primary: ThrowawayCluster, standby: ThrowawayCluster, *, with_primary: bool) -> None:
    source = json.loads(standby.airflow_conn_json("shop"))
    if with_primary:
        source["extra"] = json.dumps({"primary_conn_id": "shop_primary"})
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", json.dumps(source))
    monkeypatch.setenv("AIRFLOW_CONN_SHOP_PRIMARY", primary.airflow_conn_json("shop"))


def run(dag, conf) -> dict[str, str]:
    from airflow.utils.state import DagRunState

    dag_run = dag.test(run_conf=conf)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    return states


def write_changes(conn: psycopg.Connection, base: int) -> None:
    conn.execute(
        f"insert into sb_orders select g, 'new', g * 1.5 from generate_series({base}, {base + 199}) g;"
        f" update sb_orders set status = 'paid' where id % 3 = 0 and id >= {base};"
        f" delete from sb_orders where id % 7 = 0 and id >= {base};"
        f" insert into sb_notes values ('n{base}'), ('n{base}')"  # keyless: the duplicates stay two rows
    )
    conn.execute("begin")
    conn.execute(f"insert into sb_orders values ({base + 1000}, 'prepared', 1)")
    conn.execute(f"prepare transaction 'sb_{base}'")
    conn.execute(f"commit prepared 'sb_{base}'")


@pytest.mark.parametrize(
    "topology",
    [
        on_major(16),
        # 17 decodes on a standby as 16 does; in make test its standby topology runs the failover test below.
        pytest.param(
            17,
            id="pg17",
            marks=[
                full_only_test("the failover test runs a 17 primary and standby; 16 runs this one"),
                *on_major(17).marks,
            ],
        ),
    ],
    indirect=True,
)
def test_incremental_dag_on_a_standby(topology, tmp_path, monkeypatch, airflow_db, merge_through_connect, spark):
    slot = f"{SLOT}_{uuid.uuid4().hex[:8]}"
    from airflow.dag_processing.dagbag import DagBag

    primary, standby = topology
    with primary.connect("shop") as conn:
        conn.execute(
            "create table sb_orders (id int primary key, status text, amount numeric(10,2));"
            " create table sb_notes (note text) ; alter table sb_notes replica identity full"
        )
    connections(monkeypatch, primary, standby, with_primary=True)
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    dag = bag.dags["pgdecode_incremental"]
    conf = {
        "slot_name": slot,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": [f"public.{t}" for t in TABLES],
        "table_options": {"public.sb_notes": {"mode": "append_only"}},
    }
    # First run: the slot is created on the standby (nothing to merge yet).
    run(dag, conf)
    with standby.connect("shop") as sconn:
        assert sconn.execute("select pg_is_in_recovery()").fetchone()[0]
        assert sconn.execute("select two_phase from pg_replication_slots where slot_name = %s", (slot,)).fetchone() == (
            True,
        )
        created_at = sconn.execute(
            "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
        ).fetchone()[0]
    with primary.connect("shop") as conn:
        assert conn.execute("select count(*) from pg_replication_slots where slot_name = %s", (slot,)).fetchone() == (
            0,
        )
        write_changes(conn, 1)
    standby.catch_up()
    states = run(dag, conf)
    assert states["merge"] == "success", states
    with primary.connect("shop") as conn, standby.connect("shop") as sconn:
        for table in TABLES:
            result = compare_table(conn, spark, str(tmp_path / "delta"), "public", table)
            assert result.equal, result.describe()
        # Confirmed on the standby: the slot there moved past the changes.
        moved = sconn.execute(
            "select confirmed_flush_lsn > %s::pg_lsn from pg_replication_slots where slot_name = %s",
            (created_at, slot),
        ).fetchone()
        assert moved == (True,)
        # A heartbeat asked on the standby is written on the primary and replayed before it returns.
        client = SlotClient(sconn)
        assert client.in_recovery()
        with pytest.raises(StandbyWriteError, match="primary_conn_id"):
            client.heartbeat()
    # A second round of changes through the same standby slot, and a table added to the pipeline:
    # its chunks are read on the standby, between watermarks written on the primary.
    with primary.connect("shop") as conn:
        conn.execute(
            "create table sb_late (id int primary key, v text);"
            " insert into sb_late select g, 'v' || g from generate_series(1, 250) g"
        )
        write_changes(conn, 5000)
    request_table_snapshot(conf["staging_uri"], slot, ["public.sb_late"], "add-table", chunk_rows=100)
    standby.catch_up()
    run(dag, conf)
    with primary.connect("shop") as conn:
        for table in (*TABLES, "sb_late"):
            result = compare_table(conn, spark, str(tmp_path / "delta"), "public", table)
            assert result.equal, result.describe()


@pytest.mark.postgres
@pytest.mark.parametrize("topology", [on_major(16)], indirect=True)
def test_heartbeat_goes_to_the_primary(topology, monkeypatch) -> None:
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook

    primary, standby = topology
    connections(monkeypatch, primary, standby, with_primary=True)
    with PgDecodeHook() as hook:
        hook.ensure_slot("hb_slot", plugin="test_decoding", two_phase=True)
        lsn = hook.emit_heartbeat(prefix="pgdecode.heartbeat")
        with standby.connect("shop") as sconn:
            replayed = sconn.execute("select pg_last_wal_replay_lsn() >= %s::pg_lsn", (str(lsn),)).fetchone()[0]
            rows = sconn.execute("select data from pg_logical_slot_peek_changes('hb_slot', null, null)").fetchall()
        assert replayed
        assert any("pgdecode.heartbeat" in row[0] for row in rows), rows
        assert hook.current_flush_lsn() >= lsn  # the standby's replay position is the ceiling
        hook.drop_slot("hb_slot")


@pytest.mark.postgres
@pytest.mark.parametrize("topology", [on_major(16)], indirect=True)
def test_a_table_snapshot_on_a_standby_without_its_primary_is_given_up_alone(topology, tmp_path, monkeypatch) -> None:
    """Without ``primary_conn_id`` a table snapshot's watermarks cannot be written: that request is
    given up with the way forward, and the batch's changes are staged as usual."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_pgdecode.capture.extract import extract_batch
    from airflow_provider_pgdecode.capture.table_snapshot import read_snapshot_state, write_snapshot_states
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
    from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor

    primary, standby = topology
    with primary.connect("shop") as conn:
        conn.execute(
            "create table sb_orders (id int primary key, status text, amount numeric(10,2));"
            " create table sb_late (id int primary key, v text);"
            " insert into sb_late select g, 'v' || g from generate_series(1, 50) g"
        )
    connections(monkeypatch, primary, standby, with_primary=True)
    with PgDecodeHook() as hook:  # the slot is created with the primary's help
        hook.ensure_slot("sb_alone", plugin="test_decoding", two_phase=True)
    with primary.connect("shop") as conn:
        conn.execute("insert into sb_orders select g, 'new', g from generate_series(1, 30) g")
    standby.catch_up()
    staging = tmp_path / "staging"
    request = request_table_snapshot(str(staging), "sb_alone", ["public.sb_late"], "add-table")
    with standby.connect("shop") as sconn:  # and now read without it
        manifest = extract_batch(sconn, "sb_alone", staging, tables=["public.sb_orders"])
    error = manifest.snapshots[request.id]["error"]
    assert manifest.snapshots[request.id]["done"] and "primary_conn_id" in error, manifest.snapshots
    assert {t.table: t.inserts for t in manifest.tables} == {"sb_orders": 30}
    assert manifest.snapshot_chunks == []
    # Once confirmed, the request's sensor says so, with both ways forward.
    write_snapshot_states(str(staging), "sb_alone", manifest.snapshots)
    assert read_snapshot_state(str(staging), "sb_alone", request.id)["error"] == error
    sensor = PgDecodeTableSnapshotSensor(
        task_id="wait", slot_name="sb_alone", staging_root=str(staging), request_id=request.id
    )
    with pytest.raises(AirflowFailException, match="primary_conn_id.*file a new request"):
        sensor.poke({})


@pytest.mark.postgres
@pytest.mark.parametrize("topology", [on_major(15)], indirect=True)
def test_a_standby_before_16_is_refused_with_the_reason(topology, monkeypatch) -> None:
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook

    primary, standby = topology
    connections(monkeypatch, primary, standby, with_primary=True)
    with PgDecodeHook() as hook:
        ok, message = hook.test_connection()
        assert not ok and "needs PostgreSQL 16" in message, message
        with pytest.raises(ServerNotReadyError, match="logical decoding on a standby needs PostgreSQL 16"):
            hook.ensure_slot("too_old", plugin="test_decoding", two_phase=True)


@pytest.fixture
def failover_topology(request):
    """A PostgreSQL 17 primary whose decoding waits for its standby (``synchronized_standby_slots``),
    and that standby, which keeps copies of the primary's failover slots."""
    with ThrowawayCluster(pg_version=request.param) as primary:
        primary.create_database("shop")
        with StandbyCluster(primary, sync_slots=True) as standby:
            with primary.connect() as conn:
                conn.execute(f"alter system set synchronized_standby_slots = '{standby.slot_name}'")
                conn.execute("select pg_reload_conf()")
            yield primary, standby


def sync_slot(standby: StandbyCluster, slot: str, confirmed: str, timeout: float = 60.0) -> None:
    """Wait until the standby's slot sync worker has a copy of ``slot`` that reached ``confirmed``."""
    import time

    deadline = time.monotonic() + timeout
    with standby.connect("shop") as sconn:
        while True:
            standby.catch_up()
            row = sconn.execute(
                "select synced, confirmed_flush_lsn >= %s::pg_lsn from pg_replication_slots where slot_name = %s",
                (confirmed, slot),
            ).fetchone()
            if row == (True, True):
                return
            if time.monotonic() > deadline:
                logs = sorted(standby.socket_dir.glob("server-*.log"))
                lines = logs[-1].read_text().splitlines()
                said = [line for line in lines if "synchroniz" in line or "DETAIL" in line][-2:]
                raise AssertionError(f"the standby's copy of {slot} is {row}: {said}")
            time.sleep(0.2)


@pytest.mark.parametrize("failover_topology", [on_major(17)], indirect=True)
def test_a_failover_slot_carries_the_pipeline_over_a_promotion(
    failover_topology, tmp_path, monkeypatch, airflow_db, merge_through_connect, spark
):
    slot = f"{SLOT}_failover"
    from airflow.dag_processing.dagbag import DagBag

    primary, standby = failover_topology
    with primary.connect("shop") as conn:
        conn.execute(
            "create table sb_orders (id int primary key, status text, amount numeric(10,2));"
            " create table sb_notes (note text) ; alter table sb_notes replica identity full"
        )
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", primary.airflow_conn_json("shop"))
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags["pgdecode_incremental"]
    conf = {
        "slot_name": slot,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": [f"public.{t}" for t in TABLES],
        "table_options": {"public.sb_notes": {"mode": "append_only"}},
        "failover": True,
    }
    run(dag, conf)
    with primary.connect("shop") as conn:
        # Failover, and on 17 not two-phase (unsafe together there): prepared transactions arrive at COMMIT PREPARED.
        assert conn.execute(
            "select failover, two_phase from pg_replication_slots where slot_name = %s", (slot,)
        ).fetchone() == (True, False)
        write_changes(conn, 1)
        # The standby copies the slot once the slot's catalog_xmin is one the standby holds: after it is
        # confirmed past a running-transactions record (a busy primary logs one every 15 s; asked for here).
        conn.execute("select pg_log_standby_snapshot()")
        conn.execute("insert into sb_notes values ('after the running transactions')")
    run(dag, conf)
    with primary.connect("shop") as conn:
        for table in TABLES:
            assert compare_table(conn, spark, str(tmp_path / "delta"), "public", table).equal
        confirmed = conn.execute(
            "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
        ).fetchone()[0]
    sync_slot(standby, slot, confirmed)
    # Changes the pipeline has not read yet when the primary goes away.
    with primary.connect("shop") as conn:
        write_changes(conn, 5000)
    standby.catch_up()
    primary.stop()
    standby.promote()
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", standby.airflow_conn_json("shop"))
    run(dag, conf)
    with standby.connect("shop") as conn:
        assert conn.execute("select pg_is_in_recovery()").fetchone() == (False,)
        assert conn.execute("select count(*) from sb_orders where id >= 5000").fetchone()[0] > 0
        for table in TABLES:
            result = compare_table(conn, spark, str(tmp_path / "delta"), "public", table)
            assert result.equal, result.describe()
