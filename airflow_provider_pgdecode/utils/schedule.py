"""How long a slot sits unused between two runs of the DAG that reads it: the longest gap
between the DAG's scheduled runs, read from its timetable (cron or fixed interval)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

#: Consecutive cron fire times looked at: enough to see a weekend in a weekday schedule.
CRON_FIRES = 64


def longest_gap(timetable: Any, after: datetime) -> timedelta | None:
    """The longest time between two consecutive scheduled runs after ``after``, or ``None`` for a
    timetable without a fixed rhythm (manual, asset-triggered, event-driven)."""
    delta = getattr(timetable, "delta", None)
    if isinstance(delta, timedelta):
        return delta
    expression = getattr(timetable, "expression", None)
    if not isinstance(expression, str):
        return None
    from croniter import croniter

    fires = croniter(expression, after)
    times = [fires.get_next(datetime) for _ in range(CRON_FIRES)]
    return max(later - earlier for earlier, later in zip(times, times[1:]))
