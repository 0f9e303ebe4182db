"""Many sources from one config file: the model of ``pgdecode_sources.yaml`` and its loader.

The file lists sources, each a database read through one replication slot, and
``dags/pgdecode_sources.py`` turns each into an incremental and a backfill DAG
(:mod:`airflow_provider_pgdecode.example_dags.sources`, docs/sources.md)::

    defaults:                        # every source takes these unless it says otherwise
      spark_conn_id: spark_default
      pool: pgdecode_spark           # create it: airflow pools set pgdecode_spark 2 "pgdecode merges"
    sources:
      shop:                          # the name: DAGs pgdecode_shop_incremental, pgdecode_shop_backfill
        postgres_conn_id: shop_db
        slot: pgdecode_shop
        plugin: test_decoding
        tables: [public.orders, "public.order_*"]
        delta_root: /data/shop/delta
        schedule: "*/10 * * * *"     # or a preset, or "event" (run when the slot has changes)

The file is validated whole when the DAG file is parsed, without opening any connection: one
:class:`~airflow_provider_pgdecode.errors.ConfigurationError` lists every problem, each line
naming the file, the line, the source and the field (``dags/pgdecode_sources.yaml:7: source
'shop': field 'plugin': must be one of test_decoding, pgoutput (got 'wal2json')``). Nothing of a
file with a problem is used: a DAG of a half-applied file could read a slot with the wrong
settings. What is checked here: YAML syntax, keys given twice (PyYAML would keep the last one
silently), unknown fields (a misspelt option is refused, with the closest field named), types and
ranges, the plugin, ``publication`` for pgoutput, table names and patterns
(:func:`~airflow_provider_pgdecode.capture.tables.parse_table_pattern`), per-table options
(:func:`~airflow_provider_pgdecode.batch.options.parse_table_options`, so options added there are
accepted here), the schedule, a slot used by two sources (slots are cluster-wide, and two
connection ids may reach one cluster, so slot names are unique in the whole file) and a Delta root
shared by two sources (their tables would be merged into each other). What needs the databases
(patterns matching tables, the slots' plugins) is checked when the tasks run.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from airflow_provider_pgdecode.batch.options import parse_table_options
from airflow_provider_pgdecode.capture.bounds import DEFAULT_MAX_BATCH_CHANGES, DEFAULT_MAX_BATCH_WAL_BYTES
from airflow_provider_pgdecode.capture.tables import is_table_pattern, parse_table_pattern
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS
from airflow_provider_pgdecode.errors import ConfigurationError

DEFAULT_FILE_NAME = "pgdecode_sources.yaml"
"""The sources file read when ``[pgdecode] sources`` is empty: next to the DAG file that reads it."""

DEFAULT_POOL = "default_pool"
"""The pool of the merges when the file names none: Airflow's own, which always exists. A pool of
pgdecode's own caps the merges of every source together; it must be created first, since
Airflow's scheduler never runs a task of a pool that does not exist (it only logs a warning)."""

PLUGINS = SUPPORTED_PLUGINS
EVENT = "event"
"""The ``schedule`` that runs a source's cycle when its slot has changes (an Asset watched by an event trigger)."""
PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly", "@once", "@continuous")
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,200}$"
SLOT_PATTERN = r"^[a-z0-9_]{1,63}$"
NOT_IN_DEFAULTS = {
    "slot": "each source has a slot of its own",
    "delta_root": "each source has a Delta root of its own",
    "publication": "a publication belongs to one database",
}


def _table_entry(value: str) -> str:
    parse_table_pattern(value, require_schema=True)
    return value


def _schedule(value: str | None) -> str | None:
    if value is None or value == EVENT or value in PRESETS:
        return value
    from airflow.sdk import CronTriggerTimetable  # Airflow's own cron check, as the DAG will be checked

    fields = value.split()
    reason = "" if len(fields) == 5 else f"{len(fields)} fields instead of 5"
    if not reason:
        try:
            CronTriggerTimetable(value, timezone="UTC").validate()
        except Exception as exc:  # AirflowTimetableInvalid, with croniter's reason
            reason = str(exc)
    if reason:
        raise ValueError(
            f"must be a cron expression (minute hour day month weekday, e.g. '*/15 * * * *'), a preset "
            f"({', '.join(PRESETS)}), '{EVENT}' (run when the slot has changes) or null (run only when "
            f"triggered); got {value!r}: {reason}"
        )
    return value


def _location(value: str) -> str:
    if "://" in value or os.path.isabs(value):
        return value
    raise ValueError(
        f"must be an absolute path or a URI such as s3://bucket/prefix, not {value!r}: a relative path would "
        "depend on the working directory of each Airflow worker"
    )


TableEntry = Annotated[StrictStr, AfterValidator(_table_entry)]
Location = Annotated[StrictStr, AfterValidator(_location)]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]
Count = Annotated[StrictInt, Field(ge=1)]


class SourceDefaults(BaseModel):
    """The fields a source takes from the file's ``defaults`` when it does not give them.

    Every field of :class:`SourceConfig` but ``slot``, ``delta_root`` and ``publication``, which
    belong to one source (or one database).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    postgres_conn_id: NonEmpty | None = None
    plugin: Literal["test_decoding", "pgoutput"] | None = None
    tables: list[TableEntry] = []
    exclude_tables: list[TableEntry] = []
    table_options: dict[StrictStr, Any] = {}
    staging_uri: Location | None = None
    storage_conn_id: StrictStr = ""
    spark_conn_id: NonEmpty = "spark_default"
    schedule: Annotated[StrictStr | None, AfterValidator(_schedule)] = None
    pool: NonEmpty = DEFAULT_POOL
    max_batch_changes: Count | None = DEFAULT_MAX_BATCH_CHANGES
    max_batch_wal_bytes: Count | None = DEFAULT_MAX_BATCH_WAL_BYTES
    drain: StrictBool = True
    failover: StrictBool = False
    on_slot_lost: Literal["fail", "resnapshot"] = "fail"
    max_slot_recoveries_per_day: Count = 1
    wait_seconds: Annotated[StrictInt, Field(ge=0)] | None = None
    max_lag_bytes: Count | None = None
    retention_days: Count | None = None
    poll_interval: Annotated[float, Field(gt=0, strict=True)] = 15.0

    @field_validator("table_options")
    @classmethod
    def _options(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if is_table_pattern(name):
                raise ValueError(
                    f"{name!r}: options are given per table, by its name (patterns are for tables and exclude_tables)"
                )
            parse_table_pattern(name, require_schema=True)
        parse_table_options(value)  # the one model of per-table options (batch/options.py)
        return _plain(value)


class SourceConfig(SourceDefaults):
    """One source: a database read through one slot, loaded into one Delta root.

    :param name: the source's key under ``sources``, part of its DAG ids.
    :param postgres_conn_id: the Airflow connection of the source database.
    :param slot: the replication slot (created, two-phase, by the first run); unique in the file.
    :param plugin: ``test_decoding`` or ``pgoutput``.
    :param publication: the publication a pgoutput slot reads (required for pgoutput, refused for
        test_decoding).
    :param tables: ``schema.table`` names or glob patterns (``public.order_*``), matched when a
        task runs; empty: every table (of the publication, for pgoutput).
    :param exclude_tables: names or patterns never loaded.
    :param table_options: per table name, the options of ``batch/options.py`` (``mode`` ...).
    :param staging_uri: where batches are staged; default ``<[pgdecode] data_dir>/<name>/staging``.
    :param delta_root: where the Delta tables go; default ``<[pgdecode] data_dir>/<name>/delta``;
        no two sources share one, nor nest one in another.
    :param storage_conn_id: the Airflow ``aws`` connection of ``s3://`` locations.
    :param spark_conn_id: the Spark connection of the merges.
    :param schedule: a cron expression or preset, ``event`` (run when the slot has changes), or
        null (only when triggered); default the ``[pgdecode] schedule`` setting.
    :param pool: the Airflow pool of the merges (``merge`` and ``drain`` tasks); default
        ``default_pool``.
    :param max_batch_changes: the DAG's default of the param of that name (null: no bound).
    :param max_batch_wal_bytes: the same.
    :param drain: the same.
    :param failover: the same: the slot created as a failover slot (PostgreSQL 17+, docs/standby.md).
    :param on_slot_lost: the same: ``fail`` or ``resnapshot`` (docs/lost-slots.md).
    :param max_slot_recoveries_per_day: the same.
    :param wait_seconds: how long a run waits for changes; default ``[pgdecode] wait_seconds``
        (30 with ``schedule: event``).
    :param max_lag_bytes: the slot health check's limit; default ``[pgdecode] max_lag_bytes``;
        null: none.
    :param retention_days: staged batches kept; default ``[pgdecode] retention_days``; null: all.
    :param poll_interval: ``schedule: event`` only: seconds between the trigger's looks at the slot.
    """

    name: StrictStr = ""
    postgres_conn_id: NonEmpty
    slot: Annotated[StrictStr, Field(pattern=SLOT_PATTERN)]
    plugin: Literal["test_decoding", "pgoutput"]
    publication: NonEmpty | None = None
    delta_root: Location | None = None

    @model_validator(mode="after")
    def _publication(self) -> SourceConfig:
        if self.plugin == "pgoutput" and self.publication is None:
            raise _FieldError(
                "publication",
                "required with plugin pgoutput: the publication its slot reads (CREATE PUBLICATION name FOR TABLE ...)",
            )
        if self.plugin == "test_decoding" and self.publication is not None:
            raise _FieldError("publication", "test_decoding reads no publication: remove it, or use plugin pgoutput")
        return self

    @property
    def is_event_driven(self) -> bool:
        return self.schedule == EVENT

    def given(self, field: str) -> bool:
        """True when the file gives ``field`` (for the source, or in ``defaults``)."""
        return field in self.model_fields_set


class _FieldError(ValueError):
    """A model validator's error about one field (reported with that field's line)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SourcesFile:
    """A validated sources file: its path and its sources, in the file's order."""

    path: Path
    sources: tuple[SourceConfig, ...]

    def __iter__(self) -> Iterator[SourceConfig]:
        return iter(self.sources)


# --- reading the file: PyYAML's safe loader, with lines and without duplicate keys ---------------


class _Mapping(dict[Any, Any]):
    """A YAML mapping that remembers the line of itself and of each key, and keys given twice."""

    line: int = 0
    lines: dict[Any, int]
    duplicates: list[tuple[Any, int, int]]


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Mapping:
    loader.flatten_mapping(node)
    out = _Mapping()
    out.line, out.lines, out.duplicates = node.start_mark.line + 1, {}, []
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if key in out:
            out.duplicates.append((key, out.lines[key], line))
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = line
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _plain(value: Any) -> Any:
    """Mappings and lists of the loader as plain ``dict`` and ``list`` (DAG params must serialize)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# --- validation ------------------------------------------------------------------------------


class _Problems:
    """The problems found in one file, each a line naming the file, the line, the source and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[int, str]] = []

    def add(
        self,
        message: str,
        line: int | None = None,
        *,
        source: str | None = None,
        field: str | None = None,
        defaults: bool = False,
    ) -> None:
        where = f"{self.path}:{line}: " if line else f"{self.path}: "
        what = (f"source {source!r}: " if source is not None else "") + ("defaults: " if defaults else "")
        self.lines.append((line or 0, where + what + (f"field {field!r}: " if field else "") + message))

    def raise_if_any(self) -> None:
        """One :class:`ConfigurationError` of every problem, in the order of the file's lines."""
        if self.lines:
            raise ConfigurationError("\n".join(text for _, text in sorted(self.lines, key=lambda p: p[0])))


FIELDS = (
    "postgres_conn_id",
    "slot",
    "plugin",
    "publication",
    "tables",
    "exclude_tables",
    "table_options",
    "staging_uri",
    "delta_root",
    "storage_conn_id",
    "spark_conn_id",
    "schedule",
    "pool",
    "max_batch_changes",
    "max_batch_wal_bytes",
    "drain",
    "failover",
    "on_slot_lost",
    "max_slot_recoveries_per_day",
    "wait_seconds",
    "max_lag_bytes",
    "retention_days",
    "poll_interval",
)
"""A source's fields, in the order the documentation gives them."""


REQUIRED = {
    "postgres_conn_id": "the Airflow connection (type pgdecode; postgres works too) of its database",
    "slot": "the name of its replication slot (created by the first run when missing)",
    "plugin": "its output plugin, one of " + ", ".join(PLUGINS),
}


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [name for name in FIELDS if name in model.model_fields]


def _describe(error: Mapping[str, Any], model: type[BaseModel]) -> tuple[str, str]:
    """(field, message) of one pydantic error."""
    loc = [str(part) for part in error["loc"]]
    field = loc[0] if loc else ""
    kind = error["type"]
    given = error.get("input")
    if kind == "missing":
        return field, f"missing: every source needs {REQUIRED.get(field, 'a value')}"
    if kind == "extra_forbidden":
        fields = _fields_of(model)
        if model is SourceDefaults and field in NOT_IN_DEFAULTS:
            return field, f"not allowed in defaults: {NOT_IN_DEFAULTS[field]}"
        close = difflib.get_close_matches(field, fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return field, f"unknown field{hint}; the fields are {', '.join(fields)}"
    if kind == "literal_error" and field == "plugin":
        return field, f"must be one of {', '.join(PLUGINS)} (got {given!r})"
    if kind == "string_pattern_mismatch" and field == "slot":
        return field, f"a slot name is 1 to 63 lower-case letters, digits and _ (got {given!r})"
    if kind == "value_error":
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, _FieldError):
            return cause.field, str(cause)
        message = str(cause) if cause is not None else error["msg"]
    else:
        message = f"{error['msg']} (got {given!r})"
    if len(loc) > 1 and field in ("tables", "exclude_tables") and loc[1].isdigit():
        message = f"entry {int(loc[1]) + 1}: {message}"
    return field, message


def _validate(
    model: type[SourceDefaults],
    data: Mapping[str, Any],
    problems: _Problems,
    mapping: _Mapping,
    *,
    source: str | None,
    line: int,
) -> SourceDefaults | None:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            field, message = _describe(error, model)
            problems.add(
                message,
                mapping.lines.get(field, line),
                source=source,
                field=field or None,
                defaults=model is SourceDefaults,
            )
        return None


def _duplicates(value: Any, problems: _Problems, context: Sequence[str]) -> None:
    """Report every key given twice, anywhere in the file (PyYAML would keep the last silently)."""
    if isinstance(value, _Mapping):
        for key, first, again in value.duplicates:
            twice = f"given twice (lines {first} and {again})"
            inner = list(context[3:] if context[:1] == ["sources"] else context[2:])
            inside = f"{'.'.join([*inner, str(key)])!r} is {twice}"
            if not context:
                problems.add(f"{key!r} is {twice}", again)
            elif list(context) == ["sources"]:
                problems.add(f"source {key!r} is defined twice (lines {first} and {again})", again)
            elif context[0] == "sources" and len(context) == 2:
                problems.add(twice, again, source=context[1], field=str(key))
            elif context[0] == "sources":
                problems.add(inside, again, source=context[1], field=context[2])
            elif context[0] == "defaults" and len(context) == 1:
                problems.add(twice, again, field=str(key), defaults=True)
            elif context[0] == "defaults":
                problems.add(inside, again, field=context[1], defaults=True)
            else:
                problems.add(f"{'.'.join([*context, str(key)])!r} is {twice}", again)
        for key, item in value.items():
            _duplicates(item, problems, [*context, str(key)])
    elif isinstance(value, list):
        for item in value:
            _duplicates(item, problems, context)


def _root_key(location: str) -> str:
    return location.rstrip("/") or "/"


def _nested(a: str, b: str) -> bool:
    a, b = _root_key(a), _root_key(b)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def parse_sources(text: str, path: str | os.PathLike[str], *, data_dir: str) -> SourcesFile:
    """Validate the text of a sources file; ``path`` names it in errors.

    :param data_dir: the default locations' base (``[pgdecode] data_dir``): a source without
        ``staging_uri``/``delta_root`` stages into ``<data_dir>/<name>/staging`` and merges into
        ``<data_dir>/<name>/delta``.
    :raises ConfigurationError: every problem of the file, one per line.
    """
    path = Path(path)
    problems = _Problems(path)
    try:
        document = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader with line numbers
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        detail = getattr(exc, "problem", None) or str(exc)
        if mark is not None:
            problems.add(f"not valid YAML: {detail} (column {mark.column + 1})", mark.line + 1)
        else:
            problems.add(f"not valid YAML: {detail}")
        problems.raise_if_any()
    if not isinstance(document, _Mapping):
        problems.add(
            "must be a mapping with the key 'sources' (and optionally 'defaults'), "
            f"not {'an empty file' if document is None else type(document).__name__}; see docs/sources.md"
        )
        problems.raise_if_any()
    assert isinstance(document, _Mapping)
    _duplicates(document, problems, [])
    for key in document:
        if key not in ("sources", "defaults"):
            problems.add(f"unknown key {key!r}: a sources file has 'sources' and 'defaults'", document.lines[key])
    raw_sources = document.get("sources")
    if not isinstance(raw_sources, _Mapping):
        shape = "a list" if isinstance(raw_sources, list) else repr(raw_sources)
        problems.add(
            "'sources' must map each source's name to its fields (shop: {postgres_conn_id: ..., slot: ...}), "
            f"not {shape}",
            document.lines.get("sources", document.line),
        )
        problems.raise_if_any()
    assert isinstance(raw_sources, _Mapping)
    raw_defaults = document.get("defaults")
    defaults: Mapping[str, Any] = {}
    if raw_defaults is not None:
        if not isinstance(raw_defaults, _Mapping):
            problems.add("'defaults' must be a mapping of fields to values", document.lines["defaults"])
        elif _validate(SourceDefaults, raw_defaults, problems, raw_defaults, source=None, line=raw_defaults.line):
            defaults = raw_defaults

    sources: list[SourceConfig] = []
    claims: list[tuple[str, str, str | None]] = []  # each source's slot and Delta root
    twice = {name for name, _, _ in raw_sources.duplicates}  # reported above; which one was meant is unknown
    for name, raw in raw_sources.items():
        line = raw_sources.lines[name]
        if name in twice:
            continue
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            problems.add(
                f"source name {name!r}: 1 to 200 letters, digits, _ and - (it is part of the DAG ids "
                "pgdecode_<name>_incremental and pgdecode_<name>_backfill)",
                line,
            )
            continue
        if not isinstance(raw, _Mapping):
            problems.add(f"must be a mapping of fields to values, not {raw!r}", line, source=name)
            continue
        if "name" in raw:
            problems.add("a source is named by its key under 'sources'", raw.lines["name"], source=name, field="name")
            continue
        merged = {**defaults, **raw, "name": name}
        config = _validate(SourceConfig, merged, problems, raw, source=name, line=line)
        if isinstance(config, SourceConfig):
            located = _located(config, data_dir)
            sources.append(located)
            claims.append((name, located.slot, located.delta_root))
        elif isinstance(merged.get("slot"), str):
            # Checked against the others now, not only once this source's own problems are fixed.
            claims.append((name, merged["slot"], None))

    _check_unique(claims, raw_sources, problems)
    problems.raise_if_any()
    return SourcesFile(path, tuple(sources))


def _located(source: SourceConfig, data_dir: str) -> SourceConfig:
    """The source with ``staging_uri`` and ``delta_root`` filled in from ``data_dir`` when not given."""
    update = {}
    base = f"{data_dir.rstrip('/')}/{source.name}"
    if source.staging_uri is None:
        update["staging_uri"] = f"{base}/staging"
    if source.delta_root is None:
        update["delta_root"] = f"{base}/delta"
    return source.model_copy(update=update) if update else source


def _check_unique(claims: Sequence[tuple[str, str, str | None]], raw: _Mapping, problems: _Problems) -> None:
    """No slot and no Delta root of two sources: ``claims`` holds each source's name, slot and
    Delta root (``None`` for a source whose fields failed their checks: its slot is still compared)."""
    slots: dict[str, str] = {}
    roots: list[tuple[str, str]] = []
    for name, slot, root in claims:
        entry = raw[name]
        other = slots.get(slot)
        if other is not None:
            problems.add(
                f"slot {slot!r} is also the slot of source {other!r}: each source needs a slot of its own "
                "(slots are cluster-wide, two connections may reach one cluster, and each DAG advances its slot)",
                entry.lines.get("slot", raw.lines[name]),
                source=name,
                field="slot",
            )
        slots.setdefault(slot, name)
        if root is None:
            continue
        for other_name, other_root in roots:
            if _nested(root, other_root):
                problems.add(
                    f"{root} is (or nests with) the Delta root of source {other_name!r}, {other_root}: each source "
                    "needs a Delta root of its own, or the tables of one would be merged into the other's",
                    entry.lines.get("delta_root", raw.lines[name]),
                    source=name,
                    field="delta_root",
                )
                break
        roots.append((name, root))


def load_sources(path: str | os.PathLike[str], *, data_dir: str) -> SourcesFile:
    """Read and validate the sources file at ``path`` (see :func:`parse_sources`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot read the sources file: {exc.strerror or exc}") from exc
    return parse_sources(text, path, data_dir=data_dir)


def sources_file(configured: str, default: str | os.PathLike[str]) -> Path | None:
    """The sources file to read: ``configured`` (``[pgdecode] sources`` / ``PGDECODE_SOURCES``),
    relative to the folder of ``default``; else ``default`` when it exists; else ``None``.

    :raises ConfigurationError: ``configured`` names a file that does not exist.
    """
    default = Path(default)
    if configured.strip():
        path = Path(configured.strip()).expanduser()
        if not path.is_absolute():
            path = Path(os.path.normpath(default.parent / path))
        if not path.is_file():
            raise ConfigurationError(
                f"the sources file {path} does not exist: [pgdecode] sources (PGDECODE_SOURCES, "
                f"AIRFLOW__PGDECODE__SOURCES) names it as {configured.strip()!r} (a relative path is taken from "
                f"{default.parent}). Correct the path, or unset it to read {default} when it exists"
            )
        return path
    return default if default.is_file() else None


def incremental_dag_id(name: str) -> str:
    """The id of the incremental DAG of source ``name`` (example_dags/sources.py builds it; the
    pgdecode view finds its runs by it)."""
    return f"pgdecode_{name}_incremental"


def backfill_dag_id(name: str) -> str:
    """The id of the backfill DAG of source ``name``."""
    return f"pgdecode_{name}_backfill"


__all__ = [
    "DEFAULT_FILE_NAME",
    "DEFAULT_POOL",
    "EVENT",
    "SourceConfig",
    "SourceDefaults",
    "SourcesFile",
    "backfill_dag_id",
    "incremental_dag_id",
    "load_sources",
    "parse_sources",
    "sources_file",
]
