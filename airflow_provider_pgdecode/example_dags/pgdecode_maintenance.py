"""pgdecode_maintenance: weekly OPTIMIZE and VACUUM of the pipeline's Delta tables, watermarks kept.

One task, ``maintenance`` (``PgDecodeDeltaMaintenanceOperator``), per run and per table:

- checks first, for every table, before anything is written: a ``delta.setTransactionRetentionDuration``
  shorter than 30 days (or than ``[pgdecode] retention_days``, if longer) would let Delta forget a
  slot's watermark, and a VACUUM retention below the table's ``delta.deletedFileRetentionDuration``
  (7 days by default) would delete files a running reader needs: either fails the run without a
  retry, naming the table and what to change (``allow_short_retention`` opts in to the second);
- ``OPTIMIZE`` (``ZORDER BY`` the table's key with ``zorder``), then ``VACUUM RETAIN <hours> HOURS``;
- reads the slots' transaction ids (app id ``pgdecode:<slot>``) again and fails loudly if one is
  lost; the summary (XCom) has per table the files, bytes and Delta versions before and after, the
  files VACUUM removed, and the transaction ids before and after.

It runs beside ``pgdecode_incremental``: an OPTIMIZE and a MERGE of the same table that conflict fail
one of the two commits, never half of one. The job retries its OPTIMIZE; a merge that loses fails
its task, which retries, and its slot is only advanced after it succeeds. To keep them apart
altogether, give both DAGs' Spark tasks one Airflow pool of one slot (docs/maintenance.md).

Wiring only. Run it by hand::

    airflow dags trigger pgdecode_maintenance -c '{"delta_root": "/data/delta", "zorder": true}'

Params: ``delta_root`` (a local directory or ``s3://bucket/prefix``), ``tables`` (``schema.table``
names; empty: every pgdecode table under ``delta_root``, found by its ``pgdecode.source`` property),
``retention_hours`` (VACUUM's retention; empty: each table's own, 7 days by default),
``allow_short_retention``, ``zorder``, ``storage_conn_id`` and ``spark_conn_id`` (as pgdecode_incremental's).
docs/maintenance.md says what is run and why it is safe.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from airflow_provider_pgdecode.operators.maintenance import PgDecodeDeltaMaintenanceOperator
from airflow_provider_pgdecode.utils.config import pgdecode_int, pgdecode_setting

DATA_DIR = pgdecode_setting("data_dir")  # [pgdecode] data_dir (AIRFLOW__PGDECODE__DATA_DIR)
# A watermark must outlive the staged batches that could be merged again (docs/maintenance.md).
MIN_TXN_RETENTION_HOURS = max(30 * 24, 24 * (pgdecode_int("retention_days") or 0))

with DAG(
    dag_id="pgdecode_maintenance",
    description="Weekly OPTIMIZE and VACUUM of pgdecode's Delta tables, keeping every slot's watermark",
    schedule="@weekly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=10)},
    tags=["pgdecode", "delta", "maintenance"],
    doc_md=__doc__,
    params={
        "delta_root": Param(f"{DATA_DIR}/delta", type="string", description="a local directory or s3://bucket/prefix"),
        "tables": Param(
            [], type="array", description="schema.table names; empty: every pgdecode table under delta_root"
        ),
        "retention_hours": Param(
            None,
            type=["null", "number"],
            minimum=0,
            description="VACUUM retention in hours; empty: each table's delta.deletedFileRetentionDuration (7 days)",
        ),
        "allow_short_retention": Param(
            False,
            type="boolean",
            description="allow a retention below Delta's safety check (only when no job reads versions that old)",
        ),
        "zorder": Param(False, type="boolean", description="OPTIMIZE ... ZORDER BY the key (rewrites whole tables)"),
        "purge_deletion_vectors": Param(
            False,
            type="boolean",
            description="REORG TABLE ... APPLY (PURGE): rewrite every file with deleted rows, so VACUUM removes them",
        ),
        "storage_conn_id": Param(
            "",
            type="string",
            description="an Airflow aws connection for an s3:// delta_root (endpoint_url in its extra for "
            "S3-compatible stores); empty: local paths",
        ),
        "spark_conn_id": Param(
            "spark_default", type="string", description="the Spark connection (spark or spark_connect)"
        ),
    },
) as dag:
    # [START howto_operator_pgdecode_delta_maintenance]
    PgDecodeDeltaMaintenanceOperator(
        task_id="maintenance",
        delta_root="{{ params.delta_root }}",
        tables="{{ params.tables }}",
        retention_hours="{{ params.retention_hours }}",
        allow_short_retention="{{ params.allow_short_retention }}",
        zorder="{{ params.zorder }}",
        purge_deletion_vectors="{{ params.purge_deletion_vectors }}",
        min_txn_retention_hours=MIN_TXN_RETENTION_HOURS,
        conn_id="{{ params.spark_conn_id }}",
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [END howto_operator_pgdecode_delta_maintenance]
