"""Values the pipeline cannot carry: found at staging, then failed or quarantined by table policy.

Both writers (the Python :class:`~airflow_provider_pgdecode.batch.writer.BatchWriter` and the
native path's ``NativeWriter``) convert a part's text columns through :func:`stage_values`, so
both stage the same batch. A value is *bad* when its text is larger than the table's
``max_value_bytes``, or when it cannot be converted to its staged type (a BC date, a year past
9999, a multi-dimensional array in a list column...). The table's ``on_bad_value`` decides:

* ``fail``: :func:`bad_value_error` names the table, the column, the change's LSN and the ways
  forward; nothing is staged and the slot does not move.
* ``quarantine``: the change leaves the table part and becomes a row of the batch's quarantine
  part (:data:`~airflow_provider_pgdecode.batch.format.QUARANTINE_COLUMNS`): its metadata, the
  column, the reason and the raw value. Later changes to the same key still apply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_pgdecode.batch.format import (
    CHANGE_LSN,
    COMMIT_LSN,
    OLD,
    OP,
    QUARANTINE_PREVIEW_CHARS,
    QUARANTINE_SCHEMA,
    QUARANTINE_TABLE,
    XID,
)
from airflow_provider_pgdecode.batch.options import TableOptions
from airflow_provider_pgdecode.batch.values import bad_values, convert_column
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError

TextColumn = tuple[str, str, pa.Array]
"""``(name, PostgreSQL type, text values)`` of one column of a part."""

_TOO_LARGE = "too large"


@dataclass(frozen=True)
class BadValue:
    """The first bad value of one change (in column order: new tuple, then old image)."""

    column: str
    pg_type: str
    reason: str
    kind: str  # _TOO_LARGE, "multi-dimensional" or "conversion"


@dataclass
class StagedValues:
    """A part's converted columns, and what was taken out of it."""

    values: dict[str, pa.Array]
    """The new tuple's columns, converted (rows kept only)."""
    old: list[pa.Array]
    """The old image's fields, converted (rows kept only), in the order given."""
    keep: pa.Array | None = None
    """Which rows stay in the table part (``None``: all of them)."""
    quarantine: pa.Table | None = None
    """The quarantined changes as a quarantine part (``None``: none)."""
    quarantined_ops: dict[str, int] = field(default_factory=dict)


def _preview(value: str) -> str:
    return value if len(value) <= QUARANTINE_PREVIEW_CHARS else value[:QUARANTINE_PREVIEW_CHARS]


def _size_reason(size: int, options: TableOptions) -> str:
    return (
        f"the value's text is {size} bytes, more than max_value_bytes={options.max_value_bytes} "
        "(a per-table option; raise it only if the merge's Spark memory can hold such values)"
    )


def stage_values(
    schema: str,
    table: str,
    options: TableOptions,
    meta: Mapping[str, pa.Array],
    new: Sequence[TextColumn],
    old: Sequence[TextColumn],
    has_old: Sequence[bool] | None = None,
) -> StagedValues:
    """Convert a part's text columns; route or refuse its bad values by ``options``.

    ``meta`` holds the part's metadata columns (:func:`~airflow_provider_pgdecode.batch.format.metadata_columns`),
    ``new`` the new tuple's columns and ``old`` the old image's fields (text, ``None`` = NULL);
    ``has_old`` says which rows have an old image.
    """
    limit = options.max_value_bytes
    bad: dict[int, BadValue] = {}
    texts: list[pa.Array] = []
    converted: list[pa.Array] = []
    labels = [name for name, _, _ in new] + [f"{OLD}.{name}" for name, _, _ in old]
    for label, (_, pg_type, values) in zip(labels, [*new, *old]):
        text = values if isinstance(values, pa.Array) else pa.array(values, pa.string())
        texts.append(text)
        # No value can be larger than the whole column: most parts skip the per-value check.
        over = pc.greater(pc.binary_length(text), limit) if text.nbytes > limit else None
        if over is not None and pc.any(over).as_py():
            sizes = pc.binary_length(text)
            for index in pc.indices_nonzero(over).to_pylist():
                bad.setdefault(index, BadValue(label, pg_type, _size_reason(sizes[index].as_py(), options), _TOO_LARGE))
            text = pc.if_else(over, pa.scalar(None, pa.string()), text)
        try:
            array = convert_column(pg_type, text, f"{schema}.{table}.{label}", options.staging)
        except ValueConversionError:
            failed = bad_values(pg_type, text, options.staging)
            for index, reason in failed:
                kind = "multi-dimensional" if reason.startswith("multi-dimensional") else "conversion"
                bad.setdefault(index, BadValue(label, pg_type, reason, kind))
            mask = [False] * len(text)
            for index, _ in failed:
                mask[index] = True
            text = pc.if_else(pa.array(mask, pa.bool_()), pa.scalar(None, pa.string()), text)
            array = convert_column(pg_type, text, f"{schema}.{table}.{label}", options.staging)
        converted.append(array)
    values = dict(zip([name for name, _, _ in new], converted[: len(new)]))
    old_values = converted[len(new) :]
    if not bad:
        return StagedValues(values, old_values)
    first = min(bad)
    if options.on_bad_value != "quarantine":
        raise bad_value_error(
            schema,
            table,
            bad[first],
            change_lsn=meta[CHANGE_LSN][first].as_py(),
            commit_lsn=meta[COMMIT_LSN][first].as_py(),
            xid=meta[XID][first].as_py(),
        )
    rows = sorted(bad)
    keep = pa.array([i not in bad for i in range(len(texts[0]) if texts else 0)], pa.bool_())
    quarantine = _quarantine_part(schema, table, meta, rows, bad, new, old, texts, has_old)
    ops: dict[str, int] = {}
    for op in meta[OP].take(pa.array(rows, pa.int64())).to_pylist():
        ops[op] = ops.get(op, 0) + 1
    return StagedValues(
        {name: pc.filter(array, keep) for name, array in values.items()},
        [pc.filter(array, keep) for array in old_values],
        keep,
        quarantine,
        ops,
    )


def _quarantine_part(
    schema: str,
    table: str,
    meta: Mapping[str, pa.Array],
    rows: list[int],
    bad: Mapping[int, BadValue],
    new: Sequence[TextColumn],
    old: Sequence[TextColumn],
    texts: Sequence[pa.Array],
    has_old: Sequence[bool] | None,
) -> pa.Table:
    take = pa.array(rows, pa.int64())
    picked = [text.take(take).to_pylist() for text in texts]
    new_names = [name for name, _, _ in new]
    old_names = [name for name, _, _ in old]
    by_label = dict(zip(new_names + [f"{OLD}.{n}" for n in old_names], picked))
    values: list[str | None] = []
    sizes: list[int] = []
    truncated: list[bool] = []
    row_json: list[str | None] = []
    old_json: list[str | None] = []
    for position, index in enumerate(rows):
        item = bad[index]
        raw = by_label[item.column][position]
        text = "" if raw is None else raw
        values.append(_preview(text))
        sizes.append(len(text.encode("utf-8")))
        truncated.append(len(text) > QUARANTINE_PREVIEW_CHARS)
        is_delete_or_truncate = meta[OP][index].as_py() in ("D", "T")
        row_json.append(
            None
            if not new_names or is_delete_or_truncate
            else _json_row(new_names, [column[position] for column in picked[: len(new_names)]])
        )
        with_old = bool(old_names) and (has_old is None or bool(has_old[index]))
        old_json.append(
            _json_row(old_names, [column[position] for column in picked[len(new_names) :]]) if with_old else None
        )
    columns: dict[str, Any] = {
        name: meta[name].take(take)
        for name in QUARANTINE_SCHEMA.names[:6]  # the change's metadata
    }
    columns.update(
        {
            "source_schema": [schema] * len(rows),
            "source_table": [table] * len(rows),
            "source_column": [bad[i].column for i in rows],
            "source_type": [bad[i].pg_type for i in rows],
            "reason": [bad[i].reason for i in rows],
            "value": values,
            "value_bytes": sizes,
            "value_truncated": truncated,
            "row": row_json,
            "old_row": old_json,
        }
    )
    return pa.table(columns, schema=QUARANTINE_SCHEMA)


def _json_row(names: Sequence[str], values: Sequence[str | None]) -> str:
    return json.dumps(
        {name: None if value is None else _preview(value) for name, value in zip(names, values)},
        ensure_ascii=False,
        sort_keys=False,
    )


def _fix_for(name: str, bad: BadValue) -> str:
    """The setting or change that lets this kind of value through."""
    if bad.kind == _TOO_LARGE:
        return (
            f"raise the limit for this table (table_options {json.dumps({name: {'max_value_bytes': 2 * 1024**3}})}, "
            "any size in bytes) if the merge's Spark memory (spark.driver.memory / spark.executor.memory) can "
            "hold values this large"
        )
    if bad.kind == "multi-dimensional":
        return f"stage this table's arrays as JSON text (table_options {json.dumps({name: {'arrays': 'json'}})})"
    return (
        "change the column in PostgreSQL to a type or value range pgdecode can stage (docs/merge.md, "
        "'Values the pipeline cannot carry') and resnapshot the table"
    )


def bad_value_error(
    schema: str, table: str, bad: BadValue, *, change_lsn: int, commit_lsn: int, xid: int | None
) -> ValueConversionError:
    """The one wording of a bad value under ``on_bad_value: fail``, with every way forward."""
    name = f"{schema}.{table}"
    option = json.dumps({name: {"on_bad_value": "quarantine"}})
    transaction = f"transaction {xid}, " if xid is not None else ""
    return ValueConversionError(
        f"cannot stage table {name} column {bad.column!r} ({bad.pg_type}) of the change at LSN {Lsn(change_lsn)} "
        f"({transaction}commit LSN {Lsn(commit_lsn)}): {bad.reason}. Ways forward: quarantine such changes "
        f"(table_options {option}): they go to the Delta table <delta_root>/{QUARANTINE_TABLE} with the raw value "
        f"and the rest of the batch flows; or {_fix_for(name, bad)}; or leave the table out of the pipeline's "
        "tables. Nothing was staged and the slot was not advanced."
    )


def snapshot_value_error(name: str, bad: BadValue, value: str, lsn: int) -> ValueConversionError:
    """The one wording of a bad value met by a snapshot (initial load or table snapshot), which
    stages the rows as they are now: fixing the row in PostgreSQL is a way forward."""
    shown = value if len(value) <= 80 else value[:80] + "..."
    return ValueConversionError(
        f"cannot stage table {name} column {bad.column!r} ({bad.pg_type}) in the snapshot at LSN {Lsn(lsn)}: "
        f"{bad.reason} (the value starts {shown!r}). Ways forward: fix the row in PostgreSQL (a snapshot stages "
        f"rows as they are now) and run the snapshot again; or {_fix_for(name, bad)}; or leave the table out of "
        "the snapshot. Snapshots do not quarantine: nothing was staged."
    )


def convert_snapshot_column(
    name: str, column: str, pg_type: str, values: pa.Array, options: TableOptions, lsn: int
) -> pa.Array:
    """Convert one column of a snapshot part (the table's ``arrays`` and ``max_value_bytes`` apply);
    a bad value is a :func:`snapshot_value_error`."""
    text = values if isinstance(values, pa.Array) else pa.array(values, pa.string())
    if pa.types.is_large_string(text.type) or not pa.types.is_string(text.type):
        text = text.cast(pa.string())
    sizes = pc.binary_length(text)
    over = pc.greater(sizes, options.max_value_bytes)
    if text.nbytes > options.max_value_bytes and pc.any(over).as_py():
        index = pc.indices_nonzero(over)[0].as_py()
        bad = BadValue(column, pg_type, _size_reason(sizes[index].as_py(), options), _TOO_LARGE)
        raise snapshot_value_error(name, bad, text[index].as_py(), lsn)
    try:
        return convert_column(pg_type, text, f"{name}.{column}", options.staging)
    except ValueConversionError as exc:
        failed = bad_values(pg_type, text, options.staging)
        if not failed:
            raise
        index, reason = failed[0]
        kind = "multi-dimensional" if reason.startswith("multi-dimensional") else "conversion"
        raise snapshot_value_error(name, BadValue(column, pg_type, reason, kind), text[index].as_py(), lsn) from exc


__all__ = [
    "BadValue",
    "StagedValues",
    "bad_value_error",
    "convert_snapshot_column",
    "snapshot_value_error",
    "stage_values",
]
