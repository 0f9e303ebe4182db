"""pgdecode_incremental: one complete CDC cycle per run, PostgreSQL slot to Delta tables.

ensure_slot >> wait_for_changes >> extract >> merge >> confirm, and a slot health check beside
them. The slot is only ever peeked; confirm advances it after the merge succeeded, and its
return value (the checkpoint: end LSN and prepared transactions still pending) is where the
next run starts. A failed or killed run, re-run, repeats work but never loses or duplicates a
change: the merge is idempotent by commit LSN.

Run one cycle by hand (catches Delta up with the slot)::

    airflow dags test pgdecode_incremental -c '{"slot_name": "pgdecode_shop",
        "staging_uri": "/data/staging", "delta_root": "/data/delta"}'

Parameters (DAG params, all overridable per run):

- ``postgres_conn_id``: the source database's Airflow connection (``postgres`` type).
- ``slot_name``: the logical replication slot (created, two-phase, when missing).
- ``plugin``: ``test_decoding`` or ``pgoutput``.
- ``publication``: the publication a ``pgoutput`` slot reads (ignored for test_decoding).
- ``tables``: ``schema.table`` names to load; empty means every table outside the system
  schemas (for pgoutput: in the publication), minus ``exclude_tables``. Nothing is skipped
  silently: a table without a usable key that is not ``append_only`` fails the extract before
  the slot is read, in one error naming every such table and the ways forward.
- ``exclude_tables``: ``schema.table`` names never to load (their changes are counted and the
  tables named in the extract's log and the batch manifest).
- ``table_options``: per table, ``{"schema.table": {"mode": "append_only"}}`` for insert-only
  tables without a key (logs, histories); see docs/merge.md.
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

Deployment settings: the ``[pgdecode]`` section of Airflow's configuration, read when the DAG
file is parsed (``airflow config list --section pgdecode``; ``AIRFLOW__PGDECODE__<NAME>``, or the
old ``PGDECODE_<NAME>`` variables as a fallback): ``data_dir`` (default staging and Delta
location), ``schedule`` (cron, default every 15 minutes), ``max_lag_bytes`` (the health check
fails past this slot lag; default no limit), ``wait_seconds`` (how long a run waits for changes
before it skips the cycle; default 600), ``retention_days`` (staged batches older than this that
nothing needs are removed after each confirm; default 7, empty keeps everything).

Each merge emits an Asset event per Delta table it changed: schedule a DAG on
``delta_table_asset(delta_root, "public", "orders")`` (example_dags/pgdecode_delta_consumer.py).

Table snapshots: ``pgdecode_backfill`` in ``add-table`` or ``resnapshot`` mode files a request
under the staging root; the next runs of this DAG copy the table chunk by chunk inside their
extract, while every other table keeps flowing (docs/backfill.md).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param

from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator
from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor
from airflow_provider_pgdecode.utils.config import pgdecode_int, pgdecode_setting

DATA_DIR = pgdecode_setting("data_dir")
MAX_LAG_BYTES = pgdecode_int("max_lag_bytes")
WAIT_SECONDS = pgdecode_int("wait_seconds") or 0
# Staged batches are the replay log of pgdecode_backfill; empty keeps them all.
RETENTION_DAYS = pgdecode_int("retention_days")

with DAG(
    dag_id="pgdecode_incremental",
    description="Incremental CDC: PostgreSQL logical replication slot -> staged batch -> Delta MERGE -> confirm",
    schedule=pgdecode_setting("schedule"),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,  # cycles of one slot must not overlap
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    tags=["pgdecode", "cdc"],
    doc_md=__doc__,
    params={
        "postgres_conn_id": Param(
            "pgdecode_source", type="string", description="the source database's Airflow connection (postgres type)"
        ),
        "slot_name": Param(
            "pgdecode",
            type="string",
            pattern="^[a-z0-9_]{1,63}$",
            description="the logical replication slot (created, two-phase, when missing)",
        ),
        "plugin": Param("test_decoding", enum=["test_decoding", "pgoutput"], description="the slot's output plugin"),
        "publication": Param(
            "pgdecode", type="string", description="the publication a pgoutput slot reads (ignored for test_decoding)"
        ),
        "tables": Param(
            [],
            type="array",
            description="schema.table names to load; empty: every table outside the system schemas "
            "(pgoutput: in the publication) minus exclude_tables",
        ),
        "exclude_tables": Param([], type="array", description="schema.table names never to load"),
        "table_options": Param(
            {},
            type="object",
            description='per table: {"schema.table": {"mode": "append_only", "on_bad_value": "quarantine", '
            '"max_value_bytes": 67108864, "arrays": "json"}} (docs/merge.md)',
        ),
        "staging_uri": Param(
            f"{DATA_DIR}/staging", type="string", description="a local directory or s3://bucket/prefix"
        ),
        "delta_root": Param(f"{DATA_DIR}/delta", type="string", description="a local directory or s3://bucket/prefix"),
        "storage_conn_id": Param(
            "",
            type="string",
            description="an Airflow aws connection for s3:// locations (endpoint_url in its extra for "
            "S3-compatible stores); empty: local paths",
        ),
        "spark_conn_id": Param(
            "spark_default", type="string", description="the Spark connection (local[*], spark://host:7077 ...)"
        ),
    },
) as dag:
    ensure_slot = PgDecodeEnsureSlotOperator(
        task_id="ensure_slot",
        slot_name="{{ params.slot_name }}",
        plugin="{{ params.plugin }}",
        two_phase=True,
        postgres_conn_id="{{ params.postgres_conn_id }}",
    )
    slot_health = PgDecodeSlotHealthSensor(
        task_id="slot_health",
        slot_name="{{ params.slot_name }}",
        plugin="{{ params.plugin }}",
        postgres_conn_id="{{ params.postgres_conn_id }}",
        max_lag_bytes=MAX_LAG_BYTES,
        heartbeat=True,  # an idle database's slot keeps advancing
        poke_interval=30,
        timeout=120,
    )
    wait_for_changes = PgDecodeSlotChangesSensor(
        task_id="wait_for_changes",
        slot_name="{{ params.slot_name }}",
        postgres_conn_id="{{ params.postgres_conn_id }}",
        publication="{{ params.publication if params.plugin == 'pgoutput' else None }}",
        staging_root="{{ params.staging_uri }}",  # table snapshot requests count as work
        storage_conn_id="{{ params.storage_conn_id }}",
        poke_interval=min(15, max(WAIT_SECONDS, 1)),
        timeout=WAIT_SECONDS,
        soft_fail=True,  # no changes: the cycle is skipped, not failed
    )
    extract = PgDecodeExtractOperator(
        task_id="extract",
        slot_name="{{ params.slot_name }}",
        staging_root="{{ params.staging_uri }}",
        plugin="{{ params.plugin }}",
        postgres_conn_id="{{ params.postgres_conn_id }}",
        tables="{{ params.tables }}",
        exclude_tables="{{ params.exclude_tables }}",
        publication="{{ params.publication if params.plugin == 'pgoutput' else None }}",
        table_options="{{ params.table_options }}",
        checkpoint_task_id="confirm",
        storage_conn_id="{{ params.storage_conn_id }}",
        multiple_outputs=True,  # its summary's keys as XComs too: extract.output["path"]
    )
    # An XComArg (typed Any: it stands for any templated argument): the operators resolve it when
    # they run, and it orders them after extract.
    extracted: Any = extract.output
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=extracted["path"],
        delta_root="{{ params.delta_root }}",
        conn_id="{{ params.spark_conn_id }}",
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    confirm = PgDecodeConfirmOperator(
        task_id="confirm",
        slot_name="{{ params.slot_name }}",
        batch_path=extracted["path"],
        postgres_conn_id="{{ params.postgres_conn_id }}",
        merge_task_id="merge",
        retention_days=RETENTION_DAYS,
        storage_conn_id="{{ params.storage_conn_id }}",
    )

    ensure_slot >> [slot_health, wait_for_changes]
    wait_for_changes >> extract >> merge >> confirm  # extract.output also orders merge and confirm after it
