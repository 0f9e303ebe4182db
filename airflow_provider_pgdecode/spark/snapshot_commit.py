"""An initial load committed as staged: a snapshot batch's parts become a new Delta table's first commit.

The parts are placed under the table as they are (no Spark write) and the first log entry is
created only if absent (:mod:`.delta_commit`), with a protocol and metadata taken from a
throwaway template table that Spark creates under ``TEMPLATE_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import pyarrow.parquet
from pyspark.sql.types import StructField, TimestampNTZType

from airflow_provider_pgdecode.batch.format import is_local_path, join_path, local_path
from airflow_provider_pgdecode.batch.manifest import TableSummary
from airflow_provider_pgdecode.batch.storage import Storage, fsync_dir
from airflow_provider_pgdecode.spark import delta_commit
from airflow_provider_pgdecode.spark.delta_state import app_id, table_storage
from airflow_provider_pgdecode.spark.history import KEPT_MODES
from airflow_provider_pgdecode.spark.merge_plan import METADATA_FIELDS, MergeOptions, TablePlan
from airflow_provider_pgdecode.spark.merge_sql import ddl_field, delta_ref, sql_literal, table_fields, table_properties
from airflow_provider_pgdecode.spark.spark_types import delta_ready
from airflow_provider_pgdecode.spark.staged_events import open_part

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


log = logging.getLogger("airflow_provider_pgdecode.spark.merge")


# --------------------------------------------------------------------------------------------
# An initial load committed as staged (delta_commit.py)
# --------------------------------------------------------------------------------------------

TEMPLATE_DIR = "_pgdecode_templates"
"""Under the Delta root: throwaway tables whose first commit gives a new table's protocol and metadata."""


def committable_snapshot(plan: TablePlan, options: MergeOptions) -> TableSummary | None:
    """The staged snapshot whose parts can become the new table's first commit as they are, or
    ``None`` (the table is appended or merged through Spark): the table does not exist yet, this
    run holds only one snapshot batch of it (``snapshot_files``, nothing applied before), and every
    column is staged with its Delta type under this run's options. Never for a ``history`` or
    ``soft_delete`` table: staged parts have none of their columns."""
    if not options.snapshot_commit or plan.state.exists or len(plan.segments) != 1 or plan.mode in KEPT_MODES:
        return None
    segment = plan.segments[0]
    entry = segment.staged
    if entry.snapshot_files is None or segment.applied_through >= 0 or segment.batch.snapshot_chunks:
        return None
    if entry.updates or entry.deletes or table_storage(plan.path) is None:
        return None
    if entry.numeric_specials and options.numeric_special == "error":
        return None  # the Spark path refuses the batch, naming the columns
    staged_columns = {c.name: c for c in entry.columns}
    if set(staged_columns) != set(plan.columns):
        return None
    if not all(delta_ready(plan.types[c], staged_columns[c].arrow) for c in plan.columns):
        return None
    return entry


def snapshot_template(
    spark: SparkSession,
    plan: TablePlan,
    options: MergeOptions,
    delta_root: str,
    cache: dict[Any, tuple[dict[str, Any], dict[str, Any]] | None],
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The protocol and metaData of the new table's first commit, or ``None`` when a hand-written
    commit could not carry them (:func:`delta_commit.template_actions`).

    The protocol (table features) and the properties Delta settles on come from Delta itself:
    ``CREATE TABLE`` of the metadata columns with the options' properties (and a
    ``timestamp_ntz`` column when the table has one, the one column type with a table feature of
    its own) on a throwaway location under ``<delta_root>/_pgdecode_templates``, removed again.
    It costs a Spark statement (about 0.4 s warm), so its protocol and metaData are kept beside,
    in ``_pgdecode_templates/<digest>.json`` (the digest of the properties, that column and the
    Spark version), and in ``cache`` for the run. The columns are :func:`table_fields`, as
    ``CREATE TABLE`` of the table would declare them."""
    import hashlib
    import uuid

    fields = table_fields(plan)
    ntz = any(isinstance(f.dataType, TimestampNTZType) for f in fields)
    kind = (tuple(sorted(options.table_properties.items())), ntz, spark.version)
    templates = table_storage(join_path(delta_root, TEMPLATE_DIR))
    if templates is None:
        return None
    kept = hashlib.sha256(json.dumps(kind).encode("utf-8")).hexdigest()[:24] + ".json"
    if kind not in cache and templates.is_file(kept):
        try:
            cache[kind] = delta_commit.template_actions(templates.read_text(kept))
        except (ValueError, delta_commit.TemplateRefused):
            pass  # unreadable: made again below
    if kind not in cache:
        store = templates.child(uuid.uuid4().hex)
        location = join_path(delta_root, TEMPLATE_DIR, store.root.rsplit("/", 1)[1])
        columns = [*METADATA_FIELDS, *([StructField("ntz", TimestampNTZType())] if ntz else [])]
        try:
            spark.sql(
                f"CREATE TABLE {delta_ref(location)} ({', '.join(ddl_field(f) for f in columns)}) USING delta"
                + (
                    " TBLPROPERTIES ("
                    + ", ".join(f"{sql_literal(k)} = {sql_literal(v)}" for k, v in options.table_properties.items())
                    + ")"
                    if options.table_properties
                    else ""
                )
            )
            first = store.child("_delta_log").read_text(delta_commit.FIRST_COMMIT)
            cache[kind] = delta_commit.template_actions(first)
            templates.write_text(kept, first)
        except delta_commit.TemplateRefused as refused:
            log.info("table %s: %s; the snapshot is appended through Spark", plan.name, refused)
            cache[kind] = None
        finally:
            store.delete_tree()
    template = cache[kind]
    if template is None:
        return None
    protocol, metadata = template
    try:
        return protocol, delta_commit.table_metadata(
            metadata, [f.jsonValue() for f in fields], table_properties(plan, options)
        )
    except delta_commit.TemplateRefused as refused:
        log.info("table %s: %s; the snapshot is appended through Spark", plan.name, refused)
        return None


def _place_part(source: str, store: Storage, name: str) -> None:
    """``source`` (a staged part) as ``name`` in the table's directory: a hard link on one local
    filesystem (the batch keeps its copy), else a byte copy. An earlier copy is replaced."""
    if is_local_path(source) and store.is_local:
        target = os.path.join(store.root, name)
        os.makedirs(store.root, exist_ok=True)
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        try:
            os.link(local_path(source), target)
            return
        except OSError:
            pass  # another filesystem: copy
    with open_part(source) as handle:
        src = open(handle, "rb") if isinstance(handle, str) else handle
        try:
            with store.open_output(name) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        finally:
            if isinstance(handle, str):
                src.close()


def _create_if_absent(store: Storage, name: str, data: bytes) -> bool:
    """Create ``name`` holding ``data`` unless it exists; False when it did. On a local disk a
    finished, fsynced temporary file is hard-linked (atomic, fails if the name exists); on object
    storage a look-up then one PUT."""
    if not store.is_local:
        if store.exists(name):
            return False
        store.write_bytes(name, data)
        return True
    import tempfile

    os.makedirs(store.root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store.root, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, os.path.join(store.root, name))
        except FileExistsError:
            return False
        fsync_dir(store.root)
        return True
    finally:
        os.unlink(tmp)


def commit_snapshot(
    plan: TablePlan, entry: TableSummary, template: tuple[dict[str, Any], dict[str, Any]], slot: str
) -> int | None:
    """The snapshot's parts placed in the table's directory and committed as its version 0 with the
    watermark (:mod:`.delta_commit`). Returns the rows committed, or ``None`` when the table's first
    commit exists already (another run created the table meanwhile)."""
    protocol, metadata = template
    store = table_storage(plan.path)
    assert store is not None and entry.location is not None and entry.snapshot_files is not None
    columns = delta_commit.indexed_columns(metadata)
    adds: list[dict[str, Any]] = []
    rows = 0
    for file in entry.snapshot_files:
        name = f"pgdecode-snapshot-{plan.watermark_after:016X}-{file}"
        _place_part(join_path(entry.location, file), store, name)
        with open_part(store.uri(name)) as handle:
            footer = pyarrow.parquet.read_metadata(handle)
        size = store.filesystem.get_file_info(store._path(name)).size
        adds.append(delta_commit.add_action(name, int(size), delta_commit.file_stats(footer, columns)))
        rows += footer.num_rows
    if store.is_local and adds:
        fsync_dir(store.root)
    text = delta_commit.commit_lines(protocol, metadata, adds, app_id(slot), plan.watermark_after, rows)
    if not _create_if_absent(store.child("_delta_log"), delta_commit.FIRST_COMMIT, text.encode("utf-8")):
        return None
    return rows
