"""Which tables a capture run selects, as ``(schema, table)`` pairs.

The ``tables`` and ``exclude_tables`` of a pipeline hold ``schema.table`` names and glob
patterns (``public.order_*``, ``sales.*``, ``public.t_202[45]``: ``*`` any characters, ``?`` one,
``[abc]`` one of them), matched with :func:`fnmatch.fnmatchcase` against the schema and the table
name apart, so that ``*`` never crosses the dot. :func:`resolve_tables` is the one place a
selection becomes the tables of a run: names are taken as given, patterns are expanded against
the catalog (and the publication, for pgoutput) *when the task runs*, never when a DAG is parsed,
so a table created later that matches is loaded from the run after its creation on. A pattern that
matches no table is an error naming it and the tables that exist: a typo must not silently load
nothing. The lower layers (the extract, the snapshots) take names only; :func:`parse_table_names`
refuses a pattern that was not expanded.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.batch.options import TableOptions, options_for, parse_table_options, qualified_name
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError
from airflow_provider_pgdecode.postgres.catalog import Catalog, SourceTable, source_tables

log = logging.getLogger(__name__)

#: The characters that make an entry of ``tables`` or ``exclude_tables`` a glob pattern.
GLOB_CHARACTERS = "*?["

#: What a valid entry looks like, for the errors that refuse one.
TABLE_PATTERN_HELP = (
    "a table is 'schema.table': a name as PostgreSQL stores it, or a glob pattern with * (any characters), "
    "? (one character) or [abc] (one of them) in the schema or the table part, e.g. 'public.orders', "
    "'public.order_*', 'sales.*'"
)

# Characters no sane table name holds, that show another pattern language was meant.
_REFUSED = {
    "%": "SQL's % is no wildcard here: use *",
    "(": "this is a glob, not a regular expression",
    ")": "this is a glob, not a regular expression",
    "|": "this is a glob, not a regular expression: give one entry per pattern",
    "+": "this is a glob, not a regular expression",
    "^": "this is a glob, not a regular expression ([!abc] is one character but a, b and c)",
    "\\": "this is a glob, not a regular expression",
    "{": "braces are not expanded: give one entry per pattern",
    "}": "braces are not expanded: give one entry per pattern",
    ",": "give one entry per table",
    '"': "give names without SQL quotes (they are matched as stored, case-sensitive)",
    "'": "give names without SQL quotes (they are matched as stored, case-sensitive)",
}


def is_table_pattern(name: object) -> bool:
    """True for an entry holding a glob character (``*``, ``?``, ``[``)."""
    return isinstance(name, str) and any(c in name for c in GLOB_CHARACTERS)


def _refuse(text: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"{text!r} is not a valid table name or pattern: {why}; {TABLE_PATTERN_HELP}")


def _check_brackets(text: str, part: str) -> None:
    i = 0
    while i < len(part):
        if part[i] == "]":
            raise _refuse(text, "']' without '['")
        if part[i] == "[":
            start = i + 1 + (part[i + 1 : i + 2] == "!")
            close = part.find("]", start)
            if close == -1:
                raise _refuse(text, "'[' is not closed by ']'")
            if close == start:
                raise _refuse(text, "'[]' matches no character: list the characters, e.g. [0-9]")
            i = close + 1
            continue
        i += 1


def parse_table_pattern(text: str, *, require_schema: bool = False) -> tuple[str, str]:
    """Check one entry of a ``tables`` or ``exclude_tables`` list, a name or a glob pattern, and
    split it into its schema and table parts (each a name or a glob). Without a dot the schema is
    ``public``, unless ``require_schema``. A :class:`ConfigurationError` says what is wrong and what
    a valid entry looks like."""
    if not isinstance(text, str) or not text:
        raise _refuse(str(text), "an entry must be a non-empty string")
    if text != text.strip():
        raise _refuse(text, "it begins or ends with white space")
    for character, why in _REFUSED.items():
        if character in text:
            raise _refuse(text, why)
    if text.count(".") > 1:
        why = (
            "a pattern is a glob, not a regular expression: '.*' is written '*'"
            if ".*" in text
            else "more than one '.'"
        )
        raise _refuse(text, why)
    schema, dot, table = text.partition(".")
    if not dot:
        if require_schema:
            raise _refuse(text, f"it names no schema (write 'public.{text}' for a table of schema public)")
        schema, table = "public", text
    if not schema or not table:
        raise _refuse(text, "the schema or the table part is empty")
    for part in (schema, table):
        _check_brackets(text, part)
    return schema, table


@dataclass(frozen=True)
class TablePattern:
    """One glob pattern of a selection: ``text`` as given, its schema and table globs."""

    text: str
    schema: str
    table: str

    def matches(self, schema: str, table: str) -> bool:
        return fnmatch.fnmatchcase(schema, self.schema) and fnmatch.fnmatchcase(table, self.table)


@dataclass(frozen=True)
class TableSelection:
    """The names and the patterns of a ``tables`` or ``exclude_tables`` list."""

    names: frozenset[tuple[str, str]] = frozenset()
    patterns: tuple[TablePattern, ...] = ()

    @classmethod
    def parse(cls, entries: Collection[str | tuple[str, str]] | TableSelection) -> TableSelection:
        """Entries to a selection: ``(schema, table)`` pairs and plain names are names (a name
        without a schema means ``public``), strings with a glob character are patterns (checked
        by :func:`parse_table_pattern`)."""
        if isinstance(entries, TableSelection):
            return entries
        names: set[tuple[str, str]] = set()
        patterns: list[TablePattern] = []
        for entry in entries:
            if is_table_pattern(entry):
                assert isinstance(entry, str)
                patterns.append(TablePattern(entry, *parse_table_pattern(entry)))
            else:
                names.add(entry if isinstance(entry, tuple) else qualified_name(entry))
        return cls(frozenset(names), tuple(patterns))

    def __bool__(self) -> bool:
        return bool(self.names or self.patterns)

    def matches(self, schema: str, table: str) -> bool:
        """True when ``schema.table`` is one of the names or matches one of the patterns."""
        return (schema, table) in self.names or any(p.matches(schema, table) for p in self.patterns)


def later_tables(
    tables: Collection[str | tuple[str, str]] | TableSelection,
    exclude_tables: Collection[str | tuple[str, str]] | TableSelection = (),
) -> Callable[[str, str], bool] | None:
    """Whether a table that first shows up in a run's changes, after :func:`resolve_tables` chose
    the run's tables, belongs to the selection all the same: with ``tables`` empty every table
    does, with patterns those that match; neither if ``exclude_tables`` names or matches it. A table
    created while the run reads the slot is so staged from its first change, instead of having its
    first changes left out. ``None`` for a selection of names only (nothing is added). The key rule
    holds for such a table when the batch is described (:func:`~airflow_provider_pgdecode.capture.extract.extract_batch`)."""
    selection = TableSelection.parse(tables)
    excluded = TableSelection.parse(exclude_tables)
    if selection and not selection.patterns:
        return None

    def admits(schema: str, table: str) -> bool:
        if excluded.matches(schema, table):
            return False
        return not selection or any(pattern.matches(schema, table) for pattern in selection.patterns)

    return admits


def parse_table_names(tables: Collection[str | tuple[str, str]]) -> set[tuple[str, str]]:
    """``["public.orders", ("sales", "line.items")]`` to pairs; a name without a schema means
    ``public``. Give ``(schema, table)`` pairs for names that contain a dot.

    Names only: a glob pattern is refused (:func:`resolve_tables` expands patterns against the
    catalog first; taken as a name it would silently match no table)."""
    patterns = [name for name in tables if is_table_pattern(name)]
    if patterns:
        raise ConfigurationError(
            f"{', '.join(repr(p) for p in patterns)}: table patterns are expanded against the database's catalog "
            "before this point (capture.tables.resolve_tables, as the operators do); give table names here"
        )
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
    exclude_tables: Collection[str | tuple[str, str]] | TableSelection = (),
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
) -> list[tuple[str, str]]:
    """The tables a pipeline loads when none are named: every ordinary and partitioned table
    outside the system schemas (in ``publication`` for pgoutput), minus ``exclude_tables``
    (names and patterns).

    Nothing is skipped silently: a table without a usable key (:meth:`Catalog.table_key`
    refuses it) that is not loaded ``append_only`` makes this raise ONE :class:`CatalogError`
    naming every such table, why, and the ways forward. Run it before the slot is read.
    """
    excluded = TableSelection.parse(exclude_tables)
    candidates = [t for t in source_tables(catalog, publication) if not excluded.matches(t.schema, t.table)]
    return _loadable(catalog, candidates, table_options)


def _loadable(
    catalog: Catalog,
    candidates: Sequence[SourceTable],
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None,
) -> list[tuple[str, str]]:
    """``candidates`` as pairs, or one :class:`CatalogError` naming those without a usable key."""
    options = parse_table_options(table_options)
    selected: list[tuple[str, str]] = []
    refused: list[SourceTable] = []
    for table in candidates:
        pair = (table.schema, table.table)
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


def resolve_tables(
    catalog: Callable[[], Catalog],
    tables: Collection[str | tuple[str, str]] = (),
    *,
    publication: str | None = None,
    exclude_tables: Collection[str | tuple[str, str]] = (),
    table_options: Mapping[str, TableOptions | Mapping[str, Any]] | None = None,
) -> list[tuple[str, str]]:
    """The tables a run loads, sorted: the one place where a ``tables`` selection is turned into
    tables, for the extract, the initial load, table snapshots and verify runs.

    - ``tables`` empty: :func:`select_tables` (every table, in ``publication`` for pgoutput).
    - names: taken as given, without asking the catalog (a table renamed since keeps flowing
      under its old name, see :mod:`~airflow_provider_pgdecode.capture.renames`).
    - patterns: the tables of the catalog that match (in ``publication`` when given), under the
      same key rule as :func:`select_tables`; a pattern that matches none is a
      :class:`CatalogError` naming it and the tables there are.

    ``exclude_tables`` (names and patterns) is taken out of all three. A partitioned table whose
    ``table_options`` keep its partitions as leaves is replaced by its leaf partitions
    (:func:`~airflow_provider_pgdecode.capture.partitions.expand_kept_leaves`).

    :param catalog: called for a :class:`Catalog` only when the catalog is needed (no pattern
        and names only: never).
    :param publication: pgoutput's publication: the tables patterns (and an empty ``tables``)
        may select. ``None`` for test_decoding.
    """
    selection = TableSelection.parse(tables)
    excluded = TableSelection.parse(exclude_tables)
    options = parse_table_options(table_options)
    if not selection:
        found = catalog()
        listed = select_tables(found, publication=publication, exclude_tables=excluded, table_options=table_options)
        return sorted(_with_kept_leaves(lambda: found, set(listed), options, publication, excluded))
    chosen = {pair for pair in selection.names if not excluded.matches(*pair)}
    if selection.patterns:
        found = catalog()
        candidates = source_tables(found, publication)
        unmatched: list[str] = []
        matched: dict[tuple[str, str], SourceTable] = {}
        for pattern in selection.patterns:
            hits = [t for t in candidates if pattern.matches(t.schema, t.table)]
            if not hits:
                unmatched.append(pattern.text)
            kept = [t for t in hits if not excluded.matches(t.schema, t.table)]
            log.info(
                "tables pattern %r matches %s",
                pattern.text,
                ", ".join(t.name for t in kept) or "only excluded tables",
            )
            matched.update({(t.schema, t.table): t for t in kept if (t.schema, t.table) not in chosen})
        if unmatched:
            raise unmatched_patterns_error(unmatched, candidates, publication, found)
        chosen.update(_loadable(found, list(matched.values()), table_options))
    return sorted(_with_kept_leaves(catalog, chosen, options, publication, excluded))


def _with_kept_leaves(
    catalog: Callable[[], Catalog],
    chosen: set[tuple[str, str]],
    options: Mapping[tuple[str, str], TableOptions],
    publication: str | None,
    excluded: TableSelection,
) -> set[tuple[str, str]]:
    """``chosen`` with its roots kept as leaves replaced by their leaves, minus excluded leaves."""
    if not kept_as_leaves(options) & chosen:
        return chosen
    return {pair for pair in expand_kept_leaves(catalog(), chosen, options, publication) if not excluded.matches(*pair)}


def kept_as_leaves(options: Mapping[tuple[str, str], TableOptions]) -> set[tuple[str, str]]:
    """The tables whose options keep their partitions as leaves (``partitions = 'leaves'``)."""
    return {name for name, option in options.items() if option.partitions == "leaves"}


def expand_kept_leaves(
    catalog: Catalog,
    chosen: Collection[tuple[str, str]],
    options: Mapping[tuple[str, str], TableOptions],
    publication: str | None,
) -> set[tuple[str, str]]:
    """``chosen`` with every root kept as leaves replaced by its leaf partitions (what the initial
    load, table snapshots and the extract then load one by one); :class:`ConfigurationError` when
    ``publication`` sends them under the root's name."""
    wanted = kept_as_leaves(options) & set(chosen)
    if not wanted:
        return set(chosen)
    kept = {root: oid for _, (oid, root) in catalog.partition_roots().items() if root in wanted}
    if not kept:
        return set(chosen)
    check_leaves_publishable(catalog, publication, kept)
    leaves = catalog.partition_leaves(sorted(kept.values()))
    names = catalog.relation_names(sorted(leaf for tree in leaves.values() for leaf in tree))
    return (set(chosen) - set(kept)) | set(names.values())


def check_leaves_publishable(catalog: Catalog, publication: str | None, kept: Mapping[tuple[str, str], int]) -> None:
    """Refuse roots kept as leaves under a publication that sends their changes as the root's."""
    if not kept or publication is None or not catalog.publishes_via_root(publication):
        return
    names = ", ".join(f"{schema}.{table}" for schema, table in sorted(kept))
    raise ConfigurationError(
        f"table_options keep the partitions of {names} as leaves (partitions = 'leaves'), but publication "
        f"{publication!r} sets publish_via_partition_root = true: pgoutput then sends every partition's changes "
        "under the root's name, and they cannot be told apart. Run ALTER PUBLICATION "
        f"{publication} SET (publish_via_partition_root = false), or drop the option to load each as one Delta table"
    )


def unmatched_patterns_error(
    patterns: Sequence[str], candidates: Sequence[SourceTable], publication: str | None, catalog: Catalog
) -> CatalogError:
    """Patterns that match no table, with the tables there are (some of them)."""
    where = f"database {catalog.conn.info.dbname!r}" + (f", publication {publication!r}" if publication else "")
    shown = ", ".join(t.name for t in candidates[:20]) + (
        f" ... ({len(candidates)} in all)" if len(candidates) > 20 else ""
    )
    return CatalogError(
        f"table pattern(s) {', '.join(repr(p) for p in patterns)} match no table of {where}: nothing was staged. "
        f"Tables there: {shown or 'none'}. Correct the pattern (names are case-sensitive, matched as stored), "
        "create the table, or remove the pattern" + (" (or add the tables to the publication)" if publication else "")
    )


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
