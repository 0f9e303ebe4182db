"""Provider registration: the entry point, the schema, and what Airflow's CLI lists."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode import __version__
from airflow_provider_pgdecode.get_provider_info import get_provider_info
from airflow_provider_pgdecode.utils.config import provider_config

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``airflow providers list|hooks|triggers -o json`` run in parallel, with a fresh AIRFLOW_HOME."""
    home = tmp_path_factory.mktemp("airflow-home")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
    procs = {
        what: subprocess.Popen(
            [AIRFLOW, "providers", what, "-o", "json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for what in ("list", "hooks", "triggers")
    }
    out = {}
    for what, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out[what] = json.loads(stdout)
    return out


def test_entry_point_points_at_get_provider_info() -> None:
    found = [
        e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_provider_pgdecode")
    ]
    assert [e.value for e in found] == ["airflow_provider_pgdecode.get_provider_info:get_provider_info"]
    assert found[0].load() is get_provider_info


def test_provider_info_is_valid_and_its_modules_import() -> None:
    import jsonschema
    from airflow import __file__ as airflow_init

    info = get_provider_info()
    schema = json.loads((Path(airflow_init).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    assert info["package-name"] == "airflow-provider-pgdecode"  # pitfall P10: the canonical dist name
    assert info["versions"] == [__version__]
    integrations = {i["integration-name"] for i in info["integrations"]}
    modules = {
        kind: [m for entry in info[kind] for m in entry["python-modules"]]
        for kind in ("hooks", "operators", "sensors", "triggers")
    }
    assert all(entry["integration-name"] in integrations for kind in modules for entry in info[kind])
    assert len(modules["operators"]) == 11 and len(modules["sensors"]) == 3 and len(modules["triggers"]) == 2
    for module in (m for ms in modules.values() for m in ms):
        importlib.import_module(module)
    assert info["documentation-url"] == "https://github.com/pgdecode/airflow-provider-pgdecode"
    assert info["config"] == provider_config() and "data_dir" in info["config"]["pgdecode"]["options"]
    for conn in info["connection-types"]:
        module, _, name = conn["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook.conn_type == conn["connection-type"]
        assert hook.hook_name == conn["hook-name"]


def test_airflow_cli_lists_the_provider_hook_and_trigger(cli: dict[str, Any]) -> None:
    providers = {p["package_name"]: p for p in cli["list"]}
    assert providers["airflow-provider-pgdecode"]["version"] == __version__
    hooks = [h for h in cli["hooks"] if h["package_name"] == "airflow-provider-pgdecode"]
    assert hooks == [
        {
            "connection_type": "pgdecode",
            "class": "airflow_provider_pgdecode.hooks.pgdecode.PgDecodeHook",
            "conn_id_attribute_name": "postgres_conn_id",
            "package_name": "airflow-provider-pgdecode",
            "hook_name": "PostgreSQL logical decoding (pgdecode)",
        }
    ]
    triggers = sorted(t["class"] for t in cli["triggers"] if t["package_name"] == "airflow-provider-pgdecode")
    assert triggers == [
        "airflow_provider_pgdecode.triggers.slot_changes",
        "airflow_provider_pgdecode.triggers.slot_event",
    ]


def test_the_connection_form_of_the_pgdecode_type() -> None:
    """What Airflow's providers manager builds for the form (the UI's hidden fields, labels,
    placeholders and extra fields) from the metadata, without importing the hook."""
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    behaviour = manager.field_behaviours["pgdecode"]
    assert behaviour["hidden_fields"] == []
    assert behaviour["relabeling"] == {"schema": "Database", "login": "User"}
    assert set(behaviour["placeholders"]) == {"host", "port", "schema", "login", "extra"}
    assert "REPLICATION" in behaviour["placeholders"]["login"]
    widget = manager.connection_form_widgets["extra__pgdecode__sslmode"]
    assert widget.field_name == "sslmode" and widget.field["schema"]["title"] == "SSL mode"
    assert "verify-full" in widget.field["schema"]["enum"]


def _operator_classes() -> list[type]:
    from airflow.sdk import BaseOperator

    classes = []
    for entry in ("operators", "sensors"):
        for module_name in (m for e in get_provider_info()[entry] for m in e["python-modules"]):
            module = importlib.import_module(module_name)
            classes += [
                c
                for _, c in inspect.getmembers(module, inspect.isclass)
                if issubclass(c, BaseOperator) and c.__module__ == module_name
            ]
    return classes


@pytest.mark.parametrize("cls", _operator_classes(), ids=lambda c: c.__name__)
def test_operators_document_their_templated_fields_and_do_nothing_at_parse_time(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    assert "Example::" in doc
    for field in cls.template_fields:
        match = re.search(rf":param {field}:(.*?)(?=\n:param |\Z)", doc, re.S)
        assert match, f"{cls.__name__} does not document {field}"
        assert "(templated)" in match.group(1), f"{cls.__name__}.{field} is not marked (templated)"
    # Arguments are only stored: an unknown connection and slot do not fail at DAG-parse time.
    required = {
        "slot_name": "no_such_slot",
        "staging_root": "/nonexistent",
        "batch_path": "/nonexistent",
        "batch_paths": "/nonexistent",
        "delta_root": "/nonexistent",
        "request_id": "no_such_request",
    }
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in required.items() if k in params}
    if "postgres_conn_id" in params:
        kwargs["postgres_conn_id"] = "no_such_connection"
    op = cls(task_id="t", **kwargs)
    for field in cls.template_fields:
        assert hasattr(op, field)


def test_pgdecode_connection_type_works_like_postgres(
    pg_cluster: Any, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, slot_name: str
) -> None:
    from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
    from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor

    conn = json.loads(pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("AIRFLOW_CONN_CDC_SOURCE", json.dumps({**conn, "conn_type": "pgdecode"}))
    with PgDecodeHook(postgres_conn_id="cdc_source") as hook:
        hook.ensure_slot(slot_name)
    health = PgDecodeSlotHealthSensor(task_id="h", slot_name=slot_name, postgres_conn_id="cdc_source")
    assert health.poke({}).xcom_value["database"] == "pgdecode_test"
