"""The event model shared by every output plugin.

A parser turns one row of ``pg_logical_slot_peek_*changes`` into one event. Every event
carries the row's ``lsn`` (for COMMIT, PREPARE, COMMIT PREPARED, ROLLBACK PREPARED and
messages this is the *end* of the WAL record, so advancing a slot to it consumes exactly
through that row) and the row's top-level ``xid`` (``None`` where the plugin gives none).

Column values are kept as the text PostgreSQL's type output function printed (what
``test_decoding`` quotes and what ``pgoutput`` sends in text mode), together with the
column's type name. Turning that text into typed values is the staging layer's job
(:mod:`airflow_provider_pgdecode.batch.values`), done column-wise so that both plugins
stage identical values. ``None`` is SQL NULL; :data:`UNCHANGED_TOAST` marks an
out-of-line value the UPDATE did not change, which must never overwrite real data.

Events are plain slotted dataclasses for speed: treat them as immutable.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_provider_pgdecode.decoding.lsn import Lsn

#: The prefix of pgdecode's own heartbeat messages (``SlotClient.heartbeat``): they move an idle
#: slot's end forward and are not staged as the source's messages.
HEARTBEAT_PREFIX = "pgdecode.heartbeat"


class _UnchangedToast:
    """Marker for an unchanged out-of-line (TOAST) value: the column keeps what it had."""

    _instance: _UnchangedToast | None = None

    def __new__(cls) -> _UnchangedToast:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _UnchangedToast()

ColumnValue = str | None | _UnchangedToast


class Operation(str, enum.Enum):
    INSERT = "I"
    UPDATE = "U"
    DELETE = "D"


@dataclass(slots=True)
class RowImage:
    """One tuple of a change: column names, type names and text values, in table order.

    Old-key images from ``test_decoding`` omit NULL columns (PostgreSQL prints them with
    ``skip_nulls``), so a column missing from an old image is "NULL or not part of the key".
    """

    names: tuple[str, ...]
    types: tuple[str, ...]
    values: tuple[ColumnValue, ...]

    def as_dict(self) -> dict[str, ColumnValue]:
        return dict(zip(self.names, self.values))

    def unchanged_toast_columns(self) -> tuple[str, ...]:
        return tuple(n for n, v in zip(self.names, self.values) if v is UNCHANGED_TOAST)


@dataclass(slots=True)
class Begin:
    lsn: Lsn
    xid: int | None
    # pgoutput's Begin carries these; test_decoding's BEGIN line does not.
    final_lsn: Lsn | None = None
    commit_time: datetime | None = None


@dataclass(slots=True)
class Commit:
    lsn: Lsn
    xid: int | None
    commit_time: datetime | None = None


@dataclass(slots=True)
class Change:
    """An INSERT, UPDATE or DELETE of one row.

    ``old`` is the old key (or the whole old row under REPLICA IDENTITY FULL) when the
    plugin sent one; ``new`` is the new tuple (``None`` for DELETE). ``has_tuple_data`` is
    False for ``(no-tuple-data)``: a DELETE or INSERT from which PostgreSQL logged nothing
    usable (a table without a primary key under REPLICA IDENTITY DEFAULT).
    """

    lsn: Lsn
    xid: int | None
    operation: Operation
    schema: str
    table: str
    old: RowImage | None
    new: RowImage | None
    has_tuple_data: bool = True


@dataclass(slots=True)
class Truncate:
    lsn: Lsn
    xid: int | None
    relations: tuple[tuple[str, str], ...]
    cascade: bool = False
    restart_identity: bool = False


@dataclass(slots=True)
class Message:
    """A ``pg_logical_emit_message`` record. ``content`` is raw bytes (size measured in bytes)."""

    lsn: Lsn
    xid: int | None
    transactional: bool
    prefix: str
    content: bytes


@dataclass(slots=True)
class Prepare:
    lsn: Lsn
    xid: int | None
    gid: str
    prepare_time: datetime | None = None


@dataclass(slots=True)
class CommitPrepared:
    lsn: Lsn
    xid: int | None
    gid: str
    commit_time: datetime | None = None


@dataclass(slots=True)
class RollbackPrepared:
    lsn: Lsn
    xid: int | None
    gid: str
    rollback_time: datetime | None = None


@dataclass(slots=True)
class Origin:
    """The replication origin of the transaction being decoded (pgoutput only)."""

    lsn: Lsn
    xid: int | None
    name: str
    origin_lsn: Lsn | None = None


# Streaming of in-progress transactions (PostgreSQL 14+). test_decoding prints these without
# row data, which is why only pgoutput can deliver streamed transactions.


@dataclass(slots=True)
class StreamStart:
    lsn: Lsn
    xid: int | None
    first_segment: bool | None = None


@dataclass(slots=True)
class StreamStop:
    lsn: Lsn
    xid: int | None


@dataclass(slots=True)
class StreamAbort:
    """Abort of a streamed transaction (``subxid == xid``) or of one of its subtransactions.

    ``abort_lsn`` and ``abort_time`` come with protocol 4 (PostgreSQL 16+) when the slot is read
    with ``streaming=parallel``; ``None`` otherwise."""

    lsn: Lsn
    xid: int | None
    subxid: int | None = None
    abort_lsn: Lsn | None = None
    abort_time: datetime | None = None


@dataclass(slots=True)
class StreamCommit:
    lsn: Lsn
    xid: int | None
    commit_time: datetime | None = None


@dataclass(slots=True)
class StreamPrepare:
    lsn: Lsn
    xid: int | None
    gid: str
    prepare_time: datetime | None = None


@dataclass(slots=True)
class StreamDataWithheld:
    """A streamed change, TRUNCATE or transactional message whose content the plugin did not print.

    ``test_decoding`` prints ``streaming change for TXN n`` with no row: such a transaction
    cannot be staged, and the assembler says so.
    """

    lsn: Lsn
    xid: int | None
    what: str


Event = (
    Begin
    | Commit
    | Change
    | Truncate
    | Message
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | Origin
    | StreamStart
    | StreamStop
    | StreamAbort
    | StreamCommit
    | StreamPrepare
    | StreamDataWithheld
)

#: What a transaction holds, in order.
TransactionItem = Change | Truncate | Message


# --- JSON form of transaction items, used to spool large transactions to disk and to carry
# prepared transactions from one batch to the next. Lossless: values stay text.

_TOAST_JSON = {"$toast": True}


def _image_to_json(image: RowImage | None) -> Any:
    if image is None:
        return None
    return [
        list(image.names),
        list(image.types),
        [_TOAST_JSON if v is UNCHANGED_TOAST else v for v in image.values],
    ]


def _image_from_json(data: Any) -> RowImage | None:
    if data is None:
        return None
    names, types, values = data
    return RowImage(
        tuple(names),
        tuple(types),
        tuple(UNCHANGED_TOAST if isinstance(v, dict) else v for v in values),
    )


def item_to_json(item: TransactionItem) -> dict[str, Any]:
    if isinstance(item, Change):
        return {
            "k": "change",
            "lsn": int(item.lsn),
            "xid": item.xid,
            "op": item.operation.value,
            "schema": item.schema,
            "table": item.table,
            "old": _image_to_json(item.old),
            "new": _image_to_json(item.new),
            "tuple": item.has_tuple_data,
        }
    if isinstance(item, Truncate):
        return {
            "k": "truncate",
            "lsn": int(item.lsn),
            "xid": item.xid,
            "relations": [list(r) for r in item.relations],
            "cascade": item.cascade,
            "restart_identity": item.restart_identity,
        }
    if isinstance(item, Message):
        return {
            "k": "message",
            "lsn": int(item.lsn),
            "xid": item.xid,
            "transactional": item.transactional,
            "prefix": item.prefix,
            "content": base64.b64encode(item.content).decode("ascii"),
        }
    raise TypeError(f"not a transaction item: {item!r}")


def item_from_json(data: dict[str, Any]) -> TransactionItem:
    kind = data["k"]
    if kind == "change":
        return Change(
            Lsn(data["lsn"]),
            data["xid"],
            Operation(data["op"]),
            data["schema"],
            data["table"],
            _image_from_json(data["old"]),
            _image_from_json(data["new"]),
            data["tuple"],
        )
    if kind == "truncate":
        return Truncate(
            Lsn(data["lsn"]),
            data["xid"],
            tuple((s, t) for s, t in data["relations"]),
            data["cascade"],
            data["restart_identity"],
        )
    if kind == "message":
        return Message(
            Lsn(data["lsn"]),
            data["xid"],
            data["transactional"],
            data["prefix"],
            base64.b64decode(data["content"]),
        )
    raise ValueError(f"unknown transaction item kind {kind!r} in spooled data")


__all__ = [
    "UNCHANGED_TOAST",
    "Begin",
    "Change",
    "ColumnValue",
    "Commit",
    "CommitPrepared",
    "Event",
    "Message",
    "Operation",
    "Origin",
    "Prepare",
    "RollbackPrepared",
    "RowImage",
    "StreamAbort",
    "StreamCommit",
    "StreamDataWithheld",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "TransactionItem",
    "Truncate",
    "item_from_json",
    "item_to_json",
]
