"""The Airflow Assets pgdecode emits: one per Delta table a merge changed, one per verify report."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from airflow.sdk import Asset

from airflow_provider_pgdecode.batch.format import delta_path_part
from airflow_provider_pgdecode.batch.storage import is_object_store


def location_asset(location: str | Path) -> Asset:
    """The Airflow Asset of a directory: named by its URI (``name == uri``), a ``file://`` URI of
    the resolved path for a local directory, ``s3://bucket/...`` (percent-encoded) for one on
    object storage (other schemes normalise badly). Exactly ``Asset(uri)``: what the provider
    emits and what a DAG schedules on are one Asset, which Airflow keeps active."""
    text = str(location)
    if is_object_store(text):
        bucket, _, prefix = text.split("://", 1)[1].partition("/")
        uri = f"s3://{bucket}/" + "/".join(quote(p, safe="") for p in prefix.split("/") if p)
    else:
        uri = Path(text).resolve().as_uri()
    return Asset(uri)


def delta_table_asset(delta_root: str | Path, schema: str, table: str) -> Asset:
    """The Airflow Asset of one Delta table, ``<delta_root>/<schema>/<table>`` as the merge job
    writes it (:func:`~airflow_provider_pgdecode.batch.format.delta_path_part`). The merge emits it
    for each table it changed; schedule a DAG on the same call::

        schedule=[delta_table_asset("/data/delta", "public", "orders")]

    (equal to ``Asset("file:///data/delta/public/orders")``: name and URI are the table's URI)."""
    root = str(delta_root)
    if is_object_store(root):
        return location_asset(f"{root.rstrip('/')}/{delta_path_part(schema)}/{delta_path_part(table)}")
    return location_asset(Path(root) / delta_path_part(schema) / delta_path_part(table))
