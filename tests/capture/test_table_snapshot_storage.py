"""Table snapshot requests, their confirmed states, and the verify area on a local directory and on
a real S3-compatible server: every file goes through the storage layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.storage import SPOOL_ENV, Storage, spool_dir
from airflow_provider_pgdecode.capture.snapshot import snapshot_workdir
from airflow_provider_pgdecode.capture.table_snapshot import (
    list_snapshot_requests,
    pending_snapshot_requests,
    read_snapshot_state,
    request_table_snapshot,
    requests_dir,
    write_snapshot_states,
)
from airflow_provider_pgdecode.capture.verify import VerifySnapshot, remove_verify_snapshot, verify_area
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError, StagingError

pytestmark = pytest.mark.s3

SLOT = "pgdecode_shop"


@pytest.fixture(params=["local", "s3"])
def staging(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "staging")
    bucket = request.getfixturevalue("s3_bucket")
    return Storage(f"{bucket}/staging", request.getfixturevalue("s3_server").settings)


def test_requests_are_filed_listed_and_refiled_once(staging: Storage) -> None:
    first = request_table_snapshot(staging, SLOT, ["public.orders"], "add-table", request_id="add-orders")
    assert staging.is_file(f"{SLOT}/snapshot-requests/add-orders.json")
    filed = json.loads(requests_dir(staging, SLOT).read_text("add-orders.json"))
    assert (filed["mode"], filed["tables"]) == ("add-table", [["public", "orders"]])
    # the same id again: the request already filed, not a second one
    again = request_table_snapshot(staging, SLOT, ["public.orders"], "add-table", request_id="add-orders")
    assert again == first
    with pytest.raises(StagingError, match="already exists with other settings"):
        request_table_snapshot(staging, SLOT, ["public.refunds"], "add-table", request_id="add-orders")
    request_table_snapshot(staging, SLOT, ["public.items"], "resnapshot", request_id="redo-items")
    assert [r.id for r in list_snapshot_requests(staging, SLOT)] == ["add-orders", "redo-items"]
    assert pending_snapshot_requests(staging, SLOT) == ["add-orders", "redo-items"]
    # no temporary file is left beside the requests
    assert sorted(n for n, _ in staging.list_dir(f"{SLOT}/snapshot-requests")) == ["add-orders.json", "redo-items.json"]


def test_confirmed_states_are_written_and_read_back(staging: Storage) -> None:
    assert read_snapshot_state(staging, SLOT, "add-orders") is None
    write_snapshot_states(staging, SLOT, {"add-orders": {"done": False}})  # nothing filed: nothing written
    assert not staging.exists(f"{SLOT}/snapshot-requests")
    request_table_snapshot(staging, SLOT, ["public.orders"], "add-table", request_id="add-orders")
    progress = {"done": False, "tables": {"public.orders": {"chunks": 2, "rows": 10, "done": False}}}
    write_snapshot_states(staging, SLOT, {"add-orders": progress})
    assert read_snapshot_state(staging, SLOT, "add-orders") == progress
    assert pending_snapshot_requests(staging, SLOT) == ["add-orders"]
    write_snapshot_states(staging, SLOT, {"add-orders": {**progress, "done": True}})
    assert pending_snapshot_requests(staging, SLOT) == []
    # state files are not requests
    assert [r.id for r in list_snapshot_requests(staging, SLOT)] == ["add-orders"]


def test_an_unreadable_request_names_the_file(staging: Storage) -> None:
    staging.write_text(f"{SLOT}/snapshot-requests/broken.json", "{not json")
    with pytest.raises(StagingError, match=r"unreadable snapshot request file .*broken\.json.*Remove it"):
        list_snapshot_requests(staging, SLOT)


def test_a_string_s3_location_takes_its_settings_from_the_environment(
    s3_server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.settings.to_env().items():
        monkeypatch.setenv(name, value)
    request_table_snapshot(f"{s3_bucket}/staging", SLOT, ["public.orders"], request_id="from-env")
    assert [r.id for r in list_snapshot_requests(f"{s3_bucket}/staging", SLOT)] == ["from-env"]


def test_the_verify_area_and_removing_a_verify_copy(staging: Storage) -> None:
    area = verify_area(staging, SLOT)
    assert area.root == staging.uri(SLOT, "verify")
    batch = area.uri("pgdecode_verify_0123456789abcdef", "0000000000000000-0000000001000000")
    area.write_text("pgdecode_verify_0123456789abcdef/0000000000000000-0000000001000000/manifest.json", "{}")
    area.write_text("report-1.json", "{}")
    snapshot = VerifySnapshot(SLOT, Lsn.parse("0/1000000"), batch, ("public.orders",))
    remove_verify_snapshot(snapshot, staging)
    assert not area.exists("pgdecode_verify_0123456789abcdef")
    assert area.is_file("report-1.json")  # the rest of the area stays
    remove_verify_snapshot(snapshot, staging)  # already gone: no error
    outside = VerifySnapshot(SLOT, Lsn.parse("0/1000000"), staging.uri(SLOT, "0000000000000000-0000000001000000"), ())
    with pytest.raises(ConfigurationError, match="is not a verify snapshot: refusing to delete it"):
        remove_verify_snapshot(outside, staging)


def test_snapshot_work_directories(staging: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    workdir = snapshot_workdir(staging, SLOT, "00000003-00000002-1")
    assert workdir.name == ".tmp-snapshot-00000003-00000002-1"
    if staging.is_local:  # beside the batch: publishing is a rename
        assert workdir.parent == Path(staging.uri(SLOT))
    else:  # spooled locally, the same folder for a resumed copy, one per staging location
        assert workdir.is_relative_to(spool_dir())
        assert snapshot_workdir(staging, SLOT, "00000003-00000002-1") == workdir
        assert snapshot_workdir(staging.child("other"), SLOT, "00000003-00000002-1") != workdir


def test_a_verify_copy_on_s3(pg_dsn: str, pg_conn, slot_name: str, s3_server, s3_bucket: str) -> None:
    from airflow_provider_pgdecode.batch.manifest import BatchManifest
    from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot

    pg_conn.execute("DROP TABLE IF EXISTS s3_verify_src")
    pg_conn.execute("CREATE TABLE s3_verify_src (id int PRIMARY KEY, v text)")
    pg_conn.execute("INSERT INTO s3_verify_src SELECT g, 'v' || g FROM generate_series(1, 25) g")
    staging = Storage(f"{s3_bucket}/staging", s3_server.settings)
    snapshot = stage_verify_snapshot(pg_dsn, slot_name, staging, ["public.s3_verify_src"], chunk_rows=10)
    assert snapshot.path.startswith(verify_area(staging, slot_name).root + "/pgdecode_verify_")
    manifest = BatchManifest.read(staging.at(snapshot.path))
    assert [(t.table, t.inserts) for t in manifest.tables] == [("s3_verify_src", 25)]
    remove_verify_snapshot(snapshot, staging)
    assert verify_area(staging, slot_name).list_dir() == []
