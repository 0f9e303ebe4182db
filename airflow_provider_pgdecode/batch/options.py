"""Per-table options: how each source table is loaded (one model, validated by pydantic).

Given as a mapping from ``schema.table`` to options, e.g. the DAGs' ``table_options`` param::

    {"public.pgbench_history": {"mode": "append_only"},
     "public.orders": {"mode": "history"},
     "public.readings": {"on_bad_value": "quarantine"}}

A name without a schema means ``public``. Unknown tables in the mapping are allowed (a table
may be created later); unknown option names and bad values are refused with the table and the
field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.errors import ConfigurationError

LoadMode = Literal["merge", "append_only", "history", "soft_delete"]
LOAD_MODES: tuple[str, ...] = get_args(LoadMode)
"""Every load mode, in the order the error wording lists them (docs/merge.md describes each)."""
KEPT_MODES: tuple[str, ...] = ("history", "soft_delete")
"""Modes whose Delta tables keep more than the current rows (versions, tombstones): per key."""
BadValuePolicy = Literal["fail", "quarantine"]
ArrayStaging = Literal["list", "json"]
KeptAs = Literal["string"]
RewritePolicy = Literal["resnapshot", "stop"]
PartitionLanding = Literal["root", "leaves"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def yes_or_no(value: object) -> bool | None:
    """A yes/no given as a bool or as text (a setting, an environment variable, a rendered template
    field, a connection's extra): True for one of :data:`TRUE_WORDS`, False for one of
    :data:`FALSE_WORDS` (any case, spaces around), None for anything else; the caller decides
    whether that means its default or an error."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    return None


DEFAULT_MAX_VALUE_BYTES = 64 * 1024 * 1024
"""The largest value (bytes of the text PostgreSQL printed) staged by default: 64 MiB."""


class TableOptions(BaseModel):
    """How one table is loaded.

    :param mode: ``merge`` (default): the Delta table holds the source table's current rows,
        matched by the table key (:meth:`Catalog.table_key`). ``append_only``: for insert-only
        tables without a key (logs, histories under REPLICA IDENTITY DEFAULT): inserts are
        appended; an UPDATE or DELETE of the table fails the run with its name. ``history``
        (slowly changing dimension type 2): one Delta row per committed version of each key,
        with ``_pg_valid_from_lsn``/``_pg_valid_to_lsn``, ``_pg_valid_from``/``_pg_valid_to``
        (commit LSN and time) and ``_pg_current``. ``soft_delete``: the current rows, plus a
        ``_pg_deleted`` tombstone for every deleted (or truncated) key. Both need a key (a
        primary key or a replica identity index). See docs/merge.md, "History and soft deletes".
    :param on_bad_value: ``fail`` (default): a value the pipeline cannot carry stops the run
        with the table, column and LSN named. ``quarantine``: that change goes to the quarantine
        Delta table with the raw value, the reason and its LSN; the rest of the batch flows.
    :param max_value_bytes: the largest value staged (bytes of the text PostgreSQL printed;
        default 64 MiB). A larger value is a bad value (``on_bad_value`` decides), caught at
        staging, before the merge's Spark has to hold it in memory.
    :param arrays: ``list`` (default): an array column is staged as a list of its element type
        (Delta ``array<...>``); a multi-dimensional value is a bad value. ``json``: every array
        column of the table is staged as JSON text (nested arrays for any number of
        dimensions; Delta ``string``). See docs/merge.md, "Values the pipeline cannot carry".
    :param type_map: PostgreSQL types of this table kept as the text PostgreSQL printed, each
        mapped to ``string`` (the only target), e.g. ``{"numeric": "string"}`` for numeric values
        past ``decimal(38,18)`` or NaN keys, ``{"date": "string"}`` for ``infinity`` keys (a bad
        value otherwise), ``{"timestamp with time zone": "string"}``. Names
        as ``format_type`` prints them or their aliases (``timestamptz``), modifiers ignored;
        arrays of a kept type become arrays of text. Applied when the changes are staged and
        recorded in each batch's manifest, so the merge keeps those columns as ``string``. A
        Delta table that already holds such a column with another type refuses the change
        (resnapshot the table). See docs/merge.md, "Types".
    :param on_rewrite: what the extract does when the table was rewritten without its rows in
        the WAL (a volatile ``ADD COLUMN … DEFAULT``, a rewriting ``ALTER COLUMN … TYPE``, or
        dropped and created again under its name): ``resnapshot`` (default) files a resnapshot
        request for it, which the next runs copy; ``stop`` stops the run naming the table until a
        snapshot request for it is filed. See docs/merge.md, "DDL on a source table".
    :param partitions: for a partitioned table (the one at the top of its tree): ``root``
        (default) lands every partition's rows in this table's one Delta table; ``leaves`` gives
        each leaf partition its own Delta table, named after it, as if the leaves had been named
        in ``tables`` (the initial load and table snapshots copy the leaves; a partition attached
        with rows of its own is resnapshotted by its ``on_rewrite``). Not with a pgoutput
        publication that sets ``publish_via_partition_root``, which sends the leaves' changes
        under the root's name. See docs/merge.md, "Partitioned tables".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: LoadMode = "merge"
    on_bad_value: BadValuePolicy = "fail"
    max_value_bytes: int = Field(default=DEFAULT_MAX_VALUE_BYTES, gt=0)
    arrays: ArrayStaging = "list"
    type_map: dict[str, KeptAs] = Field(default_factory=dict)
    on_rewrite: RewritePolicy = "resnapshot"
    partitions: PartitionLanding = "root"

    @field_validator("type_map")
    @classmethod
    def _type_names(cls, value: dict[str, str]) -> dict[str, str]:
        blank = [name for name in value if not name.strip()]
        if blank:
            raise ValueError("a type name may not be empty")
        return value

    @property
    def staging(self) -> typemap.Staging:
        """How the table's columns are staged (``arrays``, ``type_map``)."""
        return typemap.Staging.of(self.type_map, self.arrays)


DEFAULT_OPTIONS = TableOptions()


def qualified_name(name: str) -> tuple[str, str]:
    """``"public.orders"`` or ``"orders"`` to ``("public", "orders")``."""
    schema, dot, table = name.partition(".")
    return (schema, table) if dot else ("public", schema)


def parse_table_options(value: Mapping[str, Any] | None) -> dict[tuple[str, str], TableOptions]:
    """Validate a ``{"schema.table": {...}}`` mapping; :class:`ConfigurationError` names the table and field."""
    out: dict[tuple[str, str], TableOptions] = {}
    for name, options in (value or {}).items():
        if isinstance(options, TableOptions):
            out[qualified_name(name)] = options
            continue
        if not isinstance(options, Mapping):
            raise ConfigurationError(
                f"table_options[{name!r}] must be a mapping of option names to values, not {options!r}"
            )
        try:
            out[qualified_name(name)] = TableOptions.model_validate(dict(options))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or 'options'}: {error['msg']}" for error in exc.errors()
            )
            raise ConfigurationError(
                f"table_options[{name!r}] is invalid ({problems}); allowed: mode in {LOAD_MODES}, "
                "on_bad_value in ('fail', 'quarantine'), max_value_bytes > 0, arrays in ('list', 'json'), "
                "type_map of PostgreSQL type names to 'string', on_rewrite in ('resnapshot', 'stop'), partitions in "
                "('root', 'leaves')"
            ) from None
    return out


def options_for(options: Mapping[tuple[str, str], TableOptions], schema: str, table: str) -> TableOptions:
    """The options of ``schema.table``, or the defaults."""
    return options.get((schema, table), DEFAULT_OPTIONS)


def as_table_options(value: object) -> Mapping[str, Any]:
    """A templated ``table_options`` value as the mapping it must be (``{}`` for empty), or a
    :class:`ConfigurationError` that says what was given instead."""
    if value is None or value == "":
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"table_options must be a mapping of 'schema.table' names to options, not {value!r} "
            "(a DAG passing it through a template needs render_template_as_native_obj=True)"
        )
    return value


def keyless_kept_mode_error(name: str, mode: str, outcome: str) -> str:
    """The refusal of a keyless table (REPLICA IDENTITY FULL without a key) in a kept mode, by the
    extract (``outcome``: what it did not do) and by the merge alike."""
    return (
        f"table {name} has no key (REPLICA IDENTITY FULL without a primary key or replica identity index), "
        f"so its rows cannot be kept with table_options mode {mode!r}: versions and tombstones are kept per "
        f"key, and identical rows of a keyless table have none. {outcome} Give the table a primary key (or "
        "REPLICA IDENTITY USING INDEX on a unique index of NOT NULL columns) and re-extract, or load it with "
        "mode 'merge' (a multiset) or 'append_only'"
    )
