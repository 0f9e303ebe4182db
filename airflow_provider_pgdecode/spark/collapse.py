"""Turning a table's staged changes into one MERGE source: the last state per key.

Every function here is a pure DataFrame transformation (no action, no Delta access), except
:func:`resolve_lineage_roots`, which iterates a small join until move chains are followed, and
:func:`superseded_effects` and :func:`arrow_effects`, which find on the driver (pyarrow) the effects
a later one replaces and a part's effects.

Vocabulary:

* an **event** is one staged change row (``I``/``U``/``D``/``T``), normalized by
  :mod:`airflow_provider_pgdecode.spark.merge_job` to typed columns plus ``__lsn``, ``__seq``,
  ``__op``, ``__keep`` (columns whose value must not be written: unchanged TOAST, or a column
  the row's part file did not have) and ``__old_<i>`` (the old key, for a key change or a delete);
* an **effect** is what an event does to one key: an *upsert* (``I``, ``U``) at the new key, a
  *delete* at the old key (``D``, and the old half of a ``U`` that changes the key);
* the **merge source** has one row per key: the last effect, with for each column that can be
  kept a ``__keep_<i>`` flag meaning "take the value already in Delta".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import DELTA_COLUMNS

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

LSN = "__lsn"
SEQ = "__seq"
OP = "__op"
KEEP = "__keep"
KIND = "__kind"  # effect kind: 'U' upsert, 'D' delete
MOVE_IN = "__move_in"  # the upsert half of a key change
IS_INSERT = "__is_insert"  # an INSERT: sets every column, starts a new row
ORDER = "__ord"

UPSERT = "U"
DELETE = "D"


def col(name: str) -> Column:
    """A top-level column by its exact name (dots, spaces and backticks are not syntax)."""
    return F.col("`" + name.replace("`", "``") + "`")


def old_key_name(index: int) -> str:
    return f"__old_{index}"


def keep_flag_name(index: int) -> str:
    return f"__keep_{index}"


@dataclass(frozen=True)
class CollapseInput:
    """What the collapse needs to know about the table besides the events."""

    key: tuple[str, ...]
    value_columns: tuple[str, ...]
    """Non-key source columns written by the merge (key columns are never kept)."""
    keep_columns: tuple[str, ...]
    """Value columns some event keeps (unchanged TOAST or absent): only these get keep flags."""
    metadata_columns: tuple[str, ...] = DELTA_COLUMNS


def order_of(lsn: str = LSN, seq: str = SEQ) -> Column:
    """Commit order: commit LSN, then position within the transaction."""
    return F.struct(F.col(lsn).alias("lsn"), F.col(seq).alias("seq"))


def after(truncate_lsn: int, truncate_seq: int) -> Column:
    """Events after a TRUNCATE at (lsn, seq) in commit order."""
    return (F.col(LSN) > F.lit(truncate_lsn)) | (
        (F.col(LSN) == F.lit(truncate_lsn)) & (F.col(SEQ) > F.lit(truncate_seq))
    )


def arrow_after(lsn: pa.ChunkedArray, seq: pa.ChunkedArray, truncate_lsn: int, truncate_seq: int) -> pa.ChunkedArray:
    """:func:`after` in Arrow, over a part's commit LSNs and positions."""
    import pyarrow.compute as pc

    return pc.or_(pc.greater(lsn, truncate_lsn), pc.and_(pc.equal(lsn, truncate_lsn), pc.greater(seq, truncate_seq)))


def key_changed(key: Sequence[str]) -> Column:
    """True for an event whose old key (when sent) differs from its new key."""
    changed = F.lit(False)
    for index, name in enumerate(key):
        old = F.col(old_key_name(index))
        changed = changed | (old.isNotNull() & ~old.eqNullSafe(col(name)))
    return changed


def effects_of(events: DataFrame, spec: CollapseInput) -> DataFrame:
    """One row per effect: upserts at the new key, deletes at the old key (``D`` and moved-away keys)."""
    key_cols = [col(name) for name in spec.key]
    carried = [col(name) for name in (*spec.value_columns, *spec.metadata_columns)]
    moved = key_changed(spec.key)
    upserts = events.where(F.col(OP).isin("I", "U")).select(
        *key_cols,
        F.lit(UPSERT).alias(KIND),
        ((F.col(OP) == "U") & moved).alias(MOVE_IN),
        (F.col(OP) == "I").alias(IS_INSERT),
        F.col(LSN),
        F.col(SEQ),
        F.col(KEEP),
        *carried,
        *[F.col(old_key_name(i)) for i in range(len(spec.key))],
    )
    deletes = events.where((F.col(OP) == "D") | ((F.col(OP) == "U") & moved)).select(
        *[F.col(old_key_name(i)).alias(name) for i, name in enumerate(spec.key)],
        F.lit(DELETE).alias(KIND),
        F.lit(False).alias(MOVE_IN),
        F.lit(False).alias(IS_INSERT),
        F.col(LSN),
        F.col(SEQ),
        F.array().cast("array<string>").alias(KEEP),
        # Untyped NULLs: the union takes the upserts' types (a NULL widens to any type), with no
        # look at the events' schema (over Spark Connect, a round trip and an analysis per table).
        *[F.lit(None).alias(name) for name in spec.value_columns],
        *[col(name) for name in spec.metadata_columns],
        *[F.lit(None).alias(old_key_name(i)) for i in range(len(spec.key))],
    )
    return upserts.unionByName(deletes)


def _setter_order(column: str) -> Column:
    """The effect's order when it sets ``column`` (an upsert not keeping it), else null."""
    sets = (F.col(KIND) == UPSERT) & ~F.array_contains(F.col(KEEP), column)
    return F.when(sets, order_of())


def collapse_simple(effects: DataFrame, spec: CollapseInput, *, allow_keep: bool) -> DataFrame:
    """Last state per key, for batches where no key change keeps a value (no lineage to follow).

    A kept column takes the value of the latest effect on the same key that set it; when none
    did, the row's ``__keep_<i>`` flag tells the MERGE to keep the Delta value (unless
    ``allow_keep`` is false: after a TRUNCATE there is no Delta value to keep).
    """
    carried = [*spec.value_columns, *spec.metadata_columns, KIND, LSN, SEQ]
    aggregates = [F.max_by(F.struct(*[col(c) for c in carried]), order_of()).alias("__last")]
    for index, column in enumerate(spec.keep_columns):
        aggregates.append(F.max_by(F.struct(col(column).alias("v")), _setter_order(column)).alias(f"__set_{index}"))
    grouped = effects.groupBy(*[col(name) for name in spec.key]).agg(*aggregates)
    return _final_columns(grouped, spec, allow_keep=allow_keep)


@dataclass(frozen=True)
class StagedKeys:
    """The key-related columns of one staged part, as read on the driver: its ops, new key
    values, old key values (null where a change sent none), commit LSNs and positions."""

    op: pa.ChunkedArray
    new: tuple[pa.ChunkedArray, ...]
    old: tuple[pa.ChunkedArray, ...]
    lsn: pa.ChunkedArray
    seq: pa.ChunkedArray

    def after(self, truncate_lsn: int, truncate_seq: int) -> StagedKeys:
        """These changes after a TRUNCATE at (lsn, seq) in commit order (:func:`after`)."""
        mask = arrow_after(self.lsn, self.seq, truncate_lsn, truncate_seq)
        return StagedKeys(
            op=self.op.filter(mask),
            new=tuple(k.filter(mask) for k in self.new),
            old=tuple(k.filter(mask) for k in self.old),
            lsn=self.lsn.filter(mask),
            seq=self.seq.filter(mask),
        )


def old_values(part: pa.Table, column: str) -> pa.ChunkedArray | pa.Array:
    """A staged part's old values of ``column`` (null where a change sent no old image)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    old = part.column(staged.OLD) if staged.OLD in part.column_names else None
    if old is None or column not in {f.name for f in old.type}:
        return pa.nulls(part.num_rows, part.schema.field(column).type)
    return pc.struct_field(old, column)


def _effect_masks(
    op: pa.ChunkedArray, new: Sequence[pa.ChunkedArray], old: Sequence[pa.ChunkedArray | pa.Array]
) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
    """Which changes make an upsert effect and which a delete effect, as :func:`effects_of` decides."""
    import pyarrow as pa
    import pyarrow.compute as pc

    upsert = pc.is_in(op, value_set=pa.array(["I", "U"]))
    delete = pc.or_(pc.equal(op, "D"), pc.and_(pc.equal(op, "U"), arrow_key_changed(new, old)))
    return upsert, delete


def arrow_key_changed(new: Sequence[pa.ChunkedArray], old: Sequence[pa.ChunkedArray | pa.Array]) -> pa.ChunkedArray:
    """:func:`key_changed` in Arrow: an old key sent and different from the new one (a null new key
    differs)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    changed: pa.ChunkedArray | pa.Array = pa.repeat(False, len(new[0]))
    for new_key, old_key in zip(new, old, strict=True):
        differs = pc.fill_null(pc.not_equal(old_key, new_key), True)
        changed = pc.or_(changed, pc.and_(pc.is_valid(old_key), differs))
    return changed


def _effect_keys(part: StagedKeys) -> tuple[pa.Table, pa.Table]:
    """The part's upsert and delete effects (as :func:`effects_of` makes them): key, kind, order."""
    import pyarrow as pa

    upsert, delete = _effect_masks(part.op, part.new, part.old)

    def effects(mask: pa.ChunkedArray, keys: tuple[pa.ChunkedArray, ...], kind: str) -> pa.Table:
        columns = {f"k{i}": key for i, key in enumerate(keys)}
        table = pa.table({**columns, LSN: part.lsn, SEQ: part.seq}).filter(mask)
        return table.append_column(KIND, pa.repeat(pa.scalar(kind, pa.string()), table.num_rows))

    return effects(upsert, part.new, UPSERT), effects(delete, part.old, DELETE)


def arrow_effects(part: pa.Table, spec: CollapseInput) -> pa.Table:
    """A staged part's effects as :func:`effects_of` makes them, in Arrow, for a part whose values
    need no conversion: upserts at the new key with their values, deletes at the old key with null
    values; columns the key, the value and metadata columns, ``__kind``, ``__lsn``, ``__seq``, and
    for each of ``spec.keep_columns`` a flag ``__sets_<i>``: an upsert that does not keep it
    (:func:`_setter_order`; an INSERT keeps nothing, a delete sets nothing)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    op = part.column(staged.OP)
    new = [part.column(name) for name in spec.key]
    old = [old_values(part, name) for name in spec.key]
    upsert, delete = _effect_masks(op, new, old)
    carried = (*spec.value_columns, *spec.metadata_columns)
    kept = _kept_by(part, spec.keep_columns)

    def effects(mask: pa.ChunkedArray, kind: str, keys: Sequence[pa.ChunkedArray | pa.Array]) -> pa.Table:
        values = {name: part.column(name) for name in carried}
        if kind == DELETE:
            values.update({name: pa.nulls(part.num_rows, part.schema.field(name).type) for name in spec.value_columns})
        sets = {
            setter_flag_name(i): pc.or_(pc.equal(op, "I"), pc.invert(keeps))
            if kind == UPSERT
            else pa.repeat(False, len(op))
            for i, keeps in enumerate(kept)
        }
        table = pa.table(
            {
                **dict(zip(spec.key, keys, strict=True)),
                **values,
                KIND: pa.repeat(pa.scalar(kind, pa.string()), part.num_rows),
                LSN: part.column(staged.COMMIT_LSN),
                SEQ: part.column(staged.SEQ),
                **sets,
            }
        )
        return table.filter(mask)

    return pa.concat_tables([effects(upsert, UPSERT, new), effects(delete, DELETE, old)])


def setter_flag_name(index: int) -> str:
    return f"__sets_{index}"


def _kept_by(part: pa.Table, columns: Sequence[str]) -> list[pa.Array]:
    """For each of ``columns``, which of the part's changes leave it unchanged (unchanged TOAST)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not columns:
        return []
    if staged.UNCHANGED_TOAST not in part.column_names:
        return [pa.repeat(False, part.num_rows) for _ in columns]
    toast = part.column(staged.UNCHANGED_TOAST).combine_chunks()
    names, rows = pc.list_flatten(toast), pc.list_parent_indices(toast)
    every = pa.array(range(part.num_rows), pa.int64())
    return [pc.is_in(every, value_set=rows.filter(pc.equal(names, column)).cast(pa.int64())) for column in columns]


def arrow_last_keeping(effects: pa.Table, spec: CollapseInput, *, allow_keep: bool) -> pa.Table:
    """:func:`collapse_simple` in Arrow, for ``effects`` of :func:`arrow_effects` without a key
    change that keeps a value: each key's last effect, a kept column holding the value of the
    latest effect on the key that set it, and its ``__keep_<i>`` flag true where none did (false
    unless ``allow_keep``). The key must hold no NULL, and no two effects on a key one order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ordered = effects.sort_by([*[(name, "ascending") for name in spec.key], (LSN, "ascending"), (SEQ, "ascending")])
    count = ordered.num_rows
    if not count:
        return ordered
    same: pa.ChunkedArray | pa.Array = pa.repeat(True, count - 1)  # row i and row i + 1 share a key
    for name in spec.key:
        column = ordered.column(name)
        same = pc.and_(same, pc.equal(column.slice(0, count - 1), column.slice(1)))
    position = pa.array(range(count), pa.int64())
    none = pa.scalar(None, pa.int64())
    first = pa.concat_arrays([pa.array([True]), pc.invert(same).combine_chunks()])
    last = pa.concat_arrays([pc.invert(same).combine_chunks(), pa.array([True])])
    key_start = pc.fill_null_forward(pc.if_else(first, position, none))
    result = ordered.filter(last)
    for index, column in enumerate(spec.keep_columns):
        setter = pc.fill_null_forward(pc.if_else(ordered.column(setter_flag_name(index)), position, none))
        setter = pc.if_else(pc.less(setter, key_start), none, setter).filter(last)  # not an earlier key's
        result = result.set_column(result.schema.get_field_index(column), column, ordered.column(column).take(setter))
        flag = pc.is_null(setter) if allow_keep else pa.repeat(False, result.num_rows)
        result = result.append_column(keep_flag_name(index), flag)
    return result.drop_columns([setter_flag_name(i) for i in range(len(spec.keep_columns))])


def superseded_effects(parts: Sequence[StagedKeys]) -> pa.Table | None:
    """The effects some later effect on the same key replaces (``__kind``, ``__lsn``, ``__seq``),
    which is all the collapse without kept columns drops (:func:`collapse_known`).

    ``None`` when the parts' key types differ, a delete effect's key has a null (the Spark
    collapse then decides, as it groups nulls its own way) or two effects of one kind share a
    commit LSN and position (they could not be told apart when dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tables = [table for part in parts for table in _effect_keys(part)]
    if not tables:
        return None
    try:
        effects = pa.concat_tables(tables)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    width = len(parts[0].new)
    if any(effects.column(f"k{i}").null_count for i in range(width)):
        return None
    if effects.group_by([KIND, LSN, SEQ]).aggregate([]).num_rows != effects.num_rows:
        return None
    ordered = effects.sort_by([*[(f"k{i}", "ascending") for i in range(width)], (LSN, "ascending"), (SEQ, "ascending")])
    count = ordered.num_rows
    if count < 2:
        return ordered.select([KIND, LSN, SEQ]).slice(0, 0)
    same: pa.ChunkedArray | pa.Array = pa.repeat(True, count - 1)
    for index in range(width):
        key = ordered.column(f"k{index}")
        same = pc.and_(same, pc.equal(key.slice(0, count - 1), key.slice(1)))
    return ordered.slice(0, count - 1).filter(same).select([KIND, LSN, SEQ])


def collapse_known(spark: SparkSession, effects: DataFrame, spec: CollapseInput, superseded: pa.Table) -> DataFrame:
    """Last state per key when no column is kept and the driver already knows which effects are
    not the last of their key (:func:`superseded_effects`): those are dropped, by a broadcast
    anti-join when there are any. Same rows as :func:`collapse_simple`, without its shuffle and
    sort of every effect."""
    if superseded.num_rows:
        dropped = spark.createDataFrame(superseded)
        effects = effects.join(F.broadcast(dropped), on=[KIND, LSN, SEQ], how="left_anti")
    columns = [col(name) for name in (*spec.key, *spec.value_columns, *spec.metadata_columns)]
    return effects.select(*columns, F.col(KIND))


def _final_columns(grouped: DataFrame, spec: CollapseInput, *, allow_keep: bool) -> DataFrame:
    keep_index = {column: index for index, column in enumerate(spec.keep_columns)}
    columns: list[Column] = [col(name) for name in spec.key]
    for column in spec.value_columns:
        if column in keep_index:
            columns.append(F.col(f"__set_{keep_index[column]}").getField("v").alias(column))
        else:
            columns.append(F.col("__last").getField(column).alias(column))
    columns += [F.col("__last").getField(name).alias(name) for name in spec.metadata_columns]
    columns.append(F.col("__last").getField(KIND).alias(KIND))
    for index in keep_index.values():
        flag = F.col(f"__set_{index}").isNull() if allow_keep else F.lit(False)
        columns.append(flag.alias(keep_flag_name(index)))
    return grouped.select(*columns)


def _segment_struct(key: Sequence[str], seg_ord: Column) -> Column:
    return F.struct(F.struct(*[col(name) for name in key]).alias("k"), seg_ord.alias("o"))


def with_segments(effects: DataFrame, spec: CollapseInput) -> DataFrame:
    """Tag each effect with its segment: (key, order of the last insert or move-in at or before it).

    A segment whose order is null starts from the row already in Delta at that key.
    """
    from pyspark.sql.window import Window

    starts = F.col(IS_INSERT) | F.col(MOVE_IN)
    window = (
        Window.partitionBy(*[col(name) for name in spec.key])
        .orderBy(F.col(LSN), F.col(SEQ))
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    seg_ord = F.last(F.when(starts, order_of()), ignorenulls=True).over(window)
    return effects.withColumn("__seg", _segment_struct(spec.key, seg_ord))


def resolve_lineage_roots(links: DataFrame, max_rounds: int = 64) -> DataFrame:
    """Follow ``child -> parent`` segment links to their roots (pointer jumping).

    ``links`` has columns ``child`` and ``parent`` (segment structs). Returns ``child``, ``root``.
    Each round halves the remaining chain length, so a chain of n moves takes about log2(n)
    rounds; every round runs one small job over the links only.
    """
    current = links.select(F.col("child"), F.col("parent").alias("root")).localCheckpoint()
    for _ in range(max_rounds):
        step = current.alias("a").join(current.alias("b"), F.col("a.root") == F.col("b.child"), "left")
        pending = step.where(F.col("b.child").isNotNull()).limit(1).count()
        if pending == 0:
            return current
        current = step.select(
            F.col("a.child").alias("child"), F.coalesce(F.col("b.root"), F.col("a.root")).alias("root")
        ).localCheckpoint()
    raise RuntimeError(f"key-change chains longer than 2^{max_rounds} moves")


def with_lineage(effects: DataFrame, spec: CollapseInput) -> DataFrame:
    """Each effect tagged with ``__lineage``: the first segment of the physical row it belongs to,
    followed back through key changes (:func:`with_segments`, :func:`resolve_lineage_roots`).

    ``__lineage`` is a segment struct ``(k, o)``: ``o`` null means the row started from the one
    Delta held at key ``k`` before the run; otherwise an INSERT at order ``o`` started it."""
    tagged = with_segments(effects, spec)
    old_key = F.struct(*[F.col(old_key_name(i)).alias(name) for i, name in enumerate(spec.key)])
    move_ins = tagged.where(F.col(MOVE_IN)).select(
        F.col("__seg").alias("child"), old_key.alias("from_k"), F.col(LSN).alias("l"), F.col(SEQ).alias("s")
    )
    deletes = tagged.where(F.col(KIND) == DELETE).select(
        F.struct(*[col(name) for name in spec.key]).alias("k"),
        F.col(LSN).alias("l"),
        F.col(SEQ).alias("s"),
        F.col("__seg").alias("parent"),
    )
    links = move_ins.join(
        deletes,
        (move_ins["from_k"] == deletes["k"]) & (move_ins["l"] == deletes["l"]) & (move_ins["s"] == deletes["s"]),
    ).select("child", "parent")
    roots = resolve_lineage_roots(links)
    return tagged.join(roots, tagged["__seg"] == roots["child"], "left").select(
        *[col(name) for name in tagged.columns], F.coalesce(F.col("root"), F.col("__seg")).alias("__lineage")
    )


def collapse_with_lineage(
    effects: DataFrame, spec: CollapseInput, target: DataFrame | None, *, allow_keep: bool
) -> DataFrame:
    """Last state per key when key changes carry unchanged-TOAST columns.

    A kept column's value follows the physical row through its key changes (its lineage):
    the latest effect of the lineage that set it wins; when none did, the value is the one
    Delta holds at the lineage's first key. If that key is the row's final key, the MERGE
    keeps the Delta value itself; otherwise it is read from ``target`` here.
    """
    lineage = with_lineage(effects, spec)
    setters = lineage.groupBy("__lineage").agg(
        *[
            F.max_by(F.struct(col(column).alias("v")), _setter_order(column)).alias(f"__set_{index}")
            for index, column in enumerate(spec.keep_columns)
        ]
    )
    carried = [*spec.value_columns, *spec.metadata_columns, KIND, LSN, SEQ, "__lineage"]
    last = lineage.groupBy(*[col(name) for name in spec.key]).agg(
        F.max_by(F.struct(*[col(c) for c in carried]), order_of()).alias("__last")
    )
    grouped = last.join(setters, F.col("__last").getField("__lineage") == setters["__lineage"], "left").drop(
        "__lineage"
    )
    # Where the lineage started from a Delta row at another key, read that row's kept values here.
    origin_key = F.col("__last").getField("__lineage").getField("k")
    same_key = origin_key == F.struct(*[col(name) for name in spec.key])
    target_based = F.col("__last").getField("__lineage").getField("o").isNull()
    if target is not None and allow_keep and spec.keep_columns:
        kept = target.select(
            F.struct(*[col(name) for name in spec.key]).alias("__origin"),
            *[col(column).alias(f"__origin_{i}") for i, column in enumerate(spec.keep_columns)],
        )
        grouped = grouped.join(kept, origin_key == F.col("__origin"), "left")
        for index in range(len(spec.keep_columns)):
            fill = target_based & ~same_key & F.col(f"__set_{index}").isNull()
            grouped = grouped.withColumn(
                f"__set_{index}",
                F.when(fill, F.struct(F.col(f"__origin_{index}").alias("v"))).otherwise(F.col(f"__set_{index}")),
            )
        grouped = grouped.drop("__origin", *[f"__origin_{i}" for i in range(len(spec.keep_columns))])
    return _final_columns(grouped, spec, allow_keep=allow_keep)
