"""The pgdecode view without a browser: what it shows from given records (status.py), how it
draws them (page.py), how it registers with Airflow (plugin.py), how a slow look is bounded
(readers.gather), and whose sources a user sees (any auth manager's answer)."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from typing import Any

import pytest

from airflow_provider_pgdecode.ui.page import lag_chart, render_page
from airflow_provider_pgdecode.ui.status import (
    TASK_KINDS,
    RunRecord,
    SlotReading,
    SourceRef,
    TaskRecord,
    group_sources,
    health_of,
    source_ref,
    source_status,
)

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
STAGING = "/data/staging"


def run(
    n: int,
    *,
    slot: str = "shop",
    dag_id: str = "pgdecode_shop_incremental",
    lag: int | None = 100,
    tables: dict[str, int] | None = None,
    merged: dict[str, int] | None = None,
    quarantined: dict[str, int] | None = None,
    parked: tuple[str, ...] = (),
    state: str = "success",
) -> RunRecord:
    """Run ``n`` (its start ``n`` minutes after T0) of a cycle; ``merged``: table -> Delta version."""
    start = T0 + timedelta(minutes=n)
    rendered = {"slot_name": slot, "postgres_conn_id": "shop_db", "staging_root": STAGING, "storage_conn_id": ""}
    tasks = [
        TaskRecord(
            "slot_health",
            "health",
            "success",
            start,
            None if lag is None else {"slot_name": slot, "lag_bytes": lag},
            rendered,
        )
    ]
    if tables is not None:
        path = f"{STAGING}/{slot}/batch-{n}"
        value = {
            "slot": slot,
            "path": path,
            "start_lsn": f"0/{n}00",
            "end_lsn": f"0/{n + 1}00",
            "changes": sum(tables.values()),
            "transactions": 1,
            "tables": tables,
            "quarantined": quarantined or {},
            "plugin": "pgoutput",
        }
        tasks.append(TaskRecord("extract", "extract", "success", start, value, rendered))
        summary = {
            "tables": {
                name: {"status": "merged", "delta_version": version, "delta_path": f"/data/delta/{name}"}
                for name, version in (merged or {}).items()
            }
            | {name: {"status": "parked"} for name in parked}
        }
        merge = {"delta_root": "/data/delta", "summary": summary, "parked": {name: {} for name in parked}}
        tasks.append(
            TaskRecord("merge", "merge", "success", start + timedelta(seconds=30), merge, {"delta_root": "/data/delta"})
        )
    return RunRecord(dag_id, f"run_{n}", state, start, start + timedelta(minutes=1), tuple(tasks))


def test_the_task_kinds_are_the_operators_class_names() -> None:
    from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator
    from airflow_provider_pgdecode.operators.drain import PgDecodeDrainOperator
    from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
    from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
    from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor

    classes = [
        PgDecodeSlotHealthSensor,
        PgDecodeSlotChangesSensor,
        PgDecodeExtractOperator,
        PgDecodeMergeOperator,
        PgDecodeConfirmOperator,
        PgDecodeDrainOperator,
    ]
    assert sorted(TASK_KINDS) == sorted(c.__name__ for c in classes)


def test_sources_are_dag_and_slot_newest_run_first() -> None:
    runs = [run(1), run(3), run(2), run(1, slot="billing", dag_id="pgdecode_billing_incremental")]
    runs.append(RunRecord("other", "manual", "failed", T0, None, ()))  # nothing says its slot
    grouped = group_sources(runs)
    assert list(grouped) == [("pgdecode_billing_incremental", "billing"), ("pgdecode_shop_incremental", "shop")]
    assert [r.run_id for r in grouped[("pgdecode_shop_incremental", "shop")]] == ["run_3", "run_2", "run_1"]


def test_a_source_status_from_its_runs() -> None:
    runs = group_sources(
        [
            run(1, lag=900, tables={"public.a": 5, "public.b": 2}, merged={"public.a": 1, "public.b": 1}),
            run(2, lag=None),  # a skipped cycle: no health value, no batch
            run(3, lag=300, tables={"public.a": 4}, merged={"public.a": 2}, quarantined={"public.a": 1}),
            run(4, lag=50, tables={"public.a": 1, "public.c": 3}, merged={"public.a": 3}, parked=("public.c",)),
        ]
    )[("pgdecode_shop_incremental", "shop")]
    ref = source_ref("pgdecode_shop_incremental", "shop", runs)
    assert (ref.postgres_conn_id, ref.staging_root, ref.delta_root, ref.plugin) == (
        "shop_db",
        STAGING,
        "/data/delta",
        "pgoutput",
    )
    parked = {"public.c": {"since_lsn": "0/400", "reason": "damaged Delta log"}}
    commits = {f"{STAGING}/shop/batch-4": {"public.a": T0 + timedelta(minutes=4)}}
    delta_times = {("/data/delta/public.b", 1): T0 + timedelta(minutes=1, seconds=40)}
    now = T0 + timedelta(minutes=10)
    status = source_status(
        ref,
        runs,
        slot_state=SlotReading(info={"wal_status": "reserved", "lag_bytes": 10}),
        parked=parked,
        commit_times=commits,
        delta_commit_times=delta_times,
        now=now,
    )
    assert [(p.run_id, p.lag_bytes) for p in status.lag] == [("run_1", 900), ("run_3", 300), ("run_4", 50)]
    assert [r.run_id for r in status.runs] == ["run_4", "run_3", "run_2", "run_1"]
    assert status.runs[2].batches == () and status.runs[0].batches[0].end_lsn == "0/500"
    tables = {t.name: t for t in status.tables}
    assert list(tables) == ["public.a", "public.b", "public.c"]
    a, b, c = tables["public.a"], tables["public.b"], tables["public.c"]
    # a: merged last in run 4; its newest commit from that batch's statistics
    assert (a.last_merged_run, a.delta_version, a.newest_commit) == ("run_4", 3, T0 + timedelta(minutes=4))
    assert a.freshness_seconds == 360 and a.quarantined == 1 and a.parked is None
    assert a.merged_at == T0 + timedelta(minutes=4, seconds=30)  # no Delta commit time read: the merge task's end
    # b: merged in run 1 only; the Delta commit's own time; its batch's statistics were not read
    assert (b.last_merged_run, b.merged_at, b.newest_commit, b.freshness_seconds) == (
        "run_1",
        T0 + timedelta(minutes=1, seconds=40),
        None,
        None,
    )
    # c: staged, never merged, parked
    assert (c.last_merged_run, c.parked) == (None, parked["public.c"])
    assert status.quarantined == 1 and status.health == "parked"
    assert status.runs[0].parked_tables == ("public.c",) and status.runs[0].merged_tables == ("public.a",)
    assert status.to_dict()["tables"][0]["newest_commit"] == (T0 + timedelta(minutes=4)).isoformat()
    html = render_page([status], base="/", now=now)
    assert '<span title="damaged Delta log">since 0/400: damaged Delta log</span>' in html
    assert 'data-health="parked"' in html and re.search(r'<tr data-table="public.c"[^>]*data-parked="yes"', html)


@pytest.mark.parametrize(
    ("reading", "parked", "limit", "word"),
    [
        (SlotReading(info={"wal_status": "reserved", "lag_bytes": 5}), {}, None, "healthy"),
        (SlotReading(info={"wal_status": "reserved", "lag_bytes": 5}), {}, 4, "lagging"),
        (SlotReading(info={"wal_status": "unreserved", "lag_bytes": 5}), {}, None, "unreserved"),
        (SlotReading(info={"wal_status": "lost"}), {}, None, "lost"),
        (SlotReading(info={"wal_status": "reserved", "invalidation_reason": "idle_timeout"}), {}, None, "lost"),
        (SlotReading(info={"wal_status": "reserved"}), {"public.a": {}}, None, "parked"),
        (SlotReading(error="SlotError: replication slot 'x' does not exist (looked in ...)"), {}, None, "missing"),
        (SlotReading(error="OperationalError: connection timeout expired"), {}, None, "unreachable"),
    ],
)
def test_one_word_for_the_slot(reading: SlotReading, parked: dict[str, Any], limit: int | None, word: str) -> None:
    assert health_of(reading, parked, limit) == word


def test_the_page_shows_every_value_and_escapes_names() -> None:
    runs = group_sources([run(1, lag=2048, tables={"public.<b>": 1}, merged={"public.<b>": 1}), run(2, lag=1024)])
    key = ("pgdecode_shop_incremental", "shop")
    ref = source_ref(*key, runs[key])
    status = source_status(
        ref,
        runs[key],
        slot_state=SlotReading(info={"confirmed_flush_lsn": "0/300", "lag_bytes": 77, "active": False}),
        parked={},
        snapshot_requests=[{"id": "r1", "mode": "add-table", "tables": ["public.z"], "progress": "waiting"}],
        now=T0,
    )
    html = render_page([status], base="/airflow/", now=T0)
    assert 'data-slot="shop"' in html and 'data-lag-bytes="77"' in html and 'data-confirmed-lsn="0/300"' in html
    assert "public.&lt;b&gt;" in html and "public.<b>" not in html
    assert re.findall(r'<circle [^>]*data-lag-bytes="(\d+)"', html) == ["2048", "1024"]
    assert 'href="/airflow/dags/pgdecode_shop_incremental/runs"' in html
    assert 'href="/airflow/dags/pgdecode_shop_incremental/runs/run_1"' in html
    assert 'data-snapshot-request="r1"' in html
    assert "No pgdecode DAG has run yet" in render_page([], base="/", now=T0)
    assert '<p class="problem" data-problem>the sources file: &lt;x&gt;</p>' in render_page(
        [], base="/", now=T0, problems=["the sources file: <x>"]
    )
    assert 'data-lag-points="0"' in lag_chart([])


def test_a_look_that_does_not_answer_is_named_and_left_out() -> None:
    """gather waits for the slots and files of all sources together at most ``timeout``; a slot
    that does not answer is named in its source's problems, the others are shown."""
    from airflow_provider_pgdecode.ui.readers import gather

    release = threading.Event()

    def slot_reader(conn_id: str | None, slot: str) -> SlotReading:
        if slot == "stuck":
            release.wait(30)
        return SlotReading(info={"slot_name": slot, "wal_status": "reserved", "lag_bytes": 1})

    runs = [run(1, slot="stuck", dag_id="a"), run(1, slot="fine", dag_id="b")]
    never_ran = SourceRef("c", "new", "new_db", "pgoutput", None, None, None)
    try:
        statuses = {
            s.slot: s for s in gather(runs, configured=[never_ran], now=T0, timeout=1.0, slot_reader=slot_reader)
        }
    finally:
        release.set()
    assert statuses["new"].runs == () and statuses["new"].slot_state.info is not None
    assert statuses["fine"].slot_state.info is not None and statuses["fine"].problems == ()
    assert statuses["stuck"].slot_state.info is None and statuses["stuck"].health == "unreachable"
    assert any(p.startswith("slot") and "no answer within 1 s" in p for p in statuses["stuck"].problems)


def test_a_user_sees_the_sources_of_the_dags_the_auth_manager_lets_them_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The view asks the configured auth manager (any: only BaseAuthManager's interface is used)
    which DAGs the user may read, and reads the records of those only."""
    from airflow_provider_pgdecode.ui import app, readers

    asked: dict[str, Any] = {}

    class AuthManager:
        def get_authorized_dag_ids(self, *, user: Any, method: str, session: Any) -> set[str]:
            asked.update(user=user, method=method)
            return {"pgdecode_shop_incremental"}

    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", lambda: AuthManager())
    monkeypatch.setattr(
        readers,
        "pgdecode_dag_ids",
        lambda session, among=None: [
            d for d in ("pgdecode_billing_incremental", "pgdecode_shop_incremental") if d in among
        ],
    )
    monkeypatch.setattr(readers, "recent_runs", lambda session, dag_ids: [run(1, dag_id=d) for d in dag_ids])
    configured = [
        SourceRef(f"pgdecode_{name}_incremental", name, f"{name}_db", "pgoutput", None, None, None)
        for name in ("billing", "shop")
    ]
    monkeypatch.setattr(readers, "configured_sources", lambda dags_folder: configured)
    gathered: dict[str, Any] = {}

    def gather(runs: list[RunRecord], **kwargs: Any) -> list[Any]:
        gathered.update(runs=runs, **kwargs)
        return []

    monkeypatch.setattr(readers, "gather", gather)
    assert app.source_statuses("alice") == ([], [])
    assert asked == {"user": "alice", "method": "GET"}
    assert [r.dag_id for r in gathered["runs"]] == ["pgdecode_shop_incremental"]
    assert gathered["configured"] == [configured[1]]

    def broken(dags_folder: str) -> list[SourceRef]:
        raise ValueError("sources.yaml:3: source 'x': field 'slot': required")

    monkeypatch.setattr(readers, "configured_sources", broken)
    assert app.source_statuses("alice") == (
        [],
        ["the sources file: sources.yaml:3: source 'x': field 'slot': required"],
    )


def test_the_provider_registers_the_plugin() -> None:
    from airflow_provider_pgdecode.get_provider_info import get_provider_info
    from airflow_provider_pgdecode.ui.plugin import PgDecodeViewPlugin

    found = [e for e in entry_points(group="airflow.plugins") if e.value.startswith("airflow_provider_pgdecode")]
    assert [e.load() for e in found] == [PgDecodeViewPlugin]
    assert get_provider_info()["plugins"] == [
        {"name": "pgdecode", "plugin-class": "airflow_provider_pgdecode.ui.plugin.PgDecodeViewPlugin"}
    ]
    (view,) = PgDecodeViewPlugin.external_views
    assert (view["href"], view["url_route"], view["destination"]) == ("/pgdecode/", "pgdecode", "nav")
    (app,) = PgDecodeViewPlugin().fastapi_apps
    assert app["url_prefix"] == "/pgdecode" and PgDecodeViewPlugin.fastapi_apps is PgDecodeViewPlugin().fastapi_apps
    assert {r.path for r in app["app"].routes} >= {"/", "/api/status", "/icon.svg"}
