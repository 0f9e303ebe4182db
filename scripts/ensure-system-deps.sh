#!/usr/bin/env bash
# Installs the system packages pgdecode needs when they are absent: PostgreSQL's server
# binaries (for the throwaway clusters of tests, benchmarks and the demo) and a Java 17+
# runtime (for Spark). Debian/Ubuntu only; as root, or through sudo when it is available.
set -euo pipefail

need=()
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    need+=(postgresql postgresql-contrib)
fi
if ! command -v java >/dev/null 2>&1; then
    need+=(openjdk-17-jre-headless)
fi
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "pgdecode needs these system packages: ${need[*]}" >&2
    echo "Install them (apt-get install ${need[*]}) or run 'make' as root." >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "pgdecode needs: ${need[*]}; this is not a Debian-like system, install them by hand." >&2
    exit 1
fi
echo "Installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
