"""The replication connection that creates a slot and exports its snapshot (psycopg2, no Airflow).

A logical slot created over a replication connection can export the snapshot in which its
decoding starts (``CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')``); the snapshot can be
imported by other sessions (:func:`~airflow_provider_pgdecode.postgres.snapshot_queries.import_snapshot`)
only while that connection stays open, so :func:`replication_connection` is a context manager.
psycopg 3 speaks no replication protocol: this is the one place psycopg2 is used.

Example::

    with replication_connection(dsn, "pgdecode_shop") as repl:
        snapshot = repl.create_slot_exporting_snapshot("pgdecode_shop", "pgoutput", two_phase=True)
        ...  # copy inside snapshot.snapshot_name while the block is open
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.postgres.readiness import slot_creation_error
from airflow_provider_pgdecode.postgres.standby import PrimaryLink, primary_logs_snapshots

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


class ExportedSnapshot(NamedTuple):
    """The slot's consistent point and the name of the snapshot exported with it."""

    consistent_lsn: Lsn
    snapshot_name: str


def check_slot_name(slot_name: str) -> None:
    """:class:`SlotError` unless PostgreSQL accepts the name: replication commands take it unquoted."""
    if not _SLOT_NAME.match(slot_name):
        raise SlotError(
            f"invalid slot name {slot_name!r}: PostgreSQL allows lower-case letters, digits and underscores (at most 63)"
        )


class ReplicationConnection:
    """One open logical replication connection (psycopg2's ``LogicalReplicationConnection``)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.created: str | None = None
        """The slot this connection created, once ``CREATE_REPLICATION_SLOT`` succeeded (even when
        its reply is then refused): the one to drop when what follows fails."""

    @property
    def server_version(self) -> int:
        return int(self.conn.server_version)

    def in_recovery(self) -> bool:
        """Whether the server is a standby (a replication connection runs SQL too)."""
        cur = self.conn.cursor()
        cur.execute("SELECT pg_is_in_recovery()")
        return bool(cur.fetchone()[0])

    def create_slot_exporting_snapshot(
        self,
        slot_name: str,
        plugin: str,
        two_phase: bool,
        *,
        temporary: bool = False,
        primary: PrimaryLink | None = None,
    ) -> ExportedSnapshot:
        """``CREATE_REPLICATION_SLOT`` with an exported snapshot; its consistent point and snapshot name.

        Waits until every transaction running at that moment has ended (prepared ones too):
        PostgreSQL needs that to reach a consistent point. A two-phase slot with an exported
        snapshot needs PostgreSQL 15 (the option syntax); older servers get the old syntax.
        ``temporary``: the slot vanishes with this connection (a verify run only needs the
        snapshot and its LSN, never the slot's changes). ``primary``: on a standby, its primary, asked
        to log the running transactions the creation waits for.
        """
        import psycopg2

        check_slot_name(slot_name)
        cur = self.conn.cursor()
        kind = "TEMPORARY LOGICAL" if temporary else "LOGICAL"
        if self.server_version >= 150000:
            options = "SNAPSHOT 'export'" + (", TWO_PHASE" if two_phase else "")
            command = f"CREATE_REPLICATION_SLOT {slot_name} {kind} {plugin} ({options})"
        elif two_phase:
            raise SlotError(
                f"creating a two-phase slot with an exported snapshot needs PostgreSQL 15 or later (server "
                f"{self.server_version}); pass two_phase=False"
            )
        else:
            command = f"CREATE_REPLICATION_SLOT {slot_name} {kind} {plugin} EXPORT_SNAPSHOT"
        try:
            with primary_logs_snapshots(primary, slot_name) if self.in_recovery() else nullcontext():
                cur.execute(command)
        except psycopg2.errors.DuplicateObject:
            raise SlotError(
                f"slot {slot_name!r} already exists: an initial load needs a new slot (its snapshot is exported only "
                "when it is created). Drop the slot first, or choose another name."
            ) from None
        except psycopg2.Error as exc:
            said = getattr(exc.diag, "message_primary", None) or str(exc).strip()
            info = self.conn.info
            where = f"database {info.dbname!r} on {info.host}:{info.port}"
            translated = slot_creation_error(
                slot_name, where, exc.pgcode, said, plugin=plugin, two_phase=two_phase, role=info.user
            )
            raise (translated or SlotError(f"cannot create slot {slot_name!r}: {str(exc).strip()}")) from None
        self.created = None if temporary else slot_name
        names = [d.name for d in cur.description]
        row = dict(zip(names, cur.fetchone()))
        for column in ("slot_name", "consistent_point", "snapshot_name", "output_plugin"):
            if row.get(column) is None:
                raise SlotError(
                    f"CREATE_REPLICATION_SLOT for {slot_name!r} returned no {column} (reply columns {names})"
                )
        return ExportedSnapshot(Lsn.parse(row["consistent_point"]), row["snapshot_name"])

    def drop_slot(self, slot_name: str) -> None:
        """``DROP_REPLICATION_SLOT``: the slot must not be in use (this connection's own slot is not)."""
        check_slot_name(slot_name)
        self.conn.cursor().execute(f"DROP_REPLICATION_SLOT {slot_name}")


@contextmanager
def replication_connection(dsn: str, slot_name: str) -> Iterator[ReplicationConnection]:
    """A logical replication connection to ``dsn``'s database, closed when the block ends.

    ``slot_name`` is checked first and named in the error when the connection is refused.
    """
    import psycopg2
    import psycopg2.extras

    check_slot_name(slot_name)
    try:
        conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    except psycopg2.Error as exc:
        params = psycopg2.extensions.parse_dsn(dsn)
        where = f"database {params.get('dbname')!r} on {params.get('host')}:{params.get('port', 5432)}"
        translated = slot_creation_error(
            slot_name, where, exc.pgcode, str(exc).strip(), plugin="", role=params.get("user")
        )
        if translated is not None:
            raise translated from None
        raise SlotError(
            f"cannot open a replication connection to create slot {slot_name!r}: {str(exc).strip()}. The user needs "
            "the REPLICATION attribute and pg_hba.conf must allow its connection (a 'database' line serves "
            "logical replication connections)."
        ) from None
    try:
        yield ReplicationConnection(conn)
    finally:
        conn.close()


__all__ = [
    "ExportedSnapshot",
    "ReplicationConnection",
    "check_slot_name",
    "replication_connection",
]
