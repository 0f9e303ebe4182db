"""The ensure-slot, extract and confirm operators against a real PostgreSQL, checkpoints through XCom."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.capture import extract as capture_extract
from airflow_provider_pgdecode.capture import reconcile as reconcile_module
from airflow_provider_pgdecode.cycle import extract as cycle_extract
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeEnsureSlotOperator,
    PgDecodeExtractOperator,
    PgDecodeMergeOperator,
)
from airflow_provider_pgdecode.postgres.slot import SlotClient

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def module_database(pg_cluster: Any) -> str:
    """A database of this module's own: the extract's default selection (every table) sees only
    the tables these tests create, not the keyless tables other modules leave in pgdecode_test."""
    name = f"ops_{uuid.uuid4().hex[:10]}"
    pg_cluster.create_database(name)
    return name


@pytest.fixture(scope="module")
def pg_dsn(pg_cluster: Any, module_database: str) -> str:
    return str(pg_cluster.dsn(module_database))


@pytest.fixture
def source_conn(pg_cluster: Any, module_database: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json(module_database))
    return "pgdecode_default"


def new_table(conn: psycopg.Connection[Any]) -> str:
    name = f"op_{uuid.uuid4().hex[:10]}"
    conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
    return name


def insert(conn: psycopg.Connection[Any], table: str, *ids: int) -> None:
    for i in ids:
        conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (i, f"v{i}"))


def confirmed(conn: psycopg.Connection[Any], slot: str) -> Lsn:
    row = conn.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    assert row is not None
    return Lsn.parse(row[0])


def staged_ids(summary: dict[str, Any], table: str) -> list[int]:
    return sorted(pq.read_table(Path(summary["path"]) / "tables" / "public" / table).column("id").to_pylist())


def ops(slot: str, root: Path) -> tuple[PgDecodeExtractOperator, PgDecodeConfirmOperator]:
    extract = PgDecodeExtractOperator(task_id="extract", slot_name=slot, staging_root=str(root))
    confirm = PgDecodeConfirmOperator(task_id="confirm", slot_name=slot, batch_path="(set per run)")
    return extract, confirm


def run_confirm(confirm: PgDecodeConfirmOperator, summary: dict[str, Any], make_context: Any) -> dict[str, Any]:
    confirm.batch_path = summary["path"]
    return confirm.execute(make_context(merge={"batches": [summary["path"]], "skipped": []}))


def test_two_runs_carry_the_checkpoint_and_a_pending_prepared_transaction(
    source_conn: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    make_context: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = new_table(pg_conn)
    ensure = PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot_name, two_phase=True)
    info = ensure.execute(make_context())
    assert info["slot_name"] == slot_name and info["plugin"] == "test_decoding" and info["two_phase"] is True
    assert ensure.execute(make_context())["confirmed_flush_lsn"] == info["confirmed_flush_lsn"]  # idempotent

    insert(pg_conn, table, 1, 2)
    gid = f"g_{uuid.uuid4().hex[:8]}"
    pg_conn.execute("BEGIN")
    insert(pg_conn, table, 3)
    pg_conn.execute(f"PREPARE TRANSACTION '{gid}'")

    extract, confirm = ops(slot_name, tmp_path)
    ctx = make_context()
    first = extract.execute(ctx)
    assert ctx["ti"].pulls == [  # the slot's own checkpoint first, then the task's return value
        {
            "task_ids": "confirm",
            "key": f"pgdecode_checkpoint:{slot_name}",
            "include_prior_dates": True,
            "map_indexes": -1,
        },
        {"task_ids": "confirm", "key": "return_value", "include_prior_dates": True, "map_indexes": -1},
    ]
    json.dumps(first)  # XCom values must be JSON-able
    assert first["checkpoint"] == "start"
    assert first["slot"] == slot_name and Path(first["path"]).is_dir()
    assert first["tables"] == {f"public.{table}": 2}
    assert first["has_changes"] is True
    assert [p["gid"] for p in first["prepared_pending"]] == [gid]
    assert Lsn.parse(first["start_lsn"]) < Lsn.parse(first["end_lsn"]) <= Lsn.parse(first["ceiling_lsn"])
    assert staged_ids(first, table) == [1, 2]

    confirm_ctx = make_context(merge={"batches": [first["path"]], "skipped": []})
    confirm.batch_path = first["path"]
    checkpoint = confirm.execute(confirm_ctx)
    assert confirm_ctx["ti"].xcoms[f"pgdecode_checkpoint:{slot_name}"] == checkpoint  # per-slot key
    json.dumps(checkpoint)
    assert checkpoint["slot"] == slot_name and checkpoint["end_lsn"] == first["end_lsn"]
    assert checkpoint["batch_path"] == first["path"]
    assert [p["gid"] for p in checkpoint["prepared_pending"]] == [gid]
    assert confirmed(pg_conn, slot_name) == Lsn.parse(first["end_lsn"])

    pg_conn.execute(f"COMMIT PREPARED '{gid}'")
    insert(pg_conn, table, 4)
    # The checkpoint meets the slot once per run: the task reconciles and logs, extract_batch takes its decision.
    decisions: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        decision = reconcile_module.reconcile(*args, **kwargs)
        decisions.append(decision.action)
        return decision

    monkeypatch.setattr(capture_extract, "reconcile", counted)
    monkeypatch.setattr(cycle_extract, "reconcile", counted)
    second = extract.execute(make_context(confirm=checkpoint))
    assert decisions == ["resume"]
    assert second["checkpoint"] == "resume"
    assert second["start_lsn"] == first["end_lsn"]
    assert second["prepared_pending"] == []
    # The prepared transaction arrives once, with its COMMIT PREPARED; nothing from run 1 again.
    assert staged_ids(second, table) == [3, 4]
    checkpoint2 = run_confirm(confirm, second, make_context)
    assert checkpoint2["prepared_pending"] == [] and confirmed(pg_conn, slot_name) == Lsn.parse(second["end_lsn"])


def test_rerun_after_a_failed_merge_and_a_lost_confirm_xcom(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    extract, confirm = ops(slot_name, tmp_path)
    insert(pg_conn, table, 1)
    first = extract.execute(make_context())

    # The merge failed and the run is retried: the same range gives the same batch, nothing lost.
    again = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path), upto_lsn=first["ceiling_lsn"]
    ).execute(make_context())
    assert again == first
    checkpoint1 = run_confirm(confirm, first, make_context)

    insert(pg_conn, table, 2)
    second = extract.execute(make_context(confirm=checkpoint1))
    # This confirm advances the slot, but its XCom is lost: the next run still sees checkpoint1.
    run_confirm(confirm, second, make_context)

    insert(pg_conn, table, 3)
    third = extract.execute(make_context(confirm=checkpoint1))
    assert third["checkpoint"] == "adopted"
    assert third["start_lsn"] == second["end_lsn"]
    assert staged_ids(third, table) == [3]

    # With no XCom at all (history cleared), the batch ending at the slot is adopted too.
    run_confirm(confirm, third, make_context)
    insert(pg_conn, table, 4)
    fourth = extract.execute(make_context())
    assert fourth["checkpoint"] == "adopted" and fourth["start_lsn"] == third["end_lsn"]
    assert staged_ids(fourth, table) == [4]


def test_slot_behind_the_checkpoint_resumes_without_duplicates(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    extract, confirm = ops(slot_name, tmp_path)
    insert(pg_conn, table, 1, 2)
    first = extract.execute(make_context())
    # A checkpoint whose slot advance never took effect (e.g. lost in a server crash).
    checkpoint = Checkpoint.from_manifest(BatchManifest.read(first["path"])).to_dict()
    before = confirmed(pg_conn, slot_name)
    assert before < Lsn.parse(checkpoint["end_lsn"])

    insert(pg_conn, table, 3)
    second = extract.execute(make_context(confirm=checkpoint))
    assert second["checkpoint"] == "slot_behind"
    assert second["start_lsn"] == first["end_lsn"]
    assert staged_ids(second, table) == [3]
    run_confirm(confirm, second, make_context)
    assert confirmed(pg_conn, slot_name) == Lsn.parse(second["end_lsn"])


def test_slot_ahead_of_the_checkpoint_fails_loudly(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        extract, confirm = ops(slot_name, tmp_path)
        insert(pg_conn, table, 1)
        checkpoint = run_confirm(confirm, extract.execute(make_context()), make_context)
        insert(pg_conn, table, 2)
        # Someone else consumes the slot.
        hook.advance_slot(slot_name, hook.current_flush_lsn())
    batches = list_batches(tmp_path, slot_name)
    with pytest.raises(AirflowFailException) as caught:
        extract.execute(make_context(confirm=checkpoint))
    message = str(caught.value)
    assert f"replication slot {slot_name!r} is at" in message
    assert f"ahead of the last merged checkpoint {checkpoint['end_lsn']}" in message
    assert "another reader" in message and "pgdecode_backfill" in message
    assert list_batches(tmp_path, slot_name) == batches  # nothing staged


def test_missing_slot_and_wrong_plugin_fail_loudly(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    extract = PgDecodeExtractOperator(task_id="extract", slot_name=slot_name, staging_root=str(tmp_path))
    with pytest.raises(AirflowFailException, match=f"replication slot '{slot_name}' does not exist"):
        extract.execute(make_context())

    PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot_name).execute(make_context())
    wrong = PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot_name, plugin="pgoutput")
    with pytest.raises(AirflowFailException, match="uses output plugin 'test_decoding', but 'pgoutput' was asked"):
        wrong.execute(make_context())
    two_phase = PgDecodeEnsureSlotOperator(task_id="ensure", slot_name=slot_name, two_phase=True)
    with pytest.raises(AirflowFailException, match="two_phase=False"):
        two_phase.execute(make_context())
    as_pgoutput = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path), plugin="pgoutput", publication="p"
    )
    with pytest.raises(
        AirflowFailException,
        match="uses output plugin 'test_decoding'.*Set the DAG's plugin parameter to 'test_decoding'",
    ):
        as_pgoutput.execute(make_context())
    assert list_batches(tmp_path, slot_name) == []


def test_confirm_refuses_a_batch_the_merge_did_not_handle(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    insert(pg_conn, table, 1)
    extract, confirm = ops(slot_name, tmp_path)
    summary = extract.execute(make_context())
    confirm.batch_path = summary["path"]
    before = confirmed(pg_conn, slot_name)

    with pytest.raises(AirflowFailException, match="left no result in this DAG run"):
        confirm.execute(make_context())
    with pytest.raises(AirflowFailException, match="not among the batches"):
        confirm.execute(make_context(merge={"batches": [str(tmp_path / "other")], "skipped": []}))
    other_slot = PgDecodeConfirmOperator(task_id="confirm", slot_name="another_slot", batch_path=summary["path"])
    with pytest.raises(AirflowFailException, match="belongs to replication slot"):
        other_slot.execute(make_context(merge={"batches": [summary["path"]]}))
    assert confirmed(pg_conn, slot_name) == before  # never advanced

    unchecked = PgDecodeConfirmOperator(
        task_id="confirm", slot_name=slot_name, batch_path=summary["path"], merge_task_id=None
    )
    assert unchecked.execute(make_context())["end_lsn"] == summary["end_lsn"]
    assert confirmed(pg_conn, slot_name) == Lsn.parse(summary["end_lsn"])
    # Confirming again (a retried task) never moves the slot backwards.
    assert unchecked.execute(make_context())["end_lsn"] == summary["end_lsn"]
    assert confirmed(pg_conn, slot_name) == Lsn.parse(summary["end_lsn"])


def test_a_batch_without_changes_skips_the_merge_and_still_advances_the_slot(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
        pg_conn.execute("SELECT txid_current()")  # an empty transaction
        heartbeat = hook.emit_heartbeat()
    extract, confirm = ops(slot_name, tmp_path)
    summary = extract.execute(make_context())
    assert summary["has_changes"] is False and summary["tables"] == {}
    assert Lsn.parse(summary["end_lsn"]) >= heartbeat

    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=summary["path"],
        delta_root=str(tmp_path / "delta"),
        spark_binary="/nonexistent/spark-submit",  # proves that nothing is submitted
    )
    result = merge.execute(make_context())
    assert result["batches"] == [] and result["skipped"] == [summary["path"]]
    assert result["end_lsn"] == summary["end_lsn"] and result["summary"] is None

    confirm.batch_path = summary["path"]
    confirm.execute(make_context(merge=result))
    assert confirmed(pg_conn, slot_name) == Lsn.parse(summary["end_lsn"])


def test_previous_checkpoint_is_the_latest_even_when_airflow_returns_several(make_context: Any) -> None:
    older = {"slot": "s1", "end_lsn": "0/9", "prepared_pending": [], "batch_path": "/b/1"}
    newer = {"slot": "s1", "end_lsn": "0/10", "prepared_pending": [], "batch_path": "/b/2"}  # '0/10' < '0/9' as text
    extract = PgDecodeExtractOperator(task_id="extract", slot_name="s1", staging_root="/nonexistent")
    assert extract.previous_checkpoint(make_context(confirm=[newer, older])) == newer
    assert extract.previous_checkpoint(make_context(confirm=newer)) == newer
    assert extract.previous_checkpoint(make_context()) is None
    explicit = PgDecodeExtractOperator(task_id="extract", slot_name="s1", staging_root="/x", checkpoint=older)
    ctx = make_context(confirm=newer)
    assert explicit.previous_checkpoint(ctx) == older and ctx["ti"].pulls == []
    unchained = PgDecodeExtractOperator(task_id="extract", slot_name="s1", staging_root="/x", checkpoint_task_id=None)
    assert unchained.previous_checkpoint(make_context(confirm=newer)) is None


def test_on_kill_cancels_a_running_extract_and_stages_nothing(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    import threading
    import time

    table = new_table(pg_conn)
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 300000) g")
    extract, _ = ops(slot_name, tmp_path)
    extract.on_kill()  # before execute: nothing to cancel
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["summary"] = extract.execute(make_context())
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not list((tmp_path / slot_name).glob(".tmp-*")):  # the peek has started
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    # A cancel only stops a statement the server is running (the peek decodes the whole range
    # before the first rows arrive); one that lands between two statements does nothing, so
    # keep killing until the task gives up, as Airflow's own kill would end the process anyway.
    while thread.is_alive() and time.monotonic() < deadline:
        extract.on_kill()
        thread.join(0.02)
    thread.join(30)
    assert "summary" not in outcome, "the extract finished before it was cancelled"
    assert "canceling statement due to user request" in str(outcome["error"])
    assert list((tmp_path / slot_name).iterdir()) == []  # no batch, no temporary directory


@pytest.fixture
def own_database(pg_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A database of its own as ``pgdecode_default``: ``tables=[]`` sees only this test's tables."""
    name = f"sel_{uuid.uuid4().hex[:10]}"
    pg_cluster.create_database(name)
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json(name))
    conn = pg_cluster.connect(name)
    yield conn
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"
    )
    conn.close()


def test_without_a_table_list_every_table_is_loaded_or_named_in_an_error(
    own_database: psycopg.Connection[Any], tmp_path: Path, make_context: Any
) -> None:
    conn, slot = own_database, f"sel_{uuid.uuid4().hex[:8]}"
    keyed = new_table(conn)
    conn.execute("CREATE TABLE history (at int, what text)")  # no key, REPLICA IDENTITY DEFAULT
    conn.execute("CREATE TABLE full_rows (a int, b text); ALTER TABLE full_rows REPLICA IDENTITY FULL")
    conn.execute("CREATE TABLE pk_nothing (id int PRIMARY KEY); ALTER TABLE pk_nothing REPLICA IDENTITY NOTHING")
    SlotClient(conn).create(slot)
    insert(conn, keyed, 1, 2)
    conn.execute("INSERT INTO history VALUES (1, 'a'), (1, 'a')")
    conn.execute("INSERT INTO full_rows VALUES (1, null)")
    start = confirmed(conn, slot)

    # One error names every table that cannot be loaded, why, and the ways forward; the slot is not read.
    extract = PgDecodeExtractOperator(task_id="extract", slot_name=slot, staging_root=str(tmp_path))
    with pytest.raises(AirflowFailException) as info:
        extract.execute(make_context())
    message = str(info.value)
    assert "2 table(s) cannot be loaded" in message and "before reading or creating the slot" in message
    assert "public.history: REPLICA IDENTITY DEFAULT and no primary key" in message
    assert "public.pk_nothing: REPLICA IDENTITY NOTHING and a primary key: ALTER TABLE public.pk_nothing" in message
    for way in ("add a primary key", "REPLICA IDENTITY FULL", '"mode": "append_only"', "exclude_tables"):
        assert way in message
    assert "full_rows" not in message and keyed not in message
    assert list_batches(tmp_path, slot) == [] and confirmed(conn, slot) == start

    # append_only for the history, exclude_tables for the other: everything else is staged.
    extract = PgDecodeExtractOperator(
        task_id="extract",
        slot_name=slot,
        staging_root=str(tmp_path),
        exclude_tables=["public.pk_nothing"],
        table_options={"public.history": {"mode": "append_only"}},
    )
    summary = extract.execute(make_context())
    assert summary["tables"] == {f"public.{keyed}": 2, "public.full_rows": 1, "public.history": 2}
    manifest = BatchManifest.read(summary["path"])
    modes = {t.table: (t.mode, t.key_source) for t in manifest.tables}
    assert modes == {
        keyed: ("merge", "primary key"),
        "full_rows": ("merge", "all columns"),
        "history": ("append_only", None),
    }


def test_changes_of_tables_outside_the_list_are_counted_and_named(
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    source_conn: str,
    tmp_path: Path,
    make_context: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    keyed = new_table(pg_conn)
    other = new_table(pg_conn)
    SlotClient(pg_conn).create(slot_name)
    insert(pg_conn, keyed, 1, 2)
    insert(pg_conn, other, 1)
    extract = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path), tables=[f"public.{keyed}"]
    )
    summary = extract.execute(make_context())
    assert staged_ids(summary, keyed) == [1, 2]
    manifest = BatchManifest.read(summary["path"])
    assert manifest.skipped["excluded_table_changes"] == 1
    assert manifest.excluded_tables == [f"public.{other}"]
    assert f"1 change(s) to tables outside the list were not staged: public.{other}" in capsys.readouterr().out


def test_a_table_without_a_key_fails_the_extract_without_a_retry(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    name = f"op_nokey_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"CREATE TABLE {name} (id int, v text)")  # no primary key, REPLICA IDENTITY DEFAULT
    with PgDecodeHook() as hook:
        hook.ensure_slot(slot_name)
    pg_conn.execute(f"INSERT INTO {name} VALUES (1, 'a')")
    extract = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot_name, staging_root=str(tmp_path), tables=[f"public.{name}"]
    )
    # AirflowFailException, not a plain error: Airflow does not retry it.
    try:
        with pytest.raises(AirflowFailException, match=rf"table public\.{name} has no primary key.*Add a primary key"):
            extract.execute(make_context())
        assert list_batches(tmp_path, slot_name) == []  # nothing half-staged
    finally:
        pg_conn.execute(f"DROP TABLE {name}")  # the module's other tests load every table


def test_a_table_pattern_is_matched_when_the_task_runs(
    own_database: psycopg.Connection[Any], tmp_path: Path, make_context: Any
) -> None:
    """``tables`` patterns are expanded by the extract against the catalog of the run: a table
    created after the operator was built is staged, and a pattern matching nothing fails the task
    by name before the slot is read."""
    conn, slot = own_database, f"pat_{uuid.uuid4().hex[:8]}"
    conn.execute("CREATE TABLE order_items (id int PRIMARY KEY, v text); CREATE TABLE other (id int PRIMARY KEY)")
    extract = PgDecodeExtractOperator(
        task_id="extract",
        slot_name=slot,
        staging_root=str(tmp_path),
        tables=["public.order_*"],
        exclude_tables=["public.order_archive"],
    )
    SlotClient(conn).create(slot)
    conn.execute(
        "CREATE TABLE order_notes (id int PRIMARY KEY, v text); CREATE TABLE order_archive (id int PRIMARY KEY)"
    )
    for table in ("order_items", "order_notes", "other", "order_archive"):
        conn.execute(f"INSERT INTO {table} (id) VALUES (1), (2)")
    summary = extract.execute(make_context())
    assert summary["tables"] == {"public.order_items": 2, "public.order_notes": 2}

    missing = PgDecodeExtractOperator(
        task_id="extract", slot_name=slot, staging_root=str(tmp_path), tables=["public.orders", "public.ordr_*"]
    )
    start = confirmed(conn, slot)
    with pytest.raises(AirflowFailException, match=r"table pattern\(s\) 'public.ordr_\*' match no table"):
        missing.execute(make_context())
    assert confirmed(conn, slot) == start
