"""pgdecode_event_driven: the CDC cycle of pgdecode_incremental, run when the slot has changes instead of on a clock.

The DAG is scheduled on an Asset that stands for the replication slot
(``pgdecode-slot://<postgres_conn_id>/<slot_name>``), watched by
:class:`~airflow_provider_pgdecode.triggers.slot_event.SlotChangesEventTrigger` in Airflow's
triggerer: each time the slot has changes the DAG has not confirmed yet, the trigger fires an
Asset event and the scheduler starts a run. The run is the same cycle as pgdecode_incremental
(ensure_slot, slot_health, wait_for_changes, extract, merge, confirm; built by
:func:`~airflow_provider_pgdecode.example_dags.cycle.build_cycle`). The trigger only peeks;
the confirm advances the slot, after which the trigger fires again only for changes beyond it
(docs/event-driven.md: when to choose this over the cron schedule, and how double runs are
avoided). A triggerer must run (``airflow triggerer``).

The slot, its connection, plugin and publication are fixed when the file is parsed (the trigger
watches that slot), so they are not params: copy this file and call
:func:`event_driven_dag` with yours::

    from airflow_provider_pgdecode.example_dags.pgdecode_event_driven import event_driven_dag

    dag = event_driven_dag("shop_cdc", slot_name="pgdecode_shop", postgres_conn_id="shop_db", poll_interval=10)

Params (per run): ``tables``, ``exclude_tables``, ``table_options``, ``staging_uri``,
``delta_root``, ``storage_conn_id``, ``spark_conn_id``, as pgdecode_incremental's. Use one of the
two DAGs per slot, not both. Settings: the ``[pgdecode]`` section (``data_dir``,
``max_lag_bytes``, ``retention_days``), as for pgdecode_incremental.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG

from airflow_provider_pgdecode.example_dags.cycle import CycleSettings, Source, build_cycle, cycle_params
from airflow_provider_pgdecode.triggers.slot_event import SlotChangesEventTrigger, slot_asset
from airflow_provider_pgdecode.utils.config import pgdecode_int, pgdecode_setting

# A run starts because the trigger saw changes; a run with none left (another run took them)
# skips after this long instead of holding the DAG's one active run.
WAIT_SECONDS = 30


def event_driven_dag(
    dag_id: str = "pgdecode_event_driven",
    *,
    slot_name: str = "pgdecode",
    postgres_conn_id: str = "pgdecode_default",
    plugin: str = "test_decoding",
    publication: str = "pgdecode",
    poll_interval: float = 15.0,
    min_lag_bytes: int = 1,
    advance_lag_bytes: int | None = None,
    refire_interval: float | None = 3600.0,
    data_dir: str | None = None,
    param_defaults: Mapping[str, Any] | None = None,
    pool: str | None = None,
    settings: CycleSettings | None = None,
    alert_notifiers: Sequence[Callable[[Any], Any]] = (),
    description: str | None = None,
    tags: Sequence[str] = ("pgdecode", "cdc", "event-driven"),
    doc_md: str | None = None,
    auto_register: bool = True,
) -> DAG:
    """A DAG that runs the CDC cycle of ``slot_name`` each time the slot has new changes.

    :param dag_id: the DAG's id.
    :param slot_name: the replication slot (created, two-phase, by the first run when missing).
    :param postgres_conn_id: the source database's Airflow connection.
    :param plugin: ``test_decoding`` or ``pgoutput``.
    :param publication: the publication a pgoutput slot reads (ignored for test_decoding).
    :param poll_interval: seconds between the trigger's checks of the slot.
    :param min_lag_bytes: the trigger waits until the slot lags the WAL by this much (bigger,
        fewer runs).
    :param advance_lag_bytes: also run when the slot retains this much WAL and a heartbeat is
        pending, so that an idle database's slot gets advanced; ``None``: only changes count.
    :param refire_interval: seconds after which the same pending changes fire again when no run
        confirmed them (a failed run); ``None``: never.
    :param data_dir: default staging and Delta location; default the ``[pgdecode] data_dir`` setting.
    :param param_defaults: other default values of params (``tables``, ``delta_root`` ...).
    :param pool: the Airflow pool of the tasks that run Spark (``merge``, ``drain``); default
        Airflow's ``default_pool``.
    :param settings: wait, health and retention settings; default a wait of
        :data:`WAIT_SECONDS` and the ``[pgdecode]`` settings ``max_lag_bytes`` and ``retention_days``.
    :param alert_notifiers: Airflow notifiers that get pgdecode's alerts (``{{ pgdecode_alert }}``
        in their templates; docs/alerts.md).
    :param auto_register: Airflow's: register the DAG with the DAG file being parsed (``False``
        for a DAG found through a module attribute only).
    """
    data_dir = data_dir or pgdecode_setting("data_dir")
    if settings is None:
        settings = CycleSettings(WAIT_SECONDS, pgdecode_int("max_lag_bytes"), pgdecode_int("retention_days"))
    pub = publication if plugin == "pgoutput" else None
    trigger = SlotChangesEventTrigger(
        slot_name=slot_name,
        postgres_conn_id=postgres_conn_id,
        poll_interval=poll_interval,
        min_lag_bytes=min_lag_bytes,
        advance_lag_bytes=advance_lag_bytes,
        publication=pub,
        refire_interval=refire_interval,
    )
    with DAG(
        dag_id=dag_id,
        auto_register=auto_register,
        description=description or f"Event-driven CDC: runs when replication slot {slot_name} has changes",
        schedule=[slot_asset(slot_name, postgres_conn_id=postgres_conn_id, trigger=trigger)],
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,  # cycles of one slot must not overlap
        render_template_as_native_obj=True,
        default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
        tags=list(tags),
        doc_md=doc_md or (__doc__ if dag_id == "pgdecode_event_driven" else f"{dag_id}: {__doc__}"),
        params=cycle_params(data_dir, source=False, defaults=param_defaults),
    ) as dag:
        build_cycle(
            wait_seconds=settings.wait_seconds,
            max_lag_bytes=settings.max_lag_bytes,
            retention_days=settings.retention_days,
            source=Source(slot_name, postgres_conn_id, plugin, pub),
            pool=pool,
            alert_notifiers=alert_notifiers,
        )
    return dag


# This module's own DAG is found through `dag` (dags/pgdecode_event_driven.py imports it): not registered with
# whichever DAG file imports the factory (dags/pgdecode_sources.py would hold it twice).
dag = event_driven_dag(auto_register=False)
