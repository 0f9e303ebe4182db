"""The drain overlaps the extract of batch N+1 with the merge of batch N (at most one batch ahead):
batches still chain LSN to LSN and are confirmed in order, each after its own merge and after the
extract beside it has let go of the slot; ``overlap=False`` runs the steps one after another. A drain
that fails between an extract and a merge (batch N+1 staged, batch N not merged) loses and doubles
nothing: the next run goes on from the last confirmed batch. PostgreSQL is the oracle, a keyless table
(a multiset) shows a doubled row."""

from __future__ import annotations

import posixpath
import threading
import time
from typing import Any

import pytest

from airflow_provider_pgdecode.capture import sessions
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.operators import drain as drain_module
from airflow_provider_pgdecode.postgres.slot import SlotClient, upper_slot_name
from pgdecode_testing.compare import compare_table
from tests.dags.test_drain import TABLE, backlog, drain_dag, slot_position, staged  # noqa: F401 - fixture
from tests.dags.test_pgdecode_incremental import airflow_db, run  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

BAG = "drain_bag"


class Phases:
    """The start and end of every extract, merge and confirm the drain runs, in the order they
    happened (a counter, not the clock), keyed by the LSN the extract starts at / the batch path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: bool = False) -> None:
        """``hold``: an extract ends only after the merge of the batch before it has ended (and a
        moment more), so that a confirm that did not wait for the extract beside the merge shows."""
        self.events: list[tuple[str, str, str]] = []  # (step, "start" | "end", key)
        self.extract_ended: dict[str, threading.Event] = {}  # by the LSN the extract starts at
        self.merge_ended: dict[str, threading.Event] = {}  # by the end LSN of the batch merged
        self.merge_hook: Any = None  # called with the batch's summary before a merge runs
        self._lock = threading.Lock()
        self._monkeypatch = monkeypatch
        self.originals = extract, merge, confirm = (
            drain_module.extract_once,
            drain_module.merge_once,
            drain_module.confirm_once,
        )

        def extract_once(arguments, *args, **kwargs):
            start = str(arguments.checkpoint["end_lsn"])
            self._event("extract", "start", start)
            try:
                summary = extract(arguments, *args, **kwargs)
                if hold and threading.current_thread() is not threading.main_thread():  # an extract ahead
                    self.ended(self.merge_ended, start).wait(300)
                    time.sleep(0.5)
            finally:
                self._event("extract", "end", start)
                self.ended(self.extract_ended, start).set()
            return summary

        def merge_once(arguments, *args, **kwargs):
            path = name(arguments.batch_paths[0])
            self._event("merge", "start", path)
            if self.merge_hook is not None:
                self.merge_hook(path)
            job = merge(arguments, *args, **kwargs)
            self._event("merge", "end", path)
            self.ended(self.merge_ended, str(Lsn(int(path.split("-")[1], 16)))).set()
            return job

        def confirm_once(arguments, *args, **kwargs):
            self._event("confirm", "start", name(arguments.batch_path))
            return confirm(arguments, *args, **kwargs)

        monkeypatch.setattr(drain_module, "extract_once", extract_once)
        monkeypatch.setattr(drain_module, "merge_once", merge_once)
        monkeypatch.setattr(drain_module, "confirm_once", confirm_once)

    def ended(self, events: dict[str, threading.Event], key: str) -> threading.Event:
        with self._lock:
            return events.setdefault(key, threading.Event())

    def restore(self) -> None:
        for attribute, original in zip(("extract_once", "merge_once", "confirm_once"), self.originals, strict=True):
            self._monkeypatch.setattr(drain_module, attribute, original)

    def _event(self, step: str, phase: str, key: str) -> None:
        with self._lock:
            self.events.append((step, phase, key))

    def at(self, step: str, phase: str, key: str) -> int:
        return self.events.index((step, phase, key))

    def confirmed(self) -> list[str]:
        return [key for step, _, key in self.events if step == "confirm"]

    def overlapping(self, batches: list[Any]) -> list[str]:
        """The batches whose merge ran while the next batch was extracted."""
        found = []
        for batch, after in zip(batches, batches[1:], strict=False):
            merge_start, merge_end = (
                self.at("merge", "start", name(batch.path)),
                self.at("merge", "end", name(batch.path)),
            )
            extract_start = self.at("extract", "start", after.start_lsn)
            extract_end = self.at("extract", "end", after.start_lsn)
            if extract_start < merge_end and merge_start < extract_end:
                found.append(batch.label)
        return found


def name(path: Any) -> str:
    """A batch's directory name (``<start>-<end>``), however its path is spelled."""
    return posixpath.basename(str(path).rstrip("/"))


def drained(conf: dict, before: int) -> list[Any]:
    return staged(conf)[before:]


def assert_chain_confirmed_in_order(c, conf: dict, batches: list[Any], phases: Phases, overlap: bool) -> None:
    every = staged(conf)
    assert all(b.start_lsn == a.end_lsn for a, b in zip(every, every[1:], strict=False))
    assert len({b.start_lsn for b in every}) == len(every)  # no range staged twice
    assert phases.confirmed() == [name(b.path) for b in batches]  # each drained batch confirmed once, in order
    for batch, after in zip(batches, batches[1:], strict=False):
        confirm = phases.at("confirm", "start", name(batch.path))
        assert phases.at("merge", "end", name(batch.path)) < confirm  # after its own merge
        assert confirm < phases.at("merge", "start", name(after.path))  # before the next batch's merge
        if overlap:  # after the next batch's extract let go of the slot
            assert phases.at("extract", "end", after.start_lsn) < confirm, phases.events
        else:
            assert confirm < phases.at("extract", "start", after.start_lsn)
    assert slot_position(c, conf["slot_name"]) == batches[-1].end_lsn


def test_the_drain_extracts_the_next_batch_while_a_batch_merges(pg_conn, drain_dag, spark, monkeypatch) -> None:  # noqa: F811
    dag, conf = drain_dag
    c = pg_conn
    run(dag, conf)  # creates the slot
    task = dag.get_task("drain")

    # Overlap off: one step after another.
    monkeypatch.setattr(task, "overlap", False)
    backlog(c, 0)
    phases = Phases(monkeypatch)
    cycle_batches = len(staged(conf)) + 1  # the cycle's own batch comes first
    run(dag, conf)
    batches = drained(conf, cycle_batches)
    assert len(batches) >= 4
    assert_chain_confirmed_in_order(c, conf, batches, phases, overlap=False)
    assert phases.overlapping(batches) == []
    result = compare_table(c, spark, conf["delta_root"], "public", TABLE)
    assert result.equal, result.describe()

    # Overlap on: each next batch is extracted while the one before merges, over a copy of the slot
    # moved to its start (however little WAL the batch before holds).
    monkeypatch.setattr(task, "overlap", True)
    monkeypatch.setattr(sessions, "MIN_AHEAD_WAL_BYTES", 1)
    slots = SlotClient(c)
    if slots.describe(conf["slot_name"]).two_phase:  # test_decoding: read ahead over its upper-half slot
        slots.create(str(upper_slot_name(conf["slot_name"])), "test_decoding", two_phase=True)
    backlog(c, 1000)
    phases.restore()
    phases = Phases(monkeypatch, hold=True)
    cycle_batches = len(staged(conf)) + 1
    run(dag, conf)
    batches = drained(conf, cycle_batches)
    assert len(batches) >= 4
    assert_chain_confirmed_in_order(c, conf, batches, phases, overlap=True)
    assert len(phases.overlapping(batches)) >= len(batches) // 2, phases.events
    overlapped = set(phases.overlapping(batches))
    ahead = [after for batch, after in zip(batches, batches[1:], strict=False) if batch.label in overlapped]
    # the batch being merged was not delivered again (the slot itself, still before it, would)
    assert ahead and all(b.skipped.get("already_handled") == 0 for b in ahead), [b.skipped for b in ahead]
    result = compare_table(c, spark, conf["delta_root"], "public", TABLE)
    assert result.equal, result.describe()


def path_through(batches: list[Any]) -> list[Any] | None:
    """Batches chained LSN to LSN from the first batch's start to the last batch's end."""

    def walk(chain: list[Any]) -> list[Any] | None:
        if chain[-1] is batches[-1]:
            return chain
        for following in (b for b in batches if b.start_lsn == chain[-1].end_lsn):
            if (found := walk([*chain, following])) is not None:
                return found
        return None

    return walk([batches[0]])


def bag_rows(c, n: int) -> None:
    """Identical rows in a keyless table: a batch applied twice would show them doubled."""
    c.execute(f"insert into {BAG} select 'same' from generate_series(1, {n})")


def test_a_drain_failing_between_an_extract_and_a_merge_loses_and_doubles_nothing(
    pg_conn,
    drain_dag,  # noqa: F811
    spark,
    monkeypatch,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.utils.state import DagRunState

    dag, conf = drain_dag
    c = pg_conn
    c.execute(f"drop table if exists {BAG}; create table {BAG} (note text); alter table {BAG} replica identity full")
    conf = {**conf, "tables": [*conf["tables"], f"public.{BAG}"]}
    run(dag, conf)  # creates the slot
    for first in (0, 1000):
        bag_rows(c, 30)
        backlog(c, first)
        bag_rows(c, 30)
    c.execute(f"delete from {BAG} where ctid in (select ctid from {BAG} limit 7)")

    monkeypatch.setattr(dag.get_task("drain"), "overlap", True)  # N+1 staged while N merges
    phases = Phases(monkeypatch)
    merges = {"n": 0}

    def fail_the_second(path: str) -> None:
        """The second drained batch's merge fails once the batch after it is staged."""
        merges["n"] += 1
        if merges["n"] == 2:
            batch = next(b for b in staged(conf) if name(b.path) == path)
            assert phases.ended(phases.extract_ended, batch.end_lsn).wait(300)
            raise AirflowFailException("killed between an extract and a merge")

    phases.merge_hook = fail_the_second
    before = len(staged(conf))
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == DagRunState.FAILED
    assert {ti.task_id: ti.state for ti in dag_run.get_task_instances()}["drain"] == "failed"
    after_kill = staged(conf)
    # the cycle's batch, the first drained batch (both confirmed), the failed batch N and N+1 staged
    assert len(after_kill) == before + 4, [b.label for b in after_kill]
    failed, ahead = after_kill[-2], after_kill[-1]
    assert ahead.start_lsn == failed.end_lsn
    assert slot_position(c, conf["slot_name"]) == failed.start_lsn  # nothing confirmed past Delta
    assert phases.confirmed() == [name(after_kill[-3].path)]

    phases.restore()
    run(dag, conf)
    every = staged(conf)
    labels = [b.label for b in every]
    # The rerun starts after the last confirmed batch and extracts the failed batch's range again: the
    # same batches when the bounds cut them alike (kept as they are), else new ones beside them. Only
    # the failed run's two unconfirmed batches may lie off the chain that reaches the end.
    chain = path_through(every)
    assert chain is not None and every[-1].bounded_by is None, labels
    assert {b.label for b in every} - {b.label for b in chain} <= {failed.label, ahead.label}, labels
    assert slot_position(c, conf["slot_name"]) == every[-1].end_lsn
    for table in (TABLE, BAG):
        result = compare_table(c, spark, conf["delta_root"], "public", table)
        assert result.equal, result.describe()
