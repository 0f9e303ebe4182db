"""A Spark Connect server that is not there, or goes away, is named as such within a minute (issue 35).

No Spark server here: a port where nothing listens (bound to get a free one, then closed), real gRPC
calls to it and pyspark's own retry loop, its sleeps recorded instead of slept (no wall clock)."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from pyspark.sql.connect.client.retries import DefaultPolicy, Retrying
from pyspark.sql.connect.session import SparkSession as ConnectSession

from airflow_provider_pgdecode.errors import MergeInputError, SparkConnectUnreachableError, is_deterministic
from airflow_provider_pgdecode.spark.connect_client import (
    CONNECT_RETRY_POLICY,
    BoundedRetryPolicy,
    bounded_retry_policy,
    server_gone,
    worst_case_retry_seconds,
)
from airflow_provider_pgdecode.spark.session import build_connect_session, connect_mode, connect_server_named


@pytest.fixture
def dead_port() -> int:
    """A port of 127.0.0.1 where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def channel(dead_port: int) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{dead_port}") as opened:
        yield opened


def _call(channel: grpc.Channel) -> None:
    """One real gRPC call of the Connect service (its Config method) on ``channel``."""
    channel.unary_unary("/spark.connect.SparkConnectService/Config")(b"", timeout=10)


def _exhaust(policy: BoundedRetryPolicy, channel: grpc.Channel) -> tuple[list[float], BaseException]:
    """Run a call against the dead port under pyspark's own retry loop (``Retrying``, as every call of a
    Connect client runs) until it gives up; the waits it asked for, in seconds, and the error it raised."""
    slept: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyspark's RETRIES_EXCEEDED warning
        with pytest.raises(grpc.RpcError) as raised:
            for attempt in Retrying([policy], sleep=slept.append):
                with attempt:
                    _call(channel)
    return slept, raised.value


def test_the_retry_policy_gives_up_within_a_minute_and_still_retries(channel: grpc.Channel) -> None:
    policy = bounded_retry_policy()
    # Worst case of every wait (each at its cap, the server's RetryInfo honoured up to its cap, full jitter).
    assert worst_case_retry_seconds(policy) < 45
    assert policy.max_retries is not None and policy.max_retries >= 5
    assert policy.max_server_retry_delay is not None and policy.max_server_retry_delay <= policy.max_backoff
    # What it replaces: pyspark's DefaultPolicy waits at least 10 minutes per call (its own comment).
    assert worst_case_retry_seconds(DefaultPolicy()) > 600
    assert worst_case_retry_seconds(BoundedRetryPolicy(max_retries=None)) == float("inf")

    # A real call against a closed port, retried by pyspark's own loop: UNAVAILABLE is retried
    # max_retries times, the waits grow from 0.1 s and sum to under the worst case, then it gives up.
    slept, error = _exhaust(policy, channel)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
    assert len(slept) == CONNECT_RETRY_POLICY["max_retries"]
    assert slept[0] == pytest.approx(0.1) and slept == sorted(slept)
    assert sum(slept) <= worst_case_retry_seconds(policy)
    assert policy.gave_up is error

    # The session gave up on its server: its later calls (the job's reads of its settings after the
    # failure, its release at the end) are not retried again.
    again, second = _exhaust(policy, channel)
    assert again == [] and second.code() == grpc.StatusCode.UNAVAILABLE

    # A fresh policy (a new session) retries again.
    assert len(_exhaust(bounded_retry_policy(), channel)[0]) == CONNECT_RETRY_POLICY["max_retries"]


def test_a_session_on_a_port_where_nothing_listens_names_the_server_and_the_way_forward(dead_port: int) -> None:
    with pytest.raises(SparkConnectUnreachableError) as raised:
        build_connect_session(f"sc://127.0.0.1:{dead_port}/;user_id=etl;token=s3cr3t", conn_id="spark_connect")
    message = str(raised.value)
    assert message.startswith(
        f"the Spark Connect server at sc://127.0.0.1:{dead_port} (connection 'spark_connect') is not reachable: "
        f"nothing answers at 127.0.0.1:{dead_port} (Connection refused). "
    ), message
    assert f"python -m airflow_provider_pgdecode.spark.connect_server --port {dead_port}" in message
    assert "the spark_connect connection's host and port" in message
    assert "s3cr3t" not in message and "token" not in message
    # Airflow's retries apply: a server its supervisor restarts answers a later try.
    assert not is_deterministic(raised.value)


@pytest.fixture
def lost_session(dead_port: int, channel: grpc.Channel) -> Iterator[tuple[Any, str]]:
    """A client session of the dead port whose retry policy gave up on it, as a merge's session does
    once its server stopped answering mid-run (its first call then failed after the policy's waits)."""
    url = f"sc://127.0.0.1:{dead_port}"
    with connect_mode():
        spark = ConnectSession.builder.remote(url).create()  # no call to the server yet
    policy = bounded_retry_policy()
    spark.client.set_retry_policies([policy])
    _exhaust(policy, channel)
    yield spark, url
    spark.stop()


def test_a_server_gone_mid_run_is_named_and_the_next_call_fails_at_once(lost_session: tuple[Any, str]) -> None:
    spark, url = lost_session
    port = url.rsplit(":", 1)[1]
    with pytest.raises(SparkConnectUnreachableError) as raised:
        with connect_server_named(spark, url, conn_id="spark_connect"):
            spark.conf.get("spark.driver.memory", None)  # a real call of the session: one attempt, no waits
    message = str(raised.value)
    assert message.startswith(
        f"the Spark Connect server at sc://127.0.0.1:{port} (connection 'spark_connect') is not reachable: "
        "it went away while the task ran ("
    ), message
    assert "Connection refused" in message and f"--port {port}" in message
    assert server_gone(raised.value.__cause__, spark) is not None  # pyspark's error kept as the cause


def test_the_jobs_own_errors_pass_unchanged(lost_session: tuple[Any, str], dead_port: int) -> None:
    spark, url = lost_session
    refusal = MergeInputError("the batch is refused")
    with pytest.raises(MergeInputError) as raised, connect_server_named(spark, url):
        raise refusal
    assert raised.value is refusal
    # Without a session that gave up, an error that is not the server's passes as it is.
    with connect_mode():
        fresh = ConnectSession.builder.remote(url).create()
    fresh.client.set_retry_policies([bounded_retry_policy()])
    try:
        with pytest.raises(ZeroDivisionError), connect_server_named(fresh, url):
            _ = 1 / 0
    finally:
        fresh.client.set_retry_policies([])  # its release on stop(): one attempt, no waits
        fresh.stop()
