"""Airflow hook for logical replication slots over a ``postgres`` connection."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg.conninfo import make_conninfo

from airflow_provider_pgdecode.batch.options import yes_or_no
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, ReplicaIdentity
from airflow_provider_pgdecode.postgres.health import describe_loss, lost_reason
from airflow_provider_pgdecode.postgres.readiness import check_readiness, describe_readiness, read_server_facts
from airflow_provider_pgdecode.postgres.slot import PeekRows, SlotClient, SlotInfo
from airflow_provider_pgdecode.postgres.standby import PrimaryLink

if TYPE_CHECKING:
    from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
    from airflow_provider_pgdecode.batch.manifest import BatchManifest
    from airflow_provider_pgdecode.batch.storage import Storage
    from airflow_provider_pgdecode.capture.reconcile import Reconciliation


class PgDecodeHook(PostgresHook):
    """Slot lifecycle, bounded peeks, advancing, heartbeats and catalog lookups.

    A :class:`~airflow.providers.postgres.hooks.postgres.PostgresHook` (the same fields and
    extras: ssl, IAM, ``options``), whose connection is opened lazily in autocommit mode on first
    use and reused by the methods here. Close it with :meth:`close` (or use the hook as a
    context manager).

    Its connection type is ``pgdecode``: for a connection of that type, :meth:`test_connection`
    (``airflow connections test``, the UI's Test button) checks what a slot needs, for the output
    plugin and two-phase setting given here or in the connection's extra (``{"plugin": "pgoutput",
    "two_phase": false}``; these two keys are not passed to the driver). A ``postgres`` connection
    works too, but Airflow tests it with the Postgres provider's ``select 1``, which says nothing
    about ``wal_level`` or replication.

    Decoding on a physical standby (PostgreSQL 16+): point the connection at the standby and name
    the primary's Airflow connection in the extra as ``primary_conn_id``; pgdecode writes its own
    WAL records (heartbeats, table snapshot watermarks) there and asks the primary to log the
    running transactions a slot's creation on the standby waits for (docs/standby.md).

    :param postgres_conn_id: the Airflow connection id of the source database
        (default ``pgdecode_default``).
    :param plugin: the output plugin :meth:`test_connection` checks for; default the extra's
        ``plugin``, else ``test_decoding``.
    :param two_phase: whether :meth:`test_connection` checks for two-phase slots; default the
        extra's ``two_phase``, else True (the ``pgdecode_incremental`` DAG creates two-phase slots).
    :param kwargs: passed to :class:`PostgresHook` (e.g. ``options``, ``database``).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = "pgdecode_default"
    conn_type = "pgdecode"
    hook_name = "PostgreSQL logical decoding (pgdecode)"
    #: Extras read by pgdecode itself, not libpq connection parameters.
    ignored_extra_options = PostgresHook.ignored_extra_options | {"plugin", "two_phase", "primary_conn_id"}

    def __init__(self, *args: Any, plugin: str | None = None, two_phase: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot_client: SlotClient | None = None
        self._primary: PrimaryLink | None = None
        self.plugin = plugin
        self.two_phase = two_phase

    def __enter__(self) -> PgDecodeHook:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_slot_client(self) -> SlotClient:
        """A :class:`SlotClient` on this hook's autocommit connection (opened on first call)."""
        client = self._slot_client
        if client is None or client.conn.closed:
            conn = self.get_conn()
            if not isinstance(conn, psycopg.Connection):
                raise TypeError(
                    "PgDecodeHook needs psycopg 3 connections, but PostgresHook returned "
                    f"{type(conn).__module__}.{type(conn).__name__}; install psycopg 3 and SQLAlchemy 2"
                )
            # PostgresHook.get_conn() leaves autocommit off; slot creation needs it on.
            conn.autocommit = True
            client = self._slot_client = SlotClient(conn, primary=self.primary_link())
        return client

    def primary_link(self) -> PrimaryLink | None:
        """The way to the primary named by the connection's ``primary_conn_id`` extra (for a source
        connection that points at a standby), or ``None``; its connection is opened on first use."""
        if self._primary is None:
            conn_id = self.get_connection(self.get_conn_id()).extra_dejson.get("primary_conn_id")
            if conn_id:
                self._primary = PrimaryLink(lambda: _autocommit(PostgresHook(postgres_conn_id=conn_id)), conn_id)
        return self._primary

    def dsn(self) -> str:
        """The libpq connection string of this hook's connection, password included (for
        connections opened elsewhere: the replication connection of an initial load)."""
        info = self.get_slot_client().conn.info
        return make_conninfo(info.dsn, password=info.password) if info.password else info.dsn

    def slot_requirements(self) -> tuple[str, bool]:
        """``(plugin, two_phase)`` that :meth:`test_connection` checks for: the hook's arguments, else
        the connection's extra, else ``test_decoding`` with two-phase."""
        extra = self.get_connection(self.get_conn_id()).extra_dejson
        plugin = self.plugin or extra.get("plugin") or "test_decoding"
        two_phase = self.two_phase if self.two_phase is not None else extra.get("two_phase", True)
        return str(plugin), yes_or_no(two_phase) is not False

    def test_connection(self) -> tuple[bool, str]:  # type: ignore[override]  # DbApiHook is unannotated
        """Check that a slot can be created and read over this connection; never raises.

        Checks ``wal_level = logical``, the role's REPLICATION (or superuser) attribute, a free
        replication slot and WAL sender, ``max_prepared_transactions > 0`` when two-phase is asked
        (:meth:`slot_requirements`), and the server version for the plugin and protocol
        (:func:`~airflow_provider_pgdecode.postgres.readiness.check_readiness`).

        :return: ``(True, what was checked)``, or ``(False, every problem with its fix)``.
        """
        opened_here = self._slot_client is None
        try:
            plugin, two_phase = self.slot_requirements()
            facts = read_server_facts(self.get_slot_client().conn)
        except Exception as exc:
            return False, f"cannot check connection {self.get_conn_id()!r}: {type(exc).__name__}: {str(exc).strip()}"
        finally:
            if opened_here:
                self.close()
        problems = check_readiness(facts, plugin=plugin, two_phase=two_phase)
        asked = f"{plugin} slots" + (" with two-phase decoding" if two_phase else "")
        if problems:
            listed = " ".join(f"({n}) {p.message}." for n, p in enumerate(problems, 1))
            return False, f"{len(problems)} problem(s) keep {asked} from working on this server: {listed}"
        return True, f"ready for {asked}: {describe_readiness(facts, plugin=plugin, two_phase=two_phase)}"

    def get_catalog(self) -> Catalog:
        """A :class:`Catalog` on the same connection as :meth:`get_slot_client`."""
        return Catalog(self.get_slot_client().conn)

    def close(self) -> None:
        """Close the connection opened by :meth:`get_slot_client`, if any."""
        if self._slot_client is not None:
            self._slot_client.conn.close()
            self._slot_client = None
        if self._primary is not None:
            self._primary.close()

    def cancel(self, timeout: float = 10.0) -> None:
        """Cancel the statement running on this hook's connection (e.g. a long peek), if any.

        Safe to call from another thread; the interrupted call raises in its own thread.
        """
        client = self._slot_client
        if client is not None and not client.conn.closed:
            client.conn.cancel_safe(timeout=timeout)

    def create_slot(
        self,
        slot_name: str,
        plugin: str = "test_decoding",
        two_phase: bool = False,
        temporary: bool = False,
        failover: bool = False,
    ) -> SlotInfo:
        """Create a logical replication slot.

        :param slot_name: the slot's name (``[a-z0-9_]``, up to 63 characters).
        :param plugin: the output plugin, ``test_decoding`` or ``pgoutput``.
        :param two_phase: decode prepared transactions at PREPARE time (needs max_prepared_transactions > 0).
        :param temporary: drop the slot when this hook's session ends.
        :param failover: synchronise the slot to standbys (PostgreSQL 17+) so it survives a failover.
        """
        return self.get_slot_client().create(
            slot_name, plugin=plugin, two_phase=two_phase, temporary=temporary, failover=failover
        )

    def ensure_slot(
        self, slot_name: str, plugin: str = "test_decoding", two_phase: bool = False, failover: bool = False
    ) -> SlotInfo:
        """Return the slot, creating it when missing; raise SlotError when it cannot serve as asked.

        :param slot_name: the slot's name.
        :param plugin: the output plugin the slot must use.
        :param two_phase: whether the slot must decode two-phase transactions.
        :param failover: create it as a failover slot (PostgreSQL 17+); an existing slot keeps its setting.
        """
        return self.get_slot_client().ensure(slot_name, plugin=plugin, two_phase=two_phase, failover=failover)

    def drop_slot(self, slot_name: str, missing_ok: bool = True) -> bool:
        """Drop the slot, and its upper-half slot ``<slot_name>_upper`` when there is one (README,
        "Two decoding sessions"); returns whether the slot existed.

        :param slot_name: the slot's name.
        :param missing_ok: when False, a missing slot raises SlotError.
        """
        return self.get_slot_client().drop(slot_name, missing_ok=missing_ok)

    def describe_slot(self, slot_name: str) -> SlotInfo:
        """The slot's state and lag; SlotError when missing.

        :param slot_name: the slot's name.
        """
        return self.get_slot_client().describe(slot_name)

    def recoverable_loss(self, slot_name: str, on_slot_lost: str | None) -> str | None:
        """With ``on_slot_lost = resnapshot``: why the slot is lost, as the tasks before the extract
        (which recovers it) log it; ``None`` when the slot is not lost, missing, or the policy is ``fail``.

        :param slot_name: the slot's name.
        :param on_slot_lost: the cycle's policy (:mod:`~airflow_provider_pgdecode.capture.recovery`).
        """
        from airflow_provider_pgdecode.capture.recovery import RESNAPSHOT

        if on_slot_lost != RESNAPSHOT:
            return None
        info = self.get_slot_client().find(slot_name)
        reason = lost_reason(info) if info is not None else None
        if reason is None:
            return None
        return (
            f"replication slot {slot_name!r} was lost ({describe_loss(reason)}); on_slot_lost = resnapshot: the "
            "extract recreates it and reloads the pipeline's tables from a new snapshot"
        )

    def idle_slots(self, min_lag_bytes: int, besides: str) -> list[SlotInfo]:
        """The cluster's other logical slots that no process uses and that hold back more than
        ``min_lag_bytes`` of WAL (:meth:`SlotClient.idle_slots`).

        :param min_lag_bytes: report slots lagging the server's WAL by more bytes.
        :param besides: the slot not to report (the caller's own).
        """
        return self.get_slot_client().idle_slots(min_lag_bytes, besides)

    def peek_changes(
        self,
        slot_name: str,
        upto_lsn: Lsn,
        options: Sequence[tuple[str, str]] = (),
        chunk_size: int = 10000,
    ) -> PeekRows:
        """Stream ``(lsn, xid, data)`` rows up to ``upto_lsn`` without consuming them.

        :param slot_name: the slot's name.
        :param upto_lsn: the ceiling LSN, fixed at the start of the run.
        :param options: output plugin options as ``(name, value)`` pairs.
        :param chunk_size: rows fetched per round trip from the server-side cursor.
        """
        return self.get_slot_client().peek(slot_name, upto_lsn, options=options, chunk_size=chunk_size)

    def advance_slot(self, slot_name: str, lsn: Lsn) -> Lsn:
        """Confirm the slot up to ``lsn`` (never backwards), moving its upper-half slot along;
        returns its new position.

        :param slot_name: the slot's name.
        :param lsn: the end LSN of the last change durably stored.
        """
        return self.get_slot_client().advance(slot_name, lsn)

    def emit_heartbeat(self, prefix: str = "pgdecode.heartbeat", content: str = "") -> Lsn:
        """Write and flush a non-transactional logical message; returns its LSN.

        :param prefix: the message prefix.
        :param content: the message content.
        """
        return self.get_slot_client().heartbeat(prefix=prefix, content=content)

    def oldest_prepared(self) -> datetime | None:
        """When the oldest transaction still prepared in the database was prepared, or ``None``."""
        return self.get_slot_client().oldest_prepared()

    def current_flush_lsn(self) -> Lsn:
        """The server's WAL flush position: the ceiling a peek can reach."""
        return self.get_slot_client().current_flush_lsn()

    def extract_batch(
        self,
        slot_name: str,
        staging_root: str | os.PathLike[str] | Storage,
        *,
        plugin: str = "test_decoding",
        checkpoint: Checkpoint | Reconciliation | None = None,
        upto_lsn: Lsn | None = None,
        tables: Collection[str | tuple[str, str]] | None = None,
        **options: Any,
    ) -> BatchManifest:
        """Stage the slot's changes as one batch on this hook's connection.

        Delegates to :func:`airflow_provider_pgdecode.capture.extract.extract_batch`, which
        documents the parameters (``options``: ``chunk_rows``, ``part_rows``, ``memory_items``,
        ``progress_every``).
        """
        from airflow_provider_pgdecode.capture.extract import extract_batch

        return extract_batch(
            self.get_slot_client().conn,
            slot_name,
            staging_root,
            plugin=plugin,
            checkpoint=checkpoint,
            upto_lsn=upto_lsn,
            tables=tables,
            primary=self.primary_link(),
            **options,
        )

    def columns(self, schema: str, table: str) -> list[ColumnInfo]:
        """The table's live columns in attnum order.

        :param schema: the schema name as stored (unquoted).
        :param table: the table name as stored (unquoted).
        """
        return self.get_catalog().columns(schema, table)

    def primary_key(self, schema: str, table: str) -> list[str]:
        """The table's primary key columns in index order (empty when none).

        :param schema: the schema name as stored (unquoted).
        :param table: the table name as stored (unquoted).
        """
        return self.get_catalog().primary_key(schema, table)

    def replica_identity(self, schema: str, table: str) -> ReplicaIdentity:
        """The table's replica identity and its columns.

        :param schema: the schema name as stored (unquoted).
        :param table: the table name as stored (unquoted).
        """
        return self.get_catalog().replica_identity(schema, table)


def _autocommit(hook: PostgresHook) -> psycopg.Connection[Any]:
    conn = hook.get_conn()
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(f"the primary's connection {hook.get_conn_id()!r} did not give a psycopg 3 connection")
    conn.autocommit = True
    return conn


PgDecodeConnectionHook = PgDecodeHook
"""The former name of :class:`PgDecodeHook` under the ``pgdecode`` connection type (now its own)."""
