"""The batch manifest: write/read, what read refuses, listing batches, directory names, contents()."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from posixpath import normpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_pgdecode.batch.manifest import (
    FORMAT,
    MANIFEST_NAME,
    BatchManifest,
    ColumnSummary,
    TableSummary,
    batch_dir_name,
    list_batches,
    table_path,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import StagingError

SLOT = "pgdecode_orders"


def table_summary(
    schema: str = "public", table: str = "orders", files: tuple[str, ...] = ("part-00000.parquet",)
) -> TableSummary:
    return TableSummary(
        schema=schema,
        table=table,
        path=table_path(schema, table),
        files=list(files),
        rows=5,
        inserts=3,
        updates=1,
        deletes=1,
        truncates=0,
        min_commit_lsn="0/110",
        max_commit_lsn="0/1F0",
        columns=[
            ColumnSummary("id", "integer", "int32", "integer"),
            ColumnSummary("mood", "mood", "string", "mood", "enum"),
        ],
        key=["id"],
        replica_identity="default",
    )


def manifest(start: int = 0x100, end: int = 0x200, **changes: object) -> BatchManifest:
    base = BatchManifest(
        slot=SLOT,
        plugin="test_decoding",
        database="shop",
        start_lsn=str(Lsn(start)),
        end_lsn=str(Lsn(end)),
        ceiling_lsn=str(Lsn(end + 0x10)),
        transactions=2,
        changes=5,
        tables=[table_summary()],
        messages={"path": "messages", "files": ["part-00000.parquet"], "rows": 1},
        prepared_pending=[
            {
                "gid": "tx-42",
                "xid": 903,
                "begin_lsn": "0/150",
                "prepare_lsn": "0/160",
                "prepare_time": None,
                "items": 3,
                "path": "prepared/903-x.jsonl.gz",
            }
        ],
        prepared_committed=[{"gid": "tx-41", "xid": 900, "commit_lsn": "0/170"}],
        prepared_rolled_back=[{"gid": "tx-40", "xid": 899, "lsn": "0/180"}],
        skipped={"rows_before_checkpoint": 4},
    )
    return replace(base, **changes)


def stage(root: Path, m: BatchManifest) -> Path:
    """Write every file ``m`` lists (placeholders) and the manifest, as a complete batch."""
    directory = root / m.slot / m.name
    directory.mkdir(parents=True)
    for t in m.tables:
        (directory / t.path).mkdir(parents=True, exist_ok=True)
        for name in t.files:
            (directory / t.path / name).write_bytes(b"PAR1")
    if m.messages:
        (directory / m.messages["path"]).mkdir(parents=True, exist_ok=True)
        for name in m.messages["files"]:
            (directory / m.messages["path"] / name).write_bytes(b"PAR1")
    for p in m.prepared_pending:
        (directory / p["path"]).parent.mkdir(parents=True, exist_ok=True)
        (directory / p["path"]).write_bytes(b"")
    m.write(directory)
    return directory


def rewrite(directory: Path, change) -> None:
    """Edit the manifest file's JSON in place."""
    target = directory / MANIFEST_NAME
    data = json.loads(target.read_text())
    change(data)
    target.write_text(json.dumps(data))


# --- write / read -----------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path: Path) -> None:
    original = manifest()
    directory = stage(tmp_path, original)
    back = BatchManifest.read(directory)
    assert back == original
    assert back.path == str(directory)
    assert back.tables[0].columns[1].user_type == "enum"
    assert isinstance(back.tables[0], TableSummary) and isinstance(back.tables[0].columns[0], ColumnSummary)
    assert back.name == directory.name == "0000000000000100-0000000000000200"


def test_the_file_is_sorted_json_without_the_path(tmp_path: Path) -> None:
    directory = stage(tmp_path, manifest())
    text = (directory / MANIFEST_NAME).read_text(encoding="utf-8")
    data = json.loads(text)
    assert "path" not in data  # where a batch lives is not part of it
    assert list(data) == sorted(data)
    assert data["format"] == FORMAT and data["complete"] is True
    # Same manifest, same bytes (reproducible batches).
    other = tmp_path / "again"
    other.mkdir()
    manifest().write(other)
    assert (other / MANIFEST_NAME).read_text(encoding="utf-8") == text


def test_round_trip_keeps_non_ascii_names(tmp_path: Path) -> None:
    original = manifest(tables=[table_summary("Verkäufe", "Bestellungen 2024/Q1")], messages=None, prepared_pending=[])
    directory = stage(tmp_path, original)
    back = BatchManifest.read(directory)
    assert back.tables[0].schema == "Verkäufe" and back.tables[0].table == "Bestellungen 2024/Q1"
    assert (directory / "tables" / "Verk%C3%A4ufe" / "Bestellungen%202024%2FQ1" / "part-00000.parquet").is_file()


def test_read_refuses_a_directory_without_manifest(tmp_path: Path) -> None:
    directory = tmp_path / SLOT / batch_dir_name(Lsn(1), Lsn(2))
    directory.mkdir(parents=True)
    with pytest.raises(StagingError) as info:
        BatchManifest.read(directory)
    assert str(directory) in str(info.value)
    assert "manifest.json is missing" in str(info.value)
    assert "extract the range again" in str(info.value)


@pytest.mark.parametrize("bad", ["pgdecode.batch/2", None, 1])
def test_read_refuses_another_format(tmp_path: Path, bad: object) -> None:
    directory = stage(tmp_path, manifest())
    rewrite(directory, lambda d: d.__setitem__("format", bad))
    with pytest.raises(StagingError) as info:
        BatchManifest.read(directory)
    assert str(directory) in str(info.value)
    assert f"unknown batch format {bad!r}" in str(info.value) and FORMAT in str(info.value)


@pytest.mark.parametrize("flag", [False, None, "true", 1])
def test_read_refuses_a_batch_not_marked_complete(tmp_path: Path, flag: object) -> None:
    directory = stage(tmp_path, manifest())
    rewrite(directory, lambda d: d.__setitem__("complete", flag))
    with pytest.raises(StagingError, match="marked incomplete") as info:
        BatchManifest.read(directory)
    assert str(directory) in str(info.value)


def test_read_refuses_a_manifest_without_complete_flag(tmp_path: Path) -> None:
    directory = stage(tmp_path, manifest())
    rewrite(directory, lambda d: d.pop("complete"))
    with pytest.raises(StagingError, match="marked incomplete"):
        BatchManifest.read(directory)


@pytest.mark.parametrize("text", ["{", "", '{"format": "pgdecode.batch/1",}', "\ufeff{}", "nul\x00"])
def test_read_refuses_malformed_json(tmp_path: Path, text: str) -> None:
    directory = stage(tmp_path, manifest())
    (directory / MANIFEST_NAME).write_text(text, encoding="utf-8")
    with pytest.raises(StagingError, match="unreadable manifest") as info:
        BatchManifest.read(directory)
    assert str(directory) in str(info.value)


def test_read_refuses_undecodable_bytes(tmp_path: Path) -> None:
    directory = stage(tmp_path, manifest())
    (directory / MANIFEST_NAME).write_bytes(b"\xff\xfe{}")
    with pytest.raises(StagingError, match="unreadable manifest"):
        BatchManifest.read(directory)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("slot"),
        lambda d: d.pop("tables"),
        lambda d: d.__setitem__("tables", None),
        lambda d: d.__setitem__("surprise", 1),
        lambda d: d["tables"][0].pop("columns"),
        lambda d: d["tables"][0].__setitem__("colour", "red"),
        lambda d: d["tables"][0]["columns"][0].pop("arrow"),
    ],
    ids=[
        "no-slot",
        "no-tables",
        "null-tables",
        "unknown-field",
        "table-without-columns",
        "unknown-table-field",
        "column-without-arrow",
    ],
)
def test_read_refuses_a_malformed_manifest(tmp_path: Path, change) -> None:
    directory = stage(tmp_path, manifest())
    rewrite(directory, change)
    with pytest.raises(StagingError, match="malformed manifest") as info:
        BatchManifest.read(directory)
    assert str(directory) in str(info.value)


@pytest.mark.parametrize("text", ["[]", '"pgdecode.batch/1"', "null"])
def test_read_refuses_json_that_is_not_an_object(tmp_path: Path, text: str) -> None:
    directory = stage(tmp_path, manifest())
    (directory / MANIFEST_NAME).write_text(text, encoding="utf-8")
    with pytest.raises(StagingError, match=str(directory)):
        BatchManifest.read(directory)


def test_read_refuses_a_table_entry_that_is_not_an_object(tmp_path: Path) -> None:
    directory = stage(tmp_path, manifest())
    rewrite(directory, lambda d: d.__setitem__("tables", ["orders"]))
    with pytest.raises(StagingError, match="malformed manifest"):
        BatchManifest.read(directory)


@pytest.mark.parametrize(
    "remove, shown",
    [
        ("tables/public/orders/part-00000.parquet", "tables/public/orders/part-00000.parquet"),
        ("messages/part-00000.parquet", "messages/part-00000.parquet"),
        ("prepared/903-x.jsonl.gz", "prepared/903-x.jsonl.gz"),
    ],
)
def test_read_refuses_a_batch_missing_a_listed_file(tmp_path: Path, remove: str, shown: str) -> None:
    directory = stage(tmp_path, manifest())
    (directory / remove).unlink()
    with pytest.raises(StagingError) as info:
        BatchManifest.read(directory)
    message = str(info.value)
    assert f"batch {directory} is incomplete" in message
    assert shown in message


def test_read_lists_every_missing_file_kind_at_once(tmp_path: Path) -> None:
    m = manifest(tables=[table_summary(files=("part-00000.parquet", "part-00001.parquet"))])
    directory = stage(tmp_path, m)
    (directory / "tables/public/orders/part-00001.parquet").unlink()
    (directory / "prepared/903-x.jsonl.gz").unlink()
    with pytest.raises(StagingError) as info:
        BatchManifest.read(directory)
    assert "part-00001.parquet" in str(info.value) and "903-x.jsonl.gz" in str(info.value)
    assert "part-00000.parquet" not in str(info.value)


# --- contents / summary -----------------------------------------------------------------------


def test_contents_ignores_ceiling_and_read_statistics() -> None:
    one = manifest(ceiling_lsn="0/300", skipped={"rows_before_checkpoint": 4})
    two = manifest(ceiling_lsn="5/0", skipped={})
    assert one != two
    assert one.contents() == two.contents()
    assert "ceiling_lsn" not in one.contents() and "skipped" not in one.contents() and "path" not in one.contents()
    # Anything the batch holds does count.
    assert manifest(end_lsn="0/201").contents() != one.contents()
    assert manifest(changes=6).contents() != one.contents()
    assert manifest(prepared_pending=[]).contents() != one.contents()
    assert manifest(tables=[replace(table_summary(), rows=6)]).contents() != one.contents()


def test_contents_ignores_where_the_batch_was_read_from(tmp_path: Path) -> None:
    a = BatchManifest.read(stage(tmp_path / "a", manifest()))
    b = BatchManifest.read(stage(tmp_path / "b", manifest(ceiling_lsn="9/0")))
    assert a.path != b.path
    assert a.contents() == b.contents()


def test_summary_is_json_and_short(tmp_path: Path) -> None:
    m = BatchManifest.read(stage(tmp_path, manifest()))
    summary = m.summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["path"] == str(m.path)
    assert summary["tables"] == {"public.orders": 5}
    assert summary["prepared_pending"] == [{"gid": "tx-42", "xid": 903}]
    assert (summary["start_lsn"], summary["end_lsn"]) == ("0/100", "0/200")


# --- list_batches -----------------------------------------------------------------------------


def test_list_batches_in_lsn_order_ignoring_other_entries(tmp_path: Path) -> None:
    ranges = [(0xFFFFFFFF, 1 << 32), (0x100, 0x200), (1 << 32, (1 << 32) + 0x10), (0x200, 0x200), (0x200, 0xFFFFFFFF)]
    for start, end in ranges:
        stage(tmp_path, manifest(start, end))
    base = tmp_path / SLOT
    (base / f".tmp-{batch_dir_name(Lsn(0x300), Lsn(0x400))}").mkdir()  # a batch being written
    (base / ".tmp-abc123").mkdir()
    (base / "0000000000000100-00000000000002").mkdir()  # too short
    (base / "0000000000000a00-0000000000000b00").mkdir()  # lower case: not ours
    (base / "0000000000000100_0000000000000200").mkdir()
    (base / "notes").mkdir()
    (base / batch_dir_name(Lsn(0x900), Lsn(0xA00))).write_text("a file, not a directory")
    stage(tmp_path, manifest(0x50, 0x60, slot="another_slot"))

    listed = list_batches(tmp_path, SLOT)
    expected = sorted(ranges)
    assert [Path(p).name for p in listed] == [batch_dir_name(Lsn(s), Lsn(e)) for s, e in expected]
    assert all(Path(p).parent == base for p in listed)
    assert [BatchManifest.read(p).end_lsn for p in listed] == [str(Lsn(e)) for _, e in expected]


def test_list_batches_of_an_unknown_slot_is_empty(tmp_path: Path) -> None:
    assert list_batches(tmp_path, "nobody") == []
    assert list_batches(tmp_path / "missing-root", SLOT) == []


# --- names ------------------------------------------------------------------------------------

_lsns = st.integers(0, Lsn.MAX)


@given(a=st.tuples(_lsns, _lsns), b=st.tuples(_lsns, _lsns))
def test_batch_dir_names_sort_in_lsn_order(a: tuple[int, int], b: tuple[int, int]) -> None:
    name_a = batch_dir_name(Lsn(a[0]), Lsn(a[1]))
    name_b = batch_dir_name(Lsn(b[0]), Lsn(b[1]))
    assert (name_a < name_b) == (a < b)
    assert (name_a == name_b) == (a == b)


@given(start=_lsns, end=_lsns)
def test_batch_dir_name_reads_back_and_is_what_list_batches_accepts(start: int, end: int) -> None:
    name = batch_dir_name(Lsn(start), Lsn(end))
    high, low = name.split("-")
    assert (int(high, 16), int(low, 16)) == (start, end)
    assert len(name) == 33 and name == name.upper()
    m = manifest()
    m.start_lsn, m.end_lsn = str(Lsn(start)), str(Lsn(end))
    assert m.name == name


def test_listing_accepts_every_name_batch_dir_name_makes(tmp_path: Path) -> None:
    for start, end in [(0, 0), (0, Lsn.MAX), (Lsn.MAX, Lsn.MAX), (0xABCDEF, 0xABCDEF0)]:
        (tmp_path / SLOT / batch_dir_name(Lsn(start), Lsn(end))).mkdir(parents=True)
    assert len(list_batches(tmp_path, SLOT)) == 4


def test_table_path_percent_encodes_names() -> None:
    assert table_path("public", "orders") == "tables/public/orders"
    assert table_path("Odd Schema", "a/b") == "tables/Odd%20Schema/a%2Fb"
    assert table_path("s", "100%") == "tables/s/100%25"
    assert table_path("s", "x\\y") == "tables/s/x%5Cy"


@pytest.mark.parametrize("schema, table", [("..", "messages"), ("public", ".."), ("public", ".")])
def test_table_path_stays_inside_its_own_directory(schema: str, table: str) -> None:
    path = table_path(schema, table)
    parts = normpath(path).split("/")
    assert parts[0] == "tables" and len(parts) == 3


def test_oids_and_delta_tables_round_trip_and_older_manifests_stay_readable(tmp_path: Path) -> None:
    renamed = replace(table_summary("public", "orders_v2"), oid=16385, delta_table=["public", "orders"])
    record = {"16385": {"names": [["public", "orders"], ["public", "orders_v2"]], "delta_table": ["public", "orders"]}}
    original = manifest(tables=[table_summary(), renamed], table_oids=record)
    back = BatchManifest.read(stage(tmp_path / "new", original))
    assert back == original
    assert [t.target for t in back.tables] == [("public", "orders"), ("public", "orders")]
    assert back.tables[1].oid == 16385 and back.table_oids == record

    # A batch staged before OIDs were recorded: no oid, no delta_table, no table_oids.
    directory = stage(tmp_path / "old", manifest())

    def strip(data: dict) -> None:
        data.pop("table_oids")
        for table in data["tables"]:
            table.pop("oid")
            table.pop("delta_table")

    rewrite(directory, strip)
    old = BatchManifest.read(directory)
    assert old.tables[0].oid is None and old.tables[0].target == ("public", "orders") and old.table_oids == {}
