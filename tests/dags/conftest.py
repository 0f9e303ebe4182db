"""Fixtures of the DAG tests: each spark-submit of a DAG run loads Delta's jars from the Ivy cache;
some DAG tests merge through the session's Spark Connect server instead; Airflow's OpenLineage
listener on a transport of the test's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pgdecode_testing.connect_server import LocalConnectServer
from tests.jars import cached_delta_jars


@pytest.fixture(autouse=True)
def delta_jars_from_the_ivy_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand the merge and verify jobs the jars ``spark.jars.packages`` would resolve.

    Ivy's resolution costs seconds per spark-submit, and the DAG tests submit about twenty jobs.
    These tests are about the DAGs; resolving the packages from the Ivy cache is proven by
    tests/spark/test_spark_submit.py (offline, from the cache), and the operators' conf by
    tests/operators/test_merge.py. The fault suite does the same (tests/faults/dagproc.py).
    """
    from airflow_provider_pgdecode.spark.session import DELTA_JARS_ENV

    jars = cached_delta_jars()
    if jars:
        monkeypatch.setenv(DELTA_JARS_ENV, jars)


@pytest.fixture
def merge_through_connect(spark_connect_server: LocalConnectServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``spark_default`` names the session's Spark Connect server (a ``spark_connect`` connection):
    the DAGs' merges run as client sessions of its warm Spark, and a spark-submit fails the test.

    Half the DAG tests take this path, half spark-submit's (tests/spark/test_spark_submit.py and
    the fault suite stay on spark-submit too): both paths run the DAGs, and the suite saves a JVM
    start per merge."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    def no_spark_submit(self: SparkSubmitHook, *args: object, **kwargs: object) -> None:
        raise AssertionError("spark-submit ran although spark_default is a spark_connect connection")

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connect_server.airflow_conn_json)
    monkeypatch.setattr(SparkSubmitHook, "submit", no_spark_submit)


@pytest.fixture
def openlineage(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Airflow's OpenLineage provider configured by the test: ``openlineage(transport, **settings)``
    sets the transport, the namespace ``pgdecode_tests`` and ``[openlineage]`` settings, and
    registers the provider's own listener.

    The provider reads its configuration once (cached) and registers its listener when Airflow
    loads plugins, before a test sets a transport; so the caches are cleared and the listener
    added here, and both undone afterwards."""
    pytest.importorskip("airflow.providers.openlineage")
    from airflow.providers.openlineage import conf as ol_conf
    from airflow.providers.openlineage.plugins import listener as ol_listener
    from airflow.sdk.listener import get_listener_manager

    def clear_caches() -> None:
        for value in vars(ol_conf).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
        ol_listener.get_openlineage_listener.cache_clear()  # its client is built from the transport

    manager = get_listener_manager()
    registered: list[Any] = []

    def configure(transport: dict[str, Any], **settings: str) -> None:
        monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", json.dumps(transport))
        monkeypatch.setenv("AIRFLOW__OPENLINEAGE__NAMESPACE", "pgdecode_tests")
        for name, value in settings.items():
            monkeypatch.setenv(f"AIRFLOW__OPENLINEAGE__{name.upper()}", value)
        for listener in registered:
            manager.pm.unregister(listener)
        registered.clear()
        clear_caches()
        registered.append(ol_listener.get_openlineage_listener())
        manager.add_listener(registered[-1])

    yield configure
    for listener in registered:
        manager.pm.unregister(listener)
    monkeypatch.undo()
    clear_caches()


@pytest.fixture
def openlineage_events(openlineage: Callable[..., None], tmp_path: Any) -> Callable[[], list[dict[str, Any]]]:
    """OpenLineage's own listener on a file transport: the events a run's tasks emit, as JSON."""
    path = tmp_path / "openlineage.jsonl"
    openlineage({"type": "file", "log_file_path": str(path), "append": True})

    def events() -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return events
