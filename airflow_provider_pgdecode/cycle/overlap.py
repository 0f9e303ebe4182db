"""The drain's extract of the next batch, run in a thread while the current batch merges.

The drain (:class:`~airflow_provider_pgdecode.operators.drain.PgDecodeDrainOperator`) keeps at most
one batch ahead: while batch N's Spark job merges it, :class:`ExtractAhead` stages batch N+1 from
N's own checkpoint (:func:`staged_checkpoint`), so N+1 starts at N's end LSN and not at the slot's
confirmed position (the slot is still before N: N is not confirmed yet, and the extract skips what
the checkpoint says is staged). A slot serves one backend at a time, so the drain waits for the
thread (:meth:`ExtractAhead.wait`) before it confirms N; a merge that fails stops the thread
(:meth:`ExtractAhead.abandon`) and confirms nothing. A batch N+1 staged but never merged is picked up
by the next run as any staged, unconfirmed batch is: its extract starts at the last confirm and
stages the same range again (an identical batch is kept as it is).

Example::

    ahead = ExtractAhead(lambda kill: extract_once(arguments, context, log, kill))
    merge_once(merge_arguments, context, log)  # batch N, while N+1 is extracted
    ahead.wait()  # the slot is free again
    confirm_once(confirm_arguments, context, log)  # batch N
    summary = ahead.join()  # batch N+1, or its extract's error
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.cycle import KillSwitch
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.hooks.object_store import storage_for


def staged_checkpoint(batch_path: str, storage_conn_id: str | None) -> dict[str, Any]:
    """The checkpoint a confirm of the staged batch at ``batch_path`` would push (its end LSN, its
    pending prepared transactions, its snapshot state): where the batch after it starts."""
    return Checkpoint.from_manifest(BatchManifest.read(storage_for(batch_path, storage_conn_id))).to_dict()


class OverlapChoice:
    """Whether the drain extracts the next batch beside a merge (``overlap``: True always, False
    never, ``"auto"``: while it pays, from the last measured steps).

    An extract beside a merge starts before the slot is confirmed past the batch being merged, so
    PostgreSQL decodes that batch again (and the two steps share the worker's cores): measured on
    two cores, a 1,000,000-change extract beside a merge took about four times as long as alone.
    So ``"auto"`` extracts ahead only while the last merge took longer than the last extract run
    alone; it starts alone, and a batch extracted alone measures the extract again."""

    def __init__(self, overlap: bool | str) -> None:
        self.auto = str(overlap).strip().lower() == "auto"
        if not self.auto and yes_or_no(overlap) is None:
            raise ConfigurationError(f"overlap must be true, false or 'auto', not {overlap!r}")
        self.always = not self.auto and yes_or_no(overlap) is True
        self.extract_seconds: float | None = None
        self.merge_seconds: float | None = None

    def extracted_alone(self, seconds: float) -> None:
        self.extract_seconds = seconds

    def merged(self, seconds: float) -> None:
        self.merge_seconds = seconds

    def ahead(self) -> bool:
        """Whether to extract the next batch beside the coming merge."""
        if not self.auto:
            return self.always
        if self.extract_seconds is None or self.merge_seconds is None:
            return False
        return self.merge_seconds > self.extract_seconds

    def reason(self) -> str:
        """The measurements ``"auto"`` decided on, for the log."""
        if self.extract_seconds is None or self.merge_seconds is None:
            return "overlap auto: no merge measured yet"
        return (
            f"overlap auto: the last merge took {self.merge_seconds:.1f} s, an extract alone "
            f"{self.extract_seconds:.1f} s"
        )


class ExtractAhead:
    """``extract(kill)`` run at once in a thread of its own; ``kill`` (a :class:`KillSwitch` of its
    own) cancels its peek on the server."""

    def __init__(self, extract: Callable[[KillSwitch], dict[str, Any]], name: str = "pgdecode-extract-ahead") -> None:
        self.kill = KillSwitch()
        self._extract = extract
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._extract(self.kill)
        except BaseException as exc:  # handed to the drain's thread by join()
            self._error = exc

    def wait(self) -> None:
        """Until the extract has ended, one way or the other (its use of the slot is over)."""
        self._thread.join()

    def join(self) -> dict[str, Any]:
        """The extract's summary, once it has ended; its error, raised here, if it failed."""
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def abandon(self) -> None:
        """Cancel the extract (its peek, if it is reading the slot) and wait until it has ended; its
        result or error is dropped (what it staged is never confirmed: the next run stages it again)."""
        self.kill.pull()
        self.wait()
