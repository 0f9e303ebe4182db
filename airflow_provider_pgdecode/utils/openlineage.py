"""OpenLineage for a merge: the PostgreSQL tables its batches held in, the Delta tables it changed out.

Airflow's OpenLineage provider (``apache-airflow-providers-openlineage``, the ``openlineage``
extra) calls an operator's ``get_openlineage_facets_on_complete`` after it succeeds; without the
provider this module is never imported (the operators import it inside that method). Datasets are named as OpenLineage's naming conventions say:

* a PostgreSQL table: namespace ``postgres://<host>:<port>`` (the server the extract connected
  to, recorded in the batch's manifest), name ``<database>.<schema>.<table>``;
* a Delta table, by its location: namespace ``file`` and the absolute path, or ``s3://<bucket>``
  and the key (``s3a://`` is written ``s3://``).

Each input carries its schema (PostgreSQL types) and the changes staged for it; each output its
schema (Delta types) and the rows the merge wrote (inserted + updated + deleted); the run carries
the ``pgdecode`` facet: slot, plugin and the LSN range of the batches. The Airflow Asset events
the merge emits stay as they are (docs/assets.md).

The drain merges batch after batch in one task: each merged batch is also an OpenLineage run of its
own (:func:`emit_batch_lineage`: one COMPLETE event, a child of the drain task's run through the
``parent`` run facet), and the task's own COMPLETE event sums them up (:func:`drain_lineage`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attr
from airflow.providers.openlineage.extractors import OperatorLineage
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    RunFacet,
    input_statistics_input_dataset,
    job_type_job,
    output_statistics_output_dataset,
    parent_run,
    schema_dataset,
)
from openlineage.client.uuid import generate_static_uuid

from airflow_provider_pgdecode.batch.format import is_local_path, local_path

if TYPE_CHECKING:
    from airflow_provider_pgdecode.batch.manifest import BatchManifest

#: The JSON Schema of the ``pgdecode`` run facet, as the repository ships it (and the documentation site
#: serves it: ``spec/facets/1-0-0/PgDecodeRunFacet.json``); versioned in its path, as OpenLineage's
#: own facets are: a change of the facet's fields is a new version, the old file stays.
FACET_SCHEMA_FILE = "docs/_extra/spec/facets/1-0-0/PgDecodeRunFacet.json"
FACET_SCHEMA_URL = (
    f"https://raw.githubusercontent.com/pgdecode/airflow-provider-pgdecode/main/{FACET_SCHEMA_FILE}"
    "#/$defs/PgDecodeRunFacet"
)

#: The suffix of a drained batch's job name: ``<dag_id>.<task_id>.batch``, one run per batch.
BATCH_JOB_SUFFIX = "batch"


def postgres_dataset(server: str | None, database: str, schema: str, table: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) of a PostgreSQL table."""
    return f"postgres://{server or 'unknown'}", f"{database}.{schema}.{table}"


def location_dataset(location: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) of a Delta table at ``location`` (a local path or an
    ``s3://``/``s3a://`` URI)."""
    if is_local_path(location):
        return "file", os.path.realpath(local_path(location))
    parts = urlsplit(location)
    scheme = "s3" if parts.scheme in ("s3", "s3a", "s3n") else parts.scheme
    return f"{scheme}://{parts.netloc}", parts.path.lstrip("/")


def merge_lineage(batches: Sequence[BatchManifest], summary: Mapping[str, Any] | None) -> OperatorLineage:
    """The lineage of one merge run: ``batches`` it read, ``summary`` the merge job's."""

    def schema_facet(columns: Mapping[str, str]) -> schema_dataset.SchemaDatasetFacet:
        fields = [schema_dataset.SchemaDatasetFacetFields(name=n, type=t) for n, t in columns.items()]
        return schema_dataset.SchemaDatasetFacet(fields=fields)

    staged: dict[tuple[str, str], dict[str, Any]] = {}
    for batch in batches:
        for entry in batch.tables:
            key = postgres_dataset(batch.server, batch.database, entry.schema, entry.table)
            seen = staged.setdefault(key, {"rows": 0, "columns": {}})
            seen["rows"] += entry.rows
            seen["columns"].update({c.name: c.source_type for c in entry.columns})
    inputs = [
        InputDataset(
            namespace=namespace,
            name=name,
            facets={"schema": schema_facet(seen["columns"])},
            inputFacets={
                "inputStatistics": input_statistics_input_dataset.InputStatisticsInputDatasetFacet(
                    rowCount=seen["rows"]
                )
            },
        )
        for (namespace, name), seen in sorted(staged.items())
    ]
    outputs = []
    for table in sorted(((summary or {}).get("tables") or {}).values(), key=lambda t: str(t.get("delta_path"))):
        if table.get("status") != "merged":
            continue  # already applied: this run changed nothing there
        namespace, name = location_dataset(str(table["delta_path"]))
        written = sum(int(table.get(k) or 0) for k in ("inserted", "updated", "deleted"))
        outputs.append(
            OutputDataset(
                namespace=namespace,
                name=name,
                facets={"schema": schema_facet(table.get("columns") or {})},
                outputFacets={
                    "outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
                        rowCount=written
                    )
                },
            )
        )
    run_facets: dict[str, Any] = {}
    if batches:
        run_facets["pgdecode"] = PgDecodeRunFacet(
            slot=batches[0].slot,
            plugin=batches[0].plugin,
            startLsn=batches[0].start_lsn,
            endLsn=batches[-1].end_lsn,
            batches=len(batches),
            changes=sum(b.changes for b in batches),
        )
    return OperatorLineage(inputs=inputs, outputs=outputs, run_facets=run_facets)


@attr.define
class PgDecodeRunFacet(RunFacet):
    """The ``pgdecode`` run facet: which slot's changes a run merged, and their LSN range."""

    slot: str
    plugin: str
    startLsn: str  # noqa: N815 (OpenLineage's facets spell fields in camelCase)
    endLsn: str  # noqa: N815
    batches: int
    changes: int

    @staticmethod
    def _get_schema() -> str:
        return FACET_SCHEMA_URL


def combined_summary(summaries: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One merge summary of several merges of the same task (the drain's batches), as
    :func:`merge_lineage` reads it: per Delta table, the rows of every merge that changed it and the
    latest schema; a table none of them changed keeps the status it had."""
    tables: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for name, table in ((summary or {}).get("tables") or {}).items():
            seen = tables.get(name)
            if seen is None or (seen.get("status") != "merged" and table.get("status") == "merged"):
                tables[name] = dict(table)
            elif table.get("status") == "merged":
                for key in ("inserted", "updated", "deleted"):
                    seen[key] = int(seen.get(key) or 0) + int(table.get(key) or 0)
                seen["columns"] = table.get("columns") or seen.get("columns")
    return {"tables": tables}


def drain_lineage(merges: Sequence[tuple[Sequence[BatchManifest], Mapping[str, Any] | None]]) -> OperatorLineage:
    """The lineage of a drain task: all the batches it merged (``merges``: each merge's batches and
    summary), as one merge of them all."""
    batches = [batch for merged, _ in merges for batch in merged]
    return merge_lineage(batches, combined_summary(summary for _, summary in merges))


def batch_run_event(ti: Any, lineage: OperatorLineage, *, event_time: datetime | None = None) -> RunEvent:
    """The COMPLETE event of one batch a task (``ti``) merged, with ``lineage`` (:func:`merge_lineage`
    of that batch): job ``<dag_id>.<task_id>.batch`` in the task's namespace; a run of its own, whose
    ``parent`` facet names the task's run (and the DAG run as root), as OpenLineage's Airflow
    integration names them; its id a UUID of the event time and the batch's end LSN."""
    from airflow.providers.openlineage.plugins.macros import (
        lineage_job_name,
        lineage_job_namespace,
        lineage_root_job_name,
        lineage_root_job_namespace,
        lineage_root_run_id,
        lineage_run_id,
    )

    when = event_time or datetime.now(UTC)
    namespace, parent_job, parent_run_id = lineage_job_namespace(), lineage_job_name(ti), lineage_run_id(ti)
    facet = lineage.run_facets.get("pgdecode")
    end = facet.endLsn if isinstance(facet, PgDecodeRunFacet) else when.isoformat()
    parent = parent_run.ParentRunFacet(
        run=parent_run.Run(runId=parent_run_id),
        job=parent_run.Job(namespace=namespace, name=parent_job),
        root=parent_run.Root(
            run=parent_run.RootRun(runId=lineage_root_run_id(ti)),
            job=parent_run.RootJob(namespace=lineage_root_job_namespace(ti), name=lineage_root_job_name(ti)),
        ),
    )
    return RunEvent(
        eventType=RunState.COMPLETE,
        eventTime=when.isoformat(),
        run=Run(
            runId=str(generate_static_uuid(instant=when, data=f"{parent_run_id}.{end}".encode())),
            facets={**lineage.run_facets, "parent": parent},
        ),
        job=Job(
            namespace=namespace,
            name=f"{parent_job}.{BATCH_JOB_SUFFIX}",
            facets={
                "jobType": job_type_job.JobTypeJobFacet(processingType="BATCH", integration="AIRFLOW", jobType="TASK")
            },
        ),
        inputs=lineage.inputs,
        outputs=lineage.outputs,
    )


def emit_batch_lineage(
    task: Any, ti: Any, batches: Sequence[BatchManifest], summary: Mapping[str, Any] | None
) -> RunEvent | None:
    """Emit the OpenLineage event of one batch ``task`` merged (:func:`batch_run_event`) through the
    OpenLineage provider's own adapter (its transport, redaction and metrics), when the provider is
    configured and its emission policy lets ``task`` emit with its metadata; the event sent, or ``None``."""
    from airflow.providers.openlineage import conf
    from airflow.providers.openlineage.plugins.listener import get_openlineage_listener
    from airflow.providers.openlineage.utils.emission_policy import resolve_task_emission_policy

    if conf.is_disabled():
        return None
    policy = resolve_task_emission_policy(operator=task, dag_id=ti.dag_id, task_id=ti.task_id)
    if not (policy.emit and policy.extract_operator_metadata):
        return None
    return get_openlineage_listener().adapter.emit(batch_run_event(ti, merge_lineage(batches, summary)))
