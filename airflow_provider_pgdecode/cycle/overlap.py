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
    never, ``"auto"``: the faster way, as last measured).

    A step one after another takes a batch's extract alone and then its merge; an overlapped step
    takes from the start of a batch's merge until that merge and the next batch's extract beside
    it have both ended. The extract beside a merge decodes the next batch only (over a slot moved
    to its start: docs/extract.md, "Reading ahead of the slot"), but the two share the worker's
    cores: measured on two cores, a drain of 1,000,000-change batches took about as long either
    way; with cores to spare the overlap hides the shorter step. So ``"auto"`` starts one step
    after another, then tries one overlapped step, and from then on takes the way whose last
    measured step was shorter (a merge measured since counts for both)."""

    def __init__(self, overlap: bool | str) -> None:
        self.auto = str(overlap).strip().lower() == "auto"
        if not self.auto and yes_or_no(overlap) is None:
            raise ConfigurationError(f"overlap must be true, false or 'auto', not {overlap!r}")
        self.always = not self.auto and yes_or_no(overlap) is True
        self.extract_seconds: float | None = None
        self.merge_seconds: float | None = None
        self.overlapped_seconds: float | None = None

    def extracted_alone(self, seconds: float) -> None:
        self.extract_seconds = seconds

    def merged(self, seconds: float) -> None:
        self.merge_seconds = seconds

    def overlapped(self, seconds: float) -> None:
        """A merge and the extract beside it took ``seconds`` from the merge's start to the end of both."""
        self.overlapped_seconds = seconds

    def _one_after_another(self) -> float | None:
        if self.extract_seconds is None or self.merge_seconds is None:
            return None
        return self.extract_seconds + self.merge_seconds

    def ahead(self) -> bool:
        """Whether to extract the next batch beside the coming merge."""
        if not self.auto:
            return self.always
        serial = self._one_after_another()
        if serial is None:
            return False
        return self.overlapped_seconds is None or self.overlapped_seconds < serial

    def reason(self) -> str:
        """The measurements ``"auto"`` decided on, for the log."""
        if self.extract_seconds is None or self.merge_seconds is None:
            return "overlap auto: no step measured yet"
        serial = (
            f"a step one after another takes {self.extract_seconds + self.merge_seconds:.1f} s (an extract "
            f"alone {self.extract_seconds:.1f} s, the last merge {self.merge_seconds:.1f} s)"
        )
        if self.overlapped_seconds is None:
            return f"overlap auto: {serial}, an overlapped one is to be measured"
        return f"overlap auto: {serial}, the last overlapped one took {self.overlapped_seconds:.1f} s"


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
