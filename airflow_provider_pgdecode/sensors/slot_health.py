"""A health check of a replication slot: fails loudly before the slot costs data or disk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_pgdecode.batch.parking import read_parked
from airflow_provider_pgdecode.decoding.lsn import describe_bytes
from airflow_provider_pgdecode.errors import SlotError, SlotInUseError, StandbyWriteError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.hooks.pgdecode import PgDecodeHook
from airflow_provider_pgdecode.hooks.slot_probe import DEFAULT_HEARTBEAT_PREFIX, ChangesProbe, probe_changes
from airflow_provider_pgdecode.postgres.health import check_readable
from airflow_provider_pgdecode.postgres.slot import SlotInfo
from airflow_provider_pgdecode.utils.fail_fast import fail_fast
from airflow_provider_pgdecode.utils.xcom import latest_xcom


class PgDecodeSlotHealthSensor(BaseSensorOperator):
    """Check a logical replication slot; fail with a specific message when it is unhealthy.

    The checks, in order:

    * the slot is missing → :class:`AirflowFailException` (retrying cannot help);
    * it uses another output plugin than ``plugin`` (when given) → :class:`AirflowFailException`;
    * ``wal_status = 'lost'``: the WAL it needed was removed, changes are gone →
      :class:`AirflowFailException` with the recovery steps;
    * ``wal_status = 'unreserved'``: it retains more WAL than ``max_slot_wal_keep_size`` and
      will be lost at the server's next checkpoint unless it advances →
      :class:`AirflowException` (a retry after the pipeline advanced the slot can pass);
    * ``lag_bytes > max_lag_bytes`` (when given) → :class:`AirflowException`;
    * other logical slots of the cluster that no process uses and that hold back more than
      ``max_lag_bytes`` of WAL (when given) → a warning naming each and how to drop it, since the
      server keeps that WAL for them (a source removed from the sources file keeps its slot); the
      check still passes: only whoever knows what reads a slot can drop it.

    With ``max_stalled_runs`` it also fails when changes have been pending at the same confirmed
    position through more than that many consecutive runs of this check: nothing extracted them,
    whatever the reason (a cycle failing or skipped, a paused task, a publication that misses the
    table), and the slot's lag grows. A change it cannot decode fails it at once.

    With ``heartbeat=True`` the check also writes a heartbeat (a non-transactional logical
    message, ``pg_logical_emit_message``) when the slot has nothing pending to decode, so that
    the next extract has a position to advance the slot to even if its database is idle while
    the rest of the cluster writes WAL. It writes none while a heartbeat or real changes are
    still pending, and none while another process holds the slot. The heartbeat is written
    before the lag check, so an idle slot can still recover.

    On success the XCom value is the slot's description (``SlotInfo.to_dict()``) plus
    ``heartbeat_lsn``, ``idle_slots`` (the names warned about), ``pending_changes`` (counted by a
    probe of a few rows: ``None`` when not probed) and ``stalled_runs`` (consecutive runs that
    found changes pending at this confirmed position). The check passes or fails on
    its first poke: it never waits.

    Place it where its failure alerts without blocking the extract (e.g. a parallel branch):
    the extract, merge and confirm are what advance a lagging or unreserved slot.

    Example::

        from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor

        health = PgDecodeSlotHealthSensor(
            task_id="slot_health",
            slot_name="pgdecode_shop",
            max_lag_bytes=8 * 1024**3,
            heartbeat=True,
        )

    :param slot_name: the replication slot. (templated)
    :param postgres_conn_id: the Airflow connection of the slot's database. (templated)
    :param max_lag_bytes: fail when the slot lags the server's WAL position by more bytes.
    :param plugin: fail unless the slot uses this output plugin. (templated)
    :param heartbeat: write a heartbeat when the slot has nothing pending.
    :param heartbeat_prefix: the heartbeat messages' prefix. (templated)
    :param publication: for pgoutput slots, the publication (needed to look for pending
        changes). (templated)
    :param max_stalled_runs: fail when changes stayed pending, unextracted, at the slot's confirmed
        position through more consecutive runs of this check than this; ``None``: no such check.
    :param staging_root: the slot's staging root: its parked tables (docs/merge.md, "Parked
        tables") are named in the log and the XCom (``parked_tables``), and the check fails when
        one has stayed parked through more merge runs than ``max_parked_runs``; empty: not
        checked. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of an ``s3://`` staging root. (templated)
    :param max_parked_runs: the merge runs a table may stay parked before the check fails (``0``:
        fail while any table is parked).
    :param on_slot_lost: ``resnapshot``: a lost slot is logged at error level and left to the
        extract, which recovers it; ``fail`` (the default): it fails the check. (templated)
    """

    template_fields: Sequence[str] = (
        "slot_name",
        "postgres_conn_id",
        "plugin",
        "heartbeat_prefix",
        "publication",
        "staging_root",
        "storage_conn_id",
        "on_slot_lost",
    )
    ui_color = "#f7e3d9"

    def __init__(
        self,
        *,
        slot_name: str,
        postgres_conn_id: str = PgDecodeHook.default_conn_name,
        max_lag_bytes: int | None = None,
        plugin: str | None = None,
        heartbeat: bool = False,
        heartbeat_prefix: str = DEFAULT_HEARTBEAT_PREFIX,
        publication: str | None = None,
        max_stalled_runs: int | None = None,
        staging_root: str | None = None,
        storage_conn_id: str | None = None,
        max_parked_runs: int = 0,
        on_slot_lost: str = "fail",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poke_interval", 0)
        kwargs.setdefault("timeout", 0)
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.max_lag_bytes = max_lag_bytes
        self.plugin = plugin
        self.heartbeat = heartbeat
        self.heartbeat_prefix = heartbeat_prefix
        self.publication = publication
        self.max_stalled_runs = max_stalled_runs
        self.staging_root = staging_root
        self.storage_conn_id = storage_conn_id
        self.max_parked_runs = max_parked_runs
        self.on_slot_lost = on_slot_lost

    def poke(self, context: Context) -> PokeReturnValue:
        name = self.slot_name
        with PgDecodeHook(postgres_conn_id=self.postgres_conn_id) as hook:
            lost = hook.recoverable_loss(name, self.on_slot_lost)
            if lost is not None:
                self.log.error("%s", lost)
                return PokeReturnValue(is_done=True, xcom_value={"slot": name, "lost": lost})
            with fail_fast():
                info = hook.describe_slot(name)
                check_readable(info, self.plugin)
            self._check_state(info)
            probe = self._probe(hook, info)
            stalled = self._check_stalled(context, info, probe)
            heartbeat_lsn = self._maybe_heartbeat(hook, info, probe) if self.heartbeat else None
            idle = hook.idle_slots(self.max_lag_bytes, besides=name) if self.max_lag_bytes is not None else []
        # Said before this slot's own lag may fail the check: both hold WAL back.
        for other in idle:
            self.log.warning(
                "replication slot %r (database %s, plugin %s) is not in use and holds back %s of WAL on this server, "
                "more than max_lag_bytes %s: if no pipeline reads it any more (a source removed from the sources "
                "file keeps its slot), drop it with SELECT pg_drop_replication_slot('%s')",
                other.slot_name,
                other.database,
                other.plugin,
                describe_bytes(other.lag_bytes),
                describe_bytes(self.max_lag_bytes),
                other.slot_name,
            )
        parked = self._check_parked()
        lag = info.lag_bytes or 0
        if self.max_lag_bytes is not None and lag > self.max_lag_bytes:
            raise AirflowException(
                f"replication slot {name!r} lags the server's WAL by {describe_bytes(lag)} (confirmed at "
                f"{info.confirmed_flush_lsn}, server at {info.current_lsn}), more than max_lag_bytes "
                f"{describe_bytes(self.max_lag_bytes)}; the server retains that WAL for it. Run the pipeline (extract, "
                "merge, confirm) to advance the slot, check that its DAG is not paused or failing, or drop the "
                "slot if nothing reads it any more"
            )
        self.log.info(
            "Slot %s is healthy: plugin %s, wal_status %s, confirmed %s, lag %s, safe_wal_size %s%s",
            name,
            info.plugin,
            info.wal_status,
            info.confirmed_flush_lsn,
            describe_bytes(lag),
            describe_bytes(info.safe_wal_size) if info.safe_wal_size is not None else "unlimited",
            f", heartbeat at {heartbeat_lsn}" if heartbeat_lsn is not None else "",
        )
        return PokeReturnValue(
            is_done=True,
            xcom_value={
                **info.to_dict(),
                "heartbeat_lsn": None if heartbeat_lsn is None else str(heartbeat_lsn),
                "idle_slots": [other.slot_name for other in idle],
                "pending_changes": None if probe is None else probe.changes,
                "stalled_runs": stalled,
                "parked_tables": parked,
            },
        )

    def _check_parked(self) -> dict[str, Any]:
        """The slot's parked tables (named in the log); fails when one stayed parked too long."""
        if not self.staging_root:
            return {}
        with fail_fast():
            parked = read_parked(storage_for(str(self.staging_root), self.storage_conn_id), self.slot_name)
        for name, entry in sorted(parked.items()):
            self.log.warning(
                "table %s is parked since LSN %s (%s, %d merge run(s)): %s. Its changes wait in the staged batches; "
                "fix the cause and the next merge applies them (docs/merge.md, Parked tables)",
                name,
                entry.since_lsn,
                entry.parked_at,
                entry.runs,
                entry.reason,
            )
        overdue = sorted(name for name, entry in parked.items() if entry.runs > self.max_parked_runs)
        if overdue:
            raise AirflowException(
                f"slot {self.slot_name!r}: table(s) {', '.join(overdue)} parked through more than "
                f"{self.max_parked_runs} merge run(s) (max_parked_runs): their changes are not in Delta; every other "
                f"table flows. Reasons: {'; '.join(f'{n}: {parked[n].reason}' for n in overdue)}. Fix the cause and "
                "the next merge applies their kept changes in order"
            )
        return {name: asdict(entry) for name, entry in parked.items()}

    def _check_state(self, info: SlotInfo) -> None:
        name = info.slot_name
        if info.wal_status == "unreserved":
            raise AirflowException(
                f"replication slot {name!r} has wal_status = unreserved: it retains {describe_bytes(info.lag_bytes)} of "
                f"WAL, beyond max_slot_wal_keep_size (safe_wal_size {describe_bytes(info.safe_wal_size)}), and the server "
                "will remove that WAL at its next checkpoint, losing the slot. Advance it now: run the pipeline "
                "(extract, merge, confirm), or raise max_slot_wal_keep_size"
            )

    def _probe(self, hook: PgDecodeHook, info: SlotInfo) -> ChangesProbe | None:
        """What a peek of a few rows finds pending (``None``: the slot is in use, caught up, or
        cannot be probed without a publication). A change it cannot decode fails the check."""
        if info.active or not info.lag_bytes:
            return None
        try:
            with fail_fast(f"slot {info.slot_name!r}: a change pending in it cannot be read"):
                return probe_changes(
                    hook, info, probe_rows=10, heartbeat_prefix=self.heartbeat_prefix, publication=self.publication
                )
        except AirflowFailException as exc:
            if not isinstance(exc.__cause__, SlotError):
                raise  # a change it cannot decode: the extract would fail on it too
            self.log.warning("Slot %s: cannot look for pending changes (%s)", info.slot_name, exc.__cause__)
        except SlotInUseError as exc:
            self.log.info("Slot %s: cannot look for pending changes now (%s)", info.slot_name, exc)
        return None

    def _check_stalled(self, context: Context, info: SlotInfo, probe: ChangesProbe | None) -> int:
        """Consecutive runs of this check that found changes pending at the slot's confirmed
        position (this one included); past ``max_stalled_runs``, the check fails naming it."""
        if probe is None or not probe.changes:
            return 0
        previous = latest_xcom(context["ti"], self.task_id) if "ti" in context else None
        same = (
            isinstance(previous, dict)
            and previous.get("pending_changes")
            and previous.get("confirmed_flush_lsn") == info.to_dict().get("confirmed_flush_lsn")
        )
        stalled = int(previous.get("stalled_runs") or 0) + 1 if same and isinstance(previous, dict) else 1
        if self.max_stalled_runs is not None and stalled > self.max_stalled_runs:
            raise AirflowException(
                f"replication slot {info.slot_name!r}: changes pending, nothing extracted for {stalled - 1} runs "
                f"(its confirmed position {info.confirmed_flush_lsn} has not moved while {probe.changes} or more "
                f"change(s) waited, from {probe.first_change_lsn} on; lag {describe_bytes(info.lag_bytes)}). Look at those "
                "runs' wait_for_changes, extract, merge and confirm tasks: a failed or skipped task, a paused task, "
                "or a pgoutput publication that leaves the table out; the slot's lag grows until they run"
            )
        if stalled > 1:
            self.log.warning(
                "Slot %s: changes pending at %s for %d consecutive runs of this check, none extracted yet",
                info.slot_name,
                info.confirmed_flush_lsn,
                stalled,
            )
        return stalled

    def _maybe_heartbeat(self, hook: PgDecodeHook, info: SlotInfo, probe: ChangesProbe | None) -> Any:
        if info.active:
            self.log.info("Slot %s is in use by another process: no heartbeat", info.slot_name)
            return None
        if not info.lag_bytes or probe is None:
            return None
        if probe.changes or probe.heartbeats:
            self.log.info(
                "Slot %s has %d change(s) and %d heartbeat(s) pending: no heartbeat needed",
                info.slot_name,
                probe.changes,
                probe.heartbeats,
            )
            return None
        try:
            lsn = hook.emit_heartbeat(prefix=self.heartbeat_prefix)
        except StandbyWriteError as exc:
            self.log.warning("Slot %s lags with nothing pending, but no heartbeat is written: %s", info.slot_name, exc)
            return None
        self.log.info(
            "Slot %s has nothing pending while lagging %s: wrote a heartbeat at %s so the next extract can advance it",
            info.slot_name,
            describe_bytes(info.lag_bytes),
            lsn,
        )
        return lsn
