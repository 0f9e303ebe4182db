"""The source side of a verify run: a copy as of LSN X that fits the extract's ceiling X exactly.

Real PostgreSQL; a writer commits in another thread while the temporary slot is created and the
copy runs, so a transaction on the wrong side of X shows up as a key in one set and not the other.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.verify import (
    VerifySnapshot,
    remove_verify_snapshot,
    stage_verify_snapshot,
    verify_area,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError

pytestmark = pytest.mark.postgres


class Writer(threading.Thread):
    """Inserts ids 1, 2, 3 ... one short transaction each, until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.written = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                self.written += 1
                conn.execute("insert into verify_src values (%s, %s)", (self.written, f"row {self.written}"))


def staged_ids(manifest: BatchManifest, table: str) -> list[int]:
    entry = next(t for t in manifest.tables if t.table == table)
    ids: list[int] = []
    for path in entry.file_paths:
        rows = pq.read_table(path).to_pylist()
        ids += [row["id"] for row in rows if row["_pg_op"] in ("I", "U")]
    return sorted(ids)


def test_the_copy_holds_exactly_what_the_extract_up_to_its_lsn_holds(pg_conn, pg_dsn, slot_name, tmp_path) -> None:
    c = pg_conn
    c.execute("drop table if exists verify_src; create table verify_src (id int primary key, note text)")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    writer = Writer(pg_dsn)
    writer.start()
    try:
        while writer.written < 200:  # the copy starts in the middle of the stream
            threading.Event().wait(0.01)
        snapshot = stage_verify_snapshot(pg_dsn, slot_name, tmp_path, ["public.verify_src"], workers=2)
    finally:
        writer.stop.set()
        writer.join()
    assert writer.written > 200

    copied = staged_ids(BatchManifest.read(snapshot.path), "verify_src")
    extracted = extract_batch(c, slot_name, tmp_path, upto_lsn=snapshot.lsn, tables=["public.verify_src"])
    # Inserts only, ids in commit order: both sides are the same prefix of the stream.
    assert copied == list(range(1, len(copied) + 1))
    assert staged_ids(BatchManifest.read(extracted.path), "verify_src") == copied
    assert len(copied) < writer.written  # and the writer went on past X
    assert extracted.end <= snapshot.lsn

    # The temporary slot went with its connection; the pipeline slot did not move.
    slots = [r[0] for r in c.execute("select slot_name from pg_replication_slots").fetchall()]
    assert not [s for s in slots if s.startswith("pgdecode_verify_")]
    # The copy lives in the verify area, which no merge or reconciliation lists as a batch.
    assert Path(snapshot.path).is_relative_to(Path(verify_area(tmp_path, slot_name).root))
    assert [Path(p).name for p in list_batches(tmp_path, slot_name)] == [Path(extracted.path).name]
    assert VerifySnapshot.from_dict(snapshot.to_dict()) == snapshot

    remove_verify_snapshot(snapshot)
    assert not Path(snapshot.path).exists()
    assert Path(extracted.path).is_dir()


def test_an_empty_table_is_listed_though_it_has_no_part(pg_conn, pg_dsn, slot_name, tmp_path) -> None:
    pg_conn.execute("drop table if exists verify_empty; create table verify_empty (id int primary key)")
    snapshot = stage_verify_snapshot(pg_dsn, slot_name, tmp_path, ["verify_empty"])
    assert snapshot.tables == ("public.verify_empty",)
    assert BatchManifest.read(snapshot.path).tables == []
    remove_verify_snapshot(snapshot)


def test_a_table_without_a_key_or_no_table_is_refused_and_leaves_nothing(pg_conn, pg_dsn, slot_name, tmp_path) -> None:
    pg_conn.execute("drop table if exists verify_nokey; create table verify_nokey (a int)")
    with pytest.raises(CatalogError, match="verify_nokey"):
        stage_verify_snapshot(pg_dsn, slot_name, tmp_path, ["public.verify_nokey"])
    assert list(Path(verify_area(tmp_path, slot_name).root).iterdir()) == []
    with pytest.raises(ConfigurationError, match="no table to verify"):
        stage_verify_snapshot(pg_dsn, slot_name, tmp_path, [])
    with pytest.raises(ConfigurationError, match="not a verify snapshot"):
        remove_verify_snapshot(VerifySnapshot(slot_name, Lsn(0), str(tmp_path / "x" / "y"), ()))
