"""A lost slot under pgdecode_incremental's ``on_slot_lost`` policy, on a real cluster that keeps
only 1 MB of WAL for slots (``max_slot_wal_keep_size``).

``fail`` stops the run with the slot's error, which names the policy as a way forward;
``resnapshot`` recreates the slot and reloads every table from a new snapshot: each Delta table
equals its source afterwards, replaced in one commit (one new Delta version per table, so a reader
sees the old rows or the new), the pipeline carries on from the new slot, and a second loss within
24 hours stops at ``max_slot_recoveries_per_day``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import ThrowawayCluster, remove_slot_wal

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

SLOT = "pgdecode_lost"
TABLES = ("lost_orders", "lost_notes")


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.fixture
def small_wal_cluster():
    with ThrowawayCluster({"max_slot_wal_keep_size": "1MB"}) as cluster:
        cluster.create_database("shop")
        yield cluster


def run(dag, conf):
    return dag.test(run_conf=conf)


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def write(conn, base: int) -> None:
    conn.execute(
        f"insert into lost_orders select g, 'new', g from generate_series({base}, {base + 99}) g;"
        f" update lost_orders set status = 'paid' where id % 4 = 0 and id >= {base};"
        f" delete from lost_orders where id % 9 = 0 and id >= {base};"
        f" insert into lost_notes values ('n{base}'), ('n{base}')"
    )


def delta_versions(spark, delta: Path) -> dict[str, int]:
    from delta.tables import DeltaTable

    return {t: DeltaTable.forPath(spark, str(delta / "public" / t)).history().count() for t in TABLES}


def assert_equal(conn, spark, delta: Path) -> None:
    for table in TABLES:
        result = compare_table(conn, spark, str(delta), "public", table)
        assert result.equal, result.describe()


def test_a_lost_slot_fails_or_is_recovered_by_a_new_snapshot(
    small_wal_cluster, tmp_path, monkeypatch, airflow_db, merge_through_connect, spark
):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    cluster = small_wal_cluster
    conn = cluster.connect("shop")
    conn.execute(
        "create table lost_orders (id int primary key, status text, amount numeric(10,2));"
        " create table lost_notes (note text); alter table lost_notes replica identity full"
    )
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", cluster.airflow_conn_json("shop"))
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags["pgdecode_incremental"]
    delta = tmp_path / "delta"
    conf = {
        "slot_name": SLOT,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(delta),
        "tables": [f"public.{t}" for t in TABLES],
        "table_options": {"public.lost_notes": {"mode": "append_only"}},
    }
    run(dag, conf)  # creates the slot
    write(conn, 1)
    assert run(dag, conf).state == DagRunState.SUCCESS
    assert_equal(conn, spark, delta)

    # Changes the pipeline has not read, then the WAL they were in is removed: the slot is lost.
    write(conn, 1000)
    remove_slot_wal(conn, "lost_wal")
    write(conn, 2000)
    assert conn.execute("select wal_status from pg_replication_slots where slot_name = %s", (SLOT,)).fetchone() == (
        "lost",
    )

    # fail (the default): the run stops at ensure_slot with the slot's error, nothing merged.
    failed = run(dag, conf)
    assert failed.state == DagRunState.FAILED
    assert states(failed)["ensure_slot"] == "failed", states(failed)
    assert states(failed)["merge"] != "success"
    from airflow_provider_pgdecode.errors import SlotError
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
    from airflow_provider_pgdecode.postgres.health import check_readable

    with PgDecodeHook() as hook, pytest.raises(SlotError, match="is lost.*on_slot_lost to resnapshot"):
        check_readable(hook.describe_slot(SLOT))

    # resnapshot: the slot is recreated and every table reloaded, each Delta table replaced in one commit.
    before = delta_versions(spark, delta)
    recovered = run(dag, {**conf, "on_slot_lost": "resnapshot"})
    assert recovered.state == DagRunState.SUCCESS, states(recovered)
    assert delta_versions(spark, delta) == {t: n + 1 for t, n in before.items()}
    assert_equal(conn, spark, delta)
    slot = conn.execute(
        "select wal_status, two_phase from pg_replication_slots where slot_name = %s", (SLOT,)
    ).fetchone()
    assert slot[0] != "lost" and slot[1] is True
    record = json.loads((tmp_path / "staging" / SLOT / "recoveries.json").read_text())
    assert [entry["reason"] for entry in record] == ["wal_removed"]
    assert sorted(record[0]["tables"]) == sorted(f"public.{t}" for t in TABLES)

    # The pipeline carries on from the new slot.
    write(conn, 3000)
    assert run(dag, {**conf, "on_slot_lost": "resnapshot"}).state == DagRunState.SUCCESS
    assert_equal(conn, spark, delta)

    # Lost again within 24 hours: max_slot_recoveries_per_day (1) stops the policy, with why.
    remove_slot_wal(conn, "lost_wal_again")
    write(conn, 4000)
    again = run(dag, {**conf, "on_slot_lost": "resnapshot"})
    assert again.state == DagRunState.FAILED
    assert states(again)["extract"] == "failed", states(again)
    assert len(json.loads((tmp_path / "staging" / SLOT / "recoveries.json").read_text())) == 1
    conn.close()
