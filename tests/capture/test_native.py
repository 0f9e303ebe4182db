"""The native fast path stages exactly what the Python path stages (both plugins, a rich workload)."""

from __future__ import annotations

import gzip
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.decoding.lsn import Lsn
from tests.capture.test_extract import TEXT, table_rows

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(load_native() is None, reason="the native extension is not built"),
]

PUBLICATION = "nat_pub"
TABLES = ("nat_typed", "nat_keys", "nat_full", "nat_toast", "nat_del", '"Odd Schema"."we""ird"')


def comparable(column: Any) -> list[Any]:
    return [repr(v) for v in column.to_pylist()]


def assert_same_batches(python: BatchManifest, native: BatchManifest) -> None:
    """Same manifest contents, same Parquet tables, same messages and prepared files."""
    assert native.contents() == python.contents()
    assert native.skipped == python.skipped
    for summary in python.tables:
        for name in summary.files:
            left = pq.read_table(Path(python.path) / summary.path / name)
            right = pq.read_table(Path(native.path) / summary.path / name)
            assert right.schema == left.schema, (summary.table, name)
            for column in left.column_names:  # column-wise, NaN equal to NaN
                assert comparable(right[column]) == comparable(left[column]), (summary.table, name, column)
    if python.messages:
        for name in python.messages["files"]:
            left = pq.read_table(Path(python.path) / "messages" / name)
            assert pq.read_table(Path(native.path) / "messages" / name).equals(left)
    for entry in python.prepared_pending:
        with gzip.open(Path(python.path) / entry["path"]) as a, gzip.open(Path(native.path) / entry["path"]) as b:
            assert a.read() == b.read()


@pytest.fixture()
def slots(pg_conn: psycopg.Connection, slot_name: str):
    c = pg_conn
    c.execute(
        'drop table if exists nat_typed, nat_keys, nat_full, nat_toast, nat_del cascade; drop schema if exists "Odd Schema" cascade;'
        f" drop publication if exists {PUBLICATION}"
    )
    if not c.execute("select 1 from pg_type where typname = 'nat_mood'").fetchone():
        c.execute("create type nat_mood as enum ('happy', 'sad')")
    c.execute(
        """create table nat_typed (id bigint primary key, s smallint, i int, n numeric(12,3), r real,
           d double precision, b boolean, t text, v varchar(10), dt date, ts timestamp, tz timestamptz,
           u uuid, j json, jb jsonb, by bytea, ia int[], ta text[], m nat_mood, iv interval, bv bit varying(8));
           create table nat_keys (k1 int, k2 text, v text, primary key (k1, k2));
           create table nat_full (a int, b text); alter table nat_full replica identity full;
           create table nat_toast (id int primary key, big text, small int);
           alter table nat_toast alter column big set storage external;
           create table nat_del (id int primary key, v text);
           create schema "Odd Schema";
           create type "Odd Schema"."Mo]:od" as enum ('a', 'b c');
           create table "Odd Schema"."we""ird" ("Col A" int primary key, "x[y]" text, "new-tuple:" text,
                                                 moods "Odd Schema"."Mo]:od"[]);"""
        f" create publication {PUBLICATION} for table {', '.join(TABLES)}"
    )
    c.execute("insert into nat_toast values (1, repeat('x', 4000), 1)")
    c.execute("insert into nat_full values (1, null), (2, 'b')")
    c.execute("insert into nat_del select g, 'd' || g from generate_series(1, 30) g")
    po = f"{slot_name}_po"
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (po,))
    yield {"test_decoding": slot_name, "pgoutput": po}
    for (gid,) in c.execute("select gid from pg_prepared_xacts where gid in ('nat_g', 'nat_r')").fetchall():
        c.execute(f"rollback prepared '{gid}'")
    c.execute("select pg_drop_replication_slot(%s)", (po,))
    c.execute(f"drop publication {PUBLICATION}")


def first_batch_workload(c: psycopg.Connection) -> None:
    c.execute(
        """insert into nat_typed values
           (1, -32768, 2147483647, -123456789.125, 1.5, 'NaN', true, e'multi\\nline ''q'' \\\\ back', 'vc',
            '2024-02-29', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.5+05:30',
            'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": "c''d"}', '\\x00ff10',
            '{1,NULL,3}', '{"x y",NULL,"null","q\\"u"}', 'sad', '1 day 02:00:00', B'0101'),
           (2, null, null, null, '-Infinity', 'Infinity', false, 'null', 'unchanged-', 'infinity', null, null,
            null, null, null, null, '{}', null, null, null, null),
           (3, 1, 2, 0.5, 0, -0.0, null, e'éß😀 \\t tab', '', '-infinity', 'infinity', '-infinity',
            null, 'null', '[]', '\\x', '{-1}', '{}', 'happy', '-3 mons', B'')"""
    )
    c.execute(
        "insert into \"Odd Schema\".\"we\"\"ird\" values (1, 'a] b:[c', ' new-tuple: x[text]:''y''', '{a,\"b c\"}')"
    )
    c.execute('update "Odd Schema"."we""ird" set "Col A" = 2 where "Col A" = 1')
    c.execute("insert into nat_keys values (1, 'x', 'one'), (1, 'y', 'two'), (2, 'it''s', e'line\\nbreak')")
    c.execute("update nat_keys set k2 = 'z' where k2 = 'y'")
    c.execute("update nat_keys set v = 'same key' where k1 = 2")
    c.execute("delete from nat_keys where k1 = 1 and k2 = 'x'")
    c.execute("update nat_full set b = 'c' where a = 1")
    c.execute("delete from nat_full where a = 2")
    c.execute("update nat_toast set small = 5")
    try:
        with c.transaction():
            c.execute("insert into nat_keys values (99, 'rolled', 'back')")
            raise RuntimeError
    except RuntimeError:
        pass
    with c.transaction():  # large: pgoutput streams it (logical_decoding_work_mem = 64kB)
        c.execute("insert into nat_keys select g, 's', repeat('s', 300) from generate_series(100, 400) g")
        c.execute("select pg_logical_emit_message(true, 'nat', 'in tx')")
        c.execute("insert into nat_typed (id, t) values (10, 'in the big one')")
    with c.transaction():  # TRUNCATE mid-batch, between changes
        c.execute("insert into nat_full values (5, 'before')")
        c.execute("truncate nat_full")
        c.execute("insert into nat_full values (9, 'after truncate')")
    c.execute("select pg_logical_emit_message(false, 'hb', '\\xff00'::bytea)")
    for i in range(12):  # small transactions over several tables
        with c.transaction():
            c.execute("insert into nat_keys values (%s, 'm', %s)", (1000 + i, f"v{i}"))
            if i % 3 == 0:
                c.execute("update nat_typed set t = %s where id = 1", (f"round {i}",))
            if i % 4 == 1:
                c.execute("delete from nat_keys where k1 = %s", (1000 + i - 1,))
    c.execute("alter table nat_typed add column extra text")
    c.execute("insert into nat_typed (id, t, extra) values (20, 'with extra', 'x')")
    c.execute("update nat_typed set extra = 'y' where id = 1")
    c.execute("begin; insert into nat_keys values (7, 'p', 'prepared'); prepare transaction 'nat_g'")
    c.execute("begin; insert into nat_keys values (8, 'r', 'rolled back later'); prepare transaction 'nat_r'")
    c.execute("insert into nat_del values (100, 'last of batch 1')")


def second_batch_workload(c: psycopg.Connection) -> None:
    c.execute("commit prepared 'nat_g'")
    c.execute("rollback prepared 'nat_r'")
    c.execute("delete from nat_del where id <= 20")  # delete-only for this table
    c.execute("delete from nat_full")


def flush_lsn(c: psycopg.Connection) -> Lsn:
    lsn = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    return lsn


def extract_both(
    c: psycopg.Connection, plugin: str, slot: str, root: Path, upto: Lsn, **kwargs: Any
) -> tuple[BatchManifest, BatchManifest]:
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    python = extract_batch(c, slot, root / "python", plugin=plugin, upto_lsn=upto, native=False, **extra, **kwargs)
    native = extract_batch(c, slot, root / "native", plugin=plugin, upto_lsn=upto, native=True, **extra, **kwargs)
    return python, native


PARAMETERS = {
    "default": {},
    "small parts and memory": {"part_rows": 7, "memory_items": 5},
    "tables filter": {"tables": ["public.nat_keys", ("Odd Schema", 'we"ird'), "public.nat_del"], "part_rows": 50},
}


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_native_and_python_paths_stage_identical_batches(pg_conn, slots, tmp_path, plugin, caplog) -> None:
    slot = slots[plugin]
    first_batch_workload(pg_conn)
    upto = flush_lsn(pg_conn)
    firsts = {}
    with caplog.at_level(logging.INFO, logger="airflow_provider_pgdecode.capture.native"):
        for label, kwargs in PARAMETERS.items():
            python, native = extract_both(pg_conn, plugin, slot, tmp_path / label / "1", upto, **kwargs)
            assert_same_batches(python, native)
            firsts[label] = python
    assert firsts["default"].changes > 330 and firsts["default"].prepared_pending
    handed = [
        tuple(map(int, m)) for m in re.findall(r"Native extract: (\d+) rows read, (\d+) of them handed", caplog.text)
    ]
    assert handed and all(h < rows for rows, h in handed), handed  # the fast path did work
    # The next batch: the prepared transactions resolve, a delete-only table.
    second_batch_workload(pg_conn)
    upto = flush_lsn(pg_conn)
    pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, firsts["default"].end_lsn))
    for label, kwargs in PARAMETERS.items():
        checkpoint = Checkpoint.from_manifest(firsts[label])
        python, native = extract_both(
            pg_conn, plugin, slot, tmp_path / label / "2", upto, checkpoint=checkpoint, **kwargs
        )
        assert_same_batches(python, native)
        if label == "default":
            rows = table_rows(native, "public", "nat_keys")
            assert [r["k2"] for r in rows] == ["p"]
            assert {r["_pg_op"] for r in table_rows(native, "public", "nat_del")} == {"D"}


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_checkpoint_ahead_of_the_slot_is_honoured_alike(pg_conn, slots, tmp_path, plugin) -> None:
    slot = slots[plugin]
    pg_conn.execute("insert into nat_keys values (1, 'a', 'first')")
    middle = flush_lsn(pg_conn)
    pg_conn.execute("insert into nat_keys values (2, 'b', 'second')")
    upto = flush_lsn(pg_conn)
    python, native = extract_both(pg_conn, plugin, slot, tmp_path / "all", middle)
    assert_same_batches(python, native)
    checkpoint = Checkpoint.from_manifest(python)
    python, native = extract_both(pg_conn, plugin, slot, tmp_path / "rest", upto, checkpoint=checkpoint)
    assert_same_batches(python, native)
    assert [r["k2"] for r in table_rows(native, "public", "nat_keys")] == ["b"]


def test_environment_switch_selects_the_python_path(pg_conn, slots, tmp_path, monkeypatch, caplog) -> None:
    pg_conn.execute("insert into nat_keys values (1, 'a', 'x')")
    monkeypatch.setenv("PGDECODE_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="airflow_provider_pgdecode.capture.native"):
        manifest = extract_batch(pg_conn, slots["test_decoding"], tmp_path)
    assert manifest.changes == 1
    assert "Native extract" not in caplog.text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(TEXT, min_size=1, max_size=8), part_rows=st.integers(1, 20))
def test_random_text_stages_alike_through_both_paths(pg_conn, slots, tmp_path_factory, values, part_rows) -> None:
    with pg_conn.transaction():
        with pg_conn.cursor() as cur:
            cur.executemany(
                "insert into nat_keys (k1, k2, v) values (%s, %s, %s)",
                [(i, v, v) for i, v in enumerate(values)],
            )
            cur.execute("update nat_keys set k2 = k2 || '!', v = null where k1 = 0")
            cur.execute("delete from nat_keys")
    upto = flush_lsn(pg_conn)
    for plugin, slot in slots.items():
        root = tmp_path_factory.mktemp("rt")
        python, native = extract_both(pg_conn, plugin, slot, root, upto, part_rows=part_rows)
        assert_same_batches(python, native)
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, python.end_lsn))


def test_a_cancel_while_rows_stream_from_libpq_reports_the_server_error(
    pg_conn, pg_dsn, slots, tmp_path, monkeypatch
) -> None:
    import airflow_provider_pgdecode.capture.extract as extract_module
    import airflow_provider_pgdecode.capture.native as native_module
    from airflow_provider_pgdecode.errors import SlotError

    pg_conn.execute("insert into nat_keys select g, 'c', repeat('c', 100) from generate_series(1, 100000) g")
    upto = flush_lsn(pg_conn)
    cancelled: list[bool] = []
    ended_early: list[bool] = []
    raise_copy_end = native_module._raise_copy_end
    monkeypatch.setattr(native_module, "_raise_copy_end", lambda copy: ended_early.append(True) or raise_copy_end(copy))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        class CancelOnFirstLookup:
            """The table filter, asked when the first change streams in: cancel the peek then."""

            def __contains__(self, name: tuple[str, str]) -> bool:
                if not cancelled:
                    conn.cancel_safe()
                    cancelled.append(True)
                return True

        monkeypatch.setattr(extract_module, "parse_table_names", lambda tables: CancelOnFirstLookup())
        with pytest.raises(SlotError, match="canceling statement due to user request"):
            extract_batch(conn, slots["test_decoding"], tmp_path, upto_lsn=upto, tables=["x"], native=True)
    assert cancelled and ended_early  # the error came through the libpq reader
    assert list((tmp_path / slots["test_decoding"]).iterdir()) == []


def test_without_the_extension_the_python_path_stages_the_batch(pg_conn, slots, tmp_path, monkeypatch) -> None:
    import airflow_provider_pgdecode.capture.extract as extract_module

    pg_conn.execute("insert into nat_keys values (1, 'a', 'x')")
    upto = flush_lsn(pg_conn)
    native = extract_batch(pg_conn, slots["test_decoding"], tmp_path / "native", upto_lsn=upto)
    monkeypatch.setattr(extract_module, "load_native", lambda: None)
    python = extract_batch(pg_conn, slots["test_decoding"], tmp_path / "python", upto_lsn=upto)
    assert_same_batches(python, native)
    assert python.changes == 1


def _maps() -> list[list[str]]:
    """/proc/self/maps, split: address range, permissions, offset, device, inode and path if any."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        return [line.split() for line in maps]


def _mappings(path: str) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of each mapping of ``path`` in this process."""
    return [(int(r[0].split("-")[0], 16), int(r[0].split("-")[1], 16), r[1]) for r in _maps() if r[5:] == [path]]


def test_libpq_is_bound_by_address_from_the_very_copy_psycopg_loaded() -> None:
    """The extension resolves no symbol (no dlopen/dlsym: tests/test_packaging.py): native.py hands it
    the addresses of PQgetCopyData and PQfreemem, found with RTLD_NOLOAD in the libpq psycopg loaded."""
    import sysconfig

    import airflow_provider_pgdecode.capture.native as native_module

    psycopg.pq.version()  # psycopg's libpq is loaded
    loaded = {r[5] for r in _maps() if len(r) == 6 and "/libpq" in r[5] and "psycopg2" not in r[5]}
    wanted = "psycopg_binary" if psycopg.pq.__impl__ == "binary" else ""
    libpq = sorted(p for p in loaded if wanted in p)
    assert len(libpq) == 1, loaded
    addresses = native_module._libpq_functions(libpq[0])
    executable = [(start, end) for start, end, perms in _mappings(libpq[0]) if "x" in perms]
    for address in addresses:  # inside psycopg's libpq, not another copy
        assert any(start <= address < end for start, end in executable), (hex(address), executable)
    native = load_native()
    native.bind_libpq(*addresses)

    # A library that is not loaded is not loaded by the look-up either (RTLD_NOLOAD).
    mapped = {r[5] for r in _maps() if len(r) == 6}
    dynload = Path(sysconfig.get_config_var("DESTSHARED"))
    unloaded = sorted(str(p) for p in dynload.glob("*.so") if str(p) not in mapped)
    assert unloaded, f"every extension module of {dynload} is loaded"
    with pytest.raises(OSError, match=f"libpq {re.escape(unloaded[0])} is not loaded"):
        native_module._libpq_functions(unloaded[0])
    assert _mappings(unloaded[0]) == []
    # A loaded library without them.
    with pytest.raises(OSError, match="PQgetCopyData or PQfreemem not found"):
        native_module._libpq_functions(native.__file__)
    with pytest.raises(ValueError, match="address is NULL"):
        native.bind_libpq(0, addresses[1])
    with pytest.raises(TypeError):
        native.bind_libpq(libpq[0])  # a path is no longer what it takes


def test_reading_the_copy_through_psycopg_stages_the_same_batch(pg_conn, slots, tmp_path, monkeypatch) -> None:
    """PGDECODE_NATIVE_LIBPQ=0: the native path, its COPY read through psycopg instead of libpq."""
    import airflow_provider_pgdecode.capture.native as native_module

    first_batch_workload(pg_conn)
    upto = flush_lsn(pg_conn)
    default = extract_batch(pg_conn, slots["test_decoding"], tmp_path / "libpq", upto_lsn=upto, native=True)
    copy = SimpleNamespace(cursor=SimpleNamespace(connection=SimpleNamespace(pgconn=pg_conn.pgconn)))
    assert native_module._libpq_connection(load_native(), copy) == pg_conn.pgconn.pgconn_ptr
    monkeypatch.setenv(native_module.NATIVE_LIBPQ_ENV, "0")
    assert native_module._libpq_connection(load_native(), copy) is None
    through_psycopg = extract_batch(pg_conn, slots["test_decoding"], tmp_path / "psycopg", upto_lsn=upto, native=True)
    assert through_psycopg.changes == default.changes > 0
    assert_same_batches(default, through_psycopg)
