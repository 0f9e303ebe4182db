"""Fixtures of the operator tests: the source connection as an Airflow env var, a fake task instance."""

from __future__ import annotations

from typing import Any

import pytest

from pgdecode_testing.postgres_cluster import ThrowawayCluster


class FakeTI:
    """Just enough of a task instance for execute(): XComs by task id, and a record of the pulls."""

    def __init__(self, xcoms: dict[str, Any] | None = None) -> None:
        self.xcoms: dict[str, Any] = dict(xcoms or {})
        self.pulls: list[dict[str, Any]] = []

    def xcom_pull(self, task_ids: str | None = None, key: str = "return_value", **kwargs: Any) -> Any:
        self.pulls.append({"task_ids": task_ids, "key": key, **kwargs})
        return self.xcoms.get(task_ids) if key == "return_value" else None

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


@pytest.fixture
def make_context() -> Any:
    """``make_context(confirm={...}, merge={...})``: a context whose ``ti`` returns those XComs."""

    def make(**xcoms: Any) -> dict[str, Any]:
        return {"ti": FakeTI(xcoms)}

    return make


@pytest.fixture
def source_conn(pg_cluster: ThrowawayCluster, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``pgdecode_default`` pointing at the test database (env var form, as hooks outside a task see it)."""
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    return "pgdecode_default"
