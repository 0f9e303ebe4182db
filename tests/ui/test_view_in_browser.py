"""The pgdecode view in a real browser, against a real pipeline.

A source from a sources file runs two cycles through Airflow (``dag.test()``: real PostgreSQL,
the merges in the session's Spark Connect server, Delta on disk); a table snapshot is requested
and left pending. Then ``airflow api-server`` starts on the same metadata database with the
provider installed (its plugin registered by the entry point), and:

- the view's JSON refuses a request without a token (401), with a malformed one (403), and sends a
  browser to the auth manager's login page;
- with a token, it shows the source, its slot as PostgreSQL has it now, the lag each run's health
  check recorded, each table's Delta version and newest merged commit (between the PostgreSQL
  clock readings around that commit), a change quarantined (a value past ``max_value_bytes``), a
  table parked by its torn Delta log, the runs' batches, the pending request, and a source of the
  sources file that never ran;
- headless Chromium logs in through Airflow's login redirect, opens the page and shows the same,
  and Airflow's own UI embeds it under ``/plugin/pgdecode``. The screenshots are kept in
  ``build/test-artifacts/ui`` (``PGDECODE_TEST_ARTIFACTS`` elsewhere); docs/images/ui.png is one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from airflow_provider_pgdecode.batch.parking import read_parked
from pgdecode_testing.airflow_deployment import AirflowDeployment
from pgdecode_testing.connect_server import LocalConnectServer
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(os.environ.get("PGDECODE_TEST_ARTIFACTS") or ROOT / "build" / "test-artifacts") / "ui"


@dataclass
class Pipeline:
    dag_id: str
    slot: str
    conn_id: str
    conn_json: str
    database: str
    data_dir: Path
    sources: Path
    #: per table, the PostgreSQL clock just before and just after the commit of its last change
    committed: dict[str, tuple[datetime, datetime]]
    request_id: str


def _clock(conn: psycopg.Connection[Any]) -> datetime:
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]


@pytest.fixture(scope="module")
def pipeline(
    pg_cluster: ThrowawayCluster, spark_connect_server: LocalConnectServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """Two real cycles of a source's incremental DAG, recorded in the test session's metadata DB."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.utils import db
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

    db.resetdb()
    tmp = tmp_path_factory.mktemp("ui-pipeline")
    suffix = uuid.uuid4().hex[:8]
    database, slot, conn_id = f"ui_shop_{suffix}", f"ui_shop_{suffix}", "ui_shop_db"
    pg_cluster.create_database(database)
    data_dir = tmp / "data"
    sources = tmp / "sources.yaml"
    sources.write_text(
        textwrap.dedent(
            f"""\
            sources:
              shop:
                postgres_conn_id: {conn_id}
                slot: {slot}
                plugin: test_decoding
                wait_seconds: 5
                table_options:
                  public.notes: {{on_bad_value: quarantine, max_value_bytes: 64}}
              later:
                postgres_conn_id: {conn_id}
                slot: {slot}_later
                plugin: test_decoding
            """
        )
    )
    conn_json = pg_cluster.airflow_conn_json(database)
    env = {
        f"AIRFLOW_CONN_{conn_id.upper()}": conn_json,
        "AIRFLOW_CONN_SPARK_DEFAULT": spark_connect_server.airflow_conn_json,
        "AIRFLOW__PGDECODE__DATA_DIR": str(data_dir),
        "PGDECODE_SOURCES": str(sources),
    }
    conn = pg_cluster.connect(database)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        conn.execute(
            "CREATE TABLE orders (id int PRIMARY KEY, status text); CREATE TABLE customers (id int PRIMARY KEY);"
            " CREATE TABLE notes (id int PRIMARY KEY, body text)"
        )
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot,))

        bag = DagBag(dag_folder=str(ROOT / "dags" / "pgdecode_sources.py"))
        assert not bag.import_errors, bag.import_errors
        with create_session() as session:
            DagBundlesManager().sync_bundles_to_db(session=session)
        sync_bag_to_db(bag, "dags-folder", None)  # the DAGs the auth manager lets a user read
        dag = bag.dags["pgdecode_shop_incremental"]

        committed: dict[str, tuple[datetime, datetime]] = {}
        before = _clock(conn)
        conn.execute("INSERT INTO customers SELECT g FROM generate_series(1, 7) g")
        committed["public.customers"] = (before, _clock(conn))
        conn.execute("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 20) g")
        # one body longer than max_value_bytes: quarantined, the other notes merged
        conn.execute("INSERT INTO notes VALUES (1, 'short'), (2, repeat('x', 200)), (3, 'short too')")
        first = dag.test()
        assert first.state == DagRunState.SUCCESS, {ti.task_id: ti.state for ti in first.get_task_instances()}

        # customers' newest Delta commit torn as by a crash: its next changes park it, the others flow
        log = data_dir / "shop" / "delta" / "public" / "customers" / "_delta_log"
        newest = max(log.glob("*.json"))
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
        conn.execute("INSERT INTO customers VALUES (8)")
        before = _clock(conn)
        conn.execute("UPDATE orders SET status = 'paid' WHERE id <= 5; DELETE FROM orders WHERE id = 20")
        committed["public.orders"] = (before, _clock(conn))
        second = dag.test()
        assert second.state == DagRunState.SUCCESS, {ti.task_id: ti.state for ti in second.get_task_instances()}

    staging = data_dir / "shop" / "staging"
    request = request_table_snapshot(str(staging), slot, ["public.customers"], mode="resnapshot", request_id="ui-test")
    try:
        yield Pipeline(
            dag_id=dag.dag_id,
            slot=slot,
            conn_id=conn_id,
            conn_json=conn_json,
            database=database,
            data_dir=data_dir,
            sources=sources,
            committed=committed,
            request_id=request.id,
        )
    finally:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        )
        conn.close()


def _api_server(pipeline: Pipeline, home: Path, **env: str) -> AirflowDeployment:
    """``airflow api-server`` alone, on the metadata database the cycles were recorded in."""
    from airflow import settings

    return AirflowDeployment(
        home,
        metadata_dsn=str(settings.SQL_ALCHEMY_CONN),
        dags_folder=ROOT / "dags",
        components=("api-server",),
        env={
            f"AIRFLOW_CONN_{pipeline.conn_id.upper()}": pipeline.conn_json,
            "AIRFLOW__PGDECODE__DATA_DIR": str(pipeline.data_dir),
            "PGDECODE_SOURCES": str(pipeline.sources),
            **env,
        },
    )


@pytest.fixture(scope="module")
def api_server(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowDeployment]:
    """The API server as a developer's: the simple auth manager with everyone an admin (a browser
    is logged in by the login page's redirect)."""
    with _api_server(pipeline, tmp_path_factory.mktemp("ui-api-server")) as server:
        yield server


@pytest.fixture
def strict_api_server(pipeline: Pipeline, tmp_path: Path) -> Iterator[AirflowDeployment]:
    """The simple auth manager with users and passwords: one ``viewer``, password ``seen-not-touched``."""
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"viewer": "seen-not-touched"}))
    with _api_server(
        pipeline,
        tmp_path / "home",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="False",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="viewer:viewer",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(passwords),
    ) as server:
        yield server


def _get(url: str, headers: dict[str, str] | None = None, body: Any = None) -> tuple[int, dict[str, str], str]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {**(headers or {}), **({"Content-Type": "application/json"} if data else {})}
        with opener.open(urllib.request.Request(url, data=data, headers=headers), timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def _token(server: AirflowDeployment) -> str:
    status, _, body = _get(f"{server.api_url}/auth/token")  # simple auth manager, all admins
    assert status == 201, body
    return str(json.loads(body)["access_token"])


def _slot_row(pg_cluster: ThrowawayCluster, pipeline: Pipeline) -> dict[str, Any]:
    with pg_cluster.connect(pipeline.database) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text, wal_status, active FROM pg_replication_slots WHERE slot_name = %s",
            (pipeline.slot,),
        ).fetchone()
    assert row is not None
    return {"confirmed_flush_lsn": row[0], "wal_status": row[1], "active": row[2]}


def _recorded(pipeline: Pipeline, task_id: str) -> list[dict[str, Any]]:
    """The ``return_value`` XComs of ``task_id`` in the DAG's runs, oldest first."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(XComModel)
            .join(DagRun, DagRun.id == XComModel.dag_run_id)
            .where(XComModel.dag_id == pipeline.dag_id, XComModel.task_id == task_id, XComModel.key == "return_value")
            .order_by(DagRun.id)
        ).scalars()
        return [XComModel.deserialize_value(x) for x in rows]


def _delta_version(pipeline: Pipeline, table: str) -> int:
    schema, name = table.split(".")
    log = pipeline.data_dir / "shop" / "delta" / schema / name / "_delta_log"
    return max(int(p.stem) for p in log.glob("*.json"))


def test_the_view_asks_airflows_auth_manager(strict_api_server: AirflowDeployment, pipeline: Pipeline) -> None:
    """No token: 401 (a browser goes to the login page, and back); a malformed one: 403; a
    viewer's token (the auth manager's login): the sources of the DAGs a viewer may read."""
    base = strict_api_server.api_url
    status, _, body = _get(f"{base}/pgdecode/api/status")
    assert status == 401, body
    status, _, _ = _get(f"{base}/pgdecode/api/status", {"Authorization": "Bearer not-a-jwt"})
    assert status == 403
    status, headers, _ = _get(f"{base}/pgdecode/", {"Accept": "text/html"})
    assert status == 303
    assert headers["location"] == "/auth/login?next=%2Fpgdecode%2F"
    # the navigation icon is public (the UI shows it before any page of the plugin)
    status, _, body = _get(f"{base}/pgdecode/icon.svg")
    assert status == 200 and body.startswith("<svg")

    status, _, body = _get(f"{base}/auth/token", body={"username": "viewer", "password": "seen-not-touched"})
    assert status == 201, body
    token = json.loads(body)["access_token"]
    status, _, body = _get(f"{base}/pgdecode/api/status", {"Authorization": f"Bearer {token}"})
    assert status == 200, body
    assert [s["dag_id"] for s in json.loads(body)["sources"]] == [pipeline.dag_id, "pgdecode_later_incremental"]


def test_the_json_shows_the_pipeline_as_it_is(
    api_server: AirflowDeployment, pipeline: Pipeline, pg_cluster: ThrowawayCluster
) -> None:
    status, _, body = _get(
        f"{api_server.api_url}/pgdecode/api/status", {"Authorization": f"Bearer {_token(api_server)}"}
    )
    assert status == 200, body
    answer = json.loads(body)
    sources = answer["sources"]
    assert answer["problems"] == []
    # the source that ran, and the one of the sources file that never did (its slot not created yet)
    assert [(s["dag_id"], s["slot"]) for s in sources] == [
        (pipeline.dag_id, pipeline.slot),
        ("pgdecode_later_incremental", f"{pipeline.slot}_later"),
    ]
    later = sources[1]
    assert later["health"] == "missing" and later["runs"] == [] and later["tables"] == []
    assert "does not exist" in later["slot_state"]["error"]
    source = sources[0]
    assert source["problems"] == [] and source["slot_state"]["error"] is None

    # the slot as PostgreSQL has it now
    slot = _slot_row(pg_cluster, pipeline)
    info = source["slot_state"]["info"]
    assert info["confirmed_flush_lsn"] == slot["confirmed_flush_lsn"]
    assert info["wal_status"] == slot["wal_status"] and info["active"] is False
    assert source["health"] == "parked"  # the slot is fine; a table waits
    extracts = _recorded(pipeline, "extract")
    assert len(extracts) == 2 and extracts[-1]["end_lsn"] == slot["confirmed_flush_lsn"]  # confirmed to the batch's end

    # the lag chart: what each run's health check recorded, oldest first
    health = _recorded(pipeline, "slot_health")
    assert [p["lag_bytes"] for p in source["lag"]] == [h["lag_bytes"] for h in health]
    assert len(source["lag"]) == 2 and source["lag"][0]["lag_bytes"] > 0

    # the runs and their batches, newest first
    batches = [(r["batches"][0]["start_lsn"], r["batches"][0]["end_lsn"]) for r in source["runs"]]
    assert batches == [(e["start_lsn"], e["end_lsn"]) for e in reversed(extracts)]
    assert [r["merged_tables"] for r in source["runs"]] == [
        ["public.orders"],
        ["public.customers", "public.notes", "public.orders"],
    ]
    assert [r["parked_tables"] for r in source["runs"]] == [["public.customers"], []]

    # each table: its Delta version, and the newest commit merged, between the clock readings around it
    tables = {t["name"]: t for t in source["tables"]}
    assert set(tables) == {"public.orders", "public.customers", "public.notes"}
    for name, (before, after) in pipeline.committed.items():
        table = tables[name]
        assert table["delta_version"] == _delta_version(pipeline, name), name
        newest = datetime.fromisoformat(table["newest_commit"])
        assert before <= newest <= after, (name, before, newest, after)
    assert tables["public.notes"]["delta_version"] == _delta_version(pipeline, "public.notes")

    # parked: customers, since the batch its torn Delta log refused (the merge's parked-tables file)
    parked = read_parked(str(pipeline.data_dir / "shop" / "staging"), pipeline.slot)
    assert list(parked) == ["public.customers"] and parked["public.customers"].since_lsn == extracts[-1]["start_lsn"]
    assert source["parked"] == {"public.customers": asdict(parked["public.customers"])}
    assert tables["public.customers"]["parked"] == source["parked"]["public.customers"]
    assert tables["public.orders"]["parked"] is None and tables["public.notes"]["parked"] is None

    # quarantined: the one note too long to carry, in the extract's record and the quarantine Delta table
    assert extracts[0]["quarantined"] == {"public.notes": 1} and extracts[1]["quarantined"] == {}
    assert [(t["name"], t["quarantined"]) for t in source["tables"]] == [
        ("public.customers", 0),
        ("public.notes", 1),
        ("public.orders", 0),
    ]
    assert source["quarantined"] == 1
    quarantine = DeltaTable(str(pipeline.data_dir / "shop" / "delta" / "_pgdecode_quarantine"))
    assert quarantine.to_pyarrow_table().num_rows == 1
    assert tables["public.orders"]["last_merged_run"] == source["runs"][0]["run_id"]
    assert tables["public.customers"]["last_merged_run"] == source["runs"][1]["run_id"]

    # the pending snapshot request
    assert [(r["id"], r["tables"]) for r in source["snapshot_requests"]] == [
        (pipeline.request_id, ["public.customers"])
    ]


def _chromium(profile: Path, *args: str) -> str:
    done = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/ensure-system-deps.sh installs it)")
def test_a_headless_browser_shows_the_view(
    api_server: AirflowDeployment, pipeline: Pipeline, pg_cluster: ThrowawayCluster, tmp_path: Path
) -> None:
    profile = tmp_path / "chromium-profile"
    page = f"{api_server.api_url}/pgdecode/"
    # No cookie yet: the page sends the browser through Airflow's login, which brings it back.
    dom = _chromium(profile, "--dump-dom", page)
    sections = re.findall(r'<section class="source"[^>]*>', dom)
    assert len(sections) == 2, dom[:3000]
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', sections[0]))
    assert 'data-dag-id="pgdecode_later_incremental"' in sections[1] and 'data-health="missing"' in sections[1]
    slot = _slot_row(pg_cluster, pipeline)
    assert attrs["dag-id"] == pipeline.dag_id and attrs["slot"] == pipeline.slot
    assert attrs["confirmed-lsn"] == slot["confirmed_flush_lsn"] and attrs["health"] == "parked"
    assert int(attrs["lag-bytes"]) >= 0
    shown = set(re.findall(r'<tr data-table="([^"]+)"', dom))
    assert shown == {"public.orders", "public.customers", "public.notes"}
    assert re.search(r'<tr data-table="public.customers"[^>]*data-parked="yes"', dom)
    assert re.search(r'<tr data-table="public.notes"[^>]*data-quarantined="1"', dom)
    assert '<div data-fact="parked"><b>1</b>' in dom and '<div data-fact="quarantined"><b>1</b>' in dom
    health = _recorded(pipeline, "slot_health")
    chart = re.findall(r'<circle [^>]*data-lag-bytes="(\d+)"', dom)
    assert [int(v) for v in chart] == [h["lag_bytes"] for h in health]
    assert f'data-snapshot-request="{pipeline.request_id}"' in dom
    assert f'href="/dags/{pipeline.dag_id}/runs"' in dom

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "pgdecode-view.png"
    _chromium(profile, f"--screenshot={shot}", "--window-size=1400,1500", page)
    assert shot.stat().st_size > 10_000
    # Airflow's own UI: the navigation entry's route embeds the page.
    in_ui = ARTIFACTS / "pgdecode-in-airflow-ui.png"
    ui_dom = _chromium(profile, "--virtual-time-budget=15000", "--dump-dom", f"{api_server.api_url}/plugin/pgdecode")
    assert re.search(r'<iframe[^>]*src="/pgdecode/"', ui_dom), ui_dom[-3000:]
    _chromium(
        profile,
        "--virtual-time-budget=15000",
        f"--screenshot={in_ui}",
        "--window-size=1400,1500",
        f"{api_server.api_url}/plugin/pgdecode",
    )
    print(f"screenshots: {shot} {in_ui}")
