#!/usr/bin/env bash
# Installs the system packages pgdecode needs when they are absent: PostgreSQL's server
# binaries (for the throwaway clusters of tests, benchmarks and the demo), a Java 17+
# runtime (for Spark), gcc with the Python headers (for the native extract), and docker-compose
# (the test suite validates docker/docker-compose.yml with 'docker-compose config', which needs
# no Docker engine), and Chromium (the UI test opens the pgdecode view in a headless browser).
# Debian/Ubuntu only; as root, or through sudo when it is available.
set -euo pipefail

need=()
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    need+=(postgresql postgresql-contrib)
fi
if ! command -v java >/dev/null 2>&1; then
    need+=(openjdk-17-jre-headless)
fi
# A C compiler and the Python headers build the native extract (capture/csrc/*.c); without
# them the install still works and the extract uses its pure-Python path.
if ! command -v gcc >/dev/null 2>&1; then
    need+=(gcc)
fi
# Debian's docker-compose (1.x): enough for 'config'; tests/docker skips without it.
if ! command -v docker-compose >/dev/null 2>&1; then
    need+=(docker-compose)
fi
# Debian's chromium: tests/ui opens the pgdecode view in it, headless (tests skip without it).
if ! command -v chromium >/dev/null 2>&1; then
    need+=(chromium)
fi
PY_FOR_HEADERS="${PYTHON:-python3.11}"
if command -v "$PY_FOR_HEADERS" >/dev/null 2>&1; then
    include_dir="$("$PY_FOR_HEADERS" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    if [ ! -f "$include_dir/Python.h" ]; then
        need+=("$(basename "$PY_FOR_HEADERS")-dev")
    fi
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
