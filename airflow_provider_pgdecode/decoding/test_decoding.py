"""A scanner for the text that PostgreSQL's ``test_decoding`` output plugin prints.

One row of ``pg_logical_slot_peek_binary_changes`` becomes one event. The scanner walks each
line left to right with explicit positions (jumping with ``str.find`` for speed); it uses no
regular expressions, because values may contain anything, including text that looks like a
decoded line. Formats are those of ``contrib/test_decoding/test_decoding.c`` (PostgreSQL 14-18):

- identifiers come from ``quote_identifier`` (double quotes, ``""`` doubled inside);
- a column is `` name[type]:value``; the type is ``format_type_be`` (spaces, ``[]``, no typmod);
- values: bare ``null`` is NULL, bare ``unchanged-toast-datum`` an unchanged TOAST value,
  ``B'0101'`` a bit string, unquoted numbers/booleans, anything else single-quoted with ``''``
  doubled and raw newlines and backslashes;
- message content is raw bytes measured by ``sz``: lines are scanned as bytes so that the
  content is exact whatever it holds.

Its C twin, for the extract's native fast path, is ``capture/csrc/test_decoding.c``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow_provider_pgdecode.decoding.events import (
    UNCHANGED_TOAST,
    Begin,
    Change,
    ColumnValue,
    Commit,
    CommitPrepared,
    Event,
    Message,
    Operation,
    Prepare,
    RollbackPrepared,
    RowImage,
    StreamAbort,
    StreamCommit,
    StreamDataWithheld,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import InvalidText, char_text, has_undecodable
from airflow_provider_pgdecode.errors import DecodingError

#: Options pgdecode passes to test_decoding: xids and timestamps on, empty transactions kept
#: (their COMMIT rows let the slot advance past WAL that decodes to nothing).
DEFAULT_OPTIONS: tuple[tuple[str, str], ...] = (
    ("include-xids", "1"),
    ("include-timestamp", "1"),
    ("skip-empty-xacts", "0"),
)

#: Options of a probe (does the slot hold changes?): empty transactions print nothing, so any
#: row other than BEGIN/COMMIT is a change.
PROBE_OPTIONS: tuple[tuple[str, str], ...] = (
    ("include-xids", "0"),
    ("include-timestamp", "0"),
    ("skip-empty-xacts", "1"),
)

_OPERATIONS = {"INSERT": Operation.INSERT, "UPDATE": Operation.UPDATE, "DELETE": Operation.DELETE}


class _Malformed(Exception):
    """Internal: raised deep in the scanner, turned into a DecodingError with the row."""


def parse_timestamp(text: str) -> datetime:
    """Parse the ``(at ...)`` timestamps test_decoding prints (ISO style, session TimeZone)."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise _Malformed(f"unreadable timestamp {text!r}") from None


def read_identifier(line: str, pos: int, stops: str) -> tuple[str, int]:
    """Read one identifier as quote_identifier printed it; return (name, position after it).

    Unquoted identifiers end at the first character in ``stops``.
    """
    if pos < len(line) and line[pos] == '"':
        parts = []
        start = pos + 1
        while True:
            end = line.find('"', start)
            if end < 0:
                raise _Malformed("unterminated quoted identifier")
            if line.startswith('"', end + 1):
                parts.append(line[start : end + 1])
                start = end + 2
                continue
            parts.append(line[start:end])
            return "".join(parts), end + 1
    end = pos
    n = len(line)
    while end < n and line[end] not in stops:
        end += 1
    if end == pos:
        raise _Malformed(f"expected an identifier at offset {pos}")
    return line[pos:end], end


def read_qualified_name(line: str, pos: int) -> tuple[str, str, int]:
    """Read ``schema.table`` (each part possibly quoted)."""
    schema, pos = read_identifier(line, pos, ".:, ")
    if not line.startswith(".", pos):
        raise _Malformed("expected a schema-qualified table name")
    table, pos = read_identifier(line, pos + 1, ".:, ")
    return schema, table, pos


def read_quoted_literal(line: str, pos: int) -> tuple[str, int]:
    """Read a single-quoted literal starting at ``pos`` (the quote); ``''`` stands for ``'``."""
    start = pos + 1
    doubled = False
    search = start
    while True:
        end = line.find("'", search)
        if end < 0:
            raise _Malformed("unterminated quoted value")
        if line.startswith("'", end + 1):
            doubled = True
            search = end + 2
            continue
        value = line[start:end]
        if doubled:
            value = value.replace("''", "'")
        return value, end + 1


def read_value(line: str, pos: int) -> tuple[ColumnValue, int]:
    """Read one column value starting at ``pos``; return it and the position after it."""
    c = line[pos : pos + 1]
    if c == "'":
        return read_quoted_literal(line, pos)
    if c == "B" and line.startswith("B'", pos):
        end = line.find("'", pos + 2)
        if end < 0:
            raise _Malformed("unterminated bit string")
        return line[pos + 2 : end], end + 1
    end = line.find(" ", pos)
    if end < 0:
        end = len(line)
    token = line[pos:end]
    if token == "null":
        return None, end
    if token == "unchanged-toast-datum":
        return UNCHANGED_TOAST, end
    if not token:
        raise _Malformed(f"missing value at offset {pos}")
    return token, end


def read_tuple(line: str, pos: int, stop_at_new_tuple: bool, markers: list[str] | None = None) -> tuple[RowImage, int]:
    """Read `` name[type]:value`` columns from ``pos`` to the end of the line.

    With ``stop_at_new_tuple`` (an UPDATE's old key), stop before `` new-tuple:``, which
    cannot be a column: a column named so would be printed quoted. ``markers``, when given,
    receives each column's `` name[type]:`` text exactly as printed.
    """
    names: list[str] = []
    types: list[str] = []
    values: list[ColumnValue] = []
    n = len(line)
    find = line.find
    startswith = line.startswith
    while pos < n:
        if line[pos] != " ":
            raise _Malformed(f"expected a space before a column at offset {pos}")
        column_start = pos
        pos += 1
        if stop_at_new_tuple and startswith("new-tuple:", pos):
            return RowImage(tuple(names), tuple(types), tuple(values)), pos - 1
        # column name
        if line[pos] == '"':
            name, pos = read_identifier(line, pos, "[")
        else:
            end = find("[", pos)
            if end < 0:
                raise _Malformed("expected '[' after a column name")
            name = line[pos:end]
            pos = end
        if not startswith("[", pos):
            raise _Malformed(f"expected '[' after column {name!r}")
        # type name: up to the ']' directly followed by ':' ("text[]" has inner brackets;
        # a quoted type name may hold anything, so skip over double quotes)
        end = find("]:", pos)
        quote = find('"', pos, end) if end >= 0 else -1
        if quote >= 0:
            end = _type_end_with_quotes(line, pos + 1)
        if end < 0:
            raise _Malformed(f"unterminated type of column {name!r}")
        type_name = line[pos + 1 : end]
        pos = end + 2
        if markers is not None:
            markers.append(line[column_start:pos])
        # value
        value, pos = read_value(line, pos)
        names.append(name)
        types.append(type_name)
        values.append(value)
    if stop_at_new_tuple:
        raise _Malformed("UPDATE old-key without new-tuple")
    return RowImage(tuple(names), tuple(types), tuple(values)), pos


def _type_end_with_quotes(line: str, pos: int) -> int:
    n = len(line)
    while pos < n:
        c = line[pos]
        if c == '"':
            _, pos = read_identifier(line, pos, "")
            continue
        if c == "]" and line.startswith(":", pos + 1):
            return pos
        pos += 1
    return -1


class _Layout:
    """The columns of the last tuple seen for a table and section: a fast path for the next.

    Lines of one table repeat the same `` name[type]:`` markers; when each marker is found at
    the position where the generic scanner would read it, the result is the same.
    """

    __slots__ = ("markers", "names", "types")

    def __init__(self, image: RowImage, markers: list[str]) -> None:
        self.names = image.names
        self.types = image.types
        self.markers = tuple((marker, len(marker)) for marker in markers)


def _read_with_layout(line: str, pos: int, layout: _Layout, stop_at_new_tuple: bool) -> tuple[RowImage, int] | None:
    values: list[ColumnValue] = []
    append = values.append
    startswith = line.startswith
    n = len(line)
    for marker, length in layout.markers:
        if not startswith(marker, pos):
            return None
        value, pos = read_value(line, pos + length)
        append(value)
    if stop_at_new_tuple:
        if not startswith(" new-tuple:", pos):
            return None
    elif pos != n:
        return None
    return RowImage(layout.names, layout.types, tuple(values)), pos


def _read_tuple_cached(
    line: str, pos: int, stop_at_new_tuple: bool, layouts: dict[Any, _Layout], key: Any
) -> tuple[RowImage, int]:
    layout = layouts.get(key)
    if layout is not None:
        found = _read_with_layout(line, pos, layout, stop_at_new_tuple)
        if found is not None:
            return found
    markers: list[str] = []
    image, end = read_tuple(line, pos, stop_at_new_tuple, markers)
    if image.names:
        layouts[key] = _Layout(image, markers)
    return image, end


def _parse_change(line: str, lsn: Lsn, xid: int | None, layouts: dict[Any, Any] | None = None) -> Change | Truncate:
    # "table " qualname ": " OP ":" ...
    if layouts is None:
        layouts = {}
    colon = line.find(": ", 6)
    head = line[6:colon] if colon > 0 else ""
    names = layouts.get(head) if head else None
    if names is not None:
        schema, table = names
        pos = colon
    else:
        schema, table, pos = read_qualified_name(line, 6)
        if line.startswith(", ", pos):
            return _parse_truncate(line, lsn, xid, [(schema, table)], pos)
        if pos == colon and '"' not in head:
            layouts[head] = (schema, table)
    if not line.startswith(": ", pos):
        raise _Malformed("expected ': ' after the table name")
    pos += 2
    colon = line.find(":", pos)
    word = line[pos:colon]
    if word == "TRUNCATE":
        return _parse_truncate(line, lsn, xid, [(schema, table)], pos - 2)
    operation = _OPERATIONS.get(word)
    if operation is None:
        raise _Malformed(f"unknown change kind {word!r}")
    pos = colon + 1
    if line.startswith(" (no-tuple-data)", pos) and pos + 16 == len(line):
        return Change(lsn, xid, operation, schema, table, None, None, False)
    if operation is Operation.INSERT:
        new, _ = _read_tuple_cached(line, pos, False, layouts, (schema, table, "new"))
        return Change(lsn, xid, operation, schema, table, None, new)
    if operation is Operation.DELETE:
        deleted, _ = _read_tuple_cached(line, pos, False, layouts, (schema, table, "old"))
        return Change(lsn, xid, operation, schema, table, deleted, None)
    old: RowImage | None = None
    if line.startswith(" old-key:", pos):
        old, pos = _read_tuple_cached(line, pos + 9, True, layouts, (schema, table, "old"))
        pos += 11  # " new-tuple:"
        if line.startswith(" (no-tuple-data)", pos) and pos + 16 == len(line):
            return Change(lsn, xid, operation, schema, table, old, None, False)
    new, _ = _read_tuple_cached(line, pos, False, layouts, (schema, table, "new"))
    return Change(lsn, xid, operation, schema, table, old, new)


def _parse_truncate(line: str, lsn: Lsn, xid: int | None, relations: list[tuple[str, str]], pos: int) -> Truncate:
    while line.startswith(", ", pos):
        schema, table, pos = read_qualified_name(line, pos + 2)
        relations.append((schema, table))
    if not line.startswith(": TRUNCATE:", pos):
        raise _Malformed("expected ': TRUNCATE:' after the table list")
    flags = line[pos + 11 :].split()
    if flags == ["(no-flags)"]:
        flags = []
    unknown = set(flags) - {"restart_seqs", "cascade"}
    if unknown:
        raise _Malformed(f"unknown TRUNCATE flags {sorted(unknown)}")
    return Truncate(lsn, xid, tuple(relations), "cascade" in flags, "restart_seqs" in flags)


def _split_at_time(rest: str) -> tuple[str, datetime | None]:
    """Split `` (at 2026-11-22 09:43:00.6+00)`` off the end of a line."""
    if rest.endswith(")"):
        at = rest.rfind(" (at ")
        if at >= 0:
            return rest[:at], parse_timestamp(rest[at + 5 : -1])
    return rest, None


def _parse_xid_suffix(rest: str) -> int | None:
    rest = rest.strip()
    if not rest:
        return None
    if not rest.isdigit():
        raise _Malformed(f"expected a transaction id, got {rest!r}")
    return int(rest)


def _read_escaped_literal(line: str, pos: int) -> tuple[str, int]:
    """Read ``E'...'`` starting at ``pos`` (the ``E``): quote_literal_cstr's form of a text holding a
    backslash, with each backslash and each quote doubled."""
    out: list[str] = []
    i = pos + 2
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            out.append(line[i + 1])
            i += 2
        elif c == "'":
            if line.startswith("'", i + 1):
                out.append("'")
                i += 2
            else:
                return "".join(out), i + 1
        else:
            out.append(c)
            i += 1
    raise _Malformed("unterminated quoted value")


def _parse_gid_line(rest: str) -> tuple[str, int | None, datetime | None]:
    """Parse ``'gid'[, txid N][ (at ts)]``; the gid is quote_literal'd (``E'...'`` when it holds a backslash)."""
    if rest.startswith("E'"):
        gid, pos = _read_escaped_literal(rest, 0)
    elif rest.startswith("'"):
        gid, pos = read_quoted_literal(rest, 0)
    else:
        raise _Malformed("expected a quoted transaction identifier")
    tail, when = _split_at_time(rest[pos:])
    xid = None
    if tail:
        if not tail.startswith(", txid "):
            raise _Malformed(f"unexpected text after the gid: {tail!r}")
        xid = _parse_xid_suffix(tail[7:])
    return gid, xid, when


def _parse_message(
    data: bytes, lsn: Lsn, xid: int | None, streaming: bool, encoding: str = "utf-8"
) -> Message | StreamDataWithheld:
    # b"message: transactional: 1 prefix: <raw>, sz: <n> content:<n raw bytes>"
    head = b"streaming message: transactional: " if streaming else b"message: transactional: "
    pos = len(head)
    flag = data[pos : pos + 1]
    if flag not in (b"0", b"1") or not data.startswith(b" prefix: ", pos + 1):
        raise _Malformed("malformed message header")
    transactional = flag == b"1"
    prefix_start = pos + 10
    # Prefix and content are raw: either may hold ", sz: ". Take the first split from the left
    # that makes the content exactly sz bytes long, so a content that itself ends in
    # ", sz: N content:" plus N bytes is not split inside the content.
    search_from = prefix_start
    content: bytes | None
    while True:
        sz_at = data.find(b", sz: ", search_from)
        if sz_at < 0:
            raise _Malformed("message size not found")
        digits_end = sz_at + 6
        while digits_end < len(data) and 48 <= data[digits_end] <= 57:
            digits_end += 1
        digits = data[sz_at + 6 : digits_end]
        if digits:
            size = int(digits)
            if data.startswith(b" content:", digits_end) and len(data) - digits_end - 9 == size:
                content = data[digits_end + 9 :]
                break
            if streaming and transactional and digits_end == len(data):
                content = None
                break
        search_from = sz_at + 1  # look for a later ", sz: "
    prefix = data[prefix_start:sz_at].decode(encoding, errors="surrogateescape")
    if content is None:
        return StreamDataWithheld(lsn, xid, f"transactional message with prefix {prefix!r} ({size} bytes)")
    return Message(lsn, xid, transactional, prefix, content)


def _parse_undecodable_change(data: bytes, lsn: Lsn, xid: int | None, encoding: str) -> Change | Truncate:
    """A change whose line is not valid in ``encoding``: scanned with each undecodable byte kept
    apart (``surrogateescape``: they are never a quote or a bracket), then a ``"char"`` value read
    as PostgreSQL 15+ prints it; anything else undecodable is :class:`InvalidText`."""
    event = _parse_change(data.decode(encoding, "surrogateescape"), lsn, xid)
    if not isinstance(event, Change):
        raise InvalidText(f"the line is not valid {encoding} text")

    def fixed(image: RowImage | None) -> RowImage | None:
        if image is None:
            return None
        values = []
        for name, pg_type, value in zip(image.names, image.types, image.values):
            if isinstance(value, str) and has_undecodable(value):
                value = char_text(value.encode(encoding, "surrogateescape"), pg_type, encoding, name)
            values.append(value)
        if any(has_undecodable(text) for text in (*image.names, *image.types)):
            raise InvalidText(f"a column name or type of {event.schema}.{event.table} is not valid {encoding} text")
        return RowImage(image.names, image.types, tuple(values))

    if has_undecodable(event.schema) or has_undecodable(event.table):
        raise InvalidText(f"the table name is not valid {encoding} text")
    return Change(
        event.lsn,
        event.xid,
        event.operation,
        event.schema,
        event.table,
        fixed(event.old),
        fixed(event.new),
        event.has_tuple_data,
    )


class TestDecodingParser:
    """Turns rows of a ``test_decoding`` slot into events.

    :param encoding: the database's encoding as a Python codec name; rows arrive as bytes
        from the binary peek function so that message contents stay exact.
    """

    __test__ = False  # not a pytest test class, whatever its name says

    plugin = "test_decoding"

    def __init__(self, encoding: str = "utf-8") -> None:
        self.encoding = encoding
        # Column layouts and table names seen so far, for the scanner's fast path.
        self._layouts: dict[Any, Any] = {}

    def parse(self, lsn: Lsn, xid: int | None, data: bytes | str) -> Event:
        """Parse one row (``lsn``, ``xid`` and ``data`` columns of the peek function)."""
        try:
            if isinstance(data, str):
                if data.startswith(("message:", "streaming message:")):
                    return self._parse_bytes_line(data.encode(self.encoding), lsn, xid)
                return self._parse_text_line(data, lsn, xid)
            if data.startswith(b"table "):
                try:
                    line = data.decode(self.encoding)
                except UnicodeDecodeError:  # a "char" above 127 from PostgreSQL 14 (decoding/raw_char.py)
                    return _parse_undecodable_change(data, lsn, xid, self.encoding)
                return _parse_change(line, lsn, xid, self._layouts)
            return self._parse_bytes_line(data, lsn, xid)
        except InvalidText as exc:
            raise DecodingError(f"cannot read test_decoding row: {exc}", lsn=lsn, data=data) from None
        except _Malformed as exc:
            raise DecodingError(f"malformed test_decoding row: {exc}", lsn=lsn, data=data) from None
        except (IndexError, ValueError) as exc:
            raise DecodingError(f"malformed test_decoding row ({exc})", lsn=lsn, data=data) from None

    def _parse_bytes_line(self, data: bytes, lsn: Lsn, xid: int | None) -> Event:
        if data.startswith(b"message: "):
            return _parse_message(data, lsn, xid, False, self.encoding)
        if data.startswith(b"streaming message: "):
            return _parse_message(data, lsn, xid, True, self.encoding)
        return self._parse_text_line(data.decode(self.encoding), lsn, xid)

    def _parse_text_line(self, line: str, lsn: Lsn, xid: int | None) -> Event:
        if line.startswith("table "):
            return _parse_change(line, lsn, xid, self._layouts)
        if line.startswith("BEGIN"):
            line_xid = _parse_xid_suffix(line[5:])
            return Begin(lsn, xid if xid is not None else line_xid)
        if line.startswith("COMMIT PREPARED "):
            gid, line_xid, when = _parse_gid_line(line[16:])
            return CommitPrepared(lsn, _pick_xid(xid, line_xid), gid, when)
        if line.startswith("COMMIT"):
            rest, when = _split_at_time(line[6:])
            line_xid = _parse_xid_suffix(rest)
            return Commit(lsn, _pick_xid(xid, line_xid), when)
        if line.startswith("PREPARE TRANSACTION "):
            gid, line_xid, when = _parse_gid_line(line[20:])
            return Prepare(lsn, _pick_xid(xid, line_xid), gid, when)
        if line.startswith("ROLLBACK PREPARED "):
            gid, line_xid, when = _parse_gid_line(line[18:])
            return RollbackPrepared(lsn, _pick_xid(xid, line_xid), gid, when)
        return self._parse_stream_line(line, lsn, xid)

    def _parse_stream_line(self, line: str, lsn: Lsn, xid: int | None) -> Event:
        for prefix, kind in (
            ("opening a streamed block for transaction", StreamStart),
            ("closing a streamed block for transaction", StreamStop),
            ("aborting streamed (sub)transaction", StreamAbort),
        ):
            if line.startswith(prefix):
                line_xid = _parse_txn_suffix(line[len(prefix) :])
                if kind is StreamAbort:
                    # The printed xid is the aborted (sub)transaction's.
                    return StreamAbort(lsn, xid, line_xid)
                return kind(lsn, _pick_xid(xid, line_xid))
        if line.startswith("committing streamed transaction"):
            rest, when = _split_at_time(line[31:])
            return StreamCommit(lsn, _pick_xid(xid, _parse_txn_suffix(rest)), when)
        if line.startswith("preparing streamed transaction "):
            rest = line[31:]
            if rest.startswith("TXN "):
                rest = rest[4:]
            gid, line_xid, when = _parse_gid_line(rest)
            return StreamPrepare(lsn, _pick_xid(xid, line_xid), gid, when)
        for prefix, what in (("streaming change for ", "change"), ("streaming truncate for ", "truncate")):
            if line.startswith(prefix):
                rest = line[len(prefix) :]
                line_xid = None if rest == "transaction" else _parse_txn_suffix(" " + rest)
                return StreamDataWithheld(lsn, _pick_xid(xid, line_xid), what)
        raise _Malformed("unknown line kind")


def _parse_txn_suffix(rest: str) -> int | None:
    """Parse the optional `` TXN 123`` of streaming lines."""
    if not rest:
        return None
    if not rest.startswith(" TXN "):
        raise _Malformed(f"unexpected text {rest!r}")
    return _parse_xid_suffix(rest[5:])


def _pick_xid(row_xid: int | None, line_xid: int | None) -> int | None:
    # The SQL row's xid column is the top-level xid; the line's own xid (include-xids) is
    # the same number. Prefer the row's, fall back to the line's.
    return row_xid if row_xid is not None else line_xid
