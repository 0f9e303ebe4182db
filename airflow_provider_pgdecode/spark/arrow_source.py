"""A light write's MERGE source built on the driver, in Arrow, without Spark.

The light write (:mod:`.light_write`) hands delta-rs the MERGE source as Arrow. Computed by Spark,
that source costs a Spark job and, over Spark Connect, two round trips to the server (the staged
parts' schema, the plan's) for every table: about 0.13 s a table on a warm two-core server, most
of a cycle that touches many small tables. When the staged parts need nothing Spark does to them,
the source is built here instead, from the parts read with pyarrow:

* every column is staged as an Arrow type Spark reads exactly as its Delta type, flat or a list of
  flat values (:func:`.spark_types.delta_ready`, as for the initial load's direct commit), or is
  a ``numeric`` staged as its text, cast to its decimal (no NaN, digits that fit: see
  :func:`staged_conversions`), the key's old image too;
* the profile came from the parts (:func:`.profiling.profile_from_parts`: no key moved by an
  UPDATE that left a value unchanged, no NULL key), and the driver knows which effects a later
  one on the same key replaces (:func:`.collapse.superseded_effects`), or, where an UPDATE left a
  value unchanged (TOAST), collapses them as Spark does (:func:`.collapse.arrow_last_keeping`, as
  :func:`.collapse.collapse_simple`);
* changes already applied (a batch extracted again after a crash) are left out, as Spark leaves
  them out (:func:`.staged_events.unapplied_rows`);
* after a TRUNCATE, only the changes after the last one are read, as Spark's source reads them,
  and no value is kept from Delta (the MERGE deletes what Delta held from before it).

The source is then what :func:`.collapse.collapse_known` computes in Spark: a part's effects
(:func:`.collapse.arrow_effects`, as :func:`.collapse.effects_of`) less the superseded ones. In
any other case :func:`arrow_source` gives ``None`` and Spark computes the source, as before; and
when the light write does not take the table after all, Delta's MERGE reads the parts in Spark.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pyspark.sql.types import DecimalType

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import DELTA_COLUMNS
from airflow_provider_pgdecode.spark import collapse
from airflow_provider_pgdecode.spark.collapse import KIND, LSN, SEQ, CollapseInput
from airflow_provider_pgdecode.spark.light_write import large_run_refusal, light_write_refusal
from airflow_provider_pgdecode.spark.merge_plan import keeps_delta_values
from airflow_provider_pgdecode.spark.spark_types import delta_ready, wall_clock_as_utc
from airflow_provider_pgdecode.spark.staged_events import footers_readable, open_part, unapplied_rows

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_pgdecode.spark.merge_plan import MergeOptions, Profile, TablePlan

log = logging.getLogger("airflow_provider_pgdecode.spark.merge")

DRIVER_SOURCE_MAX_BYTES = 256 << 20
"""Up to so many bytes of a table's staged parts are read whole on the driver to build its
source (each part's uncompressed size in its Parquet footer before it is read, its Arrow size
after): it holds them, their effects and what delta-rs writes at once. A larger run's source is
Spark's, read in batches on the executors."""

_CHANGE_TYPES = dict(staged.CHANGE_COLUMNS)
#: The change columns the source needs (an effect's kind and order, and the metadata Delta keeps).
_CHANGE_COLUMNS = (staged.OP, staged.SEQ, *DELTA_COLUMNS)


def arrow_source(plan: TablePlan, profile: Profile, options: MergeOptions) -> pa.Table | None:
    """The table's MERGE source (the columns of :func:`.merge_sql.merge_source`: key, values,
    metadata, ``__kind``) built from its staged parts on the driver, for a run the light write
    may take; ``None`` when the light write refuses the run or a part needs Spark's conversion."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if light_write_refusal(plan, profile, options) is not None:
        return None
    if profile.superseded is None:
        return None
    try:
        refusal = large_run_refusal(plan, profile, options)
    except Exception:  # noqa: BLE001 - the light write opens the table again and names the error
        refusal = None
    if refusal is not None:
        log.info("table %s: its MERGE source is computed by Spark (delta-rs will not merge it: %s)", plan.name, refusal)
        return None
    spec = CollapseInput(key=plan.key, value_columns=plan.value_columns, keep_columns=profile.keep_columns)
    effects = []
    left = DRIVER_SOURCE_MAX_BYTES  # bytes the parts read so far leave
    for segment in plan.segments:
        for file in segment.staged.file_paths:
            if not footers_readable(file):
                return None
            try:
                with open_part(file) as source:
                    parquet = pq.ParquetFile(source)
                    footer = parquet.metadata
                    # The footer's sizes first (no read past the bound), then what was read:
                    # repeated values, dictionary-encoded, take more room read than staged.
                    staged_bytes = sum(footer.row_group(i).total_byte_size for i in range(footer.num_row_groups))
                    part = unapplied_rows(parquet.read(), segment) if staged_bytes <= left else None
            except Exception:  # noqa: BLE001 - Spark reads it then, and names the damaged part
                return None
            if part is None or part.nbytes > left:
                log.info(
                    "table %s: its MERGE source is computed by Spark (its staged parts hold more than the %d "
                    "bytes the driver reads whole)",
                    plan.name,
                    DRIVER_SOURCE_MAX_BYTES,
                )
                return None
            left -= part.nbytes
            casts = staged_conversions(part.schema, plan)
            if casts is None:
                return None
            if profile.truncate_at is not None:  # the table holds only what came after the last one
                part = part.filter(
                    collapse.arrow_after(part.column(staged.COMMIT_LSN), part.column(staged.SEQ), *profile.truncate_at)
                )
            for column, kind in casts.items():
                index = part.schema.get_field_index(column)
                part = part.set_column(index, column, part.column(column).cast(kind))
            effects.append(collapse.arrow_effects(part, spec))
    if not effects:
        return None
    table = pa.concat_tables(effects)
    columns = [*plan.key, *plan.value_columns, *DELTA_COLUMNS, KIND]
    if spec.keep_columns:  # values an UPDATE left unchanged (TOAST): each taken from its last setter, or kept
        flags = [collapse.keep_flag_name(i) for i in range(len(spec.keep_columns))]
        return collapse.arrow_last_keeping(table, spec, allow_keep=keeps_delta_values(plan, profile)).select(
            [*columns, *flags]
        )
    return _last_effects(table, profile.superseded).select(columns)


def staged_conversions(schema: pa.Schema, plan: TablePlan) -> dict[str, pa.DataType] | None:
    """The casts a part with ``schema`` needs for its values to be the ones Spark gives Delta, by
    column (``{}``: none), or ``None`` when the driver does not build its source. The part must hold
    the change columns the source needs as the batch format declares them, and every column of
    ``plan`` either as a type Spark reads exactly as the column's Delta type, flat or a list of flat
    values (:func:`.spark_types.delta_ready`, the test the initial load's direct commit makes), a
    ``timestamp without time zone`` (or a list of them) as its microseconds read as UTC, or,
    for a ``numeric`` staged as its text (or an array of them), as text cast to the column's
    decimal (the profile from the parts saw no NaN or infinity in it, and its digits fit:
    PostgreSQL rounded a ``numeric(p,s)`` to the scale, and the profile checked a ``numeric``
    without a typmod's).
    The old-key image's key columns need no cast, or the key's own
    (:data:`~airflow_provider_pgdecode.batch.format.OLD` is then cast too). Pure."""
    import pyarrow as pa

    for name in _CHANGE_COLUMNS:
        if name not in schema.names or not schema.field(name).type.equals(_CHANGE_TYPES[name]):
            return None

    def ready(column: str, kind: pa.DataType) -> bool:
        if pa.types.is_list(kind):  # named as the manifest names it (Parquet names the item "element")
            kind = pa.list_(kind.value_type)
        flat = kind.value_type if pa.types.is_list(kind) else kind
        return not pa.types.is_nested(flat) and delta_ready(plan.types[column], str(kind))

    casts: dict[str, pa.DataType] = {}
    for column in plan.columns:
        if column not in schema.names:
            return None
        kind, column_type = schema.field(column).type, plan.types[column]
        if ready(column, kind):
            continue
        wall_clock = wall_clock_as_utc(kind, column_type)
        if wall_clock is not None:
            casts[column] = wall_clock
            continue
        decimal = (column_type.element or column_type).delta_type
        array = column_type.element is not None and pa.types.is_list(kind)
        if not column_type.is_numeric_text or not pa.types.is_string(kind.value_type if array else kind):
            return None
        assert isinstance(decimal, DecimalType)
        cast = pa.decimal128(decimal.precision, decimal.scale)
        casts[column] = pa.list_(pa.field("element", cast)) if array else cast
    if staged.OLD in schema.names:
        old = schema.field(staged.OLD).type
        if not pa.types.is_struct(old):
            return None
        fields = [old.field(i) for i in range(old.num_fields)]
        old_key = [f for f in fields if f.name in plan.key and not ready(f.name, f.type)]
        if any(f.name not in casts or not f.type.equals(schema.field(f.name).type) for f in old_key):
            return None
        if old_key:  # an old key staged as the new one is cast as it is
            casts[staged.OLD] = pa.struct([f.with_type(casts[f.name]) if f in old_key else f for f in fields])
    return casts


def _last_effects(effects: pa.Table, superseded: pa.Table) -> pa.Table:
    """``effects`` less those ``superseded`` names (by kind, commit LSN and position): the last
    effect of each key, as :func:`.collapse.collapse_known` keeps them."""
    import pyarrow as pa

    if not superseded.num_rows:
        return effects
    row = "__row"
    order = effects.select([KIND, LSN, SEQ]).append_column(row, pa.array(range(effects.num_rows), pa.int64()))
    kept = order.join(superseded.select([KIND, LSN, SEQ]), keys=[KIND, LSN, SEQ], join_type="left anti")
    return effects.take(kept.column(row).combine_chunks().sort())
