"""Values the pipeline cannot carry: found at staging, then failed or quarantined by table policy.

Both writers (the Python :class:`~airflow_provider_pgdecode.batch.writer.BatchWriter` and the
native path's ``NativeWriter``) convert a part's text columns through :func:`stage_values`, so
both stage the same batch. A value is *bad* when its text is larger than the table's
``max_value_bytes``, or when it cannot be converted to its staged type (a BC date, a year past
9999, a multi-dimensional array in a list column...), and when it is ``infinity`` or ``-infinity``
in a date or timestamp column of the table's key: staged elsewhere as the end of Spark's range
(docs/merge.md), it would become the same Delta row as a key of that value, which PostgreSQL
keeps apart (:func:`infinite_key_reason`; the way forward is the table's ``type_map``). The
table's ``on_bad_value`` decides:

* ``fail``: :func:`bad_value_error` names the table, the column, the change's LSN and the ways
  forward; nothing is staged and the slot does not move.
* ``quarantine``: the change leaves the table part and becomes a row of the batch's quarantine
  part (:data:`~airflow_provider_pgdecode.batch.format.QUARANTINE_COLUMNS`): its metadata, the
  column, the reason and the raw value. Later changes to the same key still apply.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
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
from airflow_provider_pgdecode.batch.values import bad_values, clamped_infinities, convert_column, infinity_bounds
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError
from airflow_provider_pgdecode.typemap import array_element, find

TextColumn = tuple[str, str, pa.Array]
"""``(name, PostgreSQL type, text values)`` of one column of a part."""

_TOO_LARGE = "too large"
_INFINITE_KEY = "infinite key"


@dataclass(frozen=True)
class BadValue:
    """The first bad value of one change (in column order: new tuple, then old image)."""

    column: str
    pg_type: str
    reason: str
    kind: str  # _TOO_LARGE, "multi-dimensional", "conversion" or _INFINITE_KEY


@dataclass(frozen=True)
class ClampedValue:
    """The first ``infinity`` / ``-infinity`` of a date or timestamp column staged clamped in a table
    whose key was not known at staging (``key=None``): checked against the key once it is known
    (:func:`clamped_key_error`)."""

    column: str
    """The column's name (of the new tuple or of the old image)."""
    label: str
    """As messages name it: ``_pg_old.<name>`` for the old image."""
    pg_type: str
    value: str
    change_lsn: int
    commit_lsn: int
    xid: int | None


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
    clamped: dict[str, ClampedValue] = field(default_factory=dict)
    """With the key unknown: per column, the first ±infinity staged clamped (rows kept only)."""


def _preview(value: str) -> str:
    return value if len(value) <= QUARANTINE_PREVIEW_CHARS else value[:QUARANTINE_PREVIEW_CHARS]


def _size_reason(size: int, options: TableOptions) -> str:
    return (
        f"the value's text is {size} bytes, more than max_value_bytes={options.max_value_bytes} "
        "(a per-table option; raise it only if the merge's Spark memory can hold such values)"
    )


def infinite_key_reason(value: str, pg_type: str) -> str:
    """Why ``infinity`` / ``-infinity`` in a key column is a bad value (``value``: the column's text,
    an array literal for an array)."""
    high, low = infinity_bounds(pg_type)
    shown = value if len(value) <= 80 else value[:80] + "..."
    if value in ("infinity", "-infinity"):
        bound = high if value == "infinity" else low
        held = f"staged as {bound} (the end of Spark's range, as in other columns), it would become the same Delta row"
        return f"{shown!r} in a key column: {held} as the key {bound}, which PostgreSQL keeps apart from it"
    return (
        f"{shown!r} in a key column holds infinity or -infinity: staged as {high} / {low} (the ends of Spark's "
        "range, as in other columns), it would become the same Delta row as a key holding those values, which "
        "PostgreSQL keeps apart from it"
    )


def stage_values(
    schema: str,
    table: str,
    options: TableOptions,
    meta: Mapping[str, pa.Array],
    new: Sequence[TextColumn],
    old: Sequence[TextColumn],
    has_old: Sequence[bool] | None = None,
    key: Collection[str] | None = None,
) -> StagedValues:
    """Convert a part's text columns; route or refuse its bad values by ``options``.

    ``meta`` holds the part's metadata columns (:func:`~airflow_provider_pgdecode.batch.format.metadata_columns`),
    ``new`` the new tuple's columns and ``old`` the old image's fields (text, ``None`` = NULL);
    ``has_old`` says which rows have an old image. ``key``: the table's key columns
    (:meth:`~airflow_provider_pgdecode.postgres.catalog.Catalog.table_key`; empty for a table
    loaded ``append_only``, which is never matched): ±infinity in one of them, new or old, is a bad
    value. ``None``: the key is not known here; ±infinity staged clamped is returned in
    :attr:`StagedValues.clamped`, for :func:`clamped_key_error` once it is.
    """
    limit = options.max_value_bytes
    bad: dict[int, BadValue] = {}
    texts: list[pa.Array] = []
    converted: list[pa.Array] = []
    unchecked: list[tuple[str, str, str, int, pa.Array]] = []  # key unknown: (name, label, type, column, mask)
    labels = [name for name, _, _ in new] + [f"{OLD}.{name}" for name, _, _ in old]
    for label, (name, pg_type, values) in zip(labels, [*new, *old]):
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
        if key is None or name in key:
            infinite = clamped_infinities(pg_type, text, options.staging)
            if infinite is not None and key is None:
                unchecked.append((name, label, pg_type, len(texts) - 1, infinite))
            elif infinite is not None:
                for index in pc.indices_nonzero(infinite).to_pylist():
                    reason = infinite_key_reason(text[index].as_py(), pg_type)
                    bad.setdefault(index, BadValue(label, pg_type, reason, _INFINITE_KEY))
    values = dict(zip([name for name, _, _ in new], converted[: len(new)]))
    old_values = converted[len(new) :]
    clamped = _clamped(unchecked, texts, bad, meta)
    if not bad:
        return StagedValues(values, old_values, clamped=clamped)
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
        clamped,
    )


def _clamped(
    unchecked: Sequence[tuple[str, str, str, int, pa.Array]],
    texts: Sequence[pa.Array],
    bad: Mapping[int, BadValue],
    meta: Mapping[str, pa.Array],
) -> dict[str, ClampedValue]:
    """Per column, the first ±infinity staged clamped in a row that stays (key unknown)."""
    out: dict[str, ClampedValue] = {}
    for name, label, pg_type, column, mask in unchecked:
        index = next((i for i in pc.indices_nonzero(mask).to_pylist() if i not in bad), None)
        if index is None or name in out:
            continue
        out[name] = ClampedValue(
            name,
            label,
            pg_type,
            texts[column][index].as_py(),
            meta[CHANGE_LSN][index].as_py(),
            meta[COMMIT_LSN][index].as_py(),
            meta[XID][index].as_py(),
        )
    return out


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
    if bad.kind == _INFINITE_KEY:
        entry = find(array_element(bad.pg_type) or bad.pg_type)
        kept = (entry.aliases[:1] or (entry.name,))[0] if entry is not None else bad.pg_type
        option = json.dumps({name: {"type_map": {kept: "string"}}})
        return (
            f"keep the table's {kept} values as the text PostgreSQL printed, so that every key stays itself "
            f"(table_options {option}; the next extract stages the unmerged changes with it); if the Delta table "
            f"holds the column already, move it aside and resnapshot {name}, which re-creates it with the column "
            "as text"
        )
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


def clamped_key_error(schema: str, table: str, clamped: ClampedValue, key: Sequence[str]) -> ValueConversionError:
    """±infinity staged clamped in a key column of a table whose key the writer did not know (the
    table was created or renamed after the extract read the catalog's keys), found once the key is
    known: refused whatever ``on_bad_value`` says, since the change can no longer be routed."""
    name = f"{schema}.{table}"
    bad = BadValue(clamped.label, clamped.pg_type, infinite_key_reason(clamped.value, clamped.pg_type), _INFINITE_KEY)
    transaction = f"transaction {clamped.xid}, " if clamped.xid is not None else ""
    return ValueConversionError(
        f"cannot stage table {name} column {bad.column!r} ({bad.pg_type}) of the change at LSN "
        f"{Lsn(clamped.change_lsn)} ({transaction}commit LSN {Lsn(clamped.commit_lsn)}): {bad.reason}. The "
        f"table's key ({', '.join(key)}) was not known when its changes were staged (the table was created or "
        "renamed after the extract read the keys), so the table's on_bad_value could not apply. Ways forward: run "
        "the extract again, which reads the keys anew (enough for a table created since, not for changes staged "
        f"under a name the table no longer has); or {_fix_for(name, bad)}; or leave the table out of the "
        "pipeline's tables. Nothing was published and the slot was not advanced."
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
    name: str, column: str, pg_type: str, values: pa.Array, options: TableOptions, lsn: int, key: bool = False
) -> pa.Array:
    """Convert one column of a snapshot part (the table's ``arrays``, ``type_map`` and
    ``max_value_bytes`` apply); a bad value is a :func:`snapshot_value_error`. ``key``: the column
    is in the table's key (of a table matched by it), where ±infinity is a bad value."""
    text = values if isinstance(values, pa.Array) else pa.array(values, pa.string())
    if pa.types.is_large_string(text.type) or not pa.types.is_string(text.type):
        text = text.cast(pa.string())
    sizes = pc.binary_length(text)
    over = pc.greater(sizes, options.max_value_bytes)
    if text.nbytes > options.max_value_bytes and pc.any(over).as_py():
        index = pc.indices_nonzero(over)[0].as_py()
        bad = BadValue(column, pg_type, _size_reason(sizes[index].as_py(), options), _TOO_LARGE)
        raise snapshot_value_error(name, bad, text[index].as_py(), lsn)
    infinite = clamped_infinities(pg_type, text, options.staging) if key else None
    if infinite is not None:
        value = text[pc.indices_nonzero(infinite)[0].as_py()].as_py()
        bad = BadValue(column, pg_type, infinite_key_reason(value, pg_type), _INFINITE_KEY)
        raise snapshot_value_error(name, bad, value, lsn)
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
    "ClampedValue",
    "StagedValues",
    "bad_value_error",
    "clamped_key_error",
    "convert_snapshot_column",
    "infinite_key_reason",
    "snapshot_value_error",
    "stage_values",
]
