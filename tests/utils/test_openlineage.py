"""The merge's OpenLineage datasets and facets, built from real manifests and a merge summary."""

from __future__ import annotations

import json
from pathlib import Path

import attr
import jsonschema
import pytest

pytest.importorskip("airflow.providers.openlineage", reason="the openlineage extra is not installed")

from openlineage.client.serde import Serde  # noqa: E402

from airflow_provider_pgdecode.batch.manifest import BatchManifest, ColumnSummary, TableSummary  # noqa: E402
from airflow_provider_pgdecode.utils.openlineage import (  # noqa: E402
    FACET_SCHEMA_FILE,
    FACET_SCHEMA_URL,
    PgDecodeRunFacet,
    drain_lineage,
    location_dataset,
    merge_lineage,
)

REPO = Path(__file__).resolve().parents[2]


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
    assert facet["_schemaURL"] == FACET_SCHEMA_URL


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


def test_the_facet_s_schema_url_is_the_schema_the_project_ships_and_its_fields_match() -> None:
    """FACET_SCHEMA_URL names the JSON Schema file in this repository (its $id) and its definition
    of the facet; the facet's fields are the schema's properties, all required; a real facet
    validates, a wrong LSN or plugin does not."""
    schema = json.loads((REPO / FACET_SCHEMA_FILE).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    document, _, pointer = FACET_SCHEMA_URL.partition("#")
    assert document == schema["$id"] and document.endswith("/" + FACET_SCHEMA_FILE)
    assert pointer == "/$defs/PgDecodeRunFacet"
    base, own = schema["$defs"]["PgDecodeRunFacet"]["allOf"]
    assert base["$ref"].startswith("https://openlineage.io/spec/") and base["$ref"].endswith("#/$defs/RunFacet")
    fields = [f.name for f in attr.fields(PgDecodeRunFacet) if not f.name.startswith("_")]
    assert sorted(own["properties"]) == sorted(fields) == sorted(own["required"])

    lineage = merge_lineage([batch("0/100", "1/A0", [table("public", "t", 3, {"id": "integer"})])], None)
    facet = json.loads(Serde.to_json(lineage.run_facets["pgdecode"]))
    assert facet["_schemaURL"] == FACET_SCHEMA_URL
    validator = jsonschema.Draft202012Validator(own)
    validator.validate(facet)
    assert not validator.is_valid({**facet, "endLsn": "1/a0"})  # pg_lsn's own spelling: upper case
    assert not validator.is_valid({**facet, "plugin": "wal2json"})
    assert not validator.is_valid({k: v for k, v in facet.items() if k != "changes"})


def merged(path: str, inserted: int, columns: dict[str, str]) -> dict:
    return {
        "status": "merged",
        "delta_path": path,
        "inserted": inserted,
        "updated": 1,
        "deleted": 0,
        "columns": columns,
    }


def test_a_drain_reports_all_its_batches_as_one_merge() -> None:
    first = batch("0/100", "0/300", [table("public", "orders", 5, {"id": "bigint"})])
    second = batch("0/300", "0/500", [table("public", "orders", 2, {"id": "bigint", "note": "text"})])
    third = batch("0/500", "0/700", [table("public", "customers", 4, {"id": "integer"})])
    orders, customers = "s3a://lake/delta/public/orders", "s3a://lake/delta/public/customers"
    lineage = drain_lineage(
        [
            ([first], {"tables": {"public.orders": merged(orders, 4, {"id": "bigint"})}}),
            ([second], {"tables": {"public.orders": merged(orders, 1, {"id": "bigint", "note": "string"})}}),
            (
                [third],
                {
                    "tables": {
                        "public.customers": merged(customers, 4, {"id": "int"}),
                        "public.orders": {"status": "skipped", "delta_path": orders},
                    }
                },
            ),
        ]
    )
    inputs = {i.name: i for i in lineage.inputs}
    assert inputs["shop.public.orders"].inputFacets["inputStatistics"].rowCount == 7
    assert [f.name for f in inputs["shop.public.orders"].facets["schema"].fields] == ["id", "note"]
    outputs = {o.name: o for o in lineage.outputs}
    assert set(outputs) == {"delta/public/orders", "delta/public/customers"}
    # 4 + 1 inserted, 1 + 1 updated: both merges that changed it; the third skipped it.
    assert outputs["delta/public/orders"].outputFacets["outputStatistics"].rowCount == 7
    assert [f.name for f in outputs["delta/public/orders"].facets["schema"].fields] == ["id", "note"]
    assert outputs["delta/public/customers"].outputFacets["outputStatistics"].rowCount == 5
    facet = lineage.run_facets["pgdecode"]
    assert (facet.startLsn, facet.endLsn, facet.batches, facet.changes) == ("0/100", "0/700", 3, 11)
    assert drain_lineage([]).run_facets == {} and drain_lineage([]).outputs == []
