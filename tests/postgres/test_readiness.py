"""Server readiness: the pure checks, and PostgreSQL's refusals to create a slot translated on a real server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.errors import ServerNotReadyError, SlotError
from airflow_provider_pgdecode.postgres.readiness import (
    ServerFacts,
    check_readiness,
    describe_readiness,
    plugin_missing,
    read_server_facts,
    replication_slots_exhausted,
    role_lacks_replication,
    slot_creation_error,
    wal_level_not_logical,
)
from airflow_provider_pgdecode.postgres.slot import SlotClient
from pgdecode_testing.postgres_cluster import ThrowawayCluster

READY = ServerFacts(
    server_version_num=150018,
    wal_level="logical",
    role="etl",
    replication=True,
    superuser=False,
    max_replication_slots=10,
    replication_slots_used=3,
    max_wal_senders=10,
    wal_senders_used=1,
    max_prepared_transactions=20,
)


def settings(problems: list[Any]) -> list[str]:
    return [p.setting for p in problems]


# -- the pure checks ---------------------------------------------------------------------------


def test_a_ready_server_has_no_problems() -> None:
    assert check_readiness(READY, plugin="pgoutput", two_phase=True) == []
    assert check_readiness(replace(READY, replication=False, superuser=True)) == []
    described = describe_readiness(READY, plugin="pgoutput", two_phase=True)
    assert "wal_level=logical" in described and "7 of 10 replication slots free" in described
    assert "9 of 10 WAL senders free" in described and "max_prepared_transactions=20" in described
    assert "protocol up to 3" in described and "PostgreSQL 15.18" in described
    assert "too few for large batches" not in described


def test_too_few_free_slots_are_said_to_leave_large_batches_in_one_session() -> None:
    def said(used: int, plugin: str, two_phase: bool) -> bool:
        facts = replace(READY, replication_slots_used=used)
        return "too few for large batches" in describe_readiness(facts, plugin=plugin, two_phase=two_phase)

    # The slot and a copy while a batch runs, or the slot and its upper-half slot, and one left free.
    assert said(9, "pgoutput", True) and not said(8, "pgoutput", True)
    assert said(9, "test_decoding", False) and not said(8, "test_decoding", False)
    assert said(8, "test_decoding", True) and not said(7, "test_decoding", True)
    assert "<slot>_upper" in describe_readiness(replace(READY, replication_slots_used=8), two_phase=True)


@pytest.mark.parametrize(
    ("change", "setting", "words"),
    [
        ({"wal_level": "replica"}, "wal_level", ["wal_level is 'replica'", "set wal_level = logical", "restart"]),
        ({"replication": False}, "REPLICATION", ["role 'etl'", 'ALTER ROLE "etl" WITH REPLICATION']),
        (
            {"replication_slots_used": 10},
            "max_replication_slots",
            ["10 of max_replication_slots = 10", "drop slots nothing reads", "raise max_replication_slots"],
        ),
        ({"max_replication_slots": 0, "replication_slots_used": 0}, "max_replication_slots", ["is 0"]),
        ({"wal_senders_used": 10}, "max_wal_senders", ["10 of max_wal_senders = 10", "raise max_wal_senders"]),
        (
            {"max_prepared_transactions": 0},
            "max_prepared_transactions",
            ["max_prepared_transactions is 0", "max_prepared_transactions > 0", "two_phase=False"],
        ),
        ({"server_version_num": 130012}, "server_version", ["PostgreSQL 14 or later", "PostgreSQL 13.12"]),
        ({"server_version_num": 100023}, "server_version", ["PostgreSQL 11 or later"]),
        (
            {"in_recovery": True, "server_version_num": 150010, "hot_standby_feedback": True},
            "server_version",
            ["standby", "PostgreSQL 15.10", "needs PostgreSQL 16 or later", "point the connection at the primary"],
        ),
        (
            {"in_recovery": True, "server_version_num": 160004},
            "hot_standby_feedback",
            ["rows_removed", "hot_standby_feedback = on", "primary_slot_name"],
        ),
    ],
)
def test_each_problem_names_its_setting_and_fix(change: dict[str, Any], setting: str, words: list[str]) -> None:
    problems = check_readiness(replace(READY, **change), plugin="test_decoding", two_phase=True)
    assert setting in settings(problems)
    message = next(p.message for p in problems if p.setting == setting)
    for word in words:
        assert word in message


def test_two_phase_only_checked_when_asked_and_pgoutput_needs_15() -> None:
    off = replace(READY, max_prepared_transactions=0)
    assert check_readiness(off, two_phase=False) == []
    assert settings(check_readiness(off, two_phase=True)) == ["max_prepared_transactions"]
    pg14 = replace(READY, server_version_num=140011)
    assert check_readiness(pg14, plugin="test_decoding", two_phase=True) == []
    (problem,) = check_readiness(pg14, plugin="pgoutput", two_phase=True)
    assert problem.setting == "server_version" and "PostgreSQL 15 or later with pgoutput" in problem.message
    assert settings(check_readiness(READY, plugin="wal2json")) == ["plugin"]


def test_every_problem_is_reported_at_once() -> None:
    broken = replace(
        READY, wal_level="replica", replication=False, replication_slots_used=10, max_prepared_transactions=0
    )
    assert settings(check_readiness(broken, two_phase=True)) == [
        "wal_level",
        "max_replication_slots",
        "max_prepared_transactions",
        "REPLICATION",
    ]


def test_slot_creation_error_translation_of_known_messages() -> None:
    where = "database 'shop' on db:5432"

    def translate(sqlstate: str | None, message: str, plugin: str = "test_decoding") -> str:
        error = slot_creation_error("s1", where, sqlstate, message, plugin=plugin)
        assert isinstance(error, ServerNotReadyError) and isinstance(error, SlotError)
        text = str(error)
        assert text.startswith(f"cannot create replication slot 's1' in {where}: ") and message in text
        return text

    assert wal_level_not_logical(None) in translate("55000", "logical decoding requires wal_level >= logical")
    assert role_lacks_replication(None) in translate("42501", "permission denied to use replication slots")
    assert role_lacks_replication(None) in translate(
        "42501", "must be superuser or replication role to use replication slots"
    )
    assert replication_slots_exhausted(None, None) in translate("53400", "all replication slots are in use")
    assert "max_replication_slots is 0" in translate(
        "55000", "replication slots can only be used if max_replication_slots > 0"
    )
    assert "raise max_wal_senders" in translate(
        None, "FATAL:  number of requested standby connections exceeds max_wal_senders (currently 0)"
    )
    missing = 'could not access file "wal2json": No such file or directory'
    assert plugin_missing("wal2json", missing) in translate("58P01", missing, plugin="wal2json")
    # A standby: the primary's wal_level, and a server too old to decode in recovery.
    assert "on the primary" in translate(
        "55000", "logical decoding on standby requires wal_level >= logical on the primary"
    )
    assert "needs PostgreSQL 16" in translate("55000", "logical decoding cannot be used while in recovery")
    assert slot_creation_error("s1", where, "42P01", "relation does not exist", plugin="pgoutput") is None


# -- on a real server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cluster() -> Iterator[ThrowawayCluster]:
    """A cluster of this module's own with room for two slots, restarted with other settings by tests."""
    with ThrowawayCluster({"max_replication_slots": "2"}) as cluster:
        yield cluster


def _slot() -> str:
    return f"rd_{uuid.uuid4().hex[:12]}"


@pytest.mark.postgres
def test_facts_of_a_real_server(small_cluster: ThrowawayCluster) -> None:
    with small_cluster.connect() as conn:
        facts = read_server_facts(conn)
        assert facts.server_version_num == int(conn.info.server_version)
    assert (facts.wal_level, facts.role, facts.superuser, facts.max_replication_slots) == (
        "logical",
        "postgres",
        True,
        2,
    )
    assert facts.max_prepared_transactions == 20
    assert check_readiness(facts, two_phase=True) == []


@pytest.mark.postgres
def test_role_without_replication_cannot_create_a_slot(small_cluster: ThrowawayCluster) -> None:
    role = f"norepl_{uuid.uuid4().hex[:8]}"
    with small_cluster.connect() as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    dsn = psycopg.conninfo.make_conninfo(small_cluster.dsn(), user=role)
    name = _slot()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(ServerNotReadyError) as caught:
            SlotClient(conn).create(name)
        facts = read_server_facts(conn)
    message = str(caught.value)
    assert f"cannot create replication slot '{name}' in database 'postgres' on 127.0.0.1:" in message
    assert f'ALTER ROLE "{role}" WITH REPLICATION' in message and "REPLICATION attribute" in message
    assert settings(check_readiness(facts)) == ["REPLICATION"]

    # On Amazon RDS and Aurora, membership in rds_replication is what grants replication.
    with small_cluster.connect() as admin:
        admin.execute("CREATE ROLE rds_replication")
        admin.execute(f'GRANT rds_replication TO "{role}"')
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert read_server_facts(conn).replication is True
    finally:
        with small_cluster.connect() as admin:
            admin.execute("DROP ROLE rds_replication")


@pytest.mark.postgres
def test_all_slots_in_use(small_cluster: ThrowawayCluster) -> None:
    with small_cluster.connect() as conn:
        client = SlotClient(conn)
        taken = [_slot(), _slot()]
        for name in taken:
            client.create(name)
        try:
            name = _slot()
            with pytest.raises(ServerNotReadyError) as caught:
                client.create(name)
            message = str(caught.value)
            assert f"cannot create replication slot '{name}'" in message
            assert "drop slots nothing reads" in message and "raise max_replication_slots" in message
            assert not client.exists(name)
            assert settings(check_readiness(read_server_facts(conn))) == ["max_replication_slots"]
        finally:
            for name in taken:
                client.drop(name)


@pytest.mark.postgres
def test_plugin_not_installed(small_cluster: ThrowawayCluster) -> None:
    with small_cluster.connect() as conn:
        with pytest.raises(ServerNotReadyError, match="output plugin 'no_such_plugin' is not installed on the server"):
            SlotClient(conn).create(_slot(), plugin="no_such_plugin")


@pytest.mark.postgres
def test_wal_level_replica_and_no_prepared_transactions(small_cluster: ThrowawayCluster) -> None:
    small_cluster.reconfigure(wal_level="replica", max_prepared_transactions="0")
    try:
        with small_cluster.connect() as conn:
            client = SlotClient(conn)
            name = _slot()
            with pytest.raises(ServerNotReadyError) as caught:
                client.create(name)
            assert f"cannot create replication slot '{name}'" in str(caught.value)
            assert "wal_level is below 'logical'" in str(caught.value) and "set wal_level = logical" in str(
                caught.value
            )
            with pytest.raises(ServerNotReadyError) as caught:
                client.create(name, two_phase=True)
            assert f"cannot create two-phase replication slot '{name}'" in str(caught.value)
            assert "max_prepared_transactions is 0" in str(caught.value) and "restart" in str(caught.value)
            assert not client.exists(name)
            facts = read_server_facts(conn)
        assert settings(check_readiness(facts, two_phase=True)) == ["wal_level", "max_prepared_transactions"]
    finally:
        small_cluster.reconfigure(wal_level="logical", max_prepared_transactions="20")


@pytest.mark.postgres
def test_replication_connection_refusals_are_translated(small_cluster: ThrowawayCluster) -> None:
    from airflow_provider_pgdecode.postgres.replication import replication_connection

    role = f"norepl_{uuid.uuid4().hex[:8]}"
    with small_cluster.connect() as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    name = _slot()
    with pytest.raises(ServerNotReadyError) as caught:
        with replication_connection(psycopg.conninfo.make_conninfo(small_cluster.dsn(), user=role), name):
            pass
    assert f"cannot create replication slot '{name}' in database 'postgres'" in str(caught.value)
    assert f'ALTER ROLE "{role}" WITH REPLICATION' in str(caught.value)

    small_cluster.reconfigure(max_wal_senders="0")
    try:
        with pytest.raises(ServerNotReadyError) as caught:
            with replication_connection(small_cluster.dsn(), name):
                pass
        assert "max_wal_senders is 0" in str(caught.value) and "raise max_wal_senders" in str(caught.value)
        with small_cluster.connect() as conn:
            assert settings(check_readiness(read_server_facts(conn))) == ["max_wal_senders"]
    finally:
        small_cluster.reconfigure(max_wal_senders="20")
