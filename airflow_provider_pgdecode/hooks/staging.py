"""The staging and Delta locations an operator hands to the layers below, resolved at run time.

Operators, sensors and triggers take a location (``staging_root``, a batch path) and a
``storage_conn_id`` as plain strings: they are templated and end up in the rendered task
fields, so they hold no secret. Only inside ``execute()``/``poke()``/a trigger's ``run()`` are
they turned into something that reaches the store, with the connection's credentials:

* a local path stays the path as given (the batch layer opens it as before);
* an ``s3://bucket/prefix`` becomes a :class:`~airflow_provider_pgdecode.batch.storage.Storage`
  carrying the ``aws`` connection's settings (endpoint, region, keys), which the batch layer and
  capture use for every read, write, list and delete.

Example::

    from airflow_provider_pgdecode.hooks.staging import staging_location

    root = staging_location("s3://lake/staging", "lake")  # in execute(), never at parse time
"""

from __future__ import annotations

from airflow_provider_pgdecode.batch.storage import Storage, is_object_store
from airflow_provider_pgdecode.hooks.object_store import storage_for


def staging_location(location: str, storage_conn_id: str | None) -> str | Storage:
    """``location`` as the batch layer takes it: the path itself when local, a
    :class:`~airflow_provider_pgdecode.batch.storage.Storage` with the settings of the ``aws``
    connection ``storage_conn_id`` on object storage (empty: the ``AWS_*`` environment)."""
    text = str(location)
    if not is_object_store(text):
        return text
    return storage_for(text, str(storage_conn_id or "") or None)


__all__ = ["staging_location"]
