"""pgdecode's alerts reach Airflow notifiers (issue 38): the health check of a real slot past its lag
threshold, run by Airflow with the alert notifier as its failure callback, fires a notifier whose
own template names the alert; what each task outcome alerts on."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk import BaseNotifier

from airflow_provider_pgdecode.notifications.alerts import PgDecodeAlertNotifier, alerts_of, failure_kind

SENT: list[tuple[str, str]] = []

DAG_FILE = """
from datetime import datetime

from airflow.sdk import DAG

from airflow_provider_pgdecode.notifications.alerts import PgDecodeAlertNotifier
from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor
from tests.notifications.test_alerts import RecordingNotifier

alert = PgDecodeAlertNotifier([RecordingNotifier("[{{{{ dag.dag_id }}}}] {{{{ pgdecode_alert }}}}")])
for dag_id, limit in (("alerts_lag", 1), ("alerts_ok", 10**12)):
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1)):
        PgDecodeSlotHealthSensor(
            task_id="slot_health", slot_name="{slot}", max_lag_bytes=limit, on_failure_callback=[alert], retries=0
        )
"""


class RecordingNotifier(BaseNotifier):
    """A notifier as Slack's or email's: its message is a template rendered with the task's context."""

    template_fields = ("text",)

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def notify(self, context: Any) -> None:
        SENT.append((context["pgdecode_alert_kind"], self.text))


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


@pytest.mark.postgres
def test_a_slot_past_its_lag_threshold_fires_the_notifier(
    pg_cluster, pg_conn, slot_name, tmp_path, monkeypatch, airflow_db
):
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook

    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute("drop table if exists alert_items; create table alert_items (id int primary key)")
    pg_conn.execute("insert into alert_items select generate_series(1, 1000)")  # the slot now lags
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "alerts.py").write_text(DAG_FILE.format(slot=slot_name))
    bag = DagBag(dag_folder=str(dags))
    assert not bag.import_errors, bag.import_errors
    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
    sync_bag_to_db(bag, "dags-folder", None)  # dag.test runs serialized DAGs

    # Past the threshold: the health check fails, and Airflow runs the failure callback.
    SENT.clear()
    assert bag.dags["alerts_lag"].test().state == DagRunState.FAILED
    assert len(SENT) == 1, SENT
    kind, text = SENT[0]
    assert kind == "slot_lag"
    assert text.startswith("[alerts_lag] pgdecode alerts_lag.slot_health failed: ")
    assert f"replication slot {slot_name!r} lags" in text and "more than max_lag_bytes" in text

    # Under the threshold: the check passes and nothing is sent.
    SENT.clear()
    assert bag.dags["alerts_ok"].test().state == DagRunState.SUCCESS
    assert SENT == []


def test_what_each_outcome_alerts_on() -> None:
    lost = "replication slot 's' is lost (wal_status = lost): the server removed WAL it still needed"
    assert failure_kind(lost) == "slot_lost"
    assert failure_kind("replication slot 's' was invalidated (invalidation_reason = idle_timeout)") == "slot_lost"
    assert failure_kind("replication slot 's' is unreserved: ...") == "slot_unreserved"
    assert failure_kind("table public.t is parked since ...") == "table_parked"
    assert failure_kind("connection refused") == "task_failed"
    quarantined = alerts_of("extract", "d", None, {"quarantined": {"public.a": 3, "public.b": 0}})
    assert quarantined == [
        ("quarantine", "pgdecode d.extract: changes quarantined (values the pipeline cannot carry): public.a (3)")
    ]
    parked = alerts_of("merge", "d", None, {"parked": {"public.t": {"reason": "a column type changed"}}})
    assert parked == [("table_parked", "pgdecode d.merge: table public.t is parked: a column type changed")]
    assert alerts_of("merge", "d", None, {"parked": {}, "quarantined": {}}) == []


def test_the_incremental_dag_attaches_the_alerts() -> None:
    from airflow_provider_pgdecode.example_dags.pgdecode_incremental import incremental_dag

    dag = incremental_dag(
        "alerts_dag", alert_notifiers=[RecordingNotifier("{{ pgdecode_alert }}")], auto_register=False
    )
    failing = {
        t.task_id for t in dag.tasks if any(isinstance(c, PgDecodeAlertNotifier) for c in t.on_failure_callback or [])
    }
    assert failing == {"ensure_slot", "slot_health", "extract", "merge", "confirm", "drain"}
    succeeding = {t.task_id for t in dag.tasks if t.on_success_callback}
    assert succeeding == {"extract", "merge", "drain"}
