"""The storage layer against a local directory and a real S3-compatible server."""

from __future__ import annotations

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage, spark_uri
from airflow_provider_pgdecode.errors import ConfigurationError

pytestmark = pytest.mark.s3


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    bucket = request.getfixturevalue("s3_bucket")
    return Storage(f"{bucket}/root", request.getfixturevalue("s3_server").settings)


def test_write_read_list_and_delete(store: Storage) -> None:
    store.write_text("slot/a-b/tables/x/part-00000.parquet", "part")
    store.write_text("slot/a-b/manifest.json", "{}")
    assert store.read_text("slot/a-b/manifest.json") == "{}"
    assert store.list_dir("slot") == [("a-b", True)]
    assert store.walk_files("slot/a-b") == ["manifest.json", "tables/x/part-00000.parquet"]
    assert store.is_file("slot/a-b/manifest.json") and not store.is_file("slot/a-b")
    assert store.mtime("slot/a-b/manifest.json") > 0
    store.delete_tree("slot/a-b")
    assert store.list_dir("slot") == []
    assert not store.exists("slot/a-b/manifest.json")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("slot/a-b/manifest.json")
    store.delete_tree("slot/a-b")  # a missing tree is no error


def test_bytes_are_stored_as_given_whatever_the_name(store: Storage) -> None:
    data = gzip.compress(b"items")
    store.write_bytes("prepared/1-a.jsonl.gz", data)
    assert store.read_bytes("prepared/1-a.jsonl.gz") == data
    with store.open_output("prepared/2-b.jsonl.gz") as out:
        out.write(data)
    assert store.read_bytes("prepared/2-b.jsonl.gz") == data


def test_parquet_through_streams(store: Storage) -> None:
    table = pa.table({"id": [1, 2, 3]})
    with store.open_output("t/part.parquet") as out:
        pq.write_table(table, out)
    assert pq.read_table(store.open_input("t/part.parquet")).equals(table)


def test_upload_tree_writes_the_named_file_last(store: Storage, tmp_path) -> None:
    local = tmp_path / "batch"
    (local / "tables" / "t").mkdir(parents=True)
    (local / "tables" / "t" / "part-00000.parquet").write_bytes(b"p")
    (local / "manifest.json").write_text("{}")
    written: list[str] = []
    original = store.open_output

    def spy(relative: str):
        written.append(relative)
        return original(relative)

    store.open_output = spy  # type: ignore[method-assign]
    store.upload_tree(local, "slot/b", last="manifest.json")
    assert written == ["slot/b/tables/t/part-00000.parquet", "slot/b/manifest.json"]
    assert store.read_bytes("slot/b/tables/t/part-00000.parquet") == b"p"


def test_locations_and_settings() -> None:
    assert Storage("s3a://lake/a/b/").root == "s3://lake/a/b"
    assert spark_uri("s3://lake/a") == "s3a://lake/a"
    assert spark_uri("/data/x") == "/data/x"
    with pytest.raises(ConfigurationError, match="names no bucket"):
        Storage("s3:///x")
    with pytest.raises(ConfigurationError, match="unsupported location scheme 'gs'"):
        Storage("gs://bucket/x")
    settings = ObjectStoreSettings(endpoint_url="http://127.0.0.1:9", access_key="k", secret_key="s3cr3t")
    assert "s3cr3t" not in repr(settings)
    assert ObjectStoreSettings.from_env(settings.to_env()) == settings
    assert settings.hadoop_conf()["fs.s3a.path.style.access"] == "true"
    with pytest.raises(ConfigurationError, match="not an http"):
        ObjectStoreSettings(endpoint_url="127.0.0.1:9").filesystem()


def test_an_unreachable_store_is_named_with_the_way_forward() -> None:
    from airflow_provider_pgdecode.errors import StagingError

    settings = ObjectStoreSettings(
        endpoint_url="http://127.0.0.1:9", region="us-east-1", access_key="k", secret_key="s"
    )
    store = Storage("s3://nowhere/staging", settings)
    with pytest.raises(StagingError, match=r"s3://nowhere/staging/slot/manifest.json.*endpoint_url") as info:
        store.read_bytes("slot/manifest.json")
    assert "free space" not in str(info.value)
