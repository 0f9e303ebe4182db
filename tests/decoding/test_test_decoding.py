"""The test_decoding scanner on lines taken verbatim from PostgreSQL's output (reference §1)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

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
    StreamAbort,
    StreamCommit,
    StreamDataWithheld,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import DecodingError

LSN = Lsn.parse("0/16B6C50")


def parse(data: bytes | str, xid: int | None = None):
    return TestDecodingParser().parse(LSN, xid, data if isinstance(data, bytes) else data.encode())


ODD_INSERT = (
    'table public."Odd Tbl": INSERT: id[integer]:1 "Col A"[text]:\'it\'\'s a "test"\' v[character varying]:\'line1\n'
    "line2' n[numeric]:1.50 f[double precision]:NaN b[boolean]:true bits[bit]:B'1010' vb[bit varying]:B'101' "
    'arr[text[]]:\'{"a b","c,d","e\\"f",NULL,"null"}\' iarr[integer[]]:\'{1,2}\' '
    "ts[timestamp with time zone]:'2024-01-02 03:04:05+00' j[jsonb]:'{\"k\": \"v''x\"}' by[bytea]:'\\x00ff' "
    'nulltext[text]:null "select"[integer]:7'
)


def test_insert_with_every_value_form() -> None:
    event = parse(ODD_INSERT)
    assert isinstance(event, Change)
    assert (event.operation, event.schema, event.table, event.old) == (Operation.INSERT, "public", "Odd Tbl", None)
    row = event.new.as_dict()
    assert row == {
        "id": "1",
        "Col A": 'it\'s a "test"',
        "v": "line1\nline2",
        "n": "1.50",
        "f": "NaN",
        "b": "true",
        "bits": "1010",
        "vb": "101",
        "arr": '{"a b","c,d","e\\"f",NULL,"null"}',
        "iarr": "{1,2}",
        "ts": "2024-01-02 03:04:05+00",
        "j": '{"k": "v\'x"}',
        "by": "\\x00ff",
        "nulltext": None,
        "select": "7",
    }
    assert event.new.types[event.new.names.index("ts")] == "timestamp with time zone"
    assert event.new.types[event.new.names.index("arr")] == "text[]"


def test_quoted_null_is_text_and_bare_null_is_null() -> None:
    event = parse("table public.t: INSERT: a[text]:'null' b[text]:null c[text]:'unchanged-toast-datum'")
    assert event.new.values == ("null", None, "unchanged-toast-datum")


def test_update_with_changed_key_has_old_key_and_new_tuple() -> None:
    event = parse(
        'table public."Odd Tbl": UPDATE: old-key: id[integer]:1 new-tuple: id[integer]:10 "Col A"[text]:\'upd\''
    )
    assert event.operation is Operation.UPDATE
    assert event.old.as_dict() == {"id": "1"}
    assert event.new.as_dict() == {"id": "10", "Col A": "upd"}


def test_update_old_key_under_replica_identity_full_omits_null_columns() -> None:
    event = parse(
        "table public.t: UPDATE: old-key: id[integer]:10 a[text]:'x y' new-tuple: id[integer]:10 a[text]:'z' n[text]:null"
    )
    assert event.old.names == ("id", "a")
    assert event.new.as_dict() == {"id": "10", "a": "z", "n": None}


def test_value_that_looks_like_markers_and_lines() -> None:
    tricky = "x new-tuple: id[integer]:5 '' table public.t: INSERT: a[text]:''b''"
    quoted = tricky.replace("'", "''")
    event = parse(f"table public.t: UPDATE: old-key: a[text]:'{quoted}' new-tuple: a[text]:'{quoted}' b[integer]:2")
    assert event.old.values == (tricky,)
    assert event.new.values == (tricky, "2")


def test_unchanged_toast_datum() -> None:
    event = parse("table public.toasty: UPDATE: id[integer]:1 big[text]:unchanged-toast-datum small[integer]:2")
    assert event.new.values == ("1", UNCHANGED_TOAST, "2")
    assert event.new.unchanged_toast_columns() == ("big",)


def test_delete_forms() -> None:
    keyed = parse('table public."Odd Tbl": DELETE: id[integer]:2')
    assert keyed.operation is Operation.DELETE and keyed.old.as_dict() == {"id": "2"} and keyed.new is None
    no_data = parse("table public.nokey: DELETE: (no-tuple-data)")
    assert no_data.has_tuple_data is False and no_data.old is None


def test_quoted_schema_table_and_column_with_doubled_quotes() -> None:
    event = parse('table "My Schema"."we""ird.na:me": INSERT: "c ""q"" [x]"[integer]:1')
    assert (event.schema, event.table) == ("My Schema", 'we"ird.na:me')
    assert event.new.names == ('c "q" [x]',)


def test_type_names_with_spaces_brackets_and_quotes() -> None:
    event = parse(
        "table public.t: INSERT: a[timestamp without time zone[]]:'{\"2024-01-01 00:00:00\"}' "
        "b[character varying]:'v' c[\"My Type\"]:'e1' d[myschema.\"Odd]:Type\"]:'e2'"
    )
    assert event.new.types == (
        "timestamp without time zone[]",
        "character varying",
        '"My Type"',
        'myschema."Odd]:Type"',
    )
    assert event.new.values[2:] == ("e1", "e2")


def test_numbers_infinities_and_booleans_stay_text() -> None:
    event = parse(
        "table public.t: INSERT: a[real]:Infinity b[double precision]:-Infinity c[numeric]:NaN "
        "d[bigint]:-9223372036854775808 e[double precision]:1.5e+20 f[boolean]:false"
    )
    assert event.new.values == ("Infinity", "-Infinity", "NaN", "-9223372036854775808", "1.5e+20", "false")


def test_raw_backslashes_and_newlines_in_values() -> None:
    event = parse("table public.t: INSERT: a[text]:'C:\\new\\table\r\n\tend\\' b[integer]:1")
    assert event.new.values == ("C:\\new\\table\r\n\tend\\", "1")


def test_truncate_lines() -> None:
    one = parse("table public.nokey: TRUNCATE: (no-flags)")
    assert isinstance(one, Truncate)
    assert (one.relations, one.cascade, one.restart_identity) == ((("public", "nokey"),), False, False)
    many = parse('table public.nokey, public."Odd Tbl": TRUNCATE: restart_seqs cascade')
    assert many.relations == (("public", "nokey"), ("public", "Odd Tbl"))
    assert many.cascade and many.restart_identity


def test_begin_and_commit_with_and_without_xids_and_timestamps() -> None:
    assert parse("BEGIN 725") == Begin(LSN, 725)
    assert parse("BEGIN") == Begin(LSN, None)
    assert parse("BEGIN", xid=9) == Begin(LSN, 9)
    commit = parse("COMMIT 725 (at 2026-11-22 09:43:00.601424+00)")
    assert commit == Commit(LSN, 725, datetime(2026, 11, 22, 9, 43, 0, 601424, tzinfo=UTC))
    assert parse("COMMIT") == Commit(LSN, None, None)
    assert parse("COMMIT (at 2026-11-22 04:44:45.268943-05)").commit_time.utcoffset().total_seconds() == -5 * 3600


def test_two_phase_lines_with_quoted_gids() -> None:
    prepare = parse("PREPARE TRANSACTION 'gid''1', txid 747 (at 2026-11-22 09:43:00.60586+00)")
    assert isinstance(prepare, Prepare)
    assert (prepare.gid, prepare.xid, prepare.prepare_time.microsecond) == ("gid'1", 747, 605860)
    assert parse("PREPARE TRANSACTION 'g2'") == Prepare(LSN, None, "g2", None)
    assert parse("COMMIT PREPARED 'test_prepared1', txid 529") == CommitPrepared(LSN, 529, "test_prepared1", None)
    rollback = parse("ROLLBACK PREPARED 'a, txid 5 (at x)', txid 530 (at 2026-01-01 00:00:00+00)")
    assert isinstance(rollback, RollbackPrepared)
    assert (rollback.gid, rollback.xid) == ("a, txid 5 (at x)", 530)


def test_message_content_is_measured_in_bytes() -> None:
    content = "non-tx\nmsg é".encode()
    event = parse(b"message: transactional: 0 prefix: pfx, sz: %d content:" % len(content) + content)
    assert event == Message(LSN, None, False, "pfx", content)
    # a prefix and content that contain the header's own separators
    tricky = b"message: transactional: 1 prefix: a, sz: 3 content:, sz: 5 content:x, sz"
    event = parse(tricky)
    assert (event.transactional, event.prefix, event.content) == (True, "a, sz: 3 content:", b"x, sz")


def test_message_with_invalid_utf8_content() -> None:
    event = parse(b"message: transactional: 1 prefix: bin, sz: 3 content:\xff\x00\xfe")
    assert event.content == b"\xff\x00\xfe"


def test_streaming_lines() -> None:
    assert parse("opening a streamed block for transaction TXN 755") == StreamStart(LSN, 755)
    assert parse("closing a streamed block for transaction") == StreamStop(LSN, None)
    assert parse("aborting streamed (sub)transaction TXN 756", xid=755) == StreamAbort(LSN, 755, 756)
    assert parse("committing streamed transaction TXN 9 (at 2026-11-22 09:43:00+00)").xid == 9
    assert isinstance(parse("committing streamed transaction"), StreamCommit)
    assert parse("preparing streamed transaction TXN 'sp1', txid 755") == StreamPrepare(LSN, 755, "sp1", None)
    assert parse("preparing streamed transaction 'test1'") == StreamPrepare(LSN, None, "test1", None)
    assert isinstance(parse("streaming change for TXN 755"), StreamDataWithheld)
    assert isinstance(parse("streaming truncate for transaction"), StreamDataWithheld)
    assert isinstance(parse("streaming message: transactional: 1 prefix: test, sz: 50"), StreamDataWithheld)
    streamed = parse("streaming message: transactional: 0 prefix: test, sz: 2 content:hi")
    assert streamed == Message(LSN, None, False, "test", b"hi")


@pytest.mark.parametrize(
    "line",
    [
        "table public.t INSERT: a[integer]:1",
        "table public.t: INSERT: a[integer:1",
        "table public.t: INSERT: a[text]:'unterminated",
        "table public.t: MERGE: a[integer]:1",
        "table public.t: INSERT: a[integer]:",
        "table public: INSERT: a[integer]:1",
        "table public.t: UPDATE: old-key: a[integer]:1",
        "table public.t: TRUNCATE: sideways",
        "PREPARE TRANSACTION gid",
        "COMMIT abc",
        "something else entirely",
        "message: transactional: 1 prefix: p, sz: 9 content:short",
    ],
)
def test_malformed_lines_raise_with_the_row(line: str) -> None:
    with pytest.raises(DecodingError, match="malformed test_decoding row") as info:
        parse(line)
    assert "0/16B6C50" in str(info.value)


def test_text_rows_work_too() -> None:
    parser = TestDecodingParser()
    assert parser.parse(LSN, 1, "BEGIN 1") == Begin(LSN, 1)
    assert parser.parse(LSN, 1, "message: transactional: 1 prefix: p, sz: 2 content:é").content == "é".encode()


# --- property: render lines the way test_decoding.c does, parse them back ----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYWORDS = {"select", "table", "from", "user", "order"}


def quote_identifier(name: str) -> str:
    """PostgreSQL's quote_identifier: bare only for [a-z_][a-z0-9_]* that is not a keyword."""
    safe = (
        bool(name)
        and (name[0].islower() and name[0].isascii() or name[0] == "_")
        and all((c.isascii() and (c.islower() or c.isdigit())) or c == "_" for c in name)
    )
    if safe and name not in KEYWORDS:
        return name
    return '"' + name.replace('"', '""') + '"'


def render_value(type_name: str, value: object) -> str:
    if value is None:
        return "null"
    if value is UNCHANGED_TOAST:
        return "unchanged-toast-datum"
    if type_name in ("integer", "double precision", "numeric"):
        return str(value)
    if type_name == "boolean":
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


NAMES = st.one_of(
    st.sampled_from(["id", "a_1", "select", "Col A", 'q"uote', "new-tuple", "old-key", "x[1]", "é", "_x"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=8),
)
TEXTS = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30
) | st.sampled_from(["null", "'", "''", " new-tuple: a[text]:'x'", "unchanged-toast-datum", "\\", "\n"])
COLUMNS = st.lists(
    st.tuples(
        NAMES,
        st.sampled_from(["integer", "text", "boolean", "text[]", "character varying", "double precision"]),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda c: c[0],
)


@st.composite
def rows(draw):
    columns = draw(COLUMNS)
    values = []
    for _, type_name in columns:
        if type_name == "integer":
            values.append(draw(st.none() | st.integers(-(2**31), 2**31 - 1).map(str)))
        elif type_name == "double precision":
            values.append(draw(st.none() | st.sampled_from(["NaN", "Infinity", "-Infinity", "1.5e+20", "0.1"])))
        elif type_name == "boolean":
            values.append(draw(st.none() | st.sampled_from(["true", "false"])))
        elif type_name == "text":
            values.append(draw(st.none() | TEXTS | st.just(UNCHANGED_TOAST)))
        else:
            values.append(draw(st.none() | TEXTS))
    return columns, values


def render_tuple(columns, values) -> str:
    return "".join(f" {quote_identifier(n)}[{t}]:{render_value(t, v)}" for (n, t), v in zip(columns, values))


@settings(max_examples=300, deadline=None)
@given(st.lists(rows(), min_size=1, max_size=4), st.sampled_from(["t", "My Table", 'we"ird']))
def test_rendered_lines_parse_back_exactly(batch, table: str) -> None:
    shared = TestDecodingParser()  # keeps column layouts: exercises the fast path
    for columns, values in batch * 2:
        line = f"table public.{quote_identifier(table)}: INSERT:{render_tuple(columns, values)}"
        for parser in (shared, TestDecodingParser()):
            event = parser.parse(LSN, 1, line.encode())
            assert event.table == table
            assert event.new.names == tuple(n for n, _ in columns)
            assert event.new.types == tuple(t for _, t in columns)
            assert event.new.values == tuple(values)
        key = [(c, v) for c, v in zip(columns, values) if v is not None and v is not UNCHANGED_TOAST][:2]
        if key:
            old = render_tuple([c for c, _ in key], [v for _, v in key])
            update = f"table public.{quote_identifier(table)}: UPDATE: old-key:{old} new-tuple:{render_tuple(columns, values)}"
            event = shared.parse(LSN, 1, update.encode())
            assert event.old.values == tuple(v for _, v in key)
            assert event.new.values == tuple(values)
