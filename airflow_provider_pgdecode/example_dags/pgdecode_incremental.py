"""pgdecode_incremental: one complete CDC cycle per run, PostgreSQL slot to Delta tables.

ensure_slot >> wait_for_changes >> extract >> merge >> confirm >> drain, and a slot health check
beside them. The slot is only ever peeked; confirm advances it after the merge succeeded, and its
return value (the checkpoint: end LSN and prepared transactions still pending) is where the
next run starts. A failed or killed run, re-run, repeats work but never loses or duplicates a
change: the merge is idempotent by commit LSN.

Run one cycle by hand (catches Delta up with the slot)::

    airflow dags test pgdecode_incremental -c '{"slot_name": "pgdecode_shop",
        "staging_uri": "/data/staging", "delta_root": "/data/delta"}'

Parameters (DAG params, all overridable per run):

- ``postgres_conn_id``: the source database's Airflow connection (type ``pgdecode``, whose Test button checks what a slot needs; ``postgres`` works too).
- ``slot_name``: the logical replication slot (created, two-phase, when missing).
- ``plugin``: ``test_decoding`` or ``pgoutput``.
- ``publication``: the publication a ``pgoutput`` slot reads (ignored for test_decoding).
- ``tables``: ``schema.table`` names to load; empty means every table outside the system
  schemas (for pgoutput: in the publication), minus ``exclude_tables``. Nothing is skipped
  silently: a table without a usable key that is not ``append_only`` fails the extract before
  the slot is read, in one error naming every such table and the ways forward.
- ``exclude_tables``: ``schema.table`` names never to load (their changes are counted and the
  tables named in the extract's log and the batch manifest).
- ``table_options``: per table, ``{"schema.table": {"mode": ...}}``: ``append_only`` for
  insert-only tables without a key (logs), ``history`` for a history of versions (SCD type 2),
  ``soft_delete`` for deletes kept as tombstones (``_pg_deleted``); also ``on_bad_value``,
  ``max_value_bytes``, ``arrays``, ``type_map`` (types kept as text); see docs/merge.md.
- ``staging_uri``: where batches are staged: a local or mounted directory, or
  ``s3://bucket/prefix`` on S3-compatible object storage.
- ``delta_root``: where the Delta tables live, ``<delta_root>/<schema>/<table>``: a local
  directory or ``s3://bucket/prefix``.
- ``storage_conn_id``: for ``s3://`` locations, an Airflow connection of the Amazon provider's
  ``aws`` type (its key pair, ``region_name`` and, for an S3-compatible store, ``endpoint_url`` in
  its extra); empty (the default): local paths, as before, or the ``AWS_*`` environment for
  ``s3://``. Only the connection id travels through the DAG; its secrets never reach a task's
  fields, a log, XCom or a command line.
- ``spark_conn_id``: the Spark connection (master ``local[*]`` or ``spark://host:7077`` ...).
- ``max_batch_changes``, ``max_batch_wal_bytes``: the most changes and WAL bytes one batch takes
  (default 1,000,000 and 1 GiB; ``null``: no bound), ending at a transaction boundary; a larger
  transaction is a batch of its own.
- ``failover``: create the slot as a failover slot (PostgreSQL 17+), which a standby that syncs
  slots keeps, so the pipeline carries on after a promotion (docs/standby.md); default false.
- ``on_slot_lost``: ``fail`` (default) or ``resnapshot``: a lost slot (``wal_removed``,
  ``idle_timeout`` ...) is recreated and every table reloaded from a new snapshot, each Delta
  table replaced in one commit, at most ``max_slot_recoveries_per_day`` times (default 1) in 24
  hours (docs/lost-slots.md).
- ``drain``: when a batch ends at a bound, the ``drain`` task extracts, merges and confirms more
  batches in this run until the slot is caught up (docs/bounded-batches.md); ``false``: one
  batch per run.

Deployment settings: the ``[pgdecode]`` section of Airflow's configuration, read when the DAG
file is parsed (``airflow config list --section pgdecode``; ``AIRFLOW__PGDECODE__<NAME>``, or the
old ``PGDECODE_<NAME>`` variables as a fallback): ``data_dir`` (default staging and Delta
location), ``schedule`` (cron, default every 15 minutes), ``max_lag_bytes`` (the health check
fails past this slot lag; default no limit), ``wait_seconds`` (how long a run waits for changes
before it skips the cycle; default 600), ``retention_days`` (staged batches older than this that
nothing needs are removed after each confirm; default 7, empty keeps everything).

Each merge emits an Asset event per Delta table it changed: schedule a DAG on
``delta_table_asset(delta_root, "public", "orders")`` (example_dags/pgdecode_delta_consumer.py).

The tasks are built by :func:`~airflow_provider_pgdecode.example_dags.cycle.build_cycle`, which
``pgdecode_event_driven`` shares: the same cycle, run when the slot has changes instead of on a
clock (docs/event-driven.md). ``wait_for_changes`` is deferrable wherever Airflow's
``[operators] default_deferrable`` is on, so a waiting cycle holds no worker slot.

Table snapshots: ``pgdecode_backfill`` in ``add-table`` or ``resnapshot`` mode files a request
under the staging root; the next runs of this DAG copy the table chunk by chunk inside their
extract, while every other table keeps flowing (docs/backfill.md).

:func:`incremental_dag` builds this DAG, and the incremental DAG of each source of a sources file
(example_dags/sources.py, docs/sources.md): the same tasks with the source fixed when the file is
parsed, and the merge in a pool of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from types import EllipsisType
from typing import Any

from airflow.sdk import DAG

from airflow_provider_pgdecode.example_dags.cycle import CycleSettings, Source, build_cycle, cycle_params
from airflow_provider_pgdecode.utils.config import pgdecode_setting


def incremental_dag(
    dag_id: str = "pgdecode_incremental",
    *,
    source: Source | None = None,
    schedule: str | None | EllipsisType = ...,
    data_dir: str | None = None,
    param_defaults: Mapping[str, Any] | None = None,
    pool: str | None = None,
    settings: CycleSettings | None = None,
    alert_notifiers: Sequence[Callable[[Any], Any]] = (),
    description: str | None = None,
    tags: Sequence[str] = ("pgdecode", "cdc"),
    doc_md: str | None = None,
    auto_register: bool = True,
) -> DAG:
    """The incremental DAG: one CDC cycle per run, on a clock.

    :param dag_id: the DAG's id.
    :param source: the slot, its connection, plugin and publication, fixed (they are then not
        params); ``None`` (the default): params, overridable per run.
    :param schedule: a cron expression or preset, or ``None`` (runs only when triggered); default
        the ``[pgdecode] schedule`` setting.
    :param data_dir: where staging and Delta go by default; default ``[pgdecode] data_dir``.
    :param param_defaults: other default values of params (``tables``, ``delta_root`` ...).
    :param pool: the Airflow pool of the tasks that run Spark (``merge``, ``drain``); default
        Airflow's ``default_pool``.
    :param settings: wait, health and retention settings; default the ``[pgdecode]`` settings.
    :param alert_notifiers: Airflow notifiers that get pgdecode's alerts (``{{ pgdecode_alert }}``
        in their templates; docs/alerts.md).
    :param auto_register: Airflow's: register the DAG with the DAG file being parsed (``False``
        for a DAG found through a module attribute only).
    """
    data_dir = data_dir or pgdecode_setting("data_dir")
    settings = settings or CycleSettings.from_config()
    with DAG(
        dag_id=dag_id,
        auto_register=auto_register,
        description=description
        or "Incremental CDC: PostgreSQL logical replication slot -> staged batch -> Delta MERGE -> confirm",
        schedule=pgdecode_setting("schedule") if schedule is ... else schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,  # cycles of one slot must not overlap
        render_template_as_native_obj=True,
        default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
        tags=list(tags),
        doc_md=doc_md or __doc__,
        params=cycle_params(data_dir, source=source is None, defaults=param_defaults),
    ) as dag:
        build_cycle(
            wait_seconds=settings.wait_seconds,
            max_lag_bytes=settings.max_lag_bytes,
            # Staged batches are the replay log of pgdecode_backfill; None keeps them all.
            retention_days=settings.retention_days,
            pool=pool,
            alert_notifiers=alert_notifiers,
            **({"source": source} if source is not None else {}),
        )
    return dag


# This module's own DAG is found through `dag` (dags/pgdecode_incremental.py imports it): not registered with
# whichever DAG file imports the factory (dags/pgdecode_sources.py would hold it twice).
dag = incremental_dag(auto_register=False)
