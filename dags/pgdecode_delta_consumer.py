"""The airflow DAG pgdecode_delta_consumer: runs after each merge that changed the Delta table public.orders.

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_delta_consumer.py
(settings: the [pgdecode] section of Airflow's configuration, docs/settings.md).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_delta_consumer

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_delta_consumer).dag

__all__ = ["dag"]
