"""Example DAGs of the provider, importable by users.

Each module defines one DAG object, ``dag``: ``pgdecode_incremental`` (the CDC cycle),
``pgdecode_backfill`` (initial load, add or re-snapshot tables, replay), ``pgdecode_verify``
(Delta against PostgreSQL at one LSN), ``pgdecode_delta_consumer`` (a DAG triggered by the
merge's Asset events), ``pgdecode_event_driven`` (the incremental cycle, scheduled on the
slot's Asset: it runs when the slot has changes) and ``pgdecode_maintenance`` (weekly
OPTIMIZE and VACUUM of the Delta tables). ``cycle`` builds the cycle's tasks for both
cycle DAGs. Put them in Airflow by a file in your ``dags_folder`` that imports the
DAG (Airflow's safe mode looks for the words "airflow" and "dag" in it)::

    # my_dags/pgdecode_incremental.py: the airflow dag of the pgdecode provider
    from airflow_provider_pgdecode.example_dags.pgdecode_incremental import dag

Their settings come from the ``[pgdecode]`` section of Airflow's configuration
(:mod:`airflow_provider_pgdecode.utils.config`), read when the file is parsed.
"""
