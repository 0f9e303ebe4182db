"""Catalog lookups for source tables: columns, primary keys, replica identity (psycopg 3, no Airflow).

:meth:`Catalog.table_key` is the one rule for which columns identify a row of a table in Delta;
the extract, the initial snapshot and table snapshots all ask it.

Schema and table names are passed as query parameters, or composed as identifiers with
``psycopg.sql``; never formatted into SQL as text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.postgres.session import pin_settings

ReplicaIdentityKind = Literal["default", "nothing", "full", "index"]

_T = TypeVar("_T")

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
    generated: str = ""
    """``pg_attribute.attgenerated``: ``s`` for a stored generated column, ``v`` for a virtual one
    (PostgreSQL 18), empty otherwise. pgoutput sends stored ones only when the publication has
    ``publish_generated_columns = stored`` (18), virtual ones never; test_decoding prints stored
    ones and prints virtual ones as ``null``."""


@dataclass(frozen=True)
class ReplicaIdentity:
    """A table's REPLICA IDENTITY and the columns it puts in old-key images.

    ``columns`` are the primary key's for ``default`` (empty without a primary key), the
    index's for ``index``, all columns for ``full`` and none for ``nothing``.
    """

    kind: ReplicaIdentityKind
    columns: tuple[str, ...]
    index_name: str | None = None


KeySource = Literal["primary key", "replica identity index", "all columns"]


@dataclass(frozen=True)
class TableKey:
    """The columns that identify a row of a table in Delta, and where they come from.

    ``source`` is ``primary key``, ``replica identity index`` (REPLICA IDENTITY USING INDEX) or
    ``all columns`` (REPLICA IDENTITY FULL without either); ``replica_identity`` is the table's
    REPLICA IDENTITY kind, whatever the source.
    """

    columns: tuple[str, ...]
    replica_identity: ReplicaIdentityKind
    source: KeySource = "primary key"

    @property
    def unique(self) -> bool:
        """Whether PostgreSQL enforces the key's uniqueness (and NOT NULL): not so for all columns."""
        return self.source != "all columns"


_COLUMN_FIELDS = (
    "a.attname::text, format_type(a.atttypid, NULL), format_type(a.atttypid, a.atttypmod),"
    " a.attnotnull, a.attnum::int,"
    # typtype of the column's type, or of its element type for an array
    " CASE coalesce(e.typtype, t.typtype) WHEN 'e' THEN 'enum' WHEN 'd' THEN 'domain'"
    "  WHEN 'c' THEN 'composite' WHEN 'r' THEN 'range' WHEN 'm' THEN 'multirange' END,"
    " a.attgenerated::text"
)
"""The fields of a :class:`ColumnInfo`, selected from :data:`_LIVE_COLUMNS`."""
_LIVE_COLUMNS = (
    " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
    " LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'"
    " WHERE a.attnum > 0 AND NOT a.attisdropped"
)
_INDEX_KEY_COLUMNS = (
    "ARRAY(SELECT a.attname::text FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)"
    " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    " WHERE k.ord <= i.indnkeyatts ORDER BY k.ord)"
)
"""The key columns (not INCLUDE ones) of index ``i``, in index column order."""


@dataclass(frozen=True)
class TableDescription:
    """What :meth:`Catalog.describe` reads of one table."""

    key: TableKey | None
    """:meth:`Catalog.table_key`, or None when the table has none (:attr:`no_key` says why)."""
    no_key: CatalogError | None
    replica_identity: ReplicaIdentityKind
    columns: list[ColumnInfo]
    missing_values: dict[str, str]
    """:meth:`Catalog.missing_values`."""


def _given(value: _T) -> Callable[[], _T]:
    """A lookup whose answer is known already (:meth:`Catalog.table_keys` read it in bulk)."""
    return lambda: value


def _identity_kind(replident: str, has_identity_index: Callable[[], bool]) -> ReplicaIdentityKind | None:
    """The replica identity ``relreplident`` names, as PostgreSQL acts on it: USING INDEX whose
    index was dropped is NOTHING. ``None`` for an unknown ``relreplident``."""
    kind = _RELREPLIDENT.get(replident)
    if kind == "index" and not has_identity_index():
        return "nothing"
    return kind


def _unknown_identity(schema: str, table: str, replident: str) -> CatalogError:
    return CatalogError(f"table {schema!r}.{table!r} has unknown relreplident {replident!r}")


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
        return self._all(f"SELECT {_COLUMN_FIELDS}{_LIVE_COLUMNS} AND a.attrelid = %s::oid ORDER BY a.attnum", (oid,))

    def missing_values(self, schema: str, table: str) -> dict[str, str]:
        """Per column added with a default (``ADD COLUMN ... DEFAULT``), the value PostgreSQL shows
        in rows written before it (``pg_attribute.attmissingval``, a fast default: no WAL for those
        rows), as PostgreSQL prints it with the settings the decoding pins (an autocommit
        connection only; otherwise with the session's). Empty when the table has none (any table
        rewrite since materialized them)."""
        oid, _, _ = self._relation(schema, table)
        rows = self._pinned(
            "SELECT a.attname::text, a.attmissingval::text FROM pg_attribute a"
            " WHERE a.attrelid = %s::oid AND a.attnum > 0 AND NOT a.attisdropped AND a.atthasmissing",
            (oid,),
        )
        return {name: value for name, value in ((n, single_element(t)) for n, t in rows) if value is not None}

    def _pinned(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """``query``'s rows, values printed with the settings the decoding pins (an autocommit
        connection only; otherwise with the session's)."""
        if not self.conn.autocommit:
            return self._all(query, params)
        with self.conn.transaction():
            pin_settings(self.conn, local=True)
            return self._all(query, params)

    def describe(self, names: Collection[tuple[str, str]]) -> dict[tuple[str, str], TableDescription]:
        """:meth:`table_key`, :meth:`replica_identity`'s kind, :meth:`columns` and
        :meth:`missing_values` of each named table, in three queries whatever their number (the
        extract describes every staged table). A table that does not exist raises as those do."""
        wanted = sorted(set(names))
        found = {
            (schema, table): (int(oid), replident)
            for schema, table, oid, replident in self._all(
                "SELECT w.s, w.t, c.oid::int8, c.relreplident::text FROM unnest(%s::text[], %s::text[]) AS w(s, t)"
                " JOIN pg_namespace n ON n.nspname = w.s JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.t"
                " WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')",
                ([schema for schema, _ in wanted], [table for _, table in wanted]),
            )
        }
        for schema, table in wanted:
            if (schema, table) not in found:
                self._relation(schema, table)  # raises: no such table
        oids = [oid for oid, _ in found.values()]
        columns: dict[int, list[ColumnInfo]] = {oid: [] for oid in oids}
        missing: dict[int, dict[str, str]] = {oid: {} for oid in oids}
        for relid, *fields, missing_text in self._pinned(
            f"SELECT a.attrelid::int8, {_COLUMN_FIELDS}, CASE WHEN a.atthasmissing THEN a.attmissingval::text END"
            f"{_LIVE_COLUMNS} AND a.attrelid = ANY(%s::oid[]) ORDER BY a.attrelid, a.attnum",
            (oids,),
        ):
            columns[relid].append(ColumnInfo(*fields))
            value = None if missing_text is None else single_element(missing_text)
            if value is not None:
                missing[relid][fields[0]] = value
        primary: dict[int, list[str]] = {}
        identity: dict[int, tuple[str | None, list[str]]] = {}
        for relid, is_primary, is_identity, index_name, index_columns in self._all(
            f"SELECT i.indrelid::int8, i.indisprimary, i.indisreplident, ic.relname::text, {_INDEX_KEY_COLUMNS}"
            " FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid"
            " WHERE i.indrelid = ANY(%s::oid[]) AND (i.indisprimary OR i.indisreplident)",
            (oids,),
        ):
            if is_primary:
                primary[relid] = list(index_columns)
            if is_identity:
                identity[relid] = (index_name, list(index_columns))
        described = {}
        for (schema, table), (oid, replident) in found.items():
            key: TableKey | None = None
            try:
                key = self._key_of(
                    schema,
                    table,
                    replident,
                    primary.get(oid, []),
                    _given(identity.get(oid, (None, []))),
                    _given([column.name for column in columns[oid]]),
                )
            except CatalogError as error:
                no_key: CatalogError | None = error
            else:
                no_key = None
            kind = _identity_kind(replident, _given(oid in identity))
            if kind is None:
                raise _unknown_identity(schema, table, replident)
            described[(schema, table)] = TableDescription(key, no_key, kind, columns[oid], missing[oid])
        return described

    def _index_columns(self, oid: int, condition: str) -> tuple[str | None, list[str]]:
        rows = self._all(
            f"SELECT ic.relname::text, {_INDEX_KEY_COLUMNS} FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid"
            f" WHERE i.indrelid = %s::oid AND {condition} LIMIT 1",
            (oid,),
        )
        return (rows[0][0], list(rows[0][1])) if rows else (None, [])

    def primary_key(self, schema: str, table: str) -> list[str]:
        """The primary key's columns in index order; empty when the table has none."""
        oid, _, _ = self._relation(schema, table)
        return self._index_columns(oid, "i.indisprimary")[1]

    def replica_identity(self, schema: str, table: str) -> ReplicaIdentity:
        """The table's replica identity and its columns."""
        oid, _, replident = self._relation(schema, table)
        identity = functools.cache(lambda: self._index_columns(oid, "i.indisreplident"))
        kind = _identity_kind(replident, lambda: identity()[0] is not None)
        if kind is None:
            raise _unknown_identity(schema, table, replident)
        if kind == "nothing":
            return ReplicaIdentity(kind, ())
        if kind == "full":
            return ReplicaIdentity(kind, tuple(row[0] for row in self._columns(oid)))
        if kind == "default":
            return ReplicaIdentity(kind, tuple(self._index_columns(oid, "i.indisprimary")[1]))
        index_name, columns = identity()
        return ReplicaIdentity(kind, tuple(columns), index_name)

    def table_key(self, schema: str, table: str) -> TableKey:
        """Which columns identify a row of ``schema.table`` in Delta: the one rule for every reader.

        The primary key; else the REPLICA IDENTITY USING INDEX columns; else, under REPLICA
        IDENTITY FULL, all columns (PostgreSQL then logs the whole old row, so the whole row is
        what an UPDATE or DELETE names); else :class:`CatalogError`, since PostgreSQL logs
        nothing that says which row an UPDATE or DELETE changed. Why one rule: the incremental
        extract and the snapshots must key a table alike, or a table that flows incrementally
        could not be added or re-snapshotted (and the merge refuses a key that changes).
        """
        oid, _, replident = self._relation(schema, table)
        return self._key_of(
            schema,
            table,
            replident,
            self._index_columns(oid, "i.indisprimary")[1],
            lambda: self._index_columns(oid, "i.indisreplident"),
            lambda: [row[0] for row in self._columns(oid)],
        )

    def table_keys(
        self, exclude_schemas: Sequence[str] = ("pg_catalog", "information_schema", "pg_toast")
    ) -> dict[tuple[str, str], TableKey]:
        """:meth:`table_key` of every ordinary and partitioned table that has one (as
        :func:`source_tables` lists them), in one query: what the extract's writers stage keys by."""
        columns = (
            "ARRAY(SELECT a.attname::text FROM pg_index i"
            " CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
            " WHERE i.indrelid = c.oid AND {} AND k.ord <= i.indnkeyatts ORDER BY k.ord)"
        )
        rows = self._all(
            "SELECT n.nspname::text, c.relname::text, c.relreplident::text,"
            f" {columns.format('i.indisprimary')},"
            " (SELECT ic.relname::text FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid"
            "  WHERE i.indrelid = c.oid AND i.indisreplident LIMIT 1),"
            f" {columns.format('i.indisreplident')},"
            " CASE WHEN c.relreplident = 'f' THEN ARRAY(SELECT a.attname::text FROM pg_attribute a"
            "  WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum) END"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind IN ('r', 'p') AND c.relpersistence <> 't'"
            " AND n.nspname <> ALL(%s::text[])"
            " AND n.nspname NOT LIKE 'pg\\_temp\\_%%' AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%%'",
            (list(exclude_schemas),),
        )
        keys = {}
        for schema, table, replident, primary, index_name, index_columns, all_columns in rows:
            try:
                keys[(schema, table)] = self._key_of(
                    schema,
                    table,
                    replident,
                    list(primary),
                    _given((index_name, list(index_columns))),
                    _given(list(all_columns or ())),
                )
            except CatalogError:
                continue  # no usable key: the extract refuses the table, or loads it append_only
        return keys

    def _key_of(
        self,
        schema: str,
        table: str,
        replident: str,
        primary: list[str],
        identity_index: Callable[[], tuple[str | None, list[str]]],
        all_columns: Callable[[], list[str]],
    ) -> TableKey:
        """:meth:`table_key`'s rule over what the catalog says of the table: its ``relreplident``,
        primary key columns, replica identity index (name, columns) and live columns."""
        identity = functools.cache(identity_index)
        kind = _identity_kind(replident, lambda: identity()[0] is not None)
        if kind is None:
            raise _unknown_identity(schema, table, replident)
        if primary:
            if kind == "nothing":
                raise CatalogError(
                    f"table {schema}.{table} has a primary key ({', '.join(primary)}) but REPLICA IDENTITY NOTHING: "
                    "PostgreSQL logs no key for its UPDATEs and DELETEs, so they cannot be matched in Delta. Run "
                    f"ALTER TABLE {sql.Identifier(schema, table).as_string(self.conn)} REPLICA IDENTITY DEFAULT "
                    "(changes logged before stay keyless: resnapshot the table afterwards), or leave the table out "
                    "with exclude_tables."
                )
            return TableKey(tuple(primary), kind, "primary key")
        if kind == "index":
            return TableKey(tuple(identity()[1]), kind, "replica identity index")
        if kind == "full":
            return TableKey(tuple(all_columns()), kind, "all columns")
        raise CatalogError(
            f"table {schema}.{table} has no primary key and REPLICA IDENTITY {kind.upper()}: its rows cannot be "
            "matched in Delta. Add a primary key (or a unique index with REPLICA IDENTITY USING INDEX), or set "
            "REPLICA IDENTITY FULL (every column then identifies a row; identical rows stay distinct), or load "
            "an insert-only table (a log, a history) with table_options mode 'append_only', or exclude the table "
            "with the tables option or exclude_tables."
        )

    def unorderable_columns(self, schema: str, table: str, columns: Sequence[ColumnInfo]) -> list[ColumnInfo]:
        """Those of ``columns`` that ``ORDER BY`` cannot sort (no default b-tree operator class).

        ``json``, ``point``, ``xml``, ``xid``, arrays and composites of such types: a key of all
        columns (REPLICA IDENTITY FULL) that holds one cannot be copied in key order. PostgreSQL
        itself answers, at parse time (``ORDER BY ... LIMIT 0`` reads no row): one statement
        when every column sorts, then one per column to name the culprits. Each probe runs in a
        savepoint (or its own transaction), so a transaction in progress survives a refusal.
        """
        if not columns:
            return []
        if self._sorts(schema, table, columns):
            return []
        return [column for column in columns if not self._sorts(schema, table, [column])]

    def _sorts(self, schema: str, table: str, columns: Sequence[ColumnInfo]) -> bool:
        query = sql.SQL("SELECT FROM {} ORDER BY {} LIMIT 0").format(
            sql.Identifier(schema, table), sql.SQL(", ").join(sql.Identifier(c.name) for c in columns)
        )
        try:
            with self.conn.transaction():
                self.conn.execute(query)
        except psycopg.errors.UndefinedFunction:  # "could not identify an ordering operator for type ..."
            return False
        return True

    def in_publication(self, publication: str, schema: str, table: str) -> bool:
        """Whether ``publication`` sends the table's changes (a pgoutput slot decodes nothing else);
        a partitioned table's are sent under its own name or under its partitions' (without
        ``publish_via_partition_root`` the publication lists those)."""
        return bool(
            self._all(
                "SELECT 1 FROM pg_publication_tables p JOIN pg_namespace n ON n.nspname = p.schemaname"
                " JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename"
                " JOIN pg_namespace rn ON rn.nspname = %s JOIN pg_class r ON r.relnamespace = rn.oid AND r.relname = %s"
                " WHERE p.pubname = %s AND (c.oid = r.oid OR (c.relispartition AND pg_partition_root(c.oid) = r.oid))",
                (schema, table, publication),
            )
        )

    def publishes_generated(self, publication: str | None) -> bool:
        """Whether ``publication`` sends stored generated columns (``publish_generated_columns =
        stored``, PostgreSQL 18; never before)."""
        if publication is None or self.conn.info.server_version < 180000:
            return False
        rows = self._all("SELECT pubgencols::text FROM pg_publication WHERE pubname = %s", (publication,))
        return bool(rows) and rows[0][0] == "s"

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

    def relation_oids(self, names: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """The OID of each ``(schema, table)`` of ``names`` as named now, in one query (a cycle
        over hundreds of tables asks once, not once a table); names no table has are left out."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        rows = self._all(
            "SELECT n.nspname, c.relname, c.oid::int8 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN unnest(%s::text[], %s::text[]) AS w(nspname, relname)"
            " ON w.nspname = n.nspname AND w.relname = c.relname"
            " WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')",
            ([schema for schema, _ in wanted], [table for _, table in wanted]),
        )
        return {(str(row[0]), str(row[1])): int(row[2]) for row in rows}

    def relation_files(self, oids: Sequence[int]) -> dict[int, tuple[int, str]]:
        """Per table of ``oids`` that exists now: its file node (``pg_relation_filenode``, 0 for a
        table without storage) and its live columns' signature (``attnum:type:typmod``, comma
        separated): a rewrite changes the first, a type change or a new column the second."""
        if not oids:
            return {}
        rows = self._all(
            "SELECT c.oid::int8, coalesce(pg_relation_filenode(c.oid), 0)::int8,"
            " coalesce(string_agg(a.attnum || ':' || a.atttypid || ':' || a.atttypmod, ',' ORDER BY a.attnum), '')"
            " FROM pg_class c LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
            " WHERE c.oid = ANY(%s::oid[]) AND c.relkind IN ('r', 'p', 'v', 'm', 'f') GROUP BY c.oid",
            ([int(oid) for oid in oids],),
        )
        return {int(oid): (int(filenode), str(columns)) for oid, filenode, columns in rows}

    def partition_roots(self) -> dict[tuple[str, str], tuple[int, tuple[str, str]]]:
        """Every partition (at any level) by ``(schema, table)``: the OID and name of the
        partitioned table at the top of its tree, whose Delta table its changes land in."""
        rows = self._all(
            "SELECT n.nspname::text, c.relname::text, r.oid::int8, rn.nspname::text, r.relname::text"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_class r ON r.oid = pg_partition_root(c.oid) JOIN pg_namespace rn ON rn.oid = r.relnamespace"
            " WHERE c.relispartition AND c.relkind IN ('r', 'p')",
            (),
        )
        return {(schema, table): (int(oid), (root_schema, root)) for schema, table, oid, root_schema, root in rows}

    def partition_leaves(self, roots: Sequence[int]) -> dict[int, dict[int, tuple[int, bool]]]:
        """Per partitioned table of ``roots`` that exists now, its leaf partitions by OID: each
        one's file node (a TRUNCATE gives it a new one) and whether it was attached to the tree
        after it was created (its ``pg_inherits`` row is younger than its row type, which
        ``CREATE TABLE … PARTITION OF`` makes in the same transaction)."""
        if not roots:
            return {}
        rows = self._all(
            "SELECT r.oid::int8, t.relid::oid::int8, coalesce(pg_relation_filenode(t.relid), 0)::int8,"
            " coalesce(i.xmin::text <> ty.xmin::text, false)"
            " FROM pg_class r CROSS JOIN LATERAL pg_partition_tree(r.oid) t"
            " LEFT JOIN pg_inherits i ON i.inhrelid = t.relid AND i.inhparent = t.parentrelid"
            " LEFT JOIN pg_type ty ON ty.typrelid = t.relid"
            " WHERE r.oid = ANY(%s::oid[]) AND r.relkind = 'p' AND t.isleaf AND t.level > 0",
            ([int(oid) for oid in roots],),
        )
        out: dict[int, dict[int, tuple[int, bool]]] = {}
        for root, leaf, filenode, attached in rows:
            out.setdefault(int(root), {})[int(leaf)] = (int(filenode), bool(attached))
        return out

    def publishes_via_root(self, publication: str) -> bool:
        """Whether ``publication`` sets ``publish_via_partition_root`` (its partitions' changes
        are sent under the root's name); ``False`` when there is no such publication."""
        rows = self._all("SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (publication,))
        return bool(rows and rows[0][0])

    def relation_names(self, oids: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``(schema, table)`` of each of ``oids`` that is a table now (a renamed table's new
        name); dropped ones are left out."""
        if not oids:
            return {}
        rows = self._all(
            "SELECT c.oid::int8, n.nspname::text, c.relname::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.oid = ANY(%s::oid[]) AND c.relkind IN ('r', 'p', 'v', 'm', 'f')",
            ([int(oid) for oid in oids],),
        )
        return {int(oid): (schema, table) for oid, schema, table in rows}


@dataclass(frozen=True)
class SourceTable:
    """An ordinary or partitioned table a pipeline may load, with what decides its key."""

    schema: str
    table: str
    replica_identity: ReplicaIdentityKind
    """As PostgreSQL applies it: a REPLICA IDENTITY USING INDEX whose index was dropped is ``nothing``."""
    has_primary_key: bool

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def describe_identity(self) -> str:
        """``REPLICA IDENTITY DEFAULT and no primary key``, as messages state it."""
        key = "a primary key" if self.has_primary_key else "no primary key"
        return f"REPLICA IDENTITY {self.replica_identity.upper()} and {key}"


def source_tables(
    catalog: Catalog,
    publication: str | None = None,
    exclude_schemas: Sequence[str] = ("pg_catalog", "information_schema", "pg_toast"),
) -> list[SourceTable]:
    """Ordinary and partitioned tables outside ``exclude_schemas`` and temporary schemas (and, for
    a pgoutput pipeline, in ``publication``), sorted by ``(schema, table)``: what a pipeline
    loads when no tables are named. A partition is listed as the partitioned table at the top of
    its tree, whose Delta table its changes land in (capture/partitions.py)."""
    in_publication = (
        " AND EXISTS (SELECT 1 FROM pg_publication_tables p"
        " WHERE p.pubname = %s AND p.schemaname = tn.nspname AND p.tablename = t.relname)"
        if publication is not None
        else ""
    )
    rows = catalog._all(
        "SELECT DISTINCT n.nspname::text, c.relname::text, c.relreplident::text,"
        " EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),"
        " EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)"
        " FROM pg_class t JOIN pg_namespace tn ON tn.oid = t.relnamespace"
        " JOIN pg_class c ON c.oid = CASE WHEN t.relispartition THEN pg_partition_root(t.oid) ELSE t.oid END"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE t.relkind IN ('r', 'p') AND t.relpersistence <> 't'"
        " AND n.nspname <> ALL(%s::text[])"
        " AND n.nspname NOT LIKE 'pg\\_temp\\_%%' AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%%'"
        f"{in_publication} ORDER BY 1, 2",
        (list(exclude_schemas), publication) if publication is not None else (list(exclude_schemas),),
    )
    tables = []
    for schema, table, replident, has_primary_key, has_identity_index in rows:
        kind = _identity_kind(replident, _given(bool(has_identity_index))) or "nothing"
        tables.append(SourceTable(schema, table, kind, bool(has_primary_key)))
    return tables


def single_element(text: str) -> str | None:
    """The element of a one-element array's text (``attmissingval``), ``None`` for NULL.

    Not split at the delimiter: a type whose arrays are ``;``-delimited (``box``) prints
    ``{(1,1),(0,0)}``, one element holding commas, unquoted."""
    inner = text[1:-1]
    if inner.startswith('"') and inner.endswith('"') and len(inner) >= 2:
        return re.sub(r"\\(.)", r"\1", inner[1:-1], flags=re.DOTALL)
    return None if inner == "NULL" else inner
