"""The light write: a small run's MERGE into a small Delta table, committed by delta-rs.

Delta's own MERGE pays a fixed cost per table, whatever the rows: planning, a snapshot of the
table, and about ten small Spark jobs (about 1.5 s on a warm two-core server). A cycle that
touches many small tables pays it once per table, one after another. For a run of few changes
into a table of few bytes, the merge job instead collects the MERGE source Spark computed (one row
per key, :func:`~airflow_provider_pgdecode.spark.merge_sql.merge_source`) and hands it, with the
very same ON condition and ``WHEN`` clauses (:class:`~airflow_provider_pgdecode.spark.merge_sql.Clause`),
to delta-rs's MERGE, which runs in this process in milliseconds. A run of many changes is taken too
when the driver built its source (:mod:`.arrow_source`, read whole up to its bound): a MERGE of
500,000 updates and 500,000 deletes into 4,000,000 rows took delta-rs 1.2-1.5 s in
bench/backlog_bench.py, Delta's MERGE 8.9-10.1 s. For a single integer key the ON condition holds
the run's key ranges, as Delta's MERGE's does, so delta-rs reads only the data files they meet
(:func:`touched_files`), and the size bound counts those.

What stays as with Delta's MERGE:

* one commit, holding the ``txn`` action (app id of the slot, version = the batch's end LSN)
  that keeps the watermark; a version at or below the recorded one is not written again, as
  Delta's idempotent write skips it;
* column mapping: delta-rs writes files by the columns' physical names, with statistics;
* deletion vectors already in the table are applied when delta-rs reads it; delta-rs rewrites
  the files it changes instead of adding deletion vectors (cheap at this size), so what it
  writes is readable by every Delta reader.

The path is taken only when every condition of :func:`light_write_refusal` holds; otherwise the
table is merged by Delta as before. Which path ran is logged per table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_pgdecode.batch.format import delta_columns, is_local_path, local_path
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, is_object_store
from airflow_provider_pgdecode.spark.collapse import KIND, UPSERT
from airflow_provider_pgdecode.spark.delta_state import app_id
from airflow_provider_pgdecode.spark.key_bounds import integer_key
from airflow_provider_pgdecode.spark.merge_sql import (
    MATCHED,
    NOT_MATCHED,
    NOT_MATCHED_BY_SOURCE,
    Clause,
    merge_condition,
    pruning_ranges,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from airflow_provider_pgdecode.spark.merge_plan import MergeOptions, Profile, TablePlan

log = logging.getLogger("airflow_provider_pgdecode.spark.merge")

#: Table features of a table delta-rs merges into correctly: it reads deletion vectors and writes
#: column-mapped files, and none of the others asks anything of a rewritten file. Any other
#: feature (type widening, row tracking, change data feed, v2 checkpoints, ...) keeps the table on
#: Delta's MERGE.
LIGHT_FEATURES = frozenset({"appendOnly", "invariants", "columnMapping", "deletionVectors", "timestampNtz"})
#: The field metadata naming a column's physical name in a column-mapped table.
PHYSICAL_NAME = "delta.columnMapping.physicalName"
#: Key types whose equality delta-rs and Spark agree on (floating point ``NaN`` keys do not).
_EXACT_KEY_TYPES = ("bigint", "int", "smallint", "tinyint", "string", "date", "timestamp", "timestamp_ntz", "binary")


def light_write_refusal(plan: TablePlan, profile: Profile, options: MergeOptions) -> str | None:
    """Why this run of ``plan`` is not written by delta-rs (``None``: it may be, once the table's
    size and features pass :func:`table_refusal`). Pure: the plan, the profile and the options."""
    if options.light_write_max_bytes <= 0:
        return "the light write is off (--light-write-max-bytes 0)"
    if plan.mode != "merge" or plan.multiset or plan.append_only:
        return f"load mode {plan.mode}{' (keyless)' if plan.multiset else ''}"
    # A run that may be an append (:func:`appends`) reads no file of the table: neither a table
    # this run creates (Spark creates it first) nor a large run stops it.
    if not plan.state.exists and not may_append(plan, profile):
        return "the table is created by this run"
    # A large run's source Spark computed would be collected here whole: only the driver's own
    # (profiled from the parts, read up to arrow_source's bound) is taken for it.
    if profile.changes >= options.codegen_min_changes and profile.superseded is None and not may_append(plan, profile):
        return _many_changes(profile, options)
    if not is_local_path(plan.path) and not is_object_store(plan.path):
        return "neither on a local filesystem nor on s3://"
    mapping = plan.state.properties.get("delta.columnMapping.mode", "none")
    if mapping not in ("none", "name"):
        return f"column mapping mode {mapping}"
    key_types = [plan.types[k].delta_type.simpleString() if k in plan.types else "" for k in plan.key]
    inexact = [
        k for k, t in zip(plan.key, key_types, strict=True) if t not in _EXACT_KEY_TYPES and not t.startswith("decimal")
    ]
    if inexact:
        return f"key column(s) {inexact} of a type compared differently outside Spark"
    try:
        import deltalake  # noqa: F401
    except ImportError:
        return "the deltalake package is not installed here"
    return None


def _many_changes(profile: Profile, options: MergeOptions) -> str:
    return f"{profile.changes} changes (at least --codegen-min-changes {options.codegen_min_changes})"


def table_refusal(table: Any, max_bytes: int | None, touched: Sequence[bool] | None = None) -> str | None:
    """Why the delta-rs ``table`` is not written by delta-rs: a table feature outside
    :data:`LIGHT_FEATURES`, or more than ``max_bytes`` of data files the run may rewrite (those
    ``touched`` marks, by the order of ``get_add_actions``; all when ``None``). ``None``: it may
    be; no size bound when ``max_bytes`` is None, as for an append, which reads none of them."""
    protocol = table.protocol()
    features = set(protocol.writer_features or ()) | set(protocol.reader_features or ())
    if protocol.min_writer_version < 7 and protocol.min_writer_version > 2:
        # Legacy protocol versions 3-6 imply features (check constraints, change data feed,
        # generated columns, identity columns) named nowhere: Delta's MERGE knows them.
        return f"Delta writer version {protocol.min_writer_version}"
    unknown = sorted(features - LIGHT_FEATURES)
    if unknown:
        return f"table feature(s) {unknown}"
    if max_bytes is None:
        return None
    files = table.get_add_actions(flatten=True)
    sizes = files.column("size_bytes").to_pylist() if files.num_rows else []
    size = sum(s for s, hit in zip(sizes, touched or [True] * len(sizes), strict=True) if hit)
    if size > max_bytes:
        which = "data files its keys' ranges meet" if touched is not None else "data files"
        return f"{size} bytes of {which} (above --light-write-max-bytes {max_bytes})"
    return None


def light_merge(
    plan: TablePlan,
    profile: Profile,
    source: Callable[[], DataFrame],
    clauses: Sequence[Clause],
    slot: str,
    options: MergeOptions,
    rows: pa.Table | None = None,
) -> bool:
    """Merge ``source()`` (or ``rows``, the same source built on the driver by
    :mod:`.arrow_source`) into ``plan``'s table through delta-rs when :func:`light_write_refusal`
    and :func:`table_refusal` let it: one commit holding the transaction id (app id of ``slot``,
    version ``plan.watermark_after``). Returns False when the table is left to Delta's MERGE:
    refused (the reason logged), or delta-rs failed.

    A delta-rs failure is not the table's failure: its commit is one log file written whole or not
    at all, so the table is as before (or, if it failed after its commit, holds this run's
    transaction id, and Delta's MERGE skips it). Delta's MERGE then writes it, or fails with
    Delta's own error, the one the parking and the runbooks name."""
    refusal = light_write_refusal(plan, profile, options)
    if refusal is not None:
        log.info("table %s: merged by Delta (%s)", plan.name, refusal)
        return False
    try:
        return _merge(plan, profile, source, light_ranges(plan, profile, options), clauses, slot, options, rows)
    except Exception as exc:  # noqa: BLE001 - any delta-rs error: Delta's MERGE decides
        log.warning(
            "table %s: delta-rs could not write it (%s: %s); merged by Delta instead",
            plan.name,
            type(exc).__name__,
            exc,
        )
        return False


def _merge(
    plan: TablePlan,
    profile: Profile,
    source: Callable[[], DataFrame],
    ranges: Sequence[tuple[Any, Any]] | None,
    clauses: Sequence[Clause],
    slot: str,
    options: MergeOptions,
    rows: pa.Table | None,
) -> bool:
    import pyarrow.compute as pc
    from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction, write_deltalake

    uri, storage_options = delta_rs_location(plan.path)
    table = DeltaTable(uri, storage_options=storage_options)
    refusal = table_refusal(table, None)
    if refusal is not None:
        log.info("table %s: merged by Delta (%s)", plan.name, refusal)
        return False
    app = app_id(slot)
    recorded = table.transaction_version(app)
    if recorded is not None and recorded >= plan.watermark_after:
        return True  # Delta's idempotent write would skip it too: the caller sees no new version
    transaction = Transaction(app_id=app, version=plan.watermark_after)
    if rows is not None and appends(plan, profile, table):
        appended = rows.filter(pc.equal(rows.column(KIND), UPSERT)).select(list(appended_columns(plan)))
        write_deltalake(
            table,
            appended,
            mode="append",
            commit_properties=CommitProperties(app_transactions=[transaction]),
            post_commithook_properties=PostCommitHookProperties(create_checkpoint=False),
        )
        checkpoint_when_due(table, plan.name)
        log.info(
            "table %s: appended by delta-rs (inserts only, of keys outside every file's key range): %d row(s)",
            plan.name,
            appended.num_rows,
        )
        return True
    refusal = table_refusal(table, options.light_write_max_bytes, touched_files(plan, ranges, table))
    if refusal is None and profile.changes >= options.codegen_min_changes and rows is None:
        refusal = _many_changes(profile, options) + ", and keys within the table's files: not an append"
    if refusal is not None:
        log.info("table %s: merged by Delta (%s)", plan.name, refusal)
        return False
    built = rows is not None
    if rows is None:
        rows = source().toArrow()
    merger = table.merge(
        rows,
        predicate=merge_condition(plan, ranges),
        source_alias="s",
        target_alias="t",
        commit_properties=CommitProperties(app_transactions=[transaction]),
        post_commithook_properties=PostCommitHookProperties(create_checkpoint=False),
    )
    for clause in clauses:
        merger = _add_clause(merger, clause)
    metrics = merger.execute()
    checkpoint_when_due(table, plan.name)
    log.info(
        "table %s: merged by delta-rs (a small run into a small table): %d source row(s)%s, %d file(s) rewritten",
        plan.name,
        metrics.get("num_source_rows", 0),
        " built on the driver" if built else "",
        metrics.get("num_target_files_removed", 0),
    )
    return True


CHECKPOINT_INTERVAL = 10
"""Versions between two checkpoints of a table delta-rs commits to, when the table sets no
``delta.checkpointInterval``: Delta's own default, which Spark's writes keep (delta-rs's is 100).
Opening a table reads every commit since its last checkpoint, and the light write opens each
table it merges: for a small table here, 1.6 ms with 2 commits in its log, 10 ms with 21, 31 ms
with 99, against about 1 ms to write its checkpoint (deltalake 1.6, 2026-11-30). A table merged
every cycle would otherwise pay up to 30 ms of each cycle for it."""


def checkpoint_when_due(table: Any, name: str) -> None:
    """Write a checkpoint of ``table`` (a delta-rs ``DeltaTable``, just committed to) when its
    version is a multiple of its checkpoint interval, as Delta's writers do. A checkpoint that
    fails is logged, not raised: the commit stands, and a later one writes it."""
    configured = table.metadata().configuration.get("delta.checkpointInterval")
    try:
        interval = max(1, int(configured)) if configured else CHECKPOINT_INTERVAL
    except ValueError:
        interval = CHECKPOINT_INTERVAL
    version = table.version()
    if version % interval:
        return
    try:
        table.create_checkpoint()
    except Exception as exc:
        log.warning(
            "table %s: no checkpoint at version %d (%s: %s); a later commit writes one",
            name,
            version,
            type(exc).__name__,
            exc,
        )


def light_ranges(plan: TablePlan, profile: Profile, options: MergeOptions) -> list[tuple[Any, Any]] | None:
    """The key ranges delta-rs's ON condition holds, as Delta's MERGE's does
    (:func:`~.merge_sql.pruning_ranges`), for an integer key only (integer literals read alike
    by both SQL dialects): delta-rs then reads only the data files they meet."""
    ranges = pruning_ranges(plan, profile, options)
    return ranges if ranges and integer_key(plan) is not None else None


def large_run_refusal(plan: TablePlan, profile: Profile, options: MergeOptions) -> str | None:
    """For a run of at least ``--codegen-min-changes`` changes that is no append, why delta-rs
    will not take it (its table's features, or the bytes of the data files it would read:
    :func:`table_refusal`), checked before its source is read whole on the driver; ``None``: it
    may. A smaller run is not checked here: its source costs little."""
    if profile.changes < options.codegen_min_changes or may_append(plan, profile):
        return None
    from deltalake import DeltaTable

    uri, storage_options = delta_rs_location(plan.path)
    table = DeltaTable(uri, storage_options=storage_options)
    ranges = light_ranges(plan, profile, options)
    return table_refusal(table, options.light_write_max_bytes, touched_files(plan, ranges, table))


def may_append(plan: TablePlan, profile: Profile) -> bool:
    """Whether this run may be an append (:func:`appends` decides, from the table's statistics):
    inserts only, no TRUNCATE, of a single integer key whose ranges the profile knows. Not a text
    key: Delta keeps only a prefix of long strings in its statistics."""
    return (
        profile.inserts_only
        and profile.truncate_at is None
        and integer_key(plan) is not None
        and bool(profile.key_ranges)
    )


def appends(plan: TablePlan, profile: Profile, table: Any) -> bool:
    """Whether this run's MERGE is an append (:func:`may_append`, and every staged key lies outside
    every data file's key range in the file statistics): no row of the table can match one, so
    the MERGE would insert each row and touch nothing else. Keys inserted again over rows Delta
    still holds (a replay, a re-snapshot) overlap those ranges and are merged."""
    if not may_append(plan, profile):
        return False
    stats = _key_statistics(plan, table)
    if stats is None:
        return False  # no statistics of the key: nothing shows the keys are new
    return keys_outside(profile.key_ranges or [], *stats)


def touched_files(plan: TablePlan, ranges: Sequence[tuple[Any, Any]] | None, table: Any) -> list[bool] | None:
    """Which of the table's data files (by the order of ``get_add_actions``) meet the key
    ``ranges`` of the MERGE's ON condition, by the files' statistics (a file without them does):
    delta-rs skips the others, and reads and may rewrite these. ``None`` (every file) without
    ranges or statistics."""
    if not ranges:
        return None
    stats = _key_statistics(plan, table)
    if stats is None:
        return None
    return [not keys_outside(ranges, [low], [high]) for low, high in zip(*stats, strict=True)]


def _key_statistics(plan: TablePlan, table: Any) -> tuple[list[Any], list[Any]] | None:
    """Each data file's minimum and maximum of the table's first key column (by the order of
    ``get_add_actions``), from Delta's statistics; ``None`` when they are not kept."""
    files = table.get_add_actions(flatten=True)
    if not files.num_rows:
        return [], []
    fields = {field.name: field for field in table.schema().fields}
    if plan.key[0] not in fields:
        return None
    # Statistics are kept by the column's physical name (column mapping), else by its name.
    physical = fields[plan.key[0]].metadata.get(PHYSICAL_NAME, plan.key[0])
    low, high = f"min.{physical}", f"max.{physical}"
    if low not in files.column_names or high not in files.column_names:
        return None
    return files.column(low).to_pylist(), files.column(high).to_pylist()


def keys_outside(ranges: Sequence[tuple[Any, Any]], lows: Sequence[Any], highs: Sequence[Any]) -> bool:
    """Whether no ``[lo, hi]`` of ``ranges`` meets any file's ``[low, high]``; a file without
    statistics (``None``) meets every range."""
    for low, high in zip(lows, highs, strict=True):
        if low is None or high is None:
            return False
        if any(lo <= high and low <= hi for lo, hi in ranges):
            return False
    return True


def appended_columns(plan: TablePlan) -> tuple[str, ...]:
    """The columns an append writes: the table's, then its metadata columns (the MERGE's INSERT)."""
    return (*plan.columns, *delta_columns(plan.mode))


def delta_rs_location(path: str) -> tuple[str, dict[str, str] | None]:
    """The table URI and ``storage_options`` delta-rs opens ``path`` with: a local path as is, an
    ``s3a://`` location as ``s3://`` with the object store settings of this process's environment."""
    if is_local_path(path):
        return local_path(path), None
    return "s3://" + path.split("://", 1)[1], ObjectStoreSettings.from_env().delta_rs_options()


def _add_clause(merger: Any, clause: Clause) -> Any:
    """``clause`` as the delta-rs ``TableMerger`` call of the same meaning."""
    values: Mapping[str, str] = clause.values
    calls = {
        (MATCHED, "DELETE"): lambda: merger.when_matched_delete(predicate=clause.condition),
        (MATCHED, "UPDATE"): lambda: merger.when_matched_update(dict(values), predicate=clause.condition),
        (NOT_MATCHED, "INSERT"): lambda: merger.when_not_matched_insert(dict(values), predicate=clause.condition),
        (NOT_MATCHED_BY_SOURCE, "DELETE"): lambda: merger.when_not_matched_by_source_delete(predicate=clause.condition),
        (NOT_MATCHED_BY_SOURCE, "UPDATE"): lambda: merger.when_not_matched_by_source_update(
            dict(values), predicate=clause.condition
        ),
    }
    return calls[(clause.when, clause.action)]()
