"""Drain a backlog in one DAG run: the cycle's own extract, merge and confirm, in a loop."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.cycle import CycleTask, KillSwitch
from airflow_provider_pgdecode.cycle.confirm import ConfirmArguments, confirm_once
from airflow_provider_pgdecode.cycle.extract import ExtractArguments, extract_once
from airflow_provider_pgdecode.cycle.merge import MergeArguments, merge_once
from airflow_provider_pgdecode.cycle.overlap import ExtractAhead, OverlapChoice, staged_checkpoint
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.utils import metrics
from airflow_provider_pgdecode.utils.xcom import checkpoint_xcom_key

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

Arguments = TypeVar("Arguments", ExtractArguments, MergeArguments, ConfirmArguments)


def eta_seconds(lag_bytes: int, drained_bytes: int, written_bytes: int, seconds: float) -> float | None:
    """How long the WAL left takes to drain at the rates so far: 0 with nothing left, ``None``
    when unknown (nothing drained yet), ``inf`` when the source writes as fast as the drain reads.

    The source keeps writing while the drain reads, so the lag shrinks at the drain's rate minus
    the source's (``written_bytes``: how far the server's WAL position moved meanwhile).
    """
    if lag_bytes <= 0:
        return 0.0
    if drained_bytes <= 0 or seconds <= 0:
        return None
    gain = (drained_bytes - written_bytes) / seconds
    return lag_bytes / gain if gain > 0 else math.inf


def eta_text(lag_bytes: int, drained_bytes: int, written_bytes: int, seconds: float) -> str:
    """:func:`eta_seconds` in words; when the source is as fast, not a number but a warning."""
    left = eta_seconds(lag_bytes, drained_bytes, written_bytes, seconds)
    if left == 0:
        return "nothing"
    if left is None:
        return "an unknown time"
    if math.isinf(left):
        return "no end at these rates (the source writes WAL as fast as the drain reads it)"
    return f"{left / 60:.1f} min" if left >= 90 else f"{left:.0f} s"


class PgDecodeDrainOperator(BaseOperator):
    """After a cycle's first batch, run more batches until the slot is caught up.

    A batch is bounded (``max_batch_changes``, ``max_batch_wal_bytes`` of the extract task), so
    after downtime one batch does not hold everything. When the cycle's batch ended at a bound,
    this task runs the cycle's **own** extract, merge and confirm again (the library calls of
    :mod:`airflow_provider_pgdecode.cycle` that those tasks make, with the arguments the tasks of the
    DAG render for this run) in a loop: extract a batch from the last checkpoint, merge it,
    confirm it, until a batch reaches the server's WAL position or ``max_batches`` batches ran.
    Each batch is confirmed only after its own Delta commit, in order, and its
    checkpoint is pushed to XCom at once (the extract task reads the latest of the confirm's and
    this task's), so a run killed between two batches resumes after the last confirmed one.

    With ``overlap``, the extract of batch N+1 runs in a thread while batch N merges (by default
    only while that pays, as measured), at most one batch ahead
    (:mod:`airflow_provider_pgdecode.cycle.overlap`): N+1 starts at N's end LSN (from N's staged
    manifest, N not being confirmed yet; it is read over a slot moved there, the slot staying
    where it is until N's confirm), the thread has ended (its
    use of the slot over) before N is confirmed, and N+1 is confirmed after its own merge. A merge
    that fails cancels the extract running beside it and confirms nothing; an extract that fails
    lets the merge beside it finish and its batch be confirmed, then fails the task. A batch
    staged ahead and never merged is staged again (the same range, kept as it is) by the next run.
    ``overlap=False`` runs the steps one after another: extract, merge, confirm, then the next.
    Each batch logs its progress: batches done, changes per second, WAL lag left and the time
    left at the rate so far. With Airflow's OpenLineage provider configured, each merged batch is
    an OpenLineage run of its own (job ``<dag_id>.<task_id>.batch``, a child of this task's run:
    its PostgreSQL tables in, its Delta tables out, the ``pgdecode`` facet of its LSN range), and
    this task's own COMPLETE event sums up all its batches (docs/lineage.md).

    A loop in one task rather than dynamic task mapping: a batch's end is only known once it is
    extracted, so the batches cannot be planned as mapped task instances up front, and mapped
    instances do not run one after another, while each batch must be confirmed in order, before the
    next one is.

    The incremental DAG's wiring (:func:`~airflow_provider_pgdecode.example_dags.cycle.build_cycle`).
    Example::

        from airflow_provider_pgdecode.operators.drain import PgDecodeDrainOperator

        drain = PgDecodeDrainOperator(task_id="drain", slot_name="pgdecode_shop")
        extract >> merge >> confirm >> drain

    :param slot_name: the replication slot (for the checkpoint's XCom key). (templated)
    :param postgres_conn_id: the slot's database, for the lag in the progress log. (templated)
    :param extract_task_id: the cycle's extract task (its summary says whether a bound ended the
        batch). (templated)
    :param merge_task_id: the cycle's merge task. (templated)
    :param confirm_task_id: the cycle's confirm task (its checkpoint is where the loop starts).
        (templated)
    :param max_batches: at most this many batches in this task (``None``: until caught up); the
        next run goes on from there. (templated)
    :param enabled: ``False`` skips the loop (one batch per run). (templated)
    :param overlap: ``"auto"`` (default): extract the next batch while the current one merges
        when the last overlapped step measured took less than the last step one after another (one
        is tried after the first batch: :class:`~airflow_provider_pgdecode.cycle.overlap.OverlapChoice`);
        ``True``: always;
        ``False``: one step after another. (templated)
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "postgres_conn_id",
        "extract_task_id",
        "merge_task_id",
        "confirm_task_id",
        "max_batches",
        "enabled",
        "overlap",
    )
    ui_color = "#d9e6f0"

    def __init__(
        self,
        *,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        extract_task_id: str = "extract",
        merge_task_id: str = "merge",
        confirm_task_id: str = "confirm",
        max_batches: int | str | None = None,
        enabled: bool | str = True,
        overlap: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.extract_task_id = extract_task_id
        self.merge_task_id = merge_task_id
        self.confirm_task_id = confirm_task_id
        self.max_batches = max_batches
        self.enabled = enabled
        self.overlap = overlap
        self._kill = KillSwitch()
        self._ahead: ExtractAhead | None = None
        self._merged: list[tuple[list[BatchManifest], dict[str, Any] | None]] = []

    def _cycle_arguments(self, context: Context, task_id: str, kind: type[Arguments]) -> Arguments:
        """The rendered arguments of one of the cycle's tasks (the DAG's task stays as it is)."""
        task = context["dag"].get_task(task_id)
        arguments = task.cycle_arguments(context) if isinstance(task, CycleTask) else None
        if not isinstance(arguments, kind):
            role = kind.OPERATOR.removeprefix("PgDecode").removesuffix("Operator").lower()
            raise ConfigurationError(
                f"task {task_id!r} is a {type(task).__name__}, not a {kind.OPERATOR}: set {self.task_id}'s "
                f"{role}_task_id to the cycle's task"
            )
        return arguments

    def execute(self, context: Context) -> dict[str, Any]:
        ti = context["ti"]
        first = ti.xcom_pull(task_ids=self.extract_task_id)
        result: dict[str, Any] = {"batches": 0, "changes": 0, "caught_up": True, "end_lsn": None}
        self._merged = []
        if not isinstance(first, dict) or not first.get("bounded_by"):
            self.log.info("The cycle's batch reached the server's WAL position: nothing to drain")
            self._carry_checkpoint(ti)
            return result
        if yes_or_no(self.enabled) is False or str(self.enabled).strip() == "":
            self.log.info("The batch ended at its %s bound; draining is off, the next run goes on", first["bounded_by"])
            result["caught_up"] = False
            self._carry_checkpoint(ti)
            return result
        limit = None if self.max_batches in (None, "", "None") else int(self.max_batches)
        extract = self._cycle_arguments(context, self.extract_task_id, ExtractArguments)
        merge = self._cycle_arguments(context, self.merge_task_id, MergeArguments)
        # The loop merges each batch itself, just before confirming it.
        confirm = replace(self._cycle_arguments(context, self.confirm_task_id, ConfirmArguments), merge_task_id=None)
        checkpoint = ti.xcom_pull(task_ids=self.confirm_task_id, key=checkpoint_xcom_key(self.slot_name))
        started = time.monotonic()
        start_lsn = Lsn.parse(str(first["end_lsn"]))
        start_wal = self._server_wal()
        summary: dict[str, Any] = first
        self.log.info(
            "The cycle's batch ended at its %s bound at %s: draining the backlog batch by batch",
            first["bounded_by"],
            start_lsn,
        )
        choice = OverlapChoice(self.overlap)
        overlapping: bool | None = None
        try:
            while summary.get("bounded_by") and (limit is None or result["batches"] < limit):
                if self._ahead is not None:  # extracted while the batch before merged
                    summary, self._ahead = self._ahead.join(), None
                else:
                    began = time.monotonic()
                    summary = extract_once(replace(extract, checkpoint=checkpoint), context, self.log, self._kill)
                    choice.extracted_alone(time.monotonic() - began)
                more = summary.get("bounded_by") and (limit is None or result["batches"] + 1 < limit)
                if more and choice.auto and choice.ahead() != overlapping:
                    overlapping = choice.ahead()
                    self.log.info(
                        "%s: the next batch extracted %s", choice.reason(), "beside" if overlapping else "alone"
                    )
                if more and choice.ahead():
                    self._ahead = self._extract_ahead(extract, summary, context)
                began = time.monotonic()
                self._merge(merge, summary, context)
                choice.merged(time.monotonic() - began)
                if self._ahead is not None:
                    self._ahead.wait()  # the slot serves one backend at a time: the peek is over
                    choice.overlapped(time.monotonic() - began)
                # Also pushes the checkpoint to XCom under the slot's key.
                checkpoint = confirm_once(replace(confirm, batch_path=summary["path"]), context, self.log)
                result["batches"] += 1
                result["changes"] += int(summary.get("changes") or 0)
                result["end_lsn"] = summary["end_lsn"]
                self._log_progress(result, start_lsn, start_wal, Lsn.parse(str(summary["end_lsn"])), started)
        finally:
            if self._ahead is not None:  # a step failed: the extract beside it is cancelled
                self._ahead.abandon()
                self._ahead = None
        result["caught_up"] = not summary.get("bounded_by")
        if not result["caught_up"]:
            self.log.info(
                "Stopped after max_batches=%s batches; the next run goes on from %s", limit, summary["end_lsn"]
            )
        return result

    def _extract_ahead(self, extract: ExtractArguments, batch: dict[str, Any], context: Context) -> ExtractAhead:
        """The extract of the batch after ``batch``, started in a thread: from ``batch``'s own
        checkpoint (its end LSN; the slot is still before it), not from the slot's position."""
        ahead = replace(extract, checkpoint=staged_checkpoint(str(batch["path"]), extract.storage_conn_id))
        self.log.info("Extracting the next batch from %s while batch %s merges", batch["end_lsn"], batch["path"])
        # extract_once looked up at call time (a test replaces it here)
        return ExtractAhead(lambda kill: extract_once(ahead, context, self.log, kill))

    def _merge(self, merge: MergeArguments, batch: dict[str, Any], context: Context) -> None:
        merged = merge_once(replace(merge, batch_paths=[batch["path"]]), context, self.log, self._kill)
        self._batch_lineage(context, *merged.lineage)

    def _batch_lineage(self, context: Context, batches: list[BatchManifest], summary: dict[str, Any] | None) -> None:
        """The OpenLineage event of a batch the merge ran for (none for a batch without rows: nothing
        was submitted); a lineage failure is logged, never the drain's."""
        if not batches and summary is None:
            return
        self._merged.append((batches, summary))
        try:
            from airflow_provider_pgdecode.utils.openlineage import emit_batch_lineage
        except ImportError:  # the openlineage extra is not installed
            return
        try:
            emit_batch_lineage(self, context["ti"], batches, summary)
        except Exception as exc:
            self.log.warning("Could not emit the OpenLineage event of the batch: %s", exc, exc_info=True)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """OpenLineage of the run (Airflow's OpenLineage provider calls it after success): every
        batch this task merged, as one merge (inputs, outputs, the ``pgdecode`` facet of their LSN
        range); each batch has its own event too. See docs/lineage.md."""
        from airflow_provider_pgdecode.utils.openlineage import drain_lineage

        return drain_lineage(self._merged)

    def _carry_checkpoint(self, ti: Any) -> None:
        """This run's checkpoint (the confirm's), pushed under this task's key too, as a drain that
        confirms batches does: the next run's extract reads the key of every checkpoint task that
        has succeeded, and finds one here whether this run drained or not."""
        key = checkpoint_xcom_key(self.slot_name)
        checkpoint = ti.xcom_pull(task_ids=self.confirm_task_id, key=key)
        if checkpoint is not None:
            ti.xcom_push(key=key, value=checkpoint)

    def _server_wal(self) -> int:
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            return int(hook.current_flush_lsn())

    def _log_progress(self, result: dict[str, Any], start: Lsn, start_wal: int, end: Lsn, started: float) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        wal = self._server_wal()
        lag = max(wal - int(end), 0)
        metrics.emit("drain.backlog_bytes", lag, str(self.slot_name))
        left = eta_seconds(lag, int(end) - int(start), wal - start_wal, elapsed)
        if left is not None and math.isfinite(left):
            metrics.emit("drain.eta_seconds", left, str(self.slot_name))
        self.log.info(
            "Drain: %d batch(es) done, %d changes (%.0f changes/s), at %s, %d bytes of WAL left, %s to catch up",
            result["batches"],
            result["changes"],
            result["changes"] / elapsed,
            end,
            lag,
            eta_text(lag, int(end) - int(start), wal - start_wal, elapsed),
        )

    def on_kill(self) -> None:
        """Stop the batch in progress (the extract's peek, the merge's Spark work); confirmed
        batches stay confirmed and the next run starts after the last of them."""
        self._kill.pull()
        ahead = self._ahead
        if ahead is not None:  # the next batch's extract, beside the merge
            ahead.kill.pull()
