"""A ``"char"`` above 127 (``'ü'::"char"`` stores the byte 0xC3): PostgreSQL 15+ prints ``\\303``,
PostgreSQL 14 the byte itself, which is not UTF-8. Every path stages what 15+ prints, on every
major: both plugins, both writers, the initial snapshot. On 14 the Python parsers refused the row
as malformed and the native writer staged the raw byte as a Parquet string (not UTF-8) or failed
with a bare UnicodeDecodeError. Found by tests/spark/test_type_gauntlet.py."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import InvalidText, char_text
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import DecodingError
from tests.capture.test_native import assert_same_batches

PUBLICATION = "rc_pub"
STAGED = [(1, "\\303", ["\\303", "a", None, '"', ""]), (2, "", None), (3, None, [])]
"""What PostgreSQL 15+ prints for the rows of :func:`test_every_path_stages_what_postgres_15_prints`."""


def test_raw_bytes_read_as_postgres_15_prints_them() -> None:
    assert char_text(b"\xc3", '"char"') == "\\303"
    assert char_text(b"{\xc3,a,NULL,\xff}", '"char"[]') == '{"\\\\303",a,NULL,"\\\\377"}'
    assert char_text(b"\\303", '"char"') == "\\303"  # 15+: already text
    with pytest.raises(InvalidText, match=r"column 'c' \(text\) is not valid utf-8"):
        char_text(b"\xc3", "text", column="c")


def test_test_decoding_line_of_postgres_14() -> None:
    line = b"table public.t: INSERT: id[integer]:1 c[\"char\"]:'\xc3' ca[\"char\"[]]:'{\xc3,a}' t[text]:'\xc3\xbc'"
    change = TestDecodingParser().parse(Lsn(1), 5, line)
    assert change.new.values == ("1", "\\303", '{"\\\\303",a}', "ü")
    with pytest.raises(DecodingError, match=r"cannot read test_decoding row: the value of column 't' \(text\)"):
        TestDecodingParser().parse(Lsn(1), 5, b"table public.t: INSERT: id[integer]:1 t[text]:'\xc3'")


@pytest.fixture()
def source(pg_conn: psycopg.Connection, slot_name: str):
    # Slots without two-phase decoding: pgoutput has it from 15 on, and this runs on 14 too.
    c = pg_conn
    c.execute(f"drop table if exists rc_chars; drop publication if exists {PUBLICATION}")
    c.execute('create table rc_chars (id int primary key, c "char", ca "char"[])')
    c.execute(f"create publication {PUBLICATION} for table rc_chars")
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot_name + "_po",))
    yield slot_name  # the slot_name fixture drops the slots named after it
    c.execute(f"drop publication if exists {PUBLICATION}")


def staged_rows(manifest) -> list[tuple]:
    (summary,) = manifest.tables
    rows = [
        row for name in summary.files for row in pq.read_table(Path(manifest.path) / summary.path / name).to_pylist()
    ]
    return sorted((r["id"], r["c"], r["ca"]) for r in rows if r["_pg_op"] == "I")


@pytest.mark.postgres
@pytest.mark.pg_matrix
def test_every_path_stages_what_postgres_15_prints(pg_conn, matrix_dsn, source, tmp_path, pg_version) -> None:
    c = pg_conn
    c.execute(
        """insert into rc_chars values (1, 'ü', ARRAY['ü'::"char", 'a', NULL, '"', '']), (2, '', NULL), (3, NULL, '{}')"""
    )
    for plugin, slot in (("test_decoding", source), ("pgoutput", source + "_po")):
        extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
        python = extract_batch(c, slot, tmp_path / plugin / "python", plugin=plugin, native=False, **extra)
        assert staged_rows(python) == STAGED, plugin
        if load_native() is not None:
            assert_same_batches(python, extract_batch(c, slot, tmp_path / plugin, plugin=plugin, native=True, **extra))

    snapshot_slot = source + "_snap"
    with create_slot_with_snapshot(matrix_dsn, snapshot_slot, two_phase=False) as (lsn, name):
        snapshot = stage_snapshot(matrix_dsn, name, lsn, snapshot_slot, tmp_path / "snapshot", ["public.rc_chars"])
    assert staged_rows(snapshot) == STAGED
