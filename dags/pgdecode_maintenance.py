"""The airflow DAG pgdecode_maintenance: weekly OPTIMIZE and VACUUM of pgdecode's Delta tables.

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_maintenance.py
(settings: the [pgdecode] section of Airflow's configuration, docs/settings.md).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_maintenance

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_maintenance).dag

__all__ = ["dag"]
