"""Every test_decoding line kind, produced by real SQL on the test cluster, parsed."""

from __future__ import annotations

from collections import Counter

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
    Prepare,
    RollbackPrepared,
    StreamCommit,
    StreamDataWithheld,
    StreamStart,
    StreamStop,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import AssemblyError
from airflow_provider_pgdecode.postgres.slot import SlotClient

pytestmark = pytest.mark.postgres


def peek_events(conn: psycopg.Connection, slot: str, **options: str) -> list:
    client = SlotClient(conn)
    ceiling = client.current_flush_lsn()
    parser = TestDecodingParser(client.server_encoding())
    return [parser.parse(lsn, xid, data) for lsn, xid, data in client.peek(slot, ceiling, list(options.items()))]


@pytest.fixture()
def workload(pg_conn: psycopg.Connection, slot_name: str) -> str:
    c = pg_conn
    c.execute('drop table if exists "Odd Tbl", nokey, fullri, toasty cascade')
    c.execute(
        """create table "Odd Tbl" (id int primary key, "Col A" text, v varchar(20), n numeric(5,2),
           f float8, b bool, bits bit(4), vb varbit(8), arr text[], "select" int, nulltext text)"""
    )
    c.execute("create table nokey (a int, b text)")
    c.execute("create table fullri (id int primary key, t text, n text)")
    c.execute("alter table fullri replica identity full")
    c.execute("create table toasty (id int primary key, big text, small int)")
    c.execute("alter table toasty alter column big set storage external")
    c.execute("insert into toasty values (1, repeat('t', 5000), 1)")
    c.execute("insert into fullri values (1, 'x', null)")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    c.execute(
        """insert into "Odd Tbl" values (1, 'it''s a "test"', e'line1\\nline2', 1.5, 'NaN', true, B'1010',
           B'101', '{"a b","c,d",NULL,"null"}', 7, null)"""
    )
    c.execute("""update "Odd Tbl" set id = 10, "Col A" = 'null' where id = 1""")
    c.execute("""delete from "Odd Tbl" where id = 10""")
    c.execute("insert into nokey values (1, 'x')")
    c.execute("update nokey set b = 'y'")
    c.execute("delete from nokey")
    c.execute("update fullri set t = 'y'")
    c.execute("delete from fullri")
    c.execute("update toasty set small = 2")
    c.execute("truncate nokey")
    c.execute("""truncate nokey, "Odd Tbl" restart identity cascade""")
    c.execute("select pg_logical_emit_message(true, 'pfx', e'tx\\nmsg')")
    c.execute("select pg_logical_emit_message(false, 'pfx, sz: 1', '\\xff00'::bytea)")
    c.execute("begin; insert into nokey values (2, 'p'); prepare transaction 'g''1'")
    c.execute("commit prepared 'g''1'")
    c.execute("begin; insert into nokey values (3, 'r'); prepare transaction 'g2'")
    c.execute("rollback prepared 'g2'")
    # Let the WAL writer flush the non-transactional message before anyone peeks.
    c.execute("select pg_sleep(0.3)")
    return slot_name


@pytest.mark.pg_matrix
def test_every_line_kind_with_xids_and_timestamps(pg_conn, workload) -> None:
    events = peek_events(pg_conn, workload, **{"include-xids": "1", "include-timestamp": "1"})
    kinds = Counter(type(e).__name__ for e in events)
    assert kinds["Prepare"] == 2 and kinds["CommitPrepared"] == 1 and kinds["RollbackPrepared"] == 1
    assert all(e.xid is not None for e in events if isinstance(e, (Begin, Commit, Prepare)))
    assert all(e.commit_time is not None for e in events if isinstance(e, Commit))
    changes = [e for e in events if isinstance(e, Change)]

    insert = changes[0]
    assert (insert.table, insert.operation) == ("Odd Tbl", Operation.INSERT)
    assert insert.new.as_dict() == {
        "id": "1",
        "Col A": 'it\'s a "test"',
        "v": "line1\nline2",
        "n": "1.50",
        "f": "NaN",
        "b": "true",
        "bits": "1010",
        "vb": "101",
        "arr": '{"a b","c,d",NULL,"null"}',
        "select": "7",
        "nulltext": None,
    }
    key_change = changes[1]
    assert key_change.old.as_dict() == {"id": "1"} and key_change.new.as_dict()["Col A"] == "null"
    delete = changes[2]
    assert delete.operation is Operation.DELETE and delete.old.as_dict() == {"id": "10"}

    nokey = [e for e in changes if e.table == "nokey"]
    assert [(e.operation, e.has_tuple_data) for e in nokey[:3]] == [
        (Operation.INSERT, True),
        (Operation.UPDATE, True),
        (Operation.DELETE, False),
    ]
    assert nokey[1].old is None  # no key, no old-key

    full = [e for e in changes if e.table == "fullri"]
    assert full[0].old.as_dict() == {"id": "1", "t": "x"}  # RI FULL: NULL column omitted
    assert full[1].operation is Operation.DELETE and full[1].old.as_dict() == {"id": "1", "t": "y"}

    toast = next(e for e in changes if e.table == "toasty")
    assert toast.new.values == ("1", UNCHANGED_TOAST, "2")

    truncates = [e for e in events if isinstance(e, Truncate)]
    assert [(t.relations, t.cascade, t.restart_identity) for t in truncates] == [
        ((("public", "nokey"),), False, False),
        ((("public", "nokey"), ("public", "Odd Tbl")), True, True),
    ]
    messages = [e for e in events if isinstance(e, Message)]
    assert [(m.transactional, m.prefix, m.content) for m in messages] == [
        (True, "pfx", b"tx\nmsg"),
        (False, "pfx, sz: 1", b"\xff\x00"),
    ]
    prepares = [e for e in events if isinstance(e, Prepare)]
    assert [p.gid for p in prepares] == ["g'1", "g2"]
    assert all(p.prepare_time is not None for p in prepares)
    committed = next(e for e in events if isinstance(e, CommitPrepared))
    assert committed.gid == "g'1" and committed.xid == prepares[0].xid
    rolled_back = next(e for e in events if isinstance(e, RollbackPrepared))
    assert rolled_back.gid == "g2" and rolled_back.xid == prepares[1].xid

    # LSNs: COMMIT rows are record ends, increasing in slot order.
    commits = [e.lsn for e in events if isinstance(e, Commit)]
    assert commits == sorted(commits)

    # The whole stream assembles: the committed prepared insert comes out, the rolled back one not.
    assembler = TransactionAssembler()
    out = list(assembler.feed_all(events))
    assembler.finish()
    staged_nokey = [
        i.new.as_dict()["a"]
        for t in out
        if not isinstance(t, Message)
        for i in t
        if isinstance(i, Change) and i.table == "nokey" and i.new
    ]
    assert staged_nokey == ["1", "1", "2"]


def test_line_kinds_without_xids_and_timestamps(pg_conn, workload) -> None:
    events = peek_events(pg_conn, workload, **{"include-xids": "0", "include-timestamp": "0"})
    assert all(e.commit_time is None for e in events if isinstance(e, Commit))
    assert [e.gid for e in events if isinstance(e, (Prepare, CommitPrepared, RollbackPrepared))] == [
        "g'1",
        "g'1",
        "g2",
        "g2",
    ]
    # The SQL function's xid column still identifies transactions.
    assert all(e.xid is not None for e in events if isinstance(e, (Begin, Commit)))
    assert sum(isinstance(e, Change) for e in events) == 11


@pytest.mark.pg_matrix
def test_streamed_transaction_lines_parse_and_are_refused_clearly(pg_conn, slot_name) -> None:
    pg_conn.execute("create table streamed (id int primary key, pad text)")
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, false)", (slot_name,))
    # Larger than logical_decoding_work_mem (64kB in the test cluster): decoded as a stream.
    pg_conn.execute("insert into streamed select g, repeat('s', 100) from generate_series(1, 3000) g")
    events = peek_events(pg_conn, slot_name, **{"stream-changes": "1"})
    kinds = {type(e) for e in events}
    assert {StreamStart, StreamStop, StreamDataWithheld, StreamCommit} <= kinds
    assert all(e.xid is not None for e in events if isinstance(e, StreamStart))
    with pytest.raises(AssemblyError, match="test_decoding cannot carry streamed transactions"):
        list(TransactionAssembler().feed_all(events))
    # Without stream-changes the same transaction arrives whole.
    whole = peek_events(pg_conn, slot_name)
    assert sum(isinstance(e, Change) for e in whole) == 3000
    assert isinstance(whole[-1], Commit) and whole[-1].lsn > Lsn(0)


def test_gids_with_backslashes_and_quotes_are_read_as_postgresql_printed_them(pg_conn, slot_name) -> None:
    # quote_literal_cstr prints a gid holding a backslash as E'...' with backslashes doubled.
    c = pg_conn
    c.execute("drop table if exists gid_t")
    c.execute("create table gid_t (id int primary key)")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    gids = ["plain", "back\\slash", "it's \\ both", "ends\\"]
    for n, gid in enumerate(gids):
        c.execute("begin")
        c.execute("insert into gid_t values (%s)", (n,))
        c.execute(psycopg.sql.SQL("prepare transaction {}").format(psycopg.sql.Literal(gid)))
        finish = "commit prepared" if n % 2 == 0 else "rollback prepared"
        c.execute(psycopg.sql.SQL(finish + " {}").format(psycopg.sql.Literal(gid)))
    events = peek_events(pg_conn, slot_name)
    assert [e.gid for e in events if isinstance(e, Prepare)] == gids
    assert [e.gid for e in events if isinstance(e, CommitPrepared)] == gids[0::2]
    assert [e.gid for e in events if isinstance(e, RollbackPrepared)] == gids[1::2]


@pytest.mark.parametrize(
    "prefix, content",
    [
        ("p", b"x, sz: 3 content:abc"),  # the content ends like a message header with a size that fits
        ("p", b", sz: 0 content:"),
        ("p, sz: 1 content:x", b"tail"),  # the prefix holds the separator
        ("", b""),
    ],
)
def test_messages_whose_text_looks_like_the_header_round_trip(pg_conn, slot_name, prefix, content) -> None:
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    pg_conn.execute("select pg_logical_emit_message(true, %s, %s::bytea)", (prefix, content))
    messages = [e for e in peek_events(pg_conn, slot_name) if isinstance(e, Message)]
    assert [(m.prefix, m.content) for m in messages] == [(prefix, content)]
