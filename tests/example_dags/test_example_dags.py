"""The example DAGs shipped in the package: importable, documented, parsed from dags/ by Airflow,
and configured by the [pgdecode] section."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import airflow_provider_pgdecode.example_dags as example_dags
from airflow_provider_pgdecode.operators.merge import delta_table_asset

DAGS = Path(__file__).resolve().parents[2] / "dags"
NAMES = (
    "pgdecode_incremental",
    "pgdecode_backfill",
    "pgdecode_verify",
    "pgdecode_delta_consumer",
    "pgdecode_event_driven",
    "pgdecode_maintenance",
)


@pytest.fixture()
def bag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from airflow.dag_processing.dagbag import DagBag

    for name in ("DATA_DIR", "SCHEDULE", "WAIT_SECONDS", "MAX_LAG_BYTES", "RETENTION_DAYS", "SOURCES"):
        monkeypatch.delenv(f"PGDECODE_{name}", raising=False)
    monkeypatch.delenv("AIRFLOW__PGDECODE__SOURCES", raising=False)  # no sources file: its DAG file makes none
    monkeypatch.setenv("AIRFLOW__PGDECODE__DATA_DIR", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__PGDECODE__SCHEDULE", "*/5 * * * *")
    monkeypatch.setenv("AIRFLOW__PGDECODE__MAX_LAG_BYTES", "1024")
    monkeypatch.setenv("PGDECODE_RETENTION_DAYS", "3")  # the old variable still counts
    dagbag = DagBag(dag_folder=str(DAGS))
    assert not dagbag.import_errors, dagbag.import_errors
    return dagbag


def test_the_dag_files_are_thin_and_found_by_safe_mode() -> None:
    package = Path(example_dags.__file__).parent
    for name in NAMES:
        text = (DAGS / f"{name}.py").read_text(encoding="utf-8")
        assert "airflow" in text.lower() and "dag" in text.lower()
        assert f"from airflow_provider_pgdecode.example_dags import {name}" in text
        assert (package / f"{name}.py").is_file()
        assert importlib.import_module(f"airflow_provider_pgdecode.example_dags.{name}").dag.dag_id == name


def test_the_settings_reach_the_parsed_dags(bag, tmp_path: Path) -> None:
    assert sorted(bag.dags) == sorted(NAMES)
    incremental = bag.dags["pgdecode_incremental"]
    assert incremental.params["staging_uri"] == f"{tmp_path}/staging"
    assert incremental.params["delta_root"] == f"{tmp_path}/delta"
    assert incremental.timetable.expression == "*/5 * * * *"
    assert incremental.get_task("slot_health").max_lag_bytes == 1024
    assert incremental.get_task("confirm").retention_days == 3
    assert bag.dags["pgdecode_backfill"].params["staging_uri"] == f"{tmp_path}/staging"
    assert bag.dags["pgdecode_verify"].params["delta_root"] == f"{tmp_path}/delta"
    maintenance = bag.dags["pgdecode_maintenance"]
    assert maintenance.params["delta_root"] == f"{tmp_path}/delta"
    assert maintenance.timetable.expression == "0 0 * * 0" and maintenance.max_active_runs == 1
    # a watermark outlives the staged batches: 30 days, or retention_days when longer
    assert maintenance.get_task("maintenance").min_txn_retention_hours == 720


def test_every_dag_has_doc_md_and_every_param_a_description(bag) -> None:
    for name in NAMES:
        dag = bag.dags[name]
        assert dag.doc_md and dag.doc_md.startswith(f"{name}: "), name
        for key, param in dag.params.items():
            assert param.description, f"{name}: param {key} has no description"


def test_xcom_args_instead_of_xcom_pull_templates(bag) -> None:
    from airflow.sdk.definitions.xcom_arg import XComArg

    incremental = bag.dags["pgdecode_incremental"]
    for task_id, field in (("merge", "batch_paths"), ("confirm", "batch_path")):
        arg = getattr(incremental.get_task(task_id), field)
        assert isinstance(arg, XComArg) and arg.operator.task_id == "extract" and arg.key == "path"
    assert incremental.get_task("extract").multiple_outputs
    verify = bag.dags["pgdecode_verify"]
    assert verify.get_task("verify").snapshot.operator.task_id == "verify_snapshot"
    assert verify.get_task("extract").upto_lsn.key == "lsn"
    assert bag.dags["pgdecode_backfill"].get_task("wait_for_snapshot").request_id.operator.task_id == "prepare"
    # The one Jinja pull left: the merge takes the batches of whichever branch ran.
    package = Path(example_dags.__file__).parent
    pulls = {p.name: len(re.findall(r"xcom_pull", p.read_text(encoding="utf-8"))) for p in package.glob("*.py")}
    assert {k: v for k, v in pulls.items() if v} == {"pgdecode_backfill.py": 2}


def test_the_consumer_schedules_on_the_asset_the_merge_emits(bag, tmp_path: Path) -> None:
    from airflow.sdk import Asset

    orders = delta_table_asset(tmp_path / "delta", "public", "orders")
    assert orders == Asset((tmp_path / "delta" / "public" / "orders").resolve().as_uri())
    consumer = bag.dags["pgdecode_delta_consumer"]
    assert consumer.timetable.asset_condition.objects == (orders,)


CYCLE = ("ensure_slot", "slot_health", "wait_for_changes", "extract", "merge", "confirm", "drain")


def _edges(dag) -> set[tuple[str, str]]:
    return {(t.task_id, d) for t in dag.tasks for d in t.downstream_task_ids}


def test_the_event_driven_dag_is_the_cycle_scheduled_on_the_slots_asset(bag, tmp_path: Path) -> None:
    from airflow.sdk import Asset

    from airflow_provider_pgdecode.triggers.slot_event import SlotChangesEventTrigger

    event, incremental = bag.dags["pgdecode_event_driven"], bag.dags["pgdecode_incremental"]
    # the same tasks, wired the same way (one factory builds both)
    assert sorted(t.task_id for t in event.tasks) == sorted(CYCLE) == sorted(t.task_id for t in incremental.tasks)
    assert _edges(event) == _edges(incremental)
    (asset,) = event.timetable.asset_condition.objects
    assert isinstance(asset, Asset)
    assert (asset.name, asset.uri) == ("pgdecode_slot_pgdecode", "pgdecode-slot://pgdecode_default/pgdecode")
    (watcher,) = asset.watchers
    assert isinstance(watcher.trigger, SlotChangesEventTrigger)
    assert watcher.trigger.slot_name == "pgdecode" and watcher.trigger.postgres_conn_id == "pgdecode_default"
    # the watched slot is the one every task reads: fixed at parse time, not a param
    assert "slot_name" not in event.params and "postgres_conn_id" not in event.params
    for task_id in ("ensure_slot", "wait_for_changes", "extract", "confirm"):
        assert event.get_task(task_id).slot_name == "pgdecode", task_id
    assert event.params["staging_uri"] == f"{tmp_path}/staging"
    assert event.get_task("slot_health").max_lag_bytes == 1024
    assert event.max_active_runs == 1


def test_the_dags_leave_deferrable_to_airflows_setting() -> None:
    """No example DAG hard-codes ``deferrable``: [operators] default_deferrable decides."""
    package = Path(example_dags.__file__).parent
    assert not [p.name for p in package.glob("*.py") if "deferrable=" in p.read_text(encoding="utf-8")]
