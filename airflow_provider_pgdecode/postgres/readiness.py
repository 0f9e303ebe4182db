"""Can this server and role hold pgdecode's slots? The facts, the checks, and one wording per problem.

Three users, one sentence per problem:

* the connection test (:meth:`PgDecodeHook.test_connection
  <airflow_provider_pgdecode.hooks.pgdecode.PgDecodeHook.test_connection>`, behind ``airflow
  connections test`` and the UI's Test button) reads :class:`ServerFacts` with
  :func:`read_server_facts` and lists every :class:`Problem` :func:`check_readiness` finds;
* slot creation (:meth:`SlotClient.create <airflow_provider_pgdecode.postgres.slot.SlotClient.create>`
  and the replication connection of an initial load) turns PostgreSQL's own refusal into
  :func:`slot_creation_error`, which names the slot, the server and the same fix;
* anyone else who wants the sentence calls the wording function itself (:func:`wal_level_not_logical`, ...).

Each wording says what is missing and the setting or statement that fixes it. The checks are
pure (facts in, problems out), so they are tested without a server; the facts come from one
query that any role may run.

Example::

    from airflow_provider_pgdecode.postgres.readiness import check_readiness, read_server_facts

    facts = read_server_facts(conn)
    for problem in check_readiness(facts, plugin="pgoutput", two_phase=True):
        print(problem.setting, problem.message)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.decoding.pgoutput import max_proto_version
from airflow_provider_pgdecode.errors import ServerNotReadyError
from airflow_provider_pgdecode.postgres.standby import (
    STANDBY_DECODING_SERVER_VERSION,
    primary_wal_level_not_logical,
    standby_decoding_needs_newer_server,
    standby_feedback_off,
)

PLUGINS = SUPPORTED_PLUGINS
"""The output plugins pgdecode reads."""

MIN_SERVER_VERSION = 110000
"""pgdecode confirms batches with ``pg_replication_slot_advance``, which PostgreSQL 11 added."""

TWO_PHASE_SERVER_VERSION = 140000
"""Two-phase decoding (``twophase => true`` at slot creation) came with PostgreSQL 14."""

PGOUTPUT_TWO_PHASE_SERVER_VERSION = 150000
"""pgoutput decodes two-phase transactions from protocol 3, which PostgreSQL 15 speaks."""

FAILOVER_SERVER_VERSION = 170000
"""Failover slots (``failover => true``, synchronised to standbys) came with PostgreSQL 17, with
``pg_replication_slots.invalidation_reason`` and ``inactive_since``."""

TWO_PHASE_FAILOVER_SERVER_VERSION = 180000
"""PostgreSQL 18 synchronises a slot's ``two_phase_at`` to standbys; before, a slot that is both
two-phase and failover could skip prepared transactions after a promotion."""

_RESTART = "in postgresql.conf (or ALTER SYSTEM SET ...) and restart PostgreSQL"


@dataclass(frozen=True)
class ServerFacts:
    """What a slot needs to know about a server and the connected role (:func:`read_server_facts`).

    :param server_version_num: e.g. ``150018``.
    :param wal_level: ``minimal``, ``replica`` or ``logical``.
    :param role: the connected role (``current_user``).
    :param replication: the role has the REPLICATION attribute (or, on Amazon RDS and Aurora, is a
        member of ``rds_replication``).
    :param superuser: the role is a superuser.
    :param max_replication_slots: the server's limit.
    :param replication_slots_used: slots that exist (of any kind, in any database).
    :param max_wal_senders: the server's limit of replication connections.
    :param wal_senders_used: replication connections open now.
    :param max_prepared_transactions: 0 turns prepared transactions off.
    :param in_recovery: the server is a standby.
    :param hot_standby_feedback: the standby reports its oldest snapshot to the primary.
    """

    server_version_num: int
    wal_level: str
    role: str
    replication: bool
    superuser: bool
    max_replication_slots: int
    replication_slots_used: int
    max_wal_senders: int
    wal_senders_used: int
    max_prepared_transactions: int
    in_recovery: bool = False
    hot_standby_feedback: bool = False

    @property
    def server_version(self) -> str:
        """``15.18`` for 150018."""
        return format_server_version(self.server_version_num)


def format_server_version(num: int) -> str:
    """``15.18`` for 150018 (``9.6.24`` style before PostgreSQL 10)."""
    if num >= 100000:
        return f"{num // 10000}.{num % 10000}"
    return f"{num // 10000}.{num // 100 % 100}.{num % 100}"


@dataclass(frozen=True)
class Problem:
    """One thing the server or role lacks for a slot.

    :param setting: what to change: a server setting (``wal_level``, ``max_replication_slots``,
        ``max_wal_senders``, ``max_prepared_transactions``), ``REPLICATION`` (the role's
        attribute), ``server_version`` or ``plugin``.
    :param message: what is missing and how to fix it, one sentence.
    """

    setting: str
    message: str


# -- one wording per problem -------------------------------------------------------------------


def wal_level_not_logical(wal_level: str | None) -> str:
    """The server does not write the WAL logical decoding reads."""
    actual = f"wal_level is {wal_level!r}" if wal_level else "wal_level is below 'logical'"
    return f"{actual}, and logical decoding needs 'logical': set wal_level = logical {_RESTART}"


def role_lacks_replication(role: str | None) -> str:
    """The role may not create or use replication slots."""
    who = f"role {role!r}" if role else "the connection's role"
    name = f'"{role}"' if role else "<role>"
    return (
        f"{who} has neither the REPLICATION attribute nor superuser, which replication slots need: "
        f"run ALTER ROLE {name} WITH REPLICATION as a superuser, or connect as a role that has it"
    )


def replication_slots_exhausted(max_slots: int | None, used: int | None) -> str:
    """No slot can be created: the server's limit is reached (or zero)."""
    if max_slots == 0:
        return (
            f"max_replication_slots is 0, so the server holds no replication slots: set max_replication_slots to "
            f"the slots you need plus a margin (e.g. 10) {_RESTART}"
        )
    count = f"{used} of max_replication_slots = {max_slots}" if max_slots is not None else "all"
    return (
        f"{count} replication slots are in use, so no new slot can be created: drop slots nothing reads "
        "(they also retain WAL; SELECT slot_name, active FROM pg_replication_slots lists them) or raise "
        f"max_replication_slots {_RESTART}"
    )


def wal_senders_exhausted(max_senders: int | None, used: int | None) -> str:
    """No replication connection can be opened (an initial load's exported snapshot needs one)."""
    if max_senders == 0:
        state = "max_wal_senders is 0, so the server accepts no replication connection"
    elif max_senders is not None:
        state = f"{used} of max_wal_senders = {max_senders} replication connections are in use"
    else:
        state = "all max_wal_senders replication connections are in use"
    return (
        f"{state}, and an initial load (pgdecode_backfill) opens one to export its snapshot: raise max_wal_senders "
        f"{_RESTART}, or end replication connections nothing needs (pg_stat_replication lists them)"
    )


def prepared_transactions_off(max_prepared: int | None = 0) -> str:
    """Two-phase decoding asked for, but the server has prepared transactions turned off."""
    return (
        f"max_prepared_transactions is {max_prepared if max_prepared is not None else 0}, and two-phase decoding "
        f"needs it above 0: set max_prepared_transactions > 0 (e.g. 20) {_RESTART}, or use slots without "
        "two-phase decoding (two_phase=False)"
    )


def server_too_old(version: str) -> str:
    """The server lacks a function pgdecode always uses."""
    return (
        f"PostgreSQL {version} is too old: pgdecode needs PostgreSQL 11 or later (pg_replication_slot_advance); "
        "upgrade the server"
    )


def failover_needs_newer_server(version: str) -> str:
    """A failover slot asked for on a server older than 17."""
    return (
        f"failover slots need PostgreSQL 17 or later (this server is {version}); create the slot without "
        "failover, and after a failover recreate it on the new primary and re-snapshot the tables with the "
        "pgdecode_backfill DAG"
    )


def two_phase_failover_unsafe(version: str) -> str:
    """A slot both two-phase and failover asked for on PostgreSQL 17."""
    return (
        f"on PostgreSQL {version} a slot that is both two-phase and failover may skip prepared transactions "
        "after a promotion (the standby's copy lacks two_phase_at; PostgreSQL 18 carries it): create the "
        "failover slot without two-phase decoding (two_phase=False; a prepared transaction then arrives whole "
        "at its COMMIT PREPARED and Delta gets the same rows), or upgrade to PostgreSQL 18"
    )


def two_phase_needs_newer_server(version: str, plugin: str) -> str:
    """Two-phase decoding asked for on a server (or with a plugin) that cannot do it."""
    if plugin == "pgoutput":
        needed = "PostgreSQL 15 or later with pgoutput (protocol 3)"
        other = "use test_decoding (two-phase from PostgreSQL 14)"
    else:
        needed = "PostgreSQL 14 or later"
        other = None
    return (
        f"two-phase decoding needs {needed}, and this server is PostgreSQL {version}: upgrade the server, "
        + (f"{other}, " if other else "")
        + "or use slots without two-phase decoding (two_phase=False)"
    )


def plugin_missing(plugin: str, detail: str | None = None) -> str:
    """The server has no library of that output plugin."""
    cause = f" ({detail})" if detail else ""
    if plugin == "test_decoding":
        fix = "install PostgreSQL's contrib modules on the server (Debian: the postgresql-<major> package; "
        fix += "RHEL: postgresql<major>-contrib) or use pgoutput, which is built in"
    else:
        fix = f"install {plugin!r} on the server or use {' or '.join(PLUGINS)}"
    return f"output plugin {plugin!r} is not installed on the server{cause}: {fix}"


# -- the facts and the checks ------------------------------------------------------------------

_FACTS_SQL = """
SELECT current_setting('server_version_num')::int,
       current_setting('wal_level'),
       r.rolname::text,
       r.rolreplication OR EXISTS (
           -- Amazon RDS and Aurora grant replication through this role, not the attribute.
           SELECT 1 FROM pg_roles g WHERE g.rolname = 'rds_replication' AND pg_has_role(r.oid, g.oid, 'MEMBER')
       ),
       r.rolsuper,
       current_setting('max_replication_slots')::int,
       (SELECT count(*) FROM pg_replication_slots)::int,
       current_setting('max_wal_senders')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender')::int,
       current_setting('max_prepared_transactions')::int,
       pg_is_in_recovery(),
       current_setting('hot_standby_feedback')::bool
  FROM pg_roles r
 WHERE r.rolname = current_user
"""


def read_server_facts(conn: psycopg.Connection[Any]) -> ServerFacts:
    """The :class:`ServerFacts` of ``conn``'s server and role, in one read-only query any role may run."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(_FACTS_SQL)
        row = cur.fetchone()
    if row is None:  # pragma: no cover - current_user is always in pg_roles
        raise ServerNotReadyError("the connected role is not in pg_roles")
    return ServerFacts(
        server_version_num=int(row[0]),
        wal_level=str(row[1]),
        role=str(row[2]),
        replication=bool(row[3]),
        superuser=bool(row[4]),
        max_replication_slots=int(row[5]),
        replication_slots_used=int(row[6]),
        max_wal_senders=int(row[7]),
        wal_senders_used=int(row[8]),
        max_prepared_transactions=int(row[9]),
        in_recovery=bool(row[10]),
        hot_standby_feedback=bool(row[11]),
    )


def check_readiness(facts: ServerFacts, *, plugin: str = "test_decoding", two_phase: bool = False) -> list[Problem]:
    """Every problem that keeps a slot of ``plugin`` (two-phase when asked) from being created and read.

    An empty list means the server and role are ready. Each :class:`Problem` names the setting to
    change; the order is the order to fix them in (server settings that need a restart first).
    """
    problems: list[Problem] = []
    version = facts.server_version
    if facts.server_version_num < MIN_SERVER_VERSION:
        problems.append(Problem("server_version", server_too_old(version)))
    if plugin not in PLUGINS:
        problems.append(Problem("plugin", plugin_unknown(plugin)))
    if facts.wal_level != "logical":
        problems.append(Problem("wal_level", wal_level_not_logical(facts.wal_level)))
    if facts.replication_slots_used >= facts.max_replication_slots:
        problems.append(
            Problem(
                "max_replication_slots",
                replication_slots_exhausted(facts.max_replication_slots, facts.replication_slots_used),
            )
        )
    if facts.wal_senders_used >= facts.max_wal_senders:
        problems.append(
            Problem("max_wal_senders", wal_senders_exhausted(facts.max_wal_senders, facts.wal_senders_used))
        )
    if two_phase:
        needed = PGOUTPUT_TWO_PHASE_SERVER_VERSION if plugin == "pgoutput" else TWO_PHASE_SERVER_VERSION
        if facts.server_version_num < needed:
            problems.append(Problem("server_version", two_phase_needs_newer_server(version, plugin)))
        if facts.max_prepared_transactions <= 0:
            problems.append(
                Problem("max_prepared_transactions", prepared_transactions_off(facts.max_prepared_transactions))
            )
    if not (facts.replication or facts.superuser):
        problems.append(Problem("REPLICATION", role_lacks_replication(facts.role)))
    if facts.in_recovery and facts.server_version_num < STANDBY_DECODING_SERVER_VERSION:
        problems.append(Problem("server_version", standby_decoding_needs_newer_server(version)))
    elif facts.in_recovery and not facts.hot_standby_feedback:
        problems.append(Problem("hot_standby_feedback", standby_feedback_off()))
    return problems


def describe_readiness(facts: ServerFacts, *, plugin: str = "test_decoding", two_phase: bool = False) -> str:
    """What was checked and found, for a connection test that passed: one line."""
    role = "superuser" if facts.superuser else "REPLICATION"
    free = facts.max_replication_slots - facts.replication_slots_used
    slots = f"{free} of {facts.max_replication_slots} replication slots free"
    # A large batch is decoded in two sessions, the upper half over a temporary copy of the slot
    # or, for two-phase test_decoding, a second slot kept beside it (made while two are free).
    upper = two_phase and plugin == "test_decoding"
    if free < (3 if upper else 2):
        second = "a second slot kept beside it (<slot>_upper)" if upper else "a copy of the slot while they run"
        slots += (
            f" (too few for large batches to decode in two sessions: they need {second}, "
            f"and one slot left free; they decode in one)"
        )
    parts = [
        f"PostgreSQL {facts.server_version}",
        f"wal_level={facts.wal_level}",
        f"role {facts.role!r} has {role}",
        slots,
        f"{facts.max_wal_senders - facts.wal_senders_used} of {facts.max_wal_senders} WAL senders free",
    ]
    if facts.in_recovery:
        parts.append("a standby with hot_standby_feedback (pgdecode's own WAL records go to primary_conn_id)")
    if two_phase:
        parts.append(f"two-phase: max_prepared_transactions={facts.max_prepared_transactions}")
    else:
        parts.append("two-phase not asked")
    if plugin == "pgoutput":
        parts.append(f"plugin pgoutput, protocol up to {max_proto_version(facts.server_version_num)}")
    else:
        parts.append(f"plugin {plugin}")
    return "; ".join(parts)


# -- PostgreSQL's refusals, translated ---------------------------------------------------------


def slot_creation_error(
    name: str,
    where: str,
    sqlstate: str | None,
    message: str,
    *,
    plugin: str,
    two_phase: bool = False,
    role: str | None = None,
) -> ServerNotReadyError | None:
    """The :class:`ServerNotReadyError` for PostgreSQL's refusal to create slot ``name``, when it is
    one a setting or privilege fixes; ``None`` for any other error.

    Works on any driver's error: pass its SQLSTATE and primary message (``diag.message_primary``).

    :param where: the server, as ``database 'shop' on host:5432``.
    :param plugin: the slot's output plugin (for a missing plugin).
    :param two_phase: whether a two-phase slot was asked for.
    :param role: the connected role (named in the fix for a missing REPLICATION attribute).
    """
    text = message or ""
    reason: str | None = None
    if "on the primary" in text and "wal_level" in text:
        reason = primary_wal_level_not_logical()
    elif "while in recovery" in text:
        reason = standby_decoding_needs_newer_server("older than 16")
    elif "wal_level" in text:
        reason = wal_level_not_logical(None)
    elif sqlstate == "42501" or "replication role" in text or "REPLICATION attribute" in text:
        reason = role_lacks_replication(role)
    elif "max_replication_slots > 0" in text:
        reason = replication_slots_exhausted(0, 0)
    elif sqlstate == "53400" or "replication slots are in use" in text:
        reason = replication_slots_exhausted(None, None)
    elif "max_wal_senders" in text:
        limit = re.search(r"max_wal_senders \(currently (\d+)\)", text)
        senders = int(limit.group(1)) if limit else None
        reason = wal_senders_exhausted(senders, senders)
    elif "max_prepared_transactions" in text:
        reason = prepared_transactions_off()
    elif sqlstate == "58P01" or ("could not access file" in text and plugin in text):
        reason = plugin_missing(plugin, text)
    if reason is None:
        return None
    kind = "two-phase replication slot" if two_phase else "replication slot"
    return ServerNotReadyError(f"cannot create {kind} {name!r} in {where}: {reason} (PostgreSQL said: {text})")


__all__ = [
    "MIN_SERVER_VERSION",
    "PLUGINS",
    "Problem",
    "ServerFacts",
    "FAILOVER_SERVER_VERSION",
    "PGOUTPUT_TWO_PHASE_SERVER_VERSION",
    "TWO_PHASE_FAILOVER_SERVER_VERSION",
    "TWO_PHASE_SERVER_VERSION",
    "check_readiness",
    "describe_readiness",
    "failover_needs_newer_server",
    "format_server_version",
    "plugin_missing",
    "plugin_unknown",
    "prepared_transactions_off",
    "read_server_facts",
    "replication_slots_exhausted",
    "role_lacks_replication",
    "server_too_old",
    "slot_creation_error",
    "two_phase_failover_unsafe",
    "two_phase_needs_newer_server",
    "wal_level_not_logical",
    "wal_senders_exhausted",
]
