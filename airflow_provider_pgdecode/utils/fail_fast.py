"""The one translation of pgdecode errors into Airflow's retry semantics.

Example::

    from airflow_provider_pgdecode.utils.fail_fast import fail_fast

    def execute(self, context):
        with fail_fast():
            manifest = hook.extract_batch(...)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.errors import is_deterministic


@contextmanager
def fail_fast(what: str | None = None) -> Iterator[None]:
    """Fail the task without retries on a deterministic pgdecode error; let others propagate.

    A deterministic error (:func:`~airflow_provider_pgdecode.errors.is_deterministic`) becomes
    ``AirflowFailException`` with the error's own message, prefixed by ``what`` when given (e.g.
    ``"batch /data/x is merged, but the slot was not advanced"``). Transient errors (a refused
    connection, a server restart) and Airflow's own exceptions pass through unchanged, so the
    task's ``retries`` apply to them.
    """
    try:
        yield
    except Exception as exc:
        if is_deterministic(exc):
            raise AirflowFailException(f"{what}: {exc}" if what else str(exc)) from exc
        raise
