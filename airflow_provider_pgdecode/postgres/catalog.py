"""Catalog lookups for source tables: columns, primary keys, replica identity (psycopg 3, no Airflow).

Schema and table names are always passed as query parameters, never formatted into SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.errors import CatalogError

ReplicaIdentityKind = Literal["default", "nothing", "full", "index"]

_RELREPLIDENT: dict[str, ReplicaIdentityKind] = {"d": "default", "n": "nothing", "f": "full", "i": "index"}


@dataclass(frozen=True)
class ColumnInfo:
    """One live column of a table.

    ``type_name`` is ``format_type(atttypid, NULL)``, the spelling test_decoding prints
    (``character varying``, ``integer[]``); ``catalog_type`` carries the typmod
    (``character varying(20)``, ``numeric(12,2)``).
    """

    name: str
    type_name: str
    catalog_type: str
    not_null: bool
    attnum: int
    user_type: str | None = None
    """``enum``, ``domain``, ``composite``, ``range`` or ``multirange`` for a user-defined type
    (of the element, for an array); ``None`` for built-in base types."""


@dataclass(frozen=True)
class ReplicaIdentity:
    """A table's REPLICA IDENTITY and the columns it puts in old-key images.

    ``columns`` are the primary key's for ``default`` (empty without a primary key), the
    index's for ``index``, all columns for ``full`` and none for ``nothing``.
    """

    kind: ReplicaIdentityKind
    columns: tuple[str, ...]
    index_name: str | None = None


class Catalog:
    """Catalog lookups over one psycopg 3 connection (any transaction mode)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def _all(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        # tuple_row: the connection may come with another row factory (Airflow's "cursor" extra).
        with self.conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(query, params)
            return cur.fetchall()

    def _relation(self, schema: str, table: str) -> tuple[int, str, str]:
        """(oid, relkind, relreplident) of ``schema.table``; :class:`CatalogError` when missing."""
        rows = self._all(
            "SELECT c.oid::int8, c.relkind::text, c.relreplident::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')",
            (schema, table),
        )
        if not rows:
            raise CatalogError(
                f"table {schema!r}.{table!r} does not exist in database {self.conn.info.dbname!r} "
                "(names are case-sensitive: give them as stored, without SQL quotes)"
            )
        oid, relkind, replident = rows[0]
        return int(oid), relkind, replident

    def columns(self, schema: str, table: str) -> list[ColumnInfo]:
        """The table's live columns in attnum order."""
        oid, _, _ = self._relation(schema, table)
        return [ColumnInfo(*row) for row in self._columns(oid)]

    def _columns(self, oid: int) -> list[tuple[Any, ...]]:
        # typtype of the column's type, or of its element type for an array.
        return self._all(
            "SELECT a.attname::text, format_type(a.atttypid, NULL), format_type(a.atttypid, a.atttypmod),"
            " a.attnotnull, a.attnum::int,"
            " CASE coalesce(e.typtype, t.typtype) WHEN 'e' THEN 'enum' WHEN 'd' THEN 'domain'"
            "  WHEN 'c' THEN 'composite' WHEN 'r' THEN 'range' WHEN 'm' THEN 'multirange' END"
            " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
            " LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'"
            " WHERE a.attrelid = %s::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (oid,),
        )

    def _index_columns(self, oid: int, condition: str) -> tuple[str | None, list[str]]:
        # Only key columns (not INCLUDE ones), in index column order.
        rows = self._all(
            "SELECT ic.relname::text, a.attname::text FROM pg_index i"
            " JOIN pg_class ic ON ic.oid = i.indexrelid"
            " CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
            f" WHERE i.indrelid = %s::oid AND {condition} AND k.ord <= i.indnkeyatts ORDER BY k.ord",
            (oid,),
        )
        return (rows[0][0] if rows else None), [row[1] for row in rows]

    def primary_key(self, schema: str, table: str) -> list[str]:
        """The primary key's columns in index order; empty when the table has none."""
        oid, _, _ = self._relation(schema, table)
        return self._index_columns(oid, "i.indisprimary")[1]

    def replica_identity(self, schema: str, table: str) -> ReplicaIdentity:
        """The table's replica identity and its columns."""
        oid, _, replident = self._relation(schema, table)
        kind = _RELREPLIDENT.get(replident)
        if kind is None:
            raise CatalogError(f"table {schema!r}.{table!r} has unknown relreplident {replident!r}")
        if kind == "nothing":
            return ReplicaIdentity(kind, ())
        if kind == "full":
            return ReplicaIdentity(kind, tuple(row[0] for row in self._columns(oid)))
        if kind == "default":
            return ReplicaIdentity(kind, tuple(self._index_columns(oid, "i.indisprimary")[1]))
        index_name, columns = self._index_columns(oid, "i.indisreplident")
        if index_name is None:
            # The index was dropped: PostgreSQL then behaves as NOTHING.
            return ReplicaIdentity("nothing", ())
        return ReplicaIdentity(kind, tuple(columns), index_name)

    def type_names(self) -> dict[int, str]:
        """``format_type`` names of every type by OID (what test_decoding prints for them)."""
        return {int(oid): name for oid, name in self._all("SELECT oid::int8, format_type(oid, NULL) FROM pg_type", ())}

    def tables_with_primary_key(
        self, exclude_schemas: Sequence[str] = ("pg_catalog", "information_schema", "pg_toast")
    ) -> list[tuple[str, str]]:
        """``(schema, table)`` of ordinary and partitioned tables with a primary key, sorted.

        Partitions are listed as well as their parents: test_decoding reports changes under
        the partition's name. Temporary schemas are skipped.
        """
        rows = self._all(
            "SELECT n.nspname::text, c.relname::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind IN ('r', 'p') AND c.relpersistence <> 't'"
            " AND n.nspname <> ALL(%s::text[])"
            " AND n.nspname NOT LIKE 'pg\\_temp\\_%%' AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%%'"
            " AND EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary)"
            " ORDER BY 1, 2",
            (list(exclude_schemas),),
        )
        return [(row[0], row[1]) for row in rows]
