"""How the initial load cuts a table's copy into chunks: ``ctid`` page ranges of the table, or of
each leaf partition of a partitioned table.

A chunk is a range of heap pages read by a TID range scan (PostgreSQL 14+), so the workers of
:func:`~airflow_provider_pgdecode.capture.snapshot.stage_snapshot` share a large table. A
partitioned table has no pages of its own: its chunks are those of its leaf partitions, one
after another, so a large root is copied by all workers at once, each chunk read from one leaf and
staged as the root's rows (its Delta table is the root's: :mod:`.partitions`). A root with a leaf
that is not a heap table (a foreign table) is read whole, by one COPY of the root.

The plan is kept in the copy's progress record (its ``state``), so a resumed copy reads the same
chunks; :func:`chunk_reads` says what chunk ``index`` reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from psycopg import Connection

from airflow_provider_pgdecode.postgres.snapshot_queries import (
    count_rows_in_first_pages,
    has_tid_range_scans,
    lock_and_measure,
    partition_leaf_tables,
)

SAMPLE_PAGES = 32
"""Pages at the start of a table whose visible rows are counted to size its chunks."""


@dataclass(frozen=True)
class ChunkRead:
    """What one chunk reads: a relation, and its pages ``[first, stop)`` (``None``: open)."""

    schema: str
    table: str
    first: int | None
    stop: int | None
    pages: int
    """How many pages it reads (at least 1), for the progress report."""


def plan_chunks(
    conn: Connection[Any], schema: str, table: str, chunk_rows: int, chunk_pages: int | None
) -> dict[str, Any]:
    """The chunk plan of ``schema.table`` (locked in ACCESS SHARE mode, with its leaves, until the
    planning transaction ends: no rewrite moves the snapshot's tuples meanwhile): ``relfilenode``
    (what a resumed copy compares), ``pages``, ``chunks``, ``seq_stride`` (the ``_pg_seq`` values
    a chunk may use: heap tuples per page at most, times its pages) and, for a partitioned table,
    ``leaves``: each leaf's own plan, in the order their chunks come."""
    size = lock_and_measure(conn, schema, table)
    # MaxHeapTuplesPerPage: a chunk's rows get _pg_seq values from index * seq_stride on, so seqs
    # grow in physical order whatever the worker count.
    max_tuples = (size.block_size - 24) // 28
    leaves = partition_leaf_tables(conn, schema, table)
    if leaves and all(kind == "r" for _, _, kind in leaves):
        plans = [_leaf_plan(conn, leaf_schema, leaf, chunk_rows, chunk_pages) for leaf_schema, leaf, _ in leaves]
        return {
            "relfilenode": [[p["schema"], p["table"], p["relfilenode"]] for p in plans],
            "pages": sum(p["pages"] for p in plans),
            "pages_per_chunk": max([p["pages_per_chunk"] for p in plans], default=1),
            "chunks": max(1, sum(p["chunks"] for p in plans)),
            "seq_stride": max([p["pages_per_chunk"] for p in plans], default=1) * max_tuples,
            "leaves": plans,
        }
    if leaves:  # a foreign partition: no pages to range over
        return {"relfilenode": None, "pages": 0, "pages_per_chunk": 1, "chunks": 1, "seq_stride": max_tuples}
    per, chunks = _cut(conn, schema, table, size.pages, chunk_rows, chunk_pages)
    return {
        "relfilenode": size.relfilenode,
        "pages": size.pages,
        "pages_per_chunk": per,
        "chunks": chunks,
        "seq_stride": per * max_tuples,
    }


def chunk_reads(schema: str, table: str, state: dict[str, Any], index: int) -> ChunkRead:
    """What chunk ``index`` of the plan ``state`` (of ``schema.table``) reads."""
    for leaf in state.get("leaves") or ():
        if index < leaf["chunks"]:
            return _pages(leaf["schema"], leaf["table"], leaf, index)
        index -= leaf["chunks"]
    # An ordinary table; or a root whose leaves are all empty or not heaps: one COPY of the root.
    return _pages(schema, table, state, index)


def describe_plan(state: dict[str, Any]) -> str:
    """The plan in words, for the log."""
    leaves = state.get("leaves")
    text = f"{state['pages']} page(s) in {state['chunks']} chunk(s)"
    if leaves is not None:
        return f"{text}, over {len(leaves)} leaf partition(s)"
    return f"{text} of {state['pages_per_chunk']} page(s)"


def _pages(schema: str, table: str, plan: dict[str, Any], index: int) -> ChunkRead:
    chunks, per = int(plan["chunks"]), int(plan["pages_per_chunk"])
    if chunks <= 1:  # a single chunk reads the whole relation: no ctid condition at all
        return ChunkRead(schema, table, None, None, max(1, int(plan["pages"])))
    first, stop = index * per, (None if index == chunks - 1 else (index + 1) * per)
    return ChunkRead(schema, table, first, stop, max(1, (stop if stop is not None else int(plan["pages"])) - first))


def _leaf_plan(
    conn: Connection[Any], schema: str, table: str, chunk_rows: int, chunk_pages: int | None
) -> dict[str, Any]:
    size = lock_and_measure(conn, schema, table)
    per, chunks = _cut(conn, schema, table, size.pages, chunk_rows, chunk_pages)
    # An empty leaf has no chunk (its root's other leaves have them).
    chunks = chunks if size.pages else 0
    return {
        "schema": schema,
        "table": table,
        "relfilenode": size.relfilenode,
        "pages": size.pages,
        "pages_per_chunk": per,
        "chunks": chunks,
    }


def _cut(
    conn: Connection[Any], schema: str, table: str, pages: int, chunk_rows: int, chunk_pages: int | None
) -> tuple[int, int]:
    """Pages per chunk and chunks of a heap of ``pages`` pages."""
    if not has_tid_range_scans(conn):
        # Before PostgreSQL 14 a ctid range is a filter on a full scan, not a TID range scan.
        return max(pages, 1), 1
    per: int
    if chunk_pages is None:
        sample = count_rows_in_first_pages(conn, schema, table, SAMPLE_PAGES)
        per = max(1, math.ceil(chunk_rows / max(1.0, sample / SAMPLE_PAGES)))
    else:
        per = chunk_pages
    return per, max(1, math.ceil(pages / per))
