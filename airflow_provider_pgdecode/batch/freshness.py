"""How recent a staged batch's changes are: each table's newest commit time, read from the Parquet
statistics of its parts' ``_pg_commit_time`` column (footers only, no rows), for the freshness
metrics (:mod:`~airflow_provider_pgdecode.utils.metrics`)."""

from __future__ import annotations

import posixpath
from datetime import UTC, datetime

from airflow_provider_pgdecode.batch.format import COMMIT_TIME, table_path
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import Storage


def newest_commit_times(batch: Storage, manifest: BatchManifest) -> dict[tuple[str, str], datetime]:
    """Per Delta table (``(schema, table)``), the newest commit time among the batch's staged
    changes; a table whose parts carry no commit time (a snapshot's rows) is left out."""
    import pyarrow.parquet as pq

    newest: dict[tuple[str, str], datetime] = {}
    for table in manifest.tables:
        directory = table.path or table_path(table.schema, table.table)
        for name in table.files:
            with batch.open_input(posixpath.join(directory, name)) as source:
                metadata = pq.read_metadata(source)
            column = metadata.schema.names.index(COMMIT_TIME) if COMMIT_TIME in metadata.schema.names else None
            if column is None:
                continue
            for group in range(metadata.num_row_groups):
                stats = metadata.row_group(group).column(column).statistics
                if stats is None or not stats.has_min_max or stats.max is None:
                    continue
                when = stats.max if stats.max.tzinfo else stats.max.replace(tzinfo=UTC)
                if table.target not in newest or when > newest[table.target]:
                    newest[table.target] = when
    return newest
