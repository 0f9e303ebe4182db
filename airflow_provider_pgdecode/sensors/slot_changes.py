"""A sensor that waits until a replication slot has changes to extract."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue, conf
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout, AirflowSkipException

from airflow_provider_pgdecode.errors import ConfigurationError, SlotError
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import DEFAULT_HEARTBEAT_PREFIX, DEFAULT_PROBE_ROWS
from airflow_provider_pgdecode.triggers.slot_changes import SlotChangesTrigger
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


class PgDecodeSlotChangesSensor(BaseSensorOperator):
    """Wait until a logical replication slot has changes beyond its confirmed position.

    Each poke first compares the server's WAL position with the slot's
    ``confirmed_flush_lsn`` (no decoding while the lag is below ``min_lag_bytes``), then peeks
    at most ``probe_rows`` rows without consuming them. Empty transactions, BEGIN/COMMIT rows
    and pgdecode heartbeat messages are not changes; row changes, TRUNCATEs, logical messages
    and two-phase PREPARE/COMMIT PREPARED/ROLLBACK PREPARED are (details:
    :mod:`airflow_provider_pgdecode.triggers.slot_changes`). The XCom value is a report:
    ``reason``, ``changes``, ``lag_bytes``, ``confirmed_flush_lsn``, ``first_change_lsn``.

    With ``deferrable=True`` the sensor checks once and, when there is nothing yet, defers to
    :class:`~airflow_provider_pgdecode.triggers.slot_changes.SlotChangesTrigger`, freeing its
    worker slot while it waits. A missing or lost slot, or a change it cannot decode, fails the
    task at once (:class:`AirflowFailException`); other errors fail it so that retries apply.

    Never a skip for an error: with ``skip_on_timeout=True`` only the timeout (no changes within
    ``timeout``) skips the task, and the cycle downstream with it. Airflow's ``soft_fail`` would
    skip on a failure too, leaving changes in the slot with every run green: it is refused.

    Example::

        from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor

        wait = PgDecodeSlotChangesSensor(
            task_id="wait_for_changes",
            slot_name="pgdecode_shop",
            poke_interval=60,
            timeout=3600,
            deferrable=True,
        )

    :param slot_name: the replication slot. (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database (``pgdecode`` or
        ``postgres`` type). (templated)
    :param min_lag_bytes: wait until the slot lags the WAL by at least this many bytes before
        probing (to let changes accumulate into bigger batches).
    :param advance_lag_bytes: also succeed when the slot retains at least this many bytes of
        WAL and a heartbeat is pending, so that an idle database's slot gets advanced (pair with
        :class:`~airflow_provider_pgdecode.sensors.slot_health.PgDecodeSlotHealthSensor`
        ``heartbeat=True``). ``None``: only real changes count.
    :param probe_rows: rows peeked per probe.
    :param heartbeat_prefix: the prefix of heartbeat messages. (templated)
    :param publication: for pgoutput slots, the publication they are read with. (templated)
    :param staging_root: the staging root of the slot's batches; when given, a table snapshot
        request still in progress (``pgdecode_backfill`` modes ``add-table``/``resnapshot``)
        counts as work, so its chunks get copied even while the database is idle; a local
        directory or ``s3://bucket/prefix``. Read by pokes in the task and, when deferred, by the
        trigger at each poll: a request filed while the sensor is deferred wakes it. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of an ``s3://`` staging root
        (``endpoint_url`` in its extra for an S3-compatible store); empty: a local staging root,
        or the ``AWS_*`` environment. Resolved in the poke or, when deferred, in the triggerer (the
        trigger holds only the connection id); no secret enters the task's fields, its log, the
        trigger's arguments or XCom. (templated)
    :param deferrable: wait in the triggerer instead of a worker.
    :param skip_on_timeout: skip the task (not fail it) when ``timeout`` passes without changes.
    :param on_slot_lost: ``resnapshot``: a lost slot is work (the extract recovers it), logged at
        error level; ``fail`` (the default): a lost slot fails the task. (templated)
    :param kwargs: :class:`~airflow.sdk.BaseSensorOperator` arguments (``poke_interval``,
        ``timeout``, ``mode`` ...; not ``soft_fail``). ``poke_interval`` is also the trigger's
        poll interval.
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "postgres_conn_id",
        "heartbeat_prefix",
        "publication",
        "staging_root",
        "storage_conn_id",
        "on_slot_lost",
    )
    ui_color = "#d9eaf7"

    def __init__(
        self,
        *,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        min_lag_bytes: int = 1,
        advance_lag_bytes: int | None = None,
        probe_rows: int = DEFAULT_PROBE_ROWS,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
        staging_root: str | None = None,
        storage_conn_id: str | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        skip_on_timeout: bool = False,
        on_slot_lost: str = "fail",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("soft_fail") or kwargs.get("never_fail"):
            raise ConfigurationError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: soft_fail and never_fail turn a failure to read "
                "the slot into a skip, and changes would stay in the slot while every run is green; use "
                "skip_on_timeout=True to skip the cycle when no change comes within the timeout"
            )
        super().__init__(**kwargs)
        self.skip_on_timeout = skip_on_timeout
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.min_lag_bytes = min_lag_bytes
        self.advance_lag_bytes = advance_lag_bytes
        self.probe_rows = probe_rows
        self.heartbeat_prefix = heartbeat_prefix
        self.publication = publication
        self.staging_root = staging_root
        self.storage_conn_id = storage_conn_id
        self.deferrable = deferrable
        self.on_slot_lost = on_slot_lost

    def _trigger(self) -> SlotChangesTrigger:
        """The trigger this sensor defers to; a poke runs the same check in the task."""
        return SlotChangesTrigger(
            slot_name=self.slot_name,
            postgres_conn_id=self.postgres_conn_id,
            poll_interval=self.poke_interval,
            min_lag_bytes=self.min_lag_bytes,
            advance_lag_bytes=self.advance_lag_bytes,
            probe_rows=self.probe_rows,
            heartbeat_prefix=self.heartbeat_prefix,
            publication=self.publication,
            staging_root=str(self.staging_root) if self.staging_root else None,
            storage_conn_id=self.storage_conn_id or None,
        )

    def _check(self) -> tuple[bool, dict[str, Any]]:
        with fail_fast():
            return self._trigger().check()

    def poke(self, context: Context) -> PokeReturnValue:
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            lost = hook.recoverable_loss(self.slot_name, self.on_slot_lost)
        if lost is not None:  # the extract's recovery is this cycle's work
            self.log.error("%s", lost)
            return PokeReturnValue(is_done=True, xcom_value={"slot": self.slot_name, "reason": lost, "lost": True})
        done, report = self._check()
        self.log.info("Slot %s: %s", self.slot_name, report["reason"])
        return PokeReturnValue(is_done=done, xcom_value=report if done else None)

    def execute(self, context: Context) -> Any:
        with self._timeout_skips():
            if not self.deferrable:
                return super().execute(context)
            returned = self.poke(context)
            if returned.is_done:
                return returned.xcom_value
            self.defer(
                trigger=self._trigger(),
                method_name="execute_complete",
                timeout=timedelta(seconds=self.timeout),
            )

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        with self._timeout_skips():  # a deferral's timeout comes back as AirflowSensorTimeout
            return super().resume_execution(next_method, next_kwargs, context)

    @contextmanager
    def _timeout_skips(self) -> Iterator[None]:
        """The timeout, and only the timeout, skips the task when ``skip_on_timeout`` is set."""
        try:
            yield
        except AirflowSensorTimeout as exc:
            if not self.skip_on_timeout:
                raise
            raise AirflowSkipException(
                f"no change in slot {self.slot_name!r} within {self.timeout:.0f} s: this cycle is skipped"
            ) from exc

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Resume after the trigger fired: return its report, or fail on an error event."""
        if not event:
            raise AirflowException(f"the trigger of slot {self.slot_name!r} returned no event")
        if event.get("status") != "success":
            message = event.get("message") or f"the trigger of slot {self.slot_name!r} failed: {event!r}"
            with fail_fast():
                # The trigger said whether its error was deterministic (a missing or lost slot).
                raise SlotError(message) if event.get("fatal") else AirflowException(message)
        self.log.info("Slot %s: %s", self.slot_name, event.get("reason"))
        return event
