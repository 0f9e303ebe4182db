"""pgdecode_backfill: load tables so that they and the slot's changes fit exactly, or replay batches.

Four modes (the ``mode`` param):

- ``initial``: create the slot with an exported snapshot and copy ``tables`` (default: every
  table with a primary key) inside it, staged as one batch at the slot's consistent point, then
  merge it into ``delta_root``. pgdecode_incremental continues from the slot. Re-running it
  once the slot exists re-merges the staged initial load (a no-op for Delta).
- ``add-table``: bring ``tables`` into a running pipeline; ``resnapshot``: copy ``tables``
  again (e.g. after their Delta tables were deleted or damaged). Both file a request that the
  next pgdecode_incremental runs carry out chunk by chunk while every other table keeps flowing
  (docs/backfill.md); this DAG waits for the request to finish and logs its progress.
- ``replay``: re-merge the retained staged batches between ``start_lsn`` and ``end_lsn`` into
  ``delta_root`` (default a separate root), e.g. to rebuild Delta tables elsewhere. The slot is
  neither read nor advanced.

Every mode is safe to repeat: the merge is idempotent by commit LSN, a request id is filed
once, and an initial load is not taken twice. The DAG never runs on its own schedule (it is
created paused, and scheduled runs skip); its daily timetable exists so that
``airflow backfill create --dag-id pgdecode_backfill --from-date ... --to-date ...`` can run it
over a date range, each run with the same conf and the same end state.

    airflow dags test pgdecode_backfill -c '{"mode": "add-table", "tables": ["public.refunds"],
        "slot_name": "pgdecode_shop", "staging_uri": "/data/staging"}'
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param, PokeReturnValue, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

DATA_DIR = os.environ.get("PGDECODE_DATA_DIR", "/tmp/pgdecode")
MODES = ["initial", "add-table", "resnapshot", "replay"]

with DAG(
    dag_id="pgdecode_backfill",
    description="Initial load, add a table, re-snapshot a table, or replay staged batches into Delta",
    schedule="@daily",  # for `airflow backfill create` only: scheduled runs skip
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["pgdecode", "cdc", "backfill"],
    params={
        "mode": Param("replay", enum=MODES),
        "postgres_conn_id": Param("pgdecode_source", type="string"),
        "slot_name": Param("pgdecode", type="string", pattern="^[a-z0-9_]{1,63}$"),
        "plugin": Param("test_decoding", enum=["test_decoding", "pgoutput"]),
        "tables": Param([], type="array", description="schema.table names; initial: empty means all with a key"),
        "staging_uri": Param(f"{DATA_DIR}/staging", type="string"),
        "delta_root": Param("", type="string",
                            description=f"empty: {DATA_DIR}/delta (replay: {DATA_DIR}/delta_backfill)"),
        "start_lsn": Param("", type="string", description="replay: X/Y; empty: from the first retained batch"),
        "end_lsn": Param("", type="string", description="replay: X/Y; empty: up to the last retained batch"),
        "chunk_rows": Param(50_000, type="integer", minimum=1),
        "workers": Param(0, type="integer", minimum=0,
                         description="initial: parallel copy connections; 0 picks min(4, cores)"),
        "request_id": Param("", type="string", description="add-table/resnapshot: empty means one per run"),
        "wait_seconds": Param(6 * 3600, type="integer", minimum=0,
                              description="add-table/resnapshot: how long to wait for the copy (0: do not wait)"),
        "spark_conn_id": Param("spark_default", type="string"),
    },
) as dag:

    @task
    def prepare() -> dict[str, Any]:
        """Decide what this run merges (initial load, replay chain) or file a snapshot request."""
        context = get_current_context()
        params = context["params"]
        if str(context["dag_run"].run_type).lower().endswith("scheduled"):
            raise AirflowSkipException("pgdecode_backfill runs when triggered or backfilled, not on its schedule")
        mode, slot, staging = params["mode"], params["slot_name"], params["staging_uri"]
        delta_root = params["delta_root"] or f"{DATA_DIR}/{'delta_backfill' if mode == 'replay' else 'delta'}"
        result: dict[str, Any] = {"mode": mode, "slot": slot, "delta_root": delta_root, "batches": [], "request": None}
        if mode == "replay":
            result["batches"] = _replay_chain(slot, staging, params["start_lsn"], params["end_lsn"])
        elif mode == "initial":
            result["batches"] = _initial_load(params, slot, staging)
        else:
            result["request"] = _file_request(params, mode, slot, staging, context["run_id"])
        return result

    def _replay_chain(slot: str, staging: str, start_lsn: str, end_lsn: str) -> list[str]:
        from airflow_provider_pgdecode.decoding.lsn import Lsn
        from airflow_provider_pgdecode.errors import StagingError
        from airflow_provider_pgdecode.batch.chains import select_batch_chain

        try:
            chain = select_batch_chain(
                staging, slot, Lsn.parse(start_lsn) if start_lsn else None, Lsn.parse(end_lsn) if end_lsn else None
            )
        except StagingError as exc:
            raise AirflowFailException(str(exc)) from exc
        print(f"replay: {len(chain)} batch(es) from {chain[0].start_lsn} to {chain[-1].end_lsn}")
        return [str(m.path) for m in chain]

    def _initial_load(params: dict[str, Any], slot: str, staging: str) -> list[str]:
        from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
        from airflow_provider_pgdecode.batch.chains import find_initial_load
        from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot

        with PgDecodeHook(postgres_conn_id=params["postgres_conn_id"]) as hook:
            exists = hook.get_slot_client().exists(slot)
            tables = list(params["tables"]) or list(hook.get_catalog().tables_with_primary_key())
            dsn = hook.dsn()
        if exists:
            staged = find_initial_load(staging, slot)
            if staged is None:
                raise AirflowFailException(
                    f"slot {slot!r} already exists and has no staged initial load under {staging}, so its tables "
                    f"cannot be loaded consistently with it from here. To load tables into the running pipeline use "
                    f"mode 'add-table' or 'resnapshot'; to start over drop the slot "
                    f"(SELECT pg_drop_replication_slot('{slot}')) and run mode 'initial' again"
                )
            print(f"initial load of slot {slot} was staged before (up to {staged.end_lsn}): merging it again")
            return [str(staged.path)]
        print(f"initial load: creating slot {slot} and copying {len(tables)} table(s)")
        with create_slot_with_snapshot(dsn, slot, params["plugin"], two_phase=True) as snapshot:
            manifest = stage_snapshot(
                dsn, snapshot.snapshot_name, snapshot.consistent_lsn, slot, staging, tables,
                plugin=params["plugin"], chunk_rows=params["chunk_rows"], workers=params["workers"] or None,
            )
        return [str(manifest.path)]

    def _file_request(params: dict[str, Any], mode: str, slot: str, staging: str, run_id: str) -> str:
        from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
        from airflow_provider_pgdecode.capture.table_snapshot import request_table_snapshot

        if not params["tables"]:
            raise AirflowFailException(f"mode {mode!r} needs the tables to copy (param 'tables')")
        with PgDecodeHook(postgres_conn_id=params["postgres_conn_id"]) as hook:
            if not hook.get_slot_client().exists(slot):
                raise AirflowFailException(
                    f"slot {slot!r} does not exist: mode {mode!r} loads tables into a running pipeline. Run "
                    "pgdecode_incremental (it creates the slot) or pgdecode_backfill with mode 'initial' first"
                )
        request = request_table_snapshot(
            staging, slot, params["tables"], mode, request_id=params["request_id"] or f"{mode}-{run_id}",
            chunk_rows=params["chunk_rows"],
        )
        print(f"filed request {request.id}: pgdecode_incremental copies {', '.join('.'.join(t) for t in request.tables)}")
        return request.id

    @task.sensor(poke_interval=30, timeout=timedelta(days=2).total_seconds(), mode="reschedule")
    def wait_for_snapshot(prepared: dict[str, Any]) -> PokeReturnValue:
        """For add-table/resnapshot: until pgdecode_incremental has copied and confirmed every chunk."""
        from airflow_provider_pgdecode.capture.table_snapshot import describe_progress, read_snapshot_state

        context = get_current_context()
        params = context["params"]
        request = prepared.get("request")
        if not request:
            return PokeReturnValue(is_done=True)
        if params["wait_seconds"] == 0:
            print(f"not waiting for request {request} (wait_seconds=0)")
            return PokeReturnValue(is_done=True)
        started = context["dag_run"].start_date
        state = read_snapshot_state(params["staging_uri"], prepared["slot"], request)
        print(f"request {request}: {describe_progress(state) if state else 'no chunk confirmed yet'}")
        if state and state.get("error"):
            raise AirflowFailException(f"snapshot request {request} failed: {state['error']}")
        if state and state.get("done"):
            return PokeReturnValue(is_done=True, xcom_value=state)
        if started and (datetime.now(started.tzinfo) - started).total_seconds() > params["wait_seconds"]:
            raise AirflowFailException(
                f"snapshot request {request} is not done after {params['wait_seconds']} s; is pgdecode_incremental "
                "running? The request stays filed: re-run this task to keep waiting"
            )
        return PokeReturnValue(is_done=False)

    prepared = prepare()
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths="{{ ti.xcom_pull(task_ids='prepare')['batches'] }}",
        delta_root="{{ ti.xcom_pull(task_ids='prepare')['delta_root'] }}",
        conn_id="{{ params.spark_conn_id }}",
    )
    prepared >> merge >> wait_for_snapshot(prepared)
