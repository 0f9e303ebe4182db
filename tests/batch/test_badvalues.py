"""Bad values at staging: ``on_bad_value`` fail names the way forward, quarantine routes the change."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.format import QUARANTINE_SCHEMA
from airflow_provider_pgdecode.batch.options import TableOptions
from airflow_provider_pgdecode.batch.writer import BatchWriter
from airflow_provider_pgdecode.decoding.events import Change, Operation, RowImage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ValueConversionError
from tests.batch.test_writer import read, transaction

COLUMNS = ("id", "day", "tags", "note")
TYPES = ("integer", "date", "integer[]", "text")


def row(op: Operation, lsn: int, values: tuple, old: tuple | None = None) -> Change:
    new = None if op is Operation.DELETE else RowImage(COLUMNS, TYPES, values)
    old_image = None if old is None else RowImage(("id",), ("integer",), old)
    return Change(Lsn(lsn), 7, op, "public", "readings", old_image, new)


def good(i: int, lsn: int, note: str = "ok") -> Change:
    return row(Operation.INSERT, lsn, (str(i), "2024-01-02", "{1,2}", note))


def writer_for(tmp_path, **options) -> BatchWriter:
    return BatchWriter(tmp_path, table_options={("public", "readings"): TableOptions(**options)})


def test_fail_names_table_column_lsn_and_ways_forward(tmp_path) -> None:
    writer = writer_for(tmp_path)
    writer.add_transaction(transaction(100, [good(1, 11), row(Operation.INSERT, 12, ("2", "0044-03-15 BC", None, ""))]))
    with pytest.raises(ValueConversionError) as err:
        writer.close()
    message = str(err.value)
    assert "public.readings" in message and "'day'" in message and "(date)" in message
    assert "LSN 0/C" in message and "commit LSN 0/64" in message and "transaction 100" in message
    assert "BC" in message
    assert '"on_bad_value": "quarantine"' in message and "_pgdecode_quarantine" in message
    assert "resnapshot" in message


def test_fail_on_a_multi_dimensional_array_names_the_arrays_option(tmp_path) -> None:
    writer = writer_for(tmp_path)
    writer.add_transaction(transaction(100, [row(Operation.INSERT, 12, ("2", None, "{{1,2},{3,4}}", ""))]))
    with pytest.raises(ValueConversionError, match=r"'tags'.*\"arrays\": \"json\""):
        writer.close()


def test_quarantine_keeps_good_rows_and_later_changes_of_the_same_key(tmp_path) -> None:
    big = "x" * 5000
    writer = writer_for(tmp_path, on_bad_value="quarantine", max_value_bytes=4096)
    writer.add_transaction(
        transaction(
            100,
            [
                good(1, 11),
                row(Operation.INSERT, 12, ("2", "10000-01-01", "{3}", "future")),
                good(3, 13, big),
                good(4, 14),
            ],
        )
    )
    # The quarantined key 2 changes again later in the batch: that change still applies.
    writer.add_transaction(transaction(200, [row(Operation.UPDATE, 21, ("2", "2024-05-05", "{4}", "fixed"))]))
    (summary,), _ = writer.close()
    assert [r["id"] for r in read(tmp_path, summary)] == [1, 4, 2]
    assert (summary.rows, summary.inserts, summary.updates) == (3, 2, 1)

    (entry,) = writer.quarantine
    assert entry == {
        "schema": "public",
        "table": "readings",
        "path": "quarantine/public/readings",
        "files": ["part-00000.parquet"],
        "rows": 2,
    }
    part = pq.read_table(tmp_path / entry["path"] / "part-00000.parquet")
    assert part.schema == QUARANTINE_SCHEMA
    future, large = part.to_pylist()
    assert (future["source_column"], future["value"], future["_pg_change_lsn"]) == ("day", "10000-01-01", 12)
    assert (future["_pg_commit_lsn"], future["_pg_xid"], future["_pg_op"]) == (100, 100, "I")
    assert "after year 9999" in future["reason"]
    assert json.loads(future["row"])["note"] == "future" and future["old_row"] is None
    assert large["source_column"] == "note" and large["value_bytes"] == 5000 and large["value_truncated"]
    assert len(large["value"]) == 1024 and "max_value_bytes=4096" in large["reason"]


def test_a_bad_old_key_quarantines_the_delete_and_a_fully_quarantined_part_is_not_written(tmp_path) -> None:
    writer = BatchWriter(tmp_path, table_options={("public", "readings"): TableOptions(on_bad_value="quarantine")})
    delete = Change(
        Lsn(30), 7, Operation.DELETE, "public", "readings", RowImage(("day",), ("date",), ("0001-01-01 BC",)), None
    )
    writer.add_transaction(transaction(300, [delete]))
    tables, _ = writer.close()
    assert tables == []
    (entry,) = writer.quarantine
    (quarantined,) = pq.read_table(tmp_path / entry["path"] / entry["files"][0]).to_pylist()
    assert quarantined["source_column"] == "_pg_old.day" and quarantined["_pg_op"] == "D"
    assert json.loads(quarantined["old_row"]) == {"day": "0001-01-01 BC"} and quarantined["row"] is None


def test_json_arrays_stage_any_dimension(tmp_path) -> None:
    writer = writer_for(tmp_path, arrays="json")
    writer.add_transaction(
        transaction(100, [row(Operation.INSERT, 12, ("2", None, "{{1,2},{3,NULL}}", "")), good(3, 13)])
    )
    (summary,), _ = writer.close()
    assert [c.arrow for c in summary.columns if c.name == "tags"] == ["string"]
    assert [r["tags"] for r in read(tmp_path, summary)] == ["[[1,2],[3,null]]", "[1,2]"]


def keyed_writer(tmp_path, key: tuple[str, ...] | None, **options) -> BatchWriter:
    table_options = {("public", "readings"): TableOptions(**options)}
    keys = None if key is None else {("public", "readings"): key}
    return BatchWriter(tmp_path, table_options=table_options, keys=keys)


def test_an_infinite_key_is_a_bad_value_and_elsewhere_clamped(tmp_path) -> None:
    """``infinity`` in a key column (new tuple, old key, an array's element) is routed by
    ``on_bad_value``; in a column outside the key it is clamped, as documented (issue 35)."""
    writer = keyed_writer(tmp_path, ("id", "day", "tags"), on_bad_value="quarantine")
    tags = ("id", "day", "tags", "note")
    types = ("integer", "date", "date[]", "text")
    changes = [
        Change(
            Lsn(11),
            7,
            Operation.INSERT,
            "public",
            "readings",
            None,
            RowImage(tags, types, ("1", "infinity", "{2024-01-01}", "")),
        ),
        Change(
            Lsn(12),
            7,
            Operation.INSERT,
            "public",
            "readings",
            None,
            RowImage(tags, types, ("2", "9999-12-31", "{infinity}", "")),
        ),
        Change(
            Lsn(13),
            7,
            Operation.INSERT,
            "public",
            "readings",
            None,
            RowImage(tags, types, ("3", "9999-12-31", "{9999-12-31}", "")),
        ),
        Change(
            Lsn(14),
            7,
            Operation.DELETE,
            "public",
            "readings",
            RowImage(("id", "day"), ("integer", "date"), ("1", "-infinity")),
            None,
        ),
    ]
    writer.add_transaction(transaction(100, changes))
    (summary,), _ = writer.close()
    assert [(r["id"], str(r["day"])) for r in read(tmp_path, summary)] == [(3, "9999-12-31")]
    (entry,) = writer.quarantine
    rows = pq.read_table(tmp_path / entry["path"] / entry["files"][0]).to_pylist()
    assert [(r["source_column"], r["value"]) for r in rows] == [
        ("day", "infinity"),
        ("tags", "{infinity}"),
        ("_pg_old.day", "-infinity"),
    ]
    assert "the key 9999-12-31" in rows[0]["reason"] and "holds infinity or -infinity" in rows[1]["reason"]
    assert "the key 0001-01-01" in rows[2]["reason"]

    # Not a key column: clamped. A table loaded append_only is never matched: clamped in its key too.
    for key, options in ((("id",), {}), (("id", "day"), {"mode": "append_only"})):
        directory = tmp_path / str(len(key))
        writer = keyed_writer(directory, key, **options)
        writer.add_transaction(transaction(100, [row(Operation.INSERT, 11, ("1", "infinity", None, ""))]))
        (summary,), _ = writer.close()
        assert [str(r["day"]) for r in read(directory, summary)] == ["9999-12-31"]
        assert not writer.quarantine and not writer.clamped_values()


def test_fail_on_an_infinite_timestamptz_key_names_the_type_map_and_an_unknown_key_is_recorded(tmp_path) -> None:
    names, types = ("at", "note"), ("timestamp with time zone", "text")
    change = Change(
        Lsn(11), 7, Operation.INSERT, "public", "readings", None, RowImage(names, types, ("-infinity", "x"))
    )
    writer = keyed_writer(tmp_path / "known", ("at",))
    writer.add_transaction(transaction(100, [change]))
    with pytest.raises(ValueConversionError) as err:
        writer.close()
    message = str(err.value)
    assert "column 'at' (timestamp with time zone) of the change at LSN 0/B" in message
    assert "'-infinity' in a key column" in message and "the key 0001-01-01 00:00:00" in message
    assert '{"public.readings": {"type_map": {"timestamptz": "string"}}}' in message

    writer = keyed_writer(tmp_path / "unknown", None)
    writer.add_transaction(transaction(100, [change]))
    writer.close()
    (clamped,) = writer.clamped_values()[("public", "readings")].values()
    assert (clamped.column, clamped.value, clamped.change_lsn, clamped.commit_lsn) == ("at", "-infinity", 11, 100)
