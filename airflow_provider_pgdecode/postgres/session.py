"""Session plumbing every reader of the database shares: pinned settings, transactions, connections.

Values PostgreSQL prints depend on session settings (``DateStyle``, ``TimeZone``, ...). The
decoding session (test_decoding renders values with them) and the copies of the initial
snapshot and of table snapshots must print alike, or a copied row and a decoded change of the
same row would not compare equal: :func:`pin_settings` applies the one set, :data:`PINNED_GUCS`,
to all of them.

The layers above hold connections only as opaque handles (:data:`Connection`) and catch
:data:`DatabaseError`; every statement is issued from this package (psycopg 3, no Airflow).

Example::

    from airflow_provider_pgdecode.postgres.session import connect, pin_settings

    conn = connect("host=127.0.0.1 dbname=shop user=postgres")
    pin_settings(conn)  # for the session; local=True inside a transaction
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from airflow_provider_pgdecode.errors import StagingError

Connection = psycopg.Connection[Any]
"""A psycopg 3 connection, as the layers above hold it (for annotations)."""

DatabaseError = psycopg.Error
"""What the driver raises for a failed statement or a lost connection."""

PINNED_GUCS: tuple[tuple[str, str], ...] = (
    ("DateStyle", "ISO, YMD"),
    ("TimeZone", "UTC"),
    ("IntervalStyle", "postgres"),
    ("bytea_output", "hex"),
    ("extra_float_digits", "3"),
)
"""Formatting settings pinned while peeking and copying: test_decoding renders values with them,
and copied rows must print as decoded ones."""

TIMEOUT_GUCS: tuple[tuple[str, str], ...] = (
    ("statement_timeout", "0"),
    ("idle_in_transaction_session_timeout", "0"),
)
"""No timeout for the statements that decode or copy: a role's or database's ``statement_timeout``
(a common DBA default) would cancel every peek of a backlog, every advance and every copy of a
large table, run after run. Pinned with :data:`PINNED_GUCS`; ``transaction_timeout`` too from
PostgreSQL 17 (:func:`timeout_settings`)."""

TRANSACTION_TIMEOUT_VERSION = 170000
"""``transaction_timeout`` exists from PostgreSQL 17 (an unknown setting is an error before)."""

SCAN_GUCS: tuple[tuple[str, str], ...] = (
    ("synchronize_seqscans", "off"),
    ("max_parallel_workers_per_gather", "0"),
    ("client_encoding", "UTF8"),
)
"""Physical order within a page-range copy, whatever the plan: no scan starting mid-table, no
parallel scan; and UTF-8 text, which the copy's CSV reader expects."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VALUE = re.compile(r"[A-Za-z0-9_ ,.:+-]*")


@lru_cache(maxsize=16)
def _settings_sql(settings: tuple[tuple[str, str], ...], local: bool) -> str:
    # Constants only (checked), so one simple-protocol string of SET statements: one round trip.
    for name, value in settings:
        if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
            raise ValueError(f"not a plain setting: {name!r} = {value!r}")
    scope = "SET LOCAL" if local else "SET"
    return "; ".join(f"{scope} {name} = '{value}'" for name, value in settings)


def timeout_settings(conn: Connection) -> tuple[tuple[str, str], ...]:
    """:data:`TIMEOUT_GUCS`, and ``transaction_timeout = 0`` on a server that has it."""
    if conn.info.server_version >= TRANSACTION_TIMEOUT_VERSION:
        return (*TIMEOUT_GUCS, ("transaction_timeout", "0"))
    return TIMEOUT_GUCS


def pin_settings(conn: Connection, *, local: bool = False, extra: Sequence[tuple[str, str]] = ()) -> None:
    """Apply :data:`PINNED_GUCS` and the timeouts (:func:`timeout_settings`), then ``extra``, to
    ``conn`` in one round trip.

    ``local=True`` pins them for the transaction in progress only (``SET LOCAL``: the peek
    leaves the session as it found it); otherwise for the session (the copies' own connections).
    """
    conn.execute(_settings_sql(PINNED_GUCS + timeout_settings(conn) + tuple(extra), local))


def pin_timeouts(conn: Connection) -> None:
    """Lift the timeouts (:func:`timeout_settings`) for the transaction in progress only."""
    conn.execute(_settings_sql(timeout_settings(conn), True))


def connect(dsn: str) -> Connection:
    """A new connection in autocommit mode (every caller here runs its own transactions)."""
    return psycopg.connect(dsn, autocommit=True)


INPUT_BUFFER_BYTES = 256 << 10
"""libpq's input buffer, widened by :func:`widen_input_buffer` for a connection that reads a large
COPY."""

_widened: weakref.WeakSet[Connection] = weakref.WeakSet()


def widen_input_buffer(conn: Connection) -> None:
    """Make libpq read up to :data:`INPUT_BUFFER_BYTES` per ``recv`` on ``conn`` (once per connection).

    Why: libpq receives into its input buffer, 16 KiB when it opens, and enlarges it only for a
    message that does not fit; it never shrinks it. A peek's COPY of 500,000 rows then takes
    ~4,000 ``recv`` calls of at most 16 KiB, each with its TCP acknowledgement, ~15% of the
    extract reader's CPU. libpq has no setting for it, so one row of that size is fetched here: the
    buffer keeps its size, and later reads take what the socket holds, up to that size.
    """
    if conn in _widened:
        return
    conn.execute("SELECT repeat(' ', %s)", (INPUT_BUFFER_BYTES,)).fetchone()
    _widened.add(conn)


def conninfo_like(conn: Connection) -> str:
    """A conninfo string with every libpq parameter ``conn`` was opened with (password and TLS
    settings included): for a second session on the same server, database and role."""
    params = {
        option.keyword.decode(): option.val.decode()
        for option in conn.pgconn.info
        if option.val is not None and option.val != b""
    }
    return make_conninfo(**params)


def database_name(conn: Connection) -> str:
    """The name of the database ``conn`` is connected to."""
    return conn.info.dbname


def server_address(conn: Connection) -> str:
    """``host:port`` of the server ``conn`` reached, as the connection names it (a Unix socket's
    directory as the host): OpenLineage's ``postgres://`` namespace of its tables."""
    return f"{conn.info.host}:{conn.info.port}"


def server_version(conn: Connection) -> int:
    """The server's version as an integer, e.g. 150018."""
    return int(conn.info.server_version)


def require_autocommit(conn: Connection, who: str) -> None:
    """:class:`StagingError` unless ``conn`` is in autocommit mode: ``who`` runs its own transactions."""
    if not conn.autocommit:
        raise StagingError(f"{who} needs a connection in autocommit mode (it runs its own transaction)")


def begin_read_only_snapshot(conn: Connection) -> None:
    """Start a ``REPEATABLE READ, READ ONLY`` transaction: one snapshot for all its statements."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")


def commit(conn: Connection) -> None:
    """End the transaction in progress (for a read-only one: release its snapshot and locks)."""
    conn.execute("COMMIT")


def rollback(conn: Connection) -> None:
    """Abandon the transaction in progress."""
    conn.execute("ROLLBACK")


def rollback_if_open(conn: Connection) -> None:
    """Abandon the transaction in progress, if any: for cleanup after an error, whatever its point."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")


__all__ = [
    "Connection",
    "DatabaseError",
    "PINNED_GUCS",
    "SCAN_GUCS",
    "begin_read_only_snapshot",
    "commit",
    "connect",
    "conninfo_like",
    "database_name",
    "pin_settings",
    "require_autocommit",
    "rollback",
    "rollback_if_open",
    "server_version",
]
