from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.writer import BatchWriter
from airflow_provider_pgdecode.decoding.assembler import Transaction
from airflow_provider_pgdecode.decoding.events import Change, Operation, RowImage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool
from airflow_provider_pgdecode.errors import CatalogError


def transaction(commit: int, items: list) -> Transaction:
    spool = ItemSpool()
    for item in items:
        spool.append(item)
    return Transaction(commit, Lsn(commit - 1), Lsn(commit), None, spool)


def insert(table: str, i: int, columns: tuple[str, ...] = ("id", "v")) -> Change:
    values = tuple(str(i) if c == "id" else f"{table}-{i}" for c in columns)
    types = tuple("integer" if c == "id" else "text" for c in columns)
    return Change(Lsn(i), 1, Operation.INSERT, "public", table, None, RowImage(columns, types, values))


def read(directory, summary) -> list[dict]:
    return pa.concat_tables(
        [pq.read_table(directory / summary.path / f) for f in summary.files], promote_options="default"
    ).to_pylist()


def test_memory_budget_is_shared_by_all_tables(tmp_path) -> None:
    writer = BatchWriter(tmp_path, part_rows=100)
    for n in range(30):
        writer.add_transaction(
            transaction(1000 + n, [insert(t, n * 10 + k) for t in ("a", "b", "c") for k in range(10)])
        )
        assert sum(len(b.meta) for b in writer._tables.values()) <= 100
    tables, _ = writer.close()
    assert [t.table for t in tables] == ["a", "b", "c"]
    for summary in tables:
        assert len(summary.files) > 1
        rows = read(tmp_path, summary)
        assert [r["id"] for r in rows] == list(range(300))
        assert rows[0]["v"] == f"{summary.table}-0"


def test_added_column_starts_a_new_part(tmp_path) -> None:
    writer = BatchWriter(tmp_path)
    writer.add_transaction(transaction(10, [insert("t", 1), insert("t", 2, ("id", "v", "extra"))]))
    (summary,), _ = writer.close()
    assert summary.files == ["part-00000.parquet", "part-00001.parquet"]
    assert [c.name for c in summary.columns] == ["id", "v", "extra"]
    rows = read(tmp_path, summary)
    assert [(r["id"], r["extra"]) for r in rows] == [(1, None), (2, "t-2")]


def test_reserved_column_names_are_refused(tmp_path) -> None:
    writer = BatchWriter(tmp_path)
    with pytest.raises(CatalogError, match="_pg_op.*reserves"):
        writer.add_transaction(transaction(10, [insert("t", 1, ("id", "_pg_op"))]))


def test_a_table_with_only_deletes_lists_its_key_columns(tmp_path) -> None:
    key = RowImage(("order_id", "line"), ("bigint", "integer"), ("7", "2"))
    delete = Change(Lsn(5), 1, Operation.DELETE, "public", "items", key, None)
    writer = BatchWriter(tmp_path)
    writer.add_transaction(transaction(10, [delete]))
    (summary,), _ = writer.close()
    assert [(c.name, c.type) for c in summary.columns] == [("order_id", "bigint"), ("line", "integer")]
    (row,) = read(tmp_path, summary)
    assert row["_pg_op"] == "D" and row["_pg_old"] == {"order_id": 7, "line": 2}
    assert (row["order_id"], row["line"]) == (None, None)  # present, null: a DELETE has no new tuple
