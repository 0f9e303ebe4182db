"""The staged Parquet parts of a table, read: the part checks, and the events Spark merges.

Where a part is missing or unreadable is named here (one wording for the driver and for Spark),
and :func:`staged_events` turns a table's parts into typed change events, with the diagnostic
columns (numeric NaN/Infinity, lossy values, special keys) the profile counts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, StringType, StructType

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import COMMIT_LSN, COMMIT_TIME, XID, is_local_path, local_path
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, is_object_store, spark_uri
from airflow_provider_pgdecode.errors import BatchError, MergeInputError
from airflow_provider_pgdecode.spark import column_defaults
from airflow_provider_pgdecode.spark.collapse import KEEP, LSN, OP, SEQ, col, old_key_name
from airflow_provider_pgdecode.spark.delta_state import bucket_storage
from airflow_provider_pgdecode.spark.memory_budget import LargestRead, largest_read
from airflow_provider_pgdecode.spark.merge_plan import HAS_OLD, SPECIAL_KEY, Segment, TablePlan
from airflow_provider_pgdecode.spark.spark_types import (
    NUMERIC_SPECIAL_VALUES,
    ColumnType,
    prints_as_its_text,
    staged_type_matches,
    widens,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession


log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


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


def unapplied_rows(part: pa.Table, segment: Segment) -> pa.Table:
    """A part of ``segment`` read on the driver, less its rows already applied (commit LSN at or
    below the segment's ``applied_through``), as :func:`staged_events` leaves them out."""
    import pyarrow.compute as pc

    if segment.applied_through < 0:
        return part
    return part.filter(pc.greater(part.column(COMMIT_LSN), segment.applied_through))


def check_staged_parts(plans: Sequence[TablePlan]) -> dict[str, LargestRead]:
    """Read the footer of every Parquet part the merge will read (local or on object storage): a
    truncated, empty or missing part fails here, before any Delta table is created or written.
    Returns each table's largest read batch (:mod:`.memory_budget`), for the tables whose parts
    pyarrow reads here."""
    import pyarrow.parquet as pq

    largest: dict[str, LargestRead] = {}
    for plan in plans:
        for segment in plan.segments:
            for file in segment.staged.file_paths:
                if not footers_readable(file):
                    continue  # another Hadoop filesystem: Spark's read names the file (see staged_part_error)
                try:
                    with open_part(file) as source:
                        metadata = pq.read_metadata(source)
                except Exception as exc:  # OSError, pyarrow's ArrowInvalid: what reading it would raise
                    raise unreadable_part(segment.batch, plan.name, file, exc) from exc
                read, current = largest_read(file, metadata), largest.get(plan.name)
                if current is None or read.batch_bytes > current.batch_bytes:
                    largest[plan.name] = read
    return largest


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
    frame = _old_key_under_names_now(frame, staged_names, staged_as)
    for name, formers in staged_as.items():
        if name in staged_names:
            continue
        former = next((old for old in formers if old in staged_names and old in known), None)
        if former is not None:
            frame = frame.withColumnRenamed(former, name)
            staged_names = [name if n == former else n for n in staged_names]
            known.add(name)
    return frame, staged_names, known


def _old_key_under_names_now(
    frame: DataFrame, staged_names: list[str], staged_as: Mapping[str, tuple[str, ...]]
) -> DataFrame:
    """The old-key image (a struct) of parts staged before a key column's rename, its fields read
    as the names now."""
    # No former names, nothing to rename: the frame's schema is not asked for (over Spark Connect,
    # a round trip to the server and an analysis of the plan, per table).
    if not any(staged_as.values()) or staged.OLD not in staged_names:
        return frame
    if not isinstance(frame.schema[staged.OLD].dataType, StructType):
        return frame
    fields = [f.name for f in frame.schema[staged.OLD].dataType.fields]  # type: ignore[attr-defined]
    now = {old: name for name, formers in staged_as.items() for old in formers if name not in fields}
    if not any(field in now for field in fields):
        return frame
    image = F.struct(*[F.col(staged.OLD).getField(field).alias(now.get(field, field)) for field in fields])
    return frame.withColumn(staged.OLD, F.when(F.col(staged.OLD).isNull(), F.lit(None)).otherwise(image))


def _check_staged_types(plan: TablePlan, frame: DataFrame, present: Sequence[str], files: Sequence[str]) -> None:
    """Raise :class:`MergeInputError` for a column staged as a type the column's Delta type cannot
    take from (a part staged before the column became text again is merged as Spark prints it)."""
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


def _group_events(
    plan: TablePlan,
    frame: DataFrame,
    staged_names: Sequence[str],
    known: set[str],
    files: Sequence[str],
    numeric_columns: Sequence[str],
) -> DataFrame:
    """The changes of parts staged with one schema (``frame``), typed as in Delta: the columns
    of :func:`staged_events`."""
    present = [c for c in plan.columns if c in staged_names and c in known]
    _check_staged_types(plan, frame, present, files)
    # A snapshot stages bounded numeric as its Delta decimal already (capture/snapshot.py).
    typed = {c for c in present if plan.types[c].is_numeric_text and isinstance(frame.schema[c].dataType, DecimalType)}
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
        (F.col(COMMIT_TIME).cast("timestamp") if COMMIT_TIME in staged_names else F.lit(None).cast("timestamp")).alias(
            COMMIT_TIME
        ),
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
    return frame.select(*selected)


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
            events = _group_events(plan, frame, staged_names, known, files, numeric_columns)
            if segment.applied_through >= 0:
                events = events.where(F.col(LSN) > F.lit(segment.applied_through))
            frames.append(events)
    result = frames[0]
    for frame in frames[1:]:
        result = result.unionByName(frame)
    return result
