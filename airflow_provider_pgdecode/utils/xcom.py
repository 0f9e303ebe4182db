"""The latest value a task left in XCom in this or an earlier DAG run, asked for only when one can exist.

Airflow 3 logs a missing XCom at error level ("XCom not found") and then returns ``None``: a
pipeline's first runs, before any run of the task succeeded, would log an error each. A task of
this DAG that never succeeded pushed nothing, so it is not asked.
"""

from __future__ import annotations

from typing import Any

XCOM_RETURN_KEY = "return_value"


def ever_succeeded(ti: Any, task_id: str) -> bool:
    """Whether task ``task_id`` of ``ti``'s DAG has succeeded in any run. True where the task
    instance cannot say (not Airflow 3's: a test's stand-in)."""
    count = getattr(ti, "get_ti_count", None)
    if count is None:
        return True
    return bool(count(dag_id=ti.dag_id, task_ids=[task_id], states=["success"]))


def latest_xcom(ti: Any, task_id: str, key: str = XCOM_RETURN_KEY) -> Any:
    """The value ``task_id`` pushed under ``key`` in the latest run (this one or an earlier one)
    that has it, or ``None``. ``map_indexes=-1`` asks for one value, the latest by logical date:
    without it Airflow 3 returns a list of every run's value once there are several."""
    if not ever_succeeded(ti, task_id):
        return None
    return ti.xcom_pull(task_ids=task_id, key=key, include_prior_dates=True, map_indexes=-1)


def checkpoint_xcom_key(slot_name: str) -> str:
    """The XCom key under which the confirm task leaves a slot's checkpoint (the extract reads it)."""
    return f"pgdecode_checkpoint:{slot_name}"
