"""The extract, reconciliation and retention with the staging root on a real S3-compatible server.

The batch on object storage is committed by its manifest alone (no rename): these tests check
that readers see only batches with a manifest, that the next extract replaces a cut-short upload,
that pending prepared transactions are carried through the store, and that the same range gives
the same objects as on a local disk.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.batch.retention import prune_batches
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import BatchError
from tests.capture.test_extract import advance, create_slot

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


@pytest.fixture
def staging(s3_server, s3_bucket) -> Storage:
    return Storage(f"{s3_bucket}/staging", s3_server.settings)


def rows_of(staging: Storage, manifest: BatchManifest, table: str) -> list[dict[str, Any]]:
    summary = next(t for t in manifest.tables if t.table == table)
    batch = staging.at(manifest.path)
    parts = [pq.read_table(batch.open_input(f"{summary.path}/{name}")) for name in summary.files]
    return pa.concat_tables(parts).to_pylist()


def digest(store: Storage) -> dict[str, str]:
    return {name: hashlib.sha256(store.read_bytes(name)).hexdigest() for name in store.walk_files()}


def test_prepared_transactions_are_carried_through_the_store(pg_conn, slot_name, staging) -> None:
    pg_conn.execute("create table s3_ledger (id int primary key, amount numeric(10,2))")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("begin; insert into s3_ledger values (1, 10.50); prepare transaction 's3pay'")
    pg_conn.execute("insert into s3_ledger values (2, 1)")

    first = extract_batch(pg_conn, slot_name, staging)
    assert first.path is not None and first.path.startswith(staging.root + "/")
    assert [r["id"] for r in rows_of(staging, first, "s3_ledger")] == [2]
    assert [p["gid"] for p in first.prepared_pending] == ["s3pay"]
    checkpoint = Checkpoint.from_manifest(first)
    assert checkpoint.prepared_pending[0]["path"].startswith("s3://")
    advance(pg_conn, slot_name, first)

    pg_conn.execute("commit prepared 's3pay'")
    second = extract_batch(pg_conn, slot_name, staging, checkpoint=checkpoint)
    assert [(r["id"], r["amount"]) for r in rows_of(staging, second, "s3_ledger")] == [(1, "10.50")]
    assert [p["gid"] for p in second.prepared_committed] == ["s3pay"]
    assert list_batches(staging, slot_name) == [first.path, second.path]
    assert BatchManifest.read(staging.at(second.path)) == second


def test_same_range_gives_the_same_objects_as_on_a_local_disk(pg_conn, slot_name, staging, tmp_path) -> None:
    pg_conn.execute("create table s3_same (id int primary key, v text)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into s3_same select g, md5(g::text) from generate_series(1, 300) g")
    pg_conn.execute("begin; update s3_same set v = 'p' where id < 5; prepare transaction 's3same'")
    try:
        local = extract_batch(pg_conn, slot_name, tmp_path)
        remote = extract_batch(pg_conn, slot_name, staging, upto_lsn=Lsn.parse(local.ceiling_lsn))
    finally:
        pg_conn.execute("rollback prepared 's3same'")
    assert remote.name == local.name
    assert digest(staging.at(remote.path)) == digest(Storage(local.path))
    assert len(digest(Storage(local.path))) == 3  # manifest, one part, one pending prepared transaction


def test_a_cut_short_upload_is_invisible_and_the_next_extract_replaces_it(pg_conn, slot_name, staging) -> None:
    pg_conn.execute("create table s3_cut (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into s3_cut select generate_series(1, 50)")
    first = extract_batch(pg_conn, slot_name, staging)
    batch = staging.at(first.path)
    # An upload that stopped before its manifest, with an object this extract would not write.
    batch.delete_file("manifest.json")
    batch.write_bytes("tables/public/s3_cut/part-00009.parquet", b"left over")
    assert list_batches(staging, slot_name) == []
    with pytest.raises(BatchError, match="manifest.json is missing"):
        BatchManifest.read(batch)

    again = extract_batch(pg_conn, slot_name, staging, upto_lsn=Lsn.parse(first.ceiling_lsn))
    assert again.path == first.path
    assert list_batches(staging, slot_name) == [first.path]
    assert "tables/public/s3_cut/part-00009.parquet" not in batch.walk_files()
    assert sorted(r["id"] for r in rows_of(staging, again, "s3_cut")) == list(range(1, 51))


def test_reconciliation_adopts_batches_staged_on_the_store(pg_conn, slot_name, staging) -> None:
    pg_conn.execute("create table s3_chain (id int primary key)")
    create_slot(pg_conn, slot_name)
    pg_conn.execute("insert into s3_chain values (1)")
    first = extract_batch(pg_conn, slot_name, staging)
    pg_conn.execute("insert into s3_chain values (2)")
    second = extract_batch(pg_conn, slot_name, staging, checkpoint=Checkpoint.from_manifest(first))
    advance(pg_conn, slot_name, second)  # the confirm ran, its checkpoint was lost
    pg_conn.execute("insert into s3_chain values (3)")
    third = extract_batch(pg_conn, slot_name, staging, checkpoint=Checkpoint.from_manifest(first))
    assert third.start_lsn == second.end_lsn
    assert [r["id"] for r in rows_of(staging, third, "s3_chain")] == [3]


def test_retention_on_the_store_keeps_what_is_needed(pg_conn, slot_name, staging) -> None:
    pg_conn.execute("create table s3_keep (id int primary key)")
    create_slot(pg_conn, slot_name)
    batches = []
    checkpoint = None
    for i in range(3):
        pg_conn.execute("insert into s3_keep values (%s)", (i,))
        if i == 1:
            pg_conn.execute("begin; insert into s3_keep values (100); prepare transaction 's3keep'")
        manifest = extract_batch(pg_conn, slot_name, staging, checkpoint=checkpoint)
        advance(pg_conn, slot_name, manifest)
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(manifest)
    pg_conn.execute("rollback prepared 's3keep'")
    # A prefix left by an upload cut short long ago: no manifest.
    staging.write_bytes(f"{slot_name}/00000000FFFFFFF0-00000000FFFFFFFF/tables/x/part-00000.parquet", b"x")
    later = time.time() + 30 * 86400

    assert checkpoint is not None
    dry = prune_batches(staging, checkpoint, keep_days=7, keep_batches=1, now=later, dry_run=True)
    removed = prune_batches(staging, checkpoint, keep_days=7, keep_batches=1, now=later)
    assert removed == dry
    # The checkpoint's batch stays (it also holds the pending prepared transaction's items).
    assert batches[0].path in removed and batches[1].path in removed and batches[2].path not in removed
    assert checkpoint.prepared_pending[0]["path"].startswith(batches[2].path + "/")
    assert staging.uri(slot_name, "00000000FFFFFFF0-00000000FFFFFFFF") in removed
    assert list_batches(staging, slot_name) == [batches[2].path]
    assert not staging.exists(f"{slot_name}/00000000FFFFFFF0-00000000FFFFFFFF/tables/x/part-00000.parquet")
    # Nothing is removed when younger than keep_days.
    assert prune_batches(staging, checkpoint, keep_days=7, keep_batches=0) == []
