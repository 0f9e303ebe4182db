"""Fixtures of the Spark merge tests: one local SparkSession with Delta for the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REPO = Path(__file__).resolve().parents[2]


def _fetch_delta_jars() -> None:
    """Fill the project-local Ivy cache once (a no-op in well under a second when already filled)."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_delta_jars.py")], check=True,
                   stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from airflow_provider_pgdecode.spark.session import build_spark_session

    _fetch_delta_jars()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = build_spark_session(
        "local[2]",
        app_name="pgdecode-tests",
        extra_conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.driver.memory": "2g",
            # Delta's own housekeeping is not under test: skip the work it adds to each commit.
            "spark.databricks.delta.stalenessLimit": "0",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
