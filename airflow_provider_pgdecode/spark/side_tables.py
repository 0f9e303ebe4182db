"""The side tables every source table's run appends to: the quarantine and the logical decoding
messages, each a Delta table of its own under the Delta root, each appended exactly once under the
slot's watermark as every merged table is."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from airflow_provider_pgdecode.batch import format as staged
from airflow_provider_pgdecode.batch.format import join_path
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import spark_uri
from airflow_provider_pgdecode.spark.delta_state import app_id, read_delta_state
from airflow_provider_pgdecode.spark.write_strategies import append_rows, last_commit

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


def quarantine_table_path(delta_root: str) -> str:
    """``<delta_root>/_pgdecode_quarantine``: the one quarantine Delta table of every source table."""
    return join_path(delta_root, staged.QUARANTINE_TABLE)


def messages_table_path(delta_root: str) -> str:
    """``<delta_root>/_pgdecode_messages``: the logical decoding messages of the source (its slot)."""
    return join_path(delta_root, staged.MESSAGES_TABLE)


def append_once(
    spark: SparkSession, path: str, parts: Sequence[tuple[BatchManifest, str]], slot_column: str
) -> tuple[str, int, int | None]:
    """Append staged parts (each with its batch) to the side table at ``path``, exactly once.

    The table keeps its own watermark under the slot's app id, as every merged table does: the
    parts of batches at or below it are already appended. Each row gets the slot's name in
    ``slot_column``. Returns ``(status, rows appended, Delta version)``.
    """
    slot = parts[0][0].slot
    state = read_delta_state(spark, path, app_id(slot))
    applied = state.watermark if state.watermark is not None else -1
    todo = [(batch, file) for batch, file in parts if int(batch.end) > applied]
    if not todo:
        return "already applied", 0, state.version
    files = [spark_uri(join_path(batch.directory, file)) for batch, file in todo]
    rows = spark.read.parquet(*files).withColumn(slot_column, F.lit(slot))
    append_rows(spark, path, rows, slot, max(int(batch.end) for batch, _ in todo))
    version, metrics = last_commit(spark, path)
    return "appended", metrics.get("inserted", 0), version


def append_quarantine(spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str) -> dict[str, Any] | None:
    """Append the batches' quarantine parts to the quarantine Delta table, exactly once
    (:func:`append_once`). Returns ``{"path", "status", "rows", "tables", "delta_version"}``
    (``tables``: quarantined changes per source table in these batches), or ``None`` when no batch
    has a quarantine part.
    """
    entries = [(batch, entry) for batch in batches for entry in batch.quarantine if entry.get("files")]
    if not entries:
        return None
    path = quarantine_table_path(delta_root)
    tables: dict[str, int] = {}
    for _, entry in entries:
        name = f"{entry['schema']}.{entry['table']}"
        tables[name] = tables.get(name, 0) + int(entry["rows"])
    for name, count in sorted(tables.items()):
        log.warning(
            "table %s: %d change(s) held a value the pipeline cannot carry and are quarantined in %s",
            name,
            count,
            path,
        )
    parts = [(batch, join_path(entry["path"], name)) for batch, entry in entries for name in entry["files"]]
    status, rows, version = append_once(spark, path, parts, staged.QUARANTINE_SLOT)
    return {"path": path, "status": status, "rows": rows, "tables": tables, "delta_version": version}


def append_messages(spark: SparkSession, batches: Sequence[BatchManifest], delta_root: str) -> dict[str, Any] | None:
    """Append the batches' logical decoding messages to the messages Delta table, exactly once
    (:func:`append_once`): the messages of committed transactions and the non-transactional
    ones, as the batches staged them. Returns ``{"path", "status", "rows", "staged",
    "delta_version"}`` (``staged``: the messages these batches hold), or ``None`` when they hold
    none.
    """
    entries = [batch for batch in batches if batch.messages and batch.messages.get("files")]
    if not entries:
        return None
    path = messages_table_path(delta_root)
    parts = [
        (batch, join_path(batch.messages["path"], name))
        for batch in entries
        if batch.messages is not None
        for name in batch.messages["files"]
    ]
    status, rows, version = append_once(spark, path, parts, staged.MESSAGES_SLOT)
    total = sum(int(batch.messages["rows"]) for batch in entries if batch.messages is not None)
    log.info("%d logical decoding message(s) in these batches: %s to %s", total, status, path)
    return {"path": path, "status": status, "rows": rows, "staged": total, "delta_version": version}
