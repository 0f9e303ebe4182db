"""Parked tables: a table whose changes cannot be merged waits; every other table flows.

When the merge refuses one table (a damaged Delta log, a read-only directory, a refused type
change...), it parks it: nothing of it is written, the other tables are merged and the slot is
confirmed. The table's place is kept here, in ``<staging_root>/<slot>/parked-tables.json``: from
which LSN on its staged changes are still to be applied (``since_lsn``, the start of the first
batch that held changes it could not take), why, and since when. Each later merge gives the
batches from there on back to the merge job for that table only, in order; once the cause is
fixed the table catches up in one run (changes at or below its Delta watermark are never applied
twice: the merge's Delta transaction ids), and it leaves this file. Retention keeps every batch
from the oldest ``since_lsn`` on. Plain Python over :class:`Storage`.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import StagingError

PARKED_FILE = "parked-tables.json"
PARKED = "parked"  # the merge summary's status of a parked table


@dataclass(frozen=True)
class ParkedTable:
    """One parked table: its changes from ``since_lsn`` on are not in Delta yet."""

    since_lsn: str
    parked_at: str
    reason: str
    error: str
    runs: int = 1

    @property
    def since(self) -> Lsn:
        return Lsn.parse(self.since_lsn)


@dataclass
class Parking:
    """What a merge run needs to know about parked tables: the slot's staging root, its parked
    tables, the earlier batches they still need, and where this run's own batches start."""

    staging: Storage
    slot: str
    parked: dict[str, ParkedTable]
    catch_up: list[BatchManifest]
    since: Lsn | None

    def merge_args(self) -> list[str]:
        """The merge job's arguments that give it the parked tables and their earlier batches."""
        args: list[str] = []
        for name in sorted(self.parked):
            args += ["--parked-table", name]
        for batch in self.catch_up:
            args += ["--catch-up", str(batch.path)]
        return args


def staging_root_of(batch_location: str) -> str:
    """The staging root a batch lives in: ``<staging_root>/<slot>/<batch>``."""
    return posixpath.dirname(posixpath.dirname(str(batch_location).rstrip("/")))


def read_parked(staging_root: str | Storage, slot: str) -> dict[str, ParkedTable]:
    """The slot's parked tables by ``schema.table`` (empty when none is parked)."""
    store = as_storage(staging_root).child(slot)
    try:
        text = store.read_text(PARKED_FILE)
    except FileNotFoundError:
        return {}
    try:
        return {name: ParkedTable(**entry) for name, entry in json.loads(text)["tables"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise StagingError(
            f"unreadable parked-tables file {store.uri(PARKED_FILE)}: {exc}. It lists tables whose changes are "
            "not merged yet: restore it, or remove it and resnapshot the tables it listed"
        ) from None


def write_parked(staging_root: str | Storage, slot: str, parked: Mapping[str, ParkedTable]) -> None:
    """Replace the slot's parked-tables file (removed when nothing is parked)."""
    store = as_storage(staging_root).child(slot)
    if not parked:
        if store.exists(PARKED_FILE):
            store.delete_file(PARKED_FILE)
        return
    data = {"tables": {name: asdict(entry) for name, entry in sorted(parked.items())}}
    store.write_text(PARKED_FILE, json.dumps(data, indent=2, sort_keys=True) + "\n")


def oldest_parked(parked: Mapping[str, ParkedTable]) -> Lsn | None:
    """The first LSN some parked table still needs (retention keeps every batch ending after it)."""
    return min((entry.since for entry in parked.values()), default=None)


def catch_up_batches(
    staging_root: str | Storage, slot: str, parked: Mapping[str, ParkedTable], before: Lsn | None
) -> list[BatchManifest]:
    """The staged batches a parked table still needs that this run does not merge anyway: from
    its ``since_lsn`` up to ``before`` (this run's first batch; ``None``: no batch this run), in
    LSN order, only those that hold one of the parked tables."""
    oldest = oldest_parked(parked)
    if oldest is None:
        return []
    store = as_storage(staging_root)
    out = []
    for location in list_batches(store, slot):
        manifest = BatchManifest.read(store.at(location))
        if manifest.end <= oldest or (before is not None and manifest.end > before):
            continue
        needed = any(
            f"{entry.target[0]}.{entry.target[1]}" in parked
            and manifest.end > parked[f"{entry.target[0]}.{entry.target[1]}"].since
            for entry in manifest.tables
        )
        if needed:
            out.append(manifest)
    return sorted(out, key=lambda m: (m.start, m.end))


def settle_parked(
    parked: Mapping[str, ParkedTable],
    tables: Mapping[str, Mapping[str, Any]],
    since: Lsn,
    now: str,
) -> tuple[dict[str, ParkedTable], list[str], list[str]]:
    """The parked tables after a merge whose per-table results are ``tables`` (the summary's
    ``tables``): a table parked by this run is added (from ``since``, this run's first LSN), one
    parked before stays parked (its first place and time kept) or, merged now, leaves. Returns
    (the new set, the tables newly parked, the tables that caught up)."""
    out = dict(parked)
    newly: list[str] = []
    caught_up: list[str] = []
    for name, result in tables.items():
        if result.get("status") == PARKED:
            before = parked.get(name)
            reason, error = str(result.get("reason") or ""), str(result.get("error") or "")
            if before is None:
                out[name] = ParkedTable(str(since), now, reason, error)
                newly.append(name)
            else:
                out[name] = ParkedTable(before.since_lsn, before.parked_at, reason, error, before.runs + 1)
        elif name in parked:
            del out[name]
            caught_up.append(name)
    return out, newly, caught_up
