"""Extract one batch of changes from a replication slot into the staging area."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.capture.bounds import DEFAULT_MAX_BATCH_CHANGES, DEFAULT_MAX_BATCH_WAL_BYTES
from airflow_provider_pgdecode.capture.recovery import DEFAULT_MAX_PER_DAY, FAIL
from airflow_provider_pgdecode.cycle import CycleTask, KillSwitch
from airflow_provider_pgdecode.cycle.extract import ExtractArguments, extract_once, previous_checkpoint
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook


class PgDecodeExtractOperator(CycleTask[ExtractArguments], BaseOperator):
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
    :param on_slot_lost: what a lost slot does (``wal_removed``, 18's ``idle_timeout`` ...):
        ``fail`` (the default) stops with the slot's error; ``resnapshot`` recreates the slot with
        a snapshot and stages every table in it as one batch that replaces each Delta table in one
        commit (:mod:`~airflow_provider_pgdecode.capture.recovery`). (templated)
    :param max_slot_recoveries_per_day: how often ``resnapshot`` may recover in 24 hours before
        the slot's error stands (default 1). (templated)
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
        "on_slot_lost",
        "max_slot_recoveries_per_day",
    )
    arguments_kind = ExtractArguments
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
        on_slot_lost: str = FAIL,
        max_slot_recoveries_per_day: int | str = DEFAULT_MAX_PER_DAY,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.on_slot_lost = on_slot_lost
        self.max_slot_recoveries_per_day = max_slot_recoveries_per_day
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
        self._kill = KillSwitch()

    def previous_checkpoint(self, context: Context) -> Mapping[str, Any] | None:
        """The explicit ``checkpoint``, else the latest checkpoint the ``checkpoint_task_id`` task(s)
        left in XCom (of several, the one that ends last)."""
        return previous_checkpoint(self.cycle_arguments(), context, self.log)

    def execute(self, context: Context) -> dict[str, Any]:
        return extract_once(self.cycle_arguments(), context, self.log, self._kill)

    def on_kill(self) -> None:
        """Cancel the running peek on the server; the unfinished batch directory is removed."""
        self._kill.pull()
