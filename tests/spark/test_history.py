"""History (SCD type 2) and soft-delete tables against PostgreSQL as the oracle.

One workload runs on two tables in the same transactions: ``hs_hist`` (``table_options`` mode
``history``) and ``hs_soft`` (``soft_delete``), over three extract, merge and advance rounds:
inserts, several updates to one key in one transaction and in several, deletes, a key change,
a key inserted and deleted in one transaction, a TRUNCATE between other changes of its
transaction, unchanged TOAST values (also carried through a key change), a prepared transaction
committed in a later round and one rolled back. The test reads the source table after every
commit: the committed states of each key. Then

* the history table's current rows equal the source; each key's versions, ordered by their
  valid-from, are its committed states; each version ends where the next begins (or at the
  DELETE or TRUNCATE that removed the key); exactly one current version per live key;
* the soft-delete table's live rows equal the source, each removed key is a tombstone holding
  its last committed values, removed at the commit that ended its last history version;
* merging a batch again adds nothing and says so; replaying every retained batch into another
  root in one run rebuilds the same history table, versions included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot
from airflow_provider_pgdecode.operators.replay import PgDecodeReplayOperator
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.spark.verify_job import verify_tables
from pgdecode_testing.compare import compare_table
from tests.conftest import PLUGIN_REPEAT, full_only, two_plugin_source
from tests.spark.staged import UNCHANGED, TableChanges, write_batch

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

HIST, SOFT = "hs_hist", "hs_soft"
TABLES = (HIST, SOFT)
PUBLICATION = "hs_pub"
TABLE_OPTIONS = {f"public.{HIST}": {"mode": "history"}, f"public.{SOFT}": {"mode": "soft_delete"}}
DDL = " ".join(
    f"create table {t} (id int primary key, name text, qty int, note text);"
    f" alter table {t} alter column note set storage external;"  # stored out of line: unchanged TOAST
    for t in TABLES
)

State = dict[int, tuple[Any, ...]]  # key -> (name, qty, note)


@pytest.fixture
def source(pg_conn: psycopg.Connection, slot_name: str):
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, list(TABLES), DDL) as slot:
        yield slot


class Workload:
    """Runs statements on both tables in one transaction each and records the committed state
    of the source after every commit."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.states: list[State] = [{}]
        self.marks: dict[str, int] = {}

    def commit(self, *statements: str) -> None:
        with self.conn.transaction():
            for statement in statements:
                for table in TABLES:
                    self.conn.execute(statement.format(t=table))
        self.record()

    def prepare(self, gid: str, *statements: str) -> None:
        body = "; ".join(s.format(t=t) for s in statements for t in TABLES)
        self.conn.execute(f"begin; {body}; prepare transaction '{gid}'")

    def record(self) -> None:
        rows = self.conn.execute(f"select id, name, qty, note from {HIST}").fetchall()
        soft = self.conn.execute(f"select id, name, qty, note from {SOFT}").fetchall()
        assert sorted(rows) == sorted(soft)
        self.states.append({r[0]: tuple(r[1:]) for r in rows})


def round_one(w: Workload) -> None:
    w.commit("insert into {t} select g, 'n' || g, g, repeat(chr(96 + g), 3000) from generate_series(1, 12) g")
    w.commit(  # two changes to one key in one transaction: one version
        "update {t} set qty = qty + 100 where id = 1", "update {t} set name = 'one-b' where id = 1"
    )
    w.commit("update {t} set qty = 20 where id = 2")
    w.commit("update {t} set qty = 21 where id = 2")
    w.commit("delete from {t} where id = 3")
    w.commit("update {t} set id = 40 where id = 4")  # a key change; note stays unchanged TOAST
    w.commit("update {t} set qty = 80 where id = 8")  # note unchanged TOAST: from the previous version
    w.commit("insert into {t} values (99, 'never', 0, 'x')", "delete from {t} where id = 99")
    w.prepare("hs_later", "update {t} set qty = 500, name = 'five-prepared' where id = 5")
    w.prepare("hs_never", "delete from {t} where id = 6")


def round_two(w: Workload) -> None:
    w.conn.execute("commit prepared 'hs_later'")
    w.record()
    w.conn.execute("rollback prepared 'hs_never'")
    w.commit("update {t} set name = 'eight-b' where id = 8")  # note from the version Delta holds
    w.marks["truncate"] = len(w.states)
    w.commit(
        "insert into {t} values (13, 'thirteen', 13, repeat('m', 3000))",
        "truncate {t}",
        "insert into {t} values (14, 'fourteen', 14, repeat('n', 3000))",
        "insert into {t} values (1, 'one-again', 1, repeat('o', 3000))",
    )
    w.commit("update {t} set qty = 140 where id = 14")  # note from the version this batch opened
    w.commit("update {t} set id = 141, qty = 141 where id = 14")  # a key change carrying unchanged TOAST
    w.commit("insert into {t} values (15, 'fifteen', 15, repeat('p', 3000))")


def round_three(w: Workload) -> None:
    w.commit("delete from {t} where id = 1")
    w.commit("insert into {t} values (1, 'one-third', 3, repeat('q', 3000))")
    w.commit("update {t} set name = 'moved' where id = 141")  # note from Delta, at the key it moved to
    w.commit("delete from {t} where id = 15")


def expected_versions(states: list[State], key: int) -> list[tuple[tuple[Any, ...], str | None]]:
    """The key's committed states as versions: (values, how it ends: 'next' when another version
    follows at once, 'removed' when the key was deleted or truncated, None while current)."""
    out: list[tuple[tuple[Any, ...], str | None]] = []
    previous = None
    for state in states:
        value = state.get(key)
        if value != previous:
            if out and out[-1][1] is None:
                out[-1] = (out[-1][0], "next" if value is not None else "removed")
            if value is not None:
                out.append((value, None))
        previous = value
    return out


def unchanged_toast(batches: list[str]) -> list[tuple[str, int]]:
    """(operation, key) of the staged changes to the history table that left ``note`` unchanged
    TOAST, in staging order: what makes the versions' notes come from earlier versions."""
    found = []
    for batch in batches:
        for entry in BatchManifest.read(batch).tables:
            if entry.table != HIST:
                continue
            for file in entry.file_paths:
                part = pq.read_table(file, columns=["_pg_op", "id", "_pg_unchanged_toast"]).to_pylist()
                found += [(r["_pg_op"], r["id"]) for r in part if "note" in (r["_pg_unchanged_toast"] or ())]
    return found


def delta_rows(spark, path: str) -> list[dict[str, Any]]:
    return [r.asDict() for r in spark.read.format("delta").load(path).collect()]


def check_history(spark, path: str, w: Workload) -> dict[int, list[dict[str, Any]]]:
    rows = delta_rows(spark, path)
    by_key: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["id"], []).append(row)
    for versions in by_key.values():
        versions.sort(key=lambda r: r["_pg_valid_from_lsn"])
    keys = {k for state in w.states for k in state} | set(by_key)
    for key in sorted(keys):
        expected = expected_versions(w.states, key)
        got = by_key.get(key, [])
        assert [(r["name"], r["qty"], r["note"]) for r in got] == [v for v, _ in expected], f"key {key}"
        for index, (row, (_, end)) in enumerate(zip(got, expected)):
            assert (row["_pg_commit_lsn"], row["_pg_commit_time"]) == (row["_pg_valid_from_lsn"], row["_pg_valid_from"])
            assert row["_pg_valid_from"] is not None
            if end is None:
                assert row["_pg_current"] and row["_pg_valid_to_lsn"] is None and row["_pg_valid_to"] is None, key
                continue
            assert not row["_pg_current"] and row["_pg_valid_to_lsn"] > row["_pg_valid_from_lsn"], key
            assert row["_pg_valid_to"] is not None and row["_pg_valid_to"] >= row["_pg_valid_from"], key
            if end == "next":
                following = got[index + 1]
                assert (row["_pg_valid_to_lsn"], row["_pg_valid_to"]) == (
                    following["_pg_valid_from_lsn"],
                    following["_pg_valid_from"],
                ), key
            elif index + 1 < len(got):
                assert row["_pg_valid_to_lsn"] < got[index + 1]["_pg_valid_from_lsn"], key
        assert sum(r["_pg_current"] for r in got) == (1 if key in w.states[-1] else 0), key
    return by_key


def check_truncate(by_key: dict[int, list[dict[str, Any]]], w: Workload) -> None:
    """Every version current before the TRUNCATE ends at its commit, where the rows inserted
    after it in its transaction begin."""
    mark = w.marks["truncate"]
    at, when = by_key[14][0]["_pg_valid_from_lsn"], by_key[14][0]["_pg_valid_from"]
    again = [r for r in by_key[1] if r["name"] == "one-again"]
    assert again[0]["_pg_valid_from_lsn"] == at  # key 1 inserted again after the TRUNCATE
    for key in w.states[mark - 1]:
        valid = [r for r in by_key[key] if r["_pg_valid_from_lsn"] < at]
        assert (valid[-1]["_pg_valid_to_lsn"], valid[-1]["_pg_valid_to"]) == (at, when), key
    assert 13 not in by_key and 99 not in by_key  # never committed


def check_soft(spark, path: str, w: Workload, history: dict[int, list[dict[str, Any]]]) -> None:
    soft = {r["id"]: r for r in delta_rows(spark, path)}
    ever = {k for state in w.states for k in state}
    assert set(soft) == ever
    for key in sorted(ever):
        row, last = soft[key], history[key][-1]
        values = (row["name"], row["qty"], row["note"])
        if key in w.states[-1]:
            assert not row["_pg_deleted"] and values == w.states[-1][key], key
            assert (row["_pg_commit_lsn"], row["_pg_commit_time"]) == (
                last["_pg_valid_from_lsn"],
                last["_pg_valid_from"],
            )
        else:
            committed = [state[key] for state in w.states if key in state]
            assert row["_pg_deleted"] and values == committed[-1], key
            assert (row["_pg_commit_lsn"], row["_pg_commit_time"]) == (last["_pg_valid_to_lsn"], last["_pg_valid_to"])


@pytest.mark.parametrize("plugin", ["test_decoding", full_only("pgoutput", PLUGIN_REPEAT)])
def test_history_and_soft_delete_tables_keep_every_committed_state(
    pg_conn, pg_dsn, source, spark, tmp_path: Path, plugin: str
) -> None:
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    w = Workload(pg_conn)
    batches: list[str] = []
    checkpoint = None

    def cycle() -> dict[str, Any]:
        nonlocal checkpoint
        manifest = extract_batch(
            pg_conn, slot, staging, plugin=plugin, checkpoint=checkpoint, table_options=TABLE_OPTIONS, **extra
        )
        assert {t.table: t.mode for t in manifest.tables} == {HIST: "history", SOFT: "soft_delete"}
        summary = merge_batches(spark, [str(manifest.path)], delta_root)
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))
        return summary

    round_one(w)
    cycle()
    assert [p["gid"] for p in checkpoint.prepared_pending] == ["hs_later", "hs_never"]
    round_two(w)
    cycle()
    round_three(w)
    last = cycle()
    assert last["tables"][f"public.{HIST}"]["status"] == "merged"
    # Updates left the note out of line and unchanged (40 and 141: changing the key), so the
    # versions' notes below came from earlier versions, in Delta or in the same batch.
    assert {key for _, key in unchanged_toast(batches)} == {1, 2, 5, 8, 14, 40, 141}

    for table in TABLES:  # the current rows (the mode recorded in the table says which) equal the source
        result = compare_table(pg_conn, spark, delta_root, "public", table)
        assert result.equal and result.source_rows > 0, result.describe()
    hist_path, soft_path = f"{delta_root}/public/{HIST}", f"{delta_root}/public/{SOFT}"
    by_key = check_history(spark, hist_path, w)
    check_truncate(by_key, w)
    check_soft(spark, soft_path, w, by_key)
    if plugin == "test_decoding":  # the verify job reads the Delta side the same way (not a plugin matter)
        names = [f"public.{t}" for t in TABLES]
        snapshot = stage_verify_snapshot(pg_dsn, slot, staging, names, table_options=TABLE_OPTIONS)
        report = verify_tables(spark, snapshot.path, delta_root, slot, snapshot.lsn, snapshot.tables)
        assert report["equal"], report["tables"]
        assert [report["tables"][n]["delta_rows"] for n in names] == [len(w.states[-1])] * 2

    # The last batch again: already applied, nothing added.
    before = {t: delta_rows(spark, f"{delta_root}/public/{t}") for t in TABLES}
    again = merge_batches(spark, [batches[-1]], delta_root)
    for table in TABLES:
        entry = again["tables"][f"public.{table}"]
        assert (entry["status"], entry["reason"]) == ("skipped", "already applied"), entry
        assert entry["delta_version"] == last["tables"][f"public.{table}"]["delta_version"]
        assert delta_rows(spark, f"{delta_root}/public/{table}") == before[table]

    # Replay: every retained batch merged into another root in one run rebuilds the same tables.
    replay_root = str(tmp_path / "replay")
    chain = PgDecodeReplayOperator(task_id="replay", slot_name=slot, staging_root=str(staging)).execute({})
    assert chain == batches
    merge_batches(spark, chain, replay_root)
    for table in TABLES:
        ordered = sorted(before[table], key=_row_order)
        assert sorted(delta_rows(spark, f"{replay_root}/public/{table}"), key=_row_order) == ordered, table


def _row_order(row: dict[str, Any]) -> tuple[int, int]:
    return row["id"], row.get("_pg_valid_from_lsn") or 0


@pytest.mark.parametrize("mode", ["history", "soft_delete"])
def test_added_and_widened_columns_flow_into_history_and_soft_delete_tables(spark, tmp_path: Path, mode: str) -> None:
    """Staged batches (tests/spark/staged.py): a column added and one widened inside the second
    batch; the Delta table takes both (ADD COLUMNS, type widening) and keeps its mode's columns."""
    before = [("id", "integer", pa.int32()), ("qty", "integer", pa.int32()), ("note", "text", pa.string())]
    after = [("id", "integer", pa.int32()), ("qty", "bigint", pa.int64()), ("note", "text", pa.string())]
    after.append(("extra", "text", pa.string()))
    first = TableChanges("public", "ev", before, mode=mode).insert(0x100, id=1, qty=1, note="n1")
    first.insert(0x100, id=2, qty=2, note="n2")
    second = TableChanges("public", "ev", before, mode=mode).update(0x300, id=1, qty=5, note=UNCHANGED)
    second.alter(after).update(0x400, id=1, qty=5_000_000_000, note=UNCHANGED, extra="x").delete(0x500, id=2)
    root, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    merge_batches(spark, [write_batch(root, "s", 0x10, 0x200, [first])], delta_root)
    summary = merge_batches(spark, [write_batch(root, "s", 0x200, 0x600, [second])], delta_root)
    table = summary["tables"]["public.ev"]
    assert (table["columns_added"], table["columns_widened"]) == (["extra"], {"qty": "int -> bigint"})
    frame = spark.read.format("delta").load(f"{delta_root}/public/ev")
    types = dict(frame.dtypes)
    assert (types["qty"], types["extra"]) == ("bigint", "string")
    rows = sorted((r.asDict() for r in frame.collect()), key=_row_order)
    if mode == "history":
        assert [(r["id"], r["qty"], r["note"], r["extra"], r["_pg_valid_to_lsn"], r["_pg_current"]) for r in rows] == [
            (1, 1, "n1", None, 0x300, False),
            (1, 5, "n1", None, 0x400, False),
            (1, 5_000_000_000, "n1", "x", None, True),
            (2, 2, "n2", None, 0x500, False),
        ]
    else:
        assert [(r["id"], r["qty"], r["note"], r["extra"], r["_pg_commit_lsn"], r["_pg_deleted"]) for r in rows] == [
            (1, 5_000_000_000, "n1", "x", 0x400, False),
            (2, 2, "n2", None, 0x500, True),
        ]
