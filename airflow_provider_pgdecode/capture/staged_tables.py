"""What the manifest says of each staged table, read from the catalog when a batch closes, and
what the batch writer stages each table by (its replica identity and key), read when it opens.

Each table's key (the one rule of :meth:`~airflow_provider_pgdecode.postgres.catalog.Catalog.table_key`),
load mode, kept-as-text types, catalog types, ADD COLUMN defaults and generated columns the slot
did not send; and the refusals that belong there, before the batch is published (a keyless table
in a keyed mode, a clamped ±infinity in a key the writers did not know, a virtual generated column
test_decoding prints as null).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from airflow_provider_pgdecode.batch.badvalues import ClampedValue, clamped_key_error
from airflow_provider_pgdecode.batch.manifest import ColumnSummary, TableSummary
from airflow_provider_pgdecode.batch.options import KEPT_MODES, TableOptions, keyless_kept_mode_error, options_for
from airflow_provider_pgdecode.batch.values import arrow_type, json_value
from airflow_provider_pgdecode.errors import CatalogError, ValueConversionError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, source_tables
from airflow_provider_pgdecode.typemap import Staging

log = logging.getLogger(__name__)


def staged_identities_and_keys(
    catalog: Catalog,
) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any], set[tuple[str, str]]]:
    """What the batch writer stages by, read once per batch: each table's replica identity and key
    (±infinity in a date or timestamp key column is a bad value at staging), and the tables whose
    old image is the whole row (REPLICA IDENTITY FULL: only its key columns are staged)."""
    tables = source_tables(catalog)
    identities = {(t.schema, t.table): t.describe_identity() for t in tables}
    keys = {name: key.columns for name, key in catalog.table_keys().items()}
    return identities, keys, {(t.schema, t.table) for t in tables if t.replica_identity == "full"}


def describe_tables(
    catalog: Catalog,
    tables: list[TableSummary],
    options: Mapping[tuple[str, str], TableOptions],
    current: dict[tuple[str, str], tuple[str, str]] | None = None,
) -> None:
    """Add each table's key (:meth:`Catalog.table_key`, the one rule the snapshots follow too, read
    for every table at once: :meth:`Catalog.describe`),
    load mode, ``type_map`` and catalog types; a table the merge cannot key is a :class:`CatalogError` saying
    what to do, unless it is loaded ``append_only`` (appended, never matched: no key needed).
    ``current``: staged name -> the table's name now, for renamed tables; generated columns the
    slot did not send are named in ``generated_not_staged`` (:func:`_generated_not_staged`)."""
    names = {(s.schema, s.table): (current or {}).get((s.schema, s.table), (s.schema, s.table)) for s in tables}
    described = catalog.describe(names.values())
    for summary in tables:
        # The types the writers kept as text, by the options of the name they staged the table under.
        summary.type_map = dict(options_for(options, summary.schema, summary.table).type_map)
        schema, table = names[(summary.schema, summary.table)]
        summary.mode = options_for(options, schema, table).mode
        description = described[(schema, table)]
        key = description.key
        if key is None:
            if summary.mode != "append_only":
                assert description.no_key is not None
                raise description.no_key
            summary.replica_identity = description.replica_identity
        else:
            summary.key = list(key.columns)
            summary.replica_identity = key.replica_identity
            summary.key_source = key.source
            if summary.mode in KEPT_MODES and summary.keyed_by_all_columns:
                # Refused here, before the batch is published, not by the merge after it is staged.
                raise CatalogError(keyless_kept_mode_error(f"{schema}.{table}", summary.mode, "Nothing was staged."))
        live = {c.name: c for c in description.columns}
        defaults = description.missing_values
        staging = options_for(options, summary.schema, summary.table).staging
        if not summary.columns:
            summary.columns = _truncated_columns(live.values(), staging)
        for column in summary.columns:
            info = live.get(column.name)
            if info is not None:  # a column dropped since keeps what the slot said of it
                column.catalog_type = info.catalog_type
                column.user_type = info.user_type
                column.attnum = info.attnum
            if column.name in defaults:
                column.missing = _missing_value(summary, column.name, column.type, defaults[column.name], staging)
        # Only new row images show every column the slot sends (a DELETE's old key does not).
        full_rows = summary.inserts + summary.updates > 0
        missing = _generated_not_staged(schema, table, live.values(), {c.name for c in summary.columns}, full_rows)
        if missing:
            summary.generated_not_staged = missing


def carried_columns(columns: Sequence[ColumnInfo], plugin: str, stored_published: bool) -> list[ColumnInfo]:
    """The columns a snapshot copies: those the slot's changes carry, so that the Delta table never
    holds a column its changes leave stale. Virtual generated columns never (pgoutput leaves them
    out, test_decoding prints them as null); stored ones through test_decoding, and through
    pgoutput when the publication has ``publish_generated_columns = stored`` (``stored_published``)."""
    return [
        c for c in columns if not c.generated or (c.generated == "s" and (plugin != "pgoutput" or stored_published))
    ]


def _truncated_columns(live: Collection[ColumnInfo], staging: Staging) -> list[ColumnSummary]:
    """The columns of a table staged with TRUNCATEs only, which carry no row image: the catalog's
    live columns as a row image would name and stage them (generated ones left out, as pgoutput
    leaves them). Without them the merge could not type the key, and refused the whole run."""
    return [ColumnSummary(c.name, c.type_name, str(arrow_type(c.type_name, staging))) for c in live if not c.generated]


def check_clamped_keys(
    tables: list[TableSummary], clamped: Mapping[tuple[str, str], Mapping[str, ClampedValue]]
) -> None:
    """Refuse a batch in which ±infinity was staged clamped in a key column of a table whose key
    the writers did not know (created or renamed after the extract read the keys): clamped, two
    source keys would become one Delta row."""
    for summary in tables:
        found = clamped.get((summary.schema, summary.table))
        if not found or summary.mode == "append_only":
            continue
        for column in summary.key:
            if column in found:
                raise clamped_key_error(summary.schema, summary.table, found[column], summary.key)


def _missing_value(summary: TableSummary, column: str, pg_type: str, text: str, staging: Staging) -> Any:
    """A column's ADD COLUMN default for the rows written before it, as staged (JSON form), or
    ``None`` with a warning when it has no staged form (a BC date ...): the merge then leaves
    those rows NULL, as it did before the default was known."""
    try:
        return json_value(pg_type, text, staging)
    except (ValueConversionError, ValueError) as exc:
        log.warning(
            "table %s column %s: its ADD COLUMN default %r has no staged form (%s); Delta rows written "
            "before the column was added keep NULL in it",
            summary.qualified_name,
            column,
            text[:80],
            exc,
        )
        return None


def _generated_not_staged(
    schema: str, table: str, live: Collection[ColumnInfo], staged: set[str], full_rows: bool
) -> list[str]:
    """The table's generated columns the slot did not send (named in the manifest and logged,
    never silently absent); :class:`CatalogError` for a virtual one it did send, since
    test_decoding prints those as ``null`` whatever their value (PostgreSQL 18)."""
    virtual = [c.name for c in live if c.generated == "v" and c.name in staged]
    if virtual:
        raise CatalogError(
            f"table {schema}.{table} has virtual generated column(s) {', '.join(virtual)} (PostgreSQL 18), which "
            "test_decoding prints as null whatever their value, so staging them would write NULLs over real values. "
            "Read the table through a pgoutput slot (virtual columns are left out), or make the columns STORED"
        )
    missing = [c.name for c in live if c.generated and c.name not in staged] if full_rows else []
    if missing:
        log.warning(
            "Generated column(s) of %s.%s not staged: %s. pgoutput sends stored generated columns only when the "
            "publication has publish_generated_columns = stored (PostgreSQL 18: ALTER PUBLICATION ... SET "
            "(publish_generated_columns = stored)) and virtual ones never; compute them in Delta, or use "
            "test_decoding, which sends stored ones on every version",
            schema,
            table,
            ", ".join(missing),
        )
    return missing
