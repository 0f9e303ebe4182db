"""The statements of the two snapshot kinds: page-range copies of an exported snapshot, and
key-range chunks of table snapshots with their watermarks (psycopg 3, no Airflow).

The initial snapshot (``capture/snapshot.py``) copies tables inside the snapshot a new slot
exported: :func:`import_snapshot` on every connection, :func:`lock_and_measure` and
:func:`count_rows_in_first_pages` to plan, :func:`copy_pages_csv` for each chunk.

Table snapshots (``capture/table_snapshot.py``) copy one table in key order while the slot
keeps flowing: :func:`emit_watermark` around each chunk, :func:`begin_chunk_snapshot` for the
chunk's transaction and what it sees, :func:`copy_key_range` for its rows and
:func:`largest_key` for where the copy ends.

Names are composed as identifiers (``psycopg.sql``), values as literals; nothing user-given is
formatted into SQL as text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import StagingError
from airflow_provider_pgdecode.postgres.catalog import ColumnInfo, TableKey
from airflow_provider_pgdecode.postgres.session import (
    Connection,
    begin_read_only_snapshot,
    pin_settings,
    require_autocommit,
    server_version,
)

KeyValues = Sequence[str | None]
"""A key as COPY prints it: one text per key column, ``None`` for NULL (only in a key of all columns)."""


def _one(conn: Connection, query: str | sql.Composed, params: Sequence[Any] | None = None) -> tuple[Any, ...]:
    # tuple_row: the connection may come with another row factory.
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query, params)
        row = cur.fetchone()
    assert row is not None
    return row


# ----------------------------------------------------------------------------------------------
# The initial snapshot: page ranges inside an exported snapshot
# ----------------------------------------------------------------------------------------------


def import_snapshot(
    conn: Connection, snapshot_name: str, slot_name: str, *, extra_settings: Sequence[tuple[str, str]] = ()
) -> None:
    """Pin the session settings, then open a ``REPEATABLE READ, READ ONLY`` transaction in the
    exported snapshot: every connection of one copy sees exactly the slot's consistent point.

    ``extra_settings`` are pinned with the formatting ones (the copying workers' scan settings).
    A snapshot no longer exported is a :class:`StagingError` saying what to do.
    """
    require_autocommit(conn, "stage_snapshot")
    pin_settings(conn, extra=extra_settings)
    begin_read_only_snapshot(conn)
    try:
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
    except psycopg.Error as exc:
        conn.execute("ROLLBACK")
        raise StagingError(
            f"cannot import snapshot {snapshot_name!r} of slot {slot_name!r}: {str(exc).strip()}. A snapshot is "
            "exported only while the replication connection that created the slot is open, so an unfinished copy "
            "can resume only inside that create_slot_with_snapshot block. Drop the slot and start the initial load "
            "again."
        ) from None


@dataclass(frozen=True)
class RelationSize:
    """A table's size as the snapshot copy plans it: pages, and the file that holds them."""

    block_size: int
    size: int
    """Bytes of the main fork."""
    relfilenode: int | None
    """Changes when the table is rewritten (``VACUUM FULL``, ``CLUSTER``, some ``ALTER TABLE``)."""

    @property
    def pages(self) -> int:
        return self.size // self.block_size


def lock_and_measure(conn: Connection, schema: str, table: str) -> RelationSize:
    """Lock the table in ACCESS SHARE mode for the rest of the transaction, then measure it.

    The lock keeps rewrites (``VACUUM FULL``, ``CLUSTER``, ``ALTER TABLE``) out until the copy
    ends, so the snapshot's tuples stay on the pages the plan assigns them to.
    """
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(sql.Identifier(schema, table)))
    block_size, size, relfilenode = _one(
        conn,
        "SELECT current_setting('block_size')::int, pg_relation_size(c.oid), pg_relation_filenode(c.oid)"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    )
    return RelationSize(int(block_size), int(size), relfilenode)


def partition_leaf_tables(conn: Connection, schema: str, table: str) -> list[tuple[str, str, str]]:
    """The leaf partitions of ``schema.table`` (empty for a table that is not partitioned), as
    ``(schema, table, relkind)`` in the order of the partition tree: ``r`` a heap, ``f`` a foreign table."""
    query = (
        "SELECT n.nspname::text, c.relname::text, c.relkind::text"
        " FROM pg_partition_tree(%s::regclass) t JOIN pg_class c ON c.oid = t.relid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf AND t.level > 0 ORDER BY t.level, c.oid"
    )
    with conn.cursor(row_factory=tuple_row) as cur:
        rows = cur.execute(query, (sql.Identifier(schema, table).as_string(conn),)).fetchall()
    return [(str(s), str(t), str(k)) for s, t, k in rows]


def has_tid_range_scans(conn: Connection) -> bool:
    """Whether ``ctid`` ranges are read by TID range scans (PostgreSQL 14+), not filtered from a full scan."""
    return server_version(conn) >= 140000


def count_rows_in_first_pages(conn: Connection, schema: str, table: str, pages: int) -> int:
    """Rows visible in the table's first ``pages`` pages: a cheap sample of rows per page."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE ctid < {}::tid").format(
        sql.Identifier(schema, table), sql.Literal(f"({pages},0)")
    )
    return int(_one(conn, query)[0])


@contextmanager
def copy_pages_csv(
    conn: Connection,
    schema: str,
    table: str,
    columns: Sequence[str],
    first_page: int | None,
    stop_page: int | None,
) -> Iterator[Iterable[bytes | bytearray | memoryview]]:
    """``COPY (SELECT <columns> FROM t WHERE <ctid range>) TO STDOUT (FORMAT csv)`` in progress.

    Yields the COPY to iterate for its rows, as libpq hands them over (no copy, no parse: the
    caller gathers them in bulk). The range is pages ``[first_page, stop_page)``; ``None``
    leaves that side open (both ``None``: the whole table, with no ``ctid`` condition at all).
    """
    conditions = []
    if first_page is not None:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({first_page},0)")))
    if stop_page is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({stop_page},0)")))
    query = sql.SQL("COPY (SELECT {} FROM {}{}) TO STDOUT (FORMAT csv)").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        sql.Identifier(schema, table),
        sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL(""),
    )
    with conn.cursor() as cur, cur.copy(query) as copy:
        yield copy


# ----------------------------------------------------------------------------------------------
# Table snapshots: watermarks, the chunk's snapshot, key ranges
# ----------------------------------------------------------------------------------------------


def emit_watermark(conn: Connection, prefix: str, content: str) -> Lsn:
    """A transactional logical message in a transaction of its own; its LSN orders a chunk.

    Committed with ``synchronous_commit = local``: flushed locally before the peek reads the
    WAL, and never waiting for a standby.
    """
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = local")
        row = _one(conn, "SELECT pg_logical_emit_message(true, %s, %s::text)::text", (prefix, content))
    return Lsn.parse(row[0])


@dataclass(frozen=True)
class ChunkSnapshot:
    """What the chunk transaction's snapshot sees (``pg_current_snapshot()``, 64-bit xids), and
    the xids whose commits are in the WAL but wait for a synchronous standby (not yet visible)."""

    xmin: int
    xmax: int
    xip: frozenset[int]
    waiting: tuple[str, ...]


def begin_chunk_snapshot(conn: Connection) -> ChunkSnapshot:
    """Open a ``REPEATABLE READ, READ ONLY`` transaction and describe its snapshot.

    The transaction stays open: the chunk is read in it (end it with ``commit``/``rollback``).
    ``waiting`` comes from ``pg_stat_activity``, which shows other users' sessions to members
    of ``pg_monitor``.
    """
    begin_read_only_snapshot(conn)
    row = _one(
        conn,
        "SELECT pg_snapshot_xmin(s)::text, pg_snapshot_xmax(s)::text,"
        " array(SELECT x::text FROM pg_snapshot_xip(s) x),"
        # Committed in the WAL, invisible until a synchronous standby answers.
        " array(SELECT a.backend_xid::text FROM pg_stat_activity a WHERE a.wait_event = 'SyncRep'"
        "  AND a.backend_xid IS NOT NULL)"
        " FROM pg_current_snapshot() s",
    )
    return ChunkSnapshot(int(row[0]), int(row[1]), frozenset(int(x) for x in row[2]), tuple(row[3]))


def _key_columns(columns: Sequence[ColumnInfo], key: TableKey) -> list[ColumnInfo]:
    by_name = {c.name: c for c in columns}
    return [by_name[k] for k in key.columns]


def _value(column: ColumnInfo, value: str | None) -> sql.Composable:
    return sql.SQL("{}::{}").format(sql.Literal(value), sql.SQL(column.catalog_type))


def _unique_bound(key: list[ColumnInfo], values: KeyValues, op: str) -> sql.Composable:
    # A row comparison: answered by the key's b-tree index. Its columns are NOT NULL.
    literals: list[sql.Composable] = [_value(c, v) for c, v in zip(key, values)]
    return sql.SQL("({}) {} ({})").format(
        sql.SQL(", ").join(sql.Identifier(c.name) for c in key), sql.SQL(op), sql.SQL(", ").join(literals)
    )


def _nullable_bound(key: list[ColumnInfo], values: KeyValues, after: bool) -> sql.Composable:
    """``key > values`` (``after``) or ``key <= values`` in the order of ``ORDER BY`` the key's
    columns ascending: NULLs last and equal to each other (a row comparison would be NULL)."""
    alternatives: list[sql.Composable] = []
    prefix: list[sql.Composable] = []
    for column, value in zip(key, values):
        name = sql.Identifier(column.name)
        if value is None:
            step = None if after else sql.SQL("{} IS NOT NULL").format(name)
            equal = sql.SQL("{} IS NULL").format(name)
        else:
            literal = _value(column, value)
            template = "({0} > {1} OR {0} IS NULL)" if after else "{0} < {1}"
            step = sql.SQL(template).format(name, literal)
            equal = sql.SQL("{} = {}").format(name, literal)
        if step is not None:
            alternatives.append(sql.SQL(" AND ").join([*prefix, step]))
        prefix.append(equal)
    if not after:
        alternatives.append(sql.SQL(" AND ").join(prefix))
    if not alternatives:
        return sql.SQL("FALSE")
    return sql.SQL("({})").format(sql.SQL(" OR ").join(sql.SQL("({})").format(a) for a in alternatives))


def copy_key_range(
    conn: Connection,
    schema: str,
    table: str,
    columns: Sequence[ColumnInfo],
    key: TableKey,
    after: KeyValues | None,
    upto: KeyValues | None,
    limit: int,
) -> list[tuple[str | None, ...]]:
    """The next rows in key order: ``key > after`` and ``key <= upto`` (``None``: no bound), at
    most ``limit`` of them, as text (``None`` for NULL), in one ``COPY (SELECT ...) TO STDOUT``.

    A unique key (primary key, replica identity index) is one row comparison, answered by its
    index: ``COPY (SELECT ... WHERE (k1, k2) > (...) ORDER BY k1, k2 LIMIT n)``. A key of all
    columns (REPLICA IDENTITY FULL) may hold NULLs and repeat: its bounds treat NULLs as the
    ``ORDER BY`` does (last, equal to each other), and ``FETCH FIRST n ROWS WITH TIES`` keeps
    the copies of the last row together, so the next chunk's ``key > after`` skips none of them.
    """
    key_columns = _key_columns(columns, key)
    conditions: list[sql.Composable] = []
    if after is not None:
        conditions.append(
            _unique_bound(key_columns, after, ">") if key.unique else _nullable_bound(key_columns, after, True)
        )
    if upto is not None:
        conditions.append(
            _unique_bound(key_columns, upto, "<=") if key.unique else _nullable_bound(key_columns, upto, False)
        )
    where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    limit_clause = "LIMIT {}" if key.unique else "FETCH FIRST {} ROWS WITH TIES"
    query = sql.SQL("COPY (SELECT {} FROM {}{} ORDER BY {} " + limit_clause + ") TO STDOUT").format(
        sql.SQL(", ").join(sql.Identifier(c.name) for c in columns),
        sql.Identifier(schema, table),
        where,
        sql.SQL(", ").join(sql.Identifier(c.name) for c in key_columns),
        sql.Literal(limit),
    )
    with conn.cursor() as cur, cur.copy(query) as out:
        return list(out.rows())


def largest_key(conn: Connection, schema: str, table: str, key: TableKey) -> list[str | None] | None:
    """The table's largest key as text (as COPY prints it), or None for an empty table.

    Descending order puts NULLs first, so for a key of all columns this is the last key of
    :func:`copy_key_range`'s ascending order, NULLs and all.
    """
    query = sql.SQL("COPY (SELECT {} FROM {} ORDER BY {} LIMIT 1) TO STDOUT").format(
        sql.SQL(", ").join(sql.Identifier(k) for k in key.columns),
        sql.Identifier(schema, table),
        sql.SQL(", ").join(sql.SQL("{} DESC").format(sql.Identifier(k)) for k in key.columns),
    )
    with conn.cursor() as cur, cur.copy(query) as out:
        rows = list(out.rows())
    return list(rows[0]) if rows else None


__all__ = [
    "ChunkSnapshot",
    "KeyValues",
    "RelationSize",
    "begin_chunk_snapshot",
    "copy_key_range",
    "copy_pages_csv",
    "count_rows_in_first_pages",
    "emit_watermark",
    "has_tid_range_scans",
    "import_snapshot",
    "largest_key",
    "lock_and_measure",
]
