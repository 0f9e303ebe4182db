"""The airflow DAGs of a sources file: an incremental and a backfill DAG per source.

The file is [pgdecode] sources (PGDECODE_SOURCES or AIRFLOW__PGDECODE__SOURCES; a relative path
is taken from this folder), else pgdecode_sources.yaml in this folder; with neither, this file
makes no DAG. Its code ships in the provider: airflow_provider_pgdecode/example_dags/sources.py
(the file's format: docs/sources.md; pgdecode_sources.example.yaml is a complete example).
"""

from pathlib import Path

from airflow_provider_pgdecode.example_dags.sources import sources_dags

# Read at each parse: a changed file changes the DAGs. A file with a problem fails this file's
# import with every problem named (file, line, source, field), and no DAG of it is made.
globals().update(sources_dags(Path(__file__).with_name("pgdecode_sources.yaml")))
