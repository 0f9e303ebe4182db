"""The merge job: apply staged batches to Delta tables, exactly once, one MERGE per table.

Run it with spark-submit (Delta's jars through ``--packages``, see :mod:`.session`)::

    spark-submit --master local[*] --packages io.delta:delta-spark_4.2_2.13:4.4.0 \\
        --conf spark.jars.ivy=.cache/ivy  airflow_provider_pgdecode/spark/merge_job.py \\
        --delta-root /data/delta --batch /data/staging/slot/0000000001A2B3C8-0000000001A9F000

or call :func:`merge_batches` with a SparkSession. Plain PySpark and delta-spark: no Airflow.

How a run goes (docs/merge.md explains the why):

1. **Read and check** every batch's manifest (complete, files present, one slot) and plan each
   table: its Delta path ``<delta_root>/<schema>/<table>``, the type of every column, the key,
   the columns to add, and which batches (or rows) the table already holds. The table's
   *watermark* is the Delta idempotent-write transaction version of app id ``pgdecode:<slot>``:
   the end LSN of the last batch merged into it, committed atomically with that MERGE.
2. **Profile** each table's staged changes (counts, TRUNCATE position, unchanged-TOAST columns,
   NULL keys, numeric values that do not fit, key ranges). The staged parts are read on the
   driver first: when they show nothing to refuse or plan around, that is the profile; otherwise
   one aggregate Spark pass computes it. Any bad input fails here, before anything is written.
3. **Write**: create the table or add new columns when needed, then one MERGE per table that
   deletes, updates and inserts the last state per key, folds a TRUNCATE in as
   ``WHEN NOT MATCHED BY SOURCE ... DELETE``, and records the new watermark in the same commit.

Batches and the Delta root may be local paths or ``s3://`` (``s3a://``) locations
(docs/object-storage.md): manifests and Parquet footers are read through the batch format's
storage layer, Spark reads the parts and writes Delta through ``s3a://``, and the store's settings
come from the ``AWS_*`` environment (set by the operators, never on the command line) onto the
session's Hadoop configuration (:func:`~.session.configure_object_store`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow.parquet

if __package__ in (None, ""):  # run as a file by spark-submit: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DecimalType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

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
    is_local_path,
    join_path,
    local_path,
)
from airflow_provider_pgdecode.batch.manifest import BatchManifest, TableSummary, read_batches
from airflow_provider_pgdecode.batch.options import LOAD_MODES, keyless_kept_mode_error
from airflow_provider_pgdecode.batch.parking import PARKED
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, fsync_dir, is_object_store, spark_uri
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import (
    BatchError,
    ConfigurationError,
    DeltaTableError,
    MergeInputError,
    MergeOutOfMemoryError,
    UnmappedTypeError,
)
from airflow_provider_pgdecode.spark import (
    collapse,
    column_defaults,
    column_renames,
    delta_commit,
    history,
    multiset,
    table_parking,
)
from airflow_provider_pgdecode.spark.collapse import KEEP, KIND, LSN, OP, SEQ, CollapseInput, col, old_key_name
from airflow_provider_pgdecode.spark.delta_state import (
    DeltaState,
    app_id,
    bucket_storage,
    delta_log_storage,
    log_version,
    read_delta_state,
    table_storage,
)
from airflow_provider_pgdecode.spark.history import HISTORY, KEPT_MODES, MODE_PROPERTY, SOFT_DELETE, Truncate
from airflow_provider_pgdecode.spark.session import active_connect_session, configure_object_store, is_connect_session
from airflow_provider_pgdecode.spark.spark_types import (
    DEFAULT_UNBOUNDED_NUMERIC,
    NUMERIC_SPECIAL_VALUES,
    ColumnType,
    delta_ready,
    map_catalog_type,
    parse_unbounded_numeric_rule,
    prints_as_its_text,
    staged_type_matches,
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
    """Runs with fewer staged changes evaluate Spark expressions interpreted (:func:`expression_evaluation`);
    0: always compile."""
    snapshot_commit: bool = True
    """Into a Delta table this run creates, commit a snapshot batch's parts as they are staged
    (:mod:`.delta_commit`) instead of reading and appending them through Spark."""
    park: bool = True
    """Park a table whose Delta table cannot be read or written and merge the others
    (:mod:`.table_parking`); ``False``: such a table stops the whole run."""
    parked: tuple[str, ...] = ()
    """``schema.table`` of the tables parked by earlier runs (batch/parking.py)."""
    catch_up: tuple[str, ...] = ()
    """Earlier batches the parked tables still need: merged for those tables only."""

    def __post_init__(self) -> None:
        if self.numeric_special not in ("null", "error"):
            raise ConfigurationError(f"numeric_special must be 'null' or 'error', not {self.numeric_special!r}")
        parse_unbounded_numeric_rule(self.unbounded_numeric)


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
    def truncate_at(self) -> tuple[int, int] | None:
        """The last TRUNCATE's (commit LSN, position): what a current-state table keeps starts after it."""
        if not self.truncations:
            return None
        last = self.truncations[-1]
        return (last.lsn, last.seq)


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


def _same_type(a: DataType, b: DataType) -> bool:
    return a.simpleString() == b.simpleString()


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
    latest = entries[-1][1]
    source = max(entries, key=lambda e: (e[0].end, e[1].max_commit or Lsn(0)))[1].qualified_name
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
    for batch, entry in entries:
        if not append_only and entry.key and tuple(entry.key) != tuple(key):
            raise MergeInputError(
                f"table {name}: the key changed from {list(entry.key)} (batch {batch.label}) to {list(key)}; "
                f"merge these batches in separate runs or rebuild the Delta table"
            )
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

    new_columns: tuple[str, ...] = ()
    widened: dict[str, DataType] = {}
    not_written: tuple[str, ...] = ()
    live = column_renames.staged_numbers((c.name, c.attnum) for _, entry in entries for c in entry.columns)
    recorded = column_renames.recorded_numbers(state.properties) if state.exists else {}
    renamed, staged_as = column_renames.renames(
        live, recorded, [f.name for f in state.schema.fields] if state.schema is not None else []
    )
    formers = {old for names in staged_as.values() for old in names}
    columns = [c for c in columns if c not in formers]  # their values are read as the column's name now
    if state.exists and state.schema is not None:
        delta_fields = {f.name: f for f in state.schema.fields}
        for old, new in renamed.items():  # checked as the column it becomes before the write
            delta_fields[new] = delta_fields.pop(old)
        recorded_key = state.properties.get(KEY_PROPERTY)
        if not append_only and recorded_key is not None and json.loads(recorded_key) != list(key):
            raise MergeInputError(
                f"table {name}: the Delta table at {path} is keyed on {json.loads(recorded_key)}, the source now on "
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
            if f.name not in types and f.name not in renamed and not f.name.startswith(staged.METADATA_PREFIX)
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
    return plan


@dataclass(frozen=True)
class UnreadableTable:
    """A table whose Delta table could not be read while planning (it is parked)."""

    schema: str
    table: str
    path: str
    error: DeltaTableError

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


def plan_merge(
    spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str, options: MergeOptions
) -> list[TablePlan | UnreadableTable]:
    """Plan every table of ``batches`` (in LSN order); raises before anything is written. With
    ``options.park``, a table whose Delta table cannot be read is returned as :class:`UnreadableTable`."""
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
        except DeltaTableError as error:
            if not options.park:
                raise
            plans.append(UnreadableTable(schema, table, path, error))
            continue
        plans.append(plan_table(schema, table, batches, delta_root, state, options))
    return plans


# --------------------------------------------------------------------------------------------
# Reading staged changes
# --------------------------------------------------------------------------------------------


def unreadable_part(batch: BatchManifest, table: str, file: str, cause: BaseException) -> BatchError:
    """The error for a staged Parquet part that is missing or cannot be read: names the batch,
    the table and the file, and how to get past it."""
    detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return BatchError(
        f"batch {batch.directory} ({batch.label}): staged part {file} of table {table} cannot be read "
        f"({detail[:500]}); it was damaged or removed after the batch was staged. Nothing was written to Delta. "
        "Restore the file from a copy, or move the batch directory away and run the extract again, which "
        "stages the same LSN range anew (the slot was not advanced past a batch that was never merged)"
    )


def uses_object_store(batch_dirs: Iterable[str], delta_root: str) -> bool:
    """Whether a run reads or writes ``s3://`` (``s3a://``) locations."""
    return any(is_object_store(location) for location in [*batch_dirs, delta_root])


@functools.lru_cache(maxsize=16)
def footers_readable(file: str) -> bool:
    """Whether pyarrow reads this part's footer here: a local file or one on object storage."""
    return is_local_path(file) or is_object_store(file)


@contextmanager
def open_part(file: str) -> Iterator[Any]:
    """A staged part for pyarrow's readers: its local path, or an open file on object storage read
    through the batch format's storage layer (settings from the ``AWS_*`` environment)."""
    if is_object_store(file):
        bucket, _, key = file.split("://", 1)[1].partition("/")
        with bucket_storage(bucket, ObjectStoreSettings.from_env()).open_input(key) as handle:
            yield handle
    else:
        yield local_path(file)


def check_staged_parts(plans: Sequence[TablePlan]) -> None:
    """Read the footer of every Parquet part the merge will read (local or on object storage): a
    truncated, empty or missing part fails here, before any Delta table is created or written."""
    import pyarrow.parquet as pq

    for plan in plans:
        for segment in plan.segments:
            for file in segment.staged.file_paths:
                if not footers_readable(file):
                    continue  # another Hadoop filesystem: Spark's read names the file (see staged_part_error)
                try:
                    with open_part(file) as source:
                        pq.read_metadata(source)
                except Exception as exc:  # OSError, pyarrow's ArrowInvalid: what reading it would raise
                    raise unreadable_part(segment.batch, plan.name, file, exc) from exc


def staged_part_error(plan: TablePlan, exc: BaseException) -> BatchError | None:
    """The :func:`unreadable_part` error when Spark failed reading one of the plan's staged parts."""
    text = str(exc)
    for segment in plan.segments:
        for file in segment.staged.file_paths:
            if local_path(file) in text or file in text or spark_uri(file) in text:
                return unreadable_part(segment.batch, plan.name, file, exc)
    return None


def _staged_columns(spark: SparkSession, file: str) -> tuple[tuple[str, str], ...]:
    """A staged part's columns with their types: parts of one batch differ when a column changed
    type within it, and are read in separate groups."""
    if footers_readable(file):
        import pyarrow.parquet as pq

        with open_part(file) as source:
            return tuple((f.name, str(f.type)) for f in pq.read_schema(source))
    return tuple(spark.read.parquet(spark_uri(file)).dtypes)


def _is_special(value: Column) -> Column:
    return value.isin(*NUMERIC_SPECIAL_VALUES)


def _convert(value: Column, column_type: ColumnType) -> Column:
    """A staged value as its Delta type (NaN/Infinity numeric becomes NULL)."""
    target = column_type.delta_type
    if column_type.is_numeric_text:
        if column_type.element is not None:
            element_type = column_type.element.delta_type
            return F.transform(value, lambda x: F.when(_is_special(x), F.lit(None)).otherwise(x.cast(element_type)))
        return F.when(_is_special(value), F.lit(None).cast(target)).otherwise(value.cast(target))
    return value.cast(target)


def _numeric_lossy(value: Column, decimal: DecimalType) -> Column:
    """True when decimal text has more integer or fraction digits than ``decimal`` holds."""
    integer = F.regexp_replace(F.regexp_extract(value, r"^[-+]?0*(\d*)", 1), r"^0+", "")
    fraction = F.regexp_replace(F.regexp_extract(value, r"\.(\d*)$", 1), r"0+$", "")
    return ~_is_special(value) & (
        (F.length(integer) > decimal.precision - decimal.scale) | (F.length(fraction) > decimal.scale)
    )


def _diagnostics(value: Column, column_type: ColumnType) -> tuple[Column, Column]:
    """(is NaN/Infinity, does not fit) for a numeric column staged as text."""
    decimal = column_type.element.delta_type if column_type.element is not None else column_type.delta_type
    assert isinstance(decimal, DecimalType)
    if column_type.element is not None:
        return (
            F.coalesce(F.exists(value, _is_special), F.lit(False)),
            F.coalesce(F.exists(value, lambda x: _numeric_lossy(x, decimal)), F.lit(False)),
        )
    return F.coalesce(_is_special(value), F.lit(False)), F.coalesce(_numeric_lossy(value, decimal), F.lit(False))


def _special_key(plan: TablePlan, present: list[str], typed: set[str], old_fields: set[str]) -> Column:
    """True for a change whose numeric key column, new or old, holds NaN or ±Infinity (staged as text)."""
    flag = F.lit(False)
    for key_column in plan.key:
        if not plan.types[key_column].is_numeric_text or plan.types[key_column].element is not None:
            continue
        if key_column in present and key_column not in typed:
            flag = flag | F.coalesce(_is_special(col(key_column)), F.lit(False))
        if key_column in old_fields and key_column not in typed:
            flag = flag | F.coalesce(_is_special(F.col(staged.OLD).getField(key_column)), F.lit(False))
    return flag


def special_name(index: int) -> str:
    return f"__special_{index}"


def lossy_name(index: int) -> str:
    return f"__lossy_{index}"


def _under_names_now(
    frame: DataFrame, staged_names: list[str], manifest_columns: set[str], staged_as: Mapping[str, tuple[str, ...]]
) -> tuple[DataFrame, list[str], set[str]]:
    """Parts staged before a column's rename carry its former name: read as the name now."""
    known = set(manifest_columns)
    for name, formers in staged_as.items():
        if name in staged_names:
            continue
        former = next((old for old in formers if old in staged_names and old in known), None)
        if former is not None:
            frame = frame.withColumnRenamed(former, name)
            staged_names = [name if n == former else n for n in staged_names]
            known.add(name)
    return frame, staged_names, known


def staged_events(spark: SparkSession, plan: TablePlan) -> DataFrame:
    """The table's staged changes of every segment, typed as in Delta, one row per change.

    Columns: the source columns (Delta types), the metadata columns, ``__lsn``, ``__seq``,
    ``__op``, ``__keep`` (columns this change must not write), ``__old_<i>`` (old key) and
    numeric diagnostics. Rows already applied (commit LSN at or below the segment's
    ``applied_through``) are left out.
    """
    numeric_columns = [c for c in plan.columns if plan.types[c].is_numeric_text]
    frames: list[DataFrame] = []
    for segment in plan.segments:
        manifest_columns = {c.name for c in segment.staged.columns}
        groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for file in segment.staged.file_paths:
            groups.setdefault(_staged_columns(spark, file), []).append(file)
        for staged_schema, files in groups.items():
            staged_names = [name for name, _ in staged_schema]
            frame = spark.read.parquet(*[spark_uri(file) for file in files])
            frame, staged_names, known = _under_names_now(frame, staged_names, manifest_columns, plan.staged_as)
            present = [c for c in plan.columns if c in staged_names and c in known]
            for column in present:
                staged_type = frame.schema[column].dataType
                # Parts staged before the column widened (in this batch or an earlier one) are cast,
                # as are integers and booleans staged before it became text again.
                delta_type = plan.types[column].delta_type
                if staged_type_matches(plan.types[column], staged_type) or widens(staged_type, delta_type):
                    continue
                if prints_as_its_text(staged_type, delta_type):
                    continue
                if isinstance(delta_type, StringType):
                    # Back to text from another type: a rewrite, which the extract resnapshots
                    # (capture/rewrites.py); until then these rows hold Spark's text of the value.
                    log.warning(
                        "table %s column %s: %d part(s) staged as %s before the column became text are merged "
                        "as Spark prints the values, which can differ from PostgreSQL's text (a time zone, a "
                        "float's digits); the resnapshot the extract files for the column's rewrite replaces them",
                        plan.name,
                        column,
                        len(files),
                        staged_type.simpleString(),
                    )
                    continue
                raise MergeInputError(
                    f"table {plan.name} column {column!r} in {files[0]}: staged as {staged_type.simpleString()}, "
                    f"but catalog type {plan.types[column].catalog_type!r} is staged as "
                    f"{' or '.join(t.simpleString() for t in plan.types[column].staged_types)}"
                )
            # A snapshot stages bounded numeric as its Delta decimal already (capture/snapshot.py).
            typed = {
                c
                for c in present
                if plan.types[c].is_numeric_text and isinstance(frame.schema[c].dataType, DecimalType)
            }
            absent = [c for c in plan.value_columns if c not in present]
            missing_key = [k for k in plan.key if k not in present]
            if missing_key and present:  # a part without source columns holds TRUNCATEs only (batch/writer.py)
                raise MergeInputError(f"table {plan.name}: staged file {files[0]} has no key column(s) {missing_key}")
            old_fields = (
                {f.name for f in frame.schema[staged.OLD].dataType.fields}  # type: ignore[attr-defined]
                if staged.OLD in staged_names and isinstance(frame.schema[staged.OLD].dataType, StructType)
                else set()
            )
            toast = (
                F.coalesce(F.col(staged.UNCHANGED_TOAST), F.array().cast("array<string>"))
                if staged.UNCHANGED_TOAST in staged_names
                else F.array().cast("array<string>")
            )
            keep = F.when(F.col(staged.OP) == "I", F.array().cast("array<string>")).otherwise(
                F.array_distinct(F.concat(toast, F.array(*[F.lit(c) for c in absent]).cast("array<string>")))
            )
            selected: list[Column] = [
                F.col(COMMIT_LSN).cast("bigint").alias(LSN),
                F.col(staged.SEQ).cast("int").alias(SEQ),
                F.col(staged.OP).alias(OP),
                keep.alias(KEEP),
                F.col(COMMIT_LSN).cast("bigint").alias(COMMIT_LSN),
                (
                    F.col(COMMIT_TIME).cast("timestamp")
                    if COMMIT_TIME in staged_names
                    else F.lit(None).cast("timestamp")
                ).alias(COMMIT_TIME),
                (F.col(XID).cast("bigint") if XID in staged_names else F.lit(None).cast("bigint")).alias(XID),
            ]
            for column in plan.columns:
                delta_type = plan.types[column].delta_type
                if column in typed:
                    value = col(column).cast(delta_type)  # a no-op unless the decimal widened since
                elif column in present:
                    value = _convert(col(column), plan.types[column])
                elif column in plan.missing:  # staged before the column was added with a default
                    value = F.expr(column_defaults.sql_value(plan.missing[column], delta_type))
                else:
                    value = F.lit(None).cast(delta_type)
                selected.append(value.alias(column))
            for index, key_column in enumerate(plan.key):
                old = (
                    (
                        F.col(staged.OLD).getField(key_column).cast(plan.types[key_column].delta_type)
                        if key_column in typed
                        else _convert(F.col(staged.OLD).getField(key_column), plan.types[key_column])
                    )
                    if key_column in old_fields
                    else F.lit(None).cast(plan.types[key_column].delta_type)
                )
                selected.append(old.alias(old_key_name(index)))
            selected.append((F.col(staged.OLD).isNotNull() if old_fields else F.lit(False)).alias(HAS_OLD))
            selected.append(_special_key(plan, present, typed, old_fields).alias(SPECIAL_KEY))
            for index, column in enumerate(numeric_columns):
                if column in present and column not in typed:
                    special, lossy = _diagnostics(col(column), plan.types[column])
                    if not plan.types[column].may_lose_digits:
                        # numeric(p,s): PostgreSQL already rounded to the scale, it always fits.
                        lossy = F.lit(False)
                else:
                    special, lossy = F.lit(False), F.lit(False)
                selected += [special.alias(special_name(index)), lossy.alias(lossy_name(index))]
            events = frame.select(*selected)
            if segment.applied_through >= 0:
                events = events.where(F.col(LSN) > F.lit(segment.applied_through))
            frames.append(events)
    result = frames[0]
    for frame in frames[1:]:
        result = result.unionByName(frame)
    return result


def profile_events(events: DataFrame, plan: TablePlan, key_ranges: KeyRanges | None = None) -> Profile:
    """One aggregate pass: counts, the TRUNCATEs, kept columns, bad keys, numeric trouble, the key's
    bounds. ``key_ranges``: the ranges :func:`staged_key_ranges` found (else the key's bounds are
    the one range)."""
    numeric_columns = [c for c in plan.columns if plan.types[c].is_numeric_text]
    upsert = F.col(OP).isin("I", "U")
    any_new_key_null = F.lit(False)
    any_old_key_null = F.lit(False)
    for index, key_column in enumerate(plan.key):
        any_new_key_null = any_new_key_null | col(key_column).isNull()
        any_old_key_null = any_old_key_null | F.col(old_key_name(index)).isNull()
    aggregates: list[Column] = [
        F.count(F.lit(1)).alias("changes"),
        F.sum(F.when(F.col(OP) == "I", 1).otherwise(0)).alias("inserts"),
        F.sum(F.when(F.col(OP) == "U", 1).otherwise(0)).alias("updates"),
        F.sum(F.when(F.col(OP) == "D", 1).otherwise(0)).alias("deletes"),
        F.sum(F.when(F.col(OP) == "T", 1).otherwise(0)).alias("truncates"),
        F.collect_set(
            F.when(
                F.col(OP) == "T",
                F.struct(
                    F.col(LSN).alias("lsn"),
                    F.col(SEQ).alias("seq"),
                    F.unix_micros(F.col(COMMIT_TIME)).alias("micros"),
                    F.col(XID).alias("xid"),
                ),
            )
        ).alias("truncate_list"),
        F.array_distinct(F.flatten(F.collect_set(F.when(upsert, F.col(KEEP))))).alias("keep_columns"),
        F.sum(
            F.when((F.col(OP) == "U") & collapse.key_changed(plan.key) & (F.size(F.col(KEEP)) > 0), 1).otherwise(0)
        ).alias("keep_moves"),
        F.sum(F.when((upsert & any_new_key_null) | ((F.col(OP) == "D") & any_old_key_null), 1).otherwise(0)).alias(
            "null_keys"
        ),
        F.sum(F.when(~F.col(OP).isin("I", "U", "D", "T"), 1).otherwise(0)).alias("unknown_ops"),
        F.sum(F.when(F.col(OP).isin("U", "D") & ~F.col(HAS_OLD), 1).otherwise(0)).alias("missing_old"),
        F.sum(F.col(SPECIAL_KEY).cast("int")).alias("special_keys"),
    ]
    for index in range(len(numeric_columns)):
        aggregates.append(F.sum(F.col(special_name(index)).cast("int")).alias(special_name(index)))
        aggregates.append(F.sum(F.col(lossy_name(index)).cast("int")).alias(lossy_name(index)))
    single_key = plan.key[0] if len(plan.key) == 1 else None
    if single_key is not None:
        aggregates.append(F.min(F.least(col(single_key), F.col(old_key_name(0)))).alias("key_min"))
        aggregates.append(F.max(F.greatest(col(single_key), F.col(old_key_name(0)))).alias("key_max"))
    row = events.agg(*aggregates).collect()[0]

    def total(name: str) -> int:
        return int(row[name] or 0)

    truncate_list = sorted(
        {
            Truncate(
                int(t["lsn"]),
                int(t["seq"]),
                None if t["micros"] is None else int(t["micros"]),
                None if t["xid"] is None else int(t["xid"]),
            )
            for t in (row["truncate_list"] or ())
        }
    )
    kept = set(row["keep_columns"] or ())
    keep_columns = tuple(c for c in plan.value_columns if c in kept)
    if total("unknown_ops"):
        raise MergeInputError(
            f"table {plan.name}: {total('unknown_ops')} staged change(s) have an _pg_op other than I, U, D, T"
        )
    ranges: list[tuple[Any, Any]] | None = None
    key_min = key_max = None
    if single_key is not None and row["key_min"] is not None:
        key_min, key_max = row["key_min"], row["key_max"]
        ranges = key_ranges.ranges if key_ranges is not None else [(key_min, key_max)]
    return Profile(
        changes=total("changes"),
        inserts=total("inserts"),
        updates=total("updates"),
        deletes=total("deletes"),
        truncates=total("truncates"),
        keep_columns=keep_columns,
        keep_moves=total("keep_moves"),
        null_keys=total("null_keys"),
        specials={c: total(special_name(i)) for i, c in enumerate(numeric_columns) if total(special_name(i))},
        lossy={c: total(lossy_name(i)) for i, c in enumerate(numeric_columns) if total(lossy_name(i))},
        key_min=key_min,
        key_max=key_max,
        key_ranges=ranges,
        missing_old=total("missing_old"),
        special_keys=total("special_keys"),
        truncations=tuple(truncate_list),
    )


def staged_key_bounds(plan: TablePlan) -> tuple[int, int] | None:
    """Min and max of an integer key over the staged files, from their Parquet statistics.

    Reads only file footers (local or on object storage); ``None`` when a statistic is missing.
    """
    key = integer_key(plan)
    if key is None:
        return None
    import pyarrow.parquet as pq

    low: int | None = None
    high: int | None = None
    for segment in plan.segments:
        for file in segment.staged.file_paths:
            if not footers_readable(file):
                return None
            with open_part(file) as source:
                metadata = pq.ParquetFile(source).metadata
            paths = {key, f"{staged.OLD}.{key}"}
            for group in range(metadata.num_row_groups):
                row_group = metadata.row_group(group)
                for index in range(row_group.num_columns):
                    column = row_group.column(index)
                    if column.path_in_schema not in paths:
                        continue
                    stats = column.statistics
                    if stats is None or not stats.has_min_max:
                        if stats is not None and stats.null_count == row_group.num_rows:
                            continue
                        return None
                    low = stats.min if low is None else min(low, stats.min)
                    high = stats.max if high is None else max(high, stats.max)
    if low is None or high is None:
        return None
    return int(low), int(high)


@dataclass
class KeyRanges:
    """Where a single integer key's staged values lie: its bounds, and ranges of the values for
    file skipping (:func:`merge_condition`)."""

    key_min: int
    key_max: int
    ranges: list[tuple[int, int]]


class _KeyRangeCollector:
    """Collects the key ranges of staged parts: with the key's bounds known from the parts'
    statistics, keys go into :data:`KEY_BUCKETS` buckets of equal width and each bucket's
    (min, max) is a range; without them, the key's (min, max) is the one range. A change that
    moves a key covers both its keys, in the bucket of its new key (as the MERGE needs both)."""

    def __init__(self, bounds: tuple[int, int] | None) -> None:
        # Bucket numbers must fit in int64 arithmetic.
        self.bounds = bounds if bounds is not None and bounds[1] - bounds[0] < 2**62 else None
        self.buckets: dict[int, tuple[int, int]] = {}
        self.key_min: int | None = None
        self.key_max: int | None = None

    def add(self, new: Any, old: Any) -> None:
        """``new``, ``old``: the key's new and old values of one part's changes (pyarrow arrays)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        low_of = pc.min_element_wise(new, old, skip_nulls=True)
        high_of = pc.max_element_wise(new, old, skip_nulls=True)
        if low_of.null_count == len(low_of):
            return
        part_min, part_max = pc.min(low_of).as_py(), pc.max(high_of).as_py()
        self.key_min = part_min if self.key_min is None else min(self.key_min, part_min)
        self.key_max = part_max if self.key_max is None else max(self.key_max, part_max)
        if self.bounds is None:
            return
        low, high = self.bounds
        width = max(1, -(-(high - low + 1) // KEY_BUCKETS))
        bucket = pc.divide(pc.subtract(pc.coalesce(new, old).cast(pa.int64()), low), width)
        grouped = (
            pa.table({"bucket": bucket, "low": low_of, "high": high_of})
            .filter(pc.is_valid(bucket))
            .group_by("bucket")
            .aggregate([("low", "min"), ("high", "max")])
        )
        for number, lo, hi in zip(*(grouped.column(name).to_pylist() for name in ("bucket", "low_min", "high_max"))):
            known = self.buckets.get(number)
            self.buckets[number] = (lo, hi) if known is None else (min(known[0], lo), max(known[1], hi))

    def result(self) -> KeyRanges | None:
        if self.key_min is None or self.key_max is None:
            return None
        if self.bounds is None:
            return KeyRanges(self.key_min, self.key_max, [(self.key_min, self.key_max)])
        # Neighbouring buckets are one range: the gap between them is narrower than a bucket,
        # far too narrow to skip a file, and every range costs the MERGE a test per row.
        ranges: list[tuple[int, int]] = []
        previous = None
        for number in sorted(self.buckets):
            low, high = self.buckets[number]
            if ranges and previous == number - 1:
                ranges[-1] = (min(ranges[-1][0], low), max(ranges[-1][1], high))
            else:
                ranges.append((low, high))
            previous = number
        return KeyRanges(self.key_min, self.key_max, merge_ranges(ranges))


INTEGER_TYPES = (ShortType, IntegerType, LongType)
"""Delta's integer types: a key of one of them has key ranges (:func:`integer_key`)."""


def integer_key(plan: TablePlan) -> str | None:
    """The table's key column when it is one column of an integer type (the key ranges' case)."""
    if len(plan.key) != 1 or not isinstance(plan.types[plan.key[0]].delta_type, INTEGER_TYPES):
        return None
    return plan.key[0]


def _old_value(part: Any, column: str) -> Any:
    """A part's old values of ``column`` (null where a change has no old image)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    old = part.column(staged.OLD) if staged.OLD in part.column_names else None
    if old is None or column not in {f.name for f in old.type}:
        return pa.nulls(part.num_rows, part.schema.field(column).type)
    return pc.struct_field(old, column)


def staged_key_ranges(plan: TablePlan) -> KeyRanges | None:
    """The key ranges of a single integer key over the staged parts, read on the driver (only the
    key's new and old values); ``None`` for other keys or when a part is not readable here."""
    key = integer_key(plan)
    if key is None:
        return None
    collector = _KeyRangeCollector(staged_key_bounds(plan))
    for segment in plan.segments:
        for file in segment.staged.file_paths:
            if not footers_readable(file):
                return None
            with open_part(file) as source:
                parquet = pyarrow.parquet.ParquetFile(source)
                names = parquet.schema_arrow.names
                part = parquet.read(columns=[c for c in (key, staged.OLD) if c in names])
            if key not in part.column_names:
                return None
            collector.add(part.column(key), _old_value(part, key))
    return collector.result()


DRIVER_PROFILE_MAX_CHANGES = 1_000_000
"""Up to so many staged changes of a table, :func:`profile_from_parts` reads them on the driver
before a Spark pass is started; above it the Spark pass is the faster read."""


def profile_from_parts(plan: TablePlan) -> Profile | None:
    """The table's :class:`Profile` from its staged parts read on the driver, when they show that
    the Spark pass (:func:`profile_events`) would find nothing to refuse or to plan around: a table
    with a key (one integer column, or several of integers or text, staged as Delta keeps them),
    every change new (nothing applied yet), no TRUNCATE, every column staged in every part, no
    unchanged-TOAST column, no NULL key, no numeric NaN/Infinity and no unbounded numeric (whose
    digits must be checked).
    ``None`` otherwise: the Spark pass then computes the profile (and names what it refuses).

    A Spark job costs a small batch more than its reading: measured on bench/merge_bench.py's
    100,000 changes, about 0.5 s of a 4.5 s merge."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if plan.multiset or not plan.key:
        return None
    segments = plan.segments
    if sum(s.staged.rows for s in segments) > DRIVER_PROFILE_MAX_CHANGES:
        return None
    if any(s.applied_through >= Lsn.parse(s.staged.min_commit_lsn) or s.staged.truncates for s in segments):
        return None  # some changes already applied, or a TRUNCATE
    numeric = [c for c in plan.columns if plan.types[c].is_numeric_text]
    if any(plan.types[c].may_lose_digits for c in numeric):
        return None
    key = integer_key(plan)
    if len(plan.key) == 1 and key is None:
        return None  # the bounds of a key of other values come from the Spark pass
    collector = _KeyRangeCollector(staged_key_bounds(plan)) if key is not None else None
    keys: list[collapse.StagedKeys] = []
    counts = {"I": 0, "U": 0, "D": 0}
    missing_old = 0
    for segment in segments:
        manifest_columns = {c.name for c in segment.staged.columns}
        for file in segment.staged.file_paths:
            if not footers_readable(file):
                return None
            with open_part(file) as source:
                parquet = pyarrow.parquet.ParquetFile(source)
                schema = parquet.schema_arrow
                if any(c not in schema.names or c not in manifest_columns for c in plan.columns):
                    return None  # a column absent from a part is kept by its changes
                for column in plan.key:
                    kind, delta_type = schema.field(column).type, plan.types[column].delta_type
                    integers = pa.types.is_integer(kind) and isinstance(delta_type, INTEGER_TYPES)
                    if not (integers or (pa.types.is_string(kind) and isinstance(delta_type, StringType))):
                        return None  # converted on its way to Delta: the Spark pass checks what it becomes
                wanted = [staged.OP, COMMIT_LSN, staged.SEQ, *plan.key, *numeric]
                wanted += [c for c in (staged.OLD, staged.UNCHANGED_TOAST) if c in schema.names]
                part = parquet.read(columns=list(dict.fromkeys(wanted)))
            op = part.column(staged.OP)
            ops = {entry["values"]: entry["counts"] for entry in pc.value_counts(op).to_pylist()}
            if set(ops) - set(counts):
                return None  # TRUNCATE or an unknown op
            for name, count in ops.items():
                counts[name] += count
            if (
                staged.UNCHANGED_TOAST in part.column_names
                and pc.sum(pc.list_value_length(part.column(staged.UNCHANGED_TOAST))).as_py()
            ):
                return None
            upsert = pc.is_in(op, value_set=pa.array(["I", "U"]))
            delete = pc.equal(op, "D")
            for column in plan.key:
                new_null = pc.and_(upsert, pc.is_null(part.column(column)))
                old_null = pc.and_(delete, pc.is_null(_old_value(part, column)))
                if pc.any(pc.or_(new_null, old_null)).as_py():
                    return None
            for column in numeric:
                values = part.column(column)
                if pa.types.is_list(values.type):
                    values = pc.list_flatten(values)
                if (
                    pa.types.is_string(values.type)
                    and pc.any(pc.is_in(values, value_set=pa.array(NUMERIC_SPECIAL_VALUES))).as_py()
                ):
                    return None
            has_old = (
                pc.is_valid(part.column(staged.OLD))
                if staged.OLD in part.column_names
                else pa.array([False] * part.num_rows, pa.bool_())  # typed: a part may have no rows
            )
            changed = pc.is_in(op, value_set=pa.array(["U", "D"]))
            missing_old += pc.sum(pc.and_(changed, pc.invert(has_old))).as_py() or 0
            if collector is not None and key is not None:
                collector.add(part.column(key), _old_value(part, key))
            keys.append(
                collapse.StagedKeys(
                    op=op,
                    new=tuple(part.column(c) for c in plan.key),
                    old=tuple(_old_value(part, c) for c in plan.key),
                    lsn=part.column(COMMIT_LSN),
                    seq=part.column(staged.SEQ),
                )
            )
    ranges = collector.result() if collector is not None else None
    return Profile(
        changes=sum(counts.values()),
        inserts=counts["I"],
        updates=counts["U"],
        deletes=counts["D"],
        truncates=0,
        keep_columns=(),
        keep_moves=0,
        null_keys=0,
        specials={},
        lossy={},
        key_min=None if ranges is None else ranges.key_min,
        key_max=None if ranges is None else ranges.key_max,
        key_ranges=None if ranges is None else ranges.ranges,
        missing_old=missing_old,
        superseded=collapse.superseded_effects(keys),
    )


def snapshot_chunks_of(plan: TablePlan) -> bool:
    """Whether the table's batches in this run carry table snapshot chunks of it."""
    return any(chunk.get("table") == plan.name for s in plan.segments for chunk in s.batch.snapshot_chunks)


def check_profile(plan: TablePlan, profile: Profile, options: MergeOptions) -> None:
    """Raise :class:`MergeInputError` for changes the merge must not apply."""
    matched_by_value = plan.multiset and snapshot_chunks_of(plan)  # see merge_batches
    if plan.append_only and (profile.updates or profile.deletes):
        raise MergeInputError(
            f"table {plan.name} is loaded append_only, but the batch holds {profile.updates} UPDATE(s) and "
            f"{profile.deletes} DELETE(s) of it, which an append cannot apply. Nothing was written. Load the "
            "table with mode 'merge' (it needs a primary key or REPLICA IDENTITY FULL) and resnapshot it"
        )
    if plan.multiset and profile.missing_old and not matched_by_value:
        raise MergeInputError(
            f"table {plan.name} (no key, merged as a multiset): {profile.missing_old} UPDATE(s)/DELETE(s) carry "
            "no old row, so which copy they changed is unknown (was the table REPLICA IDENTITY FULL when they "
            "were logged?). Nothing was written. Resnapshot the table (the backfill DAG's mode 'resnapshot')"
        )
    if profile.special_keys and not (plan.multiset or plan.append_only):
        numeric_keys = [k for k in plan.key if plan.types[k].is_numeric_text]
        raise MergeInputError(
            f"table {plan.name}: {profile.special_keys} change(s) have a numeric key {numeric_keys} that is NaN or "
            "±Infinity: PostgreSQL holds it as a value of its own (NaN equals NaN), a Delta decimal cannot hold it, "
            "and as NULL it would identify no row. Nothing was written. Keep the table's numeric columns as the text "
            f"PostgreSQL printed: table_options {json.dumps({plan.name: {'type_map': {'numeric': 'string'}}})}; the "
            "next extract stages the unmerged range again with it. If the Delta table exists already, its numeric "
            f"columns are decimals: move the Delta table at {plan.path} aside, then resnapshot {plan.name} "
            "(pgdecode_backfill mode=resnapshot), which re-creates it with them as text"
        )
    if profile.null_keys and (matched_by_value or not (plan.multiset or plan.append_only)):
        raise MergeInputError(
            f"table {plan.name}: {profile.null_keys} change(s) have a NULL key ({list(plan.key)}), or a DELETE/"
            f"key-changing UPDATE without its old key; the key must identify every row (check the replica identity)"
        )
    if profile.lossy:
        raise MergeInputError(
            f"table {plan.name}: numeric values do not fit the unbounded-numeric mapping "
            f"{options.unbounded_numeric} without losing digits: {profile.lossy} value(s) per column. Declare the "
            f"column numeric(p,s), or run with --unbounded-numeric string (or a wider decimal)."
        )
    if profile.specials and options.numeric_special == "error":
        raise MergeInputError(
            f"table {plan.name}: numeric NaN/Infinity cannot be stored in a decimal column: {profile.specials} "
            f"value(s) per column (run with --numeric-special null to store NULL instead)"
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


# --------------------------------------------------------------------------------------------
# Building the MERGE
# --------------------------------------------------------------------------------------------


def merge_source(spark: SparkSession, events: DataFrame, plan: TablePlan, profile: Profile) -> DataFrame:
    """The last state per key (one row per key), with keep flags for unchanged-TOAST columns."""
    if profile.truncate_at is not None:
        events = events.where(collapse.after(*profile.truncate_at))
    spec = CollapseInput(key=plan.key, value_columns=plan.value_columns, keep_columns=profile.keep_columns)
    effects = collapse.effects_of(events, spec)
    if profile.superseded is not None and not profile.keep_columns and profile.truncate_at is None:
        return collapse.collapse_known(spark, effects, spec, profile.superseded)
    allow_keep = profile.truncate_at is None and plan.state.exists
    if profile.keep_moves and profile.keep_columns:
        target = spark.read.format("delta").load(plan.path) if plan.state.exists and allow_keep else None
        return collapse.collapse_with_lineage(effects, spec, target, allow_keep=allow_keep)
    return collapse.collapse_simple(effects, spec, allow_keep=allow_keep)


def merge_ranges(ranges: Sequence[tuple[Any, Any]], max_ranges: int = MAX_KEY_RANGES) -> list[tuple[Any, Any]]:
    """Sort closed ranges, merge overlapping ones, then close the smallest gaps until at most
    ``max_ranges`` remain. Every key of every input range stays covered."""
    merged: list[tuple[Any, Any]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    while len(merged) > max_ranges:
        gaps = sorted(range(len(merged) - 1), key=lambda i: (merged[i + 1][0] - merged[i][1], i))
        close = set(gaps[: len(merged) - max_ranges])
        result: list[tuple[Any, Any]] = []
        for index, current in enumerate(merged):
            if result and (index - 1) in close:
                result[-1] = (result[-1][0], current[1])
            else:
                result.append(current)
        merged = result
    return merged


def _literal(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise TypeError(value)
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def merge_condition(plan: TablePlan, ranges: Sequence[tuple[Any, Any]] | None) -> str:
    """The MERGE's ON condition: key equality, plus the batch's key ranges for file skipping."""
    condition = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in plan.key)
    if ranges:
        key = f"t.{quote(plan.key[0])}"
        alternatives = " OR ".join(f"({key} BETWEEN {_literal(lo)} AND {_literal(hi)})" for lo, hi in ranges)
        condition = f"({alternatives}) AND {condition}"
    return condition


def delta_ref(path: str) -> str:
    """The SQL name of the Delta table at ``path`` (``delta.`<path>```)."""
    return f"delta.{quote(path)}"


def _ddl_field(field_: StructField) -> str:
    comment = (field_.metadata or {}).get("comment")
    return (
        f"{quote(field_.name)} {field_.dataType.simpleString()}"
        + ("" if field_.nullable else " NOT NULL")
        + (f" COMMENT {_literal(comment)}" if comment else "")
    )


def table_fields(plan: TablePlan) -> list[StructField]:
    """A new table's columns: the source columns (comment ``PostgreSQL <catalog type>``, the key
    NOT NULL unless matched as a multiset), then the metadata columns of its mode
    (:func:`metadata_fields`)."""
    return [
        StructField(
            column,
            plan.types[column].delta_type,
            column not in plan.key or plan.multiset,
            {"comment": f"PostgreSQL {plan.types[column].catalog_type}"},
        )
        for column in plan.columns
    ] + list(metadata_fields(plan.mode))


def table_properties(plan: TablePlan, options: MergeOptions) -> dict[str, str]:
    """A new table's properties: the options' and the key, source and mode of pgdecode."""
    properties = dict(options.table_properties)
    properties[KEY_PROPERTY] = json.dumps(list(plan.key))
    properties[SOURCE_PROPERTY] = plan.name
    properties[MODE_PROPERTY] = plan.mode
    if plan.numbers:
        properties[column_renames.NUMBERS_PROPERTY] = column_renames.numbers_property(plan.numbers)
    return properties


def create_table_statement(plan: TablePlan, options: MergeOptions, path: str) -> str:
    """``CREATE TABLE IF NOT EXISTS delta.`path``` with the table's columns (comments, the key NOT
    NULL), the metadata columns and its properties: the one definition of a new table."""
    fields = table_fields(plan)
    properties = table_properties(plan, options)
    return (
        f"CREATE TABLE IF NOT EXISTS {delta_ref(path)} ({', '.join(_ddl_field(f) for f in fields)}) "
        "USING delta TBLPROPERTIES ("
        + ", ".join(f"{_literal(name)} = {_literal(value)}" for name, value in properties.items())
        + ")"
    )


def ensure_table(spark: SparkSession, plan: TablePlan, options: MergeOptions) -> bool:
    """Create the Delta table, or add the source's new columns. Returns True when created.

    SQL only (``CREATE TABLE delta.`path```, ``ALTER TABLE``): the same statements run in a
    spark-submit session and over Spark Connect, where Delta's Python API needs a server plugin."""
    if not plan.state.exists:
        spark.sql(create_table_statement(plan, options, plan.path))
        log.info("table %s: created Delta table %s", plan.name, plan.path)
        return True
    rename_columns(spark, plan)
    # Columns added with a default: recorded before they are added, filled after (column_defaults).
    fill = column_defaults.pending_fill(plan.state.properties)
    added_with_default = {c: plan.missing[c] for c in plan.new_columns if c in plan.missing}
    if added_with_default:
        fill.update(added_with_default)
        recorded = _literal(json.dumps(fill, sort_keys=True))
        spark.sql(
            f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES "
            f"({_literal(column_defaults.FILL_PROPERTY)} = {recorded})"
        )
    if plan.new_columns:
        added = ", ".join(
            f"{quote(c)} {plan.types[c].delta_type.simpleString()} COMMENT {_literal('PostgreSQL ' + plan.types[c].catalog_type)}"
            for c in plan.new_columns
        )
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} ADD COLUMNS ({added})")
        log.info("table %s: added column(s) %s", plan.name, list(plan.new_columns))
    if fill:
        fill_missing(spark, plan, fill)
    if plan.widened:
        # Delta's type widening: a metadata-only change (files written with the old type are read
        # as the new one), behind a table feature that readers need Delta 4.0+ for (docs/merge.md).
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ('delta.enableTypeWidening' = 'true')")
        for column, before in plan.widened.items():
            after = plan.types[column].delta_type.simpleString()
            spark.sql(f"ALTER TABLE {delta_ref(plan.path)} ALTER COLUMN {quote(column)} TYPE {after}")
            log.info("table %s: widened column %s from %s to %s", plan.name, column, before.simpleString(), after)
    return False


def rename_columns(spark: SparkSession, plan: TablePlan) -> None:
    """Rename the Delta columns the source renamed (column mapping: metadata only, values kept),
    and record the column numbers that tell a rename (:mod:`.column_renames`)."""
    if plan.renamed and plan.state.properties.get("delta.columnMapping.mode", "none") == "none":
        # A table created without column mapping (not by pgdecode): a rename needs it.
        spark.sql(
            f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name', "
            "'delta.minReaderVersion' = '2', 'delta.minWriterVersion' = '5')"
        )
    for old, new in plan.renamed.items():
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} RENAME COLUMN {quote(old)} TO {quote(new)}")
        log.info("table %s: renamed column %s to %s, as the source did (its values kept)", plan.name, old, new)
    if plan.numbers_changed:
        numbers = _literal(column_renames.numbers_property(plan.numbers))
        spark.sql(
            f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ({_literal(column_renames.NUMBERS_PROPERTY)} = {numbers})"
        )


def fill_missing(spark: SparkSession, plan: TablePlan, fill: Mapping[str, Any]) -> None:
    """Give the Delta rows written before columns added with a default that default, as PostgreSQL
    shows them (:mod:`.column_defaults`), then remove the record of the pending fill."""
    fields = {f.name: f.dataType for f in plan.state.schema.fields} if plan.state.schema is not None else {}
    assignments = {}
    for column, value in fill.items():
        data_type = plan.types[column].delta_type if column in plan.types else fields.get(column)
        if data_type is not None:
            assignments[quote(column)] = column_defaults.sql_value(value, data_type)
    if assignments:
        spark.sql(column_defaults.fill_statement(delta_ref(plan.path), assignments))
    spark.sql(
        f"ALTER TABLE {delta_ref(plan.path)} UNSET TBLPROPERTIES IF EXISTS ({_literal(column_defaults.FILL_PROPERTY)})"
    )
    log.info(
        "table %s: rows written before column(s) %s were added now hold their default, as in PostgreSQL",
        plan.name,
        sorted(fill),
    )


INTERPRETED_CONF: Mapping[str, str] = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
}
"""Spark settings that evaluate expressions interpreted instead of compiling generated Java."""


@contextmanager
def expression_evaluation(spark: SparkSession, staged_changes: int, options: MergeOptions) -> Iterator[None]:
    """Evaluate expressions interpreted, on ``spark``'s own session and for this run only, when the
    run holds fewer than ``options.codegen_min_changes`` staged changes. Spark generates and
    compiles Java for every stage of every statement (the wide MERGE's most of all): measured on
    a warm server, that is about half a small batch's merge time, which so few rows never earn
    back. Large runs keep code generation, where it pays per row."""
    if staged_changes >= options.codegen_min_changes:
        yield
        return
    before = {key: spark.conf.get(key, None) for key in INTERPRETED_CONF}
    for key, value in INTERPRETED_CONF.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, previous in before.items():
            if previous is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, previous)


@contextmanager
def transaction_id(spark: SparkSession, slot: str, version: int) -> Iterator[None]:
    """Delta's idempotent-write transaction id (app id of ``slot``, ``version``) for the one Delta
    commit made inside the block, then unset.

    Set on ``spark``'s own session configuration (``spark.conf``): a session's settings are its own,
    in a spark-submit application and on a Spark Connect server alike, where every client session
    is a server session of its own, so two merges on one server never see each other's id.
    """
    spark.conf.set(TXN_APP_ID_CONF, app_id(slot))
    spark.conf.set(TXN_VERSION_CONF, str(version))
    try:
        yield
    finally:
        spark.conf.unset(TXN_APP_ID_CONF)
        spark.conf.unset(TXN_VERSION_CONF)


def _set_clause(assignments: Mapping[str, str]) -> str:
    return ", ".join(f"t.{name} = {value}" for name, value in assignments.items())


def _insert_clause(values: Mapping[str, str]) -> str:
    return f"INSERT ({', '.join(values)}) VALUES ({', '.join(values.values())})"


def execute_merge(
    spark: SparkSession,
    path: str,
    source: DataFrame,
    condition: str,
    clauses: Sequence[str],
    slot: str,
    version: int,
) -> None:
    """``MERGE INTO delta.`path` t USING <source> s ON condition <clauses>`` as one Delta commit
    holding the transaction id (:func:`transaction_id`). The source is a temporary view of this
    session only, dropped afterwards."""
    import uuid

    view = f"pgdecode_merge_source_{uuid.uuid4().hex}"
    source.createOrReplaceTempView(view)
    try:
        with transaction_id(spark, slot, version):
            spark.sql(f"MERGE INTO {delta_ref(path)} AS t USING {view} AS s ON {condition} " + " ".join(clauses))
    finally:
        spark.catalog.dropTempView(view)


def append_rows(spark: SparkSession, path: str, rows: DataFrame, slot: str, version: int) -> None:
    """Append ``rows`` to the Delta table at ``path`` as one commit holding the transaction id,
    given as options of this write (``txnAppId``/``txnVersion``), not as session settings."""
    (
        rows.write.format("delta")
        .mode("append")
        .option("txnAppId", app_id(slot))
        .option("txnVersion", str(version))
        .save(path)
    )


def run_merge(
    spark: SparkSession,
    plan: TablePlan,
    source: DataFrame,
    profile: Profile,
    slot: str,
    options: MergeOptions,
    keep_columns: Sequence[str] | None = None,
) -> None:
    """The one MERGE of this table, recording the watermark in the same Delta commit.

    ``source``: one row per key (:func:`merge_source`, or :func:`.history.latest_states` for a
    ``soft_delete`` table), with ``__keep_<i>`` flags for ``keep_columns`` (default: the
    profile's). A ``soft_delete`` table gets other DELETE clauses: a deleted key's row becomes a
    tombstone (``_pg_deleted``) instead of going: with the values the run last committed for it
    when it had any (``__known``, also inserted when Delta lacks the key), else keeping Delta's;
    and a TRUNCATE makes every other row a tombstone at the first TRUNCATE's commit."""
    keep_index = {c: i for i, c in enumerate(profile.keep_columns if keep_columns is None else keep_columns)}
    update_set: dict[str, str] = {}
    insert_values: dict[str, str] = {}
    for column in plan.columns:
        insert_values[quote(column)] = f"s.{quote(column)}"
        if column in plan.key:
            continue
        if column in keep_index:
            flag = collapse.keep_flag_name(keep_index[column])
            update_set[quote(column)] = f"CASE WHEN s.{flag} THEN t.{quote(column)} ELSE s.{quote(column)} END"
        else:
            update_set[quote(column)] = f"s.{quote(column)}"
    for column in delta_columns(plan.mode):
        update_set[quote(column)] = f"s.{quote(column)}"
        insert_values[quote(column)] = f"s.{quote(column)}"
    newer = f"t.{COMMIT_LSN} < s.{COMMIT_LSN}"
    ranges = None
    if options.key_range_pruning and profile.truncate_at is None and len(plan.key) == 1 and plan.state.exists:
        ranges = profile.key_ranges
    if plan.mode == SOFT_DELETE:
        known = f"s.{history.KNOWN}"
        removed = {quote(DELETED): "true", **{quote(c): f"s.{quote(c)}" for c in METADATA_COLUMNS}}
        clauses = [
            f"WHEN MATCHED AND {known} AND {newer} THEN UPDATE SET {_set_clause(update_set)}",
            f"WHEN MATCHED AND NOT t.{quote(DELETED)} AND {newer} THEN UPDATE SET {_set_clause(removed)}",
            f"WHEN NOT MATCHED AND {known} THEN {_insert_clause(insert_values)}",
        ]
        if profile.truncations:
            first = profile.truncations[0]
            tombstone = {
                quote(DELETED): "true",
                quote(COMMIT_LSN): str(first.lsn),
                quote(COMMIT_TIME): first.time_sql(),
                quote(XID): "CAST(NULL AS bigint)" if first.xid is None else str(first.xid),
            }
            clauses.append(
                f"WHEN NOT MATCHED BY SOURCE AND NOT t.{quote(DELETED)} AND t.{COMMIT_LSN} < {first.lsn} "
                f"THEN UPDATE SET {_set_clause(tombstone)}"
            )
    else:
        clauses = [
            f"WHEN MATCHED AND s.{KIND} = 'D' AND {newer} THEN DELETE",
            f"WHEN MATCHED AND s.{KIND} = 'U' AND {newer} THEN UPDATE SET {_set_clause(update_set)}",
            f"WHEN NOT MATCHED AND s.{KIND} = 'U' THEN {_insert_clause(insert_values)}",
        ]
        if profile.truncate_at is not None:
            clauses.append(f"WHEN NOT MATCHED BY SOURCE AND t.{COMMIT_LSN} < {profile.truncate_at[0]} THEN DELETE")
    execute_merge(spark, plan.path, source, merge_condition(plan, ranges), clauses, slot, plan.watermark_after)


def committed_states(
    plan: TablePlan, events: DataFrame, profile: Profile, keep_columns: Sequence[str]
) -> tuple[CollapseInput, DataFrame]:
    """The run's committed states of each key (:func:`.history.committed_states`), the values of
    ``keep_columns`` followed along each row (its lineage when a key change keeps a value)."""
    spec = CollapseInput(key=plan.key, value_columns=plan.value_columns, keep_columns=tuple(keep_columns))
    lineage = bool(profile.keep_moves and profile.keep_columns)
    valued = history.values_as_of(collapse.effects_of(events, spec), spec, lineage=lineage)
    return spec, history.committed_states(valued, spec, profile.truncations)


def key_range_filter(plan: TablePlan, profile: Profile, options: MergeOptions) -> Column:
    """The batch's key ranges as a filter on the Delta table (data skipping), or true."""
    if not options.key_range_pruning or len(plan.key) != 1 or not profile.key_ranges:
        return F.lit(True)
    key = col(plan.key[0])
    ranges = [key.between(F.lit(lo), F.lit(hi)) for lo, hi in profile.key_ranges]
    return functools.reduce(lambda a, b: a | b, ranges)


def history_write(
    spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str, options: MergeOptions
) -> None:
    """A ``history`` table: the run's versions inserted and the current versions they follow closed,
    in one MERGE (one commit with the watermark); into a table this run created, one append.

    ``ON s.__action = 'close' AND t._pg_current AND t.key = s.key``: a close row updates the key's
    current version (valid-to, not current); version rows match nothing and are inserted; a
    TRUNCATE closes, through ``WHEN NOT MATCHED BY SOURCE``, every other current version at the
    first TRUNCATE's commit. Unchanged-TOAST values no change of the run set are read from the
    current versions Delta holds (:func:`.history.fill_from_target`)."""
    spec, states = committed_states(plan, events, profile, profile.keep_columns)
    new_versions = history.versions(states, spec)
    if spec.keep_columns and plan.state.exists:
        current = spark.read.format("delta").load(plan.path).where(col(CURRENT))
        new_versions = history.fill_from_target(
            new_versions, current.where(key_range_filter(plan, profile, options)), spec
        )
    columns = [*plan.columns, *delta_columns(HISTORY)]
    if not plan.state.exists:
        append_rows(spark, plan.path, new_versions.select(*[col(c) for c in columns]), slot, plan.watermark_after)
        return
    source = history.merge_source(new_versions, history.closes(states, spec, profile.truncations), columns)
    ranges = None
    if options.key_range_pruning and not profile.truncations and len(plan.key) == 1:
        ranges = profile.key_ranges
    values = {quote(c): f"s.{quote(c)}" for c in columns}
    ended = {
        quote(VALID_TO_LSN): f"s.{quote(VALID_TO_LSN)}",
        quote(VALID_TO): f"s.{quote(VALID_TO)}",
        quote(CURRENT): "false",
    }
    clauses = [
        f"WHEN MATCHED AND t.{COMMIT_LSN} < s.{quote(VALID_TO_LSN)} THEN UPDATE SET {_set_clause(ended)}",
        f"WHEN NOT MATCHED AND s.{history.ACTION} = '{history.VERSION}' THEN {_insert_clause(values)}",
    ]
    if profile.truncations:
        first = profile.truncations[0]
        cut = {quote(VALID_TO_LSN): str(first.lsn), quote(VALID_TO): first.time_sql(), quote(CURRENT): "false"}
        clauses.append(
            f"WHEN NOT MATCHED BY SOURCE AND t.{quote(CURRENT)} AND t.{COMMIT_LSN} < {first.lsn} "
            f"THEN UPDATE SET {_set_clause(cut)}"
        )
    condition = f"s.{history.ACTION} = '{history.CLOSE}' AND t.{quote(CURRENT)} AND {merge_condition(plan, ranges)}"
    execute_merge(spark, plan.path, source, condition, clauses, slot, plan.watermark_after)


def soft_delete_write(
    spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str, options: MergeOptions
) -> None:
    """A ``soft_delete`` table: :func:`run_merge` of each key's latest state
    (:func:`.history.latest_states`): a live row or a tombstone. An unchanged-TOAST value no
    change of the run set is kept from Delta by the MERGE (read here only for a row moved by a
    key change)."""
    spec, states = committed_states(plan, events, profile, profile.keep_columns)
    source = history.latest_states(states, spec, profile.truncations)
    if profile.keep_moves and profile.keep_columns and plan.state.exists:
        target = spark.read.format("delta").load(plan.path)
        source = history.fill_from_target(source, target, spec, other_keys_only=True)
    run_merge(spark, plan, source, profile, slot, options, keep_columns=spec.keep_columns)


def inserts_only(profile: Profile) -> bool:
    """A batch of inserts (and TRUNCATEs) only, such as an initial snapshot: every key once after
    the last TRUNCATE (PostgreSQL refuses a second insert of a key without a delete between)."""
    return profile.updates == 0 and profile.deletes == 0 and not profile.keep_columns


def append_inserts(spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str) -> None:
    """Into a table this run created (empty), an inserts-only batch is appended, not merged: no
    collapse, no join. One Delta commit holding the watermark, as the MERGE's does."""
    rows = events.where(F.col(OP) == "I")
    if profile.truncate_at is not None:
        rows = rows.where(collapse.after(*profile.truncate_at))
    rows = rows.select(*[col(c) for c in plan.columns], *[F.col(c) for c in METADATA_COLUMNS])
    append_rows(spark, plan.path, rows, slot, plan.watermark_after)


# --------------------------------------------------------------------------------------------
# An initial load committed as staged (delta_commit.py)
# --------------------------------------------------------------------------------------------

TEMPLATE_DIR = "_pgdecode_templates"
"""Under the Delta root: throwaway tables whose first commit gives a new table's protocol and metadata."""


def committable_snapshot(plan: TablePlan, options: MergeOptions) -> TableSummary | None:
    """The staged snapshot whose parts can become the new table's first commit as they are, or
    ``None`` (the table is appended or merged through Spark): the table does not exist yet, this
    run holds only one snapshot batch of it (``snapshot_files``, nothing applied before), and every
    column is staged with its Delta type under this run's options. Never for a ``history`` or
    ``soft_delete`` table: staged parts have none of their columns."""
    if not options.snapshot_commit or plan.state.exists or len(plan.segments) != 1 or plan.mode in KEPT_MODES:
        return None
    segment = plan.segments[0]
    entry = segment.staged
    if entry.snapshot_files is None or segment.applied_through >= 0 or segment.batch.snapshot_chunks:
        return None
    if entry.updates or entry.deletes or table_storage(plan.path) is None:
        return None
    if entry.numeric_specials and options.numeric_special == "error":
        return None  # the Spark path refuses the batch, naming the columns
    staged_columns = {c.name: c for c in entry.columns}
    if set(staged_columns) != set(plan.columns):
        return None
    if not all(delta_ready(plan.types[c], staged_columns[c].arrow) for c in plan.columns):
        return None
    return entry


def snapshot_template(
    spark: SparkSession,
    plan: TablePlan,
    options: MergeOptions,
    delta_root: str,
    cache: dict[Any, tuple[dict[str, Any], dict[str, Any]] | None],
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The protocol and metaData of the new table's first commit, or ``None`` when a hand-written
    commit could not carry them (:func:`delta_commit.template_actions`).

    The protocol (table features) and the properties Delta settles on come from Delta itself:
    ``CREATE TABLE`` of the metadata columns with the options' properties (and a
    ``timestamp_ntz`` column when the table has one, the one column type with a table feature of
    its own) on a throwaway location under ``<delta_root>/_pgdecode_templates``, removed again.
    It costs a Spark statement (about 0.4 s warm), so its protocol and metaData are kept beside,
    in ``_pgdecode_templates/<digest>.json`` (the digest of the properties, that column and the
    Spark version), and in ``cache`` for the run. The columns are :func:`table_fields`, as
    ``CREATE TABLE`` of the table would declare them."""
    import hashlib
    import uuid

    fields = table_fields(plan)
    ntz = any(isinstance(f.dataType, TimestampNTZType) for f in fields)
    kind = (tuple(sorted(options.table_properties.items())), ntz, spark.version)
    templates = table_storage(join_path(delta_root, TEMPLATE_DIR))
    if templates is None:
        return None
    kept = hashlib.sha256(json.dumps(kind).encode("utf-8")).hexdigest()[:24] + ".json"
    if kind not in cache and templates.is_file(kept):
        try:
            cache[kind] = delta_commit.template_actions(templates.read_text(kept))
        except (ValueError, delta_commit.TemplateRefused):
            pass  # unreadable: made again below
    if kind not in cache:
        store = templates.child(uuid.uuid4().hex)
        location = join_path(delta_root, TEMPLATE_DIR, store.root.rsplit("/", 1)[1])
        columns = [*METADATA_FIELDS, *([StructField("ntz", TimestampNTZType())] if ntz else [])]
        try:
            spark.sql(
                f"CREATE TABLE {delta_ref(location)} ({', '.join(_ddl_field(f) for f in columns)}) USING delta"
                + (
                    " TBLPROPERTIES ("
                    + ", ".join(f"{_literal(k)} = {_literal(v)}" for k, v in options.table_properties.items())
                    + ")"
                    if options.table_properties
                    else ""
                )
            )
            first = store.child("_delta_log").read_text(delta_commit.FIRST_COMMIT)
            cache[kind] = delta_commit.template_actions(first)
            templates.write_text(kept, first)
        except delta_commit.TemplateRefused as refused:
            log.info("table %s: %s; the snapshot is appended through Spark", plan.name, refused)
            cache[kind] = None
        finally:
            store.delete_tree()
    template = cache[kind]
    if template is None:
        return None
    protocol, metadata = template
    try:
        return protocol, delta_commit.table_metadata(
            metadata, [f.jsonValue() for f in fields], table_properties(plan, options)
        )
    except delta_commit.TemplateRefused as refused:
        log.info("table %s: %s; the snapshot is appended through Spark", plan.name, refused)
        return None


def _place_part(source: str, store: Storage, name: str) -> None:
    """``source`` (a staged part) as ``name`` in the table's directory: a hard link on one local
    filesystem (the batch keeps its copy), else a byte copy. An earlier copy is replaced."""
    if is_local_path(source) and store.is_local:
        target = os.path.join(store.root, name)
        os.makedirs(store.root, exist_ok=True)
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        try:
            os.link(local_path(source), target)
            return
        except OSError:
            pass  # another filesystem: copy
    with open_part(source) as handle:
        src = open(handle, "rb") if isinstance(handle, str) else handle
        try:
            with store.open_output(name) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        finally:
            if isinstance(handle, str):
                src.close()


def _create_if_absent(store: Storage, name: str, data: bytes) -> bool:
    """Create ``name`` holding ``data`` unless it exists; False when it did. On a local disk a
    finished, fsynced temporary file is hard-linked (atomic, fails if the name exists); on object
    storage a look-up then one PUT."""
    if not store.is_local:
        if store.exists(name):
            return False
        store.write_bytes(name, data)
        return True
    import tempfile

    os.makedirs(store.root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store.root, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, os.path.join(store.root, name))
        except FileExistsError:
            return False
        fsync_dir(store.root)
        return True
    finally:
        os.unlink(tmp)


def commit_snapshot(
    plan: TablePlan, entry: TableSummary, template: tuple[dict[str, Any], dict[str, Any]], slot: str
) -> int | None:
    """The snapshot's parts placed in the table's directory and committed as its version 0 with the
    watermark (:mod:`.delta_commit`). Returns the rows committed, or ``None`` when the table's first
    commit exists already (another run created the table meanwhile)."""
    protocol, metadata = template
    store = table_storage(plan.path)
    assert store is not None and entry.location is not None and entry.snapshot_files is not None
    columns = delta_commit.indexed_columns(metadata)
    adds: list[dict[str, Any]] = []
    rows = 0
    for file in entry.snapshot_files:
        name = f"pgdecode-snapshot-{plan.watermark_after:016X}-{file}"
        _place_part(join_path(entry.location, file), store, name)
        with open_part(store.uri(name)) as handle:
            footer = pyarrow.parquet.read_metadata(handle)
        size = store.filesystem.get_file_info(store._path(name)).size
        adds.append(delta_commit.add_action(name, int(size), delta_commit.file_stats(footer, columns)))
        rows += footer.num_rows
    if store.is_local and adds:
        fsync_dir(store.root)
    text = delta_commit.commit_lines(protocol, metadata, adds, app_id(slot), plan.watermark_after, rows)
    if not _create_if_absent(store.child("_delta_log"), delta_commit.FIRST_COMMIT, text.encode("utf-8")):
        return None
    return rows


def append_only_write(spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str) -> None:
    """An ``append_only`` table: its inserts after the last TRUNCATE are appended (one commit with
    the watermark). A TRUNCATE in the batch makes it one MERGE that inserts the rows and deletes
    what Delta held from before the TRUNCATE, still one commit."""
    rows = events.where(F.col(OP) == "I")
    if profile.truncate_at is not None:
        rows = rows.where(collapse.after(*profile.truncate_at))
    rows = rows.select(*[col(c) for c in plan.columns], *[F.col(c) for c in METADATA_COLUMNS])
    if profile.truncate_at is None or not plan.state.exists:
        append_rows(spark, plan.path, rows, slot, plan.watermark_after)
        return
    values = {quote(c): f"s.{quote(c)}" for c in (*plan.columns, *METADATA_COLUMNS)}
    clauses = [
        f"WHEN NOT MATCHED THEN {_insert_clause(values)}",
        f"WHEN NOT MATCHED BY SOURCE AND t.{COMMIT_LSN} < {profile.truncate_at[0]} THEN DELETE",
    ]
    execute_merge(spark, plan.path, rows, "false", clauses, slot, plan.watermark_after)


def multiset_write(
    spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str
) -> dict[str, int]:
    """A keyless REPLICA IDENTITY FULL table: one MERGE by copy counts (:mod:`.multiset`), one
    commit with the watermark. Returns the copies inserted and deleted (an UPDATE counts as both).
    Raises :class:`MergeInputError` before writing when the batch removes copies Delta lacks."""
    if profile.truncate_at is not None:
        events = events.where(collapse.after(*profile.truncate_at))
    columns = plan.columns
    old_columns = {name: old_key_name(index) for index, name in enumerate(plan.key)}
    effects = multiset.row_effects(events, columns, old_columns, METADATA_COLUMNS)
    net = multiset.net_changes(effects, columns, METADATA_COLUMNS).localCheckpoint()
    totals = net.agg(
        F.sum(F.when(F.col(multiset.NET) > 0, F.col(multiset.NET)).otherwise(0)).alias("added"),
        F.sum(F.when(F.col(multiset.NET) < 0, -F.col(multiset.NET)).otherwise(0)).alias("removed"),
    ).collect()[0]
    added, removed = int(totals["added"] or 0), int(totals["removed"] or 0)
    # After a TRUNCATE the table holds nothing from before it: no copy to count.
    target = None
    if plan.state.exists and profile.truncate_at is None and removed:
        target = spark.read.format("delta").load(plan.path)
    negatives = net.where(F.col(multiset.NET) < 0)
    counted = multiset.copies_in_target(negatives, target, columns, METADATA_COLUMNS).localCheckpoint()
    short = (
        counted.where(F.col(multiset.COPIES) + F.col(multiset.NET) < 0)
        .agg(F.count(F.lit(1)).alias("values"), F.sum(-(F.col(multiset.COPIES) + F.col(multiset.NET))).alias("missing"))
        .collect()[0]
    )
    if short["values"]:
        raise multiset.diverged_error(plan.name, int(short["values"]), int(short["missing"]))
    source = multiset.merge_rows(net, counted, columns, METADATA_COLUMNS)
    values = {quote(c): f"s.{quote(c)}" for c in (*columns, *METADATA_COLUMNS)}
    clauses = [
        "WHEN MATCHED THEN DELETE",
        f"WHEN NOT MATCHED AND s.{multiset.ACTION} = '{multiset.INSERT}' THEN {_insert_clause(values)}",
    ]
    if profile.truncate_at is not None:
        clauses.append(f"WHEN NOT MATCHED BY SOURCE AND t.{COMMIT_LSN} < {profile.truncate_at[0]} THEN DELETE")
    execute_merge(spark, plan.path, source, multiset.merge_condition(columns), clauses, slot, plan.watermark_after)
    return {"inserted": added, "updated": 0, "deleted": removed}


def _last_commit(spark: SparkSession, path: str) -> tuple[int, dict[str, int]]:
    """The table's latest version, and its row counts when that commit is a MERGE or an append:
    the newest commit's ``commitInfo``, read from the log through the storage layer (``DESCRIBE
    HISTORY``, a Spark statement of its own, only where that cannot reach)."""
    store = delta_log_storage(path)
    if store is None:
        row = spark.sql(f"DESCRIBE HISTORY {delta_ref(path)} LIMIT 1").collect()[0]
        version, operation, metrics = int(row["version"]), row["operation"], row["operationMetrics"] or {}
    else:
        names = [name for name, is_dir in store.list_dir() if not is_dir]
        version = max(v for v in (log_version(n, ".json") for n in names) if v is not None)
        info: dict[str, Any] = {}
        for line in store.read_text(f"{version:020d}.json").splitlines():
            action = json.loads(line) if line.strip() else {}
            if "commitInfo" in action:
                info = action["commitInfo"]
                break
        operation, metrics = info.get("operation"), info.get("operationMetrics") or {}
    if operation == "WRITE":
        return version, {"inserted": int(metrics.get("numOutputRows", 0)), "updated": 0, "deleted": 0}
    if operation != "MERGE":
        return version, {}
    return version, {
        "inserted": int(metrics.get("numTargetRowsInserted", 0)),
        "updated": int(metrics.get("numTargetRowsUpdated", 0)),
        "deleted": int(metrics.get("numTargetRowsDeleted", 0)),
    }


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def merge_batches(
    spark: SparkSession,
    batch_dirs: Iterable[str],
    delta_root: str,
    options: MergeOptions | None = None,
) -> dict[str, Any]:
    """Merge staged batches (in LSN order) into ``<delta_root>/<schema>/<table>``.

    Returns ``{"slot", "batches", "end_lsn", "tables": {"schema.table": {...}}, "parked"}`` where
    each table entry has ``status`` ("merged", "skipped" or "parked"), ``reason``, ``inserted``,
    ``updated``, ``deleted``, ``changes``, ``changes_already_applied``, ``delta_version``,
    ``watermark_lsn``... Bad input raises (:class:`BatchError`, :class:`MergeInputError`) before
    anything is written. A table whose Delta table cannot be read or written is parked
    (:mod:`.table_parking`) while the others are merged; ``options.catch_up`` gives back the
    earlier batches of the tables parked before (``options.parked``), for those tables only.
    """
    options = options or MergeOptions()
    started = time.monotonic()
    batch_dirs = [str(directory) for directory in batch_dirs]
    batches = read_batches(batch_dirs) if batch_dirs else []
    catch_up = (
        table_parking.catch_up_only(read_batches(list(options.catch_up)), options.parked) if options.catch_up else []
    )
    if not batches and not catch_up:
        raise BatchError("no batch given")
    staged_changes = sum(entry.rows for batch in [*batches, *catch_up] for entry in batch.tables)
    with active_connect_session(spark), expression_evaluation(spark, staged_changes, options):
        return _merge_batches(spark, batches, catch_up, [*batch_dirs, *options.catch_up], delta_root, options, started)


def _merge_batches(
    spark: SparkSession,
    batches: Sequence[BatchManifest],
    catch_up: Sequence[BatchManifest],
    batch_dirs: Sequence[str],
    delta_root: str,
    options: MergeOptions,
    started: float,
) -> dict[str, Any]:
    if uses_object_store(batch_dirs, delta_root):
        configure_object_store(spark)
    delta_root = spark_uri(delta_root)
    every_batch = sorted([*batches, *catch_up], key=lambda batch: (batch.start, batch.end, batch.directory))
    slot = every_batch[0].slot
    chunked = any(batch.snapshot_chunks for batch in every_batch)
    results: dict[str, TableResult] = {}
    plans = []
    for plan in plan_merge(spark, every_batch, delta_root, options):
        if isinstance(plan, TablePlan):
            plans.append(plan)
        else:
            results[plan.name] = parked_result(plan.path, plan.schema, plan.table, plan.error)
    check_staged_parts(plans)

    prepared: list[tuple[TablePlan, DataFrame | None, Profile | None, float]] = []
    # Tables whose snapshot parts are committed as staged: no read, no profile, no rewrite.
    direct: dict[str, tuple[TableSummary, tuple[dict[str, Any], dict[str, Any]]]] = {}
    templates: dict[Any, tuple[dict[str, Any], dict[str, Any]] | None] = {}
    for plan in plans:
        if not plan.segments:
            prepared.append((plan, None, None, 0.0))
            continue
        table_started = time.monotonic()
        entry = committable_snapshot(plan, options) if not chunked else None
        template = snapshot_template(spark, plan, options, delta_root, templates) if entry is not None else None
        if entry is not None and template is not None:
            direct[plan.name] = (entry, template)
            prepared.append((plan, None, None, time.monotonic() - table_started))
            continue
        try:
            table_events = staged_events(spark, plan)
            table_profile = profile_from_parts(plan)
            if table_profile is None:
                table_profile = profile_events(table_events, plan, staged_key_ranges(plan))
        except (BatchError, MergeInputError):
            raise
        except Exception as exc:  # Spark's read of a damaged part: name the batch and the file
            error = staged_part_error(plan, exc)
            if error is None:
                raise
            raise error from exc
        for segment in plan.segments:  # a snapshot's NaN/Infinity, staged as null in a decimal column
            for column, count in segment.staged.numeric_specials.items():
                table_profile.specials[column] = table_profile.specials.get(column, 0) + count
        check_profile(plan, table_profile, options)
        prepared.append((plan, table_events, table_profile, time.monotonic() - table_started))

    for plan, events, profile, profile_seconds in prepared:
        table_started = time.monotonic() - profile_seconds
        result = TableResult(
            delta_path=plan.path,
            schema=plan.schema,
            table=plan.table,
            status="skipped",
            batches_skipped=list(plan.skipped),
            delta_version=plan.state.version,
            watermark_lsn=str(Lsn(plan.state.watermark)) if plan.state.watermark is not None else None,
            columns_not_written=list(plan.not_written),
            columns={c: plan.types[c].delta_type.simpleString() for c in plan.columns},
        )
        results[plan.name] = result
        skipped_rows = sum(
            entry.rows
            for batch in every_batch
            for entry in batch.tables
            if entry.target == (plan.schema, plan.table) and batch.label in plan.skipped
        )
        try:
            if plan.name in direct:
                write_snapshot(spark, plan, result, direct[plan.name], slot)
            else:
                write_table(spark, plan, events, profile, result, skipped_rows, slot, chunked, options)
        except Exception as error:
            if not options.park or not table_parking.table_problem(spark, error):
                raise
            results[plan.name] = parked_result(plan.path, plan.schema, plan.table, error)
            continue
        result.seconds = round(time.monotonic() - table_started, 3)

    quarantine = append_quarantine(spark, batches, delta_root)
    if quarantine is not None:
        for name, count in quarantine["tables"].items():
            if name in results:
                results[name].quarantined = count
    messages = append_messages(spark, batches, delta_root)
    return {
        "slot": slot,
        "batches": [{"directory": b.directory, "start_lsn": b.start_lsn, "end_lsn": b.end_lsn} for b in batches],
        "catch_up": [b.directory for b in catch_up],
        "end_lsn": str(max(b.end for b in every_batch)),
        "tables": {name: asdict(result) for name, result in results.items()},
        "parked": sorted(name for name, result in results.items() if result.status == PARKED),
        "quarantine": quarantine,
        "messages": messages,
        "seconds": round(time.monotonic() - started, 3),
    }


def parked_result(path: str, schema: str, table: str, error: BaseException) -> TableResult:
    """The result of a table this run parked: nothing of it written, the reason logged."""
    reason = table_parking.reason(error)
    log.warning(
        "table %s.%s is parked: %s. Nothing of it was written; the other tables are merged. Its staged changes are "
        "kept and applied in order by the first merge after the cause is fixed",
        schema,
        table,
        reason,
    )
    return TableResult(
        delta_path=path, schema=schema, table=table, status=PARKED, reason=reason, error=type(error).__name__
    )


def _note_specials(plan: TablePlan, result: TableResult, specials: Mapping[str, int]) -> None:
    """Log and record numeric NaN/Infinity a decimal column holds as NULL (one wording)."""
    if specials:
        log.warning("table %s: numeric NaN/Infinity stored as NULL (decimal cannot hold them): %s", plan.name, specials)
        result.numeric_specials_nulled = dict(specials)


def write_snapshot(
    spark: SparkSession,
    plan: TablePlan,
    result: TableResult,
    direct: tuple[TableSummary, tuple[dict[str, Any], dict[str, Any]]],
    slot: str,
) -> None:
    """Commit a snapshot batch's parts as they are staged into the Delta table this run creates."""
    entry, template = direct
    result.changes = entry.rows
    _note_specials(plan, result, entry.numeric_specials)
    committed = commit_snapshot(plan, entry, template, slot)
    if committed is None:
        state = read_delta_state(spark, plan.path, app_id(slot))
        result.delta_version = state.version
        if state.watermark is not None and state.watermark >= plan.watermark_after:
            result.reason = "already applied (Delta transaction id)"
            return
        raise MergeInputError(
            f"table {plan.name}: the Delta table {plan.path} was created by another writer while this run "
            "loaded the snapshot into it; nothing of this run is in it. Run the merge again."
        )
    result.created = True
    result.delta_version = 0
    result.watermark_lsn = str(Lsn(plan.watermark_after))
    result.status = "merged"
    result.truncated = entry.truncates > 0
    result.inserted = committed
    log.info(
        "table %s: committed the snapshot's %d row(s) in %d staged part(s) as they are, through LSN %s "
        "(Delta version 0)",
        plan.name,
        committed,
        len(entry.snapshot_files or ()),
        result.watermark_lsn,
    )


def write_table(
    spark: SparkSession,
    plan: TablePlan,
    events: DataFrame | None,
    profile: Profile | None,
    result: TableResult,
    skipped_rows: int,
    slot: str,
    chunked: bool,
    options: MergeOptions,
) -> None:
    """Write one table's changes by its load mode (one Delta commit); fills ``result``."""
    staged_rows = sum(segment.staged.rows for segment in plan.segments)
    if events is None or profile is None:
        result.reason = "already applied" if plan.skipped else "no changes"
        result.changes_already_applied = skipped_rows
        return
    result.changes = profile.changes
    result.changes_already_applied = skipped_rows + max(0, staged_rows - profile.changes)
    if result.changes_already_applied:
        log.warning(
            "table %s: %d change(s) at or below LSN %s are already applied and were left out",
            plan.name,
            result.changes_already_applied,
            result.watermark_lsn,
        )
    if profile.changes == 0:
        result.reason = "already applied"
        return
    _note_specials(plan, result, profile.specials)
    if plan.not_written:
        log.warning(
            "table %s: column(s) %s are no longer in the source; kept in Delta, not written",
            plan.name,
            list(plan.not_written),
        )
    result.created = ensure_table(spark, plan, options)
    result.columns_added = list(plan.new_columns)
    result.columns_widened = {
        c: f"{before.simpleString()} -> {plan.types[c].delta_type.simpleString()}" for c, before in plan.widened.items()
    }
    counts: dict[str, int] | None = None
    if plan.multiset and snapshot_chunks_of(plan):
        # Table snapshot chunks are upserts (a row may come both as a chunk row and as a logged
        # INSERT): counted as copies they would double rows, so these batches match by value.
        log.warning(
            "table %s: table snapshot chunks in this run: merged by matching all columns, not as a multiset "
            "(identical rows collapse into one until the snapshot is done)",
            plan.name,
        )
    try:
        if result.created or plan.new_columns or plan.widened or plan.renamed or plan.numbers_changed:
            version_before, _ = _last_commit(spark, plan.path)
        else:
            version_before = plan.state.version
        # Table snapshot chunks (capture/table_snapshot.py) are upserts: a key may come both as a
        # chunk row and as a logged INSERT, so those batches always MERGE.
        if plan.append_only:
            append_only_write(spark, plan, events, profile, slot)
        elif plan.mode == HISTORY:
            history_write(spark, plan, events, profile, slot, options)
        elif plan.mode == SOFT_DELETE:
            soft_delete_write(spark, plan, events, profile, slot, options)
        elif result.created and inserts_only(profile) and not chunked:
            append_inserts(spark, plan, events, profile, slot)
        elif plan.multiset and not snapshot_chunks_of(plan):
            counts = multiset_write(spark, plan, events, profile, slot)
        else:
            run_merge(spark, plan, merge_source(spark, events, plan, profile), profile, slot, options)
    except BaseException:
        if result.created:
            drop_created_table(spark, plan.path)
        raise
    version_after, metrics = _last_commit(spark, plan.path)
    if counts is not None:
        metrics = counts  # Delta's counts include the copies a replace deletes and inserts again
    result.delta_version = version_after
    if version_after == version_before:
        # Delta's own idempotent-write check (same app id, version not newer) skipped it:
        # another run merged these changes since this one planned.
        result.reason = "already applied (Delta transaction id)"
        return
    result.watermark_lsn = str(Lsn(plan.watermark_after))
    result.status = "merged"
    result.truncated = profile.truncate_at is not None
    for name, value in metrics.items():
        setattr(result, name, value)
    log.info(
        "table %s: merged %d change(s) through LSN %s: %d inserted, %d updated, %d deleted%s (Delta version %d)",
        plan.name,
        profile.changes,
        result.watermark_lsn,
        result.inserted,
        result.updated,
        result.deleted,
        ", after a TRUNCATE" if result.truncated else "",
        version_after,
    )


# --------------------------------------------------------------------------------------------
# The quarantine table, a failed first write, running out of memory
# --------------------------------------------------------------------------------------------


def quarantine_table_path(delta_root: str) -> str:
    """``<delta_root>/_pgdecode_quarantine``: the one quarantine Delta table of every source table."""
    return join_path(delta_root, staged.QUARANTINE_TABLE)


def messages_table_path(delta_root: str) -> str:
    """``<delta_root>/_pgdecode_messages``: the logical decoding messages of the source (its slot)."""
    return join_path(delta_root, staged.MESSAGES_TABLE)


def append_once(
    spark: SparkSession, path: str, parts: Sequence[tuple[BatchManifest, str]], slot_column: str
) -> tuple[str, int, int | None]:
    """Append staged parts (each with its batch) to the side table at ``path``, exactly once.

    The table keeps its own watermark under the slot's app id, as every merged table does: the
    parts of batches at or below it are already appended. Each row gets the slot's name in
    ``slot_column``. Returns ``(status, rows appended, Delta version)``.
    """
    slot = parts[0][0].slot
    state = read_delta_state(spark, path, app_id(slot))
    applied = state.watermark if state.watermark is not None else -1
    todo = [(batch, file) for batch, file in parts if int(batch.end) > applied]
    if not todo:
        return "already applied", 0, state.version
    files = [spark_uri(join_path(batch.directory, file)) for batch, file in todo]
    rows = spark.read.parquet(*files).withColumn(slot_column, F.lit(slot))
    append_rows(spark, path, rows, slot, max(int(batch.end) for batch, _ in todo))
    version, metrics = _last_commit(spark, path)
    return "appended", metrics.get("inserted", 0), version


def append_quarantine(spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str) -> dict[str, Any] | None:
    """Append the batches' quarantine parts to the quarantine Delta table, exactly once
    (:func:`append_once`). Returns ``{"path", "status", "rows", "tables", "delta_version"}``
    (``tables``: quarantined changes per source table in these batches), or ``None`` when no batch
    has a quarantine part.
    """
    entries = [(batch, entry) for batch in batches for entry in batch.quarantine if entry.get("files")]
    if not entries:
        return None
    path = quarantine_table_path(delta_root)
    tables: dict[str, int] = {}
    for _, entry in entries:
        name = f"{entry['schema']}.{entry['table']}"
        tables[name] = tables.get(name, 0) + int(entry["rows"])
    for name, count in sorted(tables.items()):
        log.warning(
            "table %s: %d change(s) held a value the pipeline cannot carry and are quarantined in %s",
            name,
            count,
            path,
        )
    parts = [(batch, join_path(entry["path"], name)) for batch, entry in entries for name in entry["files"]]
    status, rows, version = append_once(spark, path, parts, staged.QUARANTINE_SLOT)
    return {"path": path, "status": status, "rows": rows, "tables": tables, "delta_version": version}


def append_messages(spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str) -> dict[str, Any] | None:
    """Append the batches' logical decoding messages to the messages Delta table, exactly once
    (:func:`append_once`): the messages of committed transactions and the non-transactional
    ones, as the batches staged them. Returns ``{"path", "status", "rows", "staged",
    "delta_version"}`` (``staged``: the messages these batches hold), or ``None`` when they hold
    none.
    """
    entries = [batch for batch in batches if batch.messages and batch.messages.get("files")]
    if not entries:
        return None
    path = messages_table_path(delta_root)
    parts = [
        (batch, join_path(batch.messages["path"], name))
        for batch in entries
        if batch.messages is not None
        for name in batch.messages["files"]
    ]
    status, rows, version = append_once(spark, path, parts, staged.MESSAGES_SLOT)
    total = sum(int(batch.messages["rows"]) for batch in entries if batch.messages is not None)
    log.info("%d logical decoding message(s) in these batches: %s to %s", total, status, path)
    return {"path": path, "status": status, "rows": rows, "staged": total, "delta_version": version}


def drop_created_table(spark: SparkSession, path: str) -> None:
    """Remove a Delta table this run created when its first write failed: a failed merge leaves
    no table behind. Only a table still at its creation commit (version 0) is removed."""
    try:
        if is_local_path(path):
            import shutil
            from pathlib import Path

            directory = Path(local_path(path))
            commits = sorted(p.name for p in (directory / "_delta_log").glob("*.json"))
            if commits == [f"{0:020d}.json"]:
                shutil.rmtree(directory, ignore_errors=True)
                log.info("removed %s: created by this run, whose first write failed", path)
            return
        store = delta_log_storage(path)
        if store is not None:  # object storage, through the storage layer (no JVM: Connect too)
            if not store.exists(f"{1:020d}.json"):
                store.at(store.root.rsplit("/_delta_log", 1)[0]).delete_tree()
                log.info("removed %s: created by this run, whose first write failed", path)
            return
        jvm: Any = spark._jvm
        hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
        filesystem = hadoop_path.getFileSystem(spark._jsc.hadoopConfiguration())
        log_dir = jvm.org.apache.hadoop.fs.Path(path.rstrip("/") + "/_delta_log/" + f"{1:020d}.json")
        if not filesystem.exists(log_dir):
            filesystem.delete(hadoop_path, True)
            log.info("removed %s: created by this run, whose first write failed", path)
    except Exception as error:  # the write's own error matters more
        log.warning("could not remove %s after its first write failed (%s); it is an empty Delta table", path, error)


def out_of_memory_error(error: BaseException, spark_conf: Mapping[str, str]) -> MergeOutOfMemoryError | None:
    """A :class:`MergeOutOfMemoryError` naming the memory settings when ``error`` (Spark's, often an
    ``INTERNAL_ERROR`` that calls itself a bug in Spark) was caused by a JVM out of memory; else ``None``."""
    text = f"{error}\n{getattr(error, 'java_exception', '')}"
    sign = next((s for s in table_parking.OUT_OF_MEMORY_SIGNS if s in text), None)
    if sign is None:
        return None
    driver = spark_conf.get("spark.driver.memory", "1g (Spark's default)")
    executor = spark_conf.get("spark.executor.memory", "1g (Spark's default)")
    return MergeOutOfMemoryError(
        f"the merge ran out of memory ({sign}): Spark's heap could not hold the batch's data. This is not a bug in "
        f"Spark or pgdecode, and nothing was confirmed to the slot. Give Spark more memory: spark.driver.memory "
        f"(now {driver}; in local mode the driver runs the tasks too) and spark.executor.memory (now {executor}), "
        "through the merge operator's driver_memory / executor_memory or the conf of the Spark connection; or "
        "stage smaller batches (max changes per batch) and lower the tables' max_value_bytes (table_options) so "
        "that no single value needs this much memory. Then run the merge again."
    )


def parse_type_map(pairs: Sequence[str]) -> dict[str, str]:
    """``--type-map NAME=TYPE`` pairs as a mapping (the merge and verify jobs' command lines)."""
    overrides: dict[str, str] = {}
    for pair in pairs:
        name, sep, spark_type = pair.rpartition("=")
        if not sep or not name:
            raise SystemExit(f"--type-map expects NAME=TYPE, got {pair!r}")
        overrides[name.strip()] = spark_type.strip()
    return overrides


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="merge_job.py", description="Merge pgdecode staged batches into Delta tables, exactly once."
    )
    parser.add_argument("--delta-root", required=True, help="root of the Delta tables (<root>/<schema>/<table>)")
    parser.add_argument("--batch", action="append", default=[], help="a batch directory; repeat for more")
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit (default local[*])")
    parser.add_argument(
        "--unbounded-numeric",
        default=DEFAULT_UNBOUNDED_NUMERIC,
        help="Delta type of numeric without precision: decimal(P,S) or string",
    )
    parser.add_argument(
        "--numeric-special",
        choices=("null", "error"),
        default="null",
        help="numeric NaN/Infinity in a decimal column: store NULL (default) or fail",
    )
    parser.add_argument(
        "--type-map",
        action="append",
        default=[],
        metavar="CATALOG_TYPE=string",
        help="map a user-defined type staged as text (enum, domain), e.g. mood=string",
    )
    parser.add_argument(
        "--table-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Delta table property for tables the job creates (replaces the default for KEY); "
        "e.g. delta.enableDeletionVectors=false for readers without deletion-vector support",
    )
    parser.add_argument(
        "--no-key-range-pruning", action="store_true", help="do not add key ranges to the MERGE condition"
    )
    parser.add_argument(
        "--codegen-min-changes",
        type=int,
        default=DEFAULT_CODEGEN_MIN_CHANGES,
        metavar="N",
        help="runs with fewer staged changes evaluate Spark expressions interpreted instead of compiling "
        f"generated code (default {DEFAULT_CODEGEN_MIN_CHANGES}; 0: always compile)",
    )
    parser.add_argument(
        "--no-park",
        action="store_true",
        help="a table whose Delta table cannot be read or written stops the run instead of being parked",
    )
    parser.add_argument(
        "--parked-table", action="append", default=[], help="schema.table parked by an earlier run (repeatable)"
    )
    parser.add_argument(
        "--catch-up",
        action="append",
        default=[],
        help="an earlier batch the parked tables still need, merged for them only (repeatable)",
    )
    parser.add_argument("--summary-json", default=None, help="also write the summary to this file")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _write_refusal(error: Exception, summary_json: str | None) -> None:
    """Log and print the job's refusal; with ``--summary-json`` also write it there, which lets the
    caller tell a final error (bad input, out of memory) from a crash worth a retry."""
    log.error("%s", error)
    refusal = json.dumps({"error": type(error).__name__, "message": str(error)})
    print(refusal, file=sys.stderr)
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as handle:
            handle.write(refusal)


def _session_conf(spark: SparkSession) -> dict[str, str]:
    """The session's memory-relevant settings for an out-of-memory message ({} when unreadable):
    the application's SparkConf in a classic session, the session's settings over Spark Connect."""
    conf: dict[str, str] = {}
    if not is_connect_session(spark):
        try:
            return {str(k): str(v) for k, v in spark.sparkContext.getConf().getAll()}
        except Exception:  # a stopped session: the message says the defaults
            return conf
    for key in ("spark.driver.memory", "spark.executor.memory"):
        try:
            value = spark.conf.get(key, None)
        except Exception:  # a stopped session, a lost server: the message says the defaults
            continue
        if value:
            conf[key] = str(value)
    return conf


def options_from_args(args: argparse.Namespace) -> MergeOptions:
    """The :class:`MergeOptions` of parsed merge job arguments."""
    table_properties = dict(DEFAULT_TABLE_PROPERTIES)
    for pair in args.table_property:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--table-property expects KEY=VALUE, got {pair!r}")
        table_properties[key.strip()] = value.strip()
    return MergeOptions(
        table_properties=table_properties,
        unbounded_numeric=args.unbounded_numeric,
        type_overrides=parse_type_map(args.type_map),
        numeric_special=args.numeric_special,
        key_range_pruning=not args.no_key_range_pruning,
        codegen_min_changes=args.codegen_min_changes,
        park=not args.no_park,
        parked=tuple(args.parked_table),
        catch_up=tuple(args.catch_up),
    )


def run_merge_job(
    spark: SparkSession,
    batch_dirs: Sequence[str],
    delta_root: str,
    options: MergeOptions,
    summary_json: str | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """The merge job's core on a session it is given: a spark-submit application's own session
    (:func:`main`) or a Spark Connect client session (the merge operator's ``spark_connect`` path).

    Returns ``(exit code, summary)``: 0 and the summary (also written to ``summary_json``); 2 when
    the input is refused (:class:`BatchError`, :class:`MergeInputError`), 3 when Spark ran out of
    memory, both with the refusal written to ``summary_json`` and no summary. Other errors raise.
    The session is not stopped here.
    """
    try:
        summary = merge_batches(spark, batch_dirs, delta_root, options)
    except (BatchError, MergeInputError) as error:
        _write_refusal(error, summary_json)
        return 2, None
    except Exception as error:
        memory = out_of_memory_error(error, _session_conf(spark))
        if memory is None:
            raise
        _write_refusal(memory, summary_json)
        return 3, None
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(summary, sort_keys=True))
    return 0, summary


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """One line per table (what happened, rows inserted/updated/deleted, Delta version, seconds)
    and the run's total: what the merge operator logs, from either path."""
    lines: list[str] = []
    totals = {"inserted": 0, "updated": 0, "deleted": 0}
    merged = 0
    for name, info in sorted((summary.get("tables") or {}).items()):
        if not isinstance(info, Mapping):
            continue
        status = str(info.get("status"))
        if status == "merged":
            merged += 1
            for key in totals:
                totals[key] += int(info.get(key) or 0)
        reason = f" ({info['reason']})" if status != "merged" and info.get("reason") else ""
        lines.append(
            f"table {name}: {status}{reason}, {int(info.get('inserted') or 0)} inserted, "
            f"{int(info.get('updated') or 0)} updated, {int(info.get('deleted') or 0)} deleted"
            + (", after a TRUNCATE" if info.get("truncated") else "")
            + f", Delta version {info.get('delta_version')}, {float(info.get('seconds') or 0.0):.1f} s"
        )
    tables = len(lines)
    messages = summary.get("messages")
    if isinstance(messages, Mapping):
        lines.append(
            f"messages: {int(messages.get('staged') or 0)} in these batches, {messages.get('status')} "
            f"({int(messages.get('rows') or 0)} appended) to {messages.get('path')}, Delta version "
            f"{messages.get('delta_version')}"
        )
    seconds = summary.get("seconds")
    lines.append(
        f"merge total: {merged} of {tables} table(s) merged, {totals['inserted']} inserted, "
        f"{totals['updated']} updated, {totals['deleted']} deleted, through LSN {summary.get('end_lsn')}"
        + (f", {float(seconds):.1f} s" if seconds is not None else "")
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from airflow_provider_pgdecode.spark.session import build_spark_session

    options = options_from_args(args)
    spark = build_spark_session(
        args.master, object_store=uses_object_store([*args.batch, *args.catch_up], args.delta_root)
    )
    try:
        code, summary = run_merge_job(spark, args.batch, args.delta_root, options, args.summary_json)
    finally:
        spark.stop()
    if summary is not None:
        print("PGDECODE_MERGE_SUMMARY " + json.dumps(summary, sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())
