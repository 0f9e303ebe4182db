"""pgdecode_delta_consumer: a DAG that runs when the pipeline's merge changed a Delta table.

The merge (``PgDecodeMergeOperator``) emits one Asset event per Delta table it changed: the
Asset of :func:`~airflow_provider_pgdecode.operators.merge.delta_table_asset`, named by its URI
(``file://<delta_root>/<schema>/<table>`` or ``s3://bucket/<prefix>/<schema>/<table>``).
Schedule on the same call, and Airflow queues a run of this DAG after each merge that changed
the table::

    schedule=[delta_table_asset("/data/delta", "public", "orders")]

(equal to ``schedule=[Asset("file:///data/delta/public/orders")]``). The Delta root here is
``<data_dir>/delta`` (the ``[pgdecode] data_dir`` setting), the default ``delta_root`` of
pgdecode_incremental; the table is ``public.orders``. The event's ``extra`` carries the merge's
counts (``inserted``, ``updated``, ``deleted``), the Delta version and the watermark LSN.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, task

from airflow_provider_pgdecode.operators.merge import delta_table_asset
from airflow_provider_pgdecode.utils.config import pgdecode_setting

ORDERS = delta_table_asset(f"{pgdecode_setting('data_dir')}/delta", "public", "orders")

with DAG(
    dag_id="pgdecode_delta_consumer",
    description="Runs after each merge that changed the Delta table public.orders",
    schedule=[ORDERS],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["pgdecode", "cdc", "consumer"],
    doc_md=__doc__,
) as dag:

    @task
    def report_changes(*, triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        """The merges that triggered this run: each event's counts and Delta version."""
        changes = [dict(event.extra) for event in (triggering_asset_events or {}).get(ORDERS, [])]
        print(f"{ORDERS.uri}: {changes}")
        return changes

    report_changes()
