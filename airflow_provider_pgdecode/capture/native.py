"""The extract's native fast path: the peek as binary COPY read by a C scanner (``capture/_native``,
sources in ``capture/csrc/``, the Reader in ``module.c``) into per-table Arrow-layout buffers,
written as Parquet parts on writer threads; whatever the scanner does not take (TRUNCATE,
messages, two-phase, streams, unreadable rows) is handed with its transaction to the Python
parser and assembler, so both paths stage the same batch.

How and why, step by step, with its memory bound and its one known difference:
docs/extract.md ("The native path"). ``PGDECODE_NATIVE=0`` or ``extract_batch(..., native=False)``
selects the Python path; ``PGDECODE_NATIVE_LIBPQ=0`` (:data:`NATIVE_LIBPQ_ENV`) reads the COPY
through psycopg instead of its libpq.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections import deque
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_pgdecode.batch.badvalues import ClampedValue, stage_values
from airflow_provider_pgdecode.batch.format import (
    COMMIT_LSN,
    METADATA_PREFIX,
    OLD,
    change_part_options,
    check_column_names,
    metadata_columns,
    quarantine_path,
    table_path,
)
from airflow_provider_pgdecode.batch.manifest import ColumnSummary, TableSummary
from airflow_provider_pgdecode.batch.options import TableOptions, options_for, yes_or_no
from airflow_provider_pgdecode.batch.values import arrow_type
from airflow_provider_pgdecode.batch.writer import (
    BatchWriter,
    append_only_error,
    no_tuple_data_error,
    old_field_staged,
    quarantine_entry,
    write_quarantine_part,
)
from airflow_provider_pgdecode.capture.bounds import BatchCut
from airflow_provider_pgdecode.decoding.assembler import PreparedTransaction, Transaction, TransactionAssembler
from airflow_provider_pgdecode.decoding.events import UNCHANGED_TOAST, Change, Message, Truncate
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import CHAR_TYPES, char_text
from airflow_provider_pgdecode.errors import DecodingError, staging_io

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Parts handed to the writer's two threads (one converting, one writing Parquet) and not
#: written yet, at most; the reader may hold one more, taken and waiting.
_IN_FLIGHT = 2
_missing_logged = False


def load_native() -> Any | None:
    """The C extension module, or ``None`` (logged once) when it was not built."""
    global _missing_logged
    try:
        native = importlib.import_module("airflow_provider_pgdecode.capture._native")
    except ImportError as exc:
        if not _missing_logged:
            log.warning("pgdecode's native extract is not available (%s); using the Python path", exc)
            _missing_logged = True
        return None
    return native


def native_wanted(native: bool | None) -> bool:
    """``native`` if given, else the environment (``PGDECODE_NATIVE=0`` turns it off; default on)."""
    if native is not None:
        return native
    return yes_or_no(os.environ.get("PGDECODE_NATIVE", "")) is not False


def _micros(when: datetime | None) -> int | None:
    if when is None:
        return None
    if when.tzinfo is None:  # as pyarrow reads a naive datetime for a UTC column
        when = when.replace(tzinfo=UTC)
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _text(n: int, parts: tuple[bytes, int, bytes, bytes]) -> pa.Array:
    valid, nulls, offsets, data = parts
    return pa.Array.from_buffers(
        pa.string(),
        n,
        [pa.py_buffer(valid) if nulls else None, pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=nulls,
    )


def _column_text(n: int, parts: tuple[bytes, int, bytes, bytes], pg_type: str) -> pa.Array:
    """A column's values as text (:func:`_text`); a ``"char"`` column's as PostgreSQL 15+ prints
    them: 14 prints a byte above 127 as itself, not UTF-8 (decoding/raw_char.py, as the Python
    parsers read it). The C reader keeps the bytes as sent; only such a column is checked."""
    text = _text(n, parts)
    if pg_type not in CHAR_TYPES:
        return text
    try:
        text.validate(full=True)  # UTF-8 included
        return text
    except pa.ArrowInvalid:
        raw = text.view(pa.binary()).to_pylist()
        return pa.array([None if v is None else char_text(v, pg_type) for v in raw], pa.string())


def _fixed(kind: pa.DataType, n: int, data: bytes, valid: tuple[bytes, int] | None = None) -> pa.Array:
    bits, nulls = valid if valid is not None else (None, 0)
    return pa.Array.from_buffers(kind, n, [pa.py_buffer(bits) if nulls else None, pa.py_buffer(data)], null_count=nulls)


class _Table:
    """Python-side state of one table: its part files and the columns it has staged."""

    __slots__ = (
        "schema",
        "table",
        "options",
        "relpath",
        "directory",
        "files",
        "all_columns",
        "quarantine_directory",
        "quarantine_files",
        "quarantined",
        "quarantined_ops",
        "key",
        "old_key",
        "clamped",
    )

    def __init__(
        self,
        schema: str,
        table: str,
        root: Path,
        options: TableOptions,
        key: Collection[str] | None = None,
        old_key: Collection[str] | None = None,
    ) -> None:
        self.schema = schema
        self.table = table
        self.options = options
        self.key = key  # the key columns (stage_values' key); None: unknown here
        self.old_key = old_key  # the old image's columns staged (old_field_staged); None: all
        #: per column, the first ±infinity staged clamped while the key was unknown
        self.clamped: dict[str, ClampedValue] = {}
        self.relpath = table_path(schema, table)
        self.directory = root / self.relpath
        self.files: list[str] = []
        self.all_columns: dict[str, str] = {}
        self.quarantine_directory = root / quarantine_path(schema, table)
        self.quarantine_files: list[str] = []
        self.quarantined = 0
        self.quarantined_ops = {"I": 0, "U": 0, "D": 0, "T": 0}


class NativeWriter:
    """Stages into one batch directory from the C reader's buffers (the fast path's writer).

    It has :class:`BatchWriter`'s interface for the extract; messages and pending prepared
    transactions go through the wrapped ``BatchWriter``, table rows through the reader.
    """

    def __init__(self, reader: Any, writer: BatchWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.directory = writer.directory
        self._tables: dict[int, _Table] = {}
        self._py_transactions = 0
        self._py_changes = 0
        self._py_skipped = 0
        self._in_flight = _IN_FLIGHT
        # Two stages, a thread each, parts in order through both: converting part k + 1 while
        # part k is written. Where the cores are shared with other work, the writer's CPU per part
        # (conversion ~1/3, Parquet ~2/3) then limits the extract less than on one thread.
        self._converter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdecode-convert")
        self._parquet = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdecode-parquet")
        #: per part in flight, its conversion, which gives its write (None: nothing to write)
        self._futures: deque[Future[Future[None] | None]] = deque()
        #: The manifest's ``quarantine`` entries, set by :meth:`close` (as BatchWriter's).
        self.quarantine: list[dict[str, Any]] = []

    # -- totals as BatchWriter has them -------------------------------------------------------

    @property
    def transactions(self) -> int:
        return self._py_transactions + self.reader.stats()["transactions"]

    @property
    def changes(self) -> int:
        return self._py_changes + self.reader.stats()["changes"]

    @property
    def skipped_changes(self) -> int:
        return self._py_skipped + self.reader.stats()["skipped"]

    @property
    def partition_truncates(self) -> int:
        return self.writer.partition_truncates

    # -- the Python path's transactions ----------------------------------------------------------

    def add_transaction(self, txn: Transaction) -> None:
        """One transaction assembled in Python, row by row (as BatchWriter.add_transaction)."""
        reader = self.reader
        staged = 0
        commit = int(txn.commit_lsn)
        when = _micros(txn.commit_time)
        for seq, item in enumerate(txn.items):
            kind = type(item)
            if kind is Change:
                change = cast(Change, item)
                tid = reader.table_id(change.schema, change.table)
                if tid < 0:
                    self._py_skipped += 1
                    continue
                if change.operation.value != "I" and self._append_only(change.schema, change.table):
                    raise append_only_error(change.schema, change.table, change.operation.name, change.lsn)
                if not change.has_tuple_data:
                    raise no_tuple_data_error(change, self.writer.identities.get((change.schema, change.table)))
                new = change.new
                values = None
                if new is not None:
                    layout = reader.layout(tid)
                    if layout is None or layout != (new.names, new.types):
                        if layout is not None and reader.pending(tid):
                            self._flush(tid, reader.pending(tid))
                        self._check_names(tid, new.names)
                        reader.set_layout(tid, tuple(new.names), tuple(new.types))
                    values = tuple(new.values)
                old = change.old
                flush = reader.append(
                    tid,
                    seq,
                    change.operation.value,
                    txn.xid,
                    commit,
                    when,
                    int(change.lsn),
                    values,
                    None if old is None else (tuple(old.names), tuple(old.types), tuple(old.values)),
                )
                staged += 1
                if flush is not None:
                    self._flush(*flush)
            elif kind is Truncate:
                truncate = cast(Truncate, item)
                for schema, table in truncate.relations:
                    if self.writer.skips_truncate(schema, table):
                        continue
                    tid = reader.table_id(schema, table)
                    if tid < 0:
                        self._py_skipped += 1
                        continue
                    flush = reader.append(tid, seq, "T", txn.xid, commit, when, int(truncate.lsn), None, None)
                    staged += 1
                    if flush is not None:
                        self._flush(*flush)
            elif kind is Message:
                self.writer._add_message(item, txn.commit_lsn, seq, txn.xid)  # type: ignore[arg-type]
        if staged:
            self._py_transactions += 1
            self._py_changes += staged

    def _append_only(self, schema: str, table: str) -> bool:
        return options_for(self.writer.table_options, schema, table).mode == "append_only"

    def add_message(self, message: Message) -> None:
        self.writer.add_message(message)

    def _check_names(self, tid: int, names: Iterable[str]) -> None:
        names = list(names)
        if any(name.startswith(METADATA_PREFIX) for name in names):
            info = self.reader.table_info(tid)
            check_column_names(info["schema"], info["table"], names)

    # -- parts -----------------------------------------------------------------------------------

    def _table(self, tid: int) -> _Table:
        table = self._tables.get(tid)
        if table is None:
            info = self.reader.table_info(tid)
            options = options_for(self.writer.table_options, info["schema"], info["table"])
            table = self._tables[tid] = _Table(
                info["schema"],
                info["table"],
                self.directory,
                options,
                self.writer.staging_key(info["schema"], info["table"], options),
                self.writer.old_image_key(info["schema"], info["table"], options),
            )
        return table

    def clamped_values(self) -> dict[tuple[str, str], dict[str, ClampedValue]]:
        """As :meth:`BatchWriter.clamped_values` (after :meth:`close`)."""
        return {(t.schema, t.table): dict(t.clamped) for t in self._tables.values() if t.clamped}

    def flush_all(self, flushes: Iterable[tuple[int, int]]) -> None:
        for tid, rows in flushes:
            self._flush(tid, rows)

    def _flush(self, tid: int, rows: int) -> None:
        """Write the first ``rows`` buffered rows of a table as one part (as _TableBuffer.flush).

        The rows leave the C buffers here; converting and writing them happens on writer
        threads (pyarrow releases the GIL), overlapping the next rows' transfer and parsing.
        At most ``_IN_FLIGHT`` parts are being written, so memory stays bounded; errors are
        raised in part order.
        """
        if rows <= 0:
            return
        state = self._table(tid)
        layout = self.reader.layout(tid)
        buffers = self.reader.take(tid, rows)
        buffers["old"] = [field for field in buffers["old"] if old_field_staged(field[0], state.old_key)]
        # The manifest's column list, in the order the Python writer records it.
        if layout is not None:
            for name, pg_type in zip(*layout):
                state.all_columns[name] = pg_type
        for name, pg_type, _ in buffers["old"]:
            state.all_columns.setdefault(name, pg_type)
        while len(self._futures) >= self._in_flight:
            self._retire()
        # The part's file name is taken when it is written (a part whose every change is
        # quarantined is not written, as in the Python writer); parts are converted one at a
        # time and written one at a time, in order.
        self._futures.append(self._converter.submit(self._convert_part, state, layout, buffers))

    def _retire(self) -> None:
        """Wait for the oldest part in flight to be written; raise its error."""
        written = self._futures.popleft().result()
        if written is not None:
            written.result()

    def wait(self) -> None:
        """Wait for the parts being written; raise the first error."""
        while self._futures:
            self._retire()

    def abort(self) -> None:
        """Stop writing (after an error elsewhere): wait for the writer threads, drop their errors."""
        for future in self._futures:
            future.cancel()
        self._converter.shutdown(wait=True)
        self._parquet.shutdown(wait=True)
        self._futures.clear()

    def _convert_part(self, state: _Table, layout: Any, b: dict[str, Any]) -> Future[None] | None:
        """Convert a part (quarantining bad values) and hand it to the Parquet thread: its write,
        or None when every change of the part was quarantined."""
        n = b["n"]
        toast_child = _text(b["toast_n"], b["toast_names"])
        bits, nulls = b["toast_valid"]
        toast = pa.Array.from_buffers(
            pa.list_(pa.string()),
            n,
            [pa.py_buffer(bits) if nulls else None, pa.py_buffer(b["toast_offsets"])],
            null_count=nulls,
            children=[toast_child],
        )
        columns = metadata_columns(
            _fixed(pa.int64(), n, b["commit_lsn"]),
            _fixed(pa.int32(), n, b["seq"]),
            pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(b["op_offsets"]), pa.py_buffer(b["op"])]),
            _fixed(pa.int64(), n, b["xid"], b["xid_valid"]),
            _fixed(pa.timestamp("us", tz="UTC"), n, b["ctime"], b["ctime_valid"]),
            _fixed(pa.int64(), n, b["change_lsn"]),
            toast,
        )
        new: list[tuple[str, str, pa.Array]] = []
        names: tuple[str, ...] = ()
        if layout is not None:
            names, types = layout
            new = [
                (name, pg_type, _column_text(n, parts, pg_type))
                for name, pg_type, parts in zip(names, types, b["values"])
            ]
        order = {name: i for i, name in enumerate(names)}
        fields = sorted(b["old"], key=lambda f: (order.get(f[0], len(order)), f[0]))
        old_fields = [(name, pg_type, _column_text(n, parts, pg_type)) for name, pg_type, parts in fields]
        has_old = pc.not_equal(pa.Array.from_buffers(pa.uint8(), n, [None, pa.py_buffer(b["has_old"])]), 0)
        staged = stage_values(state.schema, state.table, state.options, columns, new, old_fields, has_old, state.key)
        for name, value in staged.clamped.items():
            state.clamped.setdefault(name, value)  # parts are converted one at a time, in order
        if staged.keep is not None:
            columns = {name: pc.filter(array, staged.keep) for name, array in columns.items()}
            has_old = pc.filter(has_old, staged.keep)
            state.quarantine_files.append(
                write_quarantine_part(state.quarantine_directory, state.quarantine_files, staged)
            )
            assert staged.quarantine is not None
            state.quarantined += staged.quarantine.num_rows
            for op, count in staged.quarantined_ops.items():
                state.quarantined_ops[op] += count
        n = len(columns[COMMIT_LSN])
        values = dict(staged.values)
        old = self._old_struct(n, names, layout, old_fields, staged.old, has_old, state.options)
        if old is not None:
            columns[OLD] = old
            for child in old.type:
                if child.name not in values:
                    values[child.name] = pa.nulls(n, child.type)
        columns.update(values)
        if n == 0:
            return None  # every change of the part was quarantined
        return self._parquet.submit(self._write_part, state, pa.table(columns))

    @staticmethod
    def _write_part(state: _Table, table: pa.Table) -> None:
        file_name = f"part-{len(state.files):05d}.parquet"
        with staging_io(state.directory / file_name, "write Parquet part"):
            state.directory.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, state.directory / file_name, **change_part_options(table.schema))
        state.files.append(file_name)

    @staticmethod
    def _old_struct(
        n: int,
        names: tuple[str, ...],
        layout: Any,
        fields: list[tuple[str, str, pa.Array]],
        children: list[pa.Array],
        has_old: pa.Array,
        options: TableOptions,
    ) -> pa.Array | None:
        if not fields:
            if not names:
                return None
            types = layout[1]
            return pa.nulls(n, pa.struct([(nm, arrow_type(t, options.staging)) for nm, t in zip(names, types)]))
        return pa.StructArray.from_arrays(children, names=[f[0] for f in fields], mask=pc.invert(has_old))

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> tuple[list[TableSummary], dict[str, Any] | None]:
        try:
            for tid in self.reader.order():
                self._flush(tid, self.reader.pending(tid))
            self.wait()
        except BaseException:
            self.abort()
            raise
        self._converter.shutdown(wait=True)
        self._parquet.shutdown(wait=True)
        _, messages = self.writer.close()
        summaries = []
        for tid in self.reader.order():
            state = self._tables.get(tid)
            if state is None or not state.files:
                continue
            info = self.reader.table_info(tid)
            counts = {op: info[op] - state.quarantined_ops[op] for op in ("I", "U", "D", "T")}
            summaries.append(
                TableSummary(
                    schema=state.schema,
                    table=state.table,
                    path=state.relpath,
                    files=list(state.files),
                    rows=sum(counts.values()),
                    inserts=counts["I"],
                    updates=counts["U"],
                    deletes=counts["D"],
                    truncates=counts["T"],
                    min_commit_lsn=str(Lsn(info["min_commit"] or 0)),
                    max_commit_lsn=str(Lsn(info["max_commit"])),
                    columns=[
                        ColumnSummary(nm, t, str(arrow_type(t, state.options.staging)))
                        for nm, t in state.all_columns.items()
                    ],
                )
            )
        summaries.sort(key=lambda s: (s.schema, s.table))
        quarantined = [state for state in self._tables.values() if state.quarantine_files]
        self.quarantine = [
            entry
            for state in sorted(quarantined, key=lambda s: (s.schema, s.table))
            if (entry := quarantine_entry(state.schema, state.table, state.quarantine_files, state.quarantined))
            is not None
        ]
        return summaries, messages

    def save_prepared(self, prepared: list[PreparedTransaction]) -> list[dict[str, Any]]:
        return self.writer.save_prepared(prepared)


_libpq_path: str | None | bool = False


def _libpq_functions(path: str) -> tuple[int, int]:
    """The addresses of ``PQgetCopyData`` and ``PQfreemem`` in the libpq at ``path``, which must be
    loaded already: ``RTLD_NOLOAD`` finds the copy in the process, it never loads a second one.

    ctypes resolves them, not the extension: its own ``dlopen``/``dlsym`` would bind their
    GLIBC_2.34 versions and make the wheel ``manylinux_2_34``.
    """
    import ctypes

    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as exc:
        raise OSError(f"libpq {path} is not loaded: {exc}") from exc
    try:
        get_copy_data = ctypes.cast(lib.PQgetCopyData, ctypes.c_void_p).value
        freemem = ctypes.cast(lib.PQfreemem, ctypes.c_void_p).value
    except AttributeError:
        get_copy_data = freemem = None
    if not get_copy_data or not freemem:
        raise OSError("PQgetCopyData or PQfreemem not found")
    return get_copy_data, freemem


NATIVE_LIBPQ_ENV = "PGDECODE_NATIVE_LIBPQ"
"""``0``: the native reader reads the COPY through psycopg, not by calling psycopg's libpq."""


def _libpq_connection(native: Any, copy: Any) -> int | None:
    """The ``PGconn*`` of a psycopg ``Copy`` whose libpq the reader can call, else ``None``.

    The reader must call the very libpq that psycopg loaded (the connection's structure is
    private to it): it is found among the process's loaded libraries, and the addresses of its
    ``PQgetCopyData`` and ``PQfreemem`` are bound once.
    """
    global _libpq_path
    pgconn = getattr(getattr(getattr(copy, "cursor", None), "connection", None), "pgconn", None)
    if pgconn is None or os.environ.get(NATIVE_LIBPQ_ENV, "1") == "0":
        return None
    if _libpq_path is False:
        _libpq_path = None
        try:
            import psycopg

            wanted = "psycopg_binary" if psycopg.pq.__impl__ == "binary" else ""
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                paths = {line.split()[-1] for line in maps if "/libpq" in line}
            found = sorted(p for p in paths if wanted in p and "psycopg2" not in p)
            if len(found) == 1:
                native.bind_libpq(*_libpq_functions(found[0]))
                _libpq_path = found[0]
            else:
                log.info("Native extract: libpq of psycopg not identified (%s); reading COPY through psycopg", found)
        except OSError as exc:
            log.info("Native extract: cannot use libpq directly (%s); reading COPY through psycopg", exc)
    if _libpq_path is None:
        return None
    return int(pgconn.pgconn_ptr)


def _raise_copy_end(copy: Any) -> None:
    """After libpq ended a COPY before its trailer: raise the server's error (as psycopg would)."""
    import psycopg

    conn = copy.cursor.connection
    results = []
    while (res := conn.pgconn.get_result()) is not None:
        results.append(res)
    for res in results:
        if res.status != psycopg.pq.ExecStatus.COMMAND_OK:
            raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
    raise DecodingError("the peek's COPY data ended without its trailer")


def extract_native(
    native: Any,
    copy: Any,
    parser: Any,
    plugin: str,
    assembler: TransactionAssembler,
    writer: BatchWriter,
    include: Callable[[str, str], bool] | None,
    part_rows: int,
    memory_items: int,
    resume_after: Lsn | None,
    cut: BatchCut | None = None,
    more: Callable[[int], Any | None] | None = None,
) -> tuple[NativeWriter, int]:
    """Run the peek's COPY (a psycopg ``Copy`` in progress, or any iterable of COPY blocks)
    through the C reader; returns the writer and the rows read.

    ``more``: asked, when a COPY has ended, with the rows read from it, for the COPY that
    continues it (the second decoding session's, :mod:`~airflow_provider_pgdecode.capture.sessions`)
    or None. That one is read resuming after the position reached (what both deliver is kept
    once), with the streams still in progress dropped: it delivers them again from their start.

    ``parser`` is the plugin's Python parser (used for the rows handed over, and for pgoutput's
    Relation and Type messages); ``assembler`` and ``writer`` are those of the Python path.
    ``cut``: the batch's bounds; the reader hands the transaction that would cross one to the
    Python side, which cuts the batch before it (the rest of the COPY is then read and dropped).
    """
    run = _NativeRun(native, parser, plugin, assembler, writer, include, part_rows, memory_items, resume_after, cut)
    try:
        run.read(copy)
        if more is not None and (cut is None or cut.cut_by is None):
            following = more(run.reader.stats()["rows_read"])
            if following is not None:
                run.read_following(following)
        run.out.wait()  # no part is still being written when the extract goes on (or fails)
    except BaseException:
        run.out.abort()
        raise
    return run.finish()


class _NativeRun:
    """One native extract: the C reader, the writer it feeds, and the rows it hands to the Python
    path (pgoutput's Relation messages, a transaction the batch's bounds may cut)."""

    def __init__(
        self,
        native: Any,
        parser: Any,
        plugin: str,
        assembler: TransactionAssembler,
        writer: BatchWriter,
        include: Callable[[str, str], bool] | None,
        part_rows: int,
        memory_items: int,
        resume_after: Lsn | None,
        cut: BatchCut | None,
    ) -> None:
        self.native = native
        self.parser = parser
        self.assembler = assembler
        self.cut = cut
        self.is_pgoutput = plugin == "pgoutput"
        self.relations: dict[int, Any] = {}
        self.handed = 0
        self.reader: Any = native.Reader(
            plugin,
            part_rows,
            memory_items,
            None if resume_after is None else int(resume_after),
            include if include is not None else (lambda schema, table: True),
            self.on_relation if self.is_pgoutput else None,
            UNCHANGED_TOAST,
        )
        self.out = NativeWriter(self.reader, writer)
        self.stops_before = None
        if cut is not None:
            self.reader.set_bounds(cut.max_changes, None if cut.max_lsn is None else int(cut.max_lsn))
            cut.elsewhere = self.native_share
            self.stops_before = cut.stops_before

    def native_share(self) -> tuple[int, bool]:
        stats = self.reader.stats()
        return stats["assembled_changes"], stats["safe_lsn"] is not None

    def sync_relations(self) -> None:
        for relid, rel in self.parser.relations.items():
            if self.relations.get(relid) is not rel:
                self.reader.set_relation(relid, rel.schema, rel.table, rel.names, rel.types, rel.key_flags)
                self.relations[relid] = rel

    def on_relation(self, lsn: int, xid: int | None, data: bytes) -> None:
        self.parser.parse(Lsn(lsn), xid, data)
        self.sync_relations()

    def python_rows(self, rows: list[tuple[int, int | None, bytes]]) -> None:
        self.handed += len(rows)
        cut, reader, out = self.cut, self.reader, self.out
        parse, feed, stops_before = self.parser.parse, self.assembler.feed, self.stops_before
        for lsn, xid, data in rows:
            if cut is not None and cut.cut_by is not None:
                return
            event = parse(Lsn(lsn), xid, data)
            if event is None:
                if self.is_pgoutput:
                    self.sync_relations()
                continue
            if stops_before is not None and stops_before(event):
                reader.stop()
                return
            done = feed(event)
            if done is not None:
                if type(done) is Transaction:
                    out.add_transaction(done)
                    done.items.discard()
                elif type(done) is Message:
                    out.add_message(done)
        if cut is not None:
            reader.set_python_totals(self.assembler.stats.changes, self.assembler.safe_lsn is not None)

    def handle(self, result: tuple[Any, ...]) -> None:
        kind = result[0]
        if kind == "flush":
            self.out.flush_all(result[1])
        elif kind == "rows":
            self.python_rows(result[1])
            if self.assembler.idle:
                self.reader.resume()
        elif kind == "end":  # rows of a transaction cut off by the end, for the assembler to judge
            self.python_rows(result[1])

    def read(self, copy: Any) -> None:
        reader, handle = self.reader, self.handle
        pgconn = _libpq_connection(self.native, copy)
        if pgconn is not None:
            # Rows straight from libpq into the reader: no Python object per row.
            pump = reader.pump
            while True:
                result = pump(pgconn)
                if result[0] == "eof":
                    break
                handle(result)
            if not reader.ended:
                # libpq ended the COPY early (a cancel, a server error): report what the server said.
                _raise_copy_end(copy)
        # The rest through psycopg (all of it without libpq access): it also ends the COPY and
        # raises the server's error if the COPY failed.
        run = reader.run
        for block in copy:
            reader.feed(block)
            while (result := run()) is not None:
                handle(result)

    def read_following(self, following: Any) -> None:
        """The COPY that continues this one, read after the position reached."""
        assembler, reader = self.assembler, self.reader
        assembler.drop_streams()
        if assembler.idle:
            reader.resume()
        reached = max((Lsn(x) for x in (reader.stats()["safe_lsn"], assembler.safe_lsn) if x is not None), default=None)
        reader.next_copy(None if reached is None else int(reached))
        assembler.resume_from(reached)
        self.read(following)
        assembler.end_resume()

    def finish(self) -> tuple[NativeWriter, int]:
        """The reader's totals handed to the assembler; the writer and the rows read."""
        stats = self.reader.stats()
        # The relation callback refers to the reader through this object, and the reader to the
        # callback: break the cycle here, so the reader's buffers go with its writer, not at the cycle
        # collector's next full pass (a drain's batches piled up 17 MiB each).
        self.reader = None
        log.info("Native extract: %d rows read, %d of them handed to the Python path", stats["rows_read"], self.handed)
        self.assembler.add_fast_totals(
            safe_lsn=None if stats["safe_lsn"] is None else Lsn(stats["safe_lsn"]),
            transactions=stats["assembled_transactions"],
            changes=stats["assembled_changes"],
            empty=stats["empty_transactions"],
        )
        return self.out, stats["rows_read"]


__all__ = ["NativeWriter", "extract_native", "load_native", "native_wanted"]
