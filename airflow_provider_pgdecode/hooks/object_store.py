"""Object storage settings from an Airflow connection of the Amazon provider's ``aws`` type.

An S3-compatible store is reached with the connection's key pair (login/password, or any way the
Amazon provider resolves credentials: a role, a profile, the instance's), its region
(``region_name`` in the extra) and, for stores other than AWS, ``endpoint_url`` in the extra::

    airflow connections add lake --conn-type aws --conn-login KEY --conn-password SECRET \\
        --conn-extra '{"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}'

The secrets are registered with Airflow's log masker as they are read, so a task log that would
print one shows ``***``.
"""

from __future__ import annotations

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, is_object_store
from airflow_provider_pgdecode.errors import ConfigurationError


def object_store_settings(storage_conn_id: str | None) -> ObjectStoreSettings | None:
    """The settings of the ``aws`` connection ``storage_conn_id``; ``None`` when it is empty."""
    if not storage_conn_id:
        return None
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigurationError(
            f"storage_conn_id={storage_conn_id!r} needs the Amazon provider: "
            "pip install 'airflow-provider-pgdecode[amazon]'"
        ) from exc
    hook = AwsBaseHook(aws_conn_id=storage_conn_id, client_type="s3")
    config = hook.conn_config
    credentials = hook.get_credentials()  # masks the secret key and token in task logs
    return ObjectStoreSettings(
        endpoint_url=config.get_service_endpoint_url("s3"),
        region=hook.region_name,
        access_key=credentials.access_key,
        secret_key=credentials.secret_key,
        session_token=credentials.token,
    )


def storage_for(location: str, storage_conn_id: str | None) -> Storage:
    """The :class:`Storage` of a staging or Delta location, with the connection's settings when
    it is on object storage. An ``s3://`` location without a connection uses the ``AWS_*``
    environment (the instance's role on AWS); a local path ignores the connection."""
    if not is_object_store(location):
        return Storage(location)
    return Storage(location, object_store_settings(storage_conn_id))


__all__ = ["object_store_settings", "storage_for"]
