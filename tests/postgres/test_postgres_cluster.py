from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgdecode_testing.postgres_cluster import ThrowawayCluster, find_bindir

pytestmark = pytest.mark.postgres


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(f"SHOW {name}").fetchone()
    assert row is not None
    return str(row[0])


def test_logical_decoding_settings_are_in_effect(pg_cluster: ThrowawayCluster) -> None:
    with pg_cluster.connect() as conn:
        assert _show(conn, "wal_level") == "logical"
        assert _show(conn, "max_prepared_transactions") == "20"
        assert _show(conn, "max_replication_slots") == "40"
        assert _show(conn, "max_wal_senders") == "20"
        assert _show(conn, "logical_decoding_work_mem") == "64kB"
        assert _show(conn, "fsync") == "off"
        assert _show(conn, "full_page_writes") == "off"
        assert _show(conn, "listen_addresses") == "127.0.0.1"
        assert int(_show(conn, "port")) == pg_cluster.port
        assert _show(conn, "unix_socket_directories") == str(pg_cluster.socket_dir)
        assert _show(conn, "server_encoding") == "UTF8"
        assert _show(conn, "lc_collate") == "C"


def test_server_runs_unprivileged_when_started_as_root(pg_cluster: ThrowawayCluster) -> None:
    if os.geteuid() != 0:
        pytest.skip("only meaningful when the tests run as root")
    with pg_cluster.connect() as conn:
        datadir = _show(conn, "data_directory")
    assert os.stat(datadir).st_uid == pwd.getpwnam("postgres").pw_uid


def test_connection_helpers(pg_cluster: ThrowawayCluster, pg_dsn: str) -> None:
    assert f"port={pg_cluster.port}" in pg_dsn and "dbname=pgdecode_test" in pg_dsn
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT current_database(), current_user").fetchone() == ("pgdecode_test", "postgres")
    with pg_cluster.connect("pgdecode_test", autocommit=False) as conn:
        assert conn.autocommit is False
    assert json.loads(pg_cluster.airflow_conn_json("pgdecode_test")) == {
        "conn_type": "pgdecode",
        "host": "127.0.0.1",
        "port": pg_cluster.port,
        "login": "postgres",
        "schema": "pgdecode_test",
    }
    assert (find_bindir() / "pg_ctl").exists()


def test_extra_settings_override_and_teardown_removes_everything() -> None:
    with ThrowawayCluster({"logical_decoding_work_mem": "1MB", "shared_buffers": "32MB"}) as cluster:
        workdir: Path = cluster.socket_dir
        dsn = cluster.dsn()
        with cluster.connect() as conn:
            assert _show(conn, "logical_decoding_work_mem") == "1MB"
            assert _show(conn, "shared_buffers") == "32MB"
            assert _show(conn, "wal_level") == "logical"
    assert not workdir.exists()
    assert not cluster.running
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=2)
