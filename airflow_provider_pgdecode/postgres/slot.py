"""Logical replication slots through PostgreSQL's SQL functions (psycopg 3, no Airflow).

Both the Airflow hook and the plain-Python extract use :class:`SlotClient`. Changes are only
ever *peeked* (``pg_logical_slot_peek_binary_changes``) and the slot is moved explicitly with
:meth:`SlotClient.advance` once they are safely stored: ``pg_logical_slot_get_*changes``
consumes non-transactionally and is never used.

The C twin of :meth:`SlotClient.peek_copy`'s reading side (COPY BINARY framing, the libpq
reader) is ``capture/csrc/copy_reader.c``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import PgDecodeError, ServerNotReadyError, SlotError, StandbyWriteError
from airflow_provider_pgdecode.postgres.health import (
    check_readable,
    connection_lost,
    not_logical,
    publication_missing,
    slot_in_use,
    slot_invalidated,
    slot_lost,
    slot_missing,
)
from airflow_provider_pgdecode.postgres.readiness import (
    FAILOVER_SERVER_VERSION,
    PGOUTPUT_TWO_PHASE_SERVER_VERSION,
    TWO_PHASE_FAILOVER_SERVER_VERSION,
    TWO_PHASE_SERVER_VERSION,
    failover_needs_newer_server,
    format_server_version,
    prepared_transactions_off,
    slot_creation_error,
    two_phase_failover_unsafe,
    two_phase_needs_newer_server,
)
from airflow_provider_pgdecode.postgres.session import (  # noqa: F401  (PINNED_GUCS: re-exported)
    PINNED_GUCS,
    pin_settings,
    pin_timeouts,
    widen_input_buffer,
)
from airflow_provider_pgdecode.postgres.standby import (
    STANDBY_DECODING_SERVER_VERSION,
    PrimaryLink,
    in_recovery,
    primary_logs_snapshots,
    standby_decoding_needs_newer_server,
    standby_write_needs_primary,
    wait_for_replay,
)

log = logging.getLogger(__name__)

SLOT_NAME_RE = re.compile(r"[a-z0-9_]{1,63}")
"""What PostgreSQL accepts as a replication slot name."""

# The fastest variant measured on 202k test_decoding rows (PG 15): binary results with lsn as
# int8 and xid via text ~560k rows/s; text results parsed with Lsn.parse ~400k rows/s; a
# pg_lsn binary loader ~515k rows/s; the server's count(*) alone ~950k rows/s.
_PEEK_SQL = (
    "SELECT (lsn - '0/0'::pg_lsn)::int8, xid::text::int8, data"
    " FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s::int4, VARIADIC %s::text[])"
)

# The same peek as one COPY in binary format, for readers that parse it themselves: columns as
# the function returns them (pg_lsn and xid travel as 8- and 4-byte integers), so the server
# evaluates no expression per row.
_PEEK_COPY_SQL = (
    "COPY (SELECT lsn, xid, data"
    " FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s::int4, VARIADIC %s::text[]))"
    " TO STDOUT (FORMAT BINARY)"
)

# A probe: at most N rows (whole transactions) from the confirmed position, never consuming.
_PROBE_SQL = (
    "SELECT (lsn - '0/0'::pg_lsn)::int8, data"
    " FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s::int4, VARIADIC %s::text[])"
)

_ENCODINGS: dict[str, str] = {
    "UTF8": "utf-8",
    "SQL_ASCII": "ascii",
    "LATIN1": "latin-1",
    "LATIN2": "iso8859-2",
    "LATIN3": "iso8859-3",
    "LATIN4": "iso8859-4",
    "LATIN5": "iso8859-9",
    "LATIN6": "iso8859-10",
    "LATIN7": "iso8859-13",
    "LATIN8": "iso8859-14",
    "LATIN9": "iso8859-15",
    "LATIN10": "iso8859-16",
    "ISO_8859_5": "iso8859-5",
    "ISO_8859_6": "iso8859-6",
    "ISO_8859_7": "iso8859-7",
    "ISO_8859_8": "iso8859-8",
    "WIN866": "cp866",
    "WIN874": "cp874",
    "WIN1250": "cp1250",
    "WIN1251": "cp1251",
    "WIN1252": "cp1252",
    "WIN1253": "cp1253",
    "WIN1254": "cp1254",
    "WIN1255": "cp1255",
    "WIN1256": "cp1256",
    "WIN1257": "cp1257",
    "WIN1258": "cp1258",
    "KOI8R": "koi8-r",
    "KOI8U": "koi8-u",
    "EUC_JP": "euc_jp",
    "EUC_KR": "euc_kr",
    "EUC_CN": "gb2312",
    "EUC_JIS_2004": "euc_jis_2004",
}

_cursor_ids = itertools.count(1)

_INVALIDATED_DUE_TO = re.compile(r'invalidated due to "(\w+)"')
"""PostgreSQL 18's detail of an error on an invalidated slot, e.g. ``... due to "idle_timeout".``"""

PeekRows = Generator[tuple[Lsn, int | None, bytes], None, None]
"""What :meth:`SlotClient.peek` returns: ``(lsn, xid, data)`` rows; ``close()`` it to stop early."""


@dataclass(frozen=True)
class SlotInfo:
    """One row of ``pg_replication_slots`` plus the server's current WAL position."""

    slot_name: str
    plugin: str | None
    slot_type: str
    database: str | None
    temporary: bool
    active: bool
    two_phase: bool
    restart_lsn: Lsn | None
    confirmed_flush_lsn: Lsn | None
    wal_status: str | None
    safe_wal_size: int | None
    current_lsn: Lsn
    lag_bytes: int | None
    """``current_lsn - confirmed_flush_lsn`` (never negative); ``None`` without a confirmed position."""
    failover: bool = False
    """Synchronised to standbys for failover (PostgreSQL 17+; always false before)."""
    invalidation_reason: str | None = None
    """Why the server invalidated the slot (PostgreSQL 17+): ``wal_removed``, ``rows_removed``,
    ``wal_level_insufficient``, 18's ``idle_timeout``; ``None`` while it is valid (or before 17)."""
    inactive_since: datetime | None = None
    """Since when no process has used the slot (PostgreSQL 17+); ``None`` while in use or before 17."""
    two_phase_at: Lsn | None = None
    """From where a two-phase slot decodes prepared transactions at PREPARE (PostgreSQL 18+ shows it;
    ``None`` before 18 and for other slots)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able values, LSNs as ``X/Y`` strings, times in ISO 8601."""
        return {
            k: str(v) if isinstance(v, Lsn) else v.isoformat() if isinstance(v, datetime) else v
            for k, v in asdict(self).items()
        }


UPPER_SLOT_SUFFIX = "_upper"


def upper_slot_name(name: str) -> str | None:
    """The name of ``name``'s upper-half slot: a two-phase slot pgdecode keeps beside a two-phase
    slot whose temporary copy would not be two-phase (test_decoding), to decode the upper half of
    a large batch in a second session (:mod:`airflow_provider_pgdecode.capture.sessions`). None
    when ``name`` is too long for the suffix (then one session decodes every batch)."""
    upper = name + UPPER_SLOT_SUFFIX
    return upper if SLOT_NAME_RE.fullmatch(upper) else None


def validate_slot_name(name: str) -> str:
    """Return ``name`` if PostgreSQL accepts it as a slot name, else raise :class:`SlotError`."""
    if not isinstance(name, str) or not SLOT_NAME_RE.fullmatch(name):
        raise SlotError(
            f"invalid replication slot name {name!r}: use 1 to 63 characters of lower-case letters, "
            "digits and underscores ([a-z0-9_])"
        )
    return name


def _peek_arguments(
    name: str, upto_lsn: Lsn, options: Sequence[tuple[str, str]], upto_rows: int | None = None
) -> tuple[Lsn, list[str]]:
    """Checked slot name, ceiling, row limit and flattened plugin options of a peek."""
    validate_slot_name(name)
    if not isinstance(upto_lsn, int):
        raise TypeError(f"upto_lsn must be an Lsn, got {upto_lsn!r}")
    if upto_rows is not None and not 1 <= upto_rows <= 2**31 - 1:
        raise ValueError(f"upto_rows must be between 1 and 2147483647, got {upto_rows!r}")
    flat: list[str] = []
    for option in options:
        if len(option) != 2 or not all(isinstance(part, str) for part in option):
            raise ValueError(f"plugin options must be (name, value) pairs of strings, got {option!r}")
        flat.extend(option)
    return Lsn.coerce(upto_lsn), flat


def _lsn(text: str | None) -> Lsn | None:
    return None if text is None else Lsn.parse(text)


class SlotClient:
    """Slot lifecycle, bounded peeks and advancing, over one psycopg 3 connection.

    The connection must be in autocommit mode: slot creation fails in a transaction that has
    written, and every call here manages its own transaction. While a :meth:`peek` iterator is
    open the connection is inside that iterator's transaction; finish or ``close()`` it before
    doing other work on the connection.

    :param conn: a psycopg 3 connection with ``autocommit=True``.
    :param primary: when ``conn``'s server is a standby, the way to its primary, where the WAL
        records pgdecode writes itself go (:mod:`~airflow_provider_pgdecode.postgres.standby`).
    """

    def __init__(self, conn: psycopg.Connection[Any], primary: PrimaryLink | None = None) -> None:
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"SlotClient needs a psycopg 3 connection, got {type(conn).__name__}")
        if not conn.autocommit:
            raise ValueError(
                "SlotClient needs a connection with autocommit=True "
                "(slot creation fails in a transaction that has already written)"
            )
        self.conn = conn
        self.primary = primary

    # -- helpers -------------------------------------------------------------------------------

    def _one(self, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        # tuple_row: the connection may come with another row factory (Airflow's "cursor" extra).
        with self.conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(query, params)
            return cur.fetchone()

    def _one_unlimited(self, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        """:meth:`_one` without the session's timeouts: a statement that decodes WAL (an advance, a
        slot's copy moved) takes as long as the WAL it reads."""
        with self.conn.transaction():
            pin_timeouts(self.conn)
            return self._one(query, params)

    def _all(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        with self.conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(query, params)
            return cur.fetchall()

    def _database(self) -> str:
        return self.conn.info.dbname

    def _where(self) -> str:
        return f"database {self._database()!r} on {self.conn.info.host}:{self.conn.info.port}"

    def _error(self, exc: psycopg.Error, name: str, action: str) -> SlotError:
        diag = exc.diag
        text = diag.message_primary or str(exc).strip()
        if diag.message_detail:
            text += f" ({diag.message_detail})"
        if isinstance(exc, pg_errors.UndefinedObject) and "publication" in text:
            return publication_missing(name, text)
        if isinstance(exc, pg_errors.UndefinedObject):
            return slot_missing(name, self._where())
        if isinstance(exc, pg_errors.ObjectInUse):
            return slot_in_use(name, text)
        if "invalidated" in text or "can no longer" in text:
            # 18 names the reason in the detail; before, only the column says it (check_readable).
            reason = _INVALIDATED_DUE_TO.search(text)
            return slot_invalidated(name, reason.group(1)) if reason else slot_lost(name, text)
        if isinstance(exc, (pg_errors.AdminShutdown, pg_errors.CrashShutdown, pg_errors.CannotConnectNow)) or (
            isinstance(exc, psycopg.OperationalError) and (exc.sqlstate is None or self.conn.closed)
        ):
            return connection_lost(name, action, text)
        return SlotError(f"{action} of replication slot {name!r} failed: {text}")

    # -- server facts --------------------------------------------------------------------------

    def server_version_num(self) -> int:
        """The server's version as an integer, e.g. 150018."""
        return int(self.conn.info.server_version)

    def server_encoding(self) -> str:
        """The Python codec name of the database's encoding (how decoded bytes are to be read)."""
        row = self._one("SELECT current_setting('server_encoding')")
        assert row is not None
        pg_name = str(row[0]).upper()
        try:
            return _ENCODINGS[pg_name]
        except KeyError:
            raise PgDecodeError(
                f"database {self._database()!r} uses server encoding {pg_name}, which pgdecode does not map "
                f"to a Python codec; supported: {', '.join(sorted(_ENCODINGS))}"
            ) from None

    def current_flush_lsn(self) -> Lsn:
        """``pg_current_wal_flush_lsn()`` (on a standby ``pg_last_wal_replay_lsn()``): decoding never
        goes beyond it, so it is the ceiling to peek to."""
        row = self._one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()"
            " ELSE pg_current_wal_flush_lsn() END)::text"
        )
        assert row is not None
        return Lsn.parse(row[0])

    def idle_timeout(self) -> timedelta | None:
        """PostgreSQL 18's ``idle_replication_slot_timeout``: how long a slot may stay unused before
        the server invalidates it; ``None`` when off (0) or before 18."""
        if self.server_version_num() < 180000:
            return None
        row = self._one("SELECT setting::bigint, unit FROM pg_settings WHERE name = 'idle_replication_slot_timeout'")
        if row is None or not row[0]:
            return None
        return timedelta(seconds=int(row[0]) * {"min": 60, "h": 3600}.get(row[1], 1))

    def oldest_prepared(self) -> datetime | None:
        """When the oldest transaction still prepared in this database was prepared, or ``None``."""
        row = self._one("SELECT min(prepared) FROM pg_prepared_xacts WHERE database = current_database()")
        return row[0] if row is not None else None

    def in_recovery(self) -> bool:
        """Whether the server is a standby."""
        return in_recovery(self.conn)

    def written_where_wal_is(self, write: Callable[[psycopg.Connection[Any]], Lsn], what: str) -> Lsn:
        """Run ``write`` (which writes a WAL record and returns its LSN) on this connection or, when
        the server is a standby, on its primary; the standby then waits until it has replayed the
        record, so that a peek here sees it. :class:`StandbyWriteError` on a standby without a primary."""
        if not self.in_recovery():
            return write(self.conn)
        if self.primary is None:
            raise StandbyWriteError(standby_write_needs_primary(what, self._where()))
        lsn = write(self.primary.connection())
        wait_for_replay(self.conn, lsn, self._where())
        return lsn

    # -- lifecycle -----------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """Whether a slot of that name exists (in any database of the cluster)."""
        validate_slot_name(name)
        return self._one("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (name,)) is not None

    def _describe(self, name: str) -> SlotInfo | None:
        found = self._slots("WHERE slot_name = %s", (name,))
        return found[0] if found else None

    def _slots(self, where: str, params: tuple[Any, ...] = ()) -> list[SlotInfo]:
        version = self.server_version_num()
        two_phase = "two_phase" if version >= 140000 else "false"
        wal = "wal_status, safe_wal_size" if version >= 130000 else "NULL::text, NULL::int8"
        # The columns 17 added: what a standby, an invalidation and idleness do to a slot.
        since_17 = (
            "failover, invalidation_reason, inactive_since"
            if version >= FAILOVER_SERVER_VERSION
            else "false, NULL::text, NULL::timestamptz"
        )
        since_18 = "two_phase_at::text" if version >= 180000 else "NULL::text"
        rows = self._all(
            f"SELECT slot_name::text, plugin::text, slot_type, database::text, temporary, active, {two_phase},"
            f" restart_lsn::text, confirmed_flush_lsn::text, {wal},"
            " (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text,"
            f" {since_17}, {since_18}"
            f" FROM pg_replication_slots {where} ORDER BY slot_name",
            params,
        )
        return [self._slot_info(row) for row in rows]

    @staticmethod
    def _slot_info(row: Sequence[Any]) -> SlotInfo:
        confirmed = _lsn(row[8])
        current = Lsn.parse(row[11])
        return SlotInfo(
            slot_name=row[0],
            plugin=row[1],
            slot_type=row[2],
            database=row[3],
            temporary=bool(row[4]),
            active=bool(row[5]),
            two_phase=bool(row[6]),
            restart_lsn=_lsn(row[7]),
            confirmed_flush_lsn=confirmed,
            wal_status=row[9],
            safe_wal_size=None if row[10] is None else int(row[10]),
            current_lsn=current,
            lag_bytes=None if confirmed is None else max(0, current - confirmed),
            failover=bool(row[12]),
            invalidation_reason=row[13],
            inactive_since=row[14],
            two_phase_at=_lsn(row[15]),
        )

    def idle_slots(self, min_lag_bytes: int, besides: str) -> list[SlotInfo]:
        """The cluster's logical slots other than ``besides`` that no process uses and that hold back
        more than ``min_lag_bytes`` of WAL: what a source removed from the pipeline leaves behind.
        The upper-half slot of ``besides`` (:func:`upper_slot_name`) is not reported either."""
        upper = upper_slot_name(besides) or besides
        return [
            info
            for info in self._slots(
                "WHERE slot_type = 'logical' AND NOT active AND slot_name NOT IN (%s, %s)", (besides, upper)
            )
            if (info.lag_bytes or 0) > min_lag_bytes
        ]

    def describe(self, name: str) -> SlotInfo:
        """The slot's state; :class:`SlotError` when it does not exist."""
        validate_slot_name(name)
        info = self._describe(name)
        if info is None:
            raise slot_missing(name, self._where())
        return info

    def create(
        self,
        name: str,
        plugin: str = "test_decoding",
        two_phase: bool = False,
        temporary: bool = False,
        failover: bool = False,
    ) -> SlotInfo:
        """Create a logical slot in the connection's database.

        Waits for transactions running at the time to finish (the slot needs a consistent
        snapshot). A temporary slot lives as long as this connection's session. ``failover``
        (PostgreSQL 17+): standbys that sync slots (``sync_replication_slots``) keep a copy, so
        the slot, and the changes it still holds, survive a promotion of the standby.
        """
        validate_slot_name(name)
        if not plugin:
            raise SlotError("an output plugin name is needed (test_decoding or pgoutput)")
        version = self.server_version_num()
        kind = "two-phase replication slot" if two_phase else "replication slot"
        if failover and version < FAILOVER_SERVER_VERSION:
            reason = failover_needs_newer_server(format_server_version(version))
            raise ServerNotReadyError(f"cannot create failover slot {name!r} in {self._where()}: {reason}")
        if failover and two_phase and version < TWO_PHASE_FAILOVER_SERVER_VERSION:
            reason = two_phase_failover_unsafe(format_server_version(version))
            raise ServerNotReadyError(f"cannot create failover slot {name!r} in {self._where()}: {reason}")
        standby = self.in_recovery()
        if standby and version < STANDBY_DECODING_SERVER_VERSION:
            reason = standby_decoding_needs_newer_server(format_server_version(version))
            raise ServerNotReadyError(f"cannot create {kind} {name!r} in {self._where()}: {reason}")
        if two_phase:
            # pgoutput decodes two-phase from protocol 3 (15): on 14 such a slot could not be read.
            needed = PGOUTPUT_TWO_PHASE_SERVER_VERSION if plugin == "pgoutput" else TWO_PHASE_SERVER_VERSION
            if version < needed:
                reason = two_phase_needs_newer_server(format_server_version(version), plugin)
                raise ServerNotReadyError(f"cannot create {kind} {name!r} in {self._where()}: {reason}")
            row = self._one("SELECT current_setting('max_prepared_transactions')::int")
            if row is None or int(row[0]) == 0:
                reason = prepared_transactions_off(0 if row is None else int(row[0]))
                raise ServerNotReadyError(f"cannot create {kind} {name!r} in {self._where()}: {reason}")
        if not temporary and self._describe(name) is None:  # one left from an earlier slot of that name
            self.drop_upper(name)
        query: str
        params: tuple[Any, ...]
        # The function is STRICT: every argument is a non-NULL value, or no slot is created.
        if version >= FAILOVER_SERVER_VERSION:
            query, params = (
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s, %s, %s, %s)",
                (name, plugin, bool(temporary), bool(two_phase), bool(failover)),
            )
        elif version >= 140000:
            query, params = (
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s, %s, %s)",
                (name, plugin, bool(temporary), bool(two_phase)),
            )
        else:
            query, params = (
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s, %s)",
                (name, plugin, bool(temporary)),
            )
        try:
            with primary_logs_snapshots(self.primary, name) if standby else contextlib.nullcontext():
                row = self._one(query, params)
        except pg_errors.DuplicateObject as exc:
            raise SlotError(f"cannot create replication slot {name!r}: it already exists") from exc
        except psycopg.Error as exc:
            translated = slot_creation_error(
                name,
                self._where(),
                exc.sqlstate,
                exc.diag.message_primary or str(exc).strip(),
                plugin=plugin,
                two_phase=two_phase,
                role=self.conn.info.user,
            )
            raise (translated or self._error(exc, name, "creation")) from exc
        if row is None or row[0] is None:
            raise SlotError(f"pg_create_logical_replication_slot returned no slot for {name!r}")
        return self.describe(name)

    def ensure(
        self, name: str, plugin: str = "test_decoding", two_phase: bool = False, failover: bool = False
    ) -> SlotInfo:
        """The slot as it is, created when missing; :class:`SlotError` when it cannot serve as asked.

        ``failover`` applies when the slot is created; an existing slot keeps its setting. Two-phase
        decoding is asked where it is safe: a failover slot before PostgreSQL 18 is created without
        it (:func:`~airflow_provider_pgdecode.postgres.readiness.two_phase_failover_unsafe`; its
        prepared transactions then arrive whole at COMMIT PREPARED, and Delta gets the same rows)."""
        validate_slot_name(name)
        info = self._describe(name)
        if info is None:
            safe = self._two_phase_where_safe(two_phase, failover)
            if safe != bool(two_phase):
                log.warning(
                    "Creating failover slot %s without two-phase decoding: %s",
                    name,
                    two_phase_failover_unsafe(format_server_version(self.server_version_num())),
                )
            try:
                return self.create(name, plugin=plugin, two_phase=safe, failover=failover)
            except SlotError:
                # Someone else may have created it meanwhile: check that one instead.
                info = self._describe(name)
                if info is None:
                    raise
        database = self._database()
        if info.slot_type != "logical":
            raise not_logical(name, info.slot_type)
        if info.database != database:
            raise SlotError(
                f"replication slot {name!r} belongs to database {info.database!r}, not {database!r}; "
                "connect to that database or use another slot name"
            )
        check_readable(info, plugin)
        if info.two_phase != self._two_phase_where_safe(two_phase, info.failover):
            raise SlotError(
                f"replication slot {name!r} was created with two_phase={info.two_phase}, but "
                f"two_phase={bool(two_phase)} was asked for; the setting is fixed at creation. "
                f"Set the DAG's two_phase parameter to {info.two_phase}, or drop the slot "
                f"(SELECT pg_drop_replication_slot('{name}')) and recreate it "
                "(then reload the tables from a new snapshot)"
            )
        return info

    def _two_phase_where_safe(self, two_phase: bool, failover: bool) -> bool:
        return bool(two_phase) and not (failover and self.server_version_num() < TWO_PHASE_FAILOVER_SERVER_VERSION)

    def find(self, name: str) -> SlotInfo | None:
        """The slot's state, or None when there is no slot of that name."""
        validate_slot_name(name)
        return self._describe(name)

    def drop(self, name: str, missing_ok: bool = True) -> bool:
        """Drop the slot, and its upper-half slot (:func:`upper_slot_name`) when there is one;
        returns whether the slot existed. Drop unused slots: they retain WAL."""
        validate_slot_name(name)
        self.drop_upper(name)
        try:
            self._one("SELECT pg_drop_replication_slot(%s)", (name,))
        except pg_errors.UndefinedObject as exc:
            if missing_ok:
                return False
            raise self._error(exc, name, "dropping") from exc
        except psycopg.Error as exc:
            raise self._error(exc, name, "dropping") from exc
        return True

    def drop_upper(self, name: str) -> bool:
        """Drop ``name``'s upper-half slot (:func:`upper_slot_name`) if there is one: with the slot,
        and before a slot of that name is created, since one made before the slot would decode
        prepared transactions as a slot two-phase from an earlier point."""
        upper = upper_slot_name(name)
        if upper is None or self._describe(upper) is None:
            return False
        dropped = self.drop(upper)
        if dropped:
            log.info("Dropped replication slot %s with %s", upper, name)
        return dropped

    # -- reading and confirming ----------------------------------------------------------------

    def peek(
        self,
        name: str,
        upto_lsn: Lsn,
        options: Sequence[tuple[str, str]] = (),
        chunk_size: int = 10000,
        upto_rows: int | None = None,
    ) -> PeekRows:
        """Stream ``(lsn, xid, data)`` rows of the slot up to ``upto_lsn``, without consuming them.

        Rows come from ``pg_logical_slot_peek_binary_changes`` (``data`` as exact bytes in the
        database encoding) through a server-side cursor, ``chunk_size`` rows at a time, inside a
        transaction that pins the formatting GUCs. ``xid`` is ``None`` for non-transactional
        messages. Decoding includes the transactions that commit before ``upto_lsn`` (and the one
        whose commit record crosses it); use :meth:`current_flush_lsn` for a fixed ceiling.
        ``close()`` the iterator when stopping early.

        :param name: the slot.
        :param upto_lsn: the ceiling LSN.
        :param options: output plugin options as ``(name, value)`` pairs.
        :param chunk_size: rows fetched per round trip.
        :param upto_rows: stop decoding once this many rows were produced (PostgreSQL's
            ``upto_nchanges``: it finishes the WAL record that reached the limit, so the
            transaction whose rows cross it comes whole, unless it was streamed); ``None``: no limit.
        """
        ceiling, flat = _peek_arguments(name, upto_lsn, options, upto_rows)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return self._peek_rows(name, str(ceiling), upto_rows, flat, chunk_size)

    def _peek_rows(self, name: str, upto: str, upto_rows: int | None, options: list[str], chunk_size: int) -> PeekRows:
        conn = self.conn
        new = int.__new__
        with conn.transaction():
            pin_settings(conn, local=True)
            cursor_name = f"pgdecode_peek_{next(_cursor_ids)}"
            with conn.cursor(name=cursor_name, row_factory=tuple_row) as cur:
                try:
                    # Binary results: bytea arrives as raw bytes, LSNs and xids as plain int8.
                    cur.execute(_PEEK_SQL, (name, upto, upto_rows, options), binary=True)
                    rows = cur.fetchmany(chunk_size)
                except psycopg.Error as exc:
                    raise self._error(exc, name, "peeking changes") from exc
                while rows:
                    for lsn, xid, data in rows:
                        # int.__new__ skips Lsn's range checks: the server's values are in range.
                        yield new(Lsn, lsn), xid or None, data
                    try:
                        rows = cur.fetchmany(chunk_size)
                    except psycopg.Error as exc:
                        raise self._error(exc, name, "peeking changes") from exc

    def probe(self, name: str, limit: int, options: Sequence[tuple[str, str]] = ()) -> list[tuple[Lsn, bytes]]:
        """At most ``limit`` rows (completing the transaction at the limit) from the slot's confirmed
        position, with the same pinned settings as :meth:`peek`; never consumes. For the changes
        probe of the sensors and the trigger."""
        _, flat = _peek_arguments(name, Lsn(0), options)
        conn = self.conn
        with conn.transaction():
            pin_settings(conn, local=True)
            with conn.cursor(row_factory=tuple_row) as cur:
                try:
                    cur.execute(_PROBE_SQL, (name, limit, flat), binary=True)
                    rows = cur.fetchall()
                except psycopg.Error as exc:
                    raise self._error(exc, name, "probing changes") from exc
        return [(Lsn(lsn), bytes(data)) for lsn, data in rows]

    @contextlib.contextmanager
    def peek_copy(
        self, name: str, upto_lsn: Lsn, options: Sequence[tuple[str, str]] = (), upto_rows: int | None = None
    ) -> Iterator[psycopg.Copy]:
        """The rows :meth:`peek` gives, as a ``COPY ... TO STDOUT (FORMAT BINARY)`` in progress.

        A context manager giving psycopg's ``Copy`` (iterate it for raw blocks). Columns: lsn
        (pg_lsn, 8 bytes), xid (xid, 4 bytes; NULL for non-transactional messages), data (bytea).
        Same function, options and pinned GUCs as :meth:`peek`; for readers that parse the binary
        COPY format themselves (the extract's native fast path, which may also read the
        connection's libpq directly while the COPY is open).
        """
        ceiling, flat = _peek_arguments(name, upto_lsn, options, upto_rows)
        conn = self.conn
        widen_input_buffer(conn)
        with conn.transaction():
            pin_settings(conn, local=True)
            with conn.cursor() as cur:
                try:
                    with cur.copy(_PEEK_COPY_SQL, (name, str(ceiling), upto_rows, flat)) as copy:
                        yield copy
                except psycopg.Error as exc:
                    raise self._error(exc, name, "peeking changes") from exc

    def free_slots(self) -> int:
        """Replication slots the server can still create (``max_replication_slots`` less those that exist)."""
        row = self._one(
            "SELECT current_setting('max_replication_slots')::int - (SELECT count(*) FROM pg_replication_slots)"
        )
        assert row is not None
        return int(row[0])

    def copy_at(self, name: str, copy_name: str, position: Lsn) -> Lsn:
        """Copy slot ``name`` as a temporary slot of this session, ``copy_name``, and move the copy
        to ``position`` (PostgreSQL reads the WAL up to there without decoding it); returns the
        copy's position. The copy goes with the session; ``name`` is left as it was.

        A copy starts decoding where the copy stands, as the slot would after a confirm of
        ``position``: a second session decodes the range beyond it while the slot's own session
        decodes the range before (:mod:`airflow_provider_pgdecode.capture.sessions`).
        """
        try:
            self._one("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (name, copy_name))
            row = self._one_unlimited(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (copy_name, str(position))
            )
        except psycopg.Error as exc:
            raise self._error(exc, name, "copying") from exc
        assert row is not None
        return Lsn.parse(row[0])

    def advance(self, name: str, lsn: Lsn, follow_upper: bool = True) -> Lsn:
        """Confirm the slot up to ``lsn``; never moves backwards. Returns the slot's new position.

        The new position is persisted at the server's next checkpoint: after a crash the slot
        may be back at an earlier position, and those changes are delivered again. The slot's
        upper-half slot (:func:`upper_slot_name`), when there is one behind, is moved there too
        (unless ``follow_upper`` is False), so that it retains no WAL the slot does not.
        """
        target = Lsn.coerce(lsn)
        info = self.describe(name)
        if info.confirmed_flush_lsn is not None and target <= info.confirmed_flush_lsn:
            position = info.confirmed_flush_lsn
        else:
            position = self._advance(name, target)
        if follow_upper:
            self._follow(name, position)
        return position

    def _follow(self, name: str, position: Lsn) -> None:
        """Move ``name``'s upper-half slot up to ``position``; a failure is logged, not raised (the
        slot's confirm stands; the next extract decodes in one session if the upper slot is unusable)."""
        upper = upper_slot_name(name)
        found = None if upper is None else self._describe(upper)
        if upper is None or found is None or found.active:
            return
        if found.confirmed_flush_lsn is not None and found.confirmed_flush_lsn >= position:
            return
        try:
            self._advance(upper, position)
        except SlotError as exc:
            log.warning("Replication slot %s stays where it is: %s", upper, exc)

    def _advance(self, name: str, target: Lsn) -> Lsn:
        try:
            row = self._one_unlimited(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (name, str(target))
            )
        except pg_errors.ObjectNotInPrerequisiteState as exc:
            # Another consumer may have moved it past target meanwhile ("minimum is ...").
            current = self._describe(name)
            if (
                current is not None
                and current.confirmed_flush_lsn is not None
                and target <= current.confirmed_flush_lsn
            ):
                return current.confirmed_flush_lsn
            raise self._error(exc, name, "advancing") from exc
        except psycopg.Error as exc:
            raise self._error(exc, name, "advancing") from exc
        assert row is not None
        return Lsn.parse(row[0])

    def wait_for_flush(self, lsn: Lsn, timeout: float = 10.0) -> Lsn:
        """Wait until the server's WAL flush position reaches ``lsn``; returns that position.

        :class:`SlotError` after ``timeout`` seconds.
        """
        target = Lsn.coerce(lsn)
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            flushed = self.current_flush_lsn()
            if flushed >= target:
                return flushed
            if time.monotonic() >= deadline:
                raise SlotError(
                    f"the server's WAL flush position is {flushed}, still before {target} after {timeout:g}s; "
                    "is the WAL writer stalled?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def heartbeat(self, prefix: str = "pgdecode.heartbeat", content: str = "", flush_timeout: float = 10.0) -> Lsn:
        """Write a non-transactional logical message and wait until it is flushed; returns its LSN.

        Every slot of the database decodes it, so an idle database still gives its slots a
        position to advance to, and a peek right after this call sees it. Before PostgreSQL 17
        the message is flushed by the WAL writer (within a few ``wal_writer_delay``), which this
        call waits for, up to ``flush_timeout`` seconds.
        """
        if self.in_recovery():
            return self.written_where_wal_is(
                lambda primary: SlotClient(primary).heartbeat(prefix, content, flush_timeout), "a heartbeat"
            )
        if self.server_version_num() >= 170000:
            row = self._one("SELECT pg_logical_emit_message(false, %s, %s::text, true)::text", (prefix, content))
            assert row is not None
            return Lsn.parse(row[0])
        row = self._one("SELECT pg_logical_emit_message(false, %s, %s::text)::text", (prefix, content))
        assert row is not None
        lsn = Lsn.parse(row[0])
        # Peeks stop at the flush position. No xid, so no commit record flushes it synchronously.
        self.wait_for_flush(lsn, flush_timeout)
        return lsn
