"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_provider_pgdecode import __version__


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
                "integration-name": "PostgreSQL logical decoding",
                "external-doc-url": "https://www.postgresql.org/docs/current/logicaldecoding.html",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {
                "integration-name": "PostgreSQL logical decoding",
                "python-modules": ["airflow_provider_pgdecode.hooks.pgdecode"],
            }
        ],
    }
