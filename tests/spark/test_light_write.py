"""The light write (spark/light_write.py): small runs into small tables committed by delta-rs.

Each batch is merged twice, into a Delta root where every table goes through Delta's MERGE and
into one where small tables are committed by delta-rs; both must equal the reference model
(:class:`tests.spark.staged.Model`) and each other, read by Spark and by delta-rs, with the same
counts and the same watermark.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.spark.delta_state import app_id, read_delta_state
from airflow_provider_pgdecode.spark.light_write import PHYSICAL_NAME
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from tests.spark.staged import UNCHANGED, Model, TableChanges, write_batch

pytestmark = pytest.mark.spark

SLOT = "pgdecode_light"
DOCS = [("id", "bigint", pa.int64()), ("title", "text", pa.string()), ("body", "text", pa.string())]
COLUMNS = ["id", "title", "body", "_pg_commit_lsn"]
DELTA_ONLY = MergeOptions(light_write_max_bytes=0)
MERGE_LOG = "airflow_provider_pgdecode.spark.merge"


def last_commit(path: Path) -> dict[str, Any]:
    """The newest commit's ``commitInfo`` and whether it holds a deletion vector, from the log."""
    log = path / "_delta_log"
    newest = max(log.glob("*.json"))
    actions = [json.loads(line) for line in newest.read_text().splitlines() if line.strip()]
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    return {**info, "version": int(newest.stem)}


def has_deletion_vectors(path: Path) -> bool:
    return any('"deletionVector":{' in f.read_text() for f in (path / "_delta_log").glob("*.json"))


def spark_rows(spark: Any, path: Path) -> list[dict[str, Any]]:
    rows = spark.read.format("delta").load(str(path)).select(*COLUMNS).collect()
    return sorted((r.asDict() for r in rows), key=lambda r: r["id"])


def delta_rs_rows(path: Path) -> list[dict[str, Any]]:
    import deltalake

    table = deltalake.DeltaTable(str(path))
    query = f"select {', '.join(COLUMNS)} from t order by id"
    return pa.table(deltalake.QueryBuilder().register("t", table).execute(query).read_all()).to_pylist()


def each_run(
    tmp_path: Path, runs: list[tuple[int, int, TableChanges]]
) -> Iterator[tuple[int, str, list[TableChanges]]]:
    """Each run's number, its staged batch, and the runs applied once it is (the model's input)."""
    applied: list[TableChanges] = []
    for number, (start, end, changes) in enumerate(runs):
        applied.append(changes)
        yield number, write_batch(tmp_path / "staging", SLOT, start, end, [changes]), list(applied)


def test_small_runs_committed_by_delta_rs_equal_deltas_merge(spark: Any, tmp_path: Path) -> None:
    big = "b" * 3000
    first = TableChanges("public", "docs", DOCS)
    for i in range(1, 41):
        first.insert(100, id=i, title=f"t{i}", body=f"{big}{i}")
    # Delta's MERGE writes deletion vectors into the table the later runs read.
    second = TableChanges("public", "docs", DOCS)
    for i in range(1, 41, 3):
        second.update(200, id=i, title=f"t{i} v2", body=UNCHANGED)
    for i in range(2, 41, 7):
        second.delete(210, id=i)
    third = (
        TableChanges("public", "docs", DOCS)
        .update(300, id=4, title="t4 v3", body=UNCHANGED)  # unchanged TOAST: Delta's value kept
        .update(300, id=5, title="t5 v3", body=None)
        .delete(310, id=6)
        .insert(320, id=2, title="t2 again", body="new body")  # a key deleted by an earlier run
        .update(330, old_key={"id": 7}, id=700, title="t7 moved", body=UNCHANGED)  # key change
        .insert(340, id=41, title="t41", body=None)
    )
    fourth = (
        TableChanges("public", "docs", DOCS)
        .update(400, id=8, title="before the truncate", body=UNCHANGED)
        .truncate(410)
        .insert(420, id=3, title="after the truncate", body="x")
        .update(430, id=3, title="after the truncate, updated", body=UNCHANGED)
    )
    runs = [(90, 110, first), (110, 220, second), (220, 350, third), (350, 440, fourth)]
    light, plain = tmp_path / "light", tmp_path / "plain"
    path_light, path_plain = light / "public" / "docs", plain / "public" / "docs"
    for number, batch, applied in each_run(tmp_path, runs):
        light_options = DELTA_ONLY if number < 2 else MergeOptions()
        got = merge_batches(spark, [batch], str(light), light_options)["tables"]["public.docs"]
        want = merge_batches(spark, [batch], str(plain), DELTA_ONLY)["tables"]["public.docs"]
        expected = Model().apply(*applied).state(COLUMNS)
        assert spark_rows(spark, path_light) == spark_rows(spark, path_plain) == expected, number
        assert delta_rs_rows(path_light) == expected, number
        for name in ("status", "inserted", "updated", "deleted", "truncated", "watermark_lsn"):
            assert got[name] == want[name], (number, name)
        engine = last_commit(path_light)["engineInfo"]
        assert engine.startswith("delta-rs" if number >= 2 else "Apache-Spark"), (number, engine)
        assert last_commit(path_plain)["engineInfo"].startswith("Apache-Spark")
        if number == 1:
            assert has_deletion_vectors(path_light)

    import deltalake

    assert deltalake.DeltaTable(str(path_light)).transaction_version(f"pgdecode:{SLOT}") == 440

    # The same batch again: the transaction id says it is in; no commit.
    version = last_commit(path_light)["version"]
    again = write_batch(tmp_path / "again", SLOT, 350, 440, [fourth])
    result = merge_batches(spark, [again], str(light))["tables"]["public.docs"]
    assert result["status"] == "skipped" and "already applied" in result["reason"]
    assert last_commit(path_light)["version"] == version
    assert spark_rows(spark, path_light) == Model().apply(*applied).state(COLUMNS)

    # delta-rs writes checkpoints of its own (every 100 commits by default): one of this table,
    # with Spark's deletion vectors and column mapping in it, is read by Spark and by pgdecode's
    # log replay (the watermark) as the commits were.
    deltalake.DeltaTable(str(path_light)).create_checkpoint()
    assert (path_light / "_delta_log" / f"{version:020d}.checkpoint.parquet").is_file()
    assert spark_rows(spark, path_light) == Model().apply(*applied).state(COLUMNS)
    assert read_delta_state(spark, str(path_light), app_id(SLOT)).watermark == 440


def test_a_run_delta_rs_writes_alone_sets_no_spark_setting(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark's small-run settings are set when a table first needs a session: not for a run whose
    tables delta-rs writes without one (each setting is a round trip to a Connect server)."""
    from pyspark.sql.conf import RuntimeConfig

    from airflow_provider_pgdecode.spark.merge_sql import SMALL_RUN_CONF

    set_keys: list[str] = []
    original = RuntimeConfig.set

    def recording(self: Any, key: str, value: Any) -> None:
        set_keys.append(key)
        original(self, key, value)

    monkeypatch.setattr(RuntimeConfig, "set", recording)
    first = TableChanges("public", "docs", DOCS)
    for i in range(1, 21):
        first.insert(100, id=i, title=f"t{i}", body=None)
    second = TableChanges("public", "docs", DOCS).update(200, id=3, title="t3 v2", body=UNCHANGED).delete(210, id=4)
    third = TableChanges("public", "docs", DOCS).update(300, id=5, title="t5 v2", body=UNCHANGED)
    path = tmp_path / "delta" / "public" / "docs"
    seen = []
    for number, batch, applied in each_run(tmp_path, [(90, 110, first), (110, 220, second), (220, 310, third)]):
        set_keys.clear()
        merge_batches(spark, [batch], str(tmp_path / "delta"), DELTA_ONLY if number == 2 else MergeOptions())
        seen.append((last_commit(path)["engineInfo"].split("-")[0], set(SMALL_RUN_CONF) & set(set_keys)))
        assert delta_rs_rows(path) == Model().apply(*applied).state(COLUMNS), number
    # created by Spark (then appended to by delta-rs), written by delta-rs alone, then by Delta's MERGE
    assert seen == [("delta", set(SMALL_RUN_CONF)), ("delta", set()), ("Apache", set(SMALL_RUN_CONF))]


def test_tables_delta_rs_must_not_write_go_through_deltas_merge(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = TableChanges("public", "docs", DOCS)
    for i in range(1, 11):
        first.insert(100, id=i, title=f"t{i}", body="b")
    second = TableChanges("public", "docs", DOCS).update(200, id=1, title="changed", body=UNCHANGED)
    # A table feature outside what delta-rs writes correctly (type widening), then a table larger
    # than the bound: each merged by Delta, saying why.
    cases = [
        (MergeOptions(table_properties={"delta.enableTypeWidening": "true"}), "table feature(s) ['typeWidening']"),
        (MergeOptions(light_write_max_bytes=1), "above --light-write-max-bytes 1"),
    ]
    for number, (options, reason) in enumerate(cases):
        root = tmp_path / f"delta{number}"
        merge_batches(spark, [write_batch(tmp_path / f"s{number}", SLOT, 90, 110, [first])], str(root), options)
        batch = write_batch(tmp_path / f"s{number}", SLOT, 110, 210, [second])
        with caplog.at_level(logging.INFO, logger="airflow_provider_pgdecode.spark.merge"):
            result = merge_batches(spark, [batch], str(root), options)["tables"]["public.docs"]
        path = root / "public" / "docs"
        assert result["status"] == "merged" and result["updated"] == 1
        assert last_commit(path)["engineInfo"].startswith("Apache-Spark"), reason
        assert "table public.docs: merged by Delta (" in caplog.text and reason in caplog.text
        assert spark_rows(spark, path) == Model().apply(first, second).state(COLUMNS)


def test_inserts_of_new_keys_are_appended_and_others_merged(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run of inserts only whose keys lie outside every file's key range (a table this run
    creates has none) is appended by delta-rs (no MERGE); an insert of a key inside a file's range (a replay over a row Delta still holds)
    is merged, so the row is replaced, not doubled. An append needs no bound on the run's changes
    (here 2); a run past it that is no append is merged by delta-rs when the driver built its
    source, else by Delta's MERGE (Spark's source is not collected whole). Spark and delta-rs read
    what the model holds."""
    first = TableChanges("public", "docs", DOCS)
    for i in range(10, 60):
        first.insert(100, id=i, title=f"t{i}", body=None)
    fresh = TableChanges("public", "docs", DOCS)  # above and below every file's range
    for i in [*range(100, 140), *range(0, 5)]:
        fresh.insert(200 + i, id=i, title=f"new {i}", body="b")
    again = (
        TableChanges("public", "docs", DOCS)
        .insert(402, id=20, title="t20 again", body="x")
        .insert(404, id=500, title="t500", body=None)
    )
    once_more = TableChanges("public", "docs", DOCS).insert(502, id=21, title="t21 again", body="y")
    once_more.insert(504, id=600, title="t600", body=None)
    runs = [(90, 110, first), (110, 400, fresh), (400, 410, again), (410, 510, once_more)]
    light, plain = tmp_path / "light", tmp_path / "plain"
    path_light, path_plain = light / "public" / "docs", plain / "public" / "docs"
    for number, batch, applied in each_run(tmp_path, runs):
        caplog.clear()
        with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO, logger=MERGE_LOG):
            if number == 3:  # more than the driver reads whole: Spark computes the source
                patch.setattr("airflow_provider_pgdecode.spark.arrow_source.DRIVER_SOURCE_MAX_BYTES", 100)
            got = merge_batches(spark, [batch], str(light), MergeOptions(codegen_min_changes=2))
        got = got["tables"]["public.docs"]
        want = merge_batches(spark, [batch], str(plain), DELTA_ONLY)["tables"]["public.docs"]
        expected = Model().apply(*applied).state(COLUMNS)
        assert spark_rows(spark, path_light) == spark_rows(spark, path_plain) == expected, number
        assert delta_rs_rows(path_light) == expected, number
        for name in ("status", "inserted", "updated", "deleted", "watermark_lsn"):
            assert got[name] == want[name], (number, name)
        operation = last_commit(path_light)["operation"]
        if number == 0:  # created by Spark, its rows appended by delta-rs
            assert "appended by delta-rs" in caplog.text and operation == "WRITE", caplog.text
            assert last_commit(path_light)["engineInfo"].startswith("delta-rs")
            assert last_commit(path_light)["version"] == 1 and got["created"]
        if number == 1:
            assert "appended by delta-rs" in caplog.text and operation == "WRITE", caplog.text
        if number == 2:  # many changes (the bound is 2 here), no append, the source the driver's
            assert "merged by delta-rs" in caplog.text and operation == "MERGE", caplog.text
            assert last_commit(path_light)["engineInfo"].startswith("delta-rs")
        if number == 3:  # ... and with Spark's source: Delta's MERGE
            assert "appended by delta-rs" not in caplog.text and operation == "MERGE", caplog.text
            assert "keys within the table's files: not an append" in caplog.text
            assert last_commit(path_light)["engineInfo"].startswith("Apache-Spark")
    import deltalake

    assert deltalake.DeltaTable(str(path_light)).transaction_version(f"pgdecode:{SLOT}") == 510


def test_the_size_bound_counts_the_files_a_runs_keys_meet(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """delta-rs reads (and may rewrite) only the data files whose key range meets the run's key
    ranges, which its ON condition holds: the bound counts those files. A run into one file of a
    table larger than the bound is merged by delta-rs; a run that meets a file more is merged by
    Delta, saying why, and when it is a large run (here of 2 changes) before the driver reads its
    source whole."""
    import deltalake

    rng = random.Random(5)

    def body() -> str:
        return rng.randbytes(1500).hex()  # incompressible: a file's size follows its rows

    first, later = TableChanges("public", "docs", DOCS), TableChanges("public", "docs", DOCS)
    for i in range(1, 41):
        first.insert(100, id=i, title=f"t{i}", body=body())
        later.insert(200, id=1000 + i, title=f"t{1000 + i}", body=body())  # new keys: appended, a file of its own
    one_file = TableChanges("public", "docs", DOCS).update(300, id=1010, title="changed", body=body())
    both = TableChanges("public", "docs", DOCS).update(400, id=5, title="changed", body=UNCHANGED)
    both.delete(400, id=1020)
    root = tmp_path / "delta"
    path = root / "public" / "docs"
    for start, end, changes in ((90, 110, first), (110, 210, later)):
        merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, start, end, [changes])], str(root))
    table = deltalake.DeltaTable(str(path))
    files = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    key = next(f for f in table.schema().fields if f.name == "id").metadata.get(PHYSICAL_NAME, "id")
    newest = max(files, key=lambda f: f[f"max.{key}"])
    assert newest[f"min.{key}"] == 1001 and all(f[f"max.{key}"] <= 40 for f in files if f is not newest)
    # Under the bound: the file of keys 1001-1040 (and some room for its rewrite); the table is not.
    options = MergeOptions(light_write_max_bytes=newest["size_bytes"] + 1000, codegen_min_changes=2)
    assert sum(f["size_bytes"] for f in files) > options.light_write_max_bytes
    for start, end, changes, writer in ((210, 310, one_file, "delta-rs"), (310, 410, both, "Apache-Spark")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=MERGE_LOG):
            merge_batches(spark, [write_batch(tmp_path / "staging", SLOT, start, end, [changes])], str(root), options)
        assert last_commit(path)["engineInfo"].startswith(writer), caplog.text
    assert "bytes of data files its keys' ranges meet (above --light-write-max-bytes" in caplog.text
    assert "its MERGE source is computed by Spark (delta-rs will not merge it" in caplog.text
    expected = Model().apply(first, later, one_file, both).state(COLUMNS)
    assert spark_rows(spark, path) == delta_rs_rows(path) == expected


def checkpoints(path: Path) -> set[int]:
    return {int(f.name.split(".")[0]) for f in (path / "_delta_log").glob("*.checkpoint.parquet")}


def commit_infos(path: Path) -> dict[int, dict[str, Any]]:
    """Each version's ``commitInfo``."""
    infos = {}
    for f in (path / "_delta_log").glob("*.json"):
        actions = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        infos[int(f.stem)] = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    return infos


def test_delta_rs_writes_a_checkpoint_at_every_tenth_version_or_the_tables_interval(spark: Any, tmp_path: Path) -> None:
    """A table delta-rs commits to gets a checkpoint at each multiple of Delta's default interval
    (10, where delta-rs's own is 100), or of the table's ``delta.checkpointInterval``, so that
    opening it reads few commits; Spark and pgdecode's log replay (the watermark) read the table
    through them."""
    first = TableChanges("public", "docs", DOCS)
    for i in range(1, 21):
        first.insert(100, id=i, title=f"t{i}", body="b")
    runs = [(90, 110, first)]
    for n in range(16):
        update = TableChanges("public", "docs", DOCS).update(115 + 10 * n, id=n + 1, title=f"v{n}", body=UNCHANGED)
        runs.append((110 + 10 * n, 120 + 10 * n, update))
    root = tmp_path / "delta"
    path = root / "public" / "docs"
    for number, batch, _ in each_run(tmp_path, runs):
        merge_batches(spark, [batch], str(root))
        if number == 10:  # the table's own interval from here on
            spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.checkpointInterval' = '4')")
    infos = commit_infos(path)
    by_delta_rs = {v for v, info in infos.items() if info.get("engineInfo", "").startswith("delta-rs")}
    altered = next(v for v, info in infos.items() if info.get("operation") == "SET TBLPROPERTIES")
    assert len(by_delta_rs) == len(runs) and {10, 20} & by_delta_rs, sorted(by_delta_rs)
    made = checkpoints(path)
    for v in sorted(by_delta_rs):
        assert (v in made) is (v % (10 if v < altered else 4) == 0), (v, altered, sorted(made))
    assert any(v % 4 == 0 and v % 10 and v > altered for v in by_delta_rs)
    expected = Model().apply(*(changes for _, _, changes in runs)).state(COLUMNS)
    assert spark_rows(spark, path) == delta_rs_rows(path) == expected
    assert read_delta_state(spark, str(path), app_id(SLOT)).watermark == runs[-1][1]
