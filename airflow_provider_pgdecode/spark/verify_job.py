"""The verify job: compare Delta tables with a copy of their source as of one LSN, per key.

Run it with spark-submit (as the merge job, :mod:`.session` for Delta's jars)::

    spark-submit ... airflow_provider_pgdecode/spark/verify_job.py --slot pgdecode_shop \\
        --lsn 0/1A2B3C8 --snapshot /data/staging/pgdecode_shop/verify/<tmp slot>/0000000000000000-0000000001A2B3C8 \\
        --delta-root /data/delta --report-json /tmp/report.json

or call :func:`verify_tables` with a SparkSession. Plain PySpark and delta-spark: no Airflow.

The source side is a verify snapshot (:mod:`airflow_provider_pgdecode.capture.verify`): the
tables as of LSN X, staged in the batch format. The Delta side must be exactly at X: every
table's watermark (the end LSN of the last batch merged into it) at or below X, and the slot's
batches up to X merged; a table past X makes the job refuse (:class:`VerifyError`), since the two
sides would then be of different moments. Each table is read at one Delta version.

How a table is compared (multiset semantics: two identical rows are two rows):

1. Both sides get the Delta types the merge gives them: the staged copy goes through the merge
   job's own planning and conversion (:func:`~.merge_job.plan_table`, :func:`~.merge_job.staged_events`),
   so a value compares as what the merge would have written. The same Spark expressions then
   hash both sides, so representations agree by construction.
2. **Buckets.** Every row gets a bucket, a hash of its key modulo ``buckets``, and a row hash
   over all its columns (with a NULL flag per column, so ``(NULL, 'a')`` and ``('a', NULL)``
   differ). Per bucket: the row count and the sum of row hashes; summing keeps duplicates
   (a multiset fingerprint) and is independent of row order. One aggregate pass per side; the
   buckets' totals are the table's row counts.
3. **Keys.** Only when buckets differ: the rows of the differing buckets, grouped by key (count,
   hash sum) on both sides and joined, give the differing keys, in key order, the first
   ``max_keys`` of them listed with what differs (missing in Delta, not in PostgreSQL, a count,
   or the columns whose values differ). A table without a key (REPLICA IDENTITY FULL) is keyed
   on all its columns: a differing "key" is then a row and its count on each side.

The snapshot and the Delta root may be ``s3://`` locations, as for the merge job: the manifest is
read through the batch format, Spark reads through ``s3a://`` with the store's settings from the
``AWS_*`` environment on the session's Hadoop configuration (docs/object-storage.md).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import decimal
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a file by spark-submit: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from airflow_provider_pgdecode.batch.format import METADATA_PREFIX
from airflow_provider_pgdecode.batch.manifest import BatchManifest, TableSummary
from airflow_provider_pgdecode.batch.options import qualified_name
from airflow_provider_pgdecode.batch.storage import spark_uri
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError, MergeInputError, VerifyError
from airflow_provider_pgdecode.spark.collapse import OP, col
from airflow_provider_pgdecode.spark.delta_state import DeltaState, app_id, read_delta_state
from airflow_provider_pgdecode.spark.history import KEPT_MODES, MODE_PROPERTY, current_rows, recorded_mode
from airflow_provider_pgdecode.spark.merge_job import (
    KEY_PROPERTY,
    MergeOptions,
    delta_table_path,
    parse_type_map,
    plan_table,
    staged_events,
    uses_object_store,
)
from airflow_provider_pgdecode.spark.session import active_connect_session, configure_object_store
from airflow_provider_pgdecode.spark.spark_types import DEFAULT_UNBOUNDED_NUMERIC

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("airflow_provider_pgdecode.spark.verify")

DEFAULT_BUCKETS = 1024
DEFAULT_MAX_KEYS = 100
REPORT_FORMAT = "pgdecode.verify/1"
_KEY_SEED = "pgdecode.verify.key"
_ROW_SEED = "pgdecode.verify.row"
_BUCKET, _HASH, _ROWS, _SUM = "__bucket", "__hash", "__rows", "__hash_sum"


# --------------------------------------------------------------------------------------------
# Narrowing (pure Python)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """A multiset of rows in two numbers: how many, and the sum of their hashes."""

    rows: int = 0
    hash_sum: int = 0


def total(buckets: Mapping[int, Fingerprint]) -> Fingerprint:
    """The fingerprint of the union of ``buckets`` (sums of a multiset fingerprint add up)."""
    return Fingerprint(sum(f.rows for f in buckets.values()), sum(f.hash_sum for f in buckets.values()))


def differing_buckets(source: Mapping[int, Fingerprint], delta: Mapping[int, Fingerprint]) -> list[int]:
    """Buckets whose fingerprints differ, in order; a bucket absent on one side holds no row there."""
    empty = Fingerprint()
    return sorted(b for b in set(source) | set(delta) if source.get(b, empty) != delta.get(b, empty))


def describe_difference(source_rows: int, delta_rows: int, keyless: bool) -> str:
    """What differs for one key (or, without a key, one row) given its rows on each side."""
    if delta_rows == 0:
        return "missing in Delta"
    if source_rows == 0:
        return "not in PostgreSQL"
    if source_rows != delta_rows:
        return f"{source_rows} row(s) in PostgreSQL, {delta_rows} in Delta"
    return "rows differ" if not keyless else "values differ"


def same_value(a: Any, b: Any) -> bool:
    """Equality of two collected values, NaN equal to NaN (as in the row hash)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def differing_columns(source_row: Mapping[str, Any], delta_row: Mapping[str, Any], columns: Sequence[str]) -> list[str]:
    """The columns whose values differ between two rows of one key."""
    return [c for c in columns if not same_value(source_row.get(c), delta_row.get(c))]


def json_value(value: Any) -> Any:
    """A collected Spark value as JSON: numbers and strings as they are, the rest as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, Row):
        return {k: json_value(v) for k, v in value.asDict().items()}
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return base64.b64encode(value).decode() if isinstance(value, memoryview) else str(value)


def summarize(report: Mapping[str, Any]) -> dict[str, Any]:
    """The short form of a report (Asset event extra, log line): verdict, LSN, counts, differing tables."""
    tables = report.get("tables") or {}
    return {
        "slot": report.get("slot"),
        "lsn": report.get("lsn"),
        "equal": report.get("equal"),
        "tables_checked": len(tables),
        "differing_tables": {
            name: {
                "source_rows": t.get("source_rows"),
                "delta_rows": t.get("delta_rows"),
                "keys": t.get("differing_keys"),
            }
            for name, t in sorted(tables.items())
            if not t.get("equal")
        },
    }


# --------------------------------------------------------------------------------------------
# Spark side
# --------------------------------------------------------------------------------------------


def hashed(columns: Sequence[str], seed: str) -> Column:
    """xxhash64 over ``columns`` with a NULL flag after each (Spark's hash skips NULLs)."""
    args: list[Column] = [F.lit(seed)]
    for name in columns:
        args += [col(name), col(name).isNull()]
    return F.xxhash64(*args)


def with_hashes(frame: DataFrame, key: Sequence[str], columns: Sequence[str], buckets: int) -> DataFrame:
    """``frame`` plus its bucket (key hash mod ``buckets``) and row hash (as decimal, to sum exactly)."""
    return frame.select(
        *[col(c) for c in columns],
        F.pmod(hashed(key, _KEY_SEED), F.lit(buckets)).alias(_BUCKET),
        hashed(columns, _ROW_SEED).cast("decimal(38,0)").alias(_HASH),
    )


def bucket_fingerprints(hashed_frame: DataFrame) -> dict[int, Fingerprint]:
    """Per bucket: rows and hash sum (one aggregate pass; at most ``buckets`` rows collected)."""
    rows = hashed_frame.groupBy(_BUCKET).agg(F.count(F.lit(1)).alias(_ROWS), F.sum(_HASH).alias(_SUM)).collect()
    return {int(r[_BUCKET]): Fingerprint(int(r[_ROWS]), int(r[_SUM])) for r in rows}


def _per_key(hashed_frame: DataFrame, key: Sequence[str], buckets: Sequence[int], side: str) -> DataFrame:
    grouped = (
        hashed_frame.where(F.col(_BUCKET).isin(*buckets))
        .groupBy(*[col(k) for k in key])
        .agg(F.count(F.lit(1)).alias(_ROWS), F.sum(_HASH).alias(_SUM))
    )
    return grouped.select(
        *[col(k).alias(f"__{side}{i}") for i, k in enumerate(key)],
        F.col(_ROWS).alias(f"__{side}_rows"),
        F.col(_SUM).alias(f"__{side}_sum"),
    )


def differing_keys(
    source: DataFrame, delta: DataFrame, key: Sequence[str], buckets: Sequence[int], max_keys: int
) -> tuple[int, list[tuple[dict[str, Any], int, int]]]:
    """Keys of ``buckets`` whose rows differ: their number, and the first ``max_keys`` in key order
    as ``(key values, rows in PostgreSQL, rows in Delta)``. Keys compare NULL-safely."""
    s, d = _per_key(source, key, buckets, "s"), _per_key(delta, key, buckets, "d")
    condition = F.lit(True)
    for i in range(len(key)):
        condition = condition & F.col(f"__s{i}").eqNullSafe(F.col(f"__d{i}"))
    source_rows = F.coalesce(F.col("__s_rows"), F.lit(0))
    delta_rows = F.coalesce(F.col("__d_rows"), F.lit(0))
    in_source = F.col("__s_rows").isNotNull()
    joined = (
        s.join(d, condition, "full_outer")
        .where(~(source_rows == delta_rows) | ~F.col("__s_sum").eqNullSafe(F.col("__d_sum")))
        .select(
            *[F.when(in_source, F.col(f"__s{i}")).otherwise(F.col(f"__d{i}")).alias(k) for i, k in enumerate(key)],
            source_rows.alias("__source_rows"),
            delta_rows.alias("__delta_rows"),
        )
        .persist()
    )
    try:
        count = joined.count()
        first = joined.orderBy(*[col(k).asc_nulls_first() for k in key]).limit(max_keys).collect() if count else []
    finally:
        joined.unpersist()
    return count, [({k: row[k] for k in key}, int(row["__source_rows"]), int(row["__delta_rows"])) for row in first]


def _rows_of_keys(
    spark: SparkSession, frame: DataFrame, key: Sequence[str], keys: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The rows of ``frame`` with one of ``keys`` (a bounded list), by the JSON text of their key."""
    schema = StructType([frame.schema[k] for k in key])
    wanted = spark.createDataFrame([tuple(k[c] for c in key) for k in keys], schema)
    wanted = wanted.select(*[col(k).alias(f"__w{i}") for i, k in enumerate(key)])
    condition = F.lit(True)
    for i, k in enumerate(key):
        condition = condition & col(k).eqNullSafe(F.col(f"__w{i}"))
    found = frame.join(wanted, condition, "left_semi").collect()
    return {key_text({k: row[k] for k in key}): row.asDict() for row in found}


def key_text(key: Mapping[str, Any]) -> str:
    return json.dumps({k: json_value(v) for k, v in key.items()}, sort_keys=True)


@dataclass
class _Side:
    """One table as compared: its key, its columns and both sides as DataFrames."""

    key: tuple[str, ...]
    columns: tuple[str, ...]
    source: DataFrame
    delta: DataFrame | None


def _plan_source(
    spark: SparkSession,
    manifest: BatchManifest,
    entry: TableSummary,
    delta_root: str,
    state: DeltaState,
    options: MergeOptions,
) -> _Side:
    """The staged copy typed as the merge types it, through the merge job's own planning."""
    key = list(entry.key) or [c.name for c in entry.columns]  # no key: all columns (a multiset)
    # The copy is compared, not merged: plan as if the table held nothing yet (no watermark
    # filters the copy's rows out), whatever key and mode the merge recorded (a changed key
    # differs), and as a table of current rows (its Delta side is read as one: current_rows).
    entry = replace(entry, key=key, mode="merge" if entry.mode in KEPT_MODES else entry.mode)
    properties = {k: v for k, v in state.properties.items() if k not in (KEY_PROPERTY, MODE_PROPERTY)}
    plan = plan_table(
        entry.schema,
        entry.table,
        [replace(manifest, tables=[entry])],
        delta_root,
        replace(state, watermark=None, properties=properties),
        options,
    )
    source = staged_events(spark, plan).where(col(OP) == "I").select(*[col(c) for c in plan.columns])
    delta = None
    if state.exists:
        frame = spark.read.format("delta").option("versionAsOf", state.version).load(plan.path)
        frame = current_rows(frame, recorded_mode(state.properties))
        present = set(frame.columns)
        # A column added in the source after Delta's last write is NULL there.
        delta = frame.select(
            *[(col(c) if c in present else F.lit(None).cast(plan.types[c].delta_type)).alias(c) for c in plan.columns]
        )
    return _Side(plan.key, plan.columns, source, delta)


def _delta_only(spark: SparkSession, path: str, state: DeltaState) -> _Side:
    """A table with no row at X: its Delta table against an empty source of the same columns."""
    assert state.schema is not None
    columns = tuple(f.name for f in state.schema.fields if not f.name.startswith(METADATA_PREFIX))
    recorded = state.properties.get(KEY_PROPERTY)
    key = tuple(json.loads(recorded)) if recorded else ()
    frame = spark.read.format("delta").option("versionAsOf", state.version).load(path)
    delta = current_rows(frame, recorded_mode(state.properties)).select(*map(col, columns))
    source = spark.createDataFrame([], StructType([state.schema[c] for c in columns]))
    return _Side(key or columns, columns, source, delta)


def compare_table(spark: SparkSession, side: _Side, buckets: int, max_keys: int) -> dict[str, Any]:
    """Counts, differing buckets and the first differing keys of one table."""
    key, columns = side.key, side.columns
    keyless = set(key) == set(columns)
    source = with_hashes(side.source, key, columns, buckets)
    delta = with_hashes(side.delta if side.delta is not None else side.source.limit(0), key, columns, buckets)
    source_buckets, delta_buckets = bucket_fingerprints(source), bucket_fingerprints(delta)
    differing = differing_buckets(source_buckets, delta_buckets)
    result: dict[str, Any] = {
        "key": list(key),
        "keyless": keyless,
        "source_rows": total(source_buckets).rows,
        "delta_rows": total(delta_buckets).rows,
        "buckets": buckets,
        "differing_buckets": len(differing),
        "differing_keys": 0,
        "keys": [],
        "equal": not differing,
    }
    if not differing:
        return result
    count, first = differing_keys(source, delta, key, differing, max_keys)
    result["differing_keys"] = count
    source_rows: dict[str, dict[str, Any]] = {}
    delta_rows: dict[str, dict[str, Any]] = {}
    if not keyless:  # name the columns that differ for keys present on both sides
        both = [k for k, s, d in first if s and d]
        if both:
            source_rows = _rows_of_keys(spark, side.source, key, both)
            delta_rows = _rows_of_keys(spark, side.delta if side.delta is not None else side.source, key, both)
    for values, in_source, in_delta in first:
        entry: dict[str, Any] = {
            "key": {k: json_value(v) for k, v in values.items()},
            "source_rows": in_source,
            "delta_rows": in_delta,
            "difference": describe_difference(in_source, in_delta, keyless),
        }
        text = key_text(values)
        if text in source_rows and text in delta_rows:
            entry["columns"] = differing_columns(source_rows[text], delta_rows[text], columns)
        result["keys"].append(entry)
    return result


def check_positions(states: Mapping[str, DeltaState], lsn: Lsn, slot: str) -> None:
    """:class:`VerifyError` when a Delta table holds changes past ``lsn``: the sides would be of different moments."""
    ahead = {name: Lsn(s.watermark) for name, s in states.items() if s.watermark is not None and s.watermark > lsn}
    if ahead:
        listed = ", ".join(f"{name} (through {mark})" for name, mark in sorted(ahead.items()))
        raise VerifyError(
            f"Delta tables of slot {slot!r} hold changes past the verify LSN {lsn}: {listed}. Another run merged "
            "later changes while this verify was copying, so Delta can no longer be compared as of that LSN. "
            "Run the verify again (pausing the pgdecode_incremental DAG of this slot while it runs avoids this)"
        )


def verify_tables(
    spark: SparkSession,
    snapshot_dir: str,
    delta_root: str,
    slot: str,
    lsn: Lsn | str,
    tables: Sequence[str] | None = None,
    *,
    options: MergeOptions | None = None,
    buckets: int = DEFAULT_BUCKETS,
    max_keys: int = DEFAULT_MAX_KEYS,
) -> dict[str, Any]:
    """Compare every table of a verify snapshot with its Delta table; the report (see module docstring).

    :param snapshot_dir: the staged copy as of ``lsn`` (a snapshot batch).
    :param slot: the pipeline's slot: its watermarks in Delta must be at or below ``lsn``.
    :param tables: ``schema.table`` names copied (a table without rows has no entry in the
        snapshot's manifest); default the manifest's tables.
    :param options: the merge's options (type overrides, unbounded numeric), so that the copy is
        typed as the merge typed Delta.
    :raises VerifyError: a Delta table is past ``lsn``.
    """
    lsn = Lsn.coerce(lsn)
    options = options or MergeOptions()
    if buckets < 1 or max_keys < 0:
        raise VerifyError(f"buckets must be at least 1 and max_keys at least 0, not {buckets} and {max_keys}")
    # pyspark.sql.functions build Connect columns only in Connect mode (as in merge_batches).
    with active_connect_session(spark):
        return _verify_tables(spark, snapshot_dir, delta_root, slot, lsn, tables, options, buckets, max_keys)


def _verify_tables(
    spark: SparkSession,
    snapshot_dir: str,
    delta_root: str,
    slot: str,
    lsn: Lsn,
    tables: Sequence[str] | None,
    options: MergeOptions,
    buckets: int,
    max_keys: int,
) -> dict[str, Any]:
    if uses_object_store([snapshot_dir], delta_root):
        configure_object_store(spark)
    manifest = BatchManifest.read(snapshot_dir)
    entries = {(t.schema, t.table): t for t in manifest.tables}
    names = sorted({qualified_name(t) for t in tables}) if tables else sorted(entries)
    missing = [f"{s}.{t}" for s, t in entries if (s, t) not in names]
    if missing:
        raise VerifyError(f"the verify snapshot {snapshot_dir} holds tables not asked for: {', '.join(missing)}")
    paths = {f"{s}.{t}": delta_table_path(spark_uri(delta_root), s, t) for s, t in names}
    states = {name: read_delta_state(spark, path, app_id(slot)) for name, path in paths.items()}
    check_positions(states, lsn, slot)
    results: dict[str, dict[str, Any]] = {}
    for schema, table in names:
        name = f"{schema}.{table}"
        state = states[name]
        base: dict[str, Any] = {
            "delta_path": paths[name],
            "delta_exists": state.exists,
            "delta_version": state.version,
            "watermark_lsn": str(Lsn(state.watermark)) if state.watermark is not None else None,
        }
        try:
            entry = entries.get((schema, table))
            if entry is not None:
                side = _plan_source(spark, manifest, entry, spark_uri(delta_root), state, options)
            elif state.exists:
                side = _delta_only(spark, paths[name], state)
            else:  # no row in PostgreSQL and no Delta table: nothing to hold
                results[name] = {**base, "equal": True, "source_rows": 0, "delta_rows": 0, "keys": []}
                continue
            results[name] = {**base, **compare_table(spark, side, buckets, max_keys)}
        except MergeInputError as error:  # e.g. a type Delta cannot hold as the source has it
            results[name] = {**base, "equal": False, "error": str(error), "keys": []}
        outcome = results[name]
        log.info(
            "table %s: %s (PostgreSQL %s rows, Delta %s rows, %s differing key(s))",
            name,
            "equal" if outcome["equal"] else "DIFFERS",
            outcome.get("source_rows"),
            outcome.get("delta_rows"),
            outcome.get("differing_keys", 0),
        )
    return {
        "format": REPORT_FORMAT,
        "slot": slot,
        "lsn": str(lsn),
        "snapshot": snapshot_dir,
        "delta_root": delta_root,
        "equal": all(r["equal"] for r in results.values()),
        "differing_tables": sorted(n for n, r in results.items() if not r["equal"]),
        "tables": results,
    }


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verify_job.py", description="Compare pgdecode's Delta tables with their source as of one LSN."
    )
    parser.add_argument("--snapshot", required=True, help="the verify snapshot (staged copy as of --lsn)")
    parser.add_argument("--delta-root", required=True, help="root of the Delta tables (<root>/<schema>/<table>)")
    parser.add_argument("--slot", required=True, help="the pipeline's replication slot")
    parser.add_argument("--lsn", required=True, help="the LSN the snapshot is as of (X/Y)")
    parser.add_argument("--table", action="append", default=[], help="schema.table copied; repeat (default: all)")
    parser.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS, help="hash buckets per table")
    parser.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS, help="differing keys listed per table")
    parser.add_argument("--unbounded-numeric", default=DEFAULT_UNBOUNDED_NUMERIC, help="as the merge job's")
    parser.add_argument(
        "--type-map", action="append", default=[], metavar="CATALOG_TYPE=string", help="as the merge job's"
    )
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit (default local[*])")
    parser.add_argument("--report-json", default=None, help="also write the report to this file")
    parser.add_argument("--log-level", default="INFO")
    return parser


#: What the verify job refuses (final for its copy: a retry compares the same input), as against a crash.
REFUSALS = (BatchError, MergeInputError, VerifyError)


def verify_from_args(spark: SparkSession, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`verify_tables` with the job's parsed arguments (spark-submit's ``main`` and the
    verify operator's Spark Connect path share it)."""
    options = MergeOptions(unbounded_numeric=args.unbounded_numeric, type_overrides=parse_type_map(args.type_map))
    return verify_tables(
        spark,
        args.snapshot,
        args.delta_root,
        args.slot,
        args.lsn,
        args.table or None,
        options=options,
        buckets=args.buckets,
        max_keys=args.max_keys,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from airflow_provider_pgdecode.spark.session import build_spark_session

    spark = build_spark_session(
        args.master, app_name="pgdecode-verify", object_store=uses_object_store([args.snapshot], args.delta_root)
    )
    try:
        report = verify_from_args(spark, args)
    except REFUSALS as error:
        log.error("%s", error)
        refusal = json.dumps({"error": type(error).__name__, "message": str(error)})
        print(refusal, file=sys.stderr)
        if args.report_json:  # lets the caller tell a refusal (final) from a crash (worth a retry)
            with open(args.report_json, "w", encoding="utf-8") as handle:
                handle.write(refusal)
        return 2
    finally:
        spark.stop()
    text = json.dumps(report, sort_keys=True)
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as handle:
            handle.write(text)
    print("PGDECODE_VERIFY_REPORT " + json.dumps(summarize(report), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
