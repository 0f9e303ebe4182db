"""A merge that fails: no Delta table is left behind by a failed first write, and running out of
memory is reported as such, with the memory settings to change (not as a bug in Spark)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_pgdecode.cycle.merge import MergeJob
from airflow_provider_pgdecode.errors import DeltaTableError, MergeOutOfMemoryError
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.spark import merge_job, table_parking
from airflow_provider_pgdecode.spark.merge_job import merge_batches, out_of_memory_error
from tests.spark.read_only import immutable_directory
from tests.spark.staged import TableChanges, write_batch

SLOT = "pgdecode_failures"
COLUMNS = [("id", "integer", pa.int32()), ("note", "text", pa.string())]

SPARK_OOM = (
    "An error occurred while calling o123.execute.\n: org.apache.spark.SparkException: [INTERNAL_ERROR] The "
    "Spark SQL phase execution failed with an internal error. You hit a bug in Spark or the Spark plugins you "
    "use. Please, report this bug to the corresponding communities or vendors, and provide the full stack trace."
    "\n\tat org.apache.spark.SparkException$.internalError(SparkException.scala:107)\n"
    "Caused by: java.lang.OutOfMemoryError: Java heap space\n\tat java.base/java.util.Arrays.copyOf(Arrays.java:3537)"
)


class Boom(RuntimeError):
    pass


def _fail(*args, **kwargs):
    raise Boom("the first write failed")


@pytest.mark.spark
@pytest.mark.parametrize(
    ("first_write", "update", "light_write_max_bytes"),
    [
        ("append_inserts", False, 0),  # Spark appends the inserts into the table it created
        ("run_merge", False, None),  # the source built on the driver: delta-rs appends it
        ("run_merge", True, None),  # not inserts only: the first write is a MERGE
    ],
    ids=["append_inserts", "delta_rs_append", "run_merge"],
)
def test_a_failed_first_merge_leaves_no_delta_table(
    spark, tmp_path: Path, monkeypatch, first_write: str, update: bool, light_write_max_bytes: int | None
) -> None:
    orders = TableChanges("public", "orders", COLUMNS).insert(100, id=1, note="a")
    if update:
        orders.update(110, id=1, note="b")
    batch = write_batch(tmp_path / "staging", SLOT, 10, 200, [orders])
    light = {} if light_write_max_bytes is None else {"light_write_max_bytes": light_write_max_bytes}
    options = merge_job.MergeOptions(**light)
    monkeypatch.setattr(merge_job, first_write, _fail)
    delta_root = tmp_path / "delta"
    # A write Spark refuses while the session works parks the table (docs/merge.md)...
    parked = merge_batches(spark, [batch], str(delta_root), options)["tables"]["public.orders"]
    assert parked["status"] == "parked" and parked["reason"] == "Boom: the first write failed"
    assert not (delta_root / "public" / "orders").exists()
    with pytest.raises(Boom):  # ... or, without parking, stops the run
        merge_batches(spark, [batch], str(delta_root), merge_job.MergeOptions(park=False, **light))
    assert not (delta_root / "public" / "orders").exists()

    monkeypatch.undo()  # the same batch merges once the cause is gone
    summary = merge_batches(spark, [batch], str(delta_root), options)
    assert summary["tables"]["public.orders"]["status"] == "merged"
    rows = spark.read.format("delta").load(str(delta_root / "public" / "orders")).collect()
    assert [(r["id"], r["note"]) for r in rows] == [(1, "b" if update else "a")]


@pytest.mark.spark
def test_a_failed_merge_into_an_existing_table_keeps_it(spark, tmp_path: Path, monkeypatch) -> None:
    delta_root = tmp_path / "delta"
    first = write_batch(
        tmp_path / "staging", SLOT, 10, 200, [TableChanges("public", "kept", COLUMNS).insert(100, id=1)]
    )
    merge_batches(spark, [first], str(delta_root))
    second = write_batch(
        tmp_path / "staging", SLOT, 200, 300, [TableChanges("public", "kept", COLUMNS).update(250, id=1, note="x")]
    )
    monkeypatch.setattr(merge_job, "run_merge", _fail)
    assert merge_batches(spark, [second], str(delta_root))["parked"] == ["public.kept"]
    assert [r["id"] for r in spark.read.format("delta").load(str(delta_root / "public" / "kept")).collect()] == [1]


def test_out_of_memory_is_named_with_the_memory_settings() -> None:
    error = out_of_memory_error(Exception(SPARK_OOM), {"spark.driver.memory": "1g"})
    assert isinstance(error, MergeOutOfMemoryError)
    message = str(error)
    assert "ran out of memory (java.lang.OutOfMemoryError)" in message
    assert "spark.driver.memory (now 1g" in message and "spark.executor.memory" in message
    assert "driver_memory" in message and "max_value_bytes" in message and "not a bug" in message
    assert out_of_memory_error(Exception("[INTERNAL_ERROR] a real bug"), {}) is None


def test_the_merge_operator_reports_out_of_memory_without_retry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    batch = write_batch(tmp_path / "staging", SLOT, 10, 200, [TableChanges("public", "t", COLUMNS).insert(100, id=1)])

    class OutOfMemoryHook:
        def __init__(self, summary_path: str) -> None:
            self.summary_path = summary_path

        def submit(self, application: str) -> None:  # what merge_job.main writes, then a failed exit
            refusal = {"error": "MergeOutOfMemoryError", "message": str(out_of_memory_error(Exception(SPARK_OOM), {}))}
            Path(self.summary_path).write_text(json.dumps(refusal), encoding="utf-8")
            raise AirflowException("Cannot execute: spark-submit ... Error code is: 3.")

    monkeypatch.setattr(
        MergeJob, "get_hook", lambda self, batches, path=None, settings=None, context=None: OutOfMemoryHook(path)
    )
    operator = PgDecodeMergeOperator(
        task_id="merge", batch_paths=batch, delta_root=str(tmp_path / "delta"), driver_memory="2g", asset_alias=None
    )
    with pytest.raises(AirflowFailException) as err:
        operator.execute({})
    assert "ran out of memory" in str(err.value) and "driver_memory='2g'" in str(err.value)
    assert "bug in Spark" not in str(err.value).replace("not a bug in Spark", "")


def test_the_job_exits_3_with_the_out_of_memory_refusal(tmp_path: Path, monkeypatch, capsys) -> None:
    from airflow_provider_pgdecode.spark import session

    class Conf:
        def getAll(self):  # noqa: N802 - SparkConf's name
            return [("spark.driver.memory", "512m"), ("spark.master", "local[1]")]

    class FakeSpark:
        class sparkContext:  # noqa: N801 - SparkSession's attribute
            @staticmethod
            def getConf():  # noqa: N802
                return Conf()

        stopped = False

        def stop(self) -> None:
            FakeSpark.stopped = True

    def out_of_memory(*args, **kwargs):
        raise Exception(SPARK_OOM)

    monkeypatch.setattr(session, "build_spark_session", lambda master=None, **kwargs: FakeSpark())
    monkeypatch.setattr(merge_job, "merge_batches", out_of_memory)
    summary = tmp_path / "summary.json"
    code = merge_job.main(["--delta-root", str(tmp_path), "--batch", str(tmp_path), "--summary-json", str(summary)])
    refusal = json.loads(summary.read_text(encoding="utf-8"))
    assert code == 3 and FakeSpark.stopped
    assert refusal["error"] == "MergeOutOfMemoryError" and "spark.driver.memory (now 512m" in refusal["message"]
    assert "MergeOutOfMemoryError" in capsys.readouterr().err


@pytest.mark.spark
def test_a_read_only_delta_table_is_parked_while_the_other_table_merges(spark, tmp_path: Path) -> None:
    """A real refusal, nothing patched: the table's _delta_log cannot take a new commit (immutable,
    which binds root too). That table is parked with the filesystem's reason, the other merges;
    writable again, the same batch merges it exactly once."""
    delta_root = tmp_path / "delta"
    first = write_batch(
        tmp_path / "staging",
        SLOT,
        10,
        200,
        [TableChanges("public", n, COLUMNS).insert(100, id=1, note="a") for n in ("ro", "rw")],
    )
    merge_batches(spark, [first], str(delta_root))
    log = delta_root / "public" / "ro" / "_delta_log"
    second = write_batch(
        tmp_path / "staging",
        SLOT,
        200,
        300,
        [TableChanges("public", n, COLUMNS).update(250, id=1, note="b") for n in ("ro", "rw")],
    )
    with immutable_directory(log):
        summary = merge_batches(spark, [second], str(delta_root))
    assert summary["parked"] == ["public.ro"]
    assert summary["tables"]["public.rw"]["status"] == "merged"
    # The innermost Java exception, not py4j's "An error occurred while calling o60.sql.".
    why = summary["tables"]["public.ro"]["reason"]
    assert why.startswith("FileNotFoundException: ") and str(log) in why and "Operation not permitted" in why, why

    def read(name: str) -> list[tuple[int, str]]:
        rows = spark.read.format("delta").load(str(delta_root / "public" / name)).collect()
        return [(r["id"], r["note"]) for r in rows]

    assert read("ro") == [(1, "a")] and read("rw") == [(1, "b")]

    again = merge_batches(spark, [second], str(delta_root))  # writable again: the parked table's turn
    assert again["tables"]["public.ro"]["status"] == "merged" and again["tables"]["public.rw"]["status"] == "skipped"
    assert read("ro") == [(1, "b")] and read("rw") == [(1, "b")]


def test_the_parked_reason_is_the_innermost_java_exception_in_one_line() -> None:
    class Py4JJavaError(Exception):
        pass

    jvm = Py4JJavaError(
        "An error occurred while calling o60.sql.\n: org.apache.spark.SparkException: Job aborted.\n"
        "\tat org.apache.spark.X.y(X.scala:1)\nCaused by: java.io.IOException: disk quota exceeded\n\tat a.B.c(B.java:2)"
    )
    assert table_parking.reason(jvm) == "IOException: disk quota exceeded"
    assert table_parking.reason(RuntimeError("plain\nsecond line")) == "RuntimeError: plain"
    assert table_parking.reason(DeltaTableError("table t: damaged")) == "table t: damaged"
    assert table_parking.reason(RuntimeError("x" * 700)).endswith("…")
