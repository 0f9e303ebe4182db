"""The airflow DAG pgdecode_backfill: initial load, add or re-snapshot tables, replay staged batches.

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_backfill.py
(settings: the [pgdecode] section of Airflow's configuration, docs/settings.md).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_backfill

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_backfill).dag

__all__ = ["dag"]
