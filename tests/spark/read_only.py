"""A directory made immutable (``chattr +i``) for a block: a real refusal of a Delta commit, which
binds root too, nothing patched. Skips the test where the machine or its filesystem cannot."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _immutable(path: Path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True, capture_output=True)


@contextmanager
def immutable_directory(path: Path) -> Iterator[None]:
    """``path`` takes no new file while the block runs (its files stay readable)."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs) to make a directory read-only for root")
    try:
        _immutable(path, True)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"this filesystem has no immutable flag: {exc.stderr!r}")
    try:
        yield
    finally:
        _immutable(path, False)
