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
   A small run into a small table is committed by delta-rs instead (:mod:`.light_write`), its
   MERGE source built on the driver when the parts need no conversion (:mod:`.arrow_source`).

This module keeps that run order, the per-table write and the command line; each step's code is
in its own module: :mod:`.merge_plan` (options, plans, results), :mod:`.staged_events` (the
staged parts read), :mod:`.profiling`, :mod:`.merge_sql` (DDL and the MERGE),
:mod:`.write_strategies` (one write per load mode), :mod:`.snapshot_commit` (an initial load
committed as staged) and :mod:`.side_tables` (the quarantine and messages tables), over
:mod:`.delta_state` (the Delta table's state).

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
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a file by spark-submit: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pyspark.sql import DataFrame

from airflow_provider_pgdecode.batch.format import is_local_path, local_path
from airflow_provider_pgdecode.batch.manifest import BatchManifest, TableSummary, read_batches
from airflow_provider_pgdecode.batch.parking import PARKED
from airflow_provider_pgdecode.batch.storage import spark_uri
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError, MergeInputError, MergeOutOfMemoryError
from airflow_provider_pgdecode.spark import table_parking
from airflow_provider_pgdecode.spark.arrow_source import arrow_source
from airflow_provider_pgdecode.spark.delta_state import DeltaState as DeltaState
from airflow_provider_pgdecode.spark.delta_state import app_id, delta_log_storage, read_delta_state
from airflow_provider_pgdecode.spark.history import HISTORY, SOFT_DELETE
from airflow_provider_pgdecode.spark.memory_budget import check_fits, server_memory
from airflow_provider_pgdecode.spark.merge_plan import (
    DEFAULT_CODEGEN_MIN_CHANGES,
    DEFAULT_LIGHT_WRITE_MAX_BYTES,
    DEFAULT_TABLE_PROPERTIES,
    MergeOptions,
    Profile,
    TablePlan,
    TableResult,
    parks,
    plan_merge,
)
from airflow_provider_pgdecode.spark.merge_plan import KEY_PROPERTY as KEY_PROPERTY
from airflow_provider_pgdecode.spark.merge_plan import SOURCE_PROPERTY as SOURCE_PROPERTY
from airflow_provider_pgdecode.spark.merge_plan import TXN_APP_ID_CONF as TXN_APP_ID_CONF
from airflow_provider_pgdecode.spark.merge_plan import TXN_VERSION_CONF as TXN_VERSION_CONF
from airflow_provider_pgdecode.spark.merge_plan import delta_table_path as delta_table_path
from airflow_provider_pgdecode.spark.merge_plan import plan_table as plan_table
from airflow_provider_pgdecode.spark.merge_plan import quote as quote
from airflow_provider_pgdecode.spark.merge_sql import SMALL_RUN_CONF as SMALL_RUN_CONF
from airflow_provider_pgdecode.spark.merge_sql import delta_ref as delta_ref
from airflow_provider_pgdecode.spark.merge_sql import ensure_table, merge_source, small_run_settings
from airflow_provider_pgdecode.spark.merge_sql import merge_condition as merge_condition
from airflow_provider_pgdecode.spark.merge_sql import table_fields as table_fields
from airflow_provider_pgdecode.spark.merge_sql import transaction_id as transaction_id
from airflow_provider_pgdecode.spark.profiling import (
    check_profile,
    profile_events,
    profile_from_parts,
    snapshot_chunks_of,
    staged_key_ranges,
)
from airflow_provider_pgdecode.spark.profiling import merge_ranges as merge_ranges
from airflow_provider_pgdecode.spark.session import active_connect_session, configure_object_store, is_connect_session
from airflow_provider_pgdecode.spark.side_tables import append_messages, append_quarantine
from airflow_provider_pgdecode.spark.snapshot_commit import TEMPLATE_DIR as TEMPLATE_DIR
from airflow_provider_pgdecode.spark.snapshot_commit import commit_snapshot, committable_snapshot, snapshot_template
from airflow_provider_pgdecode.spark.spark_types import DEFAULT_UNBOUNDED_NUMERIC
from airflow_provider_pgdecode.spark.staged_events import (
    check_staged_parts,
    staged_events,
    staged_part_error,
    uses_object_store,
)
from airflow_provider_pgdecode.spark.table_workers import (
    DRIVER_WRITERS,
    NO_SPARK,
    NeedsSpark,
    SessionsOnDemand,
    run_sharded,
    run_without_sessions,
)
from airflow_provider_pgdecode.spark.write_strategies import (
    append_inserts,
    append_only_write,
    history_write,
    last_commit,
    multiset_write,
    run_merge,
    soft_delete_write,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession


# An import ``name as name`` above re-exports a name of a sibling module that other modules, tests
# and docs import from the merge job.

log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


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
    with active_connect_session(spark):
        return _merge_batches(
            spark, batches, catch_up, [*batch_dirs, *options.catch_up], delta_root, options, started, staged_changes
        )


def _merge_batches(
    spark: SparkSession,
    batches: Sequence[BatchManifest],
    catch_up: Sequence[BatchManifest],
    batch_dirs: Sequence[str],
    delta_root: str,
    options: MergeOptions,
    started: float,
    staged_changes: int,
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
    largest_reads = check_staged_parts(plans)
    server = server_memory(spark) if options.memory_check and is_connect_session(spark) else None
    names = [plan.name for plan in plans]
    settings = functools.partial(small_run_settings, spark, staged_changes, options)
    with SessionsOnDemand(spark, options.table_workers, names, settings) as on_demand:
        # Tables whose snapshot parts are committed as staged: no read, no profile, no rewrite.
        templates: dict[int, dict[Any, tuple[dict[str, Any], dict[str, Any]] | None]] = {}

        def prepare(session: SparkSession, plan: TablePlan) -> _Prepared:
            started_at = time.monotonic()
            if not plan.segments:
                return _Prepared(plan)
            entry = committable_snapshot(plan, options) if not chunked else None
            if entry is not None:
                if session is NO_SPARK:
                    raise NeedsSpark("snapshot parts committed as staged")
                template = snapshot_template(session, plan, options, delta_root, templates.setdefault(id(session), {}))
                if template is not None:
                    return _Prepared(plan, direct=(entry, template), seconds=time.monotonic() - started_at)
            try:
                read = largest_reads.get(plan.name)
                if server is not None and read is not None and session is not NO_SPARK:
                    check_fits(plan.name, read, server)  # Spark reads its parts: they must fit the shared server
                table_events, table_profile, rows = _profiled(session, plan, options)
            except MergeInputError as error:  # a refusal of this table's changes: it waits, the others flow
                if not parks(error, options):
                    raise
                return _Prepared(plan, parked=parked_result(plan.path, plan.schema, plan.table, error))
            return _Prepared(plan, table_events, table_profile, time.monotonic() - started_at, rows=rows)

        def write(session: SparkSession, item: _Prepared) -> TableResult:
            return _write_prepared(session, item, every_batch, slot, chunked, options)

        def on_driver(_: Any, plan: TablePlan) -> _Prepared:
            """Prepare one table without a session, its source built from its parts; or raise
            :class:`NeedsSpark`."""
            try:
                item = prepare(NO_SPARK, plan)
            except NeedsSpark:
                raise
            except Exception as error:  # refused, damaged: decided in a session, as for any table
                raise NeedsSpark(f"{type(error).__name__}: {error}") from error
            if item.parked is None and item.rows is None:
                raise NeedsSpark("its MERGE source is computed by Spark")
            return item

        # Every table is prepared before any is written (bad input raises before anything is
        # written): first those the driver can take alone, in threads without a session (their
        # source built from the parts), then the others in their sessions. The driver's tables are
        # then written by delta-rs in threads, and the rest (with those that need Spark after all,
        # NeedsSpark) in their sessions.
        candidates = [plan for plan in plans if plan.segments and options.light_write_max_bytes > 0]
        workers = max(options.table_workers, DRIVER_WRITERS)
        prepared = [item for _, item in run_without_sessions(candidates, on_driver, workers)[0]]
        done = {item.plan.name for item in prepared}
        rest = [plan for plan in plans if plan.name not in done]
        prepared += run_sharded(rest, lambda plan: on_demand.session_of(plan.name), prepare)
        for item in prepared:
            if item.parked is not None:
                results[item.plan.name] = item.parked
        prepared = [item for item in prepared if item.parked is None]

        on_driver_items = [item for item in prepared if item.rows is not None and delta_log_storage(item.plan.path)]
        for item, result in run_without_sessions(on_driver_items, write, workers)[0]:
            results[item.plan.name] = result
        left = [item for item in prepared if item.plan.name not in results]
        for item, result in zip(
            left, run_sharded(left, lambda item: on_demand.session_of(item.plan.name), write), strict=True
        ):
            results[item.plan.name] = result
        if any(batch.quarantine or batch.messages for batch in batches):
            on_demand.set_up()  # the side tables are written by Spark
        quarantine = append_quarantine(spark, batches, delta_root)
        messages = append_messages(spark, batches, delta_root)

    if quarantine is not None:
        for name, count in quarantine["tables"].items():
            if name in results:
                results[name].quarantined = count
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


@dataclass
class _Prepared:
    """A table ready to be written: its changes and their profile, or its snapshot parts to commit
    as staged (``direct``), and the seconds spent on it so far."""

    plan: TablePlan
    events: DataFrame | None = None
    profile: Profile | None = None
    seconds: float = 0.0
    direct: tuple[TableSummary, tuple[dict[str, Any], dict[str, Any]]] | None = None
    parked: TableResult | None = None
    """Its changes refused and the table parked: nothing to write."""
    rows: pa.Table | None = None
    """Its MERGE source built on the driver (:mod:`.arrow_source`), its changes then not read."""


def _write_prepared(
    spark: SparkSession,
    item: _Prepared,
    every_batch: Sequence[BatchManifest],
    slot: str,
    chunked: bool,
    options: MergeOptions,
) -> TableResult:
    """Write one prepared table in ``spark`` (the session that prepared it); its result, parked
    when its Delta table cannot be read or written."""
    plan = item.plan
    table_started = time.monotonic() - item.seconds
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
    skipped_rows = sum(
        entry.rows
        for batch in every_batch
        for entry in batch.tables
        if entry.target == (plan.schema, plan.table) and batch.label in plan.skipped
    )
    try:
        if item.direct is not None:
            write_snapshot(spark, plan, result, item.direct, slot)
        else:
            write_table(spark, plan, item.events, item.profile, result, skipped_rows, slot, chunked, options, item.rows)
    except NeedsSpark as reason:  # tried without a session: nothing written yet, it is written in one
        log.info("table %s: written in a Spark session after all (%s)", plan.name, reason)
        raise
    except Exception as error:
        if spark is NO_SPARK:  # whether it is the table's problem to park is decided in a session
            log.info("table %s: written in a Spark session after all (%s: %s)", plan.name, type(error).__name__, error)
            raise NeedsSpark(str(error)) from error
        if not options.park or not table_parking.table_problem(spark, error, options.park_refused):
            raise
        return parked_result(plan.path, plan.schema, plan.table, error)
    result.seconds = round(time.monotonic() - table_started, 3)
    return result


def _profiled(
    spark: SparkSession, plan: TablePlan, options: MergeOptions
) -> tuple[DataFrame | None, Profile, pa.Table | None]:
    """The table's staged changes and their profile, checked (:func:`check_profile`): raises
    :class:`MergeInputError` for changes the merge refuses, :class:`BatchError` for a damaged part.
    For a light write whose source the driver builds (:mod:`.arrow_source`), that source instead
    of the changes: Spark reads them only if Delta's MERGE runs after all."""
    try:
        table_profile = profile_from_parts(plan)
        rows = arrow_source(plan, table_profile, options) if table_profile is not None else None
        table_events = staged_events(spark, plan) if rows is None else None
        if table_profile is None:
            assert table_events is not None
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
    return table_events, table_profile, rows


def parked_result(path: str, schema: str, table: str, error: BaseException) -> TableResult:
    """The result of a table this run parked: nothing of it written, the reason logged."""
    reason = table_parking.reason(error)
    if table_parking.refused(error):
        reason += table_parking.REFUSAL_HINT
    log.warning(
        "table %s.%s is parked: %s. Nothing of it was written; the other tables are merged. Its staged changes are "
        "kept and applied in order by the first merge after the cause is fixed%s",
        schema,
        table,
        reason,
        table_parking.REFUSAL_WAY_FORWARD if table_parking.refused(error) else "",
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
    rows: pa.Table | None = None,
) -> None:
    """Write one table's changes (or ``rows``, their MERGE source built on the driver) by its load
    mode (one Delta commit); fills ``result``."""
    staged_rows = sum(segment.staged.rows for segment in plan.segments)
    if profile is None or (events is None and rows is None):
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
            version_before, _ = last_commit(spark, plan.path)
        else:
            version_before = plan.state.version
        # Table snapshot chunks (capture/table_snapshot.py) are upserts: a key may come both as a
        # chunk row and as a logged INSERT, so those batches always MERGE.
        if rows is not None:  # the light write's source, built on the driver: Spark reads the changes for Delta only
            run_merge(
                spark,
                plan,
                lambda: merge_source(spark, staged_events(spark, plan), plan, profile),
                profile,
                slot,
                options,
                rows=rows,
            )
        else:
            assert events is not None
            if plan.append_only:
                append_only_write(spark, plan, events, profile, slot)
            elif plan.mode == HISTORY:
                history_write(spark, plan, events, profile, slot, options)
            elif plan.mode == SOFT_DELETE:
                soft_delete_write(spark, plan, events, profile, slot, options)
            elif result.created and profile.inserts_only and not chunked:
                append_inserts(spark, plan, events, profile, slot)
            elif plan.multiset and not snapshot_chunks_of(plan):
                counts = multiset_write(spark, plan, events, profile, slot)
            else:
                run_merge(spark, plan, merge_source(spark, events, plan, profile), profile, slot, options)
    except BaseException:
        if result.created:
            drop_created_table(spark, plan.path)
        raise
    version_after, metrics = last_commit(spark, plan.path)
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
# A failed first write, running out of memory
# --------------------------------------------------------------------------------------------


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
        "--light-write-max-bytes",
        type=int,
        default=DEFAULT_LIGHT_WRITE_MAX_BYTES,
        metavar="BYTES",
        help="runs into an existing merge table whose data files the run's key ranges meet hold at most BYTES "
        "(all its data files for a key other than one integer column) are committed by delta-rs, not Delta's "
        "MERGE, when the driver built their source or they hold fewer than --codegen-min-changes changes "
        f"(default {DEFAULT_LIGHT_WRITE_MAX_BYTES}; 0: always Delta's MERGE)",
    )
    parser.add_argument(
        "--no-park",
        action="store_true",
        help="a table whose Delta table cannot be read or written, or whose changes are refused, stops the run "
        "instead of being parked",
    )
    parser.add_argument(
        "--no-memory-check",
        action="store_true",
        help="through Spark Connect, send a table's staged changes even when they would not fit the server's "
        "memory (by default such a table is parked before they are sent)",
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
    parser.add_argument(
        "--table-workers",
        type=int,
        default=1,
        metavar="N",
        help="merge up to N tables side by side, each in a session of its own of this Spark application "
        "(default 1: one after another)",
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
        light_write_max_bytes=args.light_write_max_bytes,
        park=not args.no_park,
        park_refused=not args.no_park,  # the merge task keeps parked tables' places (batch/parking.py)
        parked=tuple(args.parked_table),
        catch_up=tuple(args.catch_up),
        memory_check=not args.no_memory_check,
        table_workers=args.table_workers,
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
