"""Whether a table's staged changes fit a shared Spark Connect server's memory, checked before they are sent.

One Spark Connect server merges for every source of a deployment. A batch whose values need
more heap than the server has would run it out of memory in the middle of a merge: the task fails
(or, with Spark's default, the server exits with code 52) and every source's merge waits on it. So
before a table's parts are read through a Connect session, the largest amount of data Spark must
hold at once for them is estimated from their Parquet footers and compared with the server's
heap; a table over it is refused (:class:`~airflow_provider_pgdecode.errors.StagedTooLargeError`)
and parked like any refused table (:mod:`.table_parking`), the others merge. A spark-submit merge
runs in an application of its own and is not checked: running out of memory there is reported as
such (``merge_job.out_of_memory_error``).

The estimate: Spark's Parquet reader holds one columnar batch of a row group at a time
(``spark.sql.parquet.columnarReaderBatchSize`` rows, 4096), and a row passes through a few copies
on its way to Delta (the column vectors, the row, the writer's page buffer, its compressed
output): ``COPIES`` times the largest batch's uncompressed bytes must fit in the heap Spark leaves
to tasks (the heap less its 300 MiB reserve).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_provider_pgdecode.errors import StagedTooLargeError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MIB = 1024 * 1024
RESERVED_BYTES = 300 * MIB
"""What Spark keeps of its heap for itself (``RESERVED_SYSTEM_MEMORY_BYTES``)."""
READ_BATCH_ROWS = 4096
"""Rows Spark's vectorized Parquet reader holds at once (``columnarReaderBatchSize``' default)."""
COPIES = 4
"""How many times a read batch is held on its way to Delta (see the module's docstring)."""
DEFAULT_HEAP = "1g"
"""Spark's default ``spark.driver.memory`` and ``spark.executor.memory``."""
_UNITS = {"": MIB, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB, "t": 1024 * 1024 * MIB}
_MEMORY = re.compile(r"^\s*(\d+)\s*([bkmgt]?)b?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class ServerMemory:
    """The heap a Spark Connect server's tasks run in: the setting it comes from and its value."""

    setting: str
    value: str
    heap_bytes: int

    @property
    def task_bytes(self) -> int:
        """What of the heap tasks may use (never below a tenth of it)."""
        return max(self.heap_bytes - RESERVED_BYTES, self.heap_bytes // 10)


@dataclass(frozen=True)
class LargestRead:
    """The largest read batch of a table's staged parts: where it is and how large."""

    file: str
    rows: int
    batch_bytes: int

    @property
    def needed_bytes(self) -> int:
        return self.batch_bytes * COPIES


def memory_bytes(text: str) -> int | None:
    """Bytes of a JVM memory string (``512m``, ``2g``, ``1024``: MiB without a unit, as Spark reads
    ``spark.driver.memory``); ``None`` when it is not one."""
    match = _MEMORY.match(text)
    if match is None:
        return None
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def largest_read(file: str, metadata: Any) -> LargestRead:
    """The largest read batch of one part, from its Parquet footer (``pyarrow.parquet.FileMetaData``):
    per row group, its uncompressed bytes times the share of its rows read at once."""
    best = LargestRead(file, 0, 0)
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        rows = group.num_rows
        if rows <= 0:
            continue
        batch_rows = min(rows, READ_BATCH_ROWS)
        batch_bytes = group.total_byte_size * batch_rows // rows
        if batch_bytes > best.batch_bytes:
            best = LargestRead(file, batch_rows, batch_bytes)
    return best


def server_memory(spark: SparkSession) -> ServerMemory:
    """The heap the server's tasks run in: the driver's under a local master (it runs them), the
    executors' otherwise; Spark's default when the setting cannot be read."""
    master = _conf(spark, "spark.master") or "local"
    setting = "spark.driver.memory" if master.startswith("local") else "spark.executor.memory"
    value = _conf(spark, setting) or DEFAULT_HEAP
    heap = memory_bytes(value)
    if heap is None:
        value, heap = DEFAULT_HEAP, memory_bytes(DEFAULT_HEAP)
    assert heap is not None
    return ServerMemory(setting, value, heap)


def _conf(spark: SparkSession, key: str) -> str | None:
    try:
        value = spark.conf.get(key, None)
    except Exception:  # a setting the server will not show: Spark's default applies
        return None
    return str(value) if value else None


def check_fits(table: str, read: LargestRead, server: ServerMemory) -> None:
    """Raise :class:`StagedTooLargeError` when ``read`` would not fit ``server``'s memory."""
    if read.needed_bytes <= server.task_bytes:
        return
    raise StagedTooLargeError(
        f"table {table}: its staged changes need about {_mib(read.needed_bytes)} of the Spark Connect server's "
        f"memory at once ({read.rows} row(s) of about {_mib(read.batch_bytes // max(read.rows, 1))} each read "
        f"together from {read.file}), more than its tasks have ({server.setting}={server.value}: about "
        f"{_mib(server.task_bytes)} beyond Spark's reserve). They were not sent, so the shared server keeps "
        "serving every source; nothing of the table was written. Give the server more memory (restart it with "
        "python -m airflow_provider_pgdecode.spark.connect_server --driver-memory 4g, or raise its "
        f"{server.setting}) and run the merge again: the table's parked changes catch up then. Or merge through "
        "spark-submit with more driver_memory. For the changes still to come, a lower max_value_bytes "
        "(table_options) quarantines such values at the extract"
    )


def _mib(size: int) -> str:
    return f"{size / MIB:.0f} MiB" if size >= MIB else f"{size} bytes"
