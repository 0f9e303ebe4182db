"""DAGs from a sources file: an incremental and a backfill DAG per source.

``dags/pgdecode_sources.py`` calls :func:`sources_dags` and puts the DAGs in its globals. The
file is ``[pgdecode] sources`` (``PGDECODE_SOURCES``, ``AIRFLOW__PGDECODE__SOURCES``; a relative
path is taken from the folder of the DAG file), else ``pgdecode_sources.yaml`` next to the DAG
file; with neither, no DAG. Its format and checks: :mod:`airflow_provider_pgdecode.utils.sources`
and docs/sources.md.

Each source ``<name>`` gives:

- ``pgdecode_<name>_incremental``: the cycle of ``pgdecode_incremental`` (built by
  :func:`~airflow_provider_pgdecode.example_dags.pgdecode_incremental.incremental_dag`), or, with
  ``schedule: event``, that of ``pgdecode_event_driven``
  (:func:`~airflow_provider_pgdecode.example_dags.pgdecode_event_driven.event_driven_dag`);
- ``pgdecode_<name>_backfill``: the DAG of ``pgdecode_backfill``
  (:func:`~airflow_provider_pgdecode.example_dags.pgdecode_backfill.backfill_dag`).

The source's connection, slot, plugin and publication are fixed in both (not params: a DAG
reads one slot, which no other source shares); its tables, options, locations and connections
are the defaults of the params, still overridable per run. The ``merge`` and ``drain`` tasks of
every DAG run in the source's ``pool``, so that a pool of pgdecode's own caps the merges of all
sources together. Parsing reads the file only: no database, Spark or object store is reached.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow.sdk import DAG

from airflow_provider_pgdecode.example_dags.cycle import CycleSettings, Source
from airflow_provider_pgdecode.example_dags.pgdecode_backfill import backfill_dag
from airflow_provider_pgdecode.example_dags.pgdecode_event_driven import WAIT_SECONDS as EVENT_WAIT_SECONDS
from airflow_provider_pgdecode.example_dags.pgdecode_event_driven import event_driven_dag
from airflow_provider_pgdecode.example_dags.pgdecode_incremental import incremental_dag
from airflow_provider_pgdecode.utils.config import pgdecode_setting
from airflow_provider_pgdecode.utils.sources import (
    SourceConfig,
    backfill_dag_id,
    incremental_dag_id,
    load_sources,
    sources_file,
)


def sources_dags(default_file: str | os.PathLike[str]) -> dict[str, DAG]:
    """The DAGs of the sources file, by DAG id (none when there is no file).

    :param default_file: the file read when ``[pgdecode] sources`` is empty (if it exists); a
        relative ``[pgdecode] sources`` is taken from its folder.
    :raises ConfigurationError: the configured file does not exist, or the file has problems
        (all of them, each naming the file, the line, the source and the field).
    """
    path = sources_file(pgdecode_setting("sources"), default_file)
    if path is None:
        return {}
    config = load_sources(path, data_dir=pgdecode_setting("data_dir"))
    dags: dict[str, DAG] = {}
    for source in config:
        for dag in (_incremental(source, path), _backfill(source, path)):
            dags[dag.dag_id] = dag
    return dags


def _settings(source: SourceConfig) -> CycleSettings:
    """The [pgdecode] settings, with what the file gives for the source instead."""
    settings = CycleSettings.from_config()
    if source.is_event_driven:  # a run started by the trigger finds changes at once
        settings = replace(settings, wait_seconds=EVENT_WAIT_SECONDS)
    given = {f: getattr(source, f) for f in ("wait_seconds", "max_lag_bytes", "retention_days") if source.given(f)}
    return replace(settings, **given)


def _common_params(source: SourceConfig) -> dict[str, Any]:
    return {
        "tables": list(source.tables),
        "exclude_tables": list(source.exclude_tables),
        "table_options": dict(source.table_options),
        "staging_uri": source.staging_uri,
        "storage_conn_id": source.storage_conn_id,
        "spark_conn_id": source.spark_conn_id,
    }


def _doc(dag_id: str, source: SourceConfig, path: Path, kind: str, base: str) -> str:
    publication = f", publication `{source.publication}`" if source.publication else ""
    return (
        f"{dag_id}: the {kind} DAG of source `{source.name}` in `{path}`: slot `{source.slot}` "
        f"({source.plugin}{publication}) of connection `{source.postgres_conn_id}`, Delta root "
        f"`{source.delta_root}`, merges in pool `{source.pool}`.\n\n"
        f"Generated from the sources file by `dags/pgdecode_sources.py` (docs/sources.md): change the file, "
        f"not the DAG. Its tasks and params are those of `{base}`, with the source fixed and the file's "
        "values as the params' defaults."
    )


def _incremental(source: SourceConfig, path: Path) -> DAG:
    dag_id = incremental_dag_id(source.name)
    params = {
        **_common_params(source),
        "delta_root": source.delta_root,
        "max_batch_changes": source.max_batch_changes,
        "max_batch_wal_bytes": source.max_batch_wal_bytes,
        "drain": source.drain,
        "failover": source.failover,
        "on_slot_lost": source.on_slot_lost,
        "max_slot_recoveries_per_day": source.max_slot_recoveries_per_day,
    }
    tags = ("pgdecode", "cdc", f"source:{source.name}")
    if source.is_event_driven:
        return event_driven_dag(
            dag_id,
            slot_name=source.slot,
            postgres_conn_id=source.postgres_conn_id,
            plugin=source.plugin,
            publication=source.publication or "",
            poll_interval=source.poll_interval,
            param_defaults=params,
            pool=source.pool,
            settings=_settings(source),
            description=f"Event-driven CDC of source {source.name}: runs when slot {source.slot} has changes",
            tags=(*tags, "event-driven"),
            doc_md=_doc(dag_id, source, path, "event-driven incremental", "pgdecode_event_driven"),
        )
    return incremental_dag(
        dag_id,
        source=Source(source.slot, source.postgres_conn_id, source.plugin, source.publication),
        schedule=source.schedule if source.given("schedule") else ...,
        param_defaults=params,
        pool=source.pool,
        settings=_settings(source),
        description=f"Incremental CDC of source {source.name}: slot {source.slot} -> Delta {source.delta_root}",
        tags=tags,
        doc_md=_doc(dag_id, source, path, "incremental", "pgdecode_incremental"),
    )


def _backfill(source: SourceConfig, path: Path) -> DAG:
    dag_id = backfill_dag_id(source.name)
    assert source.delta_root is not None  # filled in by load_sources
    return backfill_dag(
        dag_id,
        source=Source(source.slot, source.postgres_conn_id, source.plugin, source.publication),
        delta_root=source.delta_root,
        replay_root=f"{source.delta_root.rstrip('/')}_backfill",
        param_defaults=_common_params(source),
        pool=source.pool,
        description=f"Initial load, add or re-snapshot tables, or replay batches of source {source.name}",
        tags=("pgdecode", "cdc", "backfill", f"source:{source.name}"),
        doc_md=_doc(dag_id, source, path, "backfill", "pgdecode_backfill"),
    )
