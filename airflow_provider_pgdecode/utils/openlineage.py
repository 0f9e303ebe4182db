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
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attr
from airflow.providers.openlineage.extractors import OperatorLineage
from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.facet_v2 import (
    RunFacet,
    input_statistics_input_dataset,
    output_statistics_output_dataset,
    schema_dataset,
)

from airflow_provider_pgdecode.batch.format import is_local_path, local_path

if TYPE_CHECKING:
    from airflow_provider_pgdecode.batch.manifest import BatchManifest

#: Where the ``pgdecode`` run facet's schema is described (docs/lineage.md).
FACET_SCHEMA_URL = "https://github.com/pgdecode/pgdecode/blob/main/docs/lineage.md#the-pgdecode-run-facet"


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
