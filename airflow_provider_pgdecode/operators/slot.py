"""Create a logical replication slot, or check that the existing one serves as asked."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.postgres.health import idle_timeout_between_runs
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.schedule import longest_gap


class PgDecodeEnsureSlotOperator(BaseOperator):
    """Make sure a logical replication slot exists with the given output plugin and two-phase setting.

    A missing slot is created (in the connection's database). An existing one is checked: a
    physical slot, a slot of another database, another output plugin, another two-phase
    setting, or a lost slot fails the task with :class:`AirflowFailException` and says how to
    fix it (retrying cannot help). So does a server or role that cannot hold the slot
    (``wal_level`` not ``logical``, no REPLICATION attribute, every slot in use,
    ``max_prepared_transactions = 0`` for two-phase, the plugin not installed): the error names
    the slot, the server and the setting to change, in the words of the connection's test
    (``airflow connections test``, :meth:`PgDecodeHook.test_connection
    <airflow_provider_pgdecode.hooks.pgdecode.PgDecodeHook.test_connection>`). Returns the slot's description (``SlotInfo.to_dict()``:
    ``confirmed_flush_lsn``, ``wal_status``, ``lag_bytes``, ...) to XCom.

    Creating a slot waits for the transactions running at that moment to finish. Changes
    before the slot's creation are not in it: load the tables from a snapshot (backfill)
    when starting.

    Example::

        from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator

        ensure = PgDecodeEnsureSlotOperator(
            task_id="ensure_slot",
            slot_name="pgdecode_shop",
            plugin="test_decoding",
            two_phase=True,
        )

    :param slot_name: the slot's name (``[a-z0-9_]``, up to 63 characters). (templated)
    :param plugin: the output plugin, ``test_decoding`` or ``pgoutput``. (templated)
    :param two_phase: decode prepared transactions at PREPARE time (PostgreSQL 14+, needs
        ``max_prepared_transactions > 0``); fixed when the slot is created.
    :param failover: create a failover slot (PostgreSQL 17+): a standby with
        ``sync_replication_slots = on`` keeps it in sync, so after promoting that standby the
        pipeline carries on from the slot there instead of re-snapshotting. The primary also needs
        ``synchronized_standby_slots`` naming the standby's physical slot, so that no change is
        confirmed here before the standby has it. Applies when the slot is created; on
        PostgreSQL 17 such a slot is created without two-phase decoding, which is not safe there
        with failover (docs/standby.md). (templated)
    :param postgres_conn_id: the Airflow connection of the source database. (templated)
    :param on_slot_lost: ``resnapshot``: a lost slot is logged and left to the extract, which
        recovers it (:class:`~airflow_provider_pgdecode.operators.extract.PgDecodeExtractOperator`);
        ``fail`` (the default): the task fails with the slot's error. (templated)
    """

    template_fields: Sequence[str] = ("slot_name", "plugin", "failover", "postgres_conn_id", "on_slot_lost")
    ui_color = "#e8f0d9"

    def __init__(
        self,
        *,
        slot_name: str,
        plugin: str = "test_decoding",
        two_phase: bool = False,
        failover: bool | str = False,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        on_slot_lost: str = "fail",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.on_slot_lost = on_slot_lost
        self.slot_name = slot_name
        self.plugin = plugin
        self.two_phase = two_phase
        self.failover = failover
        self.postgres_conn_id = postgres_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            lost = hook.recoverable_loss(self.slot_name, self.on_slot_lost)
            if lost is not None:
                self.log.error("%s", lost)
                return hook.describe_slot(self.slot_name).to_dict()
            with fail_fast():
                info = hook.ensure_slot(
                    self.slot_name,
                    plugin=self.plugin,
                    two_phase=bool(self.two_phase),
                    failover=yes_or_no(self.failover) is True,
                )
                timeout = hook.get_slot_client().idle_timeout()
        self._warn_if_idle_too_long(info.slot_name, timeout, context)
        self.log.info(
            "Slot %s ready: plugin %s, two_phase %s, database %s, confirmed at %s, wal_status %s, lag %s bytes",
            info.slot_name,
            info.plugin,
            info.two_phase,
            info.database,
            info.confirmed_flush_lsn,
            info.wal_status,
            info.lag_bytes,
        )
        return info.to_dict()

    def _warn_if_idle_too_long(self, slot_name: str, timeout: timedelta | None, context: Context) -> None:
        dag = context.get("dag")
        if timeout is None or dag is None:
            return
        gap = longest_gap(dag.timetable, datetime.now(UTC))
        if gap is not None and gap >= timeout:
            self.log.warning("%s", idle_timeout_between_runs(slot_name, timeout, gap))
