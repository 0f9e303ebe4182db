"""pgdecode's alerts, sent through the Airflow notifiers a deployment already uses.

:class:`PgDecodeAlertNotifier` is a task callback. It reads what a cycle task ended with and turns
it into alerts: the slot health check failing (the slot past ``max_lag_bytes``, lost or
unreserved, stalled, a table parked too long), an extract that quarantined changes, a merge that
parked a table, any other failure of a cycle task. Each alert goes to every notifier it wraps with
``pgdecode_alert`` (the text) and ``pgdecode_alert_kind`` (``slot_lag``, ``slot_lost``,
``slot_unreserved``, ``table_parked``, ``quarantine``, ``task_failed``) in the context, so a
notifier's own template names it::

    from airflow.providers.slack.notifications.slack import SlackNotifier
    from airflow_provider_pgdecode.example_dags.pgdecode_incremental import incremental_dag

    dag = incremental_dag(alert_notifiers=[SlackNotifier(text="{{ pgdecode_alert }}", channel="#data")])

``incremental_dag`` and ``build_cycle`` attach it to the tasks that raise alerts; attach it yourself
as ``on_failure_callback`` / ``on_success_callback`` of any pgdecode task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier

Alert = tuple[str, str]
"""``(kind, text)``."""


def failure_kind(message: str) -> str:
    """The alert kind of a cycle task's failure, from its error (the wording of postgres/health.py
    and the health sensor)."""
    if "more than max_lag_bytes" in message:
        return "slot_lag"
    if "is lost" in message or "was invalidated" in message:
        return "slot_lost"
    if "unreserved" in message:
        return "slot_unreserved"
    if "parked" in message:
        return "table_parked"
    return "task_failed"


def alerts_of(task_id: str, dag_id: str, exception: BaseException | str | None, result: Any) -> list[Alert]:
    """The alerts of a cycle task's outcome: its error, else what its result says (quarantined
    changes of an extract, tables a merge parked)."""
    where = f"pgdecode {dag_id}.{task_id}"
    if exception is not None:
        text = str(exception).strip() or type(exception).__name__
        return [(failure_kind(text), f"{where} failed: {text}")]
    alerts: list[Alert] = []
    if isinstance(result, Mapping):
        quarantined = {str(t): int(n) for t, n in (result.get("quarantined") or {}).items() if n}
        if quarantined:
            listed = ", ".join(f"{t} ({n})" for t, n in sorted(quarantined.items()))
            alerts.append(("quarantine", f"{where}: changes quarantined (values the pipeline cannot carry): {listed}"))
        parked = result.get("parked") or {}
        for name, entry in sorted(parked.items()) if isinstance(parked, Mapping) else []:
            reason = entry.get("reason") if isinstance(entry, Mapping) else entry
            alerts.append(("table_parked", f"{where}: table {name} is parked: {reason}"))
    return alerts


class PgDecodeAlertNotifier(BaseNotifier):
    """Hand pgdecode's alerts of a task's outcome to ``notifiers`` (module doc).

    :param notifiers: Airflow notifiers (or any callables taking a context); each gets the task's
        context with ``pgdecode_alert`` and ``pgdecode_alert_kind`` added, once per alert.
    :param kinds: send only alerts of these kinds; default all.
    """

    def __init__(self, notifiers: Sequence[Callable[[Any], Any]], *, kinds: Sequence[str] | None = None) -> None:
        super().__init__()
        self.notifiers = list(notifiers)
        self.kinds = set(kinds) if kinds is not None else None

    def notify(self, context: Any) -> None:
        ti = context.get("ti")
        task_id = str(getattr(ti, "task_id", "") or context.get("task", "?"))
        dag_id = str(getattr(ti, "dag_id", "") or "?")
        exception = context.get("exception")
        result = ti.xcom_pull(task_ids=task_id) if exception is None and ti is not None else None
        for kind, text in alerts_of(task_id, dag_id, exception, result):
            if self.kinds is not None and kind not in self.kinds:
                continue
            self.log.warning("pgdecode alert (%s): %s", kind, text)
            for notifier in self.notifiers:
                notifier({**context, "pgdecode_alert": text, "pgdecode_alert_kind": kind})
