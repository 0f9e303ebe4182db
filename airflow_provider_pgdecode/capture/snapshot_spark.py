"""The initial load's chunk copy as the tasks of one Spark job: the copy scales with executors.

:func:`~airflow_provider_pgdecode.capture.snapshot.stage_snapshot` given a ``spark`` session plans
the chunks on the driver (the Airflow worker, which holds the slot's exported snapshot) and hands
them to :func:`copy_on_spark`: one task per chunk, each opening its own connection, importing the
snapshot (``REPEATABLE READ``, ``SET TRANSACTION SNAPSHOT``) and copying its chunk with the
thread path's code (:func:`~airflow_provider_pgdecode.capture.snapshot_parts.copy_chunk`) straight
to the staging root: into the copy's work directory on a local staging root (which every executor
must mount at the same path), or, on object storage, into a local temporary directory and then
uploaded, one PUT per part, to the batch's final place (invisible until the driver uploads the
manifest last). A part's name depends on its chunk only and it is written under a name of its own
attempt, then renamed (or uploaded whole): a task retried after its executor died writes its chunk
again whole, and the driver records each chunk once, from the result of the attempt Spark kept.
How and why: docs/backfill.md, "How the initial copy works".

No PySpark import: the session is used as given (a classic one: Spark Connect has no RDDs), and
the tasks run this module's functions on executors whose Python has this package and psycopg
(``PYSPARK_PYTHON``; :func:`~airflow_provider_pgdecode.spark.session.build_spark_session` sets it
to the worker's own, as the merge job's sessions do).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage
from airflow_provider_pgdecode.capture.snapshot_parts import ChunkCopy, ChunkSource, copy_chunk
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, StagingError
from airflow_provider_pgdecode.postgres.session import SCAN_GUCS, commit, connect
from airflow_provider_pgdecode.postgres.snapshot_queries import import_snapshot

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

Plan = TypeVar("Plan", bound=ChunkSource)

FAULT_ENV = "PGDECODE_SNAPSHOT_TASK_FAULT"
"""For tests: ``<schema.table>:<chunk>:<marker file>`` makes the first attempt of that chunk's task
(the one that finds no marker file) create the marker and exit its Python worker abruptly after
writing the part's first row group, as an executor dying mid-copy would; with no marker file
(``<schema.table>:<chunk>:``) every attempt dies. Set it in the session's ``sparkContext.environment``."""


@dataclass(frozen=True)
class CopyJob:
    """What every task needs besides its chunk (pickled to the executors with it)."""

    dsn: str
    snapshot_name: str
    slot_name: str
    workdir: str
    lsn: int
    chunk_rows: int
    replace: bool
    remote: str | None = None
    """On object storage: the batch's final location, where each task uploads its chunk's parts
    (one PUT each: whole or absent; invisible until the driver uploads the manifest last)."""
    settings: ObjectStoreSettings | None = field(default=None, repr=False)


def copy_on_spark(
    spark: SparkSession, job: CopyJob, chunks: Sequence[tuple[Plan, int]]
) -> Iterator[tuple[Plan, int, ChunkCopy]]:
    """Copy ``chunks`` (table plan, chunk index) as one Spark job of one task per chunk; yield
    each chunk with its copy, in the order given, once the job has finished."""
    context = spark_context(spark)
    if not chunks:
        return
    items = list(enumerate((plan, index) for plan, index in chunks))
    log.info(
        "Snapshot copy: %d chunk(s) to copy as Spark tasks (default parallelism %s)",
        len(items),
        context.defaultParallelism,
    )
    context.setJobDescription(f"pgdecode initial load of slot {job.slot_name}: {len(items)} chunk(s)")
    rdd = context.parallelize(items, len(items)).mapPartitions(functools.partial(copy_task, job))
    try:
        results = dict(rdd.collect())
    except Exception as exc:  # py4j's error, with the task's traceback in its text
        raise StagingError(
            f"the snapshot copy for slot {job.slot_name!r} on Spark failed: {_last_line(exc)}. The chunks its "
            f"tasks finished are kept: call stage_snapshot again while the slot's snapshot is still exported to "
            "copy the others"
        ) from exc
    finally:
        context.setJobDescription(None)
    for position, (plan, index) in items:
        yield plan, index, results[position]


def spark_context(spark: Any) -> Any:
    """The SparkContext of a classic session; a Spark Connect session is refused (no RDDs)."""
    try:
        return spark.sparkContext
    except Exception as exc:  # Connect: PySparkNotImplementedError (JVM_ATTRIBUTE_NOT_SUPPORTED)
        raise ConfigurationError(
            "the snapshot copy on Spark needs a classic SparkSession (its tasks are Python functions on "
            "executors): Spark Connect cannot run them. Build one with build_spark_session(master)"
        ) from exc


def copy_task(job: CopyJob, items: Iterable[tuple[int, tuple[ChunkSource, int]]]) -> list[tuple[int, ChunkCopy]]:
    """One task (on an executor): import the snapshot over a connection of its own and copy its
    chunk(s) into the work directory."""
    todo = list(items)
    if not todo:
        return []
    done = []
    local = None if job.remote is None else Path(tempfile.mkdtemp(prefix="pgdecode-chunk-"))
    conn = connect(job.dsn)
    try:
        import_snapshot(conn, job.snapshot_name, job.slot_name, extra_settings=SCAN_GUCS)
        for position, (plan, index) in todo:
            if local is not None:
                (local / plan.relpath).mkdir(parents=True, exist_ok=True)
            copied = copy_chunk(
                conn,
                plan,
                index,
                local or Path(job.workdir),
                Lsn(job.lsn),
                job.chunk_rows,
                job.replace,
                after_write=injected_fault(plan.name, index),
            )
            if local is not None and job.remote is not None:
                upload_parts(Storage(job.remote, job.settings), local, plan.relpath, copied)
            # The parts are in place: say so beside them, for a driver whose job fails later.
            job_store(job).write_text(f"{plan.relpath}/{record_name(index)}", json.dumps(copied._asdict()))
            done.append((position, copied))
        commit(conn)
    finally:
        conn.close()
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
    return done


def record_name(index: int) -> str:
    """The file a task writes beside chunk ``index``'s parts once they are in place."""
    return f"chunk-{index:05d}.json"


def job_store(job: CopyJob) -> Storage:
    """Where the tasks write: the batch's final place on object storage, else the work directory."""
    return Storage(job.remote, job.settings) if job.remote is not None else Storage(job.workdir)


def finished_chunks(job: CopyJob, chunks: Sequence[tuple[Plan, int]]) -> list[tuple[Plan, int, ChunkCopy]]:
    """The chunks of a failed job whose tasks finished (their record written after their parts),
    each with its copy, so that the next call does not copy them again."""
    store = job_store(job)
    found = []
    for plan, index in chunks:
        name = f"{plan.relpath}/{record_name(index)}"
        if store.is_file(name):
            found.append((plan, index, ChunkCopy(**json.loads(store.read_text(name)))))
    return found


def upload_parts(batch: Storage, local: Path, relpath: str, copied: ChunkCopy) -> None:
    """Upload a chunk's parts, written whole in ``local``, to ``<batch>/<relpath>/`` (same names)."""
    for name in (copied.truncate, copied.file):
        if name is None:
            continue
        with open(local / relpath / name, "rb") as src, batch.open_output(f"{relpath}/{name}") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        (local / relpath / name).unlink()


def injected_fault(table: str, index: int) -> Callable[[int], None] | None:
    """The fault :data:`FAULT_ENV` asks for at this chunk, if any."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    name, chunk, marker = spec.split(":", 2)
    if name != table or int(chunk) != index or (marker and os.path.exists(marker)):
        return None

    def die(rows: int) -> None:
        if marker:
            Path(marker).write_text(f"{os.getpid()} {rows}\n", encoding="utf-8")
        os._exit(13)  # no cleanup, no exception back to Spark: the worker just vanishes

    return die


def _last_line(exc: BaseException) -> str:
    """Spark's reason (``Job aborted due to stage failure: ...``) and the task's own error, from
    py4j's long text."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next((line for line in lines if "Job aborted" in line), lines[0] if lines else type(exc).__name__)
    cause = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line) and "Job aborted" not in line]
    text = reason if not cause or cause[-1] in reason else f"{reason} ({cause[-1]})"
    return text[:800]


__all__ = ["FAULT_ENV", "CopyJob", "copy_on_spark", "copy_task", "finished_chunks", "spark_context"]
