"""The profile of a table's staged changes: what to refuse or plan around before anything is written.

Counts, the TRUNCATE position, unchanged-TOAST columns, NULL keys, numeric trouble and a single
key's ranges (an integer key's in buckets; one range for the other types with bounds:
:mod:`.key_bounds`). :func:`profile_from_parts` computes it on the driver from the parts when
that is enough; :func:`profile_events` is the one aggregate Spark pass otherwise.
:func:`check_profile` raises for the changes the merge must not apply.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow.parquet
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    DateType,
    DecimalType,
    StringType,
    TimestampType,
)

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import COMMIT_LSN, COMMIT_TIME, XID
from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.spark import collapse
from airflow_provider_pgdecode.spark.collapse import KEEP, LSN, OP, SEQ, col, old_key_name
from airflow_provider_pgdecode.spark.history import Truncate
from airflow_provider_pgdecode.spark.key_bounds import (
    INTEGER_TYPES,
    arrow_bound_values,
    bound_of,
    bounded_key,
    integer_key,
)
from airflow_provider_pgdecode.spark.merge_plan import (
    HAS_OLD,
    KEY_BUCKETS,
    MAX_KEY_RANGES,
    SPECIAL_KEY,
    MergeOptions,
    Profile,
    TablePlan,
)
from airflow_provider_pgdecode.spark.spark_types import (
    NUMERIC_SPECIAL_VALUES,
    ColumnType,
    delta_ready,
    wall_clock_as_utc,
)
from airflow_provider_pgdecode.spark.staged_events import (
    footers_readable,
    lossy_name,
    open_part,
    special_name,
    unapplied_rows,
)

if TYPE_CHECKING:
    pass


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
    single_key = bounded_key(plan)
    if single_key is not None:
        delta_type = plan.types[single_key].delta_type
        aggregates.append(
            bound_of(F.min(F.least(col(single_key), F.col(old_key_name(0)))), delta_type).alias("key_min")
        )
        aggregates.append(
            bound_of(F.max(F.greatest(col(single_key), F.col(old_key_name(0)))), delta_type).alias("key_max")
        )
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


@dataclass
class KeyRanges:
    """Where a single key's staged values lie: its bounds, and ranges of the values for file
    skipping (:func:`merge_condition`): an integer key's in buckets, another's one range, its
    values as :mod:`.key_bounds` takes them (a timestamp as its microseconds)."""

    key_min: Any
    key_max: Any
    ranges: list[tuple[Any, Any]]


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
            collector.add(part.column(key), collapse.old_values(part, key))
    return collector.result()


DRIVER_PROFILE_MAX_CHANGES = 1_000_000
"""Up to so many staged changes of a table, :func:`profile_from_parts` reads them on the driver
before a Spark pass is started; above it the Spark pass is the faster read."""


def profile_from_parts(plan: TablePlan) -> Profile | None:
    """The table's :class:`Profile` from its staged parts read on the driver, when they show that
    the Spark pass (:func:`profile_events`) would find nothing to refuse or to plan around: a table
    with a key :func:`key_casts` admits (integers, text, ``numeric(p,s)``, dates, timestamps,
    bytes), every column staged in every part, no UPDATE that both moves
    its key and leaves a value unchanged (TOAST), no NULL key, no numeric NaN/Infinity, and every
    value of a ``numeric`` without a typmod fitting its decimal (:func:`_fits`). TRUNCATEs are
    listed as the Spark pass lists them (their commit time and transaction id too, where a kept
    mode's versions end), and the effects superseded are found among the changes after the last
    one. Changes already applied (a batch that overlaps what Delta holds, after a crash) are left
    out, as the Spark pass leaves them out. ``None`` otherwise: the Spark pass then computes the
    profile (and names what it refuses).

    A Spark job costs a small batch more than its reading: measured on bench/merge_bench.py's
    100,000 changes, about 0.5 s of a 4.5 s merge."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if plan.multiset or not plan.key:
        return None
    segments = plan.segments
    if sum(s.staged.rows for s in segments) > DRIVER_PROFILE_MAX_CHANGES:
        return None
    numeric = [c for c in plan.columns if plan.types[c].is_numeric_text]
    # A single key's ranges: in buckets for an integer key, its (min, max) for the other types
    # with bounds (text in byte order, as Spark compares strings; :mod:`.key_bounds`).
    collector = _KeyRangeCollector(staged_key_bounds(plan)) if bounded_key(plan) else None
    keys: list[collapse.StagedKeys] = []
    counts = {"I": 0, "U": 0, "D": 0, "T": 0}
    truncations: set[Truncate] = set()
    missing_old = 0
    kept: set[str] = set()
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
                casts = key_casts(plan, schema)
                if casts is None:
                    return None  # converted on its way to Delta: the Spark pass checks what it becomes
                wanted = [staged.OP, COMMIT_LSN, staged.SEQ, *plan.key, *numeric]
                wanted += [c for c in (staged.OLD, staged.UNCHANGED_TOAST) if c in schema.names]
                if segment.staged.truncates:  # a TRUNCATE's commit, which a kept mode's versions end at
                    wanted += [COMMIT_TIME, XID]
                part = unapplied_rows(parquet.read(columns=list(dict.fromkeys(wanted))), segment)
            op = part.column(staged.OP)
            ops = {entry["values"]: entry["counts"] for entry in pc.value_counts(op).to_pylist()}
            if set(ops) - set(counts) or ("T" in ops and COMMIT_TIME not in part.column_names):
                return None  # an unknown op, or a TRUNCATE the manifest does not count
            for name, count in ops.items():
                counts[name] += count
            if "T" in ops:
                truncations.update(_truncations(part))
            if _null_key(part, plan.key):
                return None
            if not all(_numbers_fit(part.column(column), plan.types[column]) for column in numeric):
                return None
            try:  # NaN and infinity were refused above; PostgreSQL rounded the digits to the scale
                new_keys = [_as(part.column(c), casts.get(c)) for c in plan.key]
                old_keys = [_as(collapse.old_values(part, c), casts.get(c)) for c in plan.key]
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return None
            unchanged = _unchanged_toast(part, new_keys, old_keys)
            if unchanged is None:
                return None
            kept.update(unchanged)
            missing_old += _missing_old(part)
            if collector is not None:
                key_type = plan.types[plan.key[0]].delta_type
                collector.add(arrow_bound_values(new_keys[0], key_type), arrow_bound_values(old_keys[0], key_type))
            keys.append(
                collapse.StagedKeys(
                    op=op,
                    new=tuple(new_keys),
                    old=tuple(old_keys),
                    lsn=part.column(COMMIT_LSN),
                    seq=part.column(staged.SEQ),
                )
            )
    ranges = collector.result() if collector is not None else None
    ordered = tuple(sorted(truncations))
    if ordered:  # what the collapse reads starts after the last TRUNCATE (merge_sql.merge_source)
        keys = [part.after(ordered[-1].lsn, ordered[-1].seq) for part in keys]
    return Profile(
        changes=sum(counts.values()),
        inserts=counts["I"],
        updates=counts["U"],
        deletes=counts["D"],
        truncates=counts["T"],
        keep_columns=tuple(c for c in plan.value_columns if c in kept),
        keep_moves=0,
        null_keys=0,
        specials={},
        lossy={},
        key_min=None if ranges is None else ranges.key_min,
        key_max=None if ranges is None else ranges.key_max,
        key_ranges=None if ranges is None else ranges.ranges,
        missing_old=missing_old,
        truncations=ordered,
        superseded=collapse.superseded_effects(keys),
    )


def _null_key(part: pyarrow.Table, key: Sequence[str]) -> bool:
    """Whether an INSERT or UPDATE of the part has a NULL in its key, or a DELETE in its old key."""
    import pyarrow as pa
    import pyarrow.compute as pc

    op = part.column(staged.OP)
    upsert, delete = pc.is_in(op, value_set=pa.array(["I", "U"])), pc.equal(op, "D")
    for column in key:
        new_null = pc.and_(upsert, pc.is_null(part.column(column)))
        old_null = pc.and_(delete, pc.is_null(collapse.old_values(part, column)))
        if pc.any(pc.or_(new_null, old_null)).as_py():
            return True
    return False


def _missing_old(part: pyarrow.Table) -> int:
    """The part's UPDATEs and DELETEs staged without an old image."""
    import pyarrow as pa
    import pyarrow.compute as pc

    has_old = (
        pc.is_valid(part.column(staged.OLD))
        if staged.OLD in part.column_names
        else pa.array([False] * part.num_rows, pa.bool_())  # typed: a part may have no rows
    )
    changed = pc.is_in(part.column(staged.OP), value_set=pa.array(["U", "D"]))
    return int(pc.sum(pc.and_(changed, pc.invert(has_old))).as_py() or 0)


def _truncations(part: pyarrow.Table) -> list[Truncate]:
    """The TRUNCATEs among a part's changes, as the Spark pass lists them: commit LSN, position,
    commit time in microseconds, transaction id."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = part.filter(pc.equal(part.column(staged.OP), "T"))
    micros = rows.column(COMMIT_TIME).cast(pa.int64()).to_pylist()
    return [
        Truncate(int(lsn), int(seq), time, xid)
        for lsn, seq, time, xid in zip(
            rows.column(COMMIT_LSN).to_pylist(),
            rows.column(staged.SEQ).to_pylist(),
            micros,
            rows.column(XID).to_pylist(),
            strict=True,
        )
    ]


def key_casts(plan: TablePlan, schema: pyarrow.Schema) -> dict[str, pyarrow.DataType] | None:
    """The type each key column of a part with ``schema`` is compared as, where it is not its
    staged type, by column (``{}``: none); ``None`` when the Spark pass profiles the table. A key
    column may be an integer or a text, a ``numeric(p,s)``'s text (cast to its decimal: ``1.50``
    and ``1.5`` are one key), a date, a timestamp or bytes (as a partitioned table's key holds its
    partition column, or alone): each compared here as Spark compares it. Pure."""
    import pyarrow as pa

    casts: dict[str, pa.DataType] = {}
    for column in plan.key:
        kind, column_type = schema.field(column).type, plan.types[column]
        delta_type = column_type.delta_type
        if pa.types.is_integer(kind) and isinstance(delta_type, INTEGER_TYPES):
            continue
        if pa.types.is_string(kind) and isinstance(delta_type, StringType):
            continue
        numeric_text = column_type.is_numeric_text and column_type.element is None and not column_type.may_lose_digits
        if pa.types.is_string(kind) and numeric_text and isinstance(delta_type, DecimalType):
            casts[column] = pa.decimal128(delta_type.precision, delta_type.scale)
            continue
        if not isinstance(delta_type, (DateType, TimestampType, BinaryType)):
            return None
        # A timestamp without time zone is the same microseconds read as UTC: compared alike.
        if wall_clock_as_utc(kind, column_type) is None and not delta_ready(column_type, str(kind)):
            return None
    return casts


def _numbers_fit(values: Any, column_type: ColumnType) -> bool:
    """Whether a part's numeric text ``values`` (or arrays of it) hold no NaN or infinity and, for
    a ``numeric`` without a typmod, fit its decimal (:func:`_fits`): else the Spark pass counts
    them, and the merge refuses them or stores them as NULL."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(values.type):
        values = pc.list_flatten(values)
    if not pa.types.is_string(values.type):
        return True  # staged as its decimal already (a snapshot's)
    if pc.any(pc.is_in(values, value_set=pa.array(NUMERIC_SPECIAL_VALUES))).as_py():
        return False
    return not column_type.may_lose_digits or _fits(values, column_type)


def _unchanged_toast(part: pyarrow.Table, new_keys: Sequence[Any], old_keys: Sequence[Any]) -> list[str] | None:
    """The columns a part's UPDATEs leave unchanged (TOAST), which the MERGE keeps; ``None`` when
    one of them also moves its key: the kept value then follows the key's lineage, which the
    Spark pass does."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if staged.UNCHANGED_TOAST not in part.column_names:
        return []
    toast = part.column(staged.UNCHANGED_TOAST)
    lengths = pc.fill_null(pc.list_value_length(toast), 0)
    updates = pc.and_(pc.equal(part.column(staged.OP), "U"), pc.greater(lengths, pa.scalar(0, lengths.type)))
    if pc.any(pc.and_(updates, collapse.arrow_key_changed(new_keys, old_keys))).as_py():
        return None
    return [str(name) for name in pc.unique(pc.list_flatten(toast.filter(updates))).to_pylist()]


def _fits(values: Any, column_type: ColumnType) -> bool:
    """Whether the numeric text ``values`` (NaN and infinity left out) all fit the column's decimal
    as they are: Arrow's cast refuses a value with more integer or fraction digits than it holds,
    leading zeros aside (the Spark pass's test of a lossy value), and also one with more digits
    than its precision, trailing zeros counted, which the Spark pass then finds not lossy."""
    import pyarrow as pa

    decimal = (column_type.element or column_type).delta_type
    assert isinstance(decimal, DecimalType)
    try:
        values.cast(pa.decimal128(decimal.precision, decimal.scale))
    except pa.ArrowInvalid:
        return False
    return True


def _as(values: Any, kind: pyarrow.DataType | None) -> Any:
    """``values`` cast to ``kind`` (as they are when ``None``)."""
    return values if kind is None else values.cast(kind)


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
