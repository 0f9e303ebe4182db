"""Fixtures of the DAG tests: each spark-submit of a DAG run loads Delta's jars from the Ivy cache;
some DAG tests merge through the session's Spark Connect server instead."""

from __future__ import annotations

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
