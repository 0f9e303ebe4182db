"""Decoding on a physical standby (PostgreSQL 16+): what must be written on the primary, and how.

A standby decodes, peeks and advances its own slots like a primary, but writes no WAL: the
records pgdecode writes itself (heartbeats, the watermarks of table snapshots) go to the primary,
and the standby then waits until it has replayed them, so that its next peek sees them. Creating
a slot on a standby also waits for the primary to log its running transactions, which an idle
primary never does by itself: :func:`primary_logs_snapshots` asks it every second while a slot is
being created. The primary is reached through :class:`PrimaryLink` (the hook builds one from the
source connection's ``primary_conn_id`` extra); without one, writes fail with
:class:`StandbyWriteError`, which says how to give one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import SlotError, StandbyWriteError

log = logging.getLogger(__name__)

STANDBY_DECODING_SERVER_VERSION = 160000
"""Logical decoding on a standby came with PostgreSQL 16."""

SNAPSHOT_NUDGE_SECONDS = 1.0
"""How often the primary is asked to log its running transactions while a standby creates a slot."""


def standby_write_needs_primary(what: str, where: str) -> str:
    """One wording: ``what`` (a heartbeat, a watermark ...) cannot be written on a standby."""
    return (
        f"{where} is a standby (in recovery), which cannot write {what}: it is written on the primary. Name the "
        "primary's Airflow connection in the source connection's extra as \"primary_conn_id\" (a role that may "
        "call pg_logical_emit_message there), and pgdecode writes it there and waits until the standby has "
        "replayed it"
    )


def standby_decoding_needs_newer_server(version: str) -> str:
    """One wording: a standby older than 16 cannot decode."""
    return (
        f"this server is a standby (in recovery) running PostgreSQL {version}, and logical decoding on a standby "
        "needs PostgreSQL 16 or later: point the connection at the primary, or upgrade"
    )


def standby_feedback_off() -> str:
    """One wording: a standby's slots need ``hot_standby_feedback``."""
    return (
        "hot_standby_feedback is off on this standby, so the primary may remove catalog rows a slot here still "
        "needs and PostgreSQL then invalidates the slot (rows_removed): set hot_standby_feedback = on on the "
        "standby (and primary_slot_name, so the feedback holds while the standby is disconnected), then reload"
    )


def primary_wal_level_not_logical() -> str:
    """One wording: the primary of a standby does not write the WAL logical decoding reads."""
    return (
        "the primary of this standby runs with wal_level below 'logical', and a standby decodes the primary's "
        "WAL: set wal_level = logical on the primary (and the standby) and restart them"
    )


def _value(conn: psycopg.Connection[Any], query: str) -> Any:
    # tuple_row: the connection may come with another row factory (Airflow's "cursor" extra).
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(query).fetchone()
    return row[0] if row else None


def in_recovery(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn``'s server is a standby (``pg_is_in_recovery()``)."""
    return bool(_value(conn, "SELECT pg_is_in_recovery()"))


def wait_for_replay(conn: psycopg.Connection[Any], lsn: Lsn, where: str, timeout: float = 30.0) -> Lsn:
    """Wait until the standby behind ``conn`` has replayed up to ``lsn``; returns its replay position.

    :class:`SlotError` after ``timeout`` seconds, naming how far it is.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        position = _value(conn, "SELECT pg_last_wal_replay_lsn()::text")
        replayed = Lsn.parse(position) if position else Lsn(0)
        if replayed >= lsn:
            return replayed
        if time.monotonic() >= deadline:
            raise SlotError(
                f"{where} has replayed the primary's WAL up to {replayed}, still before {lsn} (written on the "
                f"primary) after {timeout:g}s: check that it streams from the primary (pg_stat_wal_receiver) "
                "and is not paused (pg_is_wal_replay_paused())"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class PrimaryLink:
    """The way to a standby's primary: ``open`` returns a new autocommit psycopg connection.

    :meth:`connection` is opened on first use and kept; :meth:`close` closes it.

    :param open: opens a connection to the primary (autocommit).
    :param name: how the primary is named in messages (its Airflow connection id).
    """

    def __init__(self, open: Callable[[], psycopg.Connection[Any]], name: str) -> None:
        self.open = open
        self.name = name
        self._conn: psycopg.Connection[Any] | None = None

    def connection(self) -> psycopg.Connection[Any]:
        """The kept connection to the primary (opened on first call)."""
        if self._conn is None or self._conn.closed:
            self._conn = self.open()
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _log_snapshots_until(primary: PrimaryLink, done: threading.Event) -> None:
    try:
        with contextlib.closing(primary.open()) as conn:
            while not done.wait(SNAPSHOT_NUDGE_SECONDS):
                conn.execute("SELECT pg_log_standby_snapshot()")
    except psycopg.Error as exc:
        log.warning("Could not ask primary %s to log its running transactions: %s", primary.name, exc)


@contextlib.contextmanager
def primary_logs_snapshots(primary: PrimaryLink | None, slot_name: str) -> Iterator[None]:
    """While a slot is created on a standby: ask the primary every second to log its running
    transactions (``pg_log_standby_snapshot()``), the record the creation waits for."""
    if primary is None:
        log.warning(
            "Creating slot %s on a standby: it waits until the primary logs its running transactions, which a "
            "primary does every 15 s while it writes and never while it is idle. Name the primary's connection "
            "as primary_conn_id in the source connection's extra to have pgdecode ask the primary for it.",
            slot_name,
        )
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_log_snapshots_until, args=(primary, done), daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


__all__ = [
    "STANDBY_DECODING_SERVER_VERSION",
    "PrimaryLink",
    "StandbyWriteError",
    "in_recovery",
    "primary_logs_snapshots",
    "primary_wal_level_not_logical",
    "standby_decoding_needs_newer_server",
    "standby_feedback_off",
    "standby_write_needs_primary",
    "wait_for_replay",
]
