"""The C reader of the native fast path on hand-made COPY data: framing, hand-over, errors."""

from __future__ import annotations

import struct
import tempfile
from typing import Any

import pytest

from airflow_provider_pgdecode.batch.writer import BatchWriter
from airflow_provider_pgdecode.capture.native import extract_native, load_native
from airflow_provider_pgdecode.decoding.assembler import TransactionAssembler
from airflow_provider_pgdecode.decoding.events import UNCHANGED_TOAST
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import DecodingError

native = load_native()
pytestmark = pytest.mark.skipif(native is None, reason="the native extension is not built")

HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)


def copy_data(rows: list[tuple[int, int | None, bytes]]) -> bytes:
    out = [HEADER]
    for lsn, xid, data in rows:
        out.append(struct.pack(">hiq", 3, 8, lsn))
        out.append(struct.pack(">iq", 8, xid) if xid is not None else struct.pack(">i", -1))
        out.append(struct.pack(">i", len(data)) + data)
    out.append(struct.pack(">h", -1))
    return b"".join(out)


def reader(part_rows: int = 1000, memory_items: int = 1000) -> Any:
    return native.Reader("test_decoding", part_rows, memory_items, None, lambda s, t: True, None, UNCHANGED_TOAST)


def drain(r: Any, data: bytes, size: int) -> list[Any]:
    results = []
    for start in range(0, len(data), size):
        r.feed(data[start : start + size])
        while (result := r.run()) is not None:
            results.append(result)
            if result[0] == "rows":
                r.resume()
    return results


ROWS = [
    (100, 7, b"BEGIN 7"),
    (110, 7, b"table public.t: INSERT: id[integer]:1 v[text]:'it''s\nhere' n[numeric]:null"),
    (
        120,
        7,
        b"table public.t: UPDATE: old-key: id[integer]:1 new-tuple: id[integer]:2 v[text]:unchanged-toast-datum n[numeric]:1.5",
    ),
    (130, 7, b"table public.t: DELETE: id[integer]:2"),
    (140, 7, b"COMMIT 7 (at 2026-11-22 09:43:00.6+00)"),
]


def taken(r: Any) -> dict[str, Any]:
    tid = r.table_id("public", "t")
    out = r.take(tid, r.pending(tid))
    return {k: v for k, v in out.items()}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100_000])
def test_rows_straddling_blocks_read_the_same(size: int) -> None:
    whole = reader()
    expected_results = drain(whole, copy_data(ROWS), 100_000)
    expected = taken(whole)
    r = reader()
    assert drain(r, copy_data(ROWS), size) == expected_results
    assert taken(r) == expected
    assert r.stats()["rows_read"] == len(ROWS)
    assert r.stats()["changes"] == 3


def test_values_metadata_and_layout() -> None:
    r = reader()
    results = drain(r, copy_data(ROWS), 100_000)
    assert results == [("end", [])]
    tid = r.table_id("public", "t")
    assert r.layout(tid) == (("id", "v", "n"), ("integer", "text", "numeric"))
    b = r.take(tid, 3)
    valid, nulls, offsets, data = b["values"][1]
    assert data == b"it's\nhere" and nulls == 2  # the UPDATE's unchanged TOAST and the DELETE are NULL
    assert struct.unpack("<3q", b["commit_lsn"]) == (140, 140, 140)
    assert struct.unpack("<3i", b["seq"]) == (0, 1, 2)
    assert b["op"] == b"IUD"
    assert struct.unpack("<3q", b["change_lsn"]) == (110, 120, 130)
    assert struct.unpack("<q", b["ctime"][:8])[0] == 1795340580600000  # 2026-11-22 09:43:00.6 UTC
    assert b["toast_names"][3] == b"v" and struct.unpack("<4i", b["toast_offsets"]) == (0, 0, 1, 1)
    ((name, pg_type, (_, old_nulls, _, old_data)),) = b["old"]
    assert (name, pg_type, old_data, old_nulls) == ("id", "integer", b"12", 1)
    assert b["has_old"] == b"\x00\x01\x01"


@pytest.mark.parametrize(
    "line",
    [
        b"table public.t: INSERT: id[integer]",  # no value
        b"table public.t: INSERT: id[integer]:'unterminated",
        b"table public.t: MERGE: id[integer]:1",
        b"table public.t: INSERT: id[integer]:1 _pg_seq[integer]:2",  # a reserved name: the Python path says so
        b"table public.t, public.u: TRUNCATE: (no-flags)",
        b"table public.t: DELETE: (no-tuple-data)",
        b"message: transactional: 1 prefix: p, sz: 1 content:x",
    ],
)
def test_unusual_rows_are_handed_over_with_their_transaction(line: bytes) -> None:
    r = reader()
    rows = ROWS[:2] + [(115, 7, line)] + ROWS[2:]
    results = drain_no_resume(r, copy_data(rows))
    kind, handed = results[0]
    assert kind == "rows"
    assert handed == [(100, 7, b"BEGIN 7"), ROWS[1], (115, 7, line)]
    assert r.pending(r.table_id("public", "t")) == 0  # the transaction's parsed rows were dropped
    assert [res[1][0] for res in results[1:-1]] == ROWS[2:]  # then rows pass through one by one


def drain_no_resume(r: Any, data: bytes) -> list[Any]:
    r.feed(data)
    results = []
    while (result := r.run()) is not None:
        results.append(result)
    return results


def test_large_transactions_go_to_the_python_path() -> None:
    r = reader(memory_items=3)
    rows = [(100, 7, b"BEGIN 7")] + [(101 + i, 7, b"table public.t: INSERT: id[integer]:%d" % i) for i in range(5)]
    results = drain_no_resume(r, copy_data(rows + [(200, 7, b"COMMIT 7")]))
    assert results[0][0] == "rows" and len(results[0][1]) == 4


def run_extract(rows: list[tuple[int, int | None, bytes]]) -> Any:
    assembler = TransactionAssembler()
    with tempfile.TemporaryDirectory() as tmp:
        writer, _ = extract_native(
            native,
            [copy_data(rows)],
            TestDecodingParser(),
            "test_decoding",
            assembler,
            BatchWriter(tmp),
            None,
            1000,
            1000,
            None,
        )
        assembler.finish()
        return writer.close()


def test_malformed_line_raises_what_the_python_parser_raises() -> None:
    line = b"table public.t: INSERT: id[integer]:'unterminated"
    with pytest.raises(DecodingError) as python_error:
        TestDecodingParser().parse(Lsn(115), 7, line)
    with pytest.raises(DecodingError) as native_error:
        run_extract(ROWS[:2] + [(115, 7, line)] + ROWS[2:])
    assert str(native_error.value) == str(python_error.value)


def test_malformed_copy_data_is_a_decoding_error() -> None:
    r = reader()
    r.feed(b"NOTCOPY" + b"\x00" * 20)
    with pytest.raises(DecodingError, match="malformed COPY data"):
        r.run()


def test_cut_transaction_reaches_the_assembler() -> None:
    from airflow_provider_pgdecode.errors import AssemblyError

    with pytest.raises(AssemblyError, match="neither committed nor prepared"):
        run_extract(ROWS[:3])


def test_quoted_names_and_types_are_read_in_c() -> None:
    line = (
        b'table "Odd Schema"."we""ird": INSERT: "Col A"[integer]:1 "x[y]"[text]:\'a] b\' '
        b'moods["Odd Schema"."Mo]:od"[]]:\'{a,"b c"}\''
    )
    r = reader()
    results = drain_no_resume(r, copy_data([(1, 3, b"BEGIN 3"), (2, 3, line), (3, 3, b"COMMIT 3")]))
    assert results == [("end", [])]  # nothing handed over
    tid = r.table_id("Odd Schema", 'we"ird')
    assert r.layout(tid) == (("Col A", "x[y]", "moods"), ("integer", "text", '"Odd Schema"."Mo]:od"[]'))
    b = r.take(tid, 1)
    assert [v[3] for v in b["values"]] == [b"1", b"a] b", b'{a,"b c"}']


def test_a_reader_in_a_cycle_with_its_callback_is_freed() -> None:
    """The extract's pgoutput relation callback refers back to its reader: the cycle collector
    must free such a reader (and its buffers), or every batch of a drain stays in memory."""
    import gc
    import weakref

    class Marker:
        pass

    marker = Marker()
    freed = weakref.ref(marker)
    holder: dict[str, Any] = {"marker": marker}

    def relation(lsn: int, xid: int | None, data: bytes, holder: dict[str, Any] = holder) -> None:
        holder["reader"].stats()

    r = native.Reader("pgoutput", 1000, 1000, None, lambda s, t: True, relation, UNCHANGED_TOAST)
    holder["reader"] = r  # reader -> relation -> holder -> reader
    assert gc.is_tracked(r)
    del r, relation, marker, holder
    gc.collect()
    assert freed() is None
