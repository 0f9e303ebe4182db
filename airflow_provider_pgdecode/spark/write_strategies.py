"""How a table's changes are written, one function per load mode.

``merge`` (:func:`run_merge`), ``history``, ``soft_delete``, ``append_only`` and ``multiset``,
and the plain append of an inserts-only batch into a table this run created. Each writes one
Delta commit that carries the transaction id of the batches' end LSN (the watermark), built from
:mod:`.merge_sql`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from airflow_provider_pgdecode.batch.format import (
    COMMIT_LSN,
    COMMIT_TIME,
    CURRENT,
    DELETED,
    VALID_TO,
    VALID_TO_LSN,
    XID,
    delta_columns,
)
from airflow_provider_pgdecode.spark import collapse, history, multiset
from airflow_provider_pgdecode.spark.collapse import KIND, OP, CollapseInput, col, old_key_name
from airflow_provider_pgdecode.spark.delta_state import app_id, delta_log_storage, log_version
from airflow_provider_pgdecode.spark.history import HISTORY, SOFT_DELETE
from airflow_provider_pgdecode.spark.key_bounds import bound_column, bounded_key
from airflow_provider_pgdecode.spark.light_write import light_merge
from airflow_provider_pgdecode.spark.merge_plan import METADATA_COLUMNS, MergeOptions, Profile, TablePlan, quote
from airflow_provider_pgdecode.spark.merge_sql import (
    MATCHED,
    NOT_MATCHED_BY_SOURCE,
    delete,
    delta_ref,
    execute_merge,
    insert,
    merge_condition,
    pruning_ranges,
    update,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession


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
    source: DataFrame | Callable[[], DataFrame],
    profile: Profile,
    slot: str,
    options: MergeOptions,
    keep_columns: Sequence[str] | None = None,
    rows: pa.Table | None = None,
) -> None:
    """The one MERGE of this table, recording the watermark in the same Delta commit.

    ``source``: one row per key (:func:`merge_source`, or :func:`.history.latest_states` for a
    ``soft_delete`` table), or the function that makes it when asked (``rows``, the same source
    built on the driver by :mod:`.arrow_source`, may spare asking), with ``__keep_<i>`` flags for ``keep_columns`` (default: the
    profile's). A ``soft_delete`` table gets other DELETE clauses: a deleted key's row becomes a
    tombstone (``_pg_deleted``) instead of going: with the values the run last committed for it
    when it had any (``__known``, also inserted when Delta lacks the key), else keeping Delta's;
    and a TRUNCATE makes every other row a tombstone at the first TRUNCATE's commit."""
    frame: Callable[[], DataFrame] = source if callable(source) else lambda: source
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
    ranges = pruning_ranges(plan, profile, options)
    if plan.mode == SOFT_DELETE:
        known = f"s.{history.KNOWN}"
        removed = {quote(DELETED): "true", **{quote(c): f"s.{quote(c)}" for c in METADATA_COLUMNS}}
        clauses = [
            update(MATCHED, f"{known} AND {newer}", update_set),
            update(MATCHED, f"NOT t.{quote(DELETED)} AND {newer}", removed),
            insert(known, insert_values),
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
                update(NOT_MATCHED_BY_SOURCE, f"NOT t.{quote(DELETED)} AND t.{COMMIT_LSN} < {first.lsn}", tombstone)
            )
    else:
        clauses = [
            delete(MATCHED, f"s.{KIND} = 'D' AND {newer}"),
            update(MATCHED, f"s.{KIND} = 'U' AND {newer}", update_set),
            insert(f"s.{KIND} = 'U'", insert_values),
        ]
        if profile.truncate_at is not None:
            clauses.append(delete(NOT_MATCHED_BY_SOURCE, f"t.{COMMIT_LSN} < {profile.truncate_at[0]}"))
        if light_merge(plan, profile, frame, clauses, slot, options, rows):
            return
    execute_merge(spark, plan.path, frame(), merge_condition(plan, ranges), clauses, slot, plan.watermark_after)


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
    key = bounded_key(plan)
    if not options.key_range_pruning or key is None or not profile.key_ranges:
        return F.lit(True)
    delta_type = plan.types[key].delta_type
    ranges = [
        col(key).between(bound_column(lo, delta_type), bound_column(hi, delta_type)) for lo, hi in profile.key_ranges
    ]
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
        update(MATCHED, f"t.{COMMIT_LSN} < s.{quote(VALID_TO_LSN)}", ended),
        insert(f"s.{history.ACTION} = '{history.VERSION}'", values),
    ]
    if profile.truncations:
        first = profile.truncations[0]
        cut = {quote(VALID_TO_LSN): str(first.lsn), quote(VALID_TO): first.time_sql(), quote(CURRENT): "false"}
        clauses.append(update(NOT_MATCHED_BY_SOURCE, f"t.{quote(CURRENT)} AND t.{COMMIT_LSN} < {first.lsn}", cut))
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


def append_inserts(spark: SparkSession, plan: TablePlan, events: DataFrame, profile: Profile, slot: str) -> None:
    """Into a table this run created (empty), an inserts-only batch is appended, not merged: no
    collapse, no join. One Delta commit holding the watermark, as the MERGE's does."""
    rows = events.where(F.col(OP) == "I")
    if profile.truncate_at is not None:
        rows = rows.where(collapse.after(*profile.truncate_at))
    rows = rows.select(*[col(c) for c in plan.columns], *[F.col(c) for c in METADATA_COLUMNS])
    append_rows(spark, plan.path, rows, slot, plan.watermark_after)


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
        insert(None, values),
        delete(NOT_MATCHED_BY_SOURCE, f"t.{COMMIT_LSN} < {profile.truncate_at[0]}"),
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
        delete(MATCHED),
        insert(f"s.{multiset.ACTION} = '{multiset.INSERT}'", values),
    ]
    if profile.truncate_at is not None:
        clauses.append(delete(NOT_MATCHED_BY_SOURCE, f"t.{COMMIT_LSN} < {profile.truncate_at[0]}"))
    execute_merge(spark, plan.path, source, multiset.merge_condition(columns), clauses, slot, plan.watermark_after)
    return {"inserted": added, "updated": 0, "deleted": removed}


def last_commit(spark: SparkSession, path: str) -> tuple[int, dict[str, int]]:
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
    if operation == "WRITE":  # Delta's name, or delta-rs's (an append by spark/light_write.py)
        inserted = int(metrics.get("numOutputRows", metrics.get("num_added_rows", 0)))
        return version, {"inserted": inserted, "updated": 0, "deleted": 0}
    if operation != "MERGE":
        return version, {}
    # Delta's names, or delta-rs's (spark/light_write.py) for the same counts.
    return version, {
        "inserted": int(metrics.get("numTargetRowsInserted", metrics.get("num_target_rows_inserted", 0))),
        "updated": int(metrics.get("numTargetRowsUpdated", metrics.get("num_target_rows_updated", 0))),
        "deleted": int(metrics.get("numTargetRowsDeleted", metrics.get("num_target_rows_deleted", 0))),
    }
