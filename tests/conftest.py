"""Shared fixtures: one throwaway PostgreSQL cluster per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Airflow reads these when first imported, so they are set before anything imports it.
_AIRFLOW_HOME = tempfile.mkdtemp(prefix="pgdecode-airflow-home-")
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "True"
# dag.test() runs DAGs from files in the DAGs folder: the project's own dags/.
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dags"
)
# Every Spark driver the tests start (the session below, each spark-submit of a merge, the DAG
# runs' subprocesses) lives for seconds: the JIT's optimizing tier costs more CPU than it saves
# there (measured: a small Delta merge job used ~20% less CPU with C1 only, on 2 cores).
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import psycopg  # noqa: E402
import pytest  # noqa: E402
from psycopg import sql  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

from pgdecode_testing import postgres_binaries  # noqa: E402
from pgdecode_testing.connect_server import ConnectServerError, LocalConnectServer  # noqa: E402
from pgdecode_testing.postgres_cluster import ThrowawayCluster, debian_bindir  # noqa: E402
from pgdecode_testing.s3_server import LocalS3Server  # noqa: E402

# `make test` keeps the suite within CI's budget: a few long tests repeat, on another plugin, another
# major or another storage, what their siblings already cover, and the SIGKILL soak test is long by
# nature. PGDECODE_FULL_TESTS=1 runs those too.
FULL_TESTS = os.environ.get("PGDECODE_FULL_TESTS", "") not in ("", "0")


PLUGIN_REPEAT = "the other plugin runs this test end to end; the decoding and extract tests cover both"


def full_only(value: object, why: str) -> Any:
    """A parametrization run only with PGDECODE_FULL_TESTS=1 (a skip that says so otherwise)."""
    return pytest.param(value, marks=full_only_test(why))


def full_only_test(why: str) -> pytest.MarkDecorator:
    """A test run only with PGDECODE_FULL_TESTS=1; ``why`` names what covers its ground in ``make test``."""
    return pytest.mark.skipif(not FULL_TESTS, reason=f"{why}; PGDECODE_FULL_TESTS=1 runs it")


TEST_DATABASE = "pgdecode_test"

pytest_plugins = ["tests.scheduling"]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[ThrowawayCluster]:
    """One throwaway cluster (wal_level=logical, 2PC on) for the whole session: Debian's
    PostgreSQL, or the major ``PG_VERSION`` names (``PG_VERSION=17 make test``)."""
    with ThrowawayCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pg_dsn(pg_cluster: ThrowawayCluster) -> str:
    """The DSN of the ``pgdecode_test`` database."""
    return pg_cluster.create_database(TEST_DATABASE)


# --- the PostgreSQL version matrix ------------------------------------------------------------
# A test marked ``pg_matrix`` runs on the session's cluster and again on every other supported
# major (14 to 18) through ``pg_conn``/``slot_name``/``matrix_dsn``: only the tests whose outcome
# depends on what the server sends (decoding, extract, a merge of what was extracted), since the
# rest of the suite sees PostgreSQL only through them. ``pg_matrix(since=17)`` / ``(before=17)``
# keep a test to the majors a behaviour concerns. One cluster per major per worker, started by
# the first test that needs it and kept for the session.


def _session_major() -> int:
    """The major of the session's cluster: ``PG_VERSION``'s, else the installed Debian one's."""
    asked = postgres_binaries.requested_major()
    if asked is not None:
        return asked
    debian = debian_bindir()
    name = debian.parent.name if debian is not None else ""
    return int(name) if name.isdigit() else postgres_binaries.DEBIAN_MAJOR


SESSION_MAJOR = _session_major()
MATRIX_MAJORS = tuple(m for m in postgres_binaries.SUPPORTED_MAJORS if m != SESSION_MAJOR)


def _binaries_missing(major: int) -> str | None:
    if debian_bindir(major) is not None or postgres_binaries.fetched(major):
        return None
    return f"PostgreSQL {major} binaries are not fetched: make fetch-postgres PG_VERSION={major} (make test does)"


def on_major(major: int, value: object = None) -> Any:
    """A parametrization that runs on PostgreSQL ``major`` only (skipped, saying how to fetch it,
    when its binaries are not there)."""
    missing = _binaries_missing(major)
    return pytest.param(
        major if value is None else value,
        id=f"pg{major}",
        marks=pytest.mark.skipif(missing is not None, reason=missing or ""),
    )


def matrix_majors(since: int = 14, before: int = 19) -> list[Any]:
    """The parametrization of a ``pg_matrix`` test: the session's major, then the others."""
    params = [pytest.param(SESSION_MAJOR, id=f"pg{SESSION_MAJOR}")] if since <= SESSION_MAJOR < before else []
    return params + [on_major(m) for m in MATRIX_MAJORS if since <= m < before]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("pg_matrix")
    if marker is not None and "pg_version" in metafunc.fixturenames:
        metafunc.parametrize("pg_version", matrix_majors(**marker.kwargs), indirect=True)


@pytest.fixture
def pg_version(request: pytest.FixtureRequest) -> int:
    """The PostgreSQL major the test runs on: a ``pg_matrix`` test's, else the session's."""
    return int(getattr(request, "param", SESSION_MAJOR))


@pytest.fixture(scope="session")
def pg_matrix_clusters() -> Iterator[dict[int, tuple[ThrowawayCluster, str]]]:
    """The matrix's clusters by major, with their test database's DSN; stopped at the end."""
    clusters: dict[int, tuple[ThrowawayCluster, str]] = {}
    yield clusters
    for cluster, _ in clusters.values():
        cluster.stop()


def major_cluster(clusters: dict[int, tuple[ThrowawayCluster, str]], major: int) -> tuple[ThrowawayCluster, str]:
    """The worker's cluster of ``major`` (started on first use) and its test database's DSN."""
    if major not in clusters:
        missing = _binaries_missing(major)
        if missing is not None:
            pytest.skip(missing)
        cluster = ThrowawayCluster(pg_version=major)
        cluster.start()
        clusters[major] = (cluster, cluster.create_database(TEST_DATABASE))
    return clusters[major]


@pytest.fixture
def matrix_dsn(request: pytest.FixtureRequest, pg_version: int) -> str:
    """The ``pgdecode_test`` database of the cluster the test runs on (see ``pg_matrix``)."""
    if pg_version == SESSION_MAJOR:
        return str(request.getfixturevalue("pg_dsn"))
    return major_cluster(request.getfixturevalue("pg_matrix_clusters"), pg_version)[1]


def rollback_prepared(conn: psycopg.Connection[Any]) -> None:
    """Roll back the prepared transactions left in the connection's database: a test that failed
    before resolving its own would leave their locks to block the tests after it."""
    for (gid,) in conn.execute("select gid from pg_prepared_xacts where database = current_database()").fetchall():
        conn.execute(sql.SQL("rollback prepared {}").format(sql.Literal(gid)))


@pytest.fixture
def pg_conn(matrix_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit psycopg 3 connection to ``pgdecode_test`` (prepared transactions the test
    left are rolled back afterwards), on the test's matrix major when it has one."""
    with psycopg.connect(matrix_dsn, autocommit=True) as conn:
        yield conn
        rollback_prepared(conn)


@pytest.fixture
def slot_name(matrix_dsn: str) -> Iterator[str]:
    """A unique slot name; the slot is dropped afterwards, since an idle slot retains WAL, with the
    slots named after it (``_po``, the upper-half slot ``_upper``)."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(matrix_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE (slot_name = %s OR slot_name LIKE %s) AND NOT active",
            (name, name + "\\_%"),
        )


@contextmanager
def two_plugin_source(
    conn: psycopg.Connection, slot_name: str, publication: str, tables: Sequence[str], ddl: str
) -> Iterator[str]:
    """``tables`` made afresh by ``ddl``, a publication of them and two two-phase slots: ``slot_name``
    (test_decoding) and ``slot_name + "_po"`` (pgoutput). Yields ``slot_name``; drops the pgoutput
    slot and the publication after (the ``slot_name`` fixture drops the other slot)."""
    conn.execute(f"drop table if exists {', '.join(tables)} cascade; drop publication if exists {publication}")
    conn.execute(ddl)
    conn.execute(f"create publication {publication} for table {', '.join(tables)}")
    conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (slot_name + "_po",))
    yield slot_name
    conn.execute("select pg_drop_replication_slot(%s)", (slot_name + "_po",))
    conn.execute(f"drop publication if exists {publication}")


# --- a local S3-compatible server (moto's server mode, a child process on 127.0.0.1) --------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    """One S3-compatible server for the whole session; tests take buckets of their own."""
    with LocalS3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: LocalS3Server) -> str:
    """A fresh bucket on the session's S3 server: ``s3://<name>``."""
    return s3_server.create_bucket(f"pgdecode-{uuid.uuid4().hex[:12]}")


# --- one local SparkSession with Delta, shared by the merge, oracle and DAG tests ----------

REPO = Path(__file__).resolve().parents[1]


def _fetch_delta_jars() -> None:
    """Fill the project-local Ivy cache once (a no-op in well under a second when already filled)."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fetch_delta_jars.py")], check=True, stdout=subprocess.DEVNULL
    )


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from airflow_provider_pgdecode.spark.session import build_spark_session, log_java_options

    _fetch_delta_jars()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = build_spark_session(
        "local[2]",
        app_name="pgdecode-tests",
        # hadoop-aws (s3a://) for the tests on the local S3 server: one JVM serves every test.
        object_store=True,
        extra_conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.driver.memory": "2g",
            # Delta's own housekeeping is not under test: skip the work it adds to each commit.
            "spark.databricks.delta.stalenessLimit": "0",
            # One JVM runs a worker's every Spark test: its compiled code outgrew the default
            # code cache once ("Out of space in CodeCache for method handle intrinsic").
            "spark.driver.extraJavaOptions": f"{log_java_options()} -XX:ReservedCodeCacheSize=512m",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    # py4j logs while the interpreter shuts down, after pytest closed the streams.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def spark_connect_server(s3_server: LocalS3Server) -> Iterator[LocalConnectServer]:
    """One Spark Connect server with Delta for the session (started by the first test that asks):
    the Connect path's tests, the DAG tests whose merges go through a warm session, and the
    deployment's. It reads and writes the session's S3 server through its own S3A settings, as
    a deployment's server on a lake does (docs/spark-connect.md)."""
    _fetch_delta_jars()
    server = LocalConnectServer(
        master="local[2]",
        conf={"spark.sql.shuffle.partitions": "2", "spark.databricks.delta.stalenessLimit": "0"},
        object_store=s3_server.settings,
    )
    try:
        server.start()
    except ConnectServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def connect(spark_connect_server: LocalConnectServer) -> Iterator[Any]:
    """A client session of the session's Spark Connect server, stopped after the test."""
    from airflow_provider_pgdecode.spark.session import build_connect_session

    session = build_connect_session(spark_connect_server.url)
    yield session
    session.stop()


@pytest.fixture
def unreachable_conn(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``make(conn_type)``: an Airflow connection id (``nowhere``) whose port nothing listens on,
    and that port."""
    import json
    import socket

    def make(conn_type: str) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # closed again below: nothing listens there
        conn = {"conn_type": conn_type, "host": "127.0.0.1", "port": port, "login": "u", "schema": "db"}
        monkeypatch.setenv("AIRFLOW_CONN_NOWHERE", json.dumps(conn))
        return "nowhere", port

    return make
