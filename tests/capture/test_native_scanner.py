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


def many_inserts(txns: int, per: int, first_xid: int = 10, lsn: int = 1000) -> list[tuple[int, int | None, bytes]]:
    """``txns`` transactions of ``per`` INSERTs each into public.t (ids from 0, text values of 20+ bytes)."""
    rows: list[tuple[int, int | None, bytes]] = []
    for t in range(txns):
        xid = first_xid + t
        rows.append((lsn, xid, b"BEGIN %d" % xid))
        for i in range(per):
            lsn += 1
            n = t * per + i
            rows.append((lsn, xid, b"table public.t: INSERT: id[integer]:%d v[text]:'value number %08d'" % (n, n)))
        lsn += 1
        rows.append((lsn, xid, b"COMMIT %d" % xid))
        lsn += 1
    return rows


def _column(b: dict[str, Any], i: int) -> list[bytes]:
    valid, nulls, offsets, data = b["values"][i]
    offs = struct.unpack(f"<{b['n'] + 1}i", bytes(memoryview(offsets)))
    raw = bytes(memoryview(data))
    return [raw[offs[j] : offs[j + 1]] for j in range(b["n"])]


def test_large_parts_are_handed_over_without_a_copy_and_their_buffers_reused() -> None:
    """Parts of more than 64 KiB per buffer leave the reader as read-only buffer objects (no copy);
    once released, their memory serves the next part. What stays buffered is kept intact either
    way, while a taken part is still held and after it is gone."""
    r = reader(part_rows=1_000_000, memory_items=100_000)
    rows = many_inserts(10, 1000)
    drain(r, copy_data(rows), 65536)
    tid = r.table_id("public", "t")
    assert r.pending(tid) == 10_000
    first = r.take(tid, 6000)
    assert not isinstance(first["values"][1][3], bytes)  # handed over, not copied
    with pytest.raises(TypeError):
        memoryview(first["values"][1][3])[0] = 0  # read-only
    assert _column(first, 1) == [b"value number %08d" % n for n in range(6000)]
    assert struct.unpack("<6000q", bytes(memoryview(first["commit_lsn"])))[5999] == rows[6 * 1002 - 1][0]
    second = r.take(tid, 4000)  # while the first part is still held
    assert _column(second, 0) == [b"%d" % n for n in range(6000, 10_000)]
    assert _column(first, 1)[-1] == b"value number 00005999"  # untouched by the second take
    del first, second  # their buffers become spares
    more = reader_rows_after(r, many_inserts(3, 1000, first_xid=100))
    assert more == 3000
    third = r.take(tid, 3000)
    assert _column(third, 1) == [b"value number %08d" % n for n in range(3000)]
    assert r.pending(tid) == 0


def reader_rows_after(r: Any, rows: list[tuple[int, int | None, bytes]]) -> int:
    """Feed another COPY to reader ``r`` (after the one it ended) and return its buffered rows of public.t."""
    r.next_copy(None)
    drain(r, copy_data(rows), 65536)
    return int(r.pending(r.table_id("public", "t")))


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_a_transaction_handed_over_late_keeps_its_rows_across_blocks(size: int) -> None:
    """The open transaction's rows stay in the input buffer until its COMMIT (a handover gives them
    as read): fed in small blocks, the input is compacted many times meanwhile."""
    inserts = many_inserts(1, 300, lsn=2000)[:-1]  # BEGIN and 300 INSERTs
    unusual = (5000, 10, b"table public.t: TRUNCATE: (no-flags)")
    rows = many_inserts(2, 5, first_xid=1) + inserts + [unusual, (5001, 10, b"COMMIT 10")]
    r = reader()
    results = drain(r, copy_data(rows), size)
    handed = [res for res in results if res[0] == "rows"]
    assert handed[0][1] == inserts + [unusual]
    assert r.pending(r.table_id("public", "t")) == 10  # the two fast transactions before it
