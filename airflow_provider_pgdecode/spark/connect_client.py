"""How long a Spark Connect client of pgdecode waits for its server, and how it knows the server is gone.

pyspark's Connect client retries every call that fails with gRPC ``UNAVAILABLE`` (a refused
connection, a broken stream) under its ``DefaultPolicy``: 15 retries, waits growing from 50 ms by
four times up to 60 s, about 10 minutes per call (and a failed merge makes more calls: its reads
of the session's settings, the session's release). A server killed mid-merge kept the merge task
waiting some 16 minutes, and the task then failed as ``NO_ACTIVE_SESSION``. Every session pgdecode opens
(:func:`~airflow_provider_pgdecode.spark.session.build_connect_session`) gets
:func:`bounded_retry_policy` instead: a blip is still retried, a server that is gone is given up
in well under a minute, and from then on that session fails at once rather than waiting again.
:func:`server_gone` tells the errors that mean the server went away from the job's own errors.

Needs pyspark's Connect client (``pyspark.sql.connect``) and grpc; imported only where a Connect
session is built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import grpc
from pyspark.sql.connect.client.retries import DefaultPolicy, RetryPolicy, RetryPolicyState

CONNECT_RETRY_POLICY: Mapping[str, Any] = {
    # pyspark's DefaultPolicy (15 retries, 50 ms x4 up to 60 s) waits ~10 minutes per call for a
    # server that is gone: a merge on a killed server hung ~16 minutes. These keep what a blip needs
    # (8 retries, 0.1 s doubling to 8 s: a server or proxy away for a few seconds, or a broken
    # stream, is reattached well inside ~20 s of waits) and give up within a minute: the worst case,
    # every wait at its cap, the server's RetryInfo honoured up to 2 s and full jitter, is 31.6 s of
    # waits (worst_case_retry_seconds()), plus attempts that take milliseconds against a closed port.
    "max_retries": 8,
    "initial_backoff": 100,  # ms
    "backoff_multiplier": 2.0,
    "max_backoff": 8000,  # ms
    "jitter": 500,  # ms, added to waits of at least min_jitter_threshold
    "min_jitter_threshold": 2000,  # ms
    "recognize_server_retry_delay": True,
    "max_server_retry_delay": 2000,  # ms: DefaultPolicy lets a server ask for 10 minutes
}
"""The retry policy of every Spark Connect client pgdecode opens (pyspark's ``RetryPolicy``
arguments, waits in milliseconds); see the comments for why each value."""


class _BoundedPolicyState(RetryPolicyState):
    """One call's retries under a :class:`BoundedRetryPolicy`: records on the policy when they run out."""

    def next_attempt(self, exception: BaseException | None = None) -> int | None:
        wait = super().next_attempt(exception)
        if wait is None:
            policy = self.policy
            if isinstance(policy, BoundedRetryPolicy):
                policy.gave_up = exception if exception is not None else RuntimeError("retries exhausted")
        return wait


class BoundedRetryPolicy(DefaultPolicy):
    """pyspark's ``DefaultPolicy`` (the same errors retried: ``UNAVAILABLE``, a disconnected cursor,
    a server's RetryInfo) with :data:`CONNECT_RETRY_POLICY`'s bounds, one per session.

    Once a call has used up its retries (:attr:`gave_up` holds its last error), the session's
    later calls are not retried: the merge job's reads of the session's settings after a failure,
    and the session's release at the end, then fail at once instead of waiting again for a server
    that did not come back."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**{**CONNECT_RETRY_POLICY, **overrides})
        self.gave_up: BaseException | None = None

    def can_retry(self, e: BaseException) -> bool:
        return self.gave_up is None and super().can_retry(e)

    def to_state(self) -> RetryPolicyState:
        return _BoundedPolicyState(self)


def bounded_retry_policy() -> BoundedRetryPolicy:
    """A new :class:`BoundedRetryPolicy` for one client session."""
    return BoundedRetryPolicy()


def worst_case_retry_seconds(policy: RetryPolicy | None = None) -> float:
    """The longest a call can wait in total under ``policy`` (default :data:`CONNECT_RETRY_POLICY`)
    before pyspark gives up: its waits as pyspark's own ``RetryPolicyState`` computes them, each
    raised to the server's largest honoured retry delay and given the full jitter."""
    policy = policy if policy is not None else BoundedRetryPolicy()
    # pyspark's own arithmetic of the waits (first wait, growth, cap), without jitter or the server's delay.
    plain = RetryPolicy(
        max_retries=policy.max_retries,
        initial_backoff=policy.initial_backoff,
        max_backoff=policy.max_backoff,
        backoff_multiplier=policy.backoff_multiplier,
    )
    if plain.max_retries is None:
        return float("inf")
    state = plain.to_state()
    total = 0.0
    while (wait := state.next_attempt()) is not None:
        longest = float(wait)
        if policy.recognize_server_retry_delay:
            cap = policy.max_server_retry_delay
            longest = max(longest, float("inf") if cap is None else float(cap))
        if longest >= policy.min_jitter_threshold:
            longest += policy.jitter
        total += longest
    return total / 1000


SESSION_LOST_SIGNS = (
    "INVALID_HANDLE.SESSION_CHANGED",
    "INVALID_HANDLE.SESSION_NOT_FOUND",
    "Received incorrect server side session identifier",
)
"""What pyspark's client says when the server it talks to no longer has its session (it restarted)."""
CONTEXT_STOPPED_SIGN = "Cannot call methods on a stopped SparkContext"
"""What a server whose JVM is shutting down answers (stopped, or Spark's exit on running out of memory)."""


def server_gone(error: BaseException, spark: Any = None) -> str | None:
    """Why ``error`` (raised by a call on a Connect session, or by anything that called one) means the
    session's server went away, or ``None`` when it is the job's own error.

    Gone: gRPC ``UNAVAILABLE`` anywhere in the error's chain (a refused connection, a broken stream,
    pyspark's retries used up), a server that no longer knows the session (it restarted), or any
    error once the session's :class:`BoundedRetryPolicy` gave up (a closed session's
    ``NO_ACTIVE_SESSION`` among them)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = _grpc_code(current)
        if code == grpc.StatusCode.UNAVAILABLE:
            return _first_line(current)
        text = str(current)
        if any(sign in text for sign in SESSION_LOST_SIGNS):
            return "the server no longer has this task's session: it restarted or was replaced"
        if CONTEXT_STOPPED_SIGN in text:
            return (
                "the server's Spark context stopped while the task ran: the server was stopped, or it exited because "
                "a task ran out of memory (exit code 52, java.lang.OutOfMemoryError in its log; then give it more "
                "memory: pgdecode's connect_server keeps serving when a merge runs out of memory and names it)"
            )
        current = current.__cause__ or current.__context__
    policy = _bounded_policy(spark)
    if policy is not None and policy.gave_up is not None:
        return _first_line(policy.gave_up)
    return None


def _grpc_code(error: BaseException) -> Any:
    getter = getattr(error, "getGrpcStatusCode", None)  # pyspark's SparkConnectGrpcException
    if callable(getter):
        return getter()
    if isinstance(error, grpc.RpcError):
        code = getattr(error, "code", None)
        return code() if callable(code) else None
    return None


def _bounded_policy(spark: Any) -> BoundedRetryPolicy | None:
    client = getattr(spark, "client", None) if spark is not None else None
    getter = getattr(client, "get_retry_policies", None)
    if not callable(getter):
        return None
    return next((p for p in getter() if isinstance(p, BoundedRetryPolicy)), None)


def _first_line(error: BaseException) -> str:
    """A short account of a client error: gRPC's own errors print as several lines of which the
    ``details = "..."`` one says what happened (the others are debug strings)."""
    details = getattr(error, "details", None)
    text = str(details() if callable(details) else "") or str(error)
    found = re.search(r'details = "([^"]*)"', text)
    if found:
        text = found.group(1)
    text = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return text[:300]
