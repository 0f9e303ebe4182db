"""Extract one batch of changes from a replication slot into the staging area."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.options import as_table_options
from airflow_provider_pgdecode.capture.bounds import DEFAULT_MAX_BATCH_CHANGES, DEFAULT_MAX_BATCH_WAL_BYTES, BatchBounds
from airflow_provider_pgdecode.capture.reconcile import reconcile
from airflow_provider_pgdecode.capture.tables import as_table_names, later_tables, resolve_tables
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.health import check_readable
from airflow_provider_pgdecode.utils.config import pgdecode_bool, pgdecode_environment
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.xcom import checkpoint_xcom_key, latest_xcom


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


def _optional_count(value: int | str | None) -> int | None:
    """A bound from a DAG param: an integer, or ``None``/``""``/``"null"`` for no bound."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value  # type: ignore[return-value]  # BatchBounds names anything else


def _has_end(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value.get("end_lsn"))


class PgDecodeExtractOperator(BaseOperator):
    """Peek a slot up to a ceiling LSN, stage the changes as one batch, return its summary.

    The run starts from the previous successful run's checkpoint, pulled from XCom (the
    return value of the confirm task, ``checkpoint_task_id``, from this or earlier DAG runs)
    and reconciled with the slot's confirmed position
    (:func:`airflow_provider_pgdecode.capture.reconcile.reconcile`): a slot behind the checkpoint
    resumes safely; a slot ahead of everything merged fails the task with
    :class:`AirflowFailException` and the steps to recover. The slot is only peeked, never
    consumed: the confirm task advances it after the merge.

    The batch goes to ``<staging_root>/<slot_name>/<start_lsn>-<end_lsn>/`` (Parquet per table
    plus ``manifest.json``, see ``docs/staging-format.md``); extracting the same range again
    gives the same batch. Returns (to XCom) the manifest summary: ``path``, ``slot``,
    ``start_lsn``, ``end_lsn``, ``ceiling_lsn``, ``transactions``, ``changes``, ``tables``
    (rows per ``schema.table``), ``prepared_pending``, ``has_changes`` and ``checkpoint``
    (how the start was decided).

    Example::

        from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator

        extract = PgDecodeExtractOperator(
            task_id="extract",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            checkpoint_task_id="confirm",
        )
        # downstream: batch path "{{ ti.xcom_pull(task_ids='extract')['path'] }}"

    :param slot_name: the replication slot. (templated)
    :param staging_root: the root of staged batches: a local directory or ``s3://bucket/prefix``.
        (templated)
    :param plugin: the slot's output plugin (``test_decoding`` or ``pgoutput``); another
        plugin fails the task. (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database. (templated)
    :param checkpoint_task_id: the task whose XCom return value is the checkpoint (the
        confirm task). (templated)
    :param checkpoint: an explicit checkpoint dict (``Checkpoint.to_dict()``) used instead of
        the XCom one, e.g. after a backfill. (templated)
    :param upto_lsn: the ceiling LSN as ``X/Y``; default the server's WAL flush position when
        the task starts. (templated)
    :param tables: ``schema.table`` names or glob patterns (``public.order_*``) to stage;
        default (empty) every ordinary and partitioned table outside the system schemas (for
        pgoutput: in the publication). Patterns are matched against the catalog (for pgoutput:
        the publication's tables) each time the task runs; one that matches no table fails the
        task (:func:`~airflow_provider_pgdecode.capture.tables.resolve_tables`). With the
        default or a pattern, a table without a usable key (no primary key, replica identity
        index or REPLICA IDENTITY FULL) that is not loaded ``append_only`` fails the task before
        the slot is read, in one error naming every such table and the ways forward: nothing is
        skipped silently. A table created while the task reads the slot that the default or a
        pattern selects is staged from its first change (under the same key rule). (templated)
    :param exclude_tables: ``schema.table`` names or patterns never to stage (their changes are
        counted and named in the manifest, and the log warns). (templated)
    :param publication: the publication of a pgoutput slot. (templated)
    :param table_options: per-table options, ``{"schema.table": {"mode": "append_only"}}``
        (:class:`~airflow_provider_pgdecode.batch.options.TableOptions`; validated before the
        slot is read): ``mode``, ``on_bad_value`` (``fail`` / ``quarantine``),
        ``max_value_bytes``, ``arrays`` (``list`` / ``json``), ``type_map`` (types kept as
        text, ``{"numeric": "string"}``). Quarantined changes are logged per table. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    :param max_batch_changes: the most changes one batch stages (``None``: no bound); the batch
        ends at the last transaction that fits, and a transaction larger than the bound is a batch
        of its own (:mod:`~airflow_provider_pgdecode.capture.bounds`). The summary's ``bounded_by``
        says whether a bound ended the batch before the server's WAL position. (templated)
    :param max_batch_wal_bytes: the most WAL one batch spans, likewise. (templated)
    :param extract_options: more keyword arguments of
        :func:`~airflow_provider_pgdecode.capture.extract.extract_batch` (``chunk_rows``,
        ``part_rows``, ``memory_items``, ``progress_every``, ...).
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "staging_root",
        "plugin",
        "postgres_conn_id",
        "checkpoint_task_id",
        "checkpoint",
        "upto_lsn",
        "tables",
        "exclude_tables",
        "publication",
        "table_options",
        "storage_conn_id",
        "max_batch_changes",
        "max_batch_wal_bytes",
    )
    ui_color = "#d9f0ea"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        plugin: str = "test_decoding",
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        checkpoint_task_id: str | Sequence[str] | None = "confirm",
        checkpoint: Mapping[str, Any] | None = None,
        upto_lsn: str | None = None,
        tables: Sequence[str] | None = None,
        exclude_tables: Sequence[str] | None = None,
        publication: str | None = None,
        table_options: Mapping[str, Mapping[str, Any]] | str | None = None,
        extract_options: Mapping[str, Any] | None = None,
        storage_conn_id: str | None = None,
        max_batch_changes: int | str | None = DEFAULT_MAX_BATCH_CHANGES,
        max_batch_wal_bytes: int | str | None = DEFAULT_MAX_BATCH_WAL_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_batch_changes = max_batch_changes
        self.max_batch_wal_bytes = max_batch_wal_bytes
        self.slot_name = slot_name
        self.staging_root = staging_root
        self.plugin = plugin
        self.postgres_conn_id = postgres_conn_id
        self.checkpoint_task_id = checkpoint_task_id
        self.checkpoint = checkpoint
        self.upto_lsn = upto_lsn
        self.tables = tables
        self.exclude_tables = exclude_tables
        self.publication = publication
        self.table_options = table_options
        self.extract_options = dict(extract_options or {})
        self.storage_conn_id = storage_conn_id
        self._hook: PgDecodeHook | None = None

    def previous_checkpoint(self, context: Context) -> Mapping[str, Any] | None:
        """The explicit ``checkpoint``, else the latest checkpoint the ``checkpoint_task_id`` task(s)
        left in XCom (of several, the one that ends last)."""
        if self.checkpoint:
            self.log.info("Using the checkpoint given to the task: %s", self.checkpoint)
            return self.checkpoint
        if not self.checkpoint_task_id:
            return None
        ids = [self.checkpoint_task_id] if isinstance(self.checkpoint_task_id, str) else list(self.checkpoint_task_id)
        # The first task's return value is its checkpoint too (a confirm task of an older release
        # pushed nothing else); the others' (the drain's summary) are not.
        found = [
            (task_id, value)
            for i, task_id in enumerate(ids)
            if (value := self._pull_checkpoint(context, task_id, returned=i == 0)) is not None
        ]
        if not found:
            return None
        odd = next((value for _, value in found if not isinstance(value, Mapping)), None)
        if odd is not None:
            return odd  # reconcile names what is wrong with it
        task_id, value = max(
            found, key=lambda item: Lsn.parse(str(item[1]["end_lsn"])) if _has_end(item[1]) else Lsn(0)
        )
        self.log.info(
            "Previous checkpoint (XCom of task %s): end LSN %s, %d prepared transaction(s) pending",
            task_id,
            value.get("end_lsn") if isinstance(value, Mapping) else value,
            len(value.get("prepared_pending") or []) if isinstance(value, Mapping) else 0,
        )
        return value

    def _pull_checkpoint(self, context: Context, task_id: str, returned: bool) -> Any:
        # The confirm task pushes the checkpoint under a key per slot, so a DAG whose slot_name
        # param changes between runs picks up each slot's own checkpoint.
        ti = context["ti"]
        value = latest_xcom(ti, task_id, checkpoint_xcom_key(self.slot_name))
        if value is None and returned:
            value = latest_xcom(ti, task_id)
            if isinstance(value, Mapping) and value.get("slot") not in (None, self.slot_name):
                self.log.info(
                    "The latest checkpoint belongs to slot %s; slot %s has none yet", value.get("slot"), self.slot_name
                )
                value = None
        if isinstance(value, list):
            candidates = [v for v in value if _has_end(v)]
            value = max(candidates, key=lambda v: Lsn.parse(str(v["end_lsn"])), default=None)
        return value

    def bounds(self) -> BatchBounds:
        """The batch bounds from the (rendered) fields; ``None`` or an empty value lifts one."""
        return BatchBounds(_optional_count(self.max_batch_changes), _optional_count(self.max_batch_wal_bytes))

    def execute(self, context: Context) -> dict[str, Any]:
        return self.extract(context)

    def extract(self, context: Context) -> dict[str, Any]:
        """Stage one batch from the previous checkpoint; returns the summary :meth:`execute` returns
        (the drain task calls this once per batch)."""
        previous = self.previous_checkpoint(context)
        bounds = self.bounds()
        options = dict(self.extract_options)
        if self.publication is not None:
            options["publication"] = self.publication
        if self.table_options:
            options["table_options"] = as_table_options(self.table_options)
        # [pgdecode] spool_dir (batches bound for s3://) reaches the staging code as PGDECODE_SPOOL_DIR.
        with fail_fast(), pgdecode_environment(), PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            staging = storage_for(self.staging_root, self.storage_conn_id)
            self._hook = hook
            info = hook.describe_slot(self.slot_name)
            check_readable(info, self.plugin)
            decision = reconcile(previous, info, staging)
            self.log.info("%s", decision.message)
            # Without a fixed ceiling the extract reads the flush position itself, after copying
            # any table snapshot chunks (their watermarks must lie below the ceiling).
            ceiling = Lsn.parse(self.upto_lsn) if self.upto_lsn else None
            self.log.info(
                "Extracting slot %s from %s up to %s",
                self.slot_name,
                decision.start_lsn,
                ceiling if ceiling is not None else "the server's WAL flush position",
            )
            # Names as given; patterns matched against the catalog now; no tables: every table
            # outside the system schemas (and in the publication). Minus exclude_tables; a table
            # that cannot be loaded, or a pattern matching none, fails here, before the slot is read.
            tables: list[str | tuple[str, str]] = list(
                resolve_tables(
                    hook.get_catalog,
                    as_table_names(self.tables),
                    publication=self.publication if self.plugin == "pgoutput" else None,
                    exclude_tables=as_table_names(self.exclude_tables),
                    table_options=as_table_options(self.table_options),
                )
            )
            if not self.tables:
                self.log.info("No tables given: staging all %d table(s) of the database", len(tables))
            started = time.monotonic()
            manifest = hook.extract_batch(
                self.slot_name,
                staging,
                plugin=self.plugin,
                checkpoint=decision,  # reconciled once: extract_batch takes the decision as it is
                upto_lsn=ceiling,
                tables=tables,
                bounds=bounds,
                # A table created while the run reads the slot, that the selection takes: staged too.
                later_tables=later_tables(as_table_names(self.tables), as_table_names(self.exclude_tables)),
                # [pgdecode] native and two_sessions, unless extract_options says
                **{"native": pgdecode_bool("native"), "two_sessions": pgdecode_bool("two_sessions"), **options},
            )
            not_staged = manifest.skipped.get("excluded_table_changes", 0)
            if not_staged:
                self.log.warning(
                    "%d change(s) to tables outside the list were not staged: %s",
                    not_staged,
                    ", ".join(manifest.excluded_tables) or "(tables not recorded)",
                )
            elapsed = time.monotonic() - started
        self._hook = None
        log_manifest(self.log, manifest, elapsed)
        for entry in manifest.quarantine:
            self.log.warning(
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

    def on_kill(self) -> None:
        """Cancel the running peek on the server; the unfinished batch directory is removed."""
        if self._hook is not None:
            self.log.info("Cancelling the extract of slot %s", self.slot_name)
            self._hook.cancel()
