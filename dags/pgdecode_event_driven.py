"""The airflow DAG pgdecode_event_driven: the CDC cycle, run when the slot has changes (its Asset's event trigger).

Its code ships in the provider: airflow_provider_pgdecode/example_dags/pgdecode_event_driven.py
(docs/event-driven.md; a triggerer must run).
"""

import importlib

from airflow_provider_pgdecode.example_dags import pgdecode_event_driven

# Reloaded so that each parse reads the settings in force now, also in a process that parsed it before.
dag = importlib.reload(pgdecode_event_driven).dag

__all__ = ["dag"]
