"""Longest test files first, so the two xdist workers finish together.

``make test`` hands whole files to the workers (``--dist loadfile``). xdist orders files by their
number of tests, which put the few long single-test files (the SIGKILL and maintenance DAG runs)
last, side by side, as a tail of minutes on one worker. Here the workers collect the files in
order of their measured duration (``tests/durations.json``), and ``--no-loadscope-reorder`` makes
xdist keep that order: the longest-first rule of makespan scheduling.

``PGDECODE_RECORD_DURATIONS=1 make test`` rewrites ``tests/durations.json`` from the run (files
that did not run keep their old value). A file not listed yet is placed by its number of tests.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
#: Seconds assumed per test of a file that ``durations.json`` does not list yet.
_UNKNOWN_TEST_SECONDS = 2.0

_measured: defaultdict[str, float] = defaultdict(float)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known_durations() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


def expected_seconds(items: list[pytest.Item]) -> dict[str, float]:
    """Each test file's expected duration: measured, or estimated from its number of tests."""
    known = _known_durations()
    counts: defaultdict[str, int] = defaultdict(int)
    for item in items:
        counts[_file_of(item.nodeid)] += 1
    return {path: known.get(path, n * _UNKNOWN_TEST_SECONDS) for path, n in counts.items()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # one process: the order does not change the wall time; keep the natural one
    seconds = expected_seconds(items)
    # sort is stable: the tests of a file keep their order (module fixtures stay shared).
    items.sort(key=lambda item: -seconds[_file_of(item.nodeid)])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") or os.environ.get("PGDECODE_RECORD_DURATIONS", "") in ("", "0"):
        return
    durations = _known_durations()
    durations.update({path: round(seconds, 1) for path, seconds in _measured.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(durations.items())), indent=1) + "\n")
