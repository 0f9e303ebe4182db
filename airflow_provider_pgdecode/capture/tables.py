"""Which tables a capture run selects, as ``(schema, table)`` pairs. Plain Python."""

from __future__ import annotations

from collections.abc import Collection


def parse_table_names(tables: Collection[str | tuple[str, str]]) -> set[tuple[str, str]]:
    """``["public.orders", ("sales", "line.items")]`` to pairs; a name without a schema means
    ``public``. Give ``(schema, table)`` pairs for names that contain a dot."""
    out = set()
    for name in tables:
        if isinstance(name, tuple):
            out.add(name)
            continue
        schema, dot, table = name.partition(".")
        out.add((schema, table) if dot else ("public", schema))
    return out
