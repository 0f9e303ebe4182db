"""The merge's OpenLineage datasets and facets, built from real manifests and a merge summary."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("airflow.providers.openlineage", reason="the openlineage extra is not installed")

from openlineage.client.serde import Serde  # noqa: E402

from airflow_provider_pgdecode.batch.manifest import BatchManifest, ColumnSummary, TableSummary  # noqa: E402
from airflow_provider_pgdecode.utils.openlineage import location_dataset, merge_lineage  # noqa: E402


def table(schema: str, name: str, rows: int, columns: dict[str, str]) -> TableSummary:
    return TableSummary(
        schema=schema,
        table=name,
        path=f"tables/{schema}/{name}",
        files=["part-00000.parquet"],
        rows=rows,
        inserts=rows,
        updates=0,
        deletes=0,
        truncates=0,
        min_commit_lsn="0/100",
        max_commit_lsn="0/200",
        columns=[ColumnSummary(n, t, "string") for n, t in columns.items()],
    )


def batch(start: str, end: str, tables: list[TableSummary]) -> BatchManifest:
    return BatchManifest(
        slot="pgdecode_shop",
        plugin="pgoutput",
        database="shop",
        server="db1.internal:5432",
        start_lsn=start,
        end_lsn=end,
        ceiling_lsn=end,
        transactions=2,
        changes=sum(t.rows for t in tables),
        tables=tables,
    )


def test_inputs_are_the_batches_tables_and_outputs_the_delta_tables_changed() -> None:
    batches = [
        batch("0/100", "0/300", [table("public", "orders", 5, {"id": "bigint", "amount": "numeric(10,2)"})]),
        batch(
            "0/300",
            "0/500",
            [
                table("public", "orders", 2, {"id": "bigint", "amount": "numeric(10,2)"}),
                table("public", "customers", 3, {"id": "integer", "name": "text"}),
            ],
        ),
    ]
    summary = {
        "tables": {
            "public.orders": {
                "status": "merged",
                "delta_path": "s3a://lake/delta/public/orders",
                "inserted": 4,
                "updated": 2,
                "deleted": 1,
                "columns": {"id": "bigint", "amount": "decimal(10,2)"},
            },
            "public.customers": {"status": "skipped", "delta_path": "s3a://lake/delta/public/customers"},
        }
    }
    lineage = merge_lineage(batches, summary)
    events = [json.loads(Serde.to_json(d)) for d in (*lineage.inputs, *lineage.outputs)]
    inputs, outputs = events[:2], events[2:]
    assert [(i["namespace"], i["name"]) for i in inputs] == [
        ("postgres://db1.internal:5432", "shop.public.customers"),
        ("postgres://db1.internal:5432", "shop.public.orders"),
    ]
    orders = inputs[1]
    assert orders["inputFacets"]["inputStatistics"]["rowCount"] == 7  # both batches' changes
    assert [(f["name"], f["type"]) for f in orders["facets"]["schema"]["fields"]] == [
        ("id", "bigint"),
        ("amount", "numeric(10,2)"),
    ]
    # Only the table this run changed is an output (customers' batches were applied already).
    assert [(o["namespace"], o["name"]) for o in outputs] == [("s3://lake", "delta/public/orders")]
    assert outputs[0]["outputFacets"]["outputStatistics"]["rowCount"] == 7
    assert [(f["name"], f["type"]) for f in outputs[0]["facets"]["schema"]["fields"]] == [
        ("id", "bigint"),
        ("amount", "decimal(10,2)"),
    ]
    facet = json.loads(Serde.to_json(lineage.run_facets["pgdecode"]))
    assert {k: facet[k] for k in ("slot", "plugin", "startLsn", "endLsn", "batches", "changes")} == {
        "slot": "pgdecode_shop",
        "plugin": "pgoutput",
        "startLsn": "0/100",
        "endLsn": "0/500",
        "batches": 2,
        "changes": 10,
    }
    assert facet["_schemaURL"].endswith("docs/lineage.md#the-pgdecode-run-facet")


def test_a_local_delta_table_is_named_by_its_absolute_path(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert location_dataset(str(tmp_path / "link" / "public" / "t")) == ("file", str(tmp_path / "real/public/t"))
    assert location_dataset("s3://bucket/a/b") == ("s3://bucket", "a/b")


def test_a_batch_staged_before_the_server_was_recorded_reads_as_unknown() -> None:
    old = batch("0/100", "0/200", [table("public", "t", 1, {"id": "integer"})])
    old.server = None
    (dataset,) = merge_lineage([old], None).inputs
    assert (dataset.namespace, dataset.name) == ("postgres://unknown", "shop.public.t")
