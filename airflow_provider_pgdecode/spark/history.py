"""History (SCD type 2) and soft-delete tables: a table's staged changes as committed states.

``table_options`` mode ``history`` keeps one Delta row per committed version of each key;
``soft_delete`` keeps the current rows plus a tombstone (``_pg_deleted``) per deleted key. Both
are built from the same thing: the **committed states** of each key in the run, which the merge
mode's collapse (:mod:`.collapse`) does not need (it keeps only the last state per key). Every
function here is a pure DataFrame transformation (no action, no Delta access), except
:func:`values_as_of` with ``lineage=True``, which follows key-change chains as
:func:`.collapse.with_lineage` does. docs/merge.md, "History and soft deletes", is the contract.

Vocabulary, on top of :mod:`.collapse`'s (events, effects):

* a **state** is what one transaction left of one key: the last effect of that transaction on
  the key (several changes to a key in one transaction are one state; a key inserted and deleted
  in one transaction has a delete state, it never was a committed row). A state is **alive**
  when it is an upsert that no TRUNCATE later in the same transaction removed;
* a **version** (history) is an alive state, valid from its commit until the key's next state
  or the next TRUNCATE, whichever commits first (``_pg_valid_to_lsn`` NULL: still current);
* a **close** (history) ends the version Delta holds as current for a key the run touches, at
  the key's first state or the run's first TRUNCATE, whichever commits first;
* the **latest state** (soft delete) of a key is its last state: a live row, or a tombstone
  holding the row's last committed values with the commit of the DELETE or TRUNCATE that
  removed it.

Unchanged TOAST: a value an effect did not carry (``__keep``) is the value of the latest earlier
effect of the same row that set it, found with a running window over the row's effects in
commit order (the row is the key, or its lineage across key changes when one carries kept
values); when none did, the value is the one Delta held before the run at the row's first key
(``__keep_<i>`` true and ``__origin`` that key): :func:`fill_from_target` reads it, or the
soft-delete MERGE keeps it (``CASE WHEN s.__keep_<i> THEN t.c``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

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
)
from airflow_provider_pgdecode.batch.options import KEPT_MODES
from airflow_provider_pgdecode.spark import collapse
from airflow_provider_pgdecode.spark.collapse import (
    DELETE,
    KEEP,
    KIND,
    LSN,
    SEQ,
    UPSERT,
    CollapseInput,
    col,
    keep_flag_name,
)

MODE_PROPERTY = "pgdecode.mode"
"""The Delta table property that records the table's load mode (``table_options`` mode)."""
MERGE = "merge"
HISTORY = "history"
SOFT_DELETE = "soft_delete"
assert KEPT_MODES == (HISTORY, SOFT_DELETE)  # batch.options: the modes kept per key

ACTION = "__action"  # history merge source: VERSION (inserted) or CLOSE (ends the current version)
VERSION = "version"
CLOSE = "close"
ORIGIN = "__origin"  # the key whose Delta row a kept value comes from (null: set within the run)
ALIVE = "__alive"
TRUNCATED = "__truncated"  # the first TRUNCATE after the state, or null
END = "__end"  # (lsn, time) of the commit that ends the state's version, or null
KNOWN = "__known"  # soft delete: the key was a committed row at some point of the run


@dataclass(frozen=True, order=True)
class Truncate:
    """A TRUNCATE of the table in the run: its commit LSN, position, commit time (microseconds
    since the epoch, UTC) and transaction id."""

    lsn: int
    seq: int
    time_micros: int | None = None
    xid: int | None = None

    def time_sql(self) -> str:
        """Its commit time as a Spark SQL expression."""
        return "CAST(NULL AS timestamp)" if self.time_micros is None else f"timestamp_micros({int(self.time_micros)})"


def recorded_mode(properties: Mapping[str, str]) -> str:
    """The load mode a Delta table records (:data:`MODE_PROPERTY`); tables created before it was
    recorded are ``merge`` tables."""
    return properties.get(MODE_PROPERTY) or MERGE


def current_rows(frame: DataFrame, mode: str) -> DataFrame:
    """The rows of a Delta table loaded in ``mode`` that stand for the source table's rows now:
    the current versions of a history table, the rows that are not tombstones of a soft-delete
    table, every row otherwise. The one rule the verify job and the test oracle compare by."""
    if mode == HISTORY:
        return frame.where(col(CURRENT))
    if mode == SOFT_DELETE:
        return frame.where(~col(DELETED))
    return frame


def _key_struct(key: Sequence[str]) -> Column:
    return F.struct(*[col(name) for name in key])


def values_as_of(effects: DataFrame, spec: CollapseInput, *, lineage: bool) -> DataFrame:
    """Each effect (:func:`.collapse.effects_of`) with the value of each of ``spec.keep_columns``
    as of that effect: its own when it sets it, else that of the latest earlier effect of the same
    row that set it (a DELETE sets nothing). ``__keep_<i>`` is true when no effect of the run set
    column ``i`` up to there; ``__origin`` is then the key whose Delta row holds the value.

    The row is the key; with ``lineage`` (a key change carries kept values) it is the lineage
    of :func:`.collapse.with_lineage`, so a value follows the row to its new key. Effects of one
    event at two keys (a key change) order the DELETE first."""
    if lineage:
        frame = collapse.with_lineage(effects, spec)
        partition: list[Column] = [F.col("__lineage")]
        origin = F.when(F.col("__lineage").getField("o").isNull(), F.col("__lineage").getField("k"))
    else:
        frame = effects
        partition = [col(name) for name in spec.key]
        origin = _key_struct(spec.key)
    is_upsert = (F.col(KIND) == UPSERT).cast("int")
    window = (
        Window.partitionBy(*partition)
        .orderBy(F.col(LSN), F.col(SEQ), is_upsert)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    keep_index = {column: index for index, column in enumerate(spec.keep_columns)}
    values: list[Column] = []
    flags: list[Column] = []
    for column in spec.value_columns:
        if column not in keep_index:
            values.append(col(column))
            continue
        sets = (F.col(KIND) == UPSERT) & ~F.array_contains(F.col(KEEP), column)
        last = F.last(F.when(sets, F.struct(col(column).alias("v"))), ignorenulls=True).over(window)
        values.append(last.getField("v").alias(column))
        flags.append(last.isNull().alias(keep_flag_name(keep_index[column])))
    return frame.select(
        *[col(name) for name in spec.key],
        F.col(KIND),
        F.col(LSN),
        F.col(SEQ),
        *values,
        *[col(name) for name in spec.metadata_columns],
        *flags,
        origin.alias(ORIGIN),
    )


def _truncates_after(truncates: Sequence[Truncate]) -> Column:
    """The first of ``truncates`` after the row's (``__lsn``, ``__seq``) in commit order, or null."""
    kind = "struct<lsn:bigint,seq:int,micros:bigint,xid:bigint>"
    if not truncates:
        return F.lit(None).cast(kind)
    listed = F.array(
        *[
            F.struct(
                F.lit(t.lsn).cast("bigint").alias("lsn"),
                F.lit(t.seq).cast("int").alias("seq"),
                F.lit(t.time_micros).cast("bigint").alias("micros"),
                F.lit(t.xid).cast("bigint").alias("xid"),
            )
            for t in sorted(set(truncates))
        ]
    )
    later = F.filter(
        listed,
        lambda t: (
            (t.getField("lsn") > F.col(LSN)) | ((t.getField("lsn") == F.col(LSN)) & (t.getField("seq") > F.col(SEQ)))
        ),
    )
    return F.array_min(later)


def _commit(lsn: Column, time: Column, xid: Column) -> Column:
    """A commit as a struct ``(lsn, time, xid)``, ordered by its LSN."""
    return F.struct(
        lsn.cast("bigint").alias("lsn"), time.cast("timestamp").alias("time"), xid.cast("bigint").alias("xid")
    )


def _state_commit() -> Column:
    return _commit(F.col(LSN), col(COMMIT_TIME), col(XID))


def _truncate_commit(truncate: Truncate) -> Column:
    return _commit(
        F.lit(truncate.lsn), F.timestamp_micros(F.lit(truncate.time_micros).cast("bigint")), F.lit(truncate.xid)
    )


def _first_removal(truncates: Sequence[Truncate]) -> Column:
    """Aggregated per key over its states: the commit that removed the row Delta held for the key
    before the run (its first state, or the run's first TRUNCATE when that commits first)."""
    first = F.min(_state_commit())
    return F.least(first, _truncate_commit(min(truncates))) if truncates else first


def committed_states(valued: DataFrame, spec: CollapseInput, truncates: Sequence[Truncate]) -> DataFrame:
    """One row per key and transaction (commit LSN): the transaction's last effect on the key
    (:func:`values_as_of`'s columns), with ``__truncated`` (the first TRUNCATE after it),
    ``__alive`` (an upsert no TRUNCATE of its own transaction removed) and ``__end`` (for an
    alive state: the commit ``(lsn, time, xid)`` of the key's next state or of ``__truncated``,
    whichever is first; null while nothing ended it)."""
    carried = [c for c in valued.columns if c not in (*spec.key, LSN)]
    order = F.struct(F.col(SEQ), (F.col(KIND) == UPSERT).cast("int"))
    last = F.max_by(F.struct(*[col(c) for c in carried]), order).alias("__state")
    grouped = valued.groupBy(*[col(name) for name in spec.key], F.col(LSN)).agg(last)
    states = grouped.select(
        *[col(name) for name in spec.key],
        F.col(LSN),
        *[F.col("__state").getField(c).alias(c) for c in carried],
    ).withColumn(TRUNCATED, _truncates_after(truncates))
    truncated = F.col(TRUNCATED)
    alive = (F.col(KIND) == UPSERT) & (truncated.isNull() | (truncated.getField("lsn") > F.col(LSN)))
    by_key = Window.partitionBy(*[col(name) for name in spec.key]).orderBy(F.col(LSN))
    following = F.lead(_state_commit()).over(by_key)
    cut = F.when(
        truncated.isNotNull(),
        _commit(truncated.getField("lsn"), F.timestamp_micros(truncated.getField("micros")), truncated.getField("xid")),
    )
    return states.withColumn(ALIVE, alive).withColumn(END, F.when(alive, F.least(following, cut)))


def versions(states: DataFrame, spec: CollapseInput) -> DataFrame:
    """The history rows of the run's states (:func:`committed_states`): one per alive state, with
    the metadata of its change, ``_pg_valid_from_lsn``/``_pg_valid_from`` its commit,
    ``_pg_valid_to_lsn``/``_pg_valid_to`` the commit that ends it (null: current) and
    ``_pg_current``; plus ``__keep_<i>`` and ``__origin`` for :func:`fill_from_target`."""
    end = F.col(END)
    return states.where(F.col(ALIVE)).select(
        *[col(name) for name in (*spec.key, *spec.value_columns, *spec.metadata_columns)],
        F.col(LSN).alias(VALID_FROM_LSN),
        end.getField("lsn").alias(VALID_TO_LSN),
        col(COMMIT_TIME).alias(VALID_FROM),
        end.getField("time").alias(VALID_TO),
        end.isNull().alias(CURRENT),
        *[F.col(keep_flag_name(i)) for i in range(len(spec.keep_columns))],
        F.col(ORIGIN),
    )


def closes(states: DataFrame, spec: CollapseInput, truncates: Sequence[Truncate]) -> DataFrame:
    """For every key the run touches (deleted keys and the old keys of key changes included), the
    commit that ends the version Delta holds as current: the key's first state in the run, or
    the run's first TRUNCATE when that commits first. Columns: the key, ``_pg_valid_to_lsn``,
    ``_pg_valid_to``."""
    ends = states.groupBy(*[col(name) for name in spec.key]).agg(_first_removal(truncates).alias("__first"))
    end = F.col("__first")
    return ends.select(
        *[col(name) for name in spec.key],
        end.getField("lsn").alias(VALID_TO_LSN),
        end.getField("time").alias(VALID_TO),
    )


def merge_source(new_versions: DataFrame, closed: DataFrame, columns: Sequence[str]) -> DataFrame:
    """The history MERGE's source: the run's versions (``__action`` ``version``, inserted) and
    the closes (``close``, matched with the key's current version in Delta). ``columns``: the
    table's columns, which the versions carry."""
    inserted = new_versions.select(*[col(c) for c in columns], F.lit(VERSION).alias(ACTION))
    return inserted.unionByName(closed.withColumn(ACTION, F.lit(CLOSE)), allowMissingColumns=True)


def fill_from_target(
    frame: DataFrame, target: DataFrame, spec: CollapseInput, *, other_keys_only: bool = False
) -> DataFrame:
    """Fill the values no effect of the run set (``__keep_<i>``) from ``target``'s row at
    ``__origin`` (``target``: one row per key, the Delta rows the run starts from), and clear
    those flags. ``other_keys_only``: only where the origin is another key than the row's own
    (a row moved by a key change); at its own key the MERGE keeps the Delta value itself. An
    origin Delta does not hold gives NULL (Delta lost the row: as the merge mode's collapse).

    Only the target rows of the origins are read: their keys go to the target's scan as a
    broadcast semi-join."""
    if not spec.keep_columns:
        return frame
    flags = [F.col(keep_flag_name(i)) for i in range(len(spec.keep_columns))]
    own = _key_struct(spec.key)
    wanted = F.col(ORIGIN).isNotNull()
    if other_keys_only:
        wanted = wanted & (F.col(ORIGIN) != own)
    any_flag = flags[0]
    for flag in flags[1:]:
        any_flag = any_flag | flag
    origins = frame.where(wanted & any_flag).select(F.col(ORIGIN).alias("__t_key")).distinct()
    rows = target.select(
        own.alias("__t_key"), *[col(c).alias(f"__t_{i}") for i, c in enumerate(spec.keep_columns)]
    ).join(F.broadcast(origins), "__t_key", "left_semi")
    joined = frame.join(rows, frame[ORIGIN] == rows["__t_key"], "left")
    values = {c: i for i, c in enumerate(spec.keep_columns)}
    kept = {keep_flag_name(i): i for i in range(len(spec.keep_columns))}
    selected: list[Column] = []
    for name in frame.columns:
        if name in values:
            fill = wanted & F.col(keep_flag_name(values[name]))
            selected.append(F.when(fill, F.col(f"__t_{values[name]}")).otherwise(col(name)).alias(name))
        elif name in kept:
            selected.append((F.col(name) & ~wanted).alias(name))
        else:
            selected.append(col(name))
    return joined.select(*selected)


def latest_states(states: DataFrame, spec: CollapseInput, truncates: Sequence[Truncate]) -> DataFrame:
    """The soft-delete MERGE's source: one row per key the run touches (:func:`committed_states`).

    The key's last alive state, when nothing ended it: a live row (``__kind`` ``U``,
    ``_pg_deleted`` false) with that change's values and metadata. Otherwise a tombstone (``D``,
    true) with the values of the last alive state (the row's last committed values, not those of
    changes its own transaction made before deleting it) and the commit that ended it: the key's
    next state (a DELETE, a key change away from the key) or a TRUNCATE. ``__known``: some state
    of the run was alive. When none was, the run only removed the row Delta holds (at its first
    state or the run's first TRUNCATE, whichever commits first; the row keeps its values), or
    changed nothing that was ever committed (a key inserted and deleted in one transaction).
    ``__keep_<i>`` and ``__origin`` are those of the last alive state (:func:`values_as_of`)."""
    flags = [keep_flag_name(i) for i in range(len(spec.keep_columns))]
    fields = [*spec.value_columns, *spec.metadata_columns, *flags, ORIGIN, END]
    lived = F.max_by(F.struct(*[col(c) for c in fields]), F.when(F.col(ALIVE), F.col(LSN))).alias("__lived")
    grouped = states.groupBy(*[col(name) for name in spec.key]).agg(lived, _first_removal(truncates).alias("__first"))
    row = F.col("__lived")
    known = row.isNotNull()
    deleted = ~known | row.getField(END).isNotNull()
    removal = F.when(known, row.getField(END)).otherwise(F.col("__first"))
    removed = {COMMIT_LSN: "lsn", COMMIT_TIME: "time", XID: "xid"}
    return grouped.select(
        *[col(name) for name in spec.key],
        *[row.getField(c).alias(c) for c in spec.value_columns],
        *[
            F.when(deleted, removal.getField(removed[c])).otherwise(row.getField(c)).alias(c)
            if c in removed
            else row.getField(c).alias(c)
            for c in spec.metadata_columns
        ],
        deleted.alias(DELETED),
        F.when(deleted, F.lit(DELETE)).otherwise(F.lit(UPSERT)).alias(KIND),
        known.alias(KNOWN),
        *[F.coalesce(row.getField(flag), F.lit(True)).alias(flag) for flag in flags],
        row.getField(ORIGIN).alias(ORIGIN),
    )
