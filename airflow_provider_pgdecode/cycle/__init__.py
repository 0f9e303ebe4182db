"""One cycle as library calls: extract one batch, merge it, confirm it.

Each step is a function of a frozen dataclass of its task's rendered arguments (``extract.py``,
``merge.py``, ``confirm.py``), called by its own operator's ``execute`` and, once per batch, by the
drain operator, which asks the cycle's tasks for their arguments (:func:`task_arguments`) and
overrides the per-batch values. This module holds what the steps share: rendering a task's
arguments without touching the task (:class:`CycleTask`), and the switch an ``on_kill`` pulls to stop
the running step.
A layer between the operators and the hooks: it imports no operator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Generic, TypeVar

from airflow.sdk import Context

Arguments = TypeVar("Arguments")


def task_arguments(kind: type[Arguments], task: Any, context: Context | None = None) -> Arguments:
    """``kind`` (a dataclass whose fields are named as the task's attributes) from ``task``'s fields:
    with a ``context``, its template fields rendered as Airflow renders them (an empty value stays,
    a callable is called) into the new object, the task left as it is; without, the fields as they
    are (in ``execute``, already rendered)."""
    templated = set(task.template_fields) if context is not None else set()
    jinja_env = task.get_template_env() if templated else None
    values: dict[str, Any] = {}
    for field in fields(kind):  # type: ignore[arg-type]
        value = getattr(task, field.name)
        if field.name in templated and value:
            if callable(value):
                value = value(context=context, jinja_env=jinja_env)
            else:
                value = task.render_template(value, context, jinja_env)
        values[field.name] = value
    return kind(**values)


class CycleTask(Generic[Arguments]):
    """An operator (mixed in before ``BaseOperator``) whose run is one cycle step, made of
    ``arguments_kind``: it offers its arguments to the drain."""

    arguments_kind: type[Arguments]

    def cycle_arguments(self, context: Context | None = None) -> Arguments:
        """This task's arguments, its template fields rendered with ``context`` into the new object
        (the task stays as it is); without a context, its fields as they are."""
        return task_arguments(self.arguments_kind, self, context)


class KillSwitch:
    """What stops the step a task runs now (a peek's cancel, a Spark job's kill), for ``on_kill``."""

    def __init__(self) -> None:
        self._stop: Callable[[], None] | None = None

    @contextmanager
    def armed(self, stop: Callable[[], None]) -> Iterator[None]:
        """``stop`` is what :meth:`pull` calls while the block runs."""
        self._stop = stop
        try:
            yield
        finally:
            self._stop = None

    def pull(self) -> None:
        """Stop the running step; nothing when none runs."""
        if self._stop is not None:
            self._stop()
