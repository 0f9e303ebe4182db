"""A copied chunk as a Parquet part: COPY's CSV parsed by Arrow, converted to the types Delta keeps.

The initial load (:mod:`.snapshot`) and table snapshots (:mod:`.table_snapshot`) write their
parts here: rows in the layout of batch/writer.py (op I rows after an optional op T row),
bounded ``numeric`` as Delta's decimal (NaN/Infinity staged as null and counted), ``timestamp``
as UTC-annotated microseconds, every other column as incremental batches stage it; each part
written under ``.part``, fsynced and renamed.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from psycopg import Connection

from airflow_provider_pgdecode.batch.badvalues import convert_snapshot_column
from airflow_provider_pgdecode.batch.format import OLD, PARQUET_OPTIONS, metadata_columns, part_schema
from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, TableOptions
from airflow_provider_pgdecode.batch.values import arrow_type
from airflow_provider_pgdecode.capture.snapshot_chunks import ChunkRead
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import CHAR_TYPES, char_text
from airflow_provider_pgdecode.postgres.catalog import ColumnInfo
from airflow_provider_pgdecode.postgres.snapshot_queries import copy_pages_csv
from airflow_provider_pgdecode.typemap import (
    DEFAULT_STAGING,
    NUMERIC_SPECIAL_VALUES,
    Staging,
    array_element,
    numeric_delta_type,
    numeric_typmod,
)

#: The part holding a table's TRUNCATE row (``replace``), apart from the rows.
TRUNCATE_PART = "part-truncate.parquet"

SEQ_MAX = 2**31 - 1
"""``_pg_seq`` is an int32: a snapshot's rows are numbered up to it (each key occurs once)."""
CSV_BLOCK = 1 << 22
CSV_BATCH_BYTES = 64 << 20
"""COPY's rows are parsed by Arrow at most this many bytes at a time."""
NAIVE_TIMESTAMP = pa.timestamp("us")
UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")


def read_csv_columns(
    copy: Iterable[Any], names: list[str], chunk_rows: int, char_columns: Mapping[str, str] | None = None
) -> Iterator[tuple[list[pa.Array], int]]:
    """COPY's CSV output as string columns, at most ``chunk_rows`` rows at a time.

    libpq hands COPY data over one row at a time, so rows are gathered as bytes (the only
    per-row Python work: the floor any client pays) and every ``chunk_rows`` rows or
    :data:`CSV_BATCH_BYTES` bytes are parsed by Arrow's CSV reader at once. PostgreSQL's CSV
    prints NULL unquoted and empty, an empty string as ``""``: Arrow reads the first as null and
    the second as an empty string; values are the output functions' text, exactly as the text
    format prints them. ``char_columns`` (name: type) are ``"char"`` columns, read as bytes and then
    as PostgreSQL 15+ prints them: 14 prints a byte above 127 as itself, not UTF-8, which the
    reader refuses in a text column (decoding/raw_char.py, as both plugins' parsers read it).
    """
    char_columns = char_columns or {}
    read_options = pacsv.ReadOptions(column_names=names, block_size=CSV_BLOCK)
    parse_options = pacsv.ParseOptions(newlines_in_values=True)
    convert_options = pacsv.ConvertOptions(
        column_types={n: pa.binary() if n in char_columns else pa.string() for n in names},
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
        null_values=[""],
    )

    def parse(data: bytearray) -> list[pa.Array]:
        table = pacsv.read_csv(
            pa.py_buffer(data), read_options=read_options, parse_options=parse_options, convert_options=convert_options
        ).combine_chunks()
        columns = [column.chunk(0) if column.num_chunks else pa.array([], pa.string()) for column in table.columns]
        for index, name in enumerate(names):
            if name in char_columns and pa.types.is_binary(columns[index].type):
                raw = columns[index].to_pylist()
                columns[index] = pa.array(
                    [None if v is None else char_text(v, char_columns[name]) for v in raw], pa.string()
                )
        return columns

    data = bytearray()
    count = 0
    for row in copy:
        data += row
        count += 1
        if count >= chunk_rows or len(data) >= CSV_BATCH_BYTES:
            yield parse(data), count
            data = bytearray()
            count = 0
    if count:
        yield parse(data), count


def decimal_type(column: ColumnInfo, staging: Staging = DEFAULT_STAGING) -> pa.Decimal128Type | None:
    """The ``decimal128`` a bounded ``numeric(p,s)`` column is staged as in a snapshot (the Delta
    type of the type map, :func:`~airflow_provider_pgdecode.typemap.numeric_delta_type`), or
    ``None``: every other column, unbounded ``numeric``, precision above 38, arrays and numeric
    kept as text by the table's ``type_map`` keep the staging of incremental batches (text)."""
    if array_element(column.catalog_type) is not None or staging.keeps_as_text(column.catalog_type):
        return None
    typmod = numeric_typmod(column.catalog_type)
    if typmod is None or typmod[0] is None:
        return None
    match = re.fullmatch(r"decimal\((\d+),(\d+)\)", numeric_delta_type(*typmod))
    return pa.decimal128(int(match.group(1)), int(match.group(2))) if match else None


def staged_type(column: ColumnInfo, staging: Staging = DEFAULT_STAGING) -> pa.DataType:
    """A snapshot column's staged Arrow type, the one Spark reads as the column's Delta type:
    Delta's decimal for bounded numeric, ``timestamp[us, tz=UTC]`` for ``timestamp without time
    zone`` (its wall-clock time read as UTC, the type map's rule: the same microseconds, only the
    annotation differs), else as incremental batches stage it
    (:func:`~airflow_provider_pgdecode.batch.values.arrow_type`)."""
    decimal = decimal_type(column, staging)
    if decimal is not None:
        return decimal
    staged = arrow_type(column.type_name, staging)
    return UTC_TIMESTAMP if staged == NAIVE_TIMESTAMP else staged


def snapshot_part_schema(columns: list[ColumnInfo], staging: Staging = DEFAULT_STAGING) -> pa.Schema:
    values = [(c.name, staged_type(c, staging)) for c in columns]
    return part_schema(pa.struct(values), values)


def as_decimal(text: pa.Array, decimal: pa.Decimal128Type) -> tuple[pa.Array, int]:
    """Numeric text as ``decimal``, in the pass that writes the part: NaN/Infinity (which a
    decimal cannot hold) become null and are counted. PostgreSQL already rounded every value to
    the column's scale and checked its precision, so the cast never loses a digit (it raises if
    it would)."""
    special = pc.fill_null(pc.is_in(text, pa.array(NUMERIC_SPECIAL_VALUES)), False)
    count = pc.sum(special).as_py() or 0
    if count:
        text = pc.if_else(special, pa.scalar(None, pa.string()), text)
    return pc.cast(text, decimal), int(count)


def part_table(
    columns: list[ColumnInfo],
    texts: Sequence[pa.Array],
    rows: int,
    lsn: Lsn,
    seq_start: int,
    leading_truncate: bool,
    where: str,
    schema: pa.Schema | None = None,
    options: TableOptions = DEFAULT_OPTIONS,
    specials: dict[str, int] | None = None,
    key: Collection[str] = (),
) -> pa.Table:
    """Rows of one part in the layout of batch/writer.py: op I rows (after an op T row).

    ``_pg_seq`` is 0 for the TRUNCATE, then ``seq_start``, ``seq_start + 1``, ... (capped at
    int32: each key occurs once in a snapshot, so only the order against the TRUNCATE matters).
    Numeric NaN/Infinity staged as null in a decimal column are added to ``specials``. ``key``:
    the columns the table is matched by, where ±infinity is a bad value (not clamped).
    """
    schema = schema or snapshot_part_schema(columns, options.staging)
    count = rows + (1 if leading_truncate else 0)
    seqs = (
        pc.min_element_wise(
            pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), rows), start=seq_start - 1),
            pa.scalar(SEQ_MAX, pa.int64()),
        )
        if rows
        else pa.array([], pa.int64())
    )
    ops = pa.repeat(pa.scalar("I"), rows)
    if leading_truncate:
        seqs = pa.concat_arrays([pa.array([0], pa.int64()), seqs])
        ops = pa.concat_arrays([pa.array(["T"]), ops])
    lsns = pa.repeat(pa.scalar(int(lsn), pa.int64()), count)
    data: list[pa.Array] = [
        *metadata_columns(lsns, seqs, ops, [None] * count, [None] * count, lsns, [None] * count).values(),
        # No old images: a null struct shaped like the row, as the writer stages it.
        pa.nulls(count, schema.field(OLD).type),
    ]
    for column, text in zip(columns, texts):
        if leading_truncate:
            text = pa.concat_arrays([pa.nulls(1, pa.string()), text.cast(pa.string())])
        value = convert_snapshot_column(
            where, column.name, column.type_name, text, options, int(lsn), key=column.name in key
        )
        decimal = decimal_type(column, options.staging)
        if decimal is not None:
            value, nulled = as_decimal(value, decimal)
            if specials is not None:
                specials[column.name] = specials.get(column.name, 0) + nulled
        elif value.type == NAIVE_TIMESTAMP:
            value = value.cast(UTC_TIMESTAMP)  # the wall-clock time as UTC: same values
        data.append(value)
    return pa.Table.from_arrays(data, schema=schema)


def write_part_file(path: Path, table: pa.Table, *, tag: str = "") -> None:
    """One Parquet part, written under ``.part`` (``.<tag>.part``), fsynced, renamed: a reader, or
    a resumed copy, finds a whole part or none."""
    part = path.with_name(f"{path.name}.{tag}.part" if tag else path.name + ".part")
    pq.write_table(table, part, **PARQUET_OPTIONS)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


class ChunkSource(Protocol):
    """What :func:`copy_chunk` reads of a table's plan (the initial load's ``_TablePlan``)."""

    columns: list[ColumnInfo]
    state: dict[str, Any]
    options: TableOptions

    @property
    def name(self) -> str: ...

    @property
    def relpath(self) -> str: ...

    @property
    def matched_by(self) -> list[str]: ...

    def reads(self, index: int) -> ChunkRead: ...


class ChunkCopy(NamedTuple):
    """One copied chunk: its rows, part, TRUNCATE part (chunk 0 of a ``replace`` copy) and the
    numeric NaN/Infinity values staged as null, per column."""

    rows: int
    file: str | None
    truncate: str | None
    specials: dict[str, int]


def part_name(index: int) -> str:
    """Chunk ``index``'s part: the same name whichever worker or task attempt copies it."""
    return f"part-{index:05d}.parquet"


def attempt_tag() -> str:
    """A name for one attempt's temporary files, unique across processes and hosts."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def copy_chunk(
    conn: Connection[Any],
    plan: ChunkSource,
    index: int,
    tmp: Path,
    lsn: Lsn,
    chunk_rows: int,
    replace: bool,
    *,
    after_write: Callable[[int], None] | None = None,
) -> ChunkCopy:
    """Copy chunk ``index`` of ``plan`` into its part ``<tmp>/<table path>/part-<index>.parquet``.

    The part's name depends on the chunk only, and it is written under a temporary name of this
    attempt (``<name>.<tag>.part``), fsynced and renamed: a copy of the chunk done again (a retried
    Spark task, a resumed copy) replaces it whole, and two attempts at once never write one file.
    Returns its rows, file name, the TRUNCATE part's name (chunk 0 of a ``replace`` copy) and the
    numeric NaN/Infinity values staged as null, per column. ``after_write(rows)`` is called after
    each row group is written (the tests' fault injection)."""
    reads = plan.reads(index)
    names = [c.name for c in plan.columns]
    name = part_name(index)
    path = tmp / plan.relpath / name
    tag = attempt_tag()
    part = path.with_name(f"{name}.{tag}.part")
    truncate = None
    seq_start = (1 if replace else 0) + index * int(plan.state["seq_stride"])
    schema = snapshot_part_schema(plan.columns, plan.options.staging)
    specials: dict[str, int] = {}
    if replace and index == 0:
        # The TRUNCATE row in a part of its own: the chunks' parts hold rows only, so that a
        # merge creating the Delta table can commit them as they are.
        empty = [pa.array([], pa.string())] * len(plan.columns)
        table = part_table(plan.columns, empty, 0, lsn, 0, True, plan.name, schema, plan.options)
        write_part_file(tmp / plan.relpath / TRUNCATE_PART, table, tag=tag)
        truncate = TRUNCATE_PART
    writer: pq.ParquetWriter | None = None
    rows = 0
    try:
        with copy_pages_csv(conn, reads.schema, reads.table, names, reads.first, reads.stop) as copy:
            char_columns = {c.name: c.catalog_type for c in plan.columns if c.catalog_type in CHAR_TYPES}
            for texts, count in read_csv_columns(copy, names, chunk_rows, char_columns):
                table = part_table(
                    plan.columns,
                    texts,
                    count,
                    lsn,
                    seq_start + rows,
                    False,
                    plan.name,
                    schema,
                    plan.options,
                    specials,
                    plan.matched_by,
                )
                if writer is None:
                    writer = pq.ParquetWriter(part, schema, **PARQUET_OPTIONS)
                writer.write_table(table)
                rows += count
                if after_write is not None:
                    after_write(rows)
        if writer is None:
            return ChunkCopy(0, None, truncate, {})
        writer.close()
        writer = None
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        if writer is not None:
            writer.close()
    return ChunkCopy(rows, name, truncate, {column: count for column, count in specials.items() if count})
