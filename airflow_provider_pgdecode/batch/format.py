"""The batch format's fixed parts, defined once: its id, its paths, and the metadata columns.

Every writer of table parts (the Python writer, the native writer, both snapshot kinds) builds
its metadata columns with :func:`metadata_columns`, and every reader (the manifest, the Spark
job) names them through the constants here; docs/staging-format.md describes the same layout.

A staged table part holds, in this order, the metadata columns of :data:`CHANGE_COLUMNS`, then
``_pg_old`` (the old key/row image, a struct shaped like the row; absent only from parts of
TRUNCATE rows alone), then the source columns in the table's order.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlparse

import pyarrow as pa

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError

FORMAT = "pgdecode.batch/1"
MANIFEST_NAME = "manifest.json"
BATCH_NAME = re.compile(r"^([0-9A-F]{16})-([0-9A-F]{16})$")
"""A batch directory's name: ``<start>-<end>``, 16 hex digits each."""
SNAPSHOT_START_LSN = Lsn(0)
"""Where an initial load's batch starts: it holds the tables as of its end (the consistent point)."""
PARQUET_OPTIONS: dict[str, Any] = {"compression": "snappy", "write_statistics": True}

METADATA_PREFIX = "_pg_"
COMMIT_LSN = "_pg_commit_lsn"
SEQ = "_pg_seq"
OP = "_pg_op"
XID = "_pg_xid"
COMMIT_TIME = "_pg_commit_time"
CHANGE_LSN = "_pg_change_lsn"
UNCHANGED_TOAST = "_pg_unchanged_toast"
OLD = "_pg_old"

MESSAGE_LSN = "_pg_lsn"

CHANGE_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    (COMMIT_LSN, pa.int64()),  # commit LSN of the change's transaction (the merge's order, with _pg_seq)
    (SEQ, pa.int32()),  # position of the change within its transaction
    (OP, pa.string()),  # I, U, D or T (TRUNCATE)
    (XID, pa.int64()),
    (COMMIT_TIME, pa.timestamp("us", tz="UTC")),
    (CHANGE_LSN, pa.int64()),  # the change's own LSN
    (UNCHANGED_TOAST, pa.list_(pa.string())),  # columns whose TOASTed value did not change (NULL here)
)
"""The metadata columns at the head of every table part, in file order."""

DELTA_COLUMNS: tuple[str, ...] = (COMMIT_LSN, COMMIT_TIME, XID)
"""The metadata columns every Delta table keeps beside the source columns."""

VALID_FROM_LSN = "_pg_valid_from_lsn"
VALID_TO_LSN = "_pg_valid_to_lsn"
VALID_FROM = "_pg_valid_from"
VALID_TO = "_pg_valid_to"
CURRENT = "_pg_current"
HISTORY_COLUMNS: tuple[str, ...] = (VALID_FROM_LSN, VALID_TO_LSN, VALID_FROM, VALID_TO, CURRENT)
"""The columns a ``history`` table (``table_options`` mode) keeps after :data:`DELTA_COLUMNS`: the
commit LSN and time that opened and closed each version (to: NULL while it is current), and
whether it is the key's current version (docs/merge.md, "History and soft deletes")."""

DELETED = "_pg_deleted"
SOFT_DELETE_COLUMNS: tuple[str, ...] = (DELETED,)
"""The column a ``soft_delete`` table keeps after :data:`DELTA_COLUMNS`: the row is a tombstone."""


def delta_columns(mode: str) -> tuple[str, ...]:
    """The metadata columns of a Delta table loaded in ``mode`` (``table_options``), in table order."""
    if mode == "history":
        return DELTA_COLUMNS + HISTORY_COLUMNS
    if mode == "soft_delete":
        return DELTA_COLUMNS + SOFT_DELETE_COLUMNS
    return DELTA_COLUMNS


MESSAGES_DIR = "messages"
"""The batch directory holding logical decoding messages: ``messages/part-NNNNN.parquet``."""
MESSAGES_TABLE = "_pgdecode_messages"
"""The messages Delta table's directory under the Delta root (one table per source: its slot)."""
MESSAGES_SLOT = "_pg_slot"
"""The column the merge adds to the messages Delta table: the slot the message came from."""

QUARANTINE_DIR = "quarantine"
"""The batch directory holding quarantine parts: ``quarantine/<schema>/<table>/part-NNNNN.parquet``."""
QUARANTINE_TABLE = "_pgdecode_quarantine"
"""The quarantine Delta table's directory under the Delta root (one table for every source table)."""
QUARANTINE_PREVIEW_CHARS = 1024
"""Characters kept of a value quarantined for its size (and of each other value in ``row``/``old_row``)."""
QUARANTINE_SLOT = "slot"
"""The column the merge adds to the quarantine Delta table: the slot the change came from."""

QUARANTINE_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    (COMMIT_LSN, pa.int64()),
    (SEQ, pa.int32()),
    (OP, pa.string()),
    (XID, pa.int64()),
    (COMMIT_TIME, pa.timestamp("us", tz="UTC")),
    (CHANGE_LSN, pa.int64()),
    ("source_schema", pa.string()),
    ("source_table", pa.string()),
    ("source_column", pa.string()),  # the column holding the bad value (``_pg_old.<c>``: the old image's)
    ("source_type", pa.string()),  # its PostgreSQL type
    ("reason", pa.string()),  # why it cannot be staged, with the setting that would change that
    ("value", pa.string()),  # the text PostgreSQL printed (its first QUARANTINE_PREVIEW_CHARS if too large)
    ("value_bytes", pa.int64()),  # the size of that text in bytes (UTF-8)
    ("value_truncated", pa.bool_()),  # True when ``value`` holds only the start of it
    ("row", pa.string()),  # the new tuple as a JSON object of texts (each cut to the preview), or null
    ("old_row", pa.string()),  # the old key/row image likewise, or null
)
"""The columns of a quarantine part, in file order: one row per quarantined change (its first bad
value in column order), in the order the changes were staged (docs/staging-format.md)."""

QUARANTINE_SCHEMA = pa.schema(list(QUARANTINE_COLUMNS))


def quarantine_path(schema: str, table: str) -> str:
    """Relative directory of a table's quarantine parts."""
    return f"{QUARANTINE_DIR}/{_path_part(schema)}/{_path_part(table)}"


def change_part_options(schema: pa.Schema) -> dict[str, Any]:
    """How the extract writes a table part of changes (both writers): :data:`PARQUET_OPTIONS`,
    with dictionary encoding only for ``_pg_op`` and min/max statistics only for columns that
    are not text, binary or lists (``_pg_op`` aside).

    A part is read whole by the merge (and its replays) until retention removes it; the merge
    uses the statistics of ``_pg_commit_lsn`` and of an integer key (``staged_key_bounds``, also
    under ``_pg_old``), never those of text. Dictionaries for every column and statistics of
    every text were half of the Parquet writing's CPU, the extract's largest cost (hashing each
    value of key, LSN, numeric and array columns, most of which fall back to plain encoding
    anyway), and plain pages compress as small with snappy: bench/extract_bench.py's 100k-row
    part writes in 21 ms instead of 44 ms, 2.7 MB instead of 3.5 MB."""
    stats: list[str] = []
    for field in schema:
        children = list(field.type) if pa.types.is_struct(field.type) else None
        if children is not None:
            stats.extend(f"{field.name}.{child.name}" for child in children if _cheap_statistics(child.type))
        elif field.name == OP or _cheap_statistics(field.type):
            stats.append(field.name)
    return {**PARQUET_OPTIONS, "use_dictionary": [OP], "write_statistics": stats}


def _cheap_statistics(kind: pa.DataType) -> bool:
    return not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_nested(kind)
    )


def metadata_columns(
    commit_lsn: Any, seq: Any, op: Any, xid: Any, commit_time: Any, change_lsn: Any, unchanged_toast: Any
) -> dict[str, pa.Array]:
    """The metadata columns of a part, in file order, each as an array of its staged type
    (arrays are cast; sequences are converted)."""
    values = (commit_lsn, seq, op, xid, commit_time, change_lsn, unchanged_toast)
    return {
        name: (value if value.type == kind else value.cast(kind))
        if isinstance(value, pa.Array)
        else pa.array(value, kind)
        for (name, kind), value in zip(CHANGE_COLUMNS, values)
    }


def part_schema(old: pa.StructType | None, values: Iterable[tuple[str, pa.DataType]]) -> pa.Schema:
    """The schema of a part: metadata columns, ``_pg_old`` (when given), the source columns."""
    return pa.schema([*CHANGE_COLUMNS, *([(OLD, old)] if old is not None else []), *values])


def check_column_names(schema: str, table: str, names: Iterable[str]) -> None:
    """A source column named like pgdecode's metadata columns cannot be staged."""
    for name in names:
        if name.startswith(METADATA_PREFIX):
            raise CatalogError(
                f"column {name!r} of {schema}.{table} starts with {METADATA_PREFIX!r}, which pgdecode "
                "reserves for its metadata columns; rename the column or leave the table out"
            )


def batch_dir_name(start_lsn: Lsn, end_lsn: Lsn) -> str:
    """``<start>-<end>`` as 16 hex digits each, so names sort in LSN order."""
    return f"{int(start_lsn):016X}-{int(end_lsn):016X}"


def parse_batch_dir_name(name: str) -> tuple[Lsn, Lsn] | None:
    """``(start, end)`` of a batch directory's name, ``None`` for any other name."""
    match = BATCH_NAME.match(name)
    if match is None:
        return None
    return Lsn(int(match.group(1), 16)), Lsn(int(match.group(2), 16))


def table_path(schema: str, table: str) -> str:
    """Relative directory of a table's files; names percent-encoded so any name is a path part
    (``.`` and ``..`` too, which are legal quoted identifiers)."""
    return f"tables/{_path_part(schema)}/{_path_part(table)}"


def _path_part(name: str) -> str:
    encoded = quote(name, safe="")
    return encoded.replace(".", "%2E") if set(encoded) == {"."} else encoded


def delta_path_part(name: str) -> str:
    """A schema or table name as one directory name of its Delta table's path
    (``<delta_root>/<schema>/<table>``): the name as PostgreSQL stores it, except ``%`` as
    ``%25``, ``/`` as ``%2F``, a backquote as ``%60`` (Delta's table builder puts the path between
    backquotes unescaped), and a name of only dots (``.``, ``..``) as ``%2E`` each. So every name
    is one path part, and two names never share a path (docs/merge.md)."""
    if name and set(name) == {"."}:
        return "%2E" * len(name)
    return name.replace("%", "%25").replace("/", "%2F").replace("`", "%60")


def is_local_path(path: str) -> bool:
    """True for a plain filesystem path or a ``file:`` URI."""
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def local_path(path: str) -> str:
    """The filesystem path of a plain path or a ``file:`` URI."""
    return urlparse(path).path if path.startswith("file:") else path


def join_path(base: str, *parts: str) -> str:
    """Join path components of a local path or a URI with ``/``."""
    return posixpath.join(base.rstrip("/"), *parts)
