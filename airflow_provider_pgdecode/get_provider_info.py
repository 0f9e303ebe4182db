"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_provider_pgdecode import __version__

INTEGRATION = "PostgreSQL logical decoding"


def get_provider_info() -> dict[str, Any]:
    # package-name must equal the canonical distribution name, or Airflow's provider
    # discovery raises for every CLI command.
    return {
        "package-name": "airflow-provider-pgdecode",
        "name": "pgdecode",
        "description": "Batch change-data-capture from PostgreSQL logical replication slots into Delta Lake.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://www.postgresql.org/docs/current/logicaldecoding.html",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_provider_pgdecode.hooks.pgdecode"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_provider_pgdecode.operators.slot",
                    "airflow_provider_pgdecode.operators.extract",
                    "airflow_provider_pgdecode.operators.merge",
                    "airflow_provider_pgdecode.operators.confirm",
                    "airflow_provider_pgdecode.operators.initial_snapshot",
                    "airflow_provider_pgdecode.operators.table_snapshot",
                    "airflow_provider_pgdecode.operators.replay",
                    "airflow_provider_pgdecode.operators.verify_snapshot",
                    "airflow_provider_pgdecode.operators.verify",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_provider_pgdecode.sensors.slot_changes",
                    "airflow_provider_pgdecode.sensors.slot_health",
                    "airflow_provider_pgdecode.sensors.table_snapshot",
                ],
            }
        ],
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_provider_pgdecode.triggers.slot_changes"],
            }
        ],
        # PgDecodeHook works with ordinary `postgres` connections, but that type belongs to the
        # Postgres provider; a `pgdecode` type (same fields) lets Airflow list the hook.
        "connection-types": [
            {
                "connection-type": "pgdecode",
                "hook-class-name": "airflow_provider_pgdecode.hooks.pgdecode.PgDecodeConnectionHook",
                "hook-name": "PostgreSQL logical decoding (pgdecode)",
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database"},
                },
            }
        ],
    }
