"""The airflow DAG pgdecode_verify: Delta against PostgreSQL at one consistent LSN.

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_verify.py
(settings: the [pgdecode] section of Airflow's configuration, docs/settings.md).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_verify

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_verify).dag

__all__ = ["dag"]
