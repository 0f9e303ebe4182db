"""dags/pgdecode_sources.py parsed by Airflow's DagBag: six DAGs for three sources, built from the
same tasks as the example DAGs, with each source fixed, its values as the params' defaults, its
pool on the merges and its schedule; nothing reached over the network while parsing; a broken or
missing file named in the import error."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode.utils.config import SETTINGS

DAGS = Path(__file__).resolve().parents[2] / "dags"
CYCLE = ("ensure_slot", "slot_health", "wait_for_changes", "extract", "merge", "confirm", "drain")
BACKFILL = ("mode", "initial_load", "replay", "merge", "prepare", "wait_for_snapshot")
EXAMPLES = (
    "pgdecode_incremental",
    "pgdecode_backfill",
    "pgdecode_verify",
    "pgdecode_delta_consumer",
    "pgdecode_event_driven",
    "pgdecode_maintenance",
)

SOURCES = """\
defaults:
  pool: pgdecode_spark
  spark_conn_id: spark_connect
sources:
  shop:
    postgres_conn_id: shop_db
    slot: pgdecode_shop
    plugin: test_decoding
    tables: [public.customers, "public.order_*"]
    exclude_tables: [public.order_archive]
    table_options:
      public.audit_log: {mode: append_only}
    delta_root: /data/shop/delta
    schedule: "*/5 * * * *"
    wait_seconds: 60
  billing:
    postgres_conn_id: billing_db
    slot: pgdecode_billing
    plugin: pgoutput
    publication: billing_pub
    delta_root: /data/billing/delta
    staging_uri: /data/billing/staging
    max_batch_changes: 200000
    drain: false
    retention_days: null
  crm:
    postgres_conn_id: crm_db
    slot: pgdecode_crm
    plugin: test_decoding
    tables: ["sales.*"]
    schedule: event
    poll_interval: 5
    pool: default_pool
"""


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``parse(text)``: the DagBag of the dags folder with ``PGDECODE_SOURCES`` naming a file of
    ``text`` (``None``: no sources file), settings at known values."""
    from airflow.dag_processing.dagbag import DagBag

    for setting in SETTINGS.values():
        monkeypatch.delenv(setting.env, raising=False)
        monkeypatch.delenv(f"AIRFLOW__PGDECODE__{setting.name.upper()}", raising=False)
    monkeypatch.setenv("AIRFLOW__PGDECODE__DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("AIRFLOW__PGDECODE__SCHEDULE", "*/7 * * * *")
    monkeypatch.setenv("AIRFLOW__PGDECODE__MAX_LAG_BYTES", "1024")

    def parse(text: str | None, name: str = "sources.yaml") -> Any:
        if text is not None:
            (tmp_path / name).write_text(textwrap.dedent(text))
            monkeypatch.setenv("PGDECODE_SOURCES", str(tmp_path / name))
        return DagBag(dag_folder=str(DAGS))

    return parse


def test_three_sources_give_six_dags(parse: Any, tmp_path: Path) -> None:
    from airflow.sdk import Asset

    from airflow_provider_pgdecode.triggers.slot_event import SlotChangesEventTrigger

    bag = parse(SOURCES)
    assert not bag.import_errors, bag.import_errors
    generated = {f"pgdecode_{s}_{k}" for s in ("shop", "billing", "crm") for k in ("incremental", "backfill")}
    assert set(bag.dags) == generated | set(EXAMPLES)
    for dag_id in generated:
        dag = bag.dags[dag_id]
        assert dag.fileloc == str(DAGS / "pgdecode_sources.py")
        assert dag.doc_md.startswith(f"{dag_id}: ") and str(tmp_path / "sources.yaml") in dag.doc_md
        assert all(param.description for param in dag.params.values()), dag_id
        # the source is fixed, not a param
        assert not {"postgres_conn_id", "slot_name", "plugin", "publication"} & set(dag.params), dag_id
        assert dag.max_active_runs == 1 and "pgdecode" in dag.tags

    # the incremental DAGs: the example's cycle, the source fixed in every task
    shop, billing, crm = (bag.dags[f"pgdecode_{s}_incremental"] for s in ("shop", "billing", "crm"))
    example = bag.dags["pgdecode_incremental"]
    for dag in (shop, billing, crm):
        assert sorted(t.task_id for t in dag.tasks) == sorted(CYCLE)
        assert {(t.task_id, d) for t in dag.tasks for d in t.downstream_task_ids} == {
            (t.task_id, d) for t in example.tasks for d in t.downstream_task_ids
        }
    for task_id in ("ensure_slot", "slot_health", "wait_for_changes", "extract", "confirm", "drain"):
        assert shop.get_task(task_id).slot_name == "pgdecode_shop", task_id
        assert shop.get_task(task_id).postgres_conn_id == "shop_db", task_id
    assert (shop.get_task("extract").plugin, shop.get_task("extract").publication) == ("test_decoding", None)
    assert (billing.get_task("extract").plugin, billing.get_task("extract").publication) == ("pgoutput", "billing_pub")
    assert billing.get_task("wait_for_changes").publication == "billing_pub"
    assert crm.get_task("ensure_slot").slot_name == "pgdecode_crm"

    # the file's values as the params' defaults (still overridable per run)
    assert shop.params["tables"] == ["public.customers", "public.order_*"]
    assert shop.params["exclude_tables"] == ["public.order_archive"]
    assert shop.params["table_options"] == {"public.audit_log": {"mode": "append_only"}}
    assert shop.params["delta_root"] == "/data/shop/delta"
    assert shop.params["staging_uri"] == f"{tmp_path}/data/shop/staging"  # <data_dir>/<name>/staging
    assert shop.params["spark_conn_id"] == "spark_connect" and shop.params["drain"] is True
    assert (billing.params["max_batch_changes"], billing.params["drain"]) == (200000, False)
    assert billing.params["staging_uri"] == "/data/billing/staging" and billing.params["tables"] == []
    assert crm.params["delta_root"] == f"{tmp_path}/data/crm/delta"

    # the pool on the tasks that run Spark; the others in Airflow's default pool
    for dag, pool in ((shop, "pgdecode_spark"), (billing, "pgdecode_spark"), (crm, "default_pool")):
        assert {t.task_id: t.pool for t in dag.tasks if t.pool != "default_pool"} == (
            {"merge": pool, "drain": pool} if pool != "default_pool" else {}
        )
        assert dag.get_task("merge").pool == dag.get_task("drain").pool == pool

    # schedules: the source's cron, the [pgdecode] schedule, or the slot's Asset
    assert shop.timetable.expression == "*/5 * * * *"
    assert billing.timetable.expression == "*/7 * * * *"
    (asset,) = crm.timetable.asset_condition.objects
    assert isinstance(asset, Asset) and asset.uri == "pgdecode-slot://crm_db/pgdecode_crm"
    (watcher,) = asset.watchers
    assert isinstance(watcher.trigger, SlotChangesEventTrigger) and watcher.trigger.poll_interval == 5
    assert "event-driven" in crm.tags and "source:crm" in crm.tags

    # settings: the file's, else [pgdecode]'s (30 s of waiting for a run the trigger started)
    assert shop.get_task("wait_for_changes").timeout == 60 and crm.get_task("wait_for_changes").timeout == 30
    assert shop.get_task("slot_health").max_lag_bytes == 1024
    assert billing.get_task("confirm").retention_days is None and shop.get_task("confirm").retention_days == 7

    # the backfill DAGs: the example's tasks, the source fixed, the merge in the pool
    for name, dag_pool in (("shop", "pgdecode_spark"), ("billing", "pgdecode_spark"), ("crm", "default_pool")):
        backfill = bag.dags[f"pgdecode_{name}_backfill"]
        assert sorted(t.task_id for t in backfill.tasks) == sorted(BACKFILL)
        assert backfill.get_task("merge").pool == dag_pool
        assert backfill.get_task("initial_load").slot_name == f"pgdecode_{name}"
        assert backfill.timetable.expression == "0 0 * * *" and backfill.is_paused_upon_creation
    backfill = bag.dags["pgdecode_shop_backfill"]
    assert backfill.params["tables"] == ["public.customers", "public.order_*"] and backfill.params["delta_root"] == ""
    merge_root = backfill.get_task("merge").delta_root
    assert "'/data/shop/delta_backfill' if params.mode == 'replay' else '/data/shop/delta'" in merge_root
    assert bag.dags["pgdecode_billing_backfill"].get_task("initial_load").publication == "billing_pub"
    # the example DAGs are untouched: their merges stay in Airflow's default pool
    assert bag.dags["pgdecode_incremental"].get_task("merge").pool == "default_pool"
    assert bag.dags["pgdecode_incremental"].timetable.expression == "*/7 * * * *"


def test_parsing_opens_no_connection(parse: Any, monkeypatch: pytest.MonkeyPatch, unreachable_conn: Any) -> None:
    """Every connection of the file points at a port nothing listens on, and any attempt to
    connect fails the test: parsing reads the file and nothing else."""
    import psycopg

    conn_id, _ = unreachable_conn("postgres")
    for name in ("SHOP_DB", "BILLING_DB", "CRM_DB"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{name}", json.dumps({"conn_type": "postgres", "host": "127.0.0.1"}))
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError(f"a connection was opened while parsing: {args}")

    monkeypatch.setattr(psycopg, "connect", refuse)
    monkeypatch.setattr(psycopg.Connection, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    bag = parse(SOURCES.replace("shop_db", conn_id))
    assert not bag.import_errors, bag.import_errors
    assert "pgdecode_shop_incremental" in bag.dags and attempts == []


def test_a_broken_file_fails_the_dag_file_naming_the_problem(parse: Any, tmp_path: Path) -> None:
    bag = parse(SOURCES.replace("plugin: pgoutput", "plugin: wal2json"))
    (error,) = (v for k, v in bag.import_errors.items() if k.endswith("pgdecode_sources.py"))
    assert (
        f"{tmp_path / 'sources.yaml'}:19: source 'billing': field 'plugin': must be one of test_decoding, pgoutput"
        in (error)
    )
    assert not [d for d in bag.dags if d.startswith(("pgdecode_shop", "pgdecode_billing", "pgdecode_crm"))]
    assert set(bag.dags) == set(EXAMPLES)  # the other DAG files are not affected


def test_a_missing_file_is_an_error_only_when_named(
    parse: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bag = parse(None)  # no PGDECODE_SOURCES, no dags/pgdecode_sources.yaml: no DAG, no error
    assert not bag.import_errors and set(bag.dags) == set(EXAMPLES)
    monkeypatch.setenv("PGDECODE_SOURCES", str(tmp_path / "nowhere.yaml"))
    bag = parse(None)
    (error,) = bag.import_errors.values()
    assert f"the sources file {tmp_path / 'nowhere.yaml'} does not exist" in error


def test_the_shipped_example_is_valid_and_the_dag_file_thin(parse: Any) -> None:
    example = DAGS / "pgdecode_sources.example.yaml"
    bag = parse(example.read_text())
    assert not bag.import_errors, bag.import_errors
    assert {"pgdecode_shop_incremental", "pgdecode_billing_backfill", "pgdecode_crm_incremental"} <= set(bag.dags)
    assert not (DAGS / "pgdecode_sources.yaml").exists()  # shipped as an example: no DAGs by default
    text = (DAGS / "pgdecode_sources.py").read_text()
    assert "from airflow_provider_pgdecode.example_dags.sources import sources_dags" in text
    assert "airflow" in text.lower() and "dag" in text.lower()  # found by Airflow's safe mode
