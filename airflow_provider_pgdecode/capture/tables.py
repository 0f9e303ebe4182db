"""Which tables a capture run selects, as ``(schema, table)`` pairs. Plain Python."""

from __future__ import annotations

from collections.abc import Collection

from airflow_provider_pgdecode.batch.options import qualified_name


def parse_table_names(tables: Collection[str | tuple[str, str]]) -> set[tuple[str, str]]:
    """``["public.orders", ("sales", "line.items")]`` to pairs; a name without a schema means
    ``public``. Give ``(schema, table)`` pairs for names that contain a dot."""
    return {name if isinstance(name, tuple) else qualified_name(name) for name in tables}
