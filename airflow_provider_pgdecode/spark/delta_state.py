"""The Delta table's state, read from its transaction log: version, schema, properties, and the
transaction ids pgdecode's merges keep their watermarks under. One log replay for the merge, the
verify and the maintenance jobs.

The log is read through the batch format's storage layer (the newest complete checkpoint and the
commits after it): no JVM call, so the same code serves a spark-submit session and a Spark
Connect client session. Locations the storage layer cannot reach (``hdfs://``...) are read
through Delta's JVM classes, which only a classic session has. A damaged log line is a
:class:`~airflow_provider_pgdecode.errors.DeltaTableError` naming the file: the merge parks that
table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import StructType

from airflow_provider_pgdecode.batch.format import is_local_path, local_path
from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, is_object_store
from airflow_provider_pgdecode.errors import ConfigurationError, DeltaTableError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

APP_ID_PREFIX = "pgdecode:"
"""The Delta transaction id (``txn`` app id) prefix of pgdecode's merges: ``pgdecode:<slot>``."""


def app_id(slot: str) -> str:
    """The Delta idempotent-write app id of a slot: the watermark is kept under it."""
    return f"{APP_ID_PREFIX}{slot}"


@dataclass
class LogReplay:
    """A Delta log replayed: its version, every ``txn`` app id with its newest version, and the
    newest ``metaData`` action (``None``: the log holds none, it is damaged or being created)."""

    version: int
    transactions: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None

    @property
    def properties(self) -> dict[str, str]:
        configuration: Any = (self.metadata or {}).get("configuration") or {}
        if isinstance(configuration, list):  # a map column read from a checkpoint: (key, value) pairs
            configuration = dict(configuration)
        return {str(k): str(v) for k, v in configuration.items()}

    @property
    def schema(self) -> StructType | None:
        if self.metadata is None or not self.metadata.get("schemaString"):
            return None
        return StructType.fromJson(json.loads(self.metadata["schemaString"]))


@dataclass
class DeltaState:
    """A table's state as the merge needs it: ``watermark`` is its slot's transaction version."""

    exists: bool
    version: int
    watermark: int | None
    schema: StructType | None
    properties: dict[str, str]


def bucket_storage(bucket: str, settings: ObjectStoreSettings) -> Storage:
    """A bucket of the object store, through the batch format's storage layer."""
    return Storage(f"s3://{bucket}", settings)


def table_storage(path: str) -> Storage | None:
    """The table's directory through the batch format's storage layer (a local path or an
    ``s3a://`` location), or ``None`` for a location only Spark's filesystems reach."""
    if is_local_path(path):
        return Storage(local_path(path))
    if is_object_store(path):
        bucket, _, key = path.split("://", 1)[1].partition("/")
        return bucket_storage(bucket, ObjectStoreSettings.from_env()).child(key.strip("/"))
    return None


def delta_log_storage(path: str) -> Storage | None:
    """The table's ``_delta_log`` through the batch format's storage layer, or ``None`` (:func:`table_storage`)."""
    store = table_storage(path)
    return store.child("_delta_log") if store is not None else None


def log_version(name: str, suffix: str) -> int | None:
    """The version a ``_delta_log`` file name carries before ``suffix`` (``00…12.json``: 12), or ``None``."""
    head = name[: -len(suffix)] if name.endswith(suffix) else None
    return int(head) if head is not None and head.isdigit() else None


def _checkpoint_files(names: Sequence[str]) -> dict[int, list[str]]:
    """Complete checkpoints of a Delta log by version: ``<v>.checkpoint.parquet``, all the parts of
    a multi-part one (``<v>.checkpoint.<i>.<n>.parquet``), or a V2 one's top file
    (``<v>.checkpoint.<uuid>.parquet|json``, which holds the txn and metaData actions itself)."""
    found: dict[int, list[str]] = {}
    parts: dict[tuple[int, int], list[str]] = {}
    for name in names:
        head, sep, rest = name.partition(".checkpoint")
        if not sep or not head.isdigit():
            continue
        version = int(head)
        pieces = rest.strip(".").split(".")
        if pieces == ["parquet"] or (len(pieces) == 2 and pieces[1] in ("parquet", "json") and "-" in pieces[0]):
            found.setdefault(version, [name])
        elif len(pieces) == 3 and pieces[0].isdigit() and pieces[1].isdigit() and pieces[2] == "parquet":
            parts.setdefault((version, int(pieces[1])), []).append(name)
    for (version, total), names_of in parts.items():
        if len(names_of) == total:
            found.setdefault(version, sorted(names_of))
    return found


def log_actions(store: Storage) -> tuple[int, Iterator[Mapping[str, Any]]] | None:
    """The table's version and the ``txn`` and ``metaData`` actions that make up its state, oldest
    first: those of the newest complete checkpoint, then every commit after it. ``None`` when the
    ``_delta_log`` holds no commit."""
    names = [name for name, is_dir in store.list_dir() if not is_dir]
    commits = sorted(v for v in (log_version(n, ".json") for n in names) if v is not None)
    checkpoints = _checkpoint_files(names)
    if not commits and not checkpoints:
        return None
    version = max([*commits, *checkpoints])
    base = max((v for v in checkpoints if v <= version), default=-1)

    def actions() -> Iterator[Mapping[str, Any]]:
        if base >= 0:
            for name in checkpoints[base]:
                if name.endswith(".json"):
                    yield from _log_file_actions(store, name)
                else:
                    yield from _checkpoint_actions(store, name)
        for commit in (v for v in commits if v > base):
            yield from _log_file_actions(store, f"{commit:020d}.json")

    return version, actions()


def _checkpoint_actions(store: Storage, name: str) -> list[Mapping[str, Any]]:
    """The ``txn`` and ``metaData`` actions of a Parquet checkpoint (file), read in one pass; the
    rows of every other action (one a data file, a file removed within the retention) are left in
    Arrow: half the time for a small table's checkpoint."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with store.open_input(name) as handle:
        checkpoint = pq.ParquetFile(handle)
        columns = [c for c in ("txn", "metaData") if c in checkpoint.schema_arrow.names]
        if not columns:
            return []
        table = checkpoint.read(columns=columns)
    wanted = pc.is_valid(table.column(columns[0]))
    for column in columns[1:]:
        wanted = pc.or_(wanted, pc.is_valid(table.column(column)))
    return table.filter(wanted).to_pylist()


def _log_file_actions(store: Storage, name: str) -> Iterator[Mapping[str, Any]]:
    """The actions of one JSON file of a ``_delta_log``; a line that is not JSON names the file."""
    for number, line in enumerate(store.read_text(name).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError as exc:
            table = store.root.rstrip("/").rsplit("/_delta_log", 1)[0]
            raise DeltaTableError(
                f"the Delta log file {store.uri(name)} is damaged (line {number} is not JSON: {exc}), so the Delta "
                f"table {table} cannot be read. Restore the file from a copy (a versioned bucket, a backup); or move "
                "the table's directory aside and resnapshot the table (pgdecode_backfill, mode resnapshot)"
            ) from None


def replay_log(spark: SparkSession, path: str) -> LogReplay | None:
    """The Delta log at ``path`` replayed (the module docstring says how); ``None``: no commit."""
    store = delta_log_storage(path)
    if store is None:
        return _replay_log_jvm(spark, path)
    log = log_actions(store)
    if log is None:
        return None
    version, actions = log
    replay = LogReplay(version)
    for action in actions:
        txn = action.get("txn")
        if txn and txn.get("appId") is not None and txn.get("version") is not None:
            # A transaction version only grows: Delta refuses one at or below the version it holds.
            app, number = str(txn["appId"]), int(txn["version"])
            replay.transactions[app] = max(number, replay.transactions.get(app, -1))
        if action.get("metaData"):
            replay.metadata = dict(action["metaData"])
    return replay


def _replay_log_jvm(spark: SparkSession, path: str) -> LogReplay | None:
    """:func:`replay_log` through Delta's own classes, for locations Python does not reach."""
    jvm: Any = getattr(spark, "_jvm", None)
    if jvm is None:
        raise ConfigurationError(
            f"the Delta table at {path} is on a filesystem this process cannot read, and the session is a Spark "
            "Connect client, which has no JVM to read it through: use a local path or an s3:// location as the "
            "Delta root, or run the job with spark-submit (a connection of type spark)"
        )
    delta_log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    snapshot = delta_log.update(
        getattr(delta_log, "update$default$1")(),
        getattr(delta_log, "update$default$2")(),
        getattr(delta_log, "update$default$3")(),
    )
    version = int(snapshot.version())
    if version < 0:
        return None

    def as_dict(scala_map: Any) -> dict[str, str]:
        found, iterator = {}, scala_map.iterator()
        while iterator.hasNext():
            entry = iterator.next()
            found[str(entry._1())] = str(entry._2())
        return found

    metadata = {
        "schemaString": snapshot.schema().json(),
        "configuration": as_dict(snapshot.metadata().configuration()),
    }
    transactions = {app: int(number) for app, number in as_dict(snapshot.transactions()).items()}
    return LogReplay(version, transactions, metadata)


def read_delta_state(spark: SparkSession, path: str, slot_app_id: str) -> DeltaState:
    """Version, watermark (the newest ``txn`` of ``slot_app_id``), schema and properties of the
    Delta table at ``path``; ``exists`` false when there is none."""
    replay = replay_log(spark, path)
    if replay is None:
        return DeltaState(False, -1, None, None, {})
    if replay.metadata is None:
        raise DeltaTableError(
            f"the Delta log at {path} (version {replay.version}) holds no table metadata: it is damaged or still "
            "being created. Nothing was written. Move the directory aside (or restore its _delta_log) and run the "
            "merge again"
        )
    return DeltaState(True, replay.version, replay.transactions.get(slot_app_id), replay.schema, replay.properties)
