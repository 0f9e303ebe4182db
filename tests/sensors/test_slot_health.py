"""The health sensor: heartbeats on idle slots, and loud failures (missing, wrong plugin, lag, unreserved, lost)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import check_slot_changes
from airflow_provider_pgdecode.operators import PgDecodeEnsureSlotOperator, PgDecodeExtractOperator
from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = pytest.mark.postgres


class _TI:
    def xcom_pull(self, **kwargs: Any) -> None:
        return None


def busy_elsewhere(cluster: ThrowawayCluster) -> None:
    """Write WAL in another database of the cluster: the slot's own database stays idle."""
    with cluster.connect("postgres") as other:
        other.execute("CREATE TABLE IF NOT EXISTS busy (id int)")
        other.execute("INSERT INTO busy VALUES (1)")


def test_healthy_idle_slot_gets_one_heartbeat_and_advances(
    source_conn: str, pg_cluster: ThrowawayCluster, slot_name: str, tmp_path: Path
) -> None:
    sensor = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name, plugin="test_decoding", heartbeat=True)
    with PgDecodeHook() as hook:
        start = hook.ensure_slot(slot_name).confirmed_flush_lsn
        assert start is not None
        busy_elsewhere(pg_cluster)
        assert check_slot_changes(hook, slot_name)[1]["lag_bytes"] > 0

        returned = sensor.poke({})
        assert returned.is_done is True
        health = returned.xcom_value
        assert health["slot_name"] == slot_name and health["wal_status"] == "reserved"
        assert health["heartbeat_lsn"] is not None
        heartbeat = Lsn.parse(health["heartbeat_lsn"])
        assert heartbeat > start
        # One heartbeat pending is enough: the next check writes none.
        assert sensor.poke({}).xcom_value["heartbeat_lsn"] is None
        assert check_slot_changes(hook, slot_name, advance_lag_bytes=1)[0] is True

        # An extract and a confirm move the idle slot past the heartbeat.
        manifest = hook.extract_batch(slot_name, tmp_path)
        assert manifest.tables == [] and Lsn.parse(manifest.end_lsn) >= heartbeat
        hook.advance_slot(slot_name, Lsn.parse(manifest.end_lsn))
        assert hook.describe_slot(slot_name).confirmed_flush_lsn == Lsn.parse(manifest.end_lsn)


def test_no_heartbeat_while_changes_are_pending(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    table = f"hs_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {table} VALUES (1)")
    sensor = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name, heartbeat=True)
    assert sensor.poke({}).xcom_value["heartbeat_lsn"] is None


class EarlierRuns:
    """Airflow's task instance as far as the check asks it: has the check succeeded before, and
    what did its latest successful run push (``latest`` stands for that run's XCom)."""

    dag_id = "pgdecode_incremental"

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None

    def get_ti_count(self, **criteria: Any) -> int:
        return 0 if self.latest is None else 1

    def xcom_pull(self, **criteria: Any) -> Any:
        assert criteria["include_prior_dates"] is True and criteria["task_ids"] == "health"
        return self.latest


def test_changes_pending_through_runs_with_nothing_extracted_fail_the_check(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str
) -> None:
    """Whatever keeps the cycle from extracting (here: nothing runs it), changes waiting at the same
    confirmed position through more than max_stalled_runs runs fail the check, naming the slot, the
    position and the runs; once the slot moves the count starts again."""
    table = f"hs_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {table} VALUES (1)")
    runs = EarlierRuns()
    sensor = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name, max_stalled_runs=2)
    for expected in (1, 2):
        report = sensor.poke({"ti": runs}).xcom_value
        assert report["pending_changes"] == 1 and report["stalled_runs"] == expected
        runs.latest = report
    with pytest.raises(AirflowException, match=f"slot '{slot_name}': changes pending, nothing extracted for 2 runs"):
        sensor.poke({"ti": runs})
    with PgDecodeHook() as hook:  # the cycle runs again: the slot moves past the change
        hook.advance_slot(slot_name, Lsn.parse(str(hook.current_flush_lsn())))
    pg_conn.execute(f"INSERT INTO {table} VALUES (2)")
    report = sensor.poke({"ti": runs}).xcom_value
    assert report["stalled_runs"] == 1


def test_lag_over_the_limit_fails_with_a_retryable_error(
    source_conn: str, pg_cluster: ThrowawayCluster, slot_name: str
) -> None:
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    busy_elsewhere(pg_cluster)
    assert PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, max_lag_bytes=1 << 40).poke({}).is_done
    sensor = PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, max_lag_bytes=0)
    with pytest.raises(AirflowException, match="lags the server's WAL by .* more than max_lag_bytes 0 bytes") as caught:
        sensor.execute({})
    assert not isinstance(caught.value, AirflowFailException)


def test_an_idle_slot_left_behind_is_named_while_the_check_passes(
    source_conn: str, pg_cluster: ThrowawayCluster, pg_dsn: str, slot_name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A slot no pipeline reads any more (its source removed) holds back WAL for ever: the health
    check of a slot on the same server names it and says how to drop it, and still passes."""
    left_behind = f"{slot_name}_gone"
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        hook.ensure_slot(left_behind)
        busy_elsewhere(pg_cluster)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the checked slot is caught up
            conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot_name,))
            lag = conn.execute(
                "SELECT pg_current_wal_lsn() - confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                (left_behind,),
            ).fetchone()[0]
        assert lag > 0
        try:
            health = PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, max_lag_bytes=int(lag) - 1).poke({})
            assert health.is_done
            assert left_behind in health.xcom_value["idle_slots"]
            assert slot_name not in health.xcom_value["idle_slots"]
            assert f"SELECT pg_drop_replication_slot('{left_behind}')" in "".join(capfd.readouterr())
            # Within the limit, or without one, nothing is said.
            quiet = PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, max_lag_bytes=int(lag) + (1 << 20))
            assert left_behind not in quiet.poke({}).xcom_value["idle_slots"]
            assert PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name).poke({}).xcom_value["idle_slots"] == []
            assert left_behind not in "".join(capfd.readouterr())
            # When the checked slot fails its own lag check, the other is named all the same.
            busy_elsewhere(pg_cluster)
            with pytest.raises(AirflowException, match=f"replication slot '{slot_name}' lags"):
                PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, max_lag_bytes=0).poke({})
            assert f"SELECT pg_drop_replication_slot('{left_behind}')" in "".join(capfd.readouterr())
        finally:
            hook.drop_slot(left_behind)


def test_missing_slot_and_wrong_plugin_fail_for_good(source_conn: str, slot_name: str) -> None:
    sensor = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name)
    with pytest.raises(AirflowFailException, match=f"replication slot '{slot_name}' does not exist"):
        sensor.execute({})
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    wrong = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot_name, plugin="pgoutput")
    with pytest.raises(AirflowFailException, match="uses output plugin 'test_decoding', but 'pgoutput' was asked for"):
        wrong.execute({})


def test_unreserved_then_lost_slot(small_wal_cluster: ThrowawayCluster, outgrow_wal: Any, tmp_path: Path) -> None:
    slot = "pgdecode_small_wal"
    with small_wal_cluster.connect() as conn, PgDecodeHook() as hook:
        hook.ensure_slot(slot)
        sensor = PgDecodeSlotHealthSensor(task_id="health", slot_name=slot, heartbeat=True)
        assert sensor.poke({}).is_done

        outgrow_wal(conn, slot, "unreserved")
        with pytest.raises(AirflowException, match="wal_status = unreserved.*next checkpoint") as caught:
            sensor.execute({})
        assert not isinstance(caught.value, AirflowFailException)  # advancing the slot can still save it

        outgrow_wal(conn, slot, "lost")
        assert hook.describe_slot(slot).wal_status == "lost"
    with pytest.raises(AirflowFailException, match="is lost .*pg_drop_replication_slot.*pgdecode_backfill"):
        sensor.execute({})
    with pytest.raises(AirflowFailException, match="wal_status = lost"):
        PgDecodeSlotChangesSensor(task_id="wait", slot_name=slot).execute({})
    with pytest.raises(AirflowFailException, match="is lost .*pgdecode_backfill"):
        PgDecodeExtractOperator(task_id="extract", slot_name=slot, staging_root=str(tmp_path)).execute({"ti": _TI()})
    with pytest.raises(AirflowFailException, match="lost"):
        PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot).execute({})
