"""Session plumbing against a real server: libpq's input buffer widened once per connection."""

from __future__ import annotations

import tempfile
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.postgres.session import INPUT_BUFFER_BYTES, connect, widen_input_buffer

pytestmark = pytest.mark.postgres

COPY = "COPY (SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 20000) g) TO STDOUT (FORMAT BINARY)"


def _copied(conn: psycopg.Connection[Any]) -> bytes:
    with conn.cursor() as cur, cur.copy(COPY) as copy:
        return b"".join(bytes(block) for block in copy)


def _statements_sent(conn: psycopg.Connection[Any], action: Any) -> int:
    """Statements ``conn`` sends to the server while ``action()`` runs (from libpq's protocol trace)."""
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            action()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        frontend = [line.split("\t") for line in trace.read().splitlines()]
    return sum(1 for fields in frontend if len(fields) > 3 and fields[1] == "F" and fields[3] in ("Query", "Parse"))


def test_widened_connection_reads_a_large_copy_alike_and_is_widened_once(pg_dsn: str) -> None:
    plain = connect(pg_dsn)
    widened = connect(pg_dsn)
    try:
        assert _statements_sent(widened, lambda: widen_input_buffer(widened)) == 1
        assert _statements_sent(widened, lambda: widen_input_buffer(widened)) == 0  # once per connection
        expected = _copied(plain)
        assert len(expected) > 4 * INPUT_BUFFER_BYTES  # many buffers' worth
        assert _copied(widened) == expected
        assert widened.execute("SELECT 1").fetchone() == (1,)  # nothing left pending
    finally:
        plain.close()
        widened.close()
