"""The record of resolved jars: what spares a Spark job Ivy's resolution once its jars are cached.

Spark resolves ``spark.jars.packages`` through Ivy at every start, even when every jar is in the
cache: some fifty lines of Ivy's report in the task's log and seconds of a spark-submit. A
session started with pgdecode's packages records the jar files Ivy gave it (``spark.jars`` of its
running configuration) in ``<ivy dir>/pgdecode-resolved-jars.json``, keyed by what decides the
resolution (the packages, the excludes, the repository). The next job with the same key loads
those files by path (``spark.jars``) and resolves nothing. A record whose files are gone is
ignored: Ivy resolves again, and the session records anew.

Plain Python (a session's configuration is read through its public API): importable without Spark.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

RECORD_NAME = "pgdecode-resolved-jars.json"
"""The file, in the Ivy directory, holding the jar files of each resolved key."""

KEY_CONF = "spark.pgdecode.resolvedJarsKey"
"""The Spark setting that carries a job's resolution key from its configuration to its session,
which records the jars Ivy resolved under it (:func:`record_session_jars`)."""

log = logging.getLogger(__name__)


def resolution_key(packages: str, excludes: str | None, repository: str) -> str:
    """A short name of what decides which jars Ivy resolves: the packages, the excludes and the
    repository (a digest: it travels on a spark-submit command line)."""
    decided = json.dumps({"packages": packages, "excludes": excludes or "", "repository": repository}, sort_keys=True)
    return hashlib.sha256(decided.encode()).hexdigest()[:20]


def _read(ivy: Path) -> dict[str, Any]:
    try:
        data = json.loads((ivy / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_jars(ivy: Path, key: str) -> list[str] | None:
    """The jar files recorded for ``key`` in ``ivy``, when every one of them is still there."""
    jars = _read(ivy).get(key)
    if not isinstance(jars, list) or not jars or not all(isinstance(j, str) and os.path.isfile(j) for j in jars):
        return None
    return list(jars)


def record_jars(ivy: Path, key: str, jars: Sequence[str]) -> bool:
    """Record ``jars`` for ``key`` in ``ivy`` (written whole, then renamed: a reader never sees
    half a file). Best effort: a read-only cache only means the next job resolves again."""
    record = _read(ivy)
    record[key] = list(jars)
    try:
        ivy.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=ivy, prefix=f".{RECORD_NAME}.", delete=False) as f:
            json.dump(record, f, indent=2, sort_keys=True)
        os.replace(f.name, ivy / RECORD_NAME)
    except OSError as exc:
        log.debug("could not record the resolved jars in %s: %s", ivy, exc)
        return False
    return True


def jar_path(entry: str) -> str:
    """A local path of a ``spark.jars`` entry (``file:/x.jar``, ``file:///x.jar`` or ``/x.jar``)."""
    parsed = urlparse(entry)
    return unquote(parsed.path) if parsed.scheme == "file" else entry


def record_session_jars(spark: Any) -> bool:
    """In a session started with pgdecode's packages (its configuration names :data:`KEY_CONF`),
    record the jar files Ivy resolved for them; nothing otherwise. True when recorded."""
    try:
        conf = spark.sparkContext.getConf()
    except Exception:  # a Spark Connect session: no configuration of a JVM here
        return False
    key, ivy, jars = conf.get(KEY_CONF), conf.get("spark.jars.ivy"), conf.get("spark.jars")
    if not key or not ivy or not jars:
        return False
    paths = [jar_path(j.strip()) for j in jars.split(",") if j.strip()]
    if not paths or not all(os.path.isfile(p) for p in paths):
        return False
    return record_jars(Path(ivy), key, paths)
