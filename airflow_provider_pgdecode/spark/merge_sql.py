"""The SQL the merge job sends to Delta: the table's DDL and the one MERGE per table.

The MERGE's source (the last state per key) and ON condition, the table's columns and
properties (``CREATE TABLE``, added and renamed columns, filled defaults), the Spark settings
held for one run (interpreted expressions, Delta's idempotent-write transaction id) and
:func:`execute_merge`, which runs a MERGE in the commit that records the watermark.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame
from pyspark.sql.types import StructField

from airflow_provider_pgdecode.spark import collapse, column_defaults, column_renames
from airflow_provider_pgdecode.spark.collapse import CollapseInput
from airflow_provider_pgdecode.spark.delta_state import app_id
from airflow_provider_pgdecode.spark.history import MODE_PROPERTY
from airflow_provider_pgdecode.spark.key_bounds import bound_sql, bounded_key
from airflow_provider_pgdecode.spark.merge_plan import (
    KEY_PROPERTY,
    SOURCE_PROPERTY,
    TXN_APP_ID_CONF,
    TXN_VERSION_CONF,
    MergeOptions,
    Profile,
    TablePlan,
    keeps_delta_values,
    metadata_fields,
    quote,
    sql_literal,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


# --------------------------------------------------------------------------------------------
# Building the MERGE
# --------------------------------------------------------------------------------------------


def merge_source(spark: SparkSession, events: DataFrame, plan: TablePlan, profile: Profile) -> DataFrame:
    """The last state per key (one row per key), with keep flags for unchanged-TOAST columns."""
    if profile.truncate_at is not None:
        events = events.where(collapse.after(*profile.truncate_at))
    spec = CollapseInput(key=plan.key, value_columns=plan.value_columns, keep_columns=profile.keep_columns)
    effects = collapse.effects_of(events, spec)
    if profile.superseded is not None and not profile.keep_columns and profile.truncate_at is None:
        return collapse.collapse_known(spark, effects, spec, profile.superseded)
    allow_keep = keeps_delta_values(plan, profile)
    if profile.keep_moves and profile.keep_columns:
        target = spark.read.format("delta").load(plan.path) if plan.state.exists and allow_keep else None
        return collapse.collapse_with_lineage(effects, spec, target, allow_keep=allow_keep)
    return collapse.collapse_simple(effects, spec, allow_keep=allow_keep)


def pruning_ranges(plan: TablePlan, profile: Profile, options: MergeOptions) -> list[tuple[Any, Any]] | None:
    """The key ranges the MERGE's ON condition holds so files outside them are skipped: a single
    key's, into an existing table, with no TRUNCATE (which deletes from every file)."""
    if options.key_range_pruning and profile.truncate_at is None and plan.state.exists and bounded_key(plan):
        return profile.key_ranges
    return None


def merge_condition(plan: TablePlan, ranges: Sequence[tuple[Any, Any]] | None) -> str:
    """The MERGE's ON condition: key equality, plus the batch's key ranges for file skipping
    (a single key's: :mod:`.key_bounds`)."""
    condition = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in plan.key)
    key = bounded_key(plan)
    if ranges and key is not None:
        delta_type = plan.types[key].delta_type
        alternatives = " OR ".join(
            f"(t.{quote(key)} BETWEEN {bound_sql(lo, delta_type)} AND {bound_sql(hi, delta_type)})" for lo, hi in ranges
        )
        condition = f"({alternatives}) AND {condition}"
    return condition


def delta_ref(path: str) -> str:
    """The SQL name of the Delta table at ``path`` (``delta.`<path>```)."""
    return f"delta.{quote(path)}"


def ddl_field(field_: StructField) -> str:
    comment = (field_.metadata or {}).get("comment")
    return (
        f"{quote(field_.name)} {field_.dataType.simpleString()}"
        + ("" if field_.nullable else " NOT NULL")
        + (f" COMMENT {sql_literal(comment)}" if comment else "")
    )


def table_fields(plan: TablePlan) -> list[StructField]:
    """A new table's columns: the source columns (comment ``PostgreSQL <catalog type>``, the key
    NOT NULL unless matched as a multiset), then the metadata columns of its mode
    (:func:`metadata_fields`)."""
    return [
        StructField(
            column,
            plan.types[column].delta_type,
            column not in plan.key or plan.multiset,
            {"comment": f"PostgreSQL {plan.types[column].catalog_type}"},
        )
        for column in plan.columns
    ] + list(metadata_fields(plan.mode))


def table_properties(plan: TablePlan, options: MergeOptions) -> dict[str, str]:
    """A new table's properties: the options' and the key, source and mode of pgdecode."""
    properties = dict(options.table_properties)
    properties[KEY_PROPERTY] = json.dumps(list(plan.key))
    properties[SOURCE_PROPERTY] = plan.name
    properties[MODE_PROPERTY] = plan.mode
    if plan.numbers:
        properties[column_renames.NUMBERS_PROPERTY] = column_renames.numbers_property(plan.numbers)
    return properties


def create_table_statement(plan: TablePlan, options: MergeOptions, path: str) -> str:
    """``CREATE TABLE IF NOT EXISTS delta.`path``` with the table's columns (comments, the key NOT
    NULL), the metadata columns and its properties: the one definition of a new table."""
    fields = table_fields(plan)
    properties = table_properties(plan, options)
    return (
        f"CREATE TABLE IF NOT EXISTS {delta_ref(path)} ({', '.join(ddl_field(f) for f in fields)}) "
        "USING delta TBLPROPERTIES ("
        + ", ".join(f"{sql_literal(name)} = {sql_literal(value)}" for name, value in properties.items())
        + ")"
    )


def ensure_table(spark: SparkSession, plan: TablePlan, options: MergeOptions) -> bool:
    """Create the Delta table, or add the source's new columns. Returns True when created.

    SQL only (``CREATE TABLE delta.`path```, ``ALTER TABLE``): the same statements run in a
    spark-submit session and over Spark Connect, where Delta's Python API needs a server plugin."""
    if not plan.state.exists:
        spark.sql(create_table_statement(plan, options, plan.path))
        log.info("table %s: created Delta table %s", plan.name, plan.path)
        return True
    rename_columns(spark, plan)
    # Columns added with a default: recorded before they are added, filled after (column_defaults).
    fill = column_defaults.pending_fill(plan.state.properties)
    added_with_default = {c: plan.missing[c] for c in plan.new_columns if c in plan.missing}
    if added_with_default:
        fill.update(added_with_default)
        recorded = sql_literal(json.dumps(fill, sort_keys=True))
        spark.sql(
            f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES "
            f"({sql_literal(column_defaults.FILL_PROPERTY)} = {recorded})"
        )
    if plan.new_columns:
        added = ", ".join(
            f"{quote(c)} {plan.types[c].delta_type.simpleString()} COMMENT {sql_literal('PostgreSQL ' + plan.types[c].catalog_type)}"
            for c in plan.new_columns
        )
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} ADD COLUMNS ({added})")
        log.info("table %s: added column(s) %s", plan.name, list(plan.new_columns))
    if fill:
        fill_missing(spark, plan, fill)
    if plan.widened:
        # Delta's type widening: a metadata-only change (files written with the old type are read
        # as the new one), behind a table feature that readers need Delta 4.0+ for (docs/merge.md).
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ('delta.enableTypeWidening' = 'true')")
        for column, before in plan.widened.items():
            after = plan.types[column].delta_type.simpleString()
            spark.sql(f"ALTER TABLE {delta_ref(plan.path)} ALTER COLUMN {quote(column)} TYPE {after}")
            log.info("table %s: widened column %s from %s to %s", plan.name, column, before.simpleString(), after)
    return False


def rename_columns(spark: SparkSession, plan: TablePlan) -> None:
    """Rename the Delta columns the source renamed (column mapping: metadata only, values kept),
    and record the column numbers that tell a rename (:mod:`.column_renames`)."""
    if plan.renamed and plan.state.properties.get("delta.columnMapping.mode", "none") == "none":
        # A table created without column mapping (not by pgdecode): a rename needs it.
        spark.sql(
            f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name', "
            "'delta.minReaderVersion' = '2', 'delta.minWriterVersion' = '5')"
        )
    for old, new in plan.renamed.items():
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} RENAME COLUMN {quote(old)} TO {quote(new)}")
        log.info("table %s: renamed column %s to %s, as the source did (its values kept)", plan.name, old, new)
    properties: dict[str, str] = {}
    if plan.numbers_changed:
        properties[column_renames.NUMBERS_PROPERTY] = column_renames.numbers_property(plan.numbers)
    recorded_key = plan.state.properties.get(KEY_PROPERTY)
    if recorded_key is not None and any(old in plan.renamed for old in json.loads(recorded_key)):
        properties[KEY_PROPERTY] = json.dumps(list(plan.key))  # the key's column renamed: the same key
    if properties:
        pairs = ", ".join(f"{sql_literal(name)} = {sql_literal(value)}" for name, value in properties.items())
        spark.sql(f"ALTER TABLE {delta_ref(plan.path)} SET TBLPROPERTIES ({pairs})")


def fill_missing(spark: SparkSession, plan: TablePlan, fill: Mapping[str, Any]) -> None:
    """Give the Delta rows written before columns added with a default that default, as PostgreSQL
    shows them (:mod:`.column_defaults`), then remove the record of the pending fill."""
    fields = {f.name: f.dataType for f in plan.state.schema.fields} if plan.state.schema is not None else {}
    assignments = {}
    for column, value in fill.items():
        data_type = plan.types[column].delta_type if column in plan.types else fields.get(column)
        if data_type is not None:
            assignments[quote(column)] = column_defaults.sql_value(value, data_type)
    if assignments:
        spark.sql(column_defaults.fill_statement(delta_ref(plan.path), assignments))
    spark.sql(
        f"ALTER TABLE {delta_ref(plan.path)} UNSET TBLPROPERTIES IF EXISTS ({sql_literal(column_defaults.FILL_PROPERTY)})"
    )
    log.info(
        "table %s: rows written before column(s) %s were added now hold their default, as in PostgreSQL",
        plan.name,
        sorted(fill),
    )


SMALL_RUN_CONF: Mapping[str, str] = {
    # Expressions interpreted instead of compiled to Java for every stage of every statement.
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    # A fixed plan: adaptive execution runs each shuffle stage as a Spark job of its own, about
    # half of a small MERGE's jobs (19 against 10 with deletion vectors), for no skew or size to adapt to.
    "spark.sql.adaptive.enabled": "false",
    # The MERGE reads its source twice instead of caching it first (one job fewer): the source is
    # staged Parquet, never rewritten once published, and its transformations are deterministic.
    "spark.databricks.delta.merge.materializeSource": "none",
}
"""Spark settings of a small run, where a statement's fixed costs outweigh its rows."""


@contextmanager
def small_run_settings(spark: SparkSession, staged_changes: int, options: MergeOptions) -> Iterator[None]:
    """:data:`SMALL_RUN_CONF` on ``spark``'s own session, for this run only, when the run holds
    fewer than ``options.codegen_min_changes`` staged changes. Spark generates and compiles Java for
    every stage of every statement (the wide MERGE's most of all): measured on a warm server, that
    is about half a small batch's merge time, which so few rows never earn back; and each
    adaptive stage is a job of its own, a fixed cost paid per table. Large runs keep code
    generation, adaptive execution and Delta's cached MERGE source, where they pay per row."""
    if staged_changes >= options.codegen_min_changes:
        yield
        return
    before = {key: spark.conf.get(key, None) for key in SMALL_RUN_CONF}
    for key, value in SMALL_RUN_CONF.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, previous in before.items():
            if previous is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, previous)


@contextmanager
def transaction_id(spark: SparkSession, slot: str, version: int) -> Iterator[None]:
    """Delta's idempotent-write transaction id (app id of ``slot``, ``version``) for the one Delta
    commit made inside the block, then unset.

    Set on ``spark``'s own session configuration (``spark.conf``): a session's settings are its own,
    in a spark-submit application and on a Spark Connect server alike, where every client session
    is a server session of its own, so two merges on one server never see each other's id.
    """
    spark.conf.set(TXN_APP_ID_CONF, app_id(slot))
    spark.conf.set(TXN_VERSION_CONF, str(version))
    try:
        yield
    finally:
        spark.conf.unset(TXN_APP_ID_CONF)
        spark.conf.unset(TXN_VERSION_CONF)


MATCHED = "MATCHED"
NOT_MATCHED = "NOT MATCHED"
NOT_MATCHED_BY_SOURCE = "NOT MATCHED BY SOURCE"


@dataclass(frozen=True)
class Clause:
    """One ``WHEN`` clause of a MERGE: ``WHEN <when> [AND <condition>] THEN <action>``, ``values``
    being the columns an UPDATE sets or an INSERT fills (quoted name -> expression over ``t``/``s``).

    One definition for both writers: :meth:`sql` for Delta's own MERGE, and the delta-rs builder
    calls of :mod:`.light_write`, whose expression parser reads the same backquoted names."""

    when: str
    action: str  # DELETE, UPDATE or INSERT
    condition: str | None = None
    values: Mapping[str, str] = field(default_factory=dict)

    def sql(self) -> str:
        head = f"WHEN {self.when}" + (f" AND {self.condition}" if self.condition else "") + " THEN "
        if self.action == "DELETE":
            return head + "DELETE"
        if self.action == "UPDATE":
            return head + "UPDATE SET " + ", ".join(f"t.{name} = {value}" for name, value in self.values.items())
        return head + f"INSERT ({', '.join(self.values)}) VALUES ({', '.join(self.values.values())})"


def delete(when: str, condition: str | None = None) -> Clause:
    return Clause(when, "DELETE", condition)


def update(when: str, condition: str | None, assignments: Mapping[str, str]) -> Clause:
    return Clause(when, "UPDATE", condition, dict(assignments))


def insert(condition: str | None, values: Mapping[str, str]) -> Clause:
    return Clause(NOT_MATCHED, "INSERT", condition, dict(values))


def execute_merge(
    spark: SparkSession,
    path: str,
    source: DataFrame,
    condition: str,
    clauses: Sequence[Clause],
    slot: str,
    version: int,
) -> None:
    """``MERGE INTO delta.`path` t USING <source> s ON condition <clauses>`` as one Delta commit
    holding the transaction id (:func:`transaction_id`). The source is a temporary view of this
    session only, dropped afterwards."""
    import uuid

    view = f"pgdecode_merge_source_{uuid.uuid4().hex}"
    source.createOrReplaceTempView(view)
    try:
        with transaction_id(spark, slot, version):
            spark.sql(
                f"MERGE INTO {delta_ref(path)} AS t USING {view} AS s ON {condition} "
                + " ".join(clause.sql() for clause in clauses)
            )
    finally:
        spark.catalog.dropTempView(view)
