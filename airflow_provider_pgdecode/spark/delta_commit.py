"""An initial load committed into a new Delta table's log as it was staged: no rewrite.

A snapshot batch (``capture/snapshot.py``) stages each table's rows in Parquet parts whose columns
already have the types Delta keeps, the TRUNCATE row in a part of its own. When the merge creates
the Delta table for such a batch, reading those parts and writing them again only converts what is
already converted. Instead the merge job (:func:`~airflow_provider_pgdecode.spark.merge_job.merge_batches`)
copies the parts into the table's directory (a hard link on one local filesystem) and writes the
table's first commit itself, version 0, holding:

* the ``protocol`` Delta itself wrote for ``CREATE TABLE`` with the run's table properties, run
  on a throwaway *template* location (so table features and the properties Delta settles on are
  Delta's own; the merge job keeps that first commit for later runs), and a ``metaData`` action of
  the table's columns as ``CREATE TABLE`` would declare them (:func:`table_metadata`), each
  column's ``delta.columnMapping.physicalName`` being its name, the name the staged part uses
  (Delta reads column-mapped files by physical name, any name);
* an ``add`` action per part with statistics from its Parquet footer (:func:`file_stats`);
* the ``txn`` action (app id of the slot, version = the batch's end LSN) that every pgdecode
  commit carries;
* a ``commitInfo`` action of a blind append (``WRITE``), with the counts the merge summary reads.

The commit file is created only if absent (a hard link of a finished temporary file on a local
disk; a look-up then one PUT on object storage, where Delta's own S3 log store is single-writer
too), so the table appears whole, with its rows and its watermark at once, or not at all: parts
copied into the directory before a crash are not in any log and are overwritten by the next run.

Plain Python and pyarrow: no Spark (the template is created by the caller), no Airflow, no database.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ENGINE_INFO = "pgdecode (snapshot commit)"
FIRST_COMMIT = f"{0:020d}.json"
#: Table features the first commit may carry: none of them asks anything of an appended file
#: beyond what :func:`commit_lines` writes. Another feature (row tracking, clustering, in-commit
#: timestamps, ...) makes the merge append through Spark instead.
READER_FEATURES = frozenset({"columnMapping", "deletionVectors", "timestampNtz", "typeWidening", "v2Checkpoint"})
WRITER_FEATURES = READER_FEATURES | frozenset(
    {"appendOnly", "invariants", "checkConstraints", "changeDataFeed", "vacuumProtocolCheck"}
)
_REFUSED_SETTINGS = ("delta.enableInCommitTimestamps", "delta.enableRowTracking")
#: Columns with statistics: Delta's default (``delta.dataSkippingNumIndexedCols``).
DEFAULT_INDEXED_COLUMNS = 32
#: Delta keeps string statistics of at most this many characters; longer ones are left out here.
STRING_STATS_LENGTH = 32


class TemplateRefused(Exception):
    """The template table uses something a hand-written first commit would get wrong."""


def template_actions(log_text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``protocol`` and ``metaData`` of a template table's first commit (``CREATE TABLE``), or
    :class:`TemplateRefused` naming what a hand-written commit cannot carry."""
    protocol: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    for line in log_text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "protocol" in action:
            protocol = action["protocol"]
        elif "metaData" in action:
            metadata = action["metaData"]
        elif "commitInfo" not in action:
            raise TemplateRefused(f"the created table's first commit holds a {next(iter(action))!r} action")
    if protocol is None or metadata is None:
        raise TemplateRefused("the created table's first commit has no protocol or metaData")
    readers = set(protocol.get("readerFeatures") or ())
    writers = set(protocol.get("writerFeatures") or ())
    if readers - READER_FEATURES or writers - WRITER_FEATURES:
        raise TemplateRefused(f"table features {sorted((readers - READER_FEATURES) | (writers - WRITER_FEATURES))}")
    configuration = metadata.get("configuration") or {}
    for name in _REFUSED_SETTINGS:
        if str(configuration.get(name, "false")).lower() == "true":
            raise TemplateRefused(f"table property {name}")
    if metadata.get("partitionColumns"):
        raise TemplateRefused("partition columns")
    return protocol, metadata


_INVALID_NAME_CHARACTERS = set(" ,;{}()\n\t=")


def table_metadata(
    template: Mapping[str, Any], fields: Sequence[Mapping[str, Any]], properties: Mapping[str, str]
) -> dict[str, Any]:
    """The new table's ``metaData``: ``fields`` (Spark's JSON of each column: name, type,
    nullability, comment) with column mapping as Delta assigns it on ``CREATE TABLE`` (ids 1, 2,
    ... in column order, ``maxColumnId``), except that each physical name is the column's name,
    the name the staged part uses (Delta reads column-mapped files by physical name, any name);
    ``properties`` as given; format and the rest as in the ``template``'s metaData."""
    configuration = {k: v for k, v in (template.get("configuration") or {}).items() if not k.startswith("pgdecode.")}
    configuration.update(properties)
    mode = configuration.get("delta.columnMapping.mode", "none")
    schema_fields = []
    for index, field in enumerate(fields, 1):
        field = json.loads(json.dumps(field))  # a copy
        metadata = field.setdefault("metadata", {})
        if mode == "name":
            metadata["delta.columnMapping.id"] = index
            metadata["delta.columnMapping.physicalName"] = field["name"]
        elif mode == "none":
            if _INVALID_NAME_CHARACTERS & set(field["name"]):
                raise TemplateRefused(f"column {field['name']!r} needs column mapping")
        else:  # "id": files are read by Parquet field id, which the staged parts do not carry
            raise TemplateRefused(f"column mapping mode {mode!r}")
        schema_fields.append(field)
    if mode == "name":
        configuration["delta.columnMapping.maxColumnId"] = str(len(schema_fields))
    return {
        "id": str(uuid.uuid4()),
        "format": template.get("format") or {"provider": "parquet", "options": {}},
        "schemaString": json.dumps({"type": "struct", "fields": schema_fields}, separators=(",", ":")),
        "partitionColumns": [],
        "configuration": configuration,
        "createdTime": int(time.time() * 1000),
    }


def _stat_value(value: Any, arrow_type: pa.DataType) -> Any:
    """A Parquet statistic as Delta writes it in ``stats`` JSON, or ``None`` to leave it out."""
    if pa.types.is_integer(arrow_type):
        return int(value)
    if pa.types.is_date32(arrow_type):
        return value.isoformat()
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        return text if len(text) <= STRING_STATS_LENGTH else None
    # Timestamps (Delta truncates them to milliseconds and reads them back with that in mind),
    # decimals, floats, booleans and binary: left out, so data skipping treats them as unknown.
    return None


def file_stats(metadata: pq.FileMetaData, columns: Sequence[str], record_count: int | None = None) -> dict[str, Any]:
    """Delta's ``stats`` of one Parquet file from its footer: ``numRecords``, and for each of
    ``columns`` (the table's first indexed columns, by name = physical name) its ``nullCount`` and,
    for integer, date and short string columns, ``minValues``/``maxValues``. A column whose row
    groups lack statistics is left out (unknown to data skipping, never wrongly skipped)."""
    schema = metadata.schema.to_arrow_schema()
    rows = metadata.num_rows if record_count is None else record_count
    index = {metadata.schema.column(i).path: i for i in range(metadata.num_columns)}
    minimum: dict[str, Any] = {}
    maximum: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in columns:
        position = index.get(name)  # a top-level primitive column: its path is its name
        if position is None or schema.get_field_index(name) < 0:
            continue
        arrow_type = schema.field(name).type
        if pa.types.is_nested(arrow_type):
            continue
        null_count = 0
        low: Any = None
        high: Any = None
        bounded = True
        for group in range(metadata.num_row_groups):
            chunk = metadata.row_group(group).column(position)
            stats = chunk.statistics
            if stats is None or not stats.has_null_count:
                null_count = -1
                break
            null_count += stats.null_count
            if stats.null_count == chunk.num_values:
                continue  # all null in this row group
            if not stats.has_min_max:
                bounded = False
                continue
            low = stats.min if low is None or stats.min < low else low
            high = stats.max if high is None or stats.max > high else high
        if null_count < 0:
            continue
        nulls[name] = null_count
        if bounded and low is not None and high is not None:
            low_value, high_value = _stat_value(low, arrow_type), _stat_value(high, arrow_type)
            if low_value is not None and high_value is not None:
                minimum[name] = low_value
                maximum[name] = high_value
    return {"numRecords": rows, "minValues": minimum, "maxValues": maximum, "nullCount": nulls, "tightBounds": True}


def indexed_columns(metadata: Mapping[str, Any]) -> list[str]:
    """The table's columns Delta collects statistics for: the first
    ``delta.dataSkippingNumIndexedCols`` (default 32; -1 all), or ``delta.dataSkippingStatsColumns``."""
    schema = json.loads(metadata["schemaString"])
    names = [field["name"] for field in schema["fields"]]
    configuration = metadata.get("configuration") or {}
    listed = configuration.get("delta.dataSkippingStatsColumns")
    if listed:
        wanted = {name.strip().strip("`") for name in listed.split(",")}
        return [name for name in names if name in wanted]
    count = int(configuration.get("delta.dataSkippingNumIndexedCols", DEFAULT_INDEXED_COLUMNS))
    return names if count < 0 else names[:count]


def add_action(path: str, size: int, stats: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "add": {
            "path": path,
            "partitionValues": {},
            "size": size,
            "modificationTime": int(time.time() * 1000),
            "dataChange": True,
            "stats": json.dumps(stats, separators=(",", ":")),
        }
    }


def commit_lines(
    protocol: Mapping[str, Any],
    metadata: Mapping[str, Any],
    adds: Sequence[Mapping[str, Any]],
    app_id: str,
    version: int,
    rows: int,
) -> str:
    """The first commit of the table: commitInfo, metaData, protocol, txn, then the adds."""
    now = int(time.time() * 1000)
    size = sum(int(a["add"]["size"]) for a in adds)
    info = {
        "timestamp": now,
        "operation": "WRITE",
        "operationParameters": {"mode": "Append", "partitionBy": "[]"},
        "isolationLevel": "Serializable",
        "isBlindAppend": True,
        "operationMetrics": {"numFiles": str(len(adds)), "numOutputRows": str(rows), "numOutputBytes": str(size)},
        "engineInfo": ENGINE_INFO,
        "txnId": str(uuid.uuid4()),
    }
    actions: list[Mapping[str, Any]] = [
        {"commitInfo": info},
        {"metaData": metadata},
        {"protocol": protocol},
        {"txn": {"appId": app_id, "version": version, "lastUpdated": now}},
        *adds,
    ]
    return "".join(json.dumps(action, separators=(",", ":")) + "\n" for action in actions)


__all__ = [
    "FIRST_COMMIT",
    "TemplateRefused",
    "add_action",
    "commit_lines",
    "file_stats",
    "indexed_columns",
    "table_metadata",
    "template_actions",
]
