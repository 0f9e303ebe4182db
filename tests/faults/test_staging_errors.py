"""Staging I/O errors are StagingErrors that name the path, the cause and the way forward."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.publish import publish_batch
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.batch.writer import BatchWriter
from airflow_provider_pgdecode.decoding.assembler import Transaction
from airflow_provider_pgdecode.decoding.events import Change, Operation, RowImage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.spool import ItemSpool
from airflow_provider_pgdecode.errors import StagingError, is_deterministic, staging_io, staging_io_error


def blocked(tmp_path: Path) -> Path:
    """A path whose parent is a regular file: nothing can be created under it."""
    (tmp_path / "file").write_text("not a directory")
    return tmp_path / "file" / "batch"


def change(lsn: int) -> Change:
    return Change(
        lsn=Lsn(lsn),
        xid=7,
        schema="public",
        table="t",
        operation=Operation.INSERT,
        old=None,
        new=RowImage(("id",), ("integer",), ("1",)),
    )


def assert_names(error: StagingError, path: Path) -> None:
    text = str(error)
    assert str(path) in text, text
    assert "run the task again" in text, text
    assert isinstance(error.__cause__, OSError)
    assert is_deterministic(error)


def test_writer_part_names_the_file(tmp_path) -> None:
    directory = blocked(tmp_path)
    writer = BatchWriter(directory)
    items = ItemSpool()
    items.append(change(100))
    txn = Transaction(xid=7, begin_lsn=Lsn(90), commit_lsn=Lsn(200), commit_time=None, items=items)
    writer.add_transaction(txn)
    with pytest.raises(StagingError, match="cannot write Parquet part") as caught:
        writer.close()
    assert_names(caught.value, directory)


def test_spool_spill_names_the_directory(tmp_path) -> None:
    spill_dir = tmp_path / "gone"
    spool = ItemSpool(memory_items=1, spill_dir=spill_dir)
    with pytest.raises(StagingError, match="cannot spill a large transaction") as caught:
        spool.append(change(100))
    assert_names(caught.value, spill_dir)


def test_spool_save_names_the_file(tmp_path) -> None:
    spool = ItemSpool()
    spool.append(change(100))
    target = blocked(tmp_path) / "prepared.jsonl.gz"
    with pytest.raises(StagingError, match="cannot write prepared transaction") as caught:
        spool.save(target)
    assert_names(caught.value, target)


def test_manifest_and_publish_name_the_batch(tmp_path) -> None:
    manifest = BatchManifest(
        slot="s", plugin="test_decoding", database="d", start_lsn="0/10", end_lsn="0/20", ceiling_lsn="0/20",
        transactions=0, changes=0, tables=[],
    )  # fmt: skip
    with pytest.raises(StagingError, match="cannot write batch manifest") as caught:
        manifest.write(blocked(tmp_path))
    assert_names(caught.value, blocked(tmp_path))
    missing = tmp_path / "never-staged"
    with pytest.raises(StagingError, match="cannot publish batch") as caught:
        publish_batch(missing, Storage(tmp_path), "s/0000000000000010-0000000000000020", manifest)
    assert_names(caught.value, missing)


@pytest.mark.parametrize(
    ("code", "advice"),
    [(errno.ENOSPC, "free space there"), (errno.EACCES, "may write there"), (errno.EIO, "Check the staging")],
)
def test_the_way_forward_depends_on_the_cause(tmp_path, code, advice) -> None:
    cause = OSError(code, "boom", str(tmp_path / "part-00000.parquet"))
    error = staging_io_error(cause, tmp_path, "write Parquet part")
    assert advice in str(error) and "part-00000.parquet" in str(error)
    with pytest.raises(StagingError) as caught, staging_io(tmp_path, "write Parquet part"):
        raise cause
    assert caught.value.__cause__ is cause
    # pyarrow's errors carry the cause in the text only
    arrow = OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert "free space there" in str(staging_io_error(arrow, tmp_path / "x.parquet", "write Parquet part"))
