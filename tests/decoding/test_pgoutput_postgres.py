"""pgoutput messages produced by real SQL on the test cluster, parsed and assembled."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest

from airflow_provider_pgdecode.decoding.assembler import TransactionAssembler
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
from airflow_provider_pgdecode.decoding.pgoutput import PgOutputParser, max_proto_version, pgoutput_options
from airflow_provider_pgdecode.errors import DecodingError
from airflow_provider_pgdecode.postgres.slot import SlotClient

pytestmark = pytest.mark.postgres

PUBLICATION = "pgdecode_test_pub"


def events_of(conn: psycopg.Connection, slot: str, two_phase: bool | None = None) -> list:
    """The slot's events; two-phase decoding wherever pgoutput has it unless ``two_phase`` says."""
    client = SlotClient(conn)
    version = client.server_version_num()
    two_phase = decodes_two_phase(conn) if two_phase is None else two_phase
    proto = max_proto_version(version)
    options = pgoutput_options(PUBLICATION, version, two_phase=two_phase)
    parser = PgOutputParser(proto, client.server_encoding())
    out = []
    for lsn, xid, data in client.peek(slot, client.current_flush_lsn(), options):
        event = parser.parse(lsn, xid, data)
        if event is not None:
            out.append(event)
    return out


def decodes_two_phase(conn: psycopg.Connection) -> bool:
    """pgoutput decodes prepared transactions from PostgreSQL 15 (protocol 3); 14 sends them at
    COMMIT PREPARED as plain transactions, and never a rolled-back one."""
    return SlotClient(conn).server_version_num() >= 150000


@pytest.fixture()
def pgoutput_slot(pg_conn: psycopg.Connection, slot_name: str) -> Iterator[str]:
    pg_conn.execute(
        "drop table if exists po_main, po_full, po_toast, po_other, po_stream cascade;"
        f" drop publication if exists {PUBLICATION}"
    )
    pg_conn.execute(
        "create table po_main (id int primary key, label text, amount numeric(8,2), tags text[], ok boolean);"
        " create table po_full (id int, note text); alter table po_full replica identity full;"
        " create table po_toast (id int primary key, big text, small int);"
        " alter table po_toast alter column big set storage external;"
        " create table po_other (id int primary key);"
        " create table po_stream (id int primary key, pad text);"
        # Not FOR ALL TABLES: the test database is shared, and a publication stops keyless tables
        # elsewhere from taking UPDATE and DELETE.
        f" create publication {PUBLICATION} for table po_main, po_full, po_toast, po_other, po_stream"
    )
    pg_conn.execute("insert into po_toast values (1, repeat('t', 5000), 1)")
    pg_conn.execute("insert into po_full values (1, 'n1')")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (slot_name,))
    yield slot_name
    pg_conn.execute(f"drop publication {PUBLICATION}")


@pytest.mark.pg_matrix
def test_every_message_kind(pg_conn, pgoutput_slot) -> None:
    c = pg_conn
    c.execute("insert into po_main values (1, 'it''s', 1.5, '{a,\"b c\",NULL}', true)")
    c.execute("update po_main set label = 'two' where id = 1")
    c.execute("update po_main set id = 2 where id = 1")
    c.execute("delete from po_main where id = 2")
    c.execute("update po_full set note = 'n2'")
    c.execute("delete from po_full")
    c.execute("update po_toast set small = 2")
    c.execute("insert into po_other values (1)")
    c.execute("truncate po_other, po_main restart identity cascade")
    c.execute("begin; select pg_logical_emit_message(true, 'app', 'in tx'); insert into po_other values (5); commit")
    c.execute("select pg_logical_emit_message(false, 'hb', '\\xff00'::bytea)")
    c.execute("begin; insert into po_other values (2); prepare transaction 'po''1'")
    c.execute("commit prepared 'po''1'")
    c.execute("begin; insert into po_other values (3); prepare transaction 'po2'")
    c.execute("rollback prepared 'po2'")
    c.execute("select pg_sleep(0.3)")  # the WAL writer flushes the non-transactional message

    two_phase = decodes_two_phase(c)
    events = events_of(c, pgoutput_slot, two_phase=two_phase)
    kinds = Counter(type(e).__name__ for e in events)
    if two_phase:
        assert kinds["Prepare"] == 2 and kinds["CommitPrepared"] == 1 and kinds["RollbackPrepared"] == 1
        assert kinds["Begin"] == kinds["Commit"] + 2
    else:
        assert kinds["Prepare"] == kinds["CommitPrepared"] == kinds["RollbackPrepared"] == 0
        assert kinds["Begin"] == kinds["Commit"]
    changes = [e for e in events if isinstance(e, Change)]
    main = [e for e in changes if e.table == "po_main"]
    assert main[0].new.as_dict() == {"id": "1", "label": "it's", "amount": "1.50", "tags": '{a,"b c",NULL}', "ok": "t"}
    assert main[0].new.types == ("integer", "text", "numeric", "text[]", "boolean")
    assert main[1].old is None  # key unchanged: no old tuple
    assert main[2].old.as_dict() == {"id": "1"}  # K tuple: key columns only
    assert main[3].operation is Operation.DELETE and main[3].old.as_dict() == {"id": "2"}
    full = [e for e in changes if e.table == "po_full"]
    assert full[0].old.as_dict() == {"id": "1", "note": "n1"}  # O tuple: the whole old row
    assert full[1].old.as_dict() == {"id": "1", "note": "n2"}
    toast = next(e for e in changes if e.table == "po_toast")
    assert toast.new.values == ("1", UNCHANGED_TOAST, "2")
    (truncate,) = [e for e in events if isinstance(e, Truncate)]
    assert set(truncate.relations) == {("public", "po_other"), ("public", "po_main")}
    assert truncate.cascade and truncate.restart_identity
    messages = [e for e in events if isinstance(e, Message)]
    assert [(m.transactional, m.prefix, m.content) for m in messages] == [
        (True, "app", b"in tx"),
        (False, "hb", b"\xff\x00"),
    ]
    assert [e.gid for e in events if isinstance(e, (Prepare, CommitPrepared, RollbackPrepared))] == (
        ["po'1", "po'1", "po2", "po2"] if two_phase else []
    )
    assert all(e.commit_time is not None for e in events if isinstance(e, Commit))

    assembler = TransactionAssembler()
    out = list(assembler.feed_all(events))
    assembler.finish()
    other = [
        i.new.as_dict()["id"]
        for t in out
        if not isinstance(t, Message)
        for i in t
        if isinstance(i, Change) and i.table == "po_other"
    ]
    assert other == ["1", "5", "2"]  # the rolled-back prepared insert (3) never comes out


@pytest.mark.pg_matrix
def test_streamed_transaction_with_rolled_back_savepoint(pg_conn, pgoutput_slot) -> None:
    c = pg_conn
    with c.transaction():
        c.execute("insert into po_stream select g, repeat('a', 200) from generate_series(1, 1000) g")
        with pytest.raises(psycopg.errors.UniqueViolation), c.transaction():
            c.execute("insert into po_stream select g, repeat('b', 200) from generate_series(5001, 6000) g")
            c.execute("insert into po_stream values (1, 'dup')")
        c.execute("insert into po_stream select g, repeat('c', 200) from generate_series(2001, 2500) g")
    events = events_of(c, pgoutput_slot, two_phase=False)
    kinds = {type(e) for e in events}
    assert {StreamStart, StreamStop, StreamAbort, StreamCommit} <= kinds
    assert any(e.subxid != e.xid for e in events if isinstance(e, StreamAbort))
    (txn,) = [t for t in TransactionAssembler(memory_items=300).feed_all(events) if not isinstance(t, Message)]
    ids = [int(i.new.as_dict()["id"]) for i in txn]
    assert ids == list(range(1, 1001)) + list(range(2001, 2501))
    assert sorted(r[0] for r in c.execute("select id from po_stream")) == ids


@pytest.mark.pg_matrix(since=16)
def test_parallel_streaming_stream_abort_says_where_and_when(pg_conn, pgoutput_slot) -> None:
    # pgdecode reads with streaming=on; a slot read with parallel (protocol 4, 16+) gets the
    # abort's LSN and time too, which the parser must take rather than misread.
    c = pg_conn
    with c.transaction():
        c.execute("insert into po_stream select g, repeat('a', 200) from generate_series(1, 600) g")
        with pytest.raises(psycopg.errors.UniqueViolation), c.transaction():
            c.execute("insert into po_stream select g, repeat('b', 200) from generate_series(5001, 5600) g")
            c.execute("insert into po_stream values (1, 'dup')")
    client = SlotClient(c)
    version = client.server_version_num()
    options = [
        ("streaming", "parallel") if k == "streaming" else (k, v) for k, v in pgoutput_options(PUBLICATION, version)
    ]
    parser = PgOutputParser(max_proto_version(version), client.server_encoding())
    events = [
        parser.parse(lsn, xid, data)
        for lsn, xid, data in client.peek(pgoutput_slot, client.current_flush_lsn(), options)
    ]
    (abort,) = [e for e in events if isinstance(e, StreamAbort)]
    assert abort.subxid != abort.xid and abort.abort_lsn is not None and abort.abort_time is not None
    stream = [e.lsn for e in events if isinstance(e, (StreamStart, StreamStop, Change))]
    assert min(stream) < abort.abort_lsn <= abort.lsn
    assert abs(abort.abort_time - c.execute("select now()").fetchone()[0]).total_seconds() < 3600


@pytest.mark.pg_matrix
def test_streamed_prepared_transaction_committed_later(pg_conn, pgoutput_slot) -> None:
    c = pg_conn
    if not decodes_two_phase(c):
        pytest.skip("pgoutput decodes prepared transactions from PostgreSQL 15 (protocol 3)")
    c.execute(
        "begin; insert into po_stream select g, repeat('p', 200) from generate_series(10001, 11000) g;"
        " prepare transaction 'streamed_2pc'"
    )
    first = TransactionAssembler()
    events = events_of(c, pgoutput_slot)
    assert any(isinstance(e, StreamPrepare) for e in events)
    assert list(first.feed_all(events)) == []
    (pending,) = first.pending()
    assert pending.gid == "streamed_2pc" and len(pending.items) == 1000
    c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (pgoutput_slot, str(first.safe_lsn)))
    c.execute("commit prepared 'streamed_2pc'")
    second = TransactionAssembler(first.pending())
    (txn,) = second.feed_all(events_of(c, pgoutput_slot))
    assert txn.gid == "streamed_2pc" and len(txn) == 1000


@pytest.mark.pg_matrix
def test_origin_is_kept_on_the_transaction(pg_conn, pgoutput_slot) -> None:
    c = pg_conn
    c.execute(
        "select pg_replication_origin_create('upstream_a') where not exists"
        " (select 1 from pg_replication_origin where roname = 'upstream_a')"
    )
    c.execute("select pg_replication_origin_session_setup('upstream_a')")
    try:
        c.execute(
            "begin; select pg_replication_origin_xact_setup('0/AB', now()); insert into po_other values (42); commit"
        )
    finally:
        c.execute("select pg_replication_origin_session_reset()")
    events = events_of(c, pgoutput_slot)
    (origin,) = [e for e in events if isinstance(e, Origin)]
    assert origin.name == "upstream_a" and str(origin.origin_lsn) == "0/AB"
    (txn,) = TransactionAssembler().feed_all(events)
    assert txn.origin == "upstream_a"


def test_malformed_messages_are_reported() -> None:
    parser = PgOutputParser()
    with pytest.raises(DecodingError, match="before its Relation message"):
        parser.parse(0, 1, b"I\x00\x00\x00\x07N\x00\x00")
    with pytest.raises(DecodingError, match="unknown message type 'Z'"):
        parser.parse(0, 1, b"Z")
    with pytest.raises(DecodingError, match="truncated"):
        parser.parse(0, 1, b"B\x00\x00")
    assert isinstance(parser.parse(0, 1, b"B" + bytes(20)), Begin)


def test_options_follow_the_server_version() -> None:
    assert pgoutput_options("p", 150000, two_phase=True) == [
        ("proto_version", "3"),
        ("publication_names", "p"),
        ("messages", "true"),
        ("streaming", "true"),
        ("two_phase", "true"),
    ]
    assert ("streaming", "on") in pgoutput_options("p", 160000)
    assert pgoutput_options("p", 130000) == [("proto_version", "1"), ("publication_names", "p")]
    with pytest.raises(ValueError, match="two-phase decoding with pgoutput needs protocol 3"):
        pgoutput_options("p", 140000, two_phase=True)
    with pytest.raises(ValueError, match="origin option needs PostgreSQL 16"):
        pgoutput_options("p", 150000, origin="none")


def test_messages_whose_text_looks_like_a_test_decoding_header_round_trip(pg_conn, pgoutput_slot) -> None:
    # pgoutput carries lengths, so the same contents that trouble a text split come back exact here too.
    pairs = [("p", b"x, sz: 3 content:abc"), ("p, sz: 1 content:x", b"tail")]
    for prefix, content in pairs:
        pg_conn.execute("select pg_logical_emit_message(true, %s, %s::bytea)", (prefix, content))
    messages = [e for e in events_of(pg_conn, pgoutput_slot) if isinstance(e, Message)]
    assert [(m.prefix, m.content) for m in messages] == pairs
