"""Which tables a capture run selects, as ``(schema, table)`` pairs."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from airflow_provider_pgdecode.batch.options import TableOptions, options_for, parse_table_options, qualified_name
from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.postgres.catalog import Catalog, SourceTable, source_tables


def parse_table_names(tables: Collection[str | tuple[str, str]]) -> set[tuple[str, str]]:
    """``["public.orders", ("sales", "line.items")]`` to pairs; a name without a schema means
    ``public``. Give ``(schema, table)`` pairs for names that contain a dot."""
    return {name if isinstance(name, tuple) else qualified_name(name) for name in tables}


def as_table_names(value: str | Collection[str] | None) -> list[str]:
    """A templated list of table names as a list: one name (a string), a list of them, or empty."""
    if not value:
        return []
    return [value] if isinstance(value, str) else [str(name) for name in value if name]


def select_tables(
    catalog: Catalog,
    *,
    publication: str | None = None,
    exclude_tables: Collection[str | tuple[str, str]] = (),
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
) -> list[tuple[str, str]]:
    """The tables a pipeline loads when none are named: every ordinary and partitioned table
    outside the system schemas (in ``publication`` for pgoutput), minus ``exclude_tables``.

    Nothing is skipped silently: a table without a usable key (:meth:`Catalog.table_key`
    refuses it) that is not loaded ``append_only`` makes this raise ONE :class:`CatalogError`
    naming every such table, why, and the ways forward. Run it before the slot is read.
    """
    excluded = parse_table_names(exclude_tables)
    options = parse_table_options(table_options)
    selected: list[tuple[str, str]] = []
    refused: list[SourceTable] = []
    for table in source_tables(catalog, publication):
        pair = (table.schema, table.table)
        if pair in excluded:
            continue
        if options_for(options, *pair).mode != "append_only" and (
            not table.has_primary_key or table.replica_identity == "nothing"
        ):
            try:  # the one rule: a primary key, a replica identity index, or REPLICA IDENTITY FULL
                catalog.table_key(*pair)
            except CatalogError:
                refused.append(table)
                continue
        selected.append(pair)
    if refused:
        raise unloadable_tables_error(refused)
    return selected


def unloadable_tables_error(tables: Sequence[SourceTable]) -> CatalogError:
    """Tables whose UPDATEs and DELETEs PostgreSQL logs without a key, with the ways forward."""
    lines = []
    for table in tables:
        if table.has_primary_key:
            fix = f"ALTER TABLE {_quoted(table)} REPLICA IDENTITY DEFAULT"
        else:
            fix = (
                f"add a primary key, or ALTER TABLE {_quoted(table)} REPLICA IDENTITY FULL (identical rows then "
                "stay distinct), or, if it only receives inserts, table_options "
                f'{{"{table.name}": {{"mode": "append_only"}}}}'
            )
        lines.append(f"  - {table.name}: {table.describe_identity()}: {fix}")
    names = ", ".join(f'"{table.name}"' for table in tables)
    return CatalogError(
        f"{len(tables)} table(s) cannot be loaded: PostgreSQL logs nothing that says which row their UPDATEs and "
        "DELETEs change, and skipping them would lose their changes. Checked before reading or creating the slot: nothing was staged.\n"
        + "\n".join(lines)
        + f"\nOr leave them out of the pipeline with exclude_tables [{names}] (or name the tables to load)."
    )


def _quoted(table: SourceTable) -> str:
    """``schema.table`` quoted as SQL would need it (for a statement to copy)."""

    def ident(name: str) -> str:
        plain = name.isidentifier() and name == name.lower() and name.isascii()
        return name if plain else '"' + name.replace('"', '""') + '"'

    return f"{ident(table.schema)}.{ident(table.table)}"
