"""The merge job's plan: its options, what it knows of each table before it writes, and its results.

:class:`MergeOptions`, :class:`TablePlan` (a table's Delta path, column types, key, columns to
add, watermark and the batches it still needs), :class:`Profile` and :class:`TableResult` live
here, below every other room of the merge job, so the others import them without a cycle.
:func:`plan_merge` reads each table's Delta state (:mod:`.delta_state`) and plans it; nothing
here writes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow.parquet
from pyspark.sql.types import BooleanType, DataType, LongType, StructField, TimestampType

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import (
    COMMIT_LSN,
    COMMIT_TIME,
    CURRENT,
    DELETED,
    VALID_FROM,
    VALID_FROM_LSN,
    VALID_TO,
    VALID_TO_LSN,
    XID,
    delta_columns,
    join_path,
)
from airflow_provider_pgdecode.batch.manifest import BatchManifest, TableSummary
from airflow_provider_pgdecode.batch.options import LOAD_MODES, keyless_kept_mode_error
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, MergeInputError, UnmappedTypeError
from airflow_provider_pgdecode.spark import column_defaults, column_renames, multiset, table_parking
from airflow_provider_pgdecode.spark.delta_state import DeltaState, app_id, read_delta_state
from airflow_provider_pgdecode.spark.history import HISTORY, KEPT_MODES, MODE_PROPERTY, SOFT_DELETE, Truncate
from airflow_provider_pgdecode.spark.spark_types import (
    DEFAULT_UNBOUNDED_NUMERIC,
    ColumnType,
    map_catalog_type,
    parse_unbounded_numeric_rule,
    widens,
)
from airflow_provider_pgdecode.typemap import ARRAYS_AS_JSON, ARRAYS_AS_LIST, TEXT, Staging, array_element

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession


log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


METADATA_FIELDS: tuple[StructField, ...] = (
    StructField(COMMIT_LSN, LongType(), False, {"comment": "commit LSN of the row's last change"}),
    StructField(COMMIT_TIME, TimestampType(), True, {"comment": "commit time of the row's last change (UTC)"}),
    StructField(XID, LongType(), True, {"comment": "transaction id of the row's last change"}),
)
METADATA_COLUMNS = staged.DELTA_COLUMNS
assert tuple(f.name for f in METADATA_FIELDS) == METADATA_COLUMNS
MODE_FIELDS: Mapping[str, tuple[StructField, ...]] = {
    HISTORY: (
        StructField(
            VALID_FROM_LSN, LongType(), False, {"comment": "commit LSN of the change that opened this version"}
        ),
        StructField(
            VALID_TO_LSN,
            LongType(),
            True,
            {"comment": "commit LSN of the change that closed this version (NULL: current)"},
        ),
        StructField(VALID_FROM, TimestampType(), True, {"comment": "commit time of the change that opened it (UTC)"}),
        StructField(VALID_TO, TimestampType(), True, {"comment": "commit time of the change that closed it (UTC)"}),
        StructField(CURRENT, BooleanType(), False, {"comment": "the key's current version"}),
    ),
    SOFT_DELETE: (
        StructField(
            DELETED,
            BooleanType(),
            False,
            {"comment": "deleted in the source (the row's last values, kept as a tombstone)"},
        ),
    ),
}
"""The metadata columns a table of each kept mode has after :data:`METADATA_FIELDS`."""
assert all(delta_columns(m) == METADATA_COLUMNS + tuple(f.name for f in MODE_FIELDS[m]) for m in KEPT_MODES)


def metadata_fields(mode: str) -> tuple[StructField, ...]:
    """The metadata columns of a new Delta table loaded in ``mode``, in table order."""
    return METADATA_FIELDS + MODE_FIELDS.get(mode, ())


KEY_PROPERTY = "pgdecode.key"
SOURCE_PROPERTY = "pgdecode.source"
DEFAULT_TABLE_PROPERTIES: Mapping[str, str] = {
    # Deletion vectors: an UPDATE/DELETE marks rows instead of rewriting whole files, so a batch
    # costs what it changes rather than the size of the files it touches.
    "delta.enableDeletionVectors": "true",
    # Column mapping by name: PostgreSQL column names with spaces or ,;{}()= are allowed.
    "delta.columnMapping.mode": "name",
}
TXN_APP_ID_CONF = "spark.databricks.delta.write.txnAppId"
TXN_VERSION_CONF = "spark.databricks.delta.write.txnVersion"
MAX_KEY_RANGES = 16
DEFAULT_CODEGEN_MIN_CHANGES = 100_000
DEFAULT_LIGHT_WRITE_MAX_BYTES = 64 * 1024 * 1024
HAS_OLD = "__has_old"  # staged events: the change carries an old image (_pg_old)
SPECIAL_KEY = "__special_key"  # staged events: a numeric key (new or old) is NaN or ±Infinity
KEY_BUCKETS = 4096


@dataclass(frozen=True)
class MergeOptions:
    """Choices a deployment can make; the defaults are documented in docs/merge.md."""

    unbounded_numeric: str = DEFAULT_UNBOUNDED_NUMERIC
    """Delta type of ``numeric`` without precision: ``decimal(P,S)`` or ``string``."""
    type_overrides: Mapping[str, str] = field(default_factory=dict)
    """Catalog type name -> ``string`` for user-defined types staged as text (enums, domains)."""
    numeric_special: str = "null"
    """What a numeric ``NaN``/``Infinity`` becomes in a decimal column: ``null`` (logged) or ``error``."""
    table_properties: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TABLE_PROPERTIES))
    """Delta table properties for tables the job creates."""
    key_range_pruning: bool = True
    """Add the batch's key ranges to the MERGE condition so Delta skips files outside them."""
    codegen_min_changes: int = DEFAULT_CODEGEN_MIN_CHANGES
    """Runs with fewer staged changes evaluate Spark expressions interpreted (:func:`small_run_settings`);
    0: always compile."""
    light_write_max_bytes: int = DEFAULT_LIGHT_WRITE_MAX_BYTES
    """A run into an existing ``merge`` table whose data files its key ranges meet (all of them for
    a key other than one integer column) hold at most this many bytes is committed by delta-rs
    when the driver built its source or it holds fewer than ``codegen_min_changes`` changes
    (:mod:`.light_write`); 0: always Delta's MERGE."""
    snapshot_commit: bool = True
    """Into a Delta table this run creates, commit a snapshot batch's parts as they are staged
    (:mod:`.delta_commit`) instead of reading and appending them through Spark."""
    park: bool = True
    """Park a table whose Delta table cannot be read or written and merge the others
    (:mod:`.table_parking`); ``False``: such a table stops the whole run."""
    park_refused: bool = False
    """Park a table whose staged changes are refused too (with ``park``). The merge task does, and
    keeps the parked table's place (batch/parking.py); a caller that keeps no such record gets
    the refusal raised, before anything is written."""
    parked: tuple[str, ...] = ()
    """``schema.table`` of the tables parked by earlier runs (batch/parking.py)."""
    catch_up: tuple[str, ...] = ()
    """Earlier batches the parked tables still need: merged for those tables only."""
    memory_check: bool = True
    """Through Spark Connect, refuse a table whose staged changes would not fit the server's memory
    before sending them (:mod:`.memory_budget`); ``False``: send them anyway."""
    table_workers: int = 1
    """Tables merged side by side, each in a session of its own of the same Spark application
    (:mod:`.table_workers`); 1: one after another in the caller's session."""

    def __post_init__(self) -> None:
        if self.numeric_special not in ("null", "error"):
            raise ConfigurationError(f"numeric_special must be 'null' or 'error', not {self.numeric_special!r}")
        parse_unbounded_numeric_rule(self.unbounded_numeric)
        if self.table_workers < 1:
            raise ConfigurationError(f"table_workers must be at least 1, not {self.table_workers}")


@dataclass
class Segment:
    """One batch's changes to one table, and the LSN at or below which they are already applied."""

    batch: BatchManifest
    staged: TableSummary
    applied_through: int
    """Rows with a commit LSN at or below this are already in Delta (-1: none)."""


@dataclass
class TablePlan:
    """Everything decided about one table before anything is written."""

    schema: str
    table: str
    path: str
    key: tuple[str, ...]
    columns: tuple[str, ...]
    """Source columns written, in source order (key included)."""
    types: dict[str, ColumnType]
    segments: list[Segment]
    state: DeltaState
    new_columns: tuple[str, ...] = ()
    widened: dict[str, DataType] = field(default_factory=dict)
    """Delta columns whose source type widened (column -> Delta's type now): Delta's type widening
    changes them to the new type before the write."""
    not_written: tuple[str, ...] = ()
    """Delta columns no longer in the source (dropped there): kept in Delta, no longer written."""
    skipped: list[str] = field(default_factory=list)
    watermark_after: int = -1
    multiset: bool = False
    """No key: REPLICA IDENTITY FULL, all columns identify a row and identical rows stay distinct
    (:mod:`.multiset`)."""
    append_only: bool = False
    """``table_options`` mode ``append_only``: inserts are appended, nothing is matched."""
    mode: str = "merge"
    """The ``table_options`` mode the batches stage the table with (``history``, ``soft_delete``:
    :mod:`.history`)."""
    missing: dict[str, Any] = field(default_factory=dict)
    """Columns added with a default: the value rows written before them hold (:mod:`.column_defaults`)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Delta columns renamed in the source: former name -> name now (:mod:`.column_renames`)."""
    staged_as: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per column, the former names changes staged before its rename carry."""
    numbers: dict[str, int] = field(default_factory=dict)
    """The column numbers the Delta table records after this run (:mod:`.column_renames`)."""
    numbers_changed: bool = False

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def value_columns(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if c not in self.key)


@dataclass
class Profile:
    """Facts about a table's staged changes (:func:`profile_from_parts`, else :func:`profile_events`)."""

    changes: int
    inserts: int
    updates: int
    deletes: int
    truncates: int
    keep_columns: tuple[str, ...]
    keep_moves: int
    null_keys: int
    specials: dict[str, int]
    lossy: dict[str, int]
    key_min: Any = None
    key_max: Any = None
    key_ranges: list[tuple[Any, Any]] | None = None
    missing_old: int = 0
    """UPDATEs and DELETEs staged without an old image."""
    special_keys: int = 0
    """Changes whose numeric key (new or old) is NaN or ±Infinity, which a decimal cannot hold."""
    truncations: tuple[Truncate, ...] = ()
    """Every TRUNCATE of the table among the changes, in commit order."""
    superseded: pa.Table | None = field(default=None, compare=False)
    """The effects a later one on the same key replaces (:func:`.collapse.superseded_effects`),
    when :func:`profile_from_parts` found them: the collapse then only drops these."""

    @property
    def inserts_only(self) -> bool:
        """Inserts (and TRUNCATEs) only, such as an initial snapshot: every key once after the last
        TRUNCATE (PostgreSQL refuses a second insert of a key without a delete between)."""
        return self.updates == 0 and self.deletes == 0 and not self.keep_columns

    @property
    def truncate_at(self) -> tuple[int, int] | None:
        """The last TRUNCATE's (commit LSN, position): what a current-state table keeps starts after it."""
        if not self.truncations:
            return None
        last = self.truncations[-1]
        return (last.lsn, last.seq)


def keeps_delta_values(plan: TablePlan, profile: Profile) -> bool:
    """Whether a value an UPDATE left unchanged (TOAST) and no change of the run set may be kept
    from Delta: the table exists, and no TRUNCATE of the run emptied it."""
    return profile.truncate_at is None and plan.state.exists


@dataclass
class TableResult:
    """What happened to one table (the values of :func:`merge_batches`' ``tables``)."""

    delta_path: str
    status: str  # "merged" | "skipped" | "parked"
    reason: str | None = None
    changes: int = 0
    changes_already_applied: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    truncated: bool = False
    created: bool = False
    columns_added: list[str] = field(default_factory=list)
    columns: dict[str, str] = field(default_factory=dict)
    """The source columns this run wrote, with their Delta types (what lineage reports)."""
    columns_widened: dict[str, str] = field(default_factory=dict)
    """Columns whose Delta type this run widened: column -> ``"int -> bigint"``."""
    columns_not_written: list[str] = field(default_factory=list)
    quarantined: int = 0
    """Changes of this table the batches' quarantine parts hold (appended to the quarantine table)."""
    numeric_specials_nulled: dict[str, int] = field(default_factory=dict)
    batches_skipped: list[str] = field(default_factory=list)
    delta_version: int = -1
    watermark_lsn: str | None = None
    error: str | None = None
    """A parked table's error class (its message is the ``reason``)."""
    seconds: float = 0.0
    """Wall-clock seconds this run spent on the table (its read, profile and write)."""
    schema: str = ""
    """The Delta table's schema and table names (the summary's key joins them with a dot,
    which a name may hold too)."""
    table: str = ""


# --------------------------------------------------------------------------------------------
# Planning (no writes)
# --------------------------------------------------------------------------------------------


def quote(name: str) -> str:
    """A Spark SQL identifier for ``name``, whatever characters it has."""
    return "`" + name.replace("`", "``") + "`"


def sql_literal(value: Any) -> str:
    """A Spark SQL literal for an integer (as is) or a text (quoted, its quotes and backslashes escaped)."""
    if isinstance(value, bool) or value is None:
        raise TypeError(value)
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def delta_table_path(delta_root: str, schema: str, table: str) -> str:
    """``<delta_root>/<schema>/<table>`` with the names as PostgreSQL stores them, but for the
    few characters no directory name can hold (:func:`~airflow_provider_pgdecode.batch.format.delta_path_part`)."""
    return join_path(delta_root, staged.delta_path_part(schema), staged.delta_path_part(table))


def type_change_way_forward(source: str, path: str) -> str:
    """What to do when a source column changed type in a way Delta cannot follow (the one wording;
    docs/merge.md, "DDL on a source table"); ``source`` is the source table's newest staged name
    (a renamed table's new one)."""
    return (
        f"Delta changes a column's type in place only to a wider type (type widening: a wider integer, "
        f"float to double, more decimal digits), and this change is not one, so nothing was written. To "
        f"continue: move the Delta table at {path} aside, then resnapshot {source} (pgdecode_backfill "
        f"mode=resnapshot), which re-creates it with the new type. Changing the column back in PostgreSQL helps "
        f"only when the new type widens to the former one (integer back to bigint), or when it was text: the "
        f"changes staged under the new type are merged as they are (as text)"
    )


def type_change_error(name: str, column: str, before: str, after: str, source: str, path: str) -> MergeInputError:
    """A source column's type change Delta cannot apply (``before``/``after``: the types, as said)."""
    return MergeInputError(
        f"table {name} column {column!r} changed type from {before} to {after}, a narrowing or incompatible "
        f"change; {type_change_way_forward(source, path)}"
    )


def kept_as_text(entry: TableSummary, catalog_type: str, overrides: Mapping[str, str]) -> Mapping[str, str]:
    """The type overrides of one staged column: the merge's own (``--type-map``), plus its type
    (or its array's element type) when the table's ``type_map`` kept it as text at staging."""
    if not entry.type_map:
        return overrides
    name = array_element(catalog_type) or catalog_type
    if not Staging.of(entry.type_map).keeps_as_text(name):
        return overrides
    return {**overrides, name.strip(): TEXT}


def _same_type(a: DataType, b: DataType) -> bool:
    return a.simpleString() == b.simpleString()


def _mode_and_key(
    name: str, entries: Sequence[tuple[BatchManifest, TableSummary]], latest: TableSummary
) -> tuple[str, bool, list[str], bool]:
    """The table's load mode, whether it is append-only, its key and whether it is matched as a
    multiset; raises :class:`MergeInputError` for a mode or key the merge cannot use."""
    modes = sorted({entry.mode for _, entry in entries})
    if len(modes) > 1:
        raise MergeInputError(
            f"table {name} is staged with modes {modes} in these batches (table_options changed): merge the "
            "batches before and after the change in separate runs. Nothing was written."
        )
    mode = latest.mode
    if mode not in LOAD_MODES:
        raise MergeInputError(
            f"table {name} is staged with mode {mode!r}, which this merge job does not know (it knows "
            f"{', '.join(LOAD_MODES)}): the batches were staged by a newer pgdecode; merge them with that "
            "version. Nothing was written."
        )
    append_only = mode == "append_only"
    key = [] if append_only else latest.key
    if not key and not append_only:
        raise MergeInputError(
            f"table {name} has no primary key the merge can use (the manifest's key is empty, replica "
            f"identity {latest.replica_identity or 'unknown'}): add a primary key, or set REPLICA IDENTITY "
            f"USING INDEX on a unique index of NOT NULL columns, or REPLICA IDENTITY FULL (rows are then "
            f"matched as a multiset), or load an insert-only table with table_options mode 'append_only', "
            f"then re-extract. Nothing was written."
        )
    is_multiset = not append_only and latest.keyed_by_all_columns
    if is_multiset and mode in KEPT_MODES:
        raise MergeInputError(keyless_kept_mode_error(name, mode, "Nothing was written."))
    numbers = column_renames.staged_numbers((c.name, c.attnum) for _, entry in entries for c in entry.columns)
    for batch, entry in entries:
        # A key column renamed between batches is the same key: compared by attribute number.
        if not append_only and entry.key and [numbers.get(k, k) for k in entry.key] != [numbers.get(k, k) for k in key]:
            raise MergeInputError(
                f"table {name}: the key changed from {list(entry.key)} (batch {batch.label}) to {list(key)}; "
                f"merge these batches in separate runs or rebuild the Delta table"
            )
    return mode, append_only, key, is_multiset


def _column_types(
    name: str,
    entries: Sequence[tuple[BatchManifest, TableSummary]],
    key: Sequence[str],
    source: str,
    path: str,
    options: MergeOptions,
) -> tuple[list[str], dict[str, ColumnType]]:
    """The staged columns in order and the type of each (the last staged, when a type widened);
    raises :class:`MergeInputError` for a column the merge cannot store."""
    unbounded = parse_unbounded_numeric_rule(options.unbounded_numeric)
    columns: list[str] = []
    types: dict[str, ColumnType] = {}
    for _, entry in entries:
        for column in entry.columns:
            if column.name.startswith(staged.METADATA_PREFIX):
                raise MergeInputError(
                    f"table {name}: source column {column.name!r} collides with the {staged.METADATA_PREFIX} metadata columns"
                )
            try:
                mapped = map_catalog_type(
                    column.source_type,
                    unbounded_numeric=unbounded,
                    type_overrides=kept_as_text(entry, column.source_type, options.type_overrides),
                    user_type=column.user_type,
                    # A table staged with the option arrays: json has its arrays staged as text.
                    arrays=ARRAYS_AS_JSON if column.arrow == TEXT else ARRAYS_AS_LIST,
                )
            except UnmappedTypeError as error:
                raise MergeInputError(f"table {name} column {column.name!r}: {error}") from None
            before = types.get(column.name)
            if before is not None and not _same_type(before.delta_type, mapped.delta_type):
                if not widens(before.delta_type, mapped.delta_type):
                    raise type_change_error(
                        name,
                        column.name,
                        f"{before.catalog_type!r} ({before.delta_type.simpleString()} in Delta)",
                        f"{column.source_type!r} ({mapped.delta_type.simpleString()})",
                        source,
                        path,
                    )
            if column.name not in types:
                columns.append(column.name)
            types[column.name] = mapped
    missing_key = [k for k in key if k not in types]
    if missing_key:
        raise MergeInputError(f"table {name}: key column(s) {missing_key} are not among the manifest's columns")
    lowered: dict[str, str] = {}
    for column_name in columns:
        other = lowered.setdefault(column_name.lower(), column_name)
        if other != column_name:
            raise MergeInputError(
                f"table {name}: columns {other!r} and {column_name!r} differ only in case, which Delta cannot store"
            )
    return columns, types


def recorded_key_now(state: DeltaState, renamed: Mapping[str, str]) -> list[str] | None:
    """The key the Delta table records (its property), under the names its columns take once the
    source's renames are followed (a renamed key column is the same key)."""
    text = state.properties.get(KEY_PROPERTY)
    return None if text is None else [renamed.get(column, column) for column in json.loads(text)]


def _against_delta(
    name: str,
    path: str,
    source: str,
    state: DeltaState,
    mode: str,
    append_only: bool,
    key: Sequence[str],
    columns: Sequence[str],
    types: Mapping[str, ColumnType],
    renamed: Mapping[str, str],
    full_rows: bool = True,
) -> tuple[tuple[str, ...], dict[str, DataType], tuple[str, ...]]:
    """The columns to add, the columns whose Delta type stays wider and the Delta columns the
    batches do not write, checked against the existing Delta table (key, mode, types); raises
    :class:`MergeInputError` for what cannot change in place. Without ``full_rows`` (no insert or
    update staged: deletes carry their key only) no column counts as gone from the source."""
    new_columns: tuple[str, ...] = ()
    widened: dict[str, DataType] = {}
    not_written: tuple[str, ...] = ()
    if state.exists and state.schema is not None:
        delta_fields = {f.name: f for f in state.schema.fields}
        for old, new in renamed.items():  # checked as the column it becomes before the write
            delta_fields[new] = delta_fields.pop(old)
        recorded_key = recorded_key_now(state, renamed)
        if not append_only and recorded_key is not None and recorded_key != list(key):
            raise MergeInputError(
                f"table {name}: the Delta table at {path} is keyed on {recorded_key}, the source now on "
                f"{list(key)}; a key change needs the Delta table rebuilt"
            )
        recorded_mode = state.properties.get(MODE_PROPERTY)
        if (mode in KEPT_MODES or recorded_mode in KEPT_MODES) and recorded_mode != mode:
            raise MergeInputError(
                f"table {name}: the Delta table at {path} is kept in mode {recorded_mode or 'merge'!r} (its property "
                f"{MODE_PROPERTY}), and the batches stage the table with mode {mode!r} (table_options): a table's "
                "mode cannot change in place, its columns and rows differ. Nothing was written. Set table_options "
                f"back to {recorded_mode or 'merge'!r} (and re-extract), or move the Delta table aside and "
                f"resnapshot {source} (pgdecode_backfill mode=resnapshot), which creates it in mode {mode!r}"
            )
        for column_name in columns:
            mapped_type = types[column_name]
            if column_name not in delta_fields:
                continue
            delta_type = delta_fields[column_name].dataType
            if _same_type(delta_type, mapped_type.delta_type):
                continue
            if not widens(delta_type, mapped_type.delta_type):
                raise type_change_error(
                    name,
                    column_name,
                    f"{delta_type.simpleString()} (the Delta table's)",
                    f"{mapped_type.catalog_type!r} ({mapped_type.delta_type.simpleString()} in Delta)",
                    source,
                    path,
                )
            widened[column_name] = delta_type
        new_columns = tuple(c for c in columns if c not in delta_fields)
        missing_in_delta = [k for k in key if k in new_columns]
        if missing_in_delta:
            raise MergeInputError(
                f"table {name}: key column(s) {missing_in_delta} are not in the Delta table at {path}"
            )
        not_written = tuple(
            f.name
            for f in state.schema.fields
            if full_rows
            and f.name not in types
            and f.name not in renamed
            and not f.name.startswith(staged.METADATA_PREFIX)
        )
    return new_columns, widened, not_written


def _add_segments(
    plan: TablePlan, batches: Sequence[BatchManifest], entries: Sequence[tuple[BatchManifest, TableSummary]]
) -> None:
    """The batches (in LSN order) the table still needs as ``plan.segments``, with the watermark
    they take it to; those it already holds are skipped (``plan.skipped``), with a warning."""
    name = plan.name
    state = plan.state
    applied_through = state.watermark if state.watermark is not None else -1
    for batch in batches:
        for staged_entry in (entry for entry_batch, entry in entries if entry_batch is batch):
            if batch.end <= applied_through or (
                staged_entry.max_commit is not None and staged_entry.max_commit <= applied_through
            ):
                if batch.label in plan.skipped:
                    continue
                plan.skipped.append(batch.label)
                log.warning(
                    "table %s: batch %s (%s) is already applied: the table holds changes through LSN %s; skipped",
                    name,
                    batch.label,
                    batch.directory,
                    Lsn(applied_through),
                )
            elif staged_entry.files:
                plan.segments.append(Segment(batch, staged_entry, applied_through))
                plan.watermark_after = max(plan.watermark_after, int(batch.end))
        applied_through = max(applied_through, int(batch.end))


def since_resnapshot(
    name: str, entries: list[tuple[BatchManifest, TableSummary]]
) -> list[tuple[BatchManifest, TableSummary]]:
    """The table's entries from the last batch that starts a resnapshot of it (a table snapshot's
    TRUNCATE) on: what earlier batches staged is emptied by that TRUNCATE, so they are not read
    (nor typed, nor keyed) at all. This is what lets a resnapshot replace the changes of a parked
    table that were refused. Kept modes (``history``, ``soft_delete``) keep every version: all."""
    if entries[-1][1].mode in KEPT_MODES:
        return entries
    starts = [
        index
        for index, (batch, _) in enumerate(entries)
        if any(chunk.get("table") == name and chunk.get("kind") == "truncate" for chunk in batch.snapshot_chunks)
    ]
    if not starts or starts[-1] == 0:
        return entries
    first = entries[starts[-1]][0]
    kept = [(batch, entry) for batch, entry in entries if batch is first or batch.end > first.end]
    earlier = sorted({batch.label for batch, _ in entries} - {batch.label for batch, _ in kept})
    log.info(
        "table %s: batch %s starts a resnapshot of it; what batch(es) %s staged before it is not read (the "
        "resnapshot empties the table first)",
        name,
        first.label,
        ", ".join(earlier),
    )
    return kept


def plan_table(
    schema: str,
    table: str,
    batches: Sequence[BatchManifest],
    delta_root: str,
    state: DeltaState,
    options: MergeOptions,
) -> TablePlan:
    """Decide how one table is merged, or raise :class:`MergeInputError` saying why it cannot be."""
    path = delta_table_path(delta_root, schema, table)
    name = f"{schema}.{table}"
    # A renamed source table's changes staged under each of its names (docs/merge.md) flow here.
    entries = [(batch, entry) for batch in batches for entry in batch.tables if entry.target == (schema, table)]
    entries = since_resnapshot(name, entries)
    latest = entries[-1][1]
    source = max(entries, key=lambda e: (e[0].end, e[1].max_commit or Lsn(0)))[1].qualified_name
    mode, append_only, key, is_multiset = _mode_and_key(name, entries, latest)
    columns, types = _column_types(name, entries, key, source, path, options)

    live = column_renames.staged_numbers((c.name, c.attnum) for _, entry in entries for c in entry.columns)
    recorded = column_renames.recorded_numbers(state.properties) if state.exists else {}
    renamed, staged_as = column_renames.renames(
        live, recorded, [f.name for f in state.schema.fields] if state.schema is not None else []
    )
    formers = {old for names in staged_as.values() for old in names}
    columns = [c for c in columns if c not in formers]  # their values are read as the column's name now
    full_rows = any(entry.inserts + entry.updates > 0 for _, entry in entries)
    new_columns, widened, not_written = _against_delta(
        name, path, source, state, mode, append_only, key, columns, types, renamed, full_rows
    )

    if is_multiset:
        uncomparable = multiset.uncomparable_columns({c: types[c].delta_type for c in columns})
        if uncomparable:
            raise multiset.uncomparable_error(name, uncomparable, {c: types[c].delta_type for c in columns})
    plan = TablePlan(
        schema=schema,
        table=table,
        path=path,
        key=tuple(key),
        columns=tuple(columns),
        types=types,
        segments=[],
        state=state,
        new_columns=new_columns,
        widened=widened,
        not_written=not_written,
        multiset=is_multiset,
        append_only=append_only,
        mode=mode,
        missing=column_defaults.missing_values(entry for _, entry in entries),
        renamed=renamed,
        staged_as=staged_as,
        numbers=column_renames.numbers_after(recorded, live),
        numbers_changed=column_renames.numbers_after(recorded, live) != recorded,
    )
    _add_segments(plan, batches, entries)
    return plan


def parks(error: MergeInputError, options: MergeOptions) -> bool:
    """Whether ``error`` of one table parks that table under ``options`` (:mod:`.table_parking`)."""
    return options.park and table_parking.parks_merge_input(error, options.park_refused)


@dataclass(frozen=True)
class UnreadableTable:
    """A table parked while planning: its Delta table could not be read, or its staged changes
    were refused (:mod:`.table_parking`)."""

    schema: str
    table: str
    path: str
    error: MergeInputError

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


def plan_merge(
    spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str, options: MergeOptions
) -> list[TablePlan | UnreadableTable]:
    """Plan every table of ``batches`` (in LSN order); raises before anything is written. With
    ``options.park``, a table whose Delta table cannot be read, or whose changes are refused, is
    returned as :class:`UnreadableTable`."""
    names: list[tuple[str, str]] = []
    for batch in batches:
        for entry in batch.tables:
            if entry.target not in names:
                names.append(entry.target)
    slot_app_id = app_id(batches[0].slot)
    plans: list[TablePlan | UnreadableTable] = []
    for schema, table in names:
        path = delta_table_path(delta_root, schema, table)
        try:
            state = read_delta_state(spark, path, slot_app_id)
            plans.append(plan_table(schema, table, batches, delta_root, state, options))
        except MergeInputError as error:
            if not parks(error, options):
                raise
            plans.append(UnreadableTable(schema, table, path, error))
    return plans
