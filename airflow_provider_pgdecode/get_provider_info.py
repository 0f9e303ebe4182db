"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_provider_pgdecode import __version__
from airflow_provider_pgdecode.utils.config import provider_config

INTEGRATION = "PostgreSQL logical decoding"
DOCUMENTATION_URL = "https://github.com/pgdecode/airflow-provider-pgdecode"


def get_provider_info() -> dict[str, Any]:
    # package-name must equal the canonical distribution name, or Airflow's provider
    # discovery raises for every CLI command.
    return {
        "package-name": "airflow-provider-pgdecode",
        "name": "pgdecode",
        "description": "Batch change-data-capture from PostgreSQL logical replication slots into Delta Lake.",
        "versions": [__version__],
        "documentation-url": DOCUMENTATION_URL,
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
                    "airflow_provider_pgdecode.operators.drain",
                    "airflow_provider_pgdecode.operators.initial_snapshot",
                    "airflow_provider_pgdecode.operators.table_snapshot",
                    "airflow_provider_pgdecode.operators.replay",
                    "airflow_provider_pgdecode.operators.verify_snapshot",
                    "airflow_provider_pgdecode.operators.verify",
                    "airflow_provider_pgdecode.operators.maintenance",
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
                "python-modules": [
                    "airflow_provider_pgdecode.triggers.slot_changes",
                    "airflow_provider_pgdecode.triggers.slot_event",
                ],
            }
        ],
        # The pgdecode view in Airflow's UI (docs/ui.md); loaded through the airflow.plugins entry
        # point (setup.cfg), listed here for `airflow providers` and lazy_discover_providers = False.
        "plugins": [{"name": "pgdecode", "plugin-class": "airflow_provider_pgdecode.ui.plugin.PgDecodeViewPlugin"}],
        # The type whose Test button checks what a slot needs (PgDecodeHook.test_connection); a
        # `postgres` connection works with every pgdecode task too, but Airflow tests it with `select 1`.
        "notifications": ["airflow_provider_pgdecode.notifications.alerts.PgDecodeAlertNotifier"],
        "connection-types": [
            {
                "connection-type": "pgdecode",
                "hook-class-name": "airflow_provider_pgdecode.hooks.pgdecode.PgDecodeHook",
                "hook-name": "PostgreSQL logical decoding (pgdecode)",
                # The form of the Postgres provider's type: the same fields, with hints.
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database", "login": "User"},
                    "placeholders": {
                        "host": "db.example.com (the primary: slots live there)",
                        "port": "5432",
                        "schema": "the database whose changes are captured",
                        "login": "a role with the REPLICATION attribute",
                        "extra": '{"sslmode": "require"}',
                    },
                },
                # Extras the PostgreSQL driver reads (the hook passes them on like PostgresHook).
                "conn-fields": {
                    "sslmode": {
                        "label": "SSL mode",
                        "schema": {
                            "type": ["string", "null"],
                            "enum": [None, "disable", "allow", "prefer", "require", "verify-ca", "verify-full"],
                        },
                        "description": "libpq sslmode; empty: libpq's default (prefer)",
                    },
                },
            }
        ],
        "config": provider_config(),
    }
