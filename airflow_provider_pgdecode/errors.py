"""Every public error pgdecode raises, in one place. Each message says what is wrong, names the
object (slot, table, column, LSN, batch) and says what to do about it.

Errors are *deterministic* unless marked ``retryable``: running the same task again against the
same inputs fails the same way, so Airflow should not retry it (a slot of the wrong plugin, a
table without a key, a malformed batch). Errors that are not pgdecode's own (a refused
connection, a server restart, a network failure) are transient and left to Airflow's retries.
:func:`is_deterministic` is the one rule; operators, sensors and the backfill tasks apply it
through :func:`airflow_provider_pgdecode.utils.fail_fast.fail_fast`, which turns deterministic
errors into ``AirflowFailException`` (this module stays free of Airflow so that every layer
can import it).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar


class PgDecodeError(Exception):
    """Base class of every pgdecode error."""

    #: True when the same call may succeed later without anyone fixing anything.
    retryable: ClassVar[bool] = False


class DecodingError(PgDecodeError):
    """A row from the slot could not be parsed (a malformed or unexpected line)."""

    def __init__(self, message: str, *, lsn: object = None, data: str | bytes | None = None) -> None:
        detail = message
        if lsn is not None:
            detail += f" (row at LSN {lsn})"
        if data is not None:
            shown: str | bytes = data
            if len(data) > 300:
                shown = data[:300] + "..." if isinstance(data, str) else data[:300] + b"..."
            detail += f": {shown!r}"
        super().__init__(detail)
        self.lsn = lsn
        self.data = data


class AssemblyError(PgDecodeError):
    """The events of a slot do not form valid transactions (or need state that was lost)."""


class SlotError(PgDecodeError):
    """A replication slot is missing, of the wrong kind, lost, or cannot be used as asked."""


class SlotInUseError(SlotError):
    """Another process (an extract, a replication connection) holds the slot right now."""

    retryable = True


class SlotConnectionLostError(SlotError):
    """The server connection broke while a slot was read or advanced (a terminated backend, a
    server restart or crash): retrying on a new connection helps."""

    retryable = True


class StandbyWriteError(SlotError):
    """The source is a standby and something must be written on its primary, which the source
    connection does not name (``primary_conn_id`` in its extra)."""


class ServerNotReadyError(SlotError):
    """The server or the connected role lacks what a slot needs (``wal_level``, the REPLICATION attribute,
    a free slot or WAL sender, ``max_prepared_transactions``, a server version, an output plugin): the
    message names the setting to change. The wording lives in ``postgres/readiness.py``."""


class CatalogError(PgDecodeError):
    """A source table cannot be staged as asked (no usable key, a reserved column name, ...)."""


class StagingError(PgDecodeError):
    """A batch cannot be written or read back (incomplete, malformed, or inconsistent)."""


def staging_io_error(exc: OSError, path: str | os.PathLike[str], action: str) -> StagingError:
    """The :class:`StagingError` for an I/O error while staging or reading ``path``: names the path,
    the cause (``No space left on device``, ``Permission denied``...) and what to do about it.

    ``action`` is what was being done, as a verb phrase: ``"write Parquet part"``, ``"publish batch"``.
    """
    where = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes, os.PathLike)) else os.fspath(path)
    cause = exc.strerror or str(exc) or type(exc).__name__
    text = f"{cause} {exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "Disk quota" in text:
        advice = (
            "The staging filesystem is full: free space there (remove old batches, see the retention setting) or "
            "point the staging root at a larger filesystem"
        )
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) or "Permission denied" in text or "Read-only" in text:
        advice = "Check that the task's OS user may write there (permissions, ownership, a read-only mount)"
    elif os.fspath(path).startswith(("s3://", "s3a://")):
        advice = (
            "Check the object store: that its endpoint is reachable (endpoint_url in the storage_conn_id "
            "connection's extra), the bucket exists, and the connection's credentials may read and write there"
        )
    else:
        advice = "Check the staging filesystem (free space, permissions, that it is mounted and healthy)"
    return StagingError(
        f"cannot {action} {where}: {cause}. {advice}, then run the task again: a batch is published only once "
        "it is whole, so nothing half-written is read, and the slot is not advanced until its batch is merged"
    )


@contextmanager
def staging_io(path: str | os.PathLike[str], action: str) -> Iterator[None]:
    """Turn an ``OSError`` raised inside the block into :func:`staging_io_error` (the original kept
    as ``__cause__``); pgdecode's own errors pass through.

    Example::

        with staging_io(part, "write Parquet part"):
            pq.write_table(table, part)
    """
    try:
        yield
    except PgDecodeError:
        raise
    except OSError as exc:
        raise staging_io_error(exc, path, action) from exc


class ValueConversionError(StagingError):
    """A decoded value cannot be converted to its staged type."""


class BatchError(StagingError):
    """A batch cannot be merged: missing or incomplete manifest, missing files, inconsistent batches."""


class ConfigurationError(PgDecodeError, ValueError):
    """A task's arguments or connections cannot work as given (a missing connection, a bad parameter).

    Also a ``ValueError``, which is what Python code passing a bad argument expects."""


class SparkConnectUnreachableError(PgDecodeError):
    """A task's Spark Connect server cannot be reached: nothing listens at its address, or it went
    away while the task ran (its client gave up retrying, or the server no longer has the task's
    session). The message names the server (``sc://host:port``, never a token), the connection and
    how to start one; the wording lives in ``spark/session.py`` (``connect_unreachable_error``).

    Retryable: a server its supervisor restarts (docker's ``restart: always``) answers again, and a
    merge cut short commits each table whole or not at all, so the task's next try merges the rest.
    Each try gives up within a minute (``spark/connect_client.py``)."""

    retryable = True


class CheckpointError(PgDecodeError):
    """The checkpoint and the slot disagree in a way that would lose changes if ignored."""


class MergeInputError(PgDecodeError):
    """A batch's contents cannot be merged into its Delta table as they are (the message says why)."""


class DeltaTableError(MergeInputError):
    """A table's Delta table cannot be read or written (a damaged log, a directory it may not
    write): the merge parks that table (batch/parking.py) and merges the others."""


class StagedTooLargeError(MergeInputError):
    """A table's staged changes would not fit a shared Spark Connect server's memory: they are not
    sent, and the table is parked (spark/memory_budget.py) while the others merge."""


class MergeOutOfMemoryError(PgDecodeError):
    """The merge job ran out of memory (the JVM's heap): the message names the memory settings to change.

    Deterministic: the same batch with the same memory fails the same way."""


class VerifyError(PgDecodeError):
    """A verify run cannot compare Delta with PostgreSQL at its LSN (e.g. Delta moved past it meanwhile)."""


class VerifyMismatchError(VerifyError):
    """A verify run compared Delta with PostgreSQL at one LSN and found tables that differ."""


class MaintenanceError(PgDecodeError):
    """OPTIMIZE/VACUUM of a Delta table went wrong in a way that touches exactly-once (docs/maintenance.md)."""


class MaintenanceRefusedError(MaintenanceError):
    """A maintenance run refused a table before writing anything: a retention that would expire the
    slots' transaction ids, or a VACUUM retention below Delta's safety check without an opt-in."""


def is_deterministic(exc: BaseException) -> bool:
    """True when retrying cannot help: a pgdecode error not marked ``retryable``.

    Anything else (``psycopg.OperationalError`` for a refused connection or a restarting
    server, ``OSError`` on a network filesystem) is treated as transient.
    """
    return isinstance(exc, PgDecodeError) and not exc.retryable


class UnmappedTypeError(PgDecodeError):
    """A source column's catalog type has no mapping to a Delta type (see ``airflow_provider_pgdecode.typemap``)."""
