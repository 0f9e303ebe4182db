"""Does a replication slot have changes to extract? The probe the changes trigger, the changes
sensor and the health sensor's heartbeat share.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.decoding.events import (
    HEARTBEAT_PREFIX,
    Begin,
    Commit,
    Event,
    Message,
    Origin,
    StreamStart,
    StreamStop,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import PgOutputParser, pgoutput_options
from airflow_provider_pgdecode.decoding.test_decoding import PROBE_OPTIONS, TestDecodingParser
from airflow_provider_pgdecode.errors import ConfigurationError, SlotError, SlotInUseError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.health import check_readable, slot_in_use
from airflow_provider_pgdecode.postgres.slot import SlotInfo

DEFAULT_HEARTBEAT_PREFIX = HEARTBEAT_PREFIX
DEFAULT_PROBE_ROWS = 100

_NOT_CHANGES = (Begin, Commit, Origin, StreamStart, StreamStop)


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
    rows: Iterable[tuple[Lsn | str, bytes | str]],
    heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
    encoding: str = "utf-8",
) -> tuple[int, int, Lsn | None]:
    """``(changes, heartbeats, first change LSN)`` of test_decoding rows peeked with the probe's options."""
    parser = TestDecodingParser(encoding)
    events = ((Lsn.coerce(lsn), parser.parse(Lsn.coerce(lsn), None, data)) for lsn, data in rows)
    return classify_events(events, heartbeat_prefix)


def classify_pgoutput_rows(
    rows: Iterable[tuple[Lsn | str, bytes]],
    heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
    type_names: Mapping[int, str] | None = None,
) -> tuple[int, int, Lsn | None]:
    """``(changes, heartbeats, first change LSN)`` of pgoutput (protocol 1) messages; ``type_names``:
    the catalog's names of the types by OID, as the extract decodes them."""
    parser = PgOutputParser(proto_version=1, type_names=dict(type_names or {}))
    return classify_events(
        ((Lsn.coerce(lsn), parser.parse(Lsn.coerce(lsn), None, bytes(data))) for lsn, data in rows), heartbeat_prefix
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

    :raises SlotInUseError: another process holds the slot.
    :raises SlotError: the slot is lost, of an unsupported plugin, or a pgoutput slot without
        ``publication``.
    """
    if probe_rows < 1:
        raise ConfigurationError(f"probe_rows must be positive, got {probe_rows}")
    name = info.slot_name
    check_readable(info)
    client = hook.get_slot_client()
    rows = client.probe(name, probe_rows, probe_options(info, publication, client.server_version_num()))
    if info.plugin == "test_decoding":
        changes, heartbeats, first = classify_text_rows(rows, heartbeat_prefix, client.server_encoding())
    else:
        # The catalog's type names, as the extract has them: a change is decoded as it will be.
        changes, heartbeats, first = classify_pgoutput_rows(rows, heartbeat_prefix, hook.get_catalog().type_names())
    return ChangesProbe(changes, heartbeats, len(rows), len(rows) >= probe_rows, first)


def probe_options(info: SlotInfo, publication: str | None, server_version_num: int) -> list[tuple[str, str]]:
    """The plugin options a probe reads ``info``'s slot with (protocol 1 for pgoutput: enough to
    tell changes from transaction boundaries).

    :raises SlotError: an unsupported plugin, or a pgoutput slot without ``publication``.
    """
    if info.plugin == "test_decoding":
        return list(PROBE_OPTIONS)
    if info.plugin == "pgoutput":
        if not publication:
            raise SlotError(
                f"replication slot {info.slot_name!r} uses pgoutput: probing it for changes needs the publication "
                "it is read with (publication=...)"
            )
        return pgoutput_options(publication, server_version_num, proto_version=1, streaming=False, messages=True)
    raise SlotError(
        f"replication slot {info.slot_name!r} uses output plugin {info.plugin!r}; pgdecode reads test_decoding "
        "and pgoutput slots only"
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
    check_readable(info)
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
            raise slot_in_use(slot_name)
        probe = probe_changes(
            hook, info, probe_rows=probe_rows, heartbeat_prefix=heartbeat_prefix, publication=publication
        )
    except SlotInUseError as exc:
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
