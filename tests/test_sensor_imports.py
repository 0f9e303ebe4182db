"""Sensors take from the triggers only the trigger they defer to; what deciding "has changes"
takes is the slot probe's, in the hooks layer both share (issue 36)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from airflow.triggers.base import BaseTrigger

SENSORS = Path(__file__).resolve().parent.parent / "airflow_provider_pgdecode" / "sensors"


def test_sensors_import_only_trigger_classes_from_the_triggers() -> None:
    imported = [
        (node.module, alias.name)
        for path in sorted(SENSORS.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("airflow_provider_pgdecode.triggers")
        for alias in node.names
    ]
    assert imported, "the changes sensor defers to its trigger"
    for module, name in imported:
        value = getattr(importlib.import_module(module), name)
        assert isinstance(value, type) and issubclass(value, BaseTrigger), f"{name} from {module}"
