"""A streaming physical standby of a throwaway cluster, for decoding on a standby (PostgreSQL 16+).

The npm packages of PostgreSQL carry no ``pg_basebackup``, so the base backup is the low-level
one: ``pg_backup_start`` on the primary, a copy of its data directory, ``pg_backup_stop``'s label
written into the copy. The standby streams from the primary through a physical slot of its own
with ``hot_standby_feedback`` on, as PostgreSQL recommends for logical slots on a standby (the
primary then keeps the catalog rows they need).

Example::

    with ThrowawayCluster(pg_version=16) as primary, StandbyCluster(primary) as standby:
        ...  # write on primary.connect(), decode on standby.connect()
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from psycopg import sql

from pgdecode_testing.postgres_cluster import ClusterError, ThrowawayCluster

#: Files of the primary's data directory that a standby must not start with.
_NOT_COPIED = ("postmaster.pid", "postmaster.opts", "pg_wal/*", "pg_replslot/*", "standby.signal")


class StandbyCluster(ThrowawayCluster):
    """A hot standby of ``primary`` (a running :class:`ThrowawayCluster`), same binaries.

    :param primary: the cluster to replicate.
    :param slot_name: the physical slot on the primary the standby streams through (created).
    :param sync_slots: ``sync_replication_slots = on`` (PostgreSQL 17+): the standby keeps copies
        of the primary's failover slots.
    :param extra_settings: more settings of the standby.
    """

    def __init__(
        self,
        primary: ThrowawayCluster,
        *,
        slot_name: str = "pgdecode_standby",
        sync_slots: bool = False,
        extra_settings: Mapping[str, str] | None = None,
    ) -> None:
        settings = {name: value for name, value in primary.settings.items() if name != "port"}
        settings.update(
            hot_standby_feedback="on",
            primary_slot_name=slot_name,
            # dbname: the slot sync worker connects to a database of the primary.
            primary_conninfo=f"host={primary.host} port={primary.port} user={primary.user} dbname=postgres "
            f"application_name={slot_name}",
        )
        if sync_slots:
            settings["sync_replication_slots"] = "on"
        settings.update(extra_settings or {})
        super().__init__(settings, bindir=primary.bindir, os_user=primary.os_user)
        self.primary = primary
        self.slot_name = slot_name

    def _create_datadir(self, bindir: Path, datadir: Path, run_kwargs: dict[str, Any]) -> None:
        del bindir
        primary = self.primary
        with primary.connect() as conn:
            if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (self.slot_name,)).fetchone():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (self.slot_name,))
            # Reserved now: the WAL from the backup's start stays until the standby has streamed it.
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (self.slot_name,))
        with primary.connect() as backup:
            modern = int(backup.info.server_version) >= 150000
            start, stop = (
                ("pg_backup_start(%s, true)", "pg_backup_stop(true)")
                if modern
                else ("pg_start_backup(%s, true, false)", "pg_stop_backup(false, true)")
            )
            backup.execute(sql.SQL("SELECT " + start), ("pgdecode_standby",))
            copied = subprocess.run(
                ["cp", "-a", str(primary.datadir), str(datadir)],
                capture_output=True,
                text=True,
                check=False,
                **run_kwargs,
            )
            row = backup.execute(sql.SQL("SELECT labelfile FROM " + stop)).fetchone()
        # Files the primary removed while they were copied are fine: the WAL replay recreates them.
        errors = [line for line in copied.stderr.splitlines() if "No such file or directory" not in line]
        if copied.returncode != 0 and errors:
            raise ClusterError(f"copying the primary's data directory failed: {' '.join(errors)}")
        assert row is not None
        removed = " ".join(str(datadir / name) for name in _NOT_COPIED)
        self._run(
            ["bash", "-c", f"rm -rf {removed} && cat > {datadir}/backup_label && touch {datadir}/standby.signal"],
            run_kwargs,
            what="preparing the standby's data directory",
            input=row[0],
        )

    def catch_up(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        with self.primary.connect() as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while True:
                replayed = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
                if replayed is not None and replayed[0]:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(f"the standby did not replay up to {target} within {timeout:g}s")
                time.sleep(0.05)

    def promote(self) -> None:
        """Promote the standby to a primary (``pg_ctl promote``), waiting until it is one."""
        proc = subprocess.run(
            [str(self.bindir / "pg_ctl"), "promote", "-D", str(self.datadir), "-w", "-t", "60"],
            capture_output=True,
            text=True,
            check=False,
            **self._run_kwargs(),
        )
        if proc.returncode != 0:
            raise ClusterError(f"pg_ctl promote failed (exit {proc.returncode}): {proc.stderr.strip()}")
