"""pgoutput at byte level: messages built with struct as PostgreSQL's protocol documentation lays them out
("Logical Replication Message Formats"), fed to PgOutputParser for every protocol version it speaks."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_pgdecode.decoding.events import (
    UNCHANGED_TOAST,
    Begin,
    Change,
    Commit,
    CommitPrepared,
    Message,
    Operation,
    Origin,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import PgOutputParser
from airflow_provider_pgdecode.errors import DecodingError

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
ALL_VERSIONS = [1, 2, 3, 4]
STREAM_VERSIONS = [2, 3, 4]
TWO_PHASE_VERSIONS = [3, 4]

INT4, TEXT, NUMERIC, VARCHAR = 23, 25, 1700, 1043

# --- message builders (big-endian; String = bytes + NUL; [xid] only inside a stream) -----------


def pg_string(text: str, encoding: str = "utf-8") -> bytes:
    return text.encode(encoding) + b"\x00"


def pg_time(when: datetime | None) -> int:
    """Int64 microseconds since 2000-01-01 UTC (0 stands for "no time" here)."""
    return 0 if when is None else (when - PG_EPOCH) // timedelta(microseconds=1)


def sub_xid(xid: int | None) -> bytes:
    return b"" if xid is None else struct.pack(">I", xid)


def begin(final_lsn: int, when: datetime | None, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, pg_time(when), xid)


def commit(commit_lsn: int, end_lsn: int, when: datetime | None, flags: int = 0) -> bytes:
    return b"C" + struct.pack(">bQQq", flags, commit_lsn, end_lsn, pg_time(when))


def relation(
    relid: int,
    namespace: str,
    name: str,
    columns: list[tuple[int, str, int, int]],
    replident: bytes = b"d",
    xid: int | None = None,
) -> bytes:
    """columns: (flags, name, type oid, typmod); flags 1 = part of the key."""
    out = b"R" + sub_xid(xid) + struct.pack(">I", relid) + pg_string(namespace) + pg_string(name) + replident
    out += struct.pack(">h", len(columns))
    for flags, column, oid, typmod in columns:
        out += struct.pack(">b", flags) + pg_string(column) + struct.pack(">Ii", oid, typmod)
    return out


def type_message(oid: int, namespace: str, name: str, xid: int | None = None) -> bytes:
    return b"Y" + sub_xid(xid) + struct.pack(">I", oid) + pg_string(namespace) + pg_string(name)


def tuple_data(values: list[object], encoding: str = "utf-8") -> bytes:
    """None -> 'n', UNCHANGED_TOAST -> 'u', str -> 't', bytes -> 'b'."""
    out = struct.pack(">h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is UNCHANGED_TOAST:
            out += b"u"
        elif isinstance(value, bytes):
            out += b"b" + struct.pack(">i", len(value)) + value
        else:
            raw = str(value).encode(encoding)
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def insert(relid: int, new: list[object], xid: int | None = None) -> bytes:
    return b"I" + sub_xid(xid) + struct.pack(">I", relid) + b"N" + tuple_data(new)


def update(
    relid: int, new: list[object], old: list[object] | None = None, old_kind: bytes = b"K", xid: int | None = None
) -> bytes:
    out = b"U" + sub_xid(xid) + struct.pack(">I", relid)
    if old is not None:
        out += old_kind + tuple_data(old)
    return out + b"N" + tuple_data(new)


def delete(relid: int, old: list[object], old_kind: bytes = b"K", xid: int | None = None) -> bytes:
    return b"D" + sub_xid(xid) + struct.pack(">I", relid) + old_kind + tuple_data(old)


def truncate(relids: list[int], options: int = 0, xid: int | None = None) -> bytes:
    return (
        b"T" + sub_xid(xid) + struct.pack(">ib", len(relids), options) + b"".join(struct.pack(">I", r) for r in relids)
    )


def message(prefix: str, content: bytes, transactional: bool, lsn: int, xid: int | None = None) -> bytes:
    return (
        b"M"
        + sub_xid(xid)
        + struct.pack(">bQ", 1 if transactional else 0, lsn)
        + pg_string(prefix)
        + struct.pack(">i", len(content))
        + content
    )


def origin(origin_lsn: int, name: str) -> bytes:
    return b"O" + struct.pack(">Q", origin_lsn) + pg_string(name)


def stream_start(xid: int, first: bool) -> bytes:
    return b"S" + struct.pack(">Ib", xid, 1 if first else 0)


def stream_stop() -> bytes:
    return b"E"


def stream_commit(xid: int, commit_lsn: int, end_lsn: int, when: datetime | None) -> bytes:
    return b"c" + struct.pack(">IbQQq", xid, 0, commit_lsn, end_lsn, pg_time(when))


def stream_abort(xid: int, subxid: int, parallel: tuple[int, datetime] | None = None) -> bytes:
    out = b"A" + struct.pack(">II", xid, subxid)
    if parallel is not None:  # protocol 4 with streaming = parallel
        out += struct.pack(">Qq", parallel[0], pg_time(parallel[1]))
    return out


def begin_prepare(prepare_lsn: int, end_lsn: int, when: datetime | None, xid: int, gid: str) -> bytes:
    return b"b" + struct.pack(">QQqI", prepare_lsn, end_lsn, pg_time(when), xid) + pg_string(gid)


def two_phase(kind: bytes, lsn: int, end_lsn: int, when: datetime | None, xid: int, gid: str) -> bytes:
    """Prepare 'P', Commit Prepared 'K' and Stream Prepare 'p' share one layout."""
    return kind + struct.pack(">bQQqI", 0, lsn, end_lsn, pg_time(when), xid) + pg_string(gid)


def rollback_prepared(
    prepare_end_lsn: int,
    rollback_end_lsn: int,
    prepared_at: datetime | None,
    rolled_back_at: datetime | None,
    xid: int,
    gid: str,
) -> bytes:
    return (
        b"r"
        + struct.pack(
            ">bQQqqI", 0, prepare_end_lsn, rollback_end_lsn, pg_time(prepared_at), pg_time(rolled_back_at), xid
        )
        + pg_string(gid)
    )


# --- a table to change ------------------------------------------------------------------------

ORDERS = 16401
ORDERS_COLUMNS = [
    (1, "id", INT4, -1),
    (0, "note", TEXT, -1),
    (0, "amount", NUMERIC, (12 << 16 | 2) + 4),
    (1, "region", VARCHAR, 24),
]
NAMES = ("id", "note", "amount", "region")
TYPES = ("integer", "text", "numeric", "character varying")
T0 = datetime(2026, 11, 22, 9, 43, 0, 601424, tzinfo=UTC)


def parser_with_orders(version: int, **kwargs) -> PgOutputParser:
    parser = PgOutputParser(proto_version=version, **kwargs)
    assert parser.parse(Lsn(0x10), 700, relation(ORDERS, "public", "orders", ORDERS_COLUMNS)) is None
    return parser


# --- transaction boundaries -------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_begin_and_commit(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    event = parser.parse(Lsn(0x1618400), 767, begin(0x1618418, T0, 767))
    assert event == Begin(Lsn(0x1618400), 767, Lsn(0x1618418), T0)
    assert event.commit_time.tzinfo is not None and event.commit_time.utcoffset() == timedelta(0)
    done = parser.parse(Lsn(0x1618448), 767, commit(0x1618418, 0x1618448, T0))
    assert done == Commit(Lsn(0x1618448), 767, T0)


def test_the_real_bytes_from_the_reference_run() -> None:
    # Bytes observed from PostgreSQL 15 (proto 1) for pt(id int pk, t text, n int): B, R, I, U (key changed), D, M, C.
    rows = [
        ("0/1618400", "42 0000000001618418 000303d91566c7eb 000002ff"),
        (
            "0/1618400",
            "52 00004030 7075626c696300 707400 64 0003 01 696400 00000017 ffffffff"
            " 00 7400 00000019 ffffffff 00 6e00 00000017 ffffffff",
        ),
        ("0/1618500", "49 00004030 4e 0003 74 00000001 31 74 00000002 6869 6e"),
        ("0/1618600", "55 00004030 4b 0003 74 00000001 31 6e 6e 4e 0003 74 00000001 32 74 00000002 6869 6e"),
        ("0/1618700", "44 00004030 4b 0003 74 00000001 32 6e 6e"),
        ("0/1618640", "4d 01 0000000001618640 70667800 00000003 6d7367"),
        ("0/1618448", "43 00 0000000001618418 0000000001618448 000303d91566c7eb"),
    ]
    parser = PgOutputParser(proto_version=1)
    events = [parser.parse(Lsn.parse(lsn), 767, bytes.fromhex(text)) for lsn, text in rows]
    begin_event, rel, ins, upd, dele, msg, com = events
    when = PG_EPOCH + timedelta(microseconds=0x000303D91566C7EB)
    assert begin_event == Begin(Lsn.parse("0/1618400"), 0x2FF, Lsn.parse("0/1618418"), when)
    assert rel is None
    assert parser.relations[0x4030].table == "pt" and parser.relations[0x4030].types == ("integer", "text", "integer")
    assert parser.relations[0x4030].key_flags == (True, False, False)
    assert ins.new.values == ("1", "hi", None) and ins.operation is Operation.INSERT
    assert (ins.schema, ins.table) == ("public", "pt")
    assert upd.old.names == ("id",) and upd.old.values == ("1",)  # K: only the key; 'n' = not in the key
    assert upd.new.values == ("2", "hi", None)
    assert dele.old.as_dict() == {"id": "2"} and dele.new is None
    assert msg == Message(Lsn.parse("0/1618640"), 767, True, "pfx", b"msg")
    assert com == Commit(Lsn.parse("0/1618448"), 767, when)


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_zero_timestamps_are_no_time(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    assert parser.parse(Lsn(1), 5, begin(0x20, None, 5)).commit_time is None
    assert parser.parse(Lsn(2), 5, commit(0x20, 0x30, None)).commit_time is None


@given(when=st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)))
def test_timestamps_are_microseconds_since_2000_utc(when: datetime) -> None:
    if when == PG_EPOCH:
        return  # 0 is "no time"
    parser = PgOutputParser(proto_version=1)
    assert parser.parse(Lsn(1), 1, begin(2, when, 1)).commit_time == when
    assert parser.parse(Lsn(2), 1, commit(2, 3, when)).commit_time == when


# --- relations and types ----------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_relation_fills_the_cache(version: int) -> None:
    parser = parser_with_orders(version)
    cached = parser.relations[ORDERS]
    assert (cached.schema, cached.table, cached.replica_identity) == ("public", "orders", "d")
    assert cached.names == NAMES and cached.types == TYPES
    assert cached.key_flags == (True, False, False, True)


def test_an_empty_namespace_is_pg_catalog() -> None:
    parser = PgOutputParser(proto_version=1)
    parser.parse(Lsn(1), 1, relation(99, "", "pg_thing", [(1, "id", INT4, -1)]))
    assert parser.relations[99].schema == "pg_catalog"


def test_names_are_decoded_with_the_database_encoding() -> None:
    parser = PgOutputParser(proto_version=1, encoding="latin-1")
    data = (
        b"R"
        + struct.pack(">I", 5)
        + pg_string("Verkäufe", "latin-1")
        + pg_string("Grüße", "latin-1")
        + b"f"
        + struct.pack(">h", 1)
        + b"\x00"
        + pg_string("straße", "latin-1")
        + struct.pack(">Ii", TEXT, -1)
    )
    parser.parse(Lsn(1), 1, data)
    assert (parser.relations[5].schema, parser.relations[5].table, parser.relations[5].names) == (
        "Verkäufe",
        "Grüße",
        ("straße",),
    )
    change = parser.parse(Lsn(2), 1, b"I" + struct.pack(">I", 5) + b"N" + tuple_data(["süß"], "latin-1"))
    assert change.new.values == ("süß",)


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_user_types_are_named_from_type_messages(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    assert parser.parse(Lsn(1), 1, type_message(16500, "public", "mood")) is None
    assert parser.parse(Lsn(1), 1, type_message(16499, "public", "_mood")) is None
    assert parser.parse(Lsn(1), 1, type_message(16510, "shop", "Mood Ring")) is None
    parser.parse(
        Lsn(2),
        1,
        relation(
            7, "public", "t", [(1, "id", INT4, -1), (0, "m", 16500, -1), (0, "ms", 16499, -1), (0, "r", 16510, -1)]
        ),
    )
    assert parser.relations[7].types == ("integer", "mood", "mood[]", '"Mood Ring"')


def test_catalog_type_names_win_and_builtin_names_cannot_be_renamed() -> None:
    parser = PgOutputParser(proto_version=1, type_names={16500: "shop.mood"})
    parser.parse(Lsn(1), 1, type_message(16500, "shop", "mood"))
    parser.parse(Lsn(1), 1, type_message(INT4, "pg_catalog", "int4"))  # PostgreSQL never sends these; harmless
    parser.parse(Lsn(2), 1, relation(7, "public", "t", [(1, "id", INT4, -1), (0, "m", 16500, -1)]))
    assert parser.relations[7].types == ("integer", "shop.mood")


def test_a_relation_can_be_redefined() -> None:
    # Every SQL call (and every ALTER TABLE) re-sends the Relation: the newest one applies.
    parser = parser_with_orders(1)
    parser.parse(Lsn(0x20), 1, relation(ORDERS, "public", "orders", [(1, "id", INT4, -1)]))
    assert parser.parse(Lsn(0x30), 1, insert(ORDERS, ["5"])).new.names == ("id",)


# --- changes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_insert_with_every_tuple_kind(version: int) -> None:
    parser = parser_with_orders(version)
    event = parser.parse(Lsn(0x100), 700, insert(ORDERS, ["1", 'it\'s "x"\nline2', None, UNCHANGED_TOAST]))
    assert isinstance(event, Change)
    assert (event.lsn, event.xid, event.operation, event.schema, event.table, event.old) == (
        Lsn(0x100),
        700,
        Operation.INSERT,
        "public",
        "orders",
        None,
    )
    assert event.has_tuple_data
    assert event.new.names == NAMES and event.new.types == TYPES
    assert event.new.values[:3] == ("1", 'it\'s "x"\nline2', None)
    assert event.new.values[3] is UNCHANGED_TOAST


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_update_without_old_tuple(version: int) -> None:
    parser = parser_with_orders(version)
    event = parser.parse(Lsn(0x110), 700, update(ORDERS, ["1", "n", "1.50", "eu"]))
    assert event.operation is Operation.UPDATE and event.old is None
    assert event.new.as_dict() == {"id": "1", "note": "n", "amount": "1.50", "region": "eu"}


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_update_with_key_tuple_keeps_only_key_columns(version: int) -> None:
    parser = parser_with_orders(version)
    # In a K tuple the non-key columns come as 'n': not NULL, just not part of the key.
    event = parser.parse(
        Lsn(0x120), 700, update(ORDERS, ["2", UNCHANGED_TOAST, "3", "us"], ["1", None, None, "eu"], b"K")
    )
    assert event.old.names == ("id", "region")
    assert event.old.types == ("integer", "character varying")
    assert event.old.values == ("1", "eu")
    assert event.new.values[1] is UNCHANGED_TOAST
    assert event.new.unchanged_toast_columns() == ("note",)


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_update_with_old_row_leaves_out_null_columns_like_test_decoding(version: int) -> None:
    parser = parser_with_orders(version)
    event = parser.parse(Lsn(0x130), 700, update(ORDERS, ["1", "new", None, "eu"], ["1", "old", None, "eu"], b"O"))
    assert event.old.as_dict() == {"id": "1", "note": "old", "region": "eu"}
    assert event.new.as_dict() == {"id": "1", "note": "new", "amount": None, "region": "eu"}


@pytest.mark.parametrize("version", ALL_VERSIONS)
@pytest.mark.parametrize(
    "kind, expected", [(b"K", {"id": "9", "region": "eu"}), (b"O", {"id": "9", "note": "x", "region": "eu"})]
)
def test_delete(version: int, kind: bytes, expected: dict[str, str]) -> None:
    parser = parser_with_orders(version)
    old = ["9", None, None, "eu"] if kind == b"K" else ["9", "x", None, "eu"]
    event = parser.parse(Lsn(0x140), 700, delete(ORDERS, old, kind))
    assert event.operation is Operation.DELETE and event.new is None
    assert (event.schema, event.table) == ("public", "orders")
    assert event.old.as_dict() == expected


@pytest.mark.parametrize("version", ALL_VERSIONS)
@pytest.mark.parametrize(
    "options, cascade, restart", [(0, False, False), (1, True, False), (2, False, True), (3, True, True)]
)
def test_truncate(version: int, options: int, cascade: bool, restart: bool) -> None:
    parser = parser_with_orders(version)
    parser.parse(Lsn(0x11), 700, relation(16402, "sales", "Line Items", [(1, "id", INT4, -1)]))
    event = parser.parse(Lsn(0x150), 700, truncate([ORDERS, 16402], options))
    assert event == Truncate(Lsn(0x150), 700, (("public", "orders"), ("sales", "Line Items")), cascade, restart)


@given(values=st.lists(st.one_of(st.none(), st.just(UNCHANGED_TOAST), st.text()), min_size=1, max_size=12))
def test_any_text_tuple_decodes_to_its_values(values: list[object]) -> None:
    parser = PgOutputParser(proto_version=1)
    parser.parse(Lsn(1), 1, relation(3, "public", "wide", [(0, f"c{i}", TEXT, -1) for i in range(len(values))]))
    event = parser.parse(Lsn(2), 1, insert(3, values))
    assert list(event.new.values) == values
    assert [v is UNCHANGED_TOAST for v in event.new.values] == [v is UNCHANGED_TOAST for v in values]


# --- messages and origins ---------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_messages(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    content = bytes(range(256)) + b"sz: 3, content:\n"
    event = parser.parse(Lsn(0x200), 700, message("app.audit", content, True, 0x200))
    assert event == Message(Lsn(0x200), 700, True, "app.audit", content)
    # A non-transactional message outside any transaction has xid 0 in the peek row: no xid.
    loose = parser.parse(Lsn(0x210), 0, message("pgdecode.heartbeat", b"", False, 0x210))
    assert loose == Message(Lsn(0x210), None, False, "pgdecode.heartbeat", b"")


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_origin(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    event = parser.parse(Lsn(0x300), 700, origin(0x5_0000_0010, "pg_16389"))
    assert event == Origin(Lsn(0x300), 700, "pg_16389", Lsn(0x5_0000_0010))


# --- streaming (protocol 2+) ------------------------------------------------------------------


@pytest.mark.parametrize("version", STREAM_VERSIONS)
def test_a_streamed_transaction(version: int) -> None:
    parser = PgOutputParser(proto_version=version)
    top, sub = 800, 801
    rows = [
        (0x400, stream_start(top, True)),
        (0x401, type_message(16500, "public", "mood", xid=top)),
        (0x402, relation(ORDERS, "public", "orders", ORDERS_COLUMNS[:2] + [(0, "m", 16500, -1)], xid=top)),
        (0x403, insert(ORDERS, ["1", "a", "ok"], xid=top)),
        (0x404, update(ORDERS, ["1", "b", "ok"], xid=sub)),
        (0x405, delete(ORDERS, ["1", None, None], xid=sub)),
        (0x406, truncate([ORDERS], 1, xid=sub)),
        (0x407, message("p", b"in stream", True, 0x407, xid=sub)),
        (0x408, stream_stop()),
        (0x409, stream_start(top, False)),
        (0x40A, insert(ORDERS, ["2", None, UNCHANGED_TOAST], xid=top)),
        (0x40B, stream_stop()),
        (0x40C, stream_abort(top, sub)),
        (0x40D, stream_commit(top, 0x40D, 0x40E, T0)),
    ]
    events = [parser.parse(Lsn(lsn), top, data) for lsn, data in rows]
    assert events[0] == StreamStart(Lsn(0x400), top, True)
    assert events[1] is None and events[2] is None
    assert parser.relations[ORDERS].types == ("integer", "text", "mood")
    # Inside the stream every data message carries the xid of the (sub)transaction that made it.
    assert [(type(e).__name__, e.xid) for e in events[3:8]] == [
        ("Change", top),
        ("Change", sub),
        ("Change", sub),
        ("Truncate", sub),
        ("Message", sub),
    ]
    assert events[4].new.values == ("1", "b", "ok")
    assert events[5].old.as_dict() == {"id": "1"}
    assert events[6].relations == (("public", "orders"),) and events[6].cascade
    assert events[7].content == b"in stream"
    assert events[8] == StreamStop(Lsn(0x408), top)
    assert events[9] == StreamStart(Lsn(0x409), top, False)
    assert events[10].new.values[2] is UNCHANGED_TOAST
    assert events[11] == StreamStop(Lsn(0x40B), top)
    assert events[12] == StreamAbort(Lsn(0x40C), top, sub)
    assert events[13] == StreamCommit(Lsn(0x40D), top, T0)


@pytest.mark.parametrize("version", STREAM_VERSIONS)
def test_after_stream_stop_messages_carry_no_xid_again(version: int) -> None:
    parser = parser_with_orders(version)
    parser.parse(Lsn(1), 0, stream_start(800, True))
    parser.parse(Lsn(2), 0, stream_stop())
    # A regular transaction between stream blocks: no [xid] field; the row's xid is the owner.
    parser.parse(Lsn(3), 900, begin(0x10, T0, 900))
    event = parser.parse(Lsn(4), 900, insert(ORDERS, ["5", "x", "1", "eu"]))
    assert event.xid == 900 and event.new.values == ("5", "x", "1", "eu")


def test_stream_abort_with_protocol_4_parallel_fields() -> None:
    parser = PgOutputParser(proto_version=4)
    event = parser.parse(Lsn(0x500), 800, stream_abort(800, 802, (0x4FF, T0)))
    assert event == StreamAbort(Lsn(0x500), 800, 802, abort_lsn=Lsn(0x4FF), abort_time=T0)


@pytest.mark.parametrize("version", STREAM_VERSIONS)
def test_stream_abort_without_parallel_fields_has_no_abort_position(version: int) -> None:
    event = PgOutputParser(proto_version=version).parse(Lsn(0x500), 800, stream_abort(800, 802))
    assert event == StreamAbort(Lsn(0x500), 800, 802) and event.abort_lsn is None and event.abort_time is None


# --- two-phase commit (protocol 3+) -----------------------------------------------------------


@pytest.mark.parametrize("version", TWO_PHASE_VERSIONS)
def test_two_phase_messages(version: int) -> None:
    parser = parser_with_orders(version)
    later = T0 + timedelta(minutes=5)
    gid = "tx-42 'quoted' ü"
    assert parser.parse(Lsn(0x600), 910, begin_prepare(0x640, 0x650, T0, 910, gid)) == Begin(Lsn(0x600), 910)
    change = parser.parse(Lsn(0x610), 910, insert(ORDERS, ["1", None, None, "eu"]))
    assert change.xid == 910
    assert parser.parse(Lsn(0x650), 910, two_phase(b"P", 0x640, 0x650, T0, 910, gid)) == Prepare(
        Lsn(0x650), 910, gid, T0
    )
    assert parser.parse(Lsn(0x700), 910, two_phase(b"K", 0x6F0, 0x700, later, 910, gid)) == CommitPrepared(
        Lsn(0x700), 910, gid, later
    )
    assert parser.parse(Lsn(0x800), 911, rollback_prepared(0x650, 0x800, T0, later, 911, "g2")) == RollbackPrepared(
        Lsn(0x800), 911, "g2", later
    )  # the rollback's own time, not the prepare's
    assert parser.parse(Lsn(0x900), 912, two_phase(b"p", 0x8F0, 0x900, T0, 912, "sp1")) == StreamPrepare(
        Lsn(0x900), 912, "sp1", T0
    )


def test_top_level_k_and_o_are_commit_prepared_and_origin() -> None:
    # The same bytes mark old tuples inside U/D; at the top level they are message types.
    parser = PgOutputParser(proto_version=3)
    assert isinstance(parser.parse(Lsn(1), 1, two_phase(b"K", 1, 2, T0, 1, "g")), CommitPrepared)
    assert isinstance(parser.parse(Lsn(2), 1, origin(5, "o")), Origin)


# --- malformed input --------------------------------------------------------------------------


def assert_decoding_error(parser: PgOutputParser, lsn: Lsn, data: bytes, match: str | None = None) -> DecodingError:
    with pytest.raises(DecodingError) as info:
        parser.parse(lsn, 700, data)
    assert f"LSN {lsn}" in str(info.value)
    assert info.value.lsn == lsn and info.value.data == data
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def truncation_samples() -> list[tuple[str, bytes, list[int]]]:
    """(name, message, cut positions): the message cut at any of them must fail. Cuts inside a
    NUL-terminated string are covered separately below."""
    i_msg = insert(ORDERS, ["1", "text", None, UNCHANGED_TOAST])
    u_msg = update(ORDERS, ["1", "b", "2", "eu"], ["1", None, None, "eu"], b"K")
    d_msg = delete(ORDERS, ["1", "x", None, "eu"], b"O")
    t_msg = truncate([ORDERS, ORDERS], 1)
    m_msg = message("p", b"content", True, 0x30)  # M, flags, lsn: 10 bytes; "p\0": 2; length: 4; content: 7
    return [
        ("begin", begin(0x10, T0, 5), list(range(21))),
        ("commit", commit(0x10, 0x20, T0), list(range(26))),
        ("insert", i_msg, list(range(len(i_msg)))),
        # Cuts inside the last text value's bytes are covered separately below.
        ("update", u_msg, list(range(len(u_msg) - 2))),
        ("delete", d_msg, list(range(len(d_msg) - 2))),
        ("truncate", t_msg, list(range(len(t_msg)))),
        ("message", m_msg, [0, 1, *range(12, len(m_msg))]),  # 2..11: the prefix is looked for past the end
        ("stream start", stream_start(8, True), list(range(6))),
        ("stream commit", stream_commit(8, 1, 2, T0), list(range(30))),
        ("stream abort", stream_abort(8, 9), list(range(9))),
        ("begin prepare", begin_prepare(1, 2, T0, 9, "g"), list(range(29))),
        ("prepare", two_phase(b"P", 1, 2, T0, 9, "g"), list(range(30))),
        ("commit prepared", two_phase(b"K", 1, 2, T0, 9, "g"), list(range(30))),
        ("rollback prepared", rollback_prepared(1, 2, T0, T0, 9, "g"), list(range(38))),
    ]


@pytest.mark.parametrize("name, data, cuts", truncation_samples(), ids=[s[0] for s in truncation_samples()])
def test_truncated_messages_raise_decoding_error_naming_the_lsn(name: str, data: bytes, cuts: list[int]) -> None:
    assert parser_with_orders(3).parse(Lsn(1), 700, data) is not None  # whole, it parses
    for cut in cuts:
        assert_decoding_error(parser_with_orders(3), Lsn(0x1234_5678_9ABC), data[:cut])


@pytest.mark.parametrize(
    "data",
    [
        relation(ORDERS, "public", "orders", ORDERS_COLUMNS)[:12],
        type_message(16500, "public", "mood")[:-1],
        origin(5, "pg_16389")[:-1],
        message("prefix", b"x", True, 1)[:12],
        message("prefix", b"x", True, 1)[:6],  # cut inside the LSN: the prefix is then searched past the end
        two_phase(b"P", 1, 2, T0, 9, "gid-1")[:-1],
        rollback_prepared(1, 2, T0, T0, 9, "gid-1")[:-3],
    ],
    ids=["relation", "type", "origin", "message-prefix", "message-lsn", "prepare-gid", "rollback-gid"],
)
def test_messages_cut_inside_a_string_raise_decoding_error(data: bytes) -> None:
    assert_decoding_error(PgOutputParser(proto_version=3), Lsn(0xABC), data)


@pytest.mark.parametrize(
    "data",
    [
        insert(ORDERS, ["1", "text", None, "eu"])[:-1],
        update(ORDERS, ["1", "b", "2", "eu"], ["1", None, None, "eu"], b"K")[:-1],
        delete(ORDERS, ["1", "x", None, "eu"], b"O")[:-2],
    ],
    ids=["insert", "update", "delete"],
)
def test_a_text_value_cut_short_raises_decoding_error(data: bytes) -> None:
    assert_decoding_error(parser_with_orders(3), Lsn(0xABD), data)


def test_empty_and_unknown_messages() -> None:
    parser = PgOutputParser(proto_version=4)
    assert_decoding_error(parser, Lsn(1), b"")
    assert_decoding_error(parser, Lsn(2), b"Z\x00\x00", "unknown message type 'Z'")


def test_a_change_before_its_relation() -> None:
    assert_decoding_error(
        PgOutputParser(proto_version=1),
        Lsn(0x77),
        insert(ORDERS, ["1", None, None, None]),
        f"change for relation {ORDERS} before its Relation message",
    )
    assert_decoding_error(PgOutputParser(proto_version=1), Lsn(0x78), truncate([ORDERS]), "before its Relation message")


def test_a_tuple_with_the_wrong_column_count() -> None:
    assert_decoding_error(
        parser_with_orders(1),
        Lsn(0x79),
        insert(ORDERS, ["1", None]),
        "tuple of 2 columns for public.orders, which has 4",
    )


def test_an_unknown_tuple_data_kind() -> None:
    data = b"I" + struct.pack(">I", ORDERS) + b"N" + struct.pack(">h", 4) + b"x" + b"nnn"
    assert_decoding_error(parser_with_orders(1), Lsn(0x7A), data, "unknown tuple data kind 'x'")


def test_binary_tuple_data_is_refused_with_advice() -> None:
    error = assert_decoding_error(
        parser_with_orders(1), Lsn(0x7B), insert(ORDERS, [struct.pack(">i", 1), None, None, None])
    )
    assert "binary" in str(error) and "text mode" in str(error)


def test_a_missing_new_tuple_marker() -> None:
    data = bytearray(insert(ORDERS, ["1", None, None, None]))
    data[5] = ord("X")
    assert_decoding_error(parser_with_orders(1), Lsn(0x7C), bytes(data), "expected 'N' in Insert")
    assert_decoding_error(
        parser_with_orders(1), Lsn(0x7D), delete(ORDERS, ["1", None, None, "eu"], b"N"), "expected 'K' or 'O'"
    )


def test_message_content_shorter_than_its_length() -> None:
    data = message("p", b"12345", True, 1)[:-2]
    assert_decoding_error(PgOutputParser(proto_version=1), Lsn(0x7E), data, "shorter than its length")


def test_an_unknown_type_oid_without_type_message() -> None:
    assert_decoding_error(
        PgOutputParser(proto_version=1), Lsn(0x7F), relation(1, "public", "t", [(0, "x", 99999, -1)]), "type OID 99999"
    )


def test_text_that_is_not_in_the_database_encoding() -> None:
    assert_decoding_error(
        parser_with_orders(1),
        Lsn(0x80),
        b"I"
        + struct.pack(">I", ORDERS)
        + b"N"
        + struct.pack(">h", 4)
        + b"t"
        + struct.pack(">i", 2)
        + b"\xff\xfe"
        + b"nnn",
    )
