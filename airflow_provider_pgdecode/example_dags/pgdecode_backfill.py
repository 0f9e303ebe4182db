"""pgdecode_backfill: load tables so that they and the slot's changes fit exactly, or replay batches.

Four modes (the ``mode`` param):

- ``initial``: create the slot with an exported snapshot and copy ``tables`` (default: every
  table outside the system schemas, for pgoutput in ``publication``, minus ``exclude_tables``;
  a table without a usable key that is not ``append_only`` in ``table_options`` fails the run,
  named, before the slot is created) inside it, staged as one batch at the slot's consistent point, then
  merge it into ``delta_root``. pgdecode_incremental continues from the slot. Re-running it
  once the slot exists re-merges the staged initial load (a no-op for Delta).
- ``add-table``: bring ``tables`` into a running pipeline; ``resnapshot``: copy ``tables``
  again (e.g. after their Delta tables were deleted or damaged). Both file a request that the
  next pgdecode_incremental runs carry out chunk by chunk while every other table keeps flowing
  (docs/backfill.md); this DAG waits for the request to finish and logs its progress.
- ``replay``: re-merge the retained staged batches between ``start_lsn`` and ``end_lsn`` into
  ``delta_root`` (default a separate root), e.g. to rebuild Delta tables elsewhere. The slot is
  neither read nor advanced.

Wiring only: each mode is an operator of the provider. ``mode`` (a branch) picks the task of
the run's mode: ``initial_load`` (``PgDecodeInitialSnapshotOperator``) or ``replay``
(``PgDecodeReplayOperator``), both followed by ``merge`` (``PgDecodeMergeOperator``), or
``prepare`` (``PgDecodeTableSnapshotOperator``, files the request) followed by
``wait_for_snapshot`` (``PgDecodeTableSnapshotSensor``, reschedule mode).

Every mode is safe to repeat: the merge is idempotent by commit LSN, a request id is filed
once, and an initial load is not taken twice. The DAG never runs on its own schedule (it is
created paused, and scheduled runs skip); its daily timetable exists so that
``airflow backfill create --dag-id pgdecode_backfill --from-date ... --to-date ...`` can run it
over a date range, each run with the same conf and the same end state.

    airflow dags test pgdecode_backfill -c '{"mode": "add-table", "tables": ["public.refunds"],
        "slot_name": "pgdecode_shop", "staging_uri": "/data/staging"}'

Locations: ``staging_uri`` and ``delta_root`` (and so the replay's target) are local directories
or ``s3://bucket/prefix`` on S3-compatible object storage; ``storage_conn_id`` names the Airflow
connection of the Amazon provider's ``aws`` type that reaches them (its key pair,
``region_name`` and, for a store other than AWS, ``endpoint_url`` in its extra). Empty (the
default): local paths, as before, or the ``AWS_*`` environment for ``s3://``. Only the
connection id travels through the DAG: no secret reaches a task's fields, a log or XCom.

:func:`backfill_dag` builds this DAG, and the backfill DAG of each source of a sources file
(example_dags/sources.py, docs/sources.md): the same tasks with the source fixed when the file is
parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Param, TriggerRule, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException

from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS
from airflow_provider_pgdecode.example_dags.cycle import PARAM_SOURCE, SOURCE_PARAMS, Source, with_defaults
from airflow_provider_pgdecode.operators.initial_snapshot import PgDecodeInitialSnapshotOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.replay import PgDecodeReplayOperator
from airflow_provider_pgdecode.operators.table_snapshot import PgDecodeTableSnapshotOperator
from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor
from airflow_provider_pgdecode.utils.config import pgdecode_setting

MODES = ["initial", "add-table", "resnapshot", "replay"]
# The task that carries out each mode ("prepare" files a table snapshot request).
MODE_TASKS = {"initial": "initial_load", "add-table": "prepare", "resnapshot": "prepare", "replay": "replay"}


def backfill_params(
    data_dir: str,
    *,
    delta_root: str,
    replay_root: str,
    source: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Param]:
    """The params of a backfill DAG; ``source=False`` leaves out the slot, its connection, plugin
    and publication (fixed when the DAG is parsed). ``delta_root`` and ``replay_root`` are the
    merge's roots when the ``delta_root`` param is empty."""
    params = {
        "mode": Param(
            "replay",
            enum=MODES,
            description="initial: first load with the slot; add-table/resnapshot: copy tables into a running "
            "pipeline; replay: re-merge retained batches",
        ),
        "postgres_conn_id": Param(
            "pgdecode_default",
            type="string",
            description="the source database's Airflow connection (type pgdecode; postgres works too)",
        ),
        "slot_name": Param(
            "pgdecode", type="string", pattern="^[a-z0-9_]{1,63}$", description="the pipeline's replication slot"
        ),
        "plugin": Param("test_decoding", enum=list(SUPPORTED_PLUGINS), description="the slot's output plugin"),
        "tables": Param(
            [],
            type="array",
            description="schema.table names or patterns (public.order_*); initial: empty means every table",
        ),
        "exclude_tables": Param([], type="array", description="schema.table names or patterns never to load"),
        "table_options": Param(
            {},
            type="object",
            description='per table, as the incremental DAG\'s: {"schema.table": {"mode": "history"}}; mode: merge, '
            "append_only, history or soft_delete (docs/merge.md)",
        ),
        "publication": Param("pgdecode", type="string", description="initial, pgoutput: the tables to copy"),
        "staging_uri": Param(
            f"{data_dir}/staging", type="string", description="a local directory or s3://bucket/prefix"
        ),
        "delta_root": Param(
            "",
            type="string",
            description=f"a local directory or s3://bucket/prefix; empty: {delta_root} (replay: {replay_root})",
        ),
        "storage_conn_id": Param(
            "",
            type="string",
            description="an Airflow aws connection for s3:// locations (endpoint_url in its extra for "
            "S3-compatible stores); empty: local paths",
        ),
        "start_lsn": Param("", type="string", description="replay: X/Y; empty: from the first retained batch"),
        "end_lsn": Param("", type="string", description="replay: X/Y; empty: up to the last retained batch"),
        "chunk_rows": Param(50_000, type="integer", minimum=1, description="rows per copied chunk"),
        "workers": Param(
            0, type="integer", minimum=0, description="initial: parallel copy connections; 0 picks min(4, cores)"
        ),
        "request_id": Param("", type="string", description="add-table/resnapshot: empty means one per run"),
        "wait_seconds": Param(
            6 * 3600,
            type="integer",
            minimum=0,
            description="add-table/resnapshot: how long to wait for the copy (0: do not wait)",
        ),
        "spark_conn_id": Param(
            "spark_default", type="string", description="the Spark connection (local[*], spark://host:7077 ...)"
        ),
    }
    if not source:
        for name in SOURCE_PARAMS:
            del params[name]
    return with_defaults(params, defaults)


def table_snapshot_tasks(src: Source) -> tuple[PgDecodeTableSnapshotOperator, PgDecodeTableSnapshotSensor]:
    """The ``add-table`` / ``resnapshot`` branch: file the request, then wait until the incremental
    DAG's runs have copied the tables (inside the DAG being built)."""
    # [START howto_operator_pgdecode_table_snapshot]
    request = PgDecodeTableSnapshotOperator(
        task_id="prepare",
        slot_name=src.slot_name,
        staging_root="{{ params.staging_uri }}",
        tables="{{ params.tables }}",
        exclude_tables="{{ params.exclude_tables }}",
        table_options="{{ params.table_options }}",
        mode="{{ params.mode }}",
        request_id="{{ params.request_id }}",  # empty: one per DAG run
        chunk_rows="{{ params.chunk_rows }}",
        postgres_conn_id=src.postgres_conn_id,
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [END howto_operator_pgdecode_table_snapshot]
    # [START howto_operator_pgdecode_table_snapshot_sensor]
    filed: Any = request.output  # an XComArg (the request id), resolved when the sensor runs
    wait_for_snapshot = PgDecodeTableSnapshotSensor(
        task_id="wait_for_snapshot",
        slot_name=src.slot_name,
        staging_root="{{ params.staging_uri }}",
        request_id=filed,
        wait_seconds="{{ params.wait_seconds }}",
        poke_interval=30,  # reschedule mode: no worker is held between pokes
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [END howto_operator_pgdecode_table_snapshot_sensor]
    return request, wait_for_snapshot


def backfill_dag(
    dag_id: str = "pgdecode_backfill",
    *,
    source: Source | None = None,
    data_dir: str | None = None,
    delta_root: str | None = None,
    replay_root: str | None = None,
    param_defaults: Mapping[str, Any] | None = None,
    pool: str | None = None,
    description: str | None = None,
    tags: Sequence[str] = ("pgdecode", "cdc", "backfill"),
    doc_md: str | None = None,
    auto_register: bool = True,
) -> DAG:
    """The backfill DAG: initial load, add or re-snapshot tables, replay staged batches.

    :param dag_id: the DAG's id.
    :param source: the slot, its connection, plugin and publication, fixed (they are then not
        params); ``None`` (the default): params, overridable per run.
    :param data_dir: where staging goes by default; default ``[pgdecode] data_dir``.
    :param delta_root: the merge's Delta root when the ``delta_root`` param is empty; default
        ``<data_dir>/delta``.
    :param replay_root: the same for mode ``replay``; default ``<data_dir>/delta_backfill``.
    :param param_defaults: other default values of params (``tables``, ``staging_uri`` ...).
    :param pool: the Airflow pool of the ``merge`` task (Spark); default Airflow's ``default_pool``.
    :param auto_register: Airflow's: register the DAG with the DAG file being parsed (``False``
        for a DAG found through a module attribute only).
    """
    data_dir = data_dir or pgdecode_setting("data_dir")  # [pgdecode] data_dir (AIRFLOW__PGDECODE__DATA_DIR)
    # The merge's Delta root: the delta_root param, or by default a separate root for replays.
    default_root, replay_root = delta_root or f"{data_dir}/delta", replay_root or f"{data_dir}/delta_backfill"
    merge_root = f"{{{{ params.delta_root or ({replay_root!r} if params.mode == 'replay' else {default_root!r}) }}}}"
    src = source or PARAM_SOURCE
    spark_pool: dict[str, Any] = {"pool": pool} if pool else {}
    with DAG(
        dag_id=dag_id,
        auto_register=auto_register,
        description=description
        or "Initial load, add a table, re-snapshot a table, or replay staged batches into Delta",
        schedule="@daily",  # for `airflow backfill create` only: scheduled runs skip
        start_date=datetime(2026, 1, 1),
        catchup=False,
        is_paused_upon_creation=True,
        max_active_runs=1,
        render_template_as_native_obj=True,
        tags=list(tags),
        doc_md=doc_md or __doc__,
        params=backfill_params(
            data_dir,
            delta_root=default_root,
            replay_root=replay_root,
            source=source is None,
            defaults=param_defaults,
        ),
    ) as dag:

        @task.branch(task_id="mode")
        def choose_mode() -> str:
            """The task of this run's mode; scheduled runs skip (the schedule serves `airflow backfill create`)."""
            context = get_current_context()
            if str(context["dag_run"].run_type).lower().endswith("scheduled"):
                raise AirflowSkipException(f"{dag_id} runs when triggered or backfilled, not on its schedule")
            return MODE_TASKS[context["params"]["mode"]]

        # [START howto_operator_pgdecode_initial_snapshot]
        initial_load = PgDecodeInitialSnapshotOperator(
            task_id="initial_load",
            slot_name=src.slot_name,
            staging_root="{{ params.staging_uri }}",
            plugin=src.plugin,
            tables="{{ params.tables }}",
            exclude_tables="{{ params.exclude_tables }}",
            table_options="{{ params.table_options }}",
            publication=src.publication,
            postgres_conn_id=src.postgres_conn_id,
            chunk_rows="{{ params.chunk_rows }}",
            workers="{{ params.workers }}",
            storage_conn_id="{{ params.storage_conn_id }}",
        )
        # [END howto_operator_pgdecode_initial_snapshot]
        # [START howto_operator_pgdecode_replay]
        replay = PgDecodeReplayOperator(
            task_id="replay",
            slot_name=src.slot_name,
            staging_root="{{ params.staging_uri }}",
            start_lsn="{{ params.start_lsn }}",
            end_lsn="{{ params.end_lsn }}",
            storage_conn_id="{{ params.storage_conn_id }}",
        )
        # [END howto_operator_pgdecode_replay]
        merge = PgDecodeMergeOperator(
            task_id="merge",
            # Jinja, not an XComArg: the batches of whichever of the two branches ran.
            batch_paths="{{ ti.xcom_pull(task_ids='initial_load') or ti.xcom_pull(task_ids='replay') }}",
            delta_root=merge_root,
            conn_id="{{ params.spark_conn_id }}",
            trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,  # after whichever of the two ran
            storage_conn_id="{{ params.storage_conn_id }}",
            **spark_pool,
        )
        request, wait_for_snapshot = table_snapshot_tasks(src)

        choose_mode() >> [initial_load, replay, request]
        [initial_load, replay] >> merge
        request >> wait_for_snapshot
    return dag


# This module's own DAG is found through `dag` (dags/pgdecode_backfill.py imports it): not registered with
# whichever DAG file imports the factory (dags/pgdecode_sources.py would hold it twice).
dag = backfill_dag(auto_register=False)
