"""pgdecode_verify: check the pipeline's Delta tables against PostgreSQL at one consistent LSN.

verify_snapshot >> extract >> merge >> verify, writers never stopped:

- ``verify_snapshot`` (``PgDecodeVerifySnapshotOperator``): a temporary slot exports a snapshot
  at its consistent point X; ``tables`` are copied inside it into ``<staging_uri>/<slot>/verify/``.
- ``extract`` (``PgDecodeExtractOperator``, ``upto_lsn`` X) and ``merge``
  (``PgDecodeMergeOperator``): the pipeline's slot is read up to X and merged, so Delta holds
  exactly the transactions the copy sees. There is no confirm: the slot is not advanced here.
  The merge records each table's watermark, so the pipeline's next batch leaves out what this
  run merged and re-reads nothing twice into Delta.
- ``verify`` (``PgDecodeVerifyOperator``): the verify job compares row counts and a hash per key
  bucket, narrows differing buckets to the differing keys, logs and returns the report, emits it
  as an Asset event (``file://<staging_uri>/<slot>/verify``, alias ``pgdecode_verify``), and fails
  naming the tables and keys when they differ.

Wiring only. Run it by hand, with the pipeline's own params::

    airflow dags trigger pgdecode_verify -c '{"slot_name": "pgdecode_shop",
        "staging_uri": "/data/staging", "delta_root": "/data/delta"}'

Params: ``postgres_conn_id``, ``slot_name``, ``plugin``, ``publication``, ``tables`` (``schema.table``
names; empty: every table with a primary key, as pgdecode_incremental's default),
``staging_uri``, ``delta_root`` (local directories or ``s3://bucket/prefix``), ``storage_conn_id`` (an
Airflow ``aws`` connection for ``s3://`` locations, ``endpoint_url`` in its extra for an
S3-compatible store; empty: local paths), ``spark_conn_id`` (as pgdecode_incremental's), and ``max_keys``
(differing keys listed per table). A pgdecode_incremental run that merges past X while this run
copies makes the verify fail with "run the verify again"; pause it meanwhile to avoid that.
docs/verify.md says what is checked and what it costs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Param

from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.verify import PgDecodeVerifyOperator
from airflow_provider_pgdecode.operators.verify_snapshot import PgDecodeVerifySnapshotOperator
from airflow_provider_pgdecode.utils.config import pgdecode_setting

DATA_DIR = pgdecode_setting("data_dir")  # [pgdecode] data_dir (AIRFLOW__PGDECODE__DATA_DIR)
TABLE_OPTIONS: Any = "{{ params.table_options }}"  # rendered to the param's mapping

with DAG(
    dag_id="pgdecode_verify",
    description="Verify Delta against PostgreSQL at one consistent LSN, naming the differing keys",
    schedule=None,  # triggered by hand (or by another DAG)
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["pgdecode", "cdc", "verify"],
    doc_md=__doc__,
    params={
        "postgres_conn_id": Param(
            "pgdecode_default",
            type="string",
            description="the source database's Airflow connection (type pgdecode; postgres works too)",
        ),
        "slot_name": Param(
            "pgdecode", type="string", pattern="^[a-z0-9_]{1,63}$", description="the pipeline's replication slot"
        ),
        "plugin": Param("test_decoding", enum=list(SUPPORTED_PLUGINS), description="the slot's output plugin"),
        "publication": Param(
            "pgdecode", type="string", description="the publication a pgoutput slot reads (ignored for test_decoding)"
        ),
        "tables": Param(
            [],
            type="array",
            description="schema.table names to verify; empty: every table with a primary key",
        ),
        "exclude_tables": Param([], type="array", description="schema.table names the pipeline leaves out"),
        "table_options": Param({}, type="object", description="the pipeline's per-table options (docs/merge.md)"),
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
        "max_keys": Param(100, type="integer", minimum=0, description="differing keys listed per table"),
    },
) as dag:
    # [START howto_operator_pgdecode_verify_snapshot]
    verify_snapshot = PgDecodeVerifySnapshotOperator(
        task_id="verify_snapshot",
        slot_name="{{ params.slot_name }}",
        staging_root="{{ params.staging_uri }}",
        plugin="{{ params.plugin }}",
        tables="{{ params.tables }}",
        exclude_tables="{{ params.exclude_tables }}",
        table_options=TABLE_OPTIONS,
        publication="{{ params.publication if params.plugin == 'pgoutput' else None }}",
        postgres_conn_id="{{ params.postgres_conn_id }}",
        storage_conn_id="{{ params.storage_conn_id }}",
        multiple_outputs=True,  # the snapshot's keys as XComs too: snapshot["lsn"]
    )
    # [END howto_operator_pgdecode_verify_snapshot]
    # XComArgs (typed Any: they stand for any templated argument): the operators resolve them when
    # they run, and they order the tasks.
    snapshot: Any = verify_snapshot.output
    extract = PgDecodeExtractOperator(
        task_id="extract",
        slot_name="{{ params.slot_name }}",
        staging_root="{{ params.staging_uri }}",
        plugin="{{ params.plugin }}",
        postgres_conn_id="{{ params.postgres_conn_id }}",
        tables=snapshot["tables"],
        publication="{{ params.publication if params.plugin == 'pgoutput' else None }}",
        upto_lsn=snapshot["lsn"],
        table_options="{{ params.table_options }}",
        checkpoint_task_id=None,  # from the slot's position (and the staged batch ending there)
        storage_conn_id="{{ params.storage_conn_id }}",
        multiple_outputs=True,  # its summary's keys as XComs too: extract.output["path"]
    )
    extracted: Any = extract.output
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=extracted["path"],
        delta_root="{{ params.delta_root }}",
        conn_id="{{ params.spark_conn_id }}",
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [START howto_operator_pgdecode_verify]
    verify = PgDecodeVerifyOperator(
        task_id="verify",
        snapshot=snapshot,
        delta_root="{{ params.delta_root }}",
        conn_id="{{ params.spark_conn_id }}",
        max_keys="{{ params.max_keys }}",
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [END howto_operator_pgdecode_verify]

    verify_snapshot >> extract >> merge >> verify
