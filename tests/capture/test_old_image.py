"""Under REPLICA IDENTITY FULL PostgreSQL logs an UPDATE's or DELETE's old row whole. For a table
with a key of its own (a primary key, a replica identity index) the merge reads only the key from
it, so only the key is staged: a value the pipeline cannot carry elsewhere in the old row (a BC
date, a year past 9999, an array of two dimensions) no longer makes the change a bad value. The
UPDATE that repairs a quarantined row lands, as docs/merge.md promises, and a DELETE of such a row
too (quarantined, it left the row in Delta for good). A table keyed by all its columns (merged as
a multiset) still stages the whole old row: it is its key. Found by tests/spark/test_type_gauntlet.py."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from tests.capture.test_bad_values import assert_same_quarantine
from tests.capture.test_native import assert_same_batches
from tests.conftest import two_plugin_source

pytestmark = pytest.mark.postgres

PUBLICATION = "oi_pub"
OPTIONS = {"public.oi_keyed": {"on_bad_value": "quarantine"}, "public.oi_multiset": {"on_bad_value": "quarantine"}}


@pytest.fixture()
def source(pg_conn: psycopg.Connection, slot_name: str):
    ddl = (
        "create table oi_keyed (id int primary key, day date, tags int[], note text);"
        " alter table oi_keyed replica identity full;"
        " create table oi_multiset (day date, note text); alter table oi_multiset replica identity full"
    )
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["oi_keyed", "oi_multiset"], ddl) as slot:
        yield slot


def rows(manifest, table: str, path: str = "path") -> list[dict]:
    if path == "quarantine":
        (entry,) = [e for e in manifest.quarantine if e["table"] == table]
        where, files = entry["path"], entry["files"]
    else:
        (summary,) = [t for t in manifest.tables if t.table == table]
        where, files = summary.path, summary.files
    return [row for name in files for row in pq.read_table(Path(manifest.path) / where / name).to_pylist()]


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_only_the_key_of_a_whole_old_row_is_staged(pg_conn, source, tmp_path, plugin) -> None:
    c = pg_conn
    slot = source if plugin == "test_decoding" else source + "_po"
    c.execute(
        "insert into oi_keyed values (1, '0044-03-15 BC', '{{1,2},{3,4}}', 'bad'), (2, '2024-01-02', '{2}', 'ok'),"
        " (3, '10000-01-01', '{3}', 'bad too')"
    )
    c.execute("update oi_keyed set day = '2020-06-06', tags = '{1}', note = 'repaired' where id = 1")
    c.execute("update oi_keyed set note = 'changed' where id = 2")
    c.execute("delete from oi_keyed where id = 3")
    c.execute("insert into oi_multiset values ('2024-01-01', 'a'), ('2024-01-01', 'a')")
    c.execute("delete from oi_multiset where ctid = (select min(ctid) from oi_multiset)")
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    manifests = [
        extract_batch(c, slot, tmp_path / str(native), plugin=plugin, native=native, table_options=OPTIONS, **extra)
        for native in ((False, True) if load_native() is not None else (False,))
    ]
    if len(manifests) == 2:
        assert_same_batches(*manifests)
        assert_same_quarantine(*manifests)
    manifest = manifests[0]

    # Only the INSERTs of bad values are quarantined; the repair and the DELETE are staged.
    quarantined = rows(manifest, "oi_keyed", "quarantine")
    assert [(r["_pg_op"], r["source_column"], r["value"]) for r in quarantined] == [
        ("I", "day", "0044-03-15 BC"),
        ("I", "day", "10000-01-01"),
    ]
    staged = rows(manifest, "oi_keyed")
    assert [(r["_pg_op"], r["id"], r["_pg_old"]) for r in staged] == [
        ("I", 2, None),
        ("U", 1, {"id": 1}),
        ("U", 2, {"id": 2}),
        ("D", None, {"id": 3}),
    ]
    assert staged[1]["note"] == "repaired" and staged[1]["tags"] == [1]

    # Keyed by all its columns: the whole old row is the key.
    multiset = rows(manifest, "oi_multiset")
    assert [(r["_pg_op"], r["_pg_old"]) for r in multiset][-1] == ("D", {"day": multiset[0]["day"], "note": "a"})
