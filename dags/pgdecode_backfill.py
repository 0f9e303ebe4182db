"""pgdecode_backfill: rebuild Delta tables from retained staged batches.

Re-merges the staged batches of one slot whose LSN range lies between ``start_lsn`` and
``end_lsn`` (inclusive; empty means from the first / up to the last retained batch) into a
Delta root, usually a fresh one. The slot is neither read nor advanced, and the merge is
idempotent by commit LSN, so repeating a backfill leaves the same Delta state. Initial
snapshots and re-snapshots of single tables join this DAG with the backfill work.

    airflow dags test pgdecode_backfill -c '{"slot_name": "pgdecode_shop",
        "staging_uri": "/data/staging", "delta_root": "/data/delta_rebuilt"}'
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, Param, task

from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

DATA_DIR = os.environ.get("PGDECODE_DATA_DIR", "/tmp/pgdecode")

with DAG(
    dag_id="pgdecode_backfill",
    description="Re-merge a retained range of staged batches into a Delta root",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["pgdecode", "cdc", "backfill"],
    params={
        "slot_name": Param("pgdecode", type="string", pattern="^[a-z0-9_]{1,63}$"),
        "staging_uri": Param(f"{DATA_DIR}/staging", type="string"),
        "delta_root": Param(f"{DATA_DIR}/delta_backfill", type="string"),
        "start_lsn": Param("", type="string", description="X/Y; empty: from the first retained batch"),
        "end_lsn": Param("", type="string", description="X/Y; empty: up to the last retained batch"),
        "spark_conn_id": Param("spark_default", type="string"),
    },
) as dag:

    @task
    def select_batches(slot_name: str, staging_uri: str, start_lsn: str, end_lsn: str) -> list[str]:
        """The chain of retained batches covering the range, in LSN order.

        Batches that a failed run staged and a later run replaced (same start, smaller end) are
        passed over: from each start the batch reaching furthest is taken. A gap is an error.
        """
        from airflow_provider_pgdecode.decoding.lsn import Lsn
        from airflow_provider_pgdecode.staging.manifest import BatchManifest, list_batches

        manifests = [BatchManifest.read(path) for path in list_batches(staging_uri, slot_name)]
        if not manifests:
            raise ValueError(f"no retained batch of slot {slot_name!r} under {staging_uri}")
        by_start: dict[Lsn, BatchManifest] = {}
        for manifest in manifests:
            begin = Lsn.parse(manifest.start_lsn)
            best = by_start.get(begin)
            if best is None or Lsn.parse(manifest.end_lsn) > Lsn.parse(best.end_lsn):
                by_start[begin] = manifest
        position = Lsn.parse(start_lsn) if start_lsn else min(by_start)
        high = Lsn.parse(end_lsn) if end_lsn else None
        chain: list[BatchManifest] = []
        while position in by_start and (high is None or position < high):
            manifest = by_start[position]
            if Lsn.parse(manifest.end_lsn) == position:  # an empty batch: nothing further from here
                break
            chain.append(manifest)
            position = Lsn.parse(manifest.end_lsn)
        if not chain:
            raise ValueError(f"no retained batch of slot {slot_name!r} starts at {position}")
        if high is not None and position < high:
            raise ValueError(
                f"retained batches of slot {slot_name!r} end at {position}, before {high}: the changes after it "
                "are no longer staged (see the retention setting)"
            )
        print(f"{len(chain)} batch(es) from {chain[0].start_lsn} to {chain[-1].end_lsn}")
        return [str(m.path) for m in chain]

    batches = select_batches(
        "{{ params.slot_name }}", "{{ params.staging_uri }}", "{{ params.start_lsn }}", "{{ params.end_lsn }}"
    )
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths="{{ ti.xcom_pull(task_ids='select_batches') }}",
        delta_root="{{ params.delta_root }}",
        conn_id="{{ params.spark_conn_id }}",
    )
    batches >> merge
