"""Does a replication slot have changes to extract? The probe, and a trigger that waits for them.

How "has changes" is decided (shared by :class:`SlotChangesTrigger`, the changes sensor and the
health sensor's heartbeat):

1. **Lag first, without decoding.** ``lag_bytes = current WAL position - confirmed_flush_lsn``.
   Zero, or less than ``min_lag_bytes``, means "not yet": nothing is decoded. WAL moves on in
   any busy cluster (other databases, checkpoints, vacuum), so a positive lag alone does not
   mean the slot has changes.
2. **Then a small peek** of at most ``probe_rows`` rows from the slot's confirmed position
   (``pg_logical_slot_peek_changes``, never consuming). With test_decoding's
   ``skip-empty-xacts``, empty transactions print nothing, so they are not changes; BEGIN and
   COMMIT rows are not changes either, nor are pgdecode's own heartbeat messages (non-
   transactional messages with the heartbeat prefix). Every other row is: a row change, a
   TRUNCATE, a logical decoding message, a PREPARE, a COMMIT/ROLLBACK PREPARED. pgoutput slots
   are probed the same way through the binary variant (needs ``publication``).
3. A peek that fills all ``probe_rows`` with heartbeats only counts as changes (an extract
   advances past them). With ``advance_lag_bytes``, a slot that retains at least that much WAL
   and has a heartbeat pending also counts, so that idle databases get their slot advanced;
   the health sensor (``heartbeat=True``) writes those heartbeats.

Cost of the peek: PostgreSQL decodes from the slot's restart position to the first
transaction with changes and hands back that whole transaction (spilled to disk beyond
``logical_decoding_work_mem``), so a probe is cheap unless the first pending transaction is
huge.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from psycopg import errors as pg_errors
from airflow.triggers.base import BaseTrigger, TriggerEvent
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.decoding.events import Begin, Commit, Event, Message, Origin, StreamStart, StreamStop
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import PgOutputParser
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.slot import SlotInfo

DEFAULT_HEARTBEAT_PREFIX = "pgdecode.heartbeat"
DEFAULT_PROBE_ROWS = 100

_TEXT_PROBE_SQL = (
    "SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, NULL, %s, "
    "'include-xids', '0', 'include-timestamp', '0', 'skip-empty-xacts', '1')"
)
_BINARY_PROBE_SQL = (
    "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, "
    "'proto_version', '1', 'publication_names', %s, 'messages', 'true')"
)
_NOT_CHANGES = (Begin, Commit, Origin, StreamStart, StreamStop)


class SlotInUse(SlotError):
    """Another process (an extract, a replication connection) holds the slot right now."""


@dataclass(frozen=True)
class ChangesProbe:
    """What a peek of a few rows found at the slot's confirmed position.

    :param changes: rows that are changes (not BEGIN/COMMIT, not heartbeats).
    :param heartbeats: pgdecode heartbeat messages.
    :param rows: rows the peek returned.
    :param saturated: the peek stopped at its row limit: more rows may follow.
    :param first_change_lsn: LSN of the first change row.
    """

    changes: int
    heartbeats: int
    rows: int
    saturated: bool
    first_change_lsn: Lsn | None


def classify_events(
    events: Iterable[tuple[Lsn, Event | None]], heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX
) -> tuple[int, int, Lsn | None]:
    """``(changes, heartbeats, first change LSN)`` of decoded rows: transaction boundaries,
    relation/type/origin messages and pgdecode's own heartbeats are not changes."""
    changes = heartbeats = 0
    first: Lsn | None = None
    for lsn, event in events:
        if event is None or isinstance(event, _NOT_CHANGES):
            continue
        if isinstance(event, Message) and not event.transactional and event.prefix == heartbeat_prefix:
            heartbeats += 1
            continue
        changes += 1
        if first is None:
            first = lsn
    return changes, heartbeats, first


def classify_text_rows(
    rows: Iterable[tuple[str, str]], heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX
) -> tuple[int, int, Lsn | None]:
    """``(changes, heartbeats, first change LSN)`` of test_decoding rows peeked with the probe's options."""
    parser = TestDecodingParser()
    return classify_events(((Lsn.parse(lsn), parser.parse(Lsn.parse(lsn), None, data)) for lsn, data in rows), heartbeat_prefix)


def classify_pgoutput_rows(
    rows: Iterable[tuple[str, bytes]], heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX
) -> tuple[int, int, Lsn | None]:
    """``(changes, heartbeats, first change LSN)`` of pgoutput (protocol 1) messages."""
    parser = PgOutputParser(proto_version=1)
    return classify_events(
        ((Lsn.parse(lsn), parser.parse(Lsn.parse(lsn), None, bytes(data))) for lsn, data in rows), heartbeat_prefix
    )


def probe_changes(
    hook: PgDecodeHook,
    info: SlotInfo,
    *,
    probe_rows: int = DEFAULT_PROBE_ROWS,
    heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
    publication: str | None = None,
) -> ChangesProbe:
    """Peek at most ``probe_rows`` rows of the slot (never consuming) and classify them.

    :raises SlotInUse: another process holds the slot.
    :raises SlotError: the slot is lost, of an unsupported plugin, or a pgoutput slot without
        ``publication``.
    """
    if probe_rows < 1:
        raise ValueError(f"probe_rows must be positive, got {probe_rows}")
    name = info.slot_name
    if info.wal_status == "lost":
        raise SlotError(_lost_message(name))
    client = hook.get_slot_client()
    if info.plugin == "test_decoding":
        query: str = _TEXT_PROBE_SQL
        params: tuple[Any, ...] = (name, probe_rows)
    elif info.plugin == "pgoutput":
        if not publication:
            raise SlotError(
                f"replication slot {name!r} uses pgoutput: probing it for changes needs the publication "
                "it is read with (publication=...)"
            )
        query, params = _BINARY_PROBE_SQL, (name, probe_rows, publication)
    else:
        raise SlotError(
            f"replication slot {name!r} uses output plugin {info.plugin!r}; pgdecode reads test_decoding "
            "and pgoutput slots only"
        )
    try:
        with client.conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(query, params)
            rows = cur.fetchall()
    except pg_errors.ObjectInUse as exc:
        raise SlotInUse(f"replication slot {name!r} is in use by another process") from exc
    except psycopg.Error as exc:
        raise client._error(exc, name, "probe changes") from exc
    if info.plugin == "test_decoding":
        changes, heartbeats, first = classify_text_rows(rows, heartbeat_prefix)
    else:
        changes, heartbeats, first = classify_pgoutput_rows(rows, heartbeat_prefix)
    return ChangesProbe(changes, heartbeats, len(rows), len(rows) >= probe_rows, first)


def _lost_message(name: str) -> str:
    return (
        f"replication slot {name!r} lost the WAL it needs (wal_status = lost): changes were lost. Drop it "
        f"(SELECT pg_drop_replication_slot('{name}')), recreate it, and re-snapshot the tables with the "
        "pgdecode_backfill DAG"
    )


def check_slot_changes(
    hook: PgDecodeHook,
    slot_name: str,
    *,
    min_lag_bytes: int = 1,
    advance_lag_bytes: int | None = None,
    probe_rows: int = DEFAULT_PROBE_ROWS,
    heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
    publication: str | None = None,
) -> tuple[bool, dict[str, Any]]:
    """Whether ``slot_name`` has changes to extract (module docstring), and a JSON-able report.

    :raises SlotError: the slot is missing or lost, or cannot be probed.
    """
    info = hook.describe_slot(slot_name)
    if info.wal_status == "lost":
        raise SlotError(_lost_message(slot_name))
    lag = info.lag_bytes or 0
    report: dict[str, Any] = {
        "slot_name": slot_name,
        "confirmed_flush_lsn": None if info.confirmed_flush_lsn is None else str(info.confirmed_flush_lsn),
        "current_lsn": str(info.current_lsn),
        "lag_bytes": lag,
        "wal_status": info.wal_status,
        "changes": 0,
        "heartbeats": 0,
        "first_change_lsn": None,
    }
    if lag == 0 or lag < min_lag_bytes:
        report["reason"] = f"lag {lag} bytes is below min_lag_bytes {max(min_lag_bytes, 1)}: not probed"
        return False, report
    try:
        if info.active:
            raise SlotInUse(f"replication slot {slot_name!r} is in use by another process")
        probe = probe_changes(
            hook, info, probe_rows=probe_rows, heartbeat_prefix=heartbeat_prefix, publication=publication
        )
    except SlotInUse as exc:
        report["reason"] = f"{exc} (an extract running?): not probed this time; lag {lag} bytes"
        return False, report
    report.update(
        changes=probe.changes,
        heartbeats=probe.heartbeats,
        first_change_lsn=None if probe.first_change_lsn is None else str(probe.first_change_lsn),
    )
    if probe.changes:
        report["reason"] = f"{probe.changes}+ change row(s) pending from {probe.first_change_lsn}"
        return True, report
    if probe.saturated:
        report["reason"] = f"{probe.heartbeats} heartbeat message(s) pending: an extract advances the slot past them"
        return True, report
    if advance_lag_bytes is not None and lag >= advance_lag_bytes and probe.heartbeats:
        report["reason"] = (
            f"no changes, but the slot retains {lag} bytes of WAL (advance_lag_bytes {advance_lag_bytes}) and a "
            "heartbeat is pending: an extract lets it advance"
        )
        return True, report
    report["reason"] = (
        "no changes pending"
        + (f" ({probe.heartbeats} heartbeat(s))" if probe.heartbeats else "")
        + f"; lag {lag} bytes"
    )
    return False, report


class SlotChangesTrigger(BaseTrigger):
    """Poll a replication slot until it has changes to extract (see the module docstring).

    Holds only JSON-able arguments. Each poll opens a connection through
    :class:`PgDecodeHook` in a worker thread (``sync_to_async``), so the triggerer's event
    loop never blocks, and closes it before sleeping. Yields one event:
    ``{"status": "success", "reason", "changes", "lag_bytes", ...}``, or
    ``{"status": "error", "fatal": bool, "message": ...}`` (fatal: the slot is missing, lost
    or unusable; retrying cannot help).

    :param slot_name: the replication slot.
    :param postgres_conn_id: the Airflow connection of the slot's database.
    :param poll_interval: seconds between polls.
    :param min_lag_bytes: do not probe before the slot lags the WAL by this many bytes.
    :param advance_lag_bytes: also succeed when the slot retains this much WAL and a
        heartbeat is pending (idle databases).
    :param probe_rows: rows peeked per probe.
    :param heartbeat_prefix: the prefix of heartbeat messages, which are not changes.
    :param publication: the publication of a pgoutput slot.
    """

    def __init__(
        self,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        poll_interval: float = 60.0,
        min_lag_bytes: int = 1,
        advance_lag_bytes: int | None = None,
        probe_rows: int = DEFAULT_PROBE_ROWS,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
    ) -> None:
        super().__init__()
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = float(poll_interval)
        self.min_lag_bytes = int(min_lag_bytes)
        self.advance_lag_bytes = None if advance_lag_bytes is None else int(advance_lag_bytes)
        self.probe_rows = int(probe_rows)
        self.heartbeat_prefix = heartbeat_prefix
        self.publication = publication

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "slot_name": self.slot_name,
                "postgres_conn_id": self.postgres_conn_id,
                "poll_interval": self.poll_interval,
                "min_lag_bytes": self.min_lag_bytes,
                "advance_lag_bytes": self.advance_lag_bytes,
                "probe_rows": self.probe_rows,
                "heartbeat_prefix": self.heartbeat_prefix,
                "publication": self.publication,
            },
        )

    def _check(self) -> tuple[bool, dict[str, Any]]:
        # Runs in a worker thread: blocking I/O is fine here.
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            return check_slot_changes(
                hook,
                self.slot_name,
                min_lag_bytes=self.min_lag_bytes,
                advance_lag_bytes=self.advance_lag_bytes,
                probe_rows=self.probe_rows,
                heartbeat_prefix=self.heartbeat_prefix,
                publication=self.publication,
            )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        check = sync_to_async(self._check, thread_sensitive=False)
        polls = 0
        while True:
            polls += 1
            try:
                done, report = await check()
            except SlotError as exc:
                yield TriggerEvent(
                    {"status": "error", "fatal": True, "slot_name": self.slot_name, "message": str(exc)}
                )
                return
            except Exception as exc:
                yield TriggerEvent(
                    {
                        "status": "error",
                        "fatal": False,
                        "slot_name": self.slot_name,
                        "message": f"checking replication slot {self.slot_name!r} failed: "
                        f"{type(exc).__name__}: {exc}",
                    }
                )
                return
            if done:
                self.log.info("Slot %s: %s (poll %d)", self.slot_name, report["reason"], polls)
                yield TriggerEvent({"status": "success", "polls": polls, **report})
                return
            self.log.info(
                "Slot %s: %s; next poll in %.0fs", self.slot_name, report["reason"], self.poll_interval
            )
            await asyncio.sleep(self.poll_interval)
