"""pgdecode's metrics reach the StatsD server Airflow's [metrics] names (issue 38): a real cycle of
the extract, merge (through the session's Spark Connect server) and confirm tasks, with a UDP
listener on 127.0.0.1 as the StatsD server; every documented name arrives, with plausible values."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from airflow.sdk.observability import stats
from airflow.sdk.observability.metrics import stats_utils

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeExtractOperator,
    PgDecodeMergeOperator,
)
from airflow_provider_pgdecode.utils import metrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


class StatsdListener:
    """A StatsD server on a free UDP port of 127.0.0.1: every ``name:value|type`` line it receives."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.socket.recv(65536)
            except TimeoutError:
                continue
            self.lines.extend(data.decode().splitlines())

    def values(self, name: str) -> list[float]:
        return [float(line.split(":", 1)[1].split("|", 1)[0]) for line in self.lines if line.split(":", 1)[0] == name]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


@pytest.fixture
def statsd(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatsdListener]:
    """Airflow's metrics facade set up as the task runner sets it up, with StatsD on and sent here."""
    listener = StatsdListener()
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(listener.port))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
    try:
        yield listener
    finally:
        stats.initialize(factory=stats_utils.NoStatsLogger, export_legacy_names=False)
        listener.close()


@pytest.mark.postgres
@pytest.mark.spark
def test_a_cycle_sends_the_documented_metrics(
    statsd: StatsdListener,
    source_conn: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    make_context: Any,
    spark_connect_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connect_server.airflow_conn_json)
    pg_conn.execute("drop table if exists metric_items; create table metric_items (id int primary key, v text)")
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute("insert into metric_items select g, 'v' from generate_series(1, 40) g")
    pg_conn.execute("update metric_items set v = 'u' where id <= 5")
    extract = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path / "staging"), tables=["public.metric_items"]
    )
    batch = extract.execute(make_context())
    merged = PgDecodeMergeOperator(
        task_id="merge", batch_paths=batch["path"], delta_root=str(tmp_path / "delta")
    ).execute(make_context())
    pg_conn.execute("insert into metric_items values (1000, 'after')")  # the slot lags behind it once confirmed
    pg_conn.execute("begin")  # a transaction left prepared: its age is reported at the confirm
    pg_conn.execute("insert into metric_items values (1001, 'prepared')")
    pg_conn.execute("prepare transaction 'metric_pending'")
    PgDecodeConfirmOperator(task_id="confirm", slot_name=slot_name, batch_path=batch["path"]).execute(
        make_context(merge=merged)
    )
    slot = slot_name
    deadline = threading.Event()
    for _ in range(50):  # UDP: give the listener a moment for the last datagrams
        if statsd.values(f"airflow.pgdecode.slot.lag_bytes.{slot}"):
            break
        deadline.wait(0.1)
    limited = pg_conn.execute("select current_setting('max_slot_wal_keep_size') <> '-1'").fetchone()[0]
    for metric in metrics.METRICS:
        if metric == "slot.safe_wal_size_bytes" and not limited:  # sent only when the server limits it
            continue
        if metric.startswith("drain."):  # sent by a drain, between its batches: tests/dags/test_drain.py
            continue
        assert statsd.values(f"airflow.pgdecode.{metric}"), f"{metric} never arrived: {statsd.lines}"
    assert statsd.values(f"airflow.pgdecode.extract.changes.{slot}") == [45.0]
    assert statsd.values(f"airflow.pgdecode.table.changes.{slot}.public.metric_items") == [45.0]
    assert statsd.values(f"airflow.pgdecode.table.rows_written.{slot}.public.metric_items") == [40.0]
    assert statsd.values(f"airflow.pgdecode.merge.tables.{slot}") == [1.0]
    assert statsd.values(f"airflow.pgdecode.merge.parked.{slot}") == [0.0]
    assert statsd.values(f"airflow.pgdecode.slot.wal_status.{slot}") == [0.0]  # reserved
    assert statsd.values(f"airflow.pgdecode.slot.lag_bytes.{slot}")[0] > 0  # the insert after the batch
    assert statsd.values(f"airflow.pgdecode.confirm.released_bytes.{slot}")[0] > 0
    assert statsd.values(f"airflow.pgdecode.extract.duration.{slot}")[0] > 0
    # Freshness: the batch's newest commit was seconds ago; the table's newest merged commit is the batch's last.
    (lag_seconds,) = statsd.values(f"airflow.pgdecode.slot.lag_seconds.{slot}")
    assert 0 <= lag_seconds < 600
    (fresh,) = statsd.values(f"airflow.pgdecode.table.freshness_seconds.{slot}.public.metric_items")
    assert fresh == pytest.approx(lag_seconds, abs=1)
    (last_lsn,) = statsd.values(f"airflow.pgdecode.table.last_commit_lsn.{slot}.public.metric_items")
    assert int(Lsn.parse(batch["start_lsn"])) < last_lsn <= int(Lsn.parse(batch["end_lsn"]))
    (prepared_age,) = statsd.values(f"airflow.pgdecode.slot.oldest_prepared_age_seconds.{slot}")
    assert prepared_age > 0
    pg_conn.execute("rollback prepared 'metric_pending'")
    assert statsd.values(f"airflow.pgdecode.confirm.duration.{slot}")[0] > 0


def test_the_documented_table_is_the_metrics_sent() -> None:
    documented = re.findall(r"^\| `pgdecode\.([a-z_.]+)` \| (\w+) \|", DOCS.read_text(encoding="utf-8"), re.MULTILINE)
    assert documented == [(name, kind) for name, (kind, _) in metrics.METRICS.items()]
