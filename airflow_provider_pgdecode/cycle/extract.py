"""One extract: peek a slot from the reconciled checkpoint up to a ceiling, stage the changes as one
batch, return its summary (:class:`~airflow_provider_pgdecode.operators.extract.PgDecodeExtractOperator`
and the drain call :func:`extract_once`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from airflow.sdk import Context

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.options import as_table_options
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.capture.bounds import BatchBounds
from airflow_provider_pgdecode.capture.reconcile import coerce_checkpoint, reconcile
from airflow_provider_pgdecode.capture.recovery import (
    DEFAULT_MAX_PER_DAY,
    FAIL,
    RESNAPSHOT,
    check_policy,
    lost_reason,
    recover_lost_slot,
)
from airflow_provider_pgdecode.capture.table_snapshot import added_tables
from airflow_provider_pgdecode.capture.tables import as_table_names, later_tables, resolve_tables
from airflow_provider_pgdecode.cycle import KillSwitch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.health import check_readable
from airflow_provider_pgdecode.postgres.slot import SlotInfo
from airflow_provider_pgdecode.utils import metrics
from airflow_provider_pgdecode.utils.config import pgdecode_bool, pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.xcom import checkpoint_xcom_key, latest_xcom


@dataclass(frozen=True)
class ExtractArguments:
    """An extract task's rendered arguments (the operator's parameters of the same names)."""

    OPERATOR: ClassVar[str] = "PgDecodeExtractOperator"

    slot_name: str
    staging_root: str
    plugin: str
    postgres_conn_id: str
    checkpoint_task_id: str | Sequence[str] | None
    checkpoint: Mapping[str, Any] | None
    upto_lsn: str | None
    tables: Sequence[str] | None
    exclude_tables: Sequence[str] | None
    publication: str | None
    table_options: Mapping[str, Mapping[str, Any]] | str | None
    extract_options: Mapping[str, Any]
    storage_conn_id: str | None
    max_batch_changes: int | str | None
    max_batch_wal_bytes: int | str | None
    on_slot_lost: str = FAIL
    max_slot_recoveries_per_day: int | str = DEFAULT_MAX_PER_DAY

    def bounds(self) -> BatchBounds:
        """The batch bounds; ``None`` or an empty value lifts one."""
        return BatchBounds(optional_count(self.max_batch_changes), optional_count(self.max_batch_wal_bytes))


def log_manifest(log: Any, manifest: BatchManifest, seconds: float | None = None) -> None:
    """Log a batch's LSN range, transactions, rows per table and pending prepared transactions."""
    start, end = Lsn.parse(manifest.start_lsn), Lsn.parse(manifest.end_lsn)
    rate = f", {manifest.changes / seconds:.0f} changes/s" if seconds else ""
    log.info(
        "Batch %s: LSN %s to %s (%d bytes of WAL, ceiling %s): %d transactions, %d changes in %d table(s)%s",
        manifest.path,
        start,
        end,
        int(end) - int(start),
        manifest.ceiling_lsn,
        manifest.transactions,
        manifest.changes,
        len(manifest.tables),
        rate,
    )
    for table in manifest.tables:
        log.info(
            "  %s.%s: %d rows (%d inserts, %d updates, %d deletes, %d truncates), commit LSN %s to %s",
            table.schema,
            table.table,
            table.rows,
            table.inserts,
            table.updates,
            table.deletes,
            table.truncates,
            table.min_commit_lsn,
            table.max_commit_lsn,
        )
    if manifest.messages:
        log.info("  logical decoding messages: %d", manifest.messages.get("rows", 0))
    for entry in manifest.prepared_pending:
        log.info(
            "  prepared transaction %r (xid %s) still pending since %s: carried to the next batch",
            entry.get("gid"),
            entry.get("xid"),
            entry.get("prepare_lsn"),
        )
    for chunk in manifest.snapshot_chunks:
        if chunk.get("kind") == "truncate":
            log.info(
                "  snapshot %s of %s: TRUNCATE at low watermark %s", chunk["request"], chunk["table"], chunk["lsn"]
            )
        else:
            log.info(
                "  snapshot %s of %s: chunk %d, %d rows at watermark %s (%d placed before changes the chunk missed)",
                chunk["request"],
                chunk["table"],
                chunk["chunk"],
                chunk["rows"],
                chunk["lsn"],
                chunk.get("moved_rows", 0),
            )
    for entry in manifest.prepared_committed:
        log.info("  prepared transaction %r committed at %s", entry.get("gid"), entry.get("commit_lsn"))
    for entry in manifest.prepared_rolled_back:
        log.info("  prepared transaction %r rolled back at %s: not staged", entry.get("gid"), entry.get("lsn"))


def optional_count(value: int | str | None) -> int | None:
    """A bound from a DAG param: an integer, or ``None``/``""``/``"null"`` for no bound."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value  # type: ignore[return-value]  # BatchBounds names anything else


def _has_end(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value.get("end_lsn"))


def previous_checkpoint(arguments: ExtractArguments, context: Context, log: Any) -> Mapping[str, Any] | None:
    """The explicit ``checkpoint``, else the latest checkpoint the ``checkpoint_task_id`` task(s)
    left in XCom (of several, the one that ends last)."""
    if arguments.checkpoint:
        log.info("Using the checkpoint given to the task: %s", arguments.checkpoint)
        return arguments.checkpoint
    task_ids = arguments.checkpoint_task_id
    if not task_ids:
        return None
    ids = [task_ids] if isinstance(task_ids, str) else list(task_ids)
    # The first task's return value is its checkpoint too (a confirm task of an older release
    # pushed nothing else); the others' (the drain's summary) are not.
    found = [
        (task_id, value)
        for i, task_id in enumerate(ids)
        if (value := _pull_checkpoint(arguments.slot_name, context, task_id, log, returned=i == 0)) is not None
    ]
    if not found:
        return None
    odd = next((value for _, value in found if not isinstance(value, Mapping)), None)
    if odd is not None:
        return odd  # reconcile names what is wrong with it
    task_id, value = max(found, key=lambda item: Lsn.parse(str(item[1]["end_lsn"])) if _has_end(item[1]) else Lsn(0))
    log.info(
        "Previous checkpoint (XCom of task %s): end LSN %s, %d prepared transaction(s) pending",
        task_id,
        value.get("end_lsn") if isinstance(value, Mapping) else value,
        len(value.get("prepared_pending") or []) if isinstance(value, Mapping) else 0,
    )
    return value


def _pull_checkpoint(slot_name: str, context: Context, task_id: str, log: Any, returned: bool) -> Any:
    # The confirm task pushes the checkpoint under a key per slot, so a DAG whose slot_name
    # param changes between runs picks up each slot's own checkpoint.
    ti = context["ti"]
    value = latest_xcom(ti, task_id, checkpoint_xcom_key(slot_name))
    if value is None and returned:
        value = latest_xcom(ti, task_id)
        if isinstance(value, Mapping) and value.get("slot") not in (None, slot_name):
            log.info("The latest checkpoint belongs to slot %s; slot %s has none yet", value.get("slot"), slot_name)
            value = None
    if isinstance(value, list):
        candidates = [v for v in value if _has_end(v)]
        value = max(candidates, key=lambda v: Lsn.parse(str(v["end_lsn"])), default=None)
    return value


def _extract_batch_options(arguments: ExtractArguments) -> dict[str, Any]:
    """More keyword arguments of ``extract_batch``: ``extract_options`` over [pgdecode] native and
    two_sessions, with the publication and the validated table options."""
    options: dict[str, Any] = {
        "native": pgdecode_bool("native"),
        "two_sessions": pgdecode_bool("two_sessions"),
        **arguments.extract_options,
    }
    if arguments.publication is not None:
        options["publication"] = arguments.publication
    if arguments.table_options:
        options["table_options"] = as_table_options(arguments.table_options)
    return options


def extract_once(
    arguments: ExtractArguments, context: Context, log: Any, kill: KillSwitch | None = None
) -> dict[str, Any]:
    """Stage one batch from the previous checkpoint (reconciled once, here); returns the summary the
    extract task returns. ``kill``, while the slot is read, cancels the peek on the server."""
    previous = previous_checkpoint(arguments, context, log)
    bounds = arguments.bounds()
    options = _extract_batch_options(arguments)
    names, excluded = as_table_names(arguments.tables), as_table_names(arguments.exclude_tables)
    # [pgdecode] spool_dir (batches bound for s3://) reaches the staging code as PGDECODE_SPOOL_DIR.
    with (
        fail_fast(),
        pgdecode_environment(),
        PgDecodeHook(postgres_conn_id=arguments.postgres_conn_id) as hook,
        (kill or KillSwitch()).armed(lambda: _cancel(hook, arguments.slot_name, log)),
    ):
        staging = storage_for(arguments.staging_root, arguments.storage_conn_id)
        info = hook.describe_slot(arguments.slot_name)
        policy, max_per_day = arguments.on_slot_lost, int(arguments.max_slot_recoveries_per_day)
        check_policy(policy, max_per_day)
        if policy == RESNAPSHOT and lost_reason(info) is not None:
            return _recover(arguments, hook, info, staging, previous, max_per_day, log)
        check_readable(info, arguments.plugin)
        decision = reconcile(previous, info, staging)
        log.info("%s", decision.message)
        # Without a fixed ceiling the extract reads the flush position itself, after copying
        # any table snapshot chunks (their watermarks must lie below the ceiling).
        ceiling = Lsn.parse(arguments.upto_lsn) if arguments.upto_lsn else None
        log.info(
            "Extracting slot %s from %s up to %s",
            arguments.slot_name,
            decision.start_lsn,
            ceiling if ceiling is not None else "the server's WAL flush position",
        )
        # Names as given; patterns matched against the catalog now; no tables: every table
        # outside the system schemas (and in the publication). Minus exclude_tables; a table
        # that cannot be loaded, or a pattern matching none, fails here, before the slot is read.
        tables: list[str | tuple[str, str]] = list(
            resolve_tables(
                hook.get_catalog,
                names,
                publication=arguments.publication if arguments.plugin == "pgoutput" else None,
                exclude_tables=excluded,
                table_options=as_table_options(arguments.table_options),
            )
        )
        if not arguments.tables:
            log.info("No tables given: staging all %d table(s) of the database", len(tables))
        started = time.monotonic()
        manifest = hook.extract_batch(
            arguments.slot_name,
            staging,
            plugin=arguments.plugin,
            checkpoint=decision,  # reconciled once: extract_batch takes the decision as it is
            upto_lsn=ceiling,
            tables=tables,
            bounds=bounds,
            # A table created while the run reads the slot, that the selection takes: staged too.
            later_tables=later_tables(names, excluded),
            **options,
        )
        not_staged = manifest.skipped.get("excluded_table_changes", 0)
        if not_staged:
            log.warning(
                "%d change(s) to tables outside the list were not staged: %s",
                not_staged,
                ", ".join(manifest.excluded_tables) or "(tables not recorded)",
            )
        elapsed = time.monotonic() - started
    log_manifest(log, manifest, elapsed)
    metrics.extract_done(manifest.summary(), elapsed)
    for entry in manifest.quarantine:
        log.warning(
            "%s.%s: %d change(s) quarantined (a value the pipeline cannot carry); the merge appends them to "
            "the quarantine Delta table",
            entry["schema"],
            entry["table"],
            entry["rows"],
        )
    return {
        **manifest.summary(),
        "plugin": manifest.plugin,
        "database": manifest.database,
        "ceiling_lsn": manifest.ceiling_lsn,
        "has_changes": any(table.rows for table in manifest.tables) or bool(manifest.quarantine),
        "checkpoint": decision.action,
    }


def _recover(
    arguments: ExtractArguments,
    hook: PgDecodeHook,
    info: SlotInfo,
    staging: Storage,
    previous: Mapping[str, Any] | None,
    max_per_day: int,
    log: Any,
) -> dict[str, Any]:
    """``on_slot_lost = resnapshot``: the lost slot recreated and every table of the pipeline (and
    those table snapshot requests brought in) staged from its snapshot as one replacing batch."""
    options = as_table_options(arguments.table_options) if arguments.table_options else None
    publication = arguments.publication if arguments.plugin == "pgoutput" else None
    tables = set(
        resolve_tables(
            hook.get_catalog,
            as_table_names(arguments.tables),
            publication=publication,
            exclude_tables=as_table_names(arguments.exclude_tables),
            table_options=options,
        )
    )
    checkpoint = coerce_checkpoint(previous)
    if checkpoint is not None:
        tables |= added_tables(checkpoint.snapshots)
    started = time.monotonic()
    manifest = recover_lost_slot(
        hook.dsn(),
        info,
        staging,
        sorted(tables),
        max_per_day=max_per_day,
        table_options=options,
        publication=publication,
        primary=hook.primary_link(),
        drop_slot=hook.drop_slot,
    )
    log.warning(
        "Slot %s recreated at %s; %d table(s) staged from its snapshot in %.1f s, to replace their Delta tables "
        "in the merge (batch %s)",
        arguments.slot_name,
        manifest.end_lsn,
        len(manifest.tables),
        time.monotonic() - started,
        manifest.path,
    )
    return {
        **manifest.summary(),
        "plugin": manifest.plugin,
        "database": manifest.database,
        "ceiling_lsn": manifest.end_lsn,
        "has_changes": True,
        "checkpoint": "recovered",
    }


def _cancel(hook: PgDecodeHook, slot_name: str, log: Any) -> None:
    log.info("Cancelling the extract of slot %s", slot_name)
    hook.cancel()
