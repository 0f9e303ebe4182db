"""The airflow DAG pgdecode_incremental: one CDC cycle per run (slot -> batch -> Delta MERGE -> confirm).

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_incremental.py
(settings: the [pgdecode] section of Airflow's configuration, docs/settings.md).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_incremental

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_incremental).dag

__all__ = ["dag"]
