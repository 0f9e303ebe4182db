"""The incremental DAG killed with SIGKILL at random points of random cycles, under a live writer.

Each cycle is ``airflow dags test pgdecode_incremental`` in its own process group; a kill takes
the whole group (the CLI, the in-process tasks, spark-submit, the Spark JVM and its Python
driver) at once. Kills are aimed at the phases of a cycle (the sensors, the extract, the merge,
just after a table's Delta commit, the confirm, the drain's loop of bounded batches) with seeded random delays after the line that
starts the phase, so most land mid-extract, mid-merge or around the confirm and few cycles run
in full. After the kills the writer stops, its prepared transactions are resolved, and clean
cycles catch Delta up: every table must equal its source with no key twice.

Replay a failure with ``PGDECODE_FAULT_SEED=<seed>`` (the seed and every kill are logged, and
each cycle's output is kept under the test's ``logs/`` directory).
"""

from __future__ import annotations

import logging
import os
import random
import time

import pytest

from tests.conftest import full_only_test
from tests.faults.conftest import assert_caught_up, slot_position
from tests.faults.dagproc import DagProcess, KillPlan, RunResult
from tests.faults.writer import SCHEMA, TABLES, Writer

# A soak test (about twenty minutes): `make test` lands its faults at set points instead.
SOAK = (
    "a soak test of kills at random points; make test kills at set points: a Connect client after a Delta"
    " commit (tests/spark/test_connect.py), a spark-submit (tests/operators/test_merge.py)"
)
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.timeout(2400),
    full_only_test(SOAK),
]

log = logging.getLogger(__name__)

# Every phase is hit, and the windows where invariant 1 is at stake (after a table's Delta commit,
# in the confirm) as often as before. Most kills are cheap (the sensors, the extract: ~10 s into a
# cycle); a kill in the merge, after a Delta commit or in the confirm costs a whole merge, so there
# are few of those. The random order and delays vary the windows from run to run.
KILLS = {"sensors": 2, "extract": 5, "merge": 2, "commit": 2, "confirm": 2, "drain": 2}  # 15
# A cycle aimed at the drain bounds its batches to a few of the writer's changes, so the changes
# made since the last cycle are several batches and the drain task loops over them; the kill
# lands in its first or second batch (an extract, a merge or a confirm of the loop).
DRAIN_CONF = {"max_batch_changes": 25}
CLEAN_RUNS = 0  # full cycles between the kills, besides the first and the last ones


def kill_schedule(rng: random.Random) -> list[str | None]:
    """The phase each cycle is killed in (None: a clean cycle), in a seeded random order."""
    phases: list[str | None] = [p for p, n in KILLS.items() for _ in range(n)]
    rng.shuffle(phases)
    for _ in range(CLEAN_RUNS):
        phases.insert(rng.randint(1, len(phases)), None)
    return phases


def delay_for(phase: str, rng: random.Random, timings: dict[str, float]) -> float:
    """A delay after the phase's first line that lands inside the phase (timings: last clean cycle)."""
    fraction = rng.random()
    if phase == "extract":
        return fraction * max(timings.get("extract", 1.0), 0.3) * 1.2
    if phase == "merge":
        return fraction * max(timings.get("merge", 20.0), 5.0)
    if phase == "commit":
        return fraction * 1.5
    if phase == "confirm":
        return fraction * 0.6
    if phase == "drain":
        return fraction * 1.5 * (max(timings.get("extract", 1.0), 0.3) + max(timings.get("merge", 20.0), 5.0))
    return fraction * 0.5


def learn(timings: dict[str, float], run: RunResult) -> None:
    """Durations of the extract and the merge in a cycle that ran them in full."""
    marks = run.marks
    if "extract" in marks and "merge" in marks:
        timings["extract"] = marks["merge"] - marks["extract"]
    if "merge" in marks and "confirm" in marks:
        timings["merge"] = marks["confirm"] - marks["merge"]


def report(history: list[str]) -> str:
    return "\n".join(history)


def test_sigkill_at_random_points_of_random_cycles(dag_process: DagProcess, pg_conn, pg_dsn, slot_name, spark) -> None:
    seed = int(os.environ.get("PGDECODE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(seed)
    history = [f"seed {seed} (replay: PGDECODE_FAULT_SEED={seed}); logs in {dag_process.log_dir}"]
    log.warning(history[0])
    pg_conn.execute(SCHEMA)

    first = dag_process.run()  # creates the slot; earlier changes are a backfill's business
    assert first.succeeded, first.tail()
    writer = Writer(pg_dsn, seed)
    writer.start()
    try:
        timings: dict[str, float] = {}
        started = time.monotonic()
        kills = 0
        schedule = kill_schedule(rng)
        while schedule:
            phase = schedule[0]
            plan = KillPlan(phase, delay_for(phase, rng, timings)) if phase else None
            result = dag_process.run(plan, conf=DRAIN_CONF if phase == "drain" else None)
            line = (
                f"cycle {dag_process.runs}: {plan.describe() if plan else 'clean'} -> "
                f"{'KILLED' if result.killed else f'exit {result.returncode}'} after {result.seconds:.1f}s, "
                f"slot at {slot_position(pg_conn, slot_name)}, marks {result.marks}"
            )
            history.append(line)
            log.warning(line)
            writer.check()
            learn(timings, result)  # a killed cycle's marks are as good as a clean one's
            if result.killed:
                kills += 1
                schedule.pop(0)
                continue
            # A cycle that ran to its end must have succeeded, killed before or not.
            assert result.succeeded, f"{report(history)}\n--- {result.log}:\n{result.tail()}"
            if plan is None:
                schedule.pop(0)
            # else the cycle ended before the kill landed (no changes yet, a fast phase): try again
            if dag_process.runs > 60:
                pytest.fail(f"too many cycles without landing the kills:\n{report(history)}")
        history.append(f"{kills} kills in {time.monotonic() - started:.0f}s")
    finally:
        writer.stop()
    history.append(f"writer: {writer.counts}")

    # Catch up: the writer has stopped and resolved every prepared transaction.
    for _ in range(3):
        result = dag_process.run()
        history.append(f"catch-up cycle {dag_process.runs}: exit {result.returncode} after {result.seconds:.1f}s")
        if result.succeeded:  # its ceiling is past every change the writer made
            break
    assert result.succeeded, f"{report(history)}\n--- {result.log}:\n{result.tail()}"
    log.warning(report(history))
    assert kills == sum(KILLS.values())
    assert_caught_up(pg_conn, spark, dag_process.conf["delta_root"], TABLES)
