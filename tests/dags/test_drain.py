"""pgdecode_incremental drains a backlog in one run: bounded batches, each confirmed before the
next, a prepared transaction across a batch boundary, a transaction larger than the bound; killed
between two batches, the next run goes on after the last confirmed one. PostgreSQL is the oracle.
Each drained batch is an OpenLineage run of its own, a child of the drain task's."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.operators import drain as drain_module
from pgdecode_testing.compare import compare_table
from tests.dags.test_pgdecode_incremental import airflow_db, run  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLE = "drain_items"
BOUND = 100


@pytest.fixture
def drain_dag(pg_cluster, pg_conn, slot_name, tmp_path, monkeypatch, airflow_db, merge_through_connect):  # noqa: F811
    from airflow.dag_processing.dagbag import DagBag

    pg_conn.execute(f"drop table if exists {TABLE}; create table {TABLE} (id int primary key, v text)")
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json("pgdecode_test"))
    monkeypatch.setenv("PGDECODE_WAIT_SECONDS", "3")
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    conf = {
        "slot_name": slot_name,
        "staging_uri": str(tmp_path / "staging"),
        "delta_root": str(tmp_path / "delta"),
        "tables": [f"public.{TABLE}"],
        "max_batch_changes": BOUND,
        "max_batch_wal_bytes": None,
    }
    return bag.dags["pgdecode_incremental"], conf


def staged(conf: dict) -> list[BatchManifest]:
    root = Path(conf["staging_uri"])
    return [BatchManifest.read(root / path) for path in list_batches(root, conf["slot_name"])]


def changes_per_transaction(manifest: BatchManifest) -> list[int]:
    import pyarrow.parquet as pq

    counts: dict[int, int] = {}
    for table in manifest.tables:
        for name in table.files:
            for lsn in pq.read_table(Path(manifest.path) / table.path / name, columns=["_pg_commit_lsn"]).column(0):
                counts[lsn.as_py()] = counts.get(lsn.as_py(), 0) + 1
    return [counts[lsn] for lsn in sorted(counts)]


def slot_position(c, slot: str) -> str:
    return c.execute(
        "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
    ).fetchone()[0]


def backlog(c, first_id: int) -> None:
    """About five bounds' worth: small transactions, one of 150 changes, a prepared transaction
    prepared early and committed late (after at least one boundary). The inserted rows carry
    1.6 kB of hex each (about 0.5 MB of WAL in all), so that the shrinking backlog the drain reports
    stands well above the WAL the server writes meanwhile by itself (checkpoints, autovacuum)."""
    c.execute(f"begin; insert into {TABLE} select g, 'p' from generate_series({first_id + 9000}, {first_id + 9019}) g")
    c.execute(f"prepare transaction 'drain_{first_id}'")
    for t in range(8):
        lo = first_id + t * 40
        c.execute(
            f"insert into {TABLE} select g, (select string_agg(md5(g::text || '.' || i), '') from"
            f" generate_series(1, 50) i) from generate_series({lo}, {lo + 39}) g"
        )
    c.execute(f"update {TABLE} set v = 'big' where id between {first_id} and {first_id + 149}")  # 150 changes
    c.execute(f"delete from {TABLE} where id between {first_id + 300} and {first_id + 309}")
    c.execute(f"commit prepared 'drain_{first_id}'")


def test_a_backlog_drains_in_one_run_and_resumes_after_a_kill(
    pg_conn, drain_dag, spark, monkeypatch, openlineage_events
) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.utils.state import DagRunState

    dag, conf = drain_dag
    c = pg_conn
    run(dag, conf)  # creates the slot; nothing to load yet
    backlog(c, 0)

    sent: list[tuple[str, float]] = []  # the metrics the steps send, through Airflow's facade as always
    send = drain_module.metrics.emit
    monkeypatch.setattr(
        drain_module.metrics,
        "emit",
        lambda metric, value, *a, **k: (sent.append((metric, value)), send(metric, value, *a, **k)),
    )
    states = run(dag, conf)
    assert states["drain"] == "success"
    backlogs = [v for m, v in sent if m == "drain.backlog_bytes"]
    assert len(backlogs) >= 3 and backlogs[-1] < backlogs[0], backlogs  # the backlog shrinks batch by batch
    assert any(m == "drain.eta_seconds" and v > 0 for m, v in sent), sent
    monkeypatch.setattr(drain_module.metrics, "emit", send)
    batches = staged(conf)
    assert len(batches) >= 5
    for manifest in batches:
        sizes = changes_per_transaction(manifest)
        assert sum(sizes) <= BOUND or sizes == [150], f"{manifest.label}: {sizes}"
    assert [b.bounded_by is not None for b in batches] == [True] * (len(batches) - 1) + [False]
    assert all(b.start_lsn == a.end_lsn for a, b in zip(batches, batches[1:], strict=False))
    assert any(p["gid"] == "drain_0" for b in batches[:-1] for p in b.prepared_pending)
    assert slot_position(c, conf["slot_name"]) == batches[-1].end_lsn
    result = compare_table(c, spark, conf["delta_root"], "public", TABLE)
    assert result.equal, result.describe()
    assert_lineage_per_batch(openlineage_events(), batches[1:], conf)

    # A second backlog; the drain is killed between its second and third batch (after a confirm,
    # before the next extract).
    backlog(c, 1000)
    done = len(batches)
    calls = {"n": 0}
    extract = drain_module.extract_once

    def killed_on_the_second(*args, **kwargs):  # the drain's own extracts, not the cycle's task
        calls["n"] += 1
        if calls["n"] == 2:
            raise AirflowFailException("killed between two batches")
        return extract(*args, **kwargs)

    monkeypatch.setattr(drain_module, "extract_once", killed_on_the_second)
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == DagRunState.FAILED
    assert {ti.task_id: ti.state for ti in dag_run.get_task_instances()}["drain"] == "failed"
    before_kill = staged(conf)
    assert len(before_kill) == done + 2  # the cycle's batch and one drained batch, both confirmed
    assert slot_position(c, conf["slot_name"]) == before_kill[-1].end_lsn

    monkeypatch.setattr(drain_module, "extract_once", extract)
    run(dag, conf)
    after = staged(conf)
    # Resumed from the last confirmed batch: one chain, no batch extracted twice.
    assert all(b.start_lsn == a.end_lsn for a, b in zip(after, after[1:], strict=False))
    assert len({b.start_lsn for b in after}) == len(after)
    assert after[-1].bounded_by is None
    assert slot_position(c, conf["slot_name"]) == after[-1].end_lsn
    result = compare_table(c, spark, conf["delta_root"], "public", TABLE)
    assert result.equal, result.describe()


def assert_lineage_per_batch(events: list[dict], drained: list[BatchManifest], conf: dict) -> None:
    """One OpenLineage COMPLETE event per batch the drain merged, in order: job ``<dag>.drain.batch``,
    a child of the drain task's run (the DAG run its root), the batch's table in with its changes,
    the Delta table out, the batch's LSN range; and the drain's own event sums them up."""
    merged = [b for b in drained if any(t.rows for t in b.tables)]
    assert len(merged) >= 3
    task = [e for e in events if e["eventType"] == "COMPLETE" and e["job"]["name"] == "pgdecode_incremental.drain"]
    per_batch = [e for e in events if e["job"]["name"] == "pgdecode_incremental.drain.batch"]
    ranges = [(e["run"]["facets"]["pgdecode"]["startLsn"], e["run"]["facets"]["pgdecode"]["endLsn"]) for e in per_batch]
    assert ranges == [(b.start_lsn, b.end_lsn) for b in merged]
    assert len({e["run"]["runId"] for e in per_batch}) == len(per_batch)
    delta = str(Path(conf["delta_root"]).resolve() / "public" / TABLE)
    for event, manifest in zip(per_batch, merged, strict=True):
        assert event["eventType"] == "COMPLETE"
        parent = event["run"]["facets"]["parent"]
        assert (parent["job"]["name"], parent["run"]["runId"]) == (
            "pgdecode_incremental.drain",
            task[-1]["run"]["runId"],
        )
        assert parent["root"]["job"]["name"] == "pgdecode_incremental"
        assert parent["root"]["run"]["runId"] == task[-1]["run"]["facets"]["parent"]["run"]["runId"]
        (source,) = event["inputs"]
        assert source["name"] == f"pgdecode_test.public.{TABLE}"
        assert source["inputFacets"]["inputStatistics"]["rowCount"] == manifest.tables[0].rows
        assert [(o["namespace"], o["name"]) for o in event["outputs"]] == [("file", delta)]
        assert event["run"]["facets"]["pgdecode"]["changes"] == manifest.changes
    summary = task[-1]["run"]["facets"]["pgdecode"]
    assert (summary["startLsn"], summary["endLsn"]) == (merged[0].start_lsn, merged[-1].end_lsn)
    assert (summary["batches"], summary["changes"]) == (len(merged), sum(b.changes for b in merged))
    assert [o["name"] for o in task[-1]["outputs"]] == [delta]
