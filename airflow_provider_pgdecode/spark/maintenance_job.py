"""The maintenance job: OPTIMIZE and VACUUM pgdecode's Delta tables, keeping every slot's watermark.

Run it with spark-submit (as the merge job, :mod:`.session` for Delta's jars)::

    spark-submit ... airflow_provider_pgdecode/spark/maintenance_job.py --delta-root /data/delta \\
        [--table public.orders ...] [--zorder] [--retention-hours 168] [--summary-json /tmp/summary.json]

or call :func:`maintain_tables` with a SparkSession (a Spark Connect client session too: the job
uses SQL statements and reads the Delta log through the batch format's storage layer, no JVM call).
Plain PySpark and delta-spark: no Airflow, no database driver. docs/maintenance.md explains the why.

Per table, in this order:

1. **Check** (before anything is written, for every table first): the table's
   ``delta.setTransactionRetentionDuration``, if set, is not shorter than ``min_txn_retention_hours``
   (Delta forgets a transaction id older than that, and with it the slot's watermark: a batch
   merged again would then be applied twice), and the VACUUM retention is not below Delta's safety
   check (the table's ``delta.deletedFileRetentionDuration``, 7 days by default) unless
   ``allow_short_retention``. Either refusal names the table and the way forward.
2. **OPTIMIZE** (``ZORDER BY`` the table's key with ``zorder``): bin-packs small files and rewrites
   files with many deleted rows, in one commit that keeps every ``txn`` action (a commit only adds
   actions; checkpoints carry every unexpired transaction id). With ``purge_deletion_vectors``,
   ``REORG TABLE ... APPLY (PURGE)`` then rewrites every file that still has a deletion vector.
3. **VACUUM** ``RETAIN n HOURS``: deletes files no version within the retention references.
4. **Verify** the slots' transaction ids (app id ``pgdecode:<slot>``) read from the log before and
   after: each one is still there, at the same version (or higher, when a merge committed
   meanwhile). A lost or lowered one fails the job loudly.

A Delta conflict with a concurrent merge (optimistic concurrency: both touched the same files) fails
one of the two commits, never both and never half: the loser's commit is not written. An OPTIMIZE
that loses is retried here (``optimize_attempts``); a merge that loses fails its task, which Airflow
retries, and the slot is not advanced before it succeeds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a file by spark-submit: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from airflow_provider_pgdecode.batch.format import is_local_path, join_path, local_path
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, is_object_store, spark_uri
from airflow_provider_pgdecode.errors import ConfigurationError, MaintenanceError, MaintenanceRefusedError
from airflow_provider_pgdecode.spark.delta_state import APP_ID_PREFIX, bucket_storage, replay_log, table_storage
from airflow_provider_pgdecode.spark.merge_job import (
    KEY_PROPERTY,
    SOURCE_PROPERTY,
    delta_ref,
    delta_table_path,
    quote,
    uses_object_store,
)
from airflow_provider_pgdecode.spark.session import active_connect_session, configure_object_store

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("airflow_provider_pgdecode.spark.maintenance")

TXN_RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"
DELETED_FILE_RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
DEFAULT_DELETED_FILE_RETENTION_HOURS = 7 * 24.0
"""Delta's default ``delta.deletedFileRetentionDuration`` (``interval 1 week``)."""
DEFAULT_MIN_TXN_RETENTION_HOURS = 30 * 24.0
"""The shortest ``delta.setTransactionRetentionDuration`` accepted: 30 days, four times the staged
batches' default retention (``[pgdecode] retention_days``, 7). Unset (Delta's default) never expires."""
RETENTION_CHECK_CONF = "spark.databricks.delta.retentionDurationCheck.enabled"
DEFAULT_OPTIMIZE_ATTEMPTS = 3
_UNIT_HOURS = {
    "week": 168.0,
    "day": 24.0,
    "hour": 1.0,
    "minute": 1 / 60,
    "second": 1 / 3600,
    "millisecond": 1 / 3_600_000,
    "microsecond": 1 / 3_600_000_000,
}


@dataclass(frozen=True)
class MaintenanceOptions:
    """What a maintenance run does; docs/maintenance.md has the defaults' reasons."""

    optimize: bool = True
    zorder: bool = False
    """OPTIMIZE ... ZORDER BY the table's key (rewrites every file of the table each run)."""
    purge_deletion_vectors: bool = False
    """After OPTIMIZE, ``REORG TABLE ... APPLY (PURGE)``: rewrite every file that has a deletion vector."""
    vacuum: bool = True
    retention_hours: float | None = None
    """VACUUM's retention; ``None``: the table's ``delta.deletedFileRetentionDuration`` (7 days by default)."""
    allow_short_retention: bool = False
    """Allow a retention below Delta's safety check (the table's deleted-file retention)."""
    min_txn_retention_hours: float = DEFAULT_MIN_TXN_RETENTION_HOURS
    optimize_attempts: int = DEFAULT_OPTIMIZE_ATTEMPTS
    """OPTIMIZE attempts per table when a concurrent commit (a merge) conflicts with it."""

    def __post_init__(self) -> None:
        if self.retention_hours is not None and self.retention_hours < 0:
            raise ConfigurationError(f"retention_hours must be 0 or more, not {self.retention_hours}")
        if self.optimize_attempts < 1:
            raise ConfigurationError(f"optimize_attempts must be 1 or more, not {self.optimize_attempts}")


@dataclass
class LogState:
    """What the maintenance reads from a table's Delta log (no Spark statement)."""

    version: int
    transactions: dict[str, int]
    """Every ``txn`` action's app id and its newest version."""
    properties: dict[str, str]


@dataclass
class TableRef:
    schema: str
    table: str
    path: str

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class TableMaintenance:
    """What happened to one table (the values of :func:`maintain_tables`' ``tables``)."""

    delta_path: str
    schema: str
    table: str
    source: str | None = None
    version_before: int = -1
    version_after: int = -1
    files_before: int = 0
    files_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    optimized: bool = False
    optimize_attempts: int = 0
    zorder_by: list[str] = field(default_factory=list)
    files_compacted: int = 0
    files_written: int = 0
    deletion_vectors_purged: bool = False
    vacuumed: bool = False
    retention_hours: float | None = None
    storage_files_before: int = 0
    storage_files_after: int = 0
    files_removed: int = 0
    transactions_before: dict[str, int] = field(default_factory=dict)
    transactions_after: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------
# Reading (no writes)
# --------------------------------------------------------------------------------------------


def parse_interval_hours(text: str) -> float:
    """Hours of a Delta interval property (``interval 7 days``, ``interval 1 week 2 hours``, ``30 days``)."""
    words = text.strip().lower().split()
    if words and words[0] == "interval":
        words = words[1:]
    if not words or len(words) % 2:
        raise ConfigurationError(f"cannot read the interval {text!r} (expected e.g. 'interval 7 days')")
    hours = 0.0
    for number, unit in zip(words[::2], words[1::2], strict=True):
        unit = unit.rstrip("s") if unit not in ("s", "ms") else unit
        if unit not in _UNIT_HOURS:
            raise ConfigurationError(f"cannot read the interval {text!r}: unit {unit!r} (weeks to microseconds)")
        try:
            hours += float(number) * _UNIT_HOURS[unit]
        except ValueError:
            raise ConfigurationError(f"cannot read the interval {text!r}: {number!r} is not a number") from None
    return hours


def read_log_state(spark: SparkSession, path: str) -> LogState:
    """Version, transaction ids (every app id) and properties of the Delta table at ``path``, from
    its log, as the merge job reads its watermark (:func:`~.delta_state.replay_log`)."""
    replay = replay_log(spark, path)
    if replay is None:
        raise MaintenanceError(
            f"no Delta table at {path} (no commit in its _delta_log): check the table's name (schema.table) and the "
            "Delta root, or give no tables to maintain every pgdecode table under the root"
        )
    return LogState(replay.version, dict(replay.transactions), replay.properties)


def slot_transactions(state: LogState) -> dict[str, int]:
    """The transaction ids pgdecode's merges wrote (app id ``pgdecode:<slot>``): the watermarks."""
    return {app: version for app, version in state.transactions.items() if app.startswith(APP_ID_PREFIX)}


def _root_storage(delta_root: str) -> Storage:
    if is_local_path(delta_root):
        return Storage(local_path(delta_root))
    if is_object_store(delta_root):
        bucket, _, key = delta_root.split("://", 1)[1].partition("/")
        store = bucket_storage(bucket, ObjectStoreSettings.from_env())
        return store.child(key.strip("/")) if key.strip("/") else store
    raise ConfigurationError(
        f"cannot list the Delta root {delta_root}: name its tables (--table schema.table) or use a local path or s3://"
    )


def discover_tables(spark: SparkSession, delta_root: str) -> list[TableRef]:
    """Every pgdecode table under ``delta_root``: a Delta table at ``<root>/<schema>/<table>`` whose
    properties name its source (``pgdecode.source``). Other directories are left alone."""
    root = _root_storage(delta_root)
    found: list[TableRef] = []
    if not root.exists():
        log.warning("the Delta root %s does not exist: no table to maintain", delta_root)
        return found
    for schema_dir, is_dir in sorted(root.list_dir()):
        if not is_dir or schema_dir.startswith(("_", ".")):
            continue
        for table_dir, table_is_dir in sorted(root.child(schema_dir).list_dir()):
            if not table_is_dir or not root.child(schema_dir, table_dir).exists("_delta_log"):
                continue
            path = join_path(spark_uri(delta_root), schema_dir, table_dir)
            try:
                state = read_log_state(spark, path)
            except MaintenanceError:
                continue
            source = state.properties.get(SOURCE_PROPERTY)
            if source:
                schema, _, table = source.partition(".")
                found.append(TableRef(schema, table, path))
    return found


def tables_of(spark: SparkSession, delta_root: str, names: Sequence[str] | None) -> list[TableRef]:
    """The tables ``names`` (``schema.table``) under ``delta_root``, or every pgdecode table there."""
    if not names:
        return discover_tables(spark, delta_root)
    refs = []
    for name in names:
        schema, dot, table = str(name).partition(".")
        if not dot or not schema or not table:
            raise ConfigurationError(f"table {name!r}: give it as schema.table")
        refs.append(TableRef(schema, table, delta_table_path(spark_uri(delta_root), schema, table)))
    return refs


def table_key(state: LogState) -> list[str]:
    """The table's key columns (the ``pgdecode.key`` property the merge job set); empty without one."""
    try:
        key = json.loads(state.properties.get(KEY_PROPERTY) or "[]")
    except ValueError:
        return []
    return [str(column) for column in key] if isinstance(key, list) else []


MAX_ZORDER_COLUMNS = 4
"""Z-ordering by more columns clusters by none of them well (and a keyless table's "key" is all its columns)."""


def zorder_columns(ref: TableRef, state: LogState) -> list[str]:
    """The columns to Z-order ``ref`` by: its key, when it has one of at most :data:`MAX_ZORDER_COLUMNS`."""
    key = table_key(state)
    if len(key) > MAX_ZORDER_COLUMNS:
        log.warning("table %s: key of %d columns, not Z-ordered (a plain OPTIMIZE instead)", ref.name, len(key))
        return []
    return key


def detail(spark: SparkSession, path: str) -> tuple[int, int]:
    """The table's live files and their bytes (``DESCRIBE DETAIL``: Delta's own count)."""
    row = spark.sql(f"DESCRIBE DETAIL {delta_ref(path)}").collect()[0]
    return int(row["numFiles"] or 0), int(row["sizeInBytes"] or 0)


def storage_files(path: str) -> int | None:
    """Files under the table's directory outside ``_delta_log`` (data and deletion-vector files), or
    ``None`` where the storage layer cannot list."""
    store = table_storage(path)
    if store is None:
        return None
    return sum(1 for name in store.walk_files() if not name.startswith("_delta_log/"))


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_transaction_retention(ref: TableRef, state: LogState, options: MaintenanceOptions) -> None:
    """Refuse a table whose ``delta.setTransactionRetentionDuration`` would expire a slot's watermark
    sooner than ``options.min_txn_retention_hours``."""
    value = state.properties.get(TXN_RETENTION_PROPERTY)
    if value is None:
        return
    hours = parse_interval_hours(value)
    if hours >= options.min_txn_retention_hours:
        return
    raise MaintenanceRefusedError(
        f"table {ref.name} ({ref.path}): {TXN_RETENTION_PROPERTY} = {value!r} makes Delta forget a transaction id "
        f"after {hours:g} hours, and with it the slot's watermark (app id {APP_ID_PREFIX}<slot>): a batch merged "
        f"again after that would be applied twice. pgdecode needs at least {options.min_txn_retention_hours:g} hours, "
        f"or the property unset (Delta's default: never expire). Nothing was optimized or vacuumed. To continue: "
        f"ALTER TABLE {delta_ref(ref.path)} UNSET TBLPROPERTIES ('{TXN_RETENTION_PROPERTY}'), or set it to at least "
        f"'interval {options.min_txn_retention_hours / 24:g} days'"
    )


def deleted_file_retention_hours(state: LogState) -> float:
    """The table's ``delta.deletedFileRetentionDuration`` in hours (Delta's VACUUM safety check)."""
    value = state.properties.get(DELETED_FILE_RETENTION_PROPERTY)
    return parse_interval_hours(value) if value else DEFAULT_DELETED_FILE_RETENTION_HOURS


def vacuum_retention(ref: TableRef, state: LogState, options: MaintenanceOptions) -> float:
    """VACUUM's retention in hours for this table; refuses one below Delta's safety check unless
    ``options.allow_short_retention``."""
    safe = deleted_file_retention_hours(state)
    hours = safe if options.retention_hours is None else float(options.retention_hours)
    if hours < safe and not options.allow_short_retention:
        raise MaintenanceRefusedError(
            f"table {ref.name} ({ref.path}): a VACUUM retention of {hours:g} hours is below Delta's safety check "
            f"({DELETED_FILE_RETENTION_PROPERTY}, {safe:g} hours for this table): it would delete files that a "
            f"reader or writer still working on an older version (a merge, a verify, a downstream job) needs. "
            f"Nothing was optimized or vacuumed. To continue: use a retention of at least {safe:g} hours, or opt in "
            "with allow_short_retention=True (--allow-short-retention) when no job reads versions that old"
        )
    return hours


# --------------------------------------------------------------------------------------------
# Writes
# --------------------------------------------------------------------------------------------


def is_concurrent_conflict(error: BaseException) -> bool:
    """A Delta optimistic-concurrency conflict (another commit touched the same files first)."""
    text = f"{type(error).__name__}: {error}"
    return "DELTA_CONCURRENT" in text or re.search(r"Concurrent\w*Exception", text) is not None


def optimize(spark: SparkSession, path: str, zorder_by: Sequence[str]) -> dict[str, Any]:
    """``OPTIMIZE`` (``ZORDER BY``) the table; Delta's metrics of the run."""
    statement = f"OPTIMIZE {delta_ref(path)}"
    if zorder_by:
        statement += f" ZORDER BY ({', '.join(quote(c) for c in zorder_by)})"
    rows = spark.sql(statement).collect()
    metrics = rows[0]["metrics"] if rows else None
    return metrics.asDict(recursive=True) if metrics is not None else {}


def optimize_with_retries(
    spark: SparkSession, ref: TableRef, zorder_by: Sequence[str], attempts: int
) -> tuple[dict[str, Any], int]:
    """:func:`optimize`, again (after a pause) when a concurrent commit won a conflict; the metrics and
    the attempts made."""
    for attempt in range(1, attempts + 1):
        try:
            return optimize(spark, ref.path, zorder_by), attempt
        except Exception as error:
            if not is_concurrent_conflict(error) or attempt == attempts:
                raise
            log.warning(
                "table %s: OPTIMIZE lost a conflict with a concurrent commit (attempt %d of %d), retrying: %s",
                ref.name,
                attempt,
                attempts,
                str(error).splitlines()[0][:300],
            )
            time.sleep(min(30.0, 2.0 * attempt))
    raise AssertionError("unreachable")


@contextmanager
def retention_check(spark: SparkSession, enabled: bool) -> Iterator[None]:
    """Delta's VACUUM retention check switched off on this session for the block (an explicit opt-in)."""
    if enabled:
        yield
        return
    before = spark.conf.get(RETENTION_CHECK_CONF, None)
    spark.conf.set(RETENTION_CHECK_CONF, "false")
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(RETENTION_CHECK_CONF)
        else:
            spark.conf.set(RETENTION_CHECK_CONF, before)


def vacuum(spark: SparkSession, path: str, hours: float, safe_hours: float) -> None:
    """``VACUUM ... RETAIN <hours> HOURS`` (Delta's check off only for an opted-in shorter retention)."""
    with retention_check(spark, enabled=hours >= safe_hours):
        spark.sql(f"VACUUM {delta_ref(path)} RETAIN {hours:g} HOURS").collect()


def check_transactions_kept(ref: TableRef, before: Mapping[str, int], after: Mapping[str, int]) -> None:
    """Every watermark read before the maintenance is still in the log, at the same version or
    higher (a merge committed meanwhile); else fail loudly."""
    lost = {app: version for app, version in before.items() if after.get(app, -1) < version}
    if lost:
        raise MaintenanceError(
            f"table {ref.name} ({ref.path}): the transaction id(s) {lost} are missing or lower after the maintenance "
            f"(now {dict(after)}). A batch merged again could be applied twice: pause the incremental DAG of the "
            "slot(s), check the table's delta.setTransactionRetentionDuration and its _delta_log, and report this"
        )


def maintain_table(spark: SparkSession, ref: TableRef, state: LogState, options: MaintenanceOptions) -> dict[str, Any]:
    started = time.monotonic()
    result = TableMaintenance(ref.path, ref.schema, ref.table, state.properties.get(SOURCE_PROPERTY))
    result.version_before = state.version
    result.transactions_before = slot_transactions(state)
    result.files_before, result.bytes_before = detail(spark, ref.path)
    safe = deleted_file_retention_hours(state)
    if options.optimize:
        zorder_by = zorder_columns(ref, state) if options.zorder else []
        metrics, result.optimize_attempts = optimize_with_retries(spark, ref, zorder_by, options.optimize_attempts)
        result.optimized = True
        result.zorder_by = list(zorder_by)
        result.files_compacted = int(metrics.get("numFilesRemoved") or 0)
        result.files_written = int(metrics.get("numFilesAdded") or 0)
        if options.purge_deletion_vectors:
            spark.sql(f"REORG TABLE {delta_ref(ref.path)} APPLY (PURGE)").collect()
            result.deletion_vectors_purged = True
    if options.vacuum:
        hours = vacuum_retention(ref, state, options)
        result.storage_files_before = storage_files(ref.path) or 0
        vacuum(spark, ref.path, hours, safe)
        result.storage_files_after = storage_files(ref.path) or 0
        result.files_removed = max(0, result.storage_files_before - result.storage_files_after)
        result.vacuumed = True
        result.retention_hours = hours
    after = read_log_state(spark, ref.path)
    result.version_after = after.version
    result.transactions_after = slot_transactions(after)
    result.files_after, result.bytes_after = detail(spark, ref.path)
    check_transactions_kept(ref, result.transactions_before, result.transactions_after)
    result.seconds = round(time.monotonic() - started, 3)
    return asdict(result)


def maintain_tables(
    spark: SparkSession,
    delta_root: str,
    tables: Sequence[str] | None = None,
    options: MaintenanceOptions | None = None,
) -> dict[str, Any]:
    """OPTIMIZE and VACUUM the pgdecode tables ``tables`` (``schema.table``; default every one under
    ``delta_root``). Every table is checked before the first write (:class:`MaintenanceRefusedError`
    names the first unsafe one). Returns ``{"delta_root", "tables": {"schema.table": {...}}}``."""
    options = options or MaintenanceOptions()
    started = time.monotonic()
    with active_connect_session(spark):
        if uses_object_store([], delta_root):
            configure_object_store(spark)
        refs = tables_of(spark, delta_root, tables)
        states = {}
        for ref in refs:
            state = read_log_state(spark, ref.path)
            check_transaction_retention(ref, state, options)
            if options.vacuum:
                vacuum_retention(ref, state, options)
            states[ref.name] = state
        results = {}
        for ref in refs:
            results[ref.name] = maintain_table(spark, ref, states[ref.name], options)
            log.info("%s", table_line(ref.name, results[ref.name]))
    return {"delta_root": spark_uri(delta_root), "tables": results, "seconds": round(time.monotonic() - started, 3)}


def table_line(name: str, entry: Mapping[str, Any]) -> str:
    """One log line for a table's maintenance (the operator logs the same)."""
    parts = [
        f"table {name}: {entry['files_before']} -> {entry['files_after']} files",
        f"{entry['bytes_before']} -> {entry['bytes_after']} bytes",
        f"Delta version {entry['version_before']} -> {entry['version_after']}",
    ]
    if entry.get("vacuumed"):
        parts.append(f"vacuum removed {entry['files_removed']} file(s) (retention {entry['retention_hours']:g} h)")
    parts.append(f"transaction ids kept {entry['transactions_after']}")
    return ", ".join(parts) + f", {entry['seconds']:.1f} s"


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

#: What the maintenance job refuses or reports as final (a retry meets the same table), as against a crash.
REFUSALS = (MaintenanceError, ConfigurationError)


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maintenance_job.py", description="OPTIMIZE and VACUUM pgdecode's Delta tables, keeping their watermarks."
    )
    parser.add_argument("--delta-root", required=True, help="root of the Delta tables (<root>/<schema>/<table>)")
    parser.add_argument("--table", action="append", default=[], help="schema.table; repeat (default: every one)")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false", help="skip OPTIMIZE")
    parser.add_argument("--zorder", action="store_true", help="OPTIMIZE ... ZORDER BY the table's key")
    parser.add_argument("--purge-deletion-vectors", action="store_true", help="REORG TABLE ... APPLY (PURGE) too")
    parser.add_argument("--no-vacuum", dest="vacuum", action="store_false", help="skip VACUUM")
    parser.add_argument("--retention-hours", type=float, default=None, help="VACUUM retention (default: the table's)")
    parser.add_argument("--allow-short-retention", action="store_true", help="allow a retention below Delta's check")
    parser.add_argument(
        "--min-txn-retention-hours",
        type=float,
        default=DEFAULT_MIN_TXN_RETENTION_HOURS,
        help="shortest delta.setTransactionRetentionDuration accepted",
    )
    parser.add_argument("--optimize-attempts", type=int, default=DEFAULT_OPTIMIZE_ATTEMPTS)
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit (default local[*])")
    parser.add_argument("--summary-json", default=None, help="also write the summary (or a refusal) to this file")
    parser.add_argument("--log-level", default="INFO")
    return parser


def options_from_args(args: argparse.Namespace) -> MaintenanceOptions:
    return MaintenanceOptions(
        optimize=args.optimize,
        zorder=args.zorder,
        purge_deletion_vectors=args.purge_deletion_vectors,
        vacuum=args.vacuum,
        retention_hours=args.retention_hours,
        allow_short_retention=args.allow_short_retention,
        min_txn_retention_hours=args.min_txn_retention_hours,
        optimize_attempts=args.optimize_attempts,
    )


def run_maintenance_job(
    spark: SparkSession, args: argparse.Namespace, summary_json: str | None = None
) -> tuple[int, dict[str, Any]]:
    """The job's core on a given session (spark-submit's :func:`main`, the operator's Connect path):
    ``(0, summary)``, or ``(2, refusal)`` for a refused table (also written to ``summary_json``)."""
    try:
        summary = maintain_tables(spark, args.delta_root, args.table or None, options_from_args(args))
    except REFUSALS as error:
        log.error("%s", error)
        refusal = {"error": type(error).__name__, "message": str(error)}
        if summary_json:
            with open(summary_json, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(refusal))
        return 2, refusal
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(summary, sort_keys=True))
    return 0, summary


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from airflow_provider_pgdecode.spark.session import build_spark_session

    spark = build_spark_session(
        args.master, app_name="pgdecode-maintenance", object_store=uses_object_store([], args.delta_root)
    )
    try:
        code, summary = run_maintenance_job(spark, args, args.summary_json)
    finally:
        spark.stop()
    if code:
        print(json.dumps(summary), file=sys.stderr)
        return code
    print("PGDECODE_MAINTENANCE_SUMMARY " + json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
