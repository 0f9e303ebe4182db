"""Fixtures of the DAG tests: each spark-submit of a DAG run loads Delta's jars from the Ivy cache."""

from __future__ import annotations

import pytest

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
