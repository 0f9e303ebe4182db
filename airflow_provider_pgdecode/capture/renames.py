"""Follow source tables across renames and drops, by OID (docs/merge.md, "DDL on a source table").

A table's changes flow into the Delta table it was first loaded into, whatever it is called
later: the Delta path cannot be renamed on object storage, and its readers find it by path.
Which table a staged name is:

- pgoutput: the OID of the Relation message that named it (exact, in every batch);
- test_decoding, which prints names only (as of each change): the table of that name now, else
  the OID recorded for that name by an earlier batch (:attr:`BatchManifest.table_oids`, carried
  in the checkpoint).

Each batch records, for every table staged so far, the names it was seen under and its Delta
table, so that the next batch can follow it. Plain Python over the catalog lookups.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest, TableSummary
from airflow_provider_pgdecode.errors import BatchError, CatalogError
from airflow_provider_pgdecode.postgres.catalog import Catalog

log = logging.getLogger(__name__)

Name = tuple[str, str]


def _dotted(name: Name) -> str:
    return f"{name[0]}.{name[1]}"


@dataclass
class KnownTables:
    """The tables a slot's batches have staged, by OID: every name seen, and the Delta table."""

    names: dict[int, list[Name]] = field(default_factory=dict)
    delta: dict[int, Name] = field(default_factory=dict)
    files: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per OID, its file node and column signature when last staged (capture/rewrites.py)."""
    partitions: dict[int, dict[int, int] | None] = field(default_factory=dict)
    """Per partitioned table, its partitions' file nodes by OID when last extracted; ``None``: not
    yet recorded (capture/partitions.py)."""

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> KnownTables:
        known = cls()
        for oid, entry in (record or {}).items():
            try:
                known.names[int(oid)] = [(str(s), str(t)) for s, t in entry["names"]]
                schema, table = entry["delta_table"]
                known.delta[int(oid)] = (str(schema), str(table))
                if entry.get("filenode") is not None:
                    known.files[int(oid)] = {"filenode": int(entry["filenode"]), "columns": str(entry["columns"])}
                if "partitions" in entry:
                    leaves = entry["partitions"]
                    known.partitions[int(oid)] = (
                        None if leaves is None else {int(leaf): int(node) for leaf, node in leaves.items()}
                    )
            except (KeyError, TypeError, ValueError):
                log.warning("Ignoring a malformed table_oids entry %r: %r", oid, entry)
        return known

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint | None) -> KnownTables:
        """From the checkpoint, else from the manifest of the batch it was made from."""
        if checkpoint is None:
            return cls()
        if checkpoint.table_oids:
            return cls.from_record(checkpoint.table_oids)
        if checkpoint.batch_path and Path(checkpoint.batch_path).is_dir():
            try:
                return cls.from_record(BatchManifest.read(checkpoint.batch_path).table_oids)
            except BatchError as error:
                log.warning("Cannot read the table OIDs of the checkpoint's batch: %s", error)
        return cls()

    def record(self) -> dict[str, Any]:
        """The JSON form kept in the manifest and the checkpoint."""
        return {
            str(oid): {
                "names": [list(n) for n in names],
                "delta_table": list(self.delta[oid]),
                **self.files.get(oid, {}),
                **({"partitions": _leaves_record(self.partitions[oid])} if oid in self.partitions else {}),
            }
            for oid, names in sorted(self.names.items())
        }

    def add_root(self, oid: int, name: Name) -> None:
        """A partitioned table whose partitions' changes land in its Delta table."""
        self.add(oid, name)
        self.delta.setdefault(oid, name)
        self.partitions.setdefault(oid, None)

    def oid_named(self, name: Name) -> int | None:
        """The table last known under ``name``."""
        found = [oid for oid, names in sorted(self.names.items()) if name in names]
        latest = [oid for oid in found if self.names[oid][-1] == name]
        candidates = latest or found
        return candidates[-1] if candidates else None

    def add(self, oid: int, *names: Name) -> None:
        seen = self.names.setdefault(oid, [])
        for name in names:
            if name not in seen:
                seen.append(name)


def _leaves_record(leaves: dict[int, int] | None) -> dict[str, int] | None:
    return None if leaves is None else {str(leaf): node for leaf, node in sorted(leaves.items())}


def follow_selection(catalog: Catalog, selected: set[Name] | None, known: KnownTables) -> set[Name] | None:
    """The ``tables`` selection, extended so that a renamed table keeps flowing: a name that no
    table has now is followed to the table's new name through the OID an earlier batch recorded;
    every selected table's earlier names are added too (its changes before the rename carry them)."""
    if selected is None or not known.names:
        return selected
    out = set(selected)
    now = catalog.relation_names(list(known.names))
    named_now = catalog.relation_oids(selected)
    for name in sorted(selected):
        oid = named_now.get(name)
        if oid is not None:
            out.update(known.names.get(oid, ()))
            earlier = known.oid_named(name)
            if earlier is not None and earlier != oid and earlier not in now:
                log.warning(recreated_message(name, earlier, oid, known.delta[earlier]))
            continue
        oid = known.oid_named(name)
        if oid is None:
            continue
        out.update(known.names[oid])
        current = now.get(oid)
        if current is None:
            log.warning(
                "%s (OID %d) no longer exists: it was dropped; its changes stop and its Delta table %s is kept",
                _dotted(name),
                oid,
                _dotted(known.delta[oid]),
            )
            continue
        out.add(current)
        log.info(
            "%s is now %s (OID %d); its changes keep flowing into Delta table %s",
            _dotted(name),
            _dotted(current),
            oid,
            _dotted(known.delta[oid]),
        )
    return out


@dataclass
class FollowedTables:
    """What :func:`follow_staged` decided about a batch's staged tables."""

    tables: list[TableSummary]
    """The staged tables to keep, each with its OID and (when not its staged name) Delta table."""
    current: dict[Name, Name]
    """Staged name -> the table's name now (for catalog lookups)."""
    known: KnownTables
    dropped_changes: int = 0
    """Staged changes of tables dropped since, left out of the batch (logged)."""


def follow_staged(
    catalog: Catalog,
    staged: Iterable[TableSummary],
    known: KnownTables,
    stream_oids: Mapping[Name, list[int]],
    selected: set[Name] | None,
    fresh: Iterable[str] = (),
    roots: Mapping[Name, tuple[int, Name]] | None = None,
) -> FollowedTables:
    """Give each staged table its OID and Delta table, following renames; leave out (and log) the
    changes of tables dropped since. A staged name that is no table now and that no earlier batch
    recorded is a :class:`CatalogError` when ``selected`` names it (with what to do).

    ``fresh``: ``schema.table`` of tables whose snapshot (``add-table``, ``resnapshot``) starts in
    this batch: such a table starts afresh in the Delta table of its current name (how a renamed
    table moves to a Delta table of its new name).

    ``roots``: each partition's partitioned table at the top of its tree
    (:meth:`Catalog.partition_roots`): a partition staged for the first time flows into the root's
    Delta table (:mod:`.partitions`), and its catalog lookups are the root's."""
    fresh = set(fresh)
    roots = roots or {}
    root_names = {root: oid for oid, root in roots.values()}
    staged = list(staged)
    oids = _staged_oids(catalog, staged, known, stream_oids)
    now = catalog.relation_names(sorted(set(oids.values()) | set(known.names)))
    for name, staged_oid in sorted(oids.items()):
        earlier = known.oid_named(name)
        if earlier is not None and earlier != staged_oid and earlier not in now:
            log.warning(recreated_message(name, earlier, staged_oid, known.delta[earlier]))
    # A table staged for the first time flows into the Delta table of the first name it had in the batch.
    first_name: dict[int, Name] = {}
    for summary in sorted(staged, key=lambda s: (s.min_commit is None, s.min_commit or 0)):
        name = (summary.schema, summary.table)
        if name in oids:
            first_name.setdefault(oids[name], name)
    result = FollowedTables(
        [],
        {},
        KnownTables(
            {o: list(n) for o, n in known.names.items()}, dict(known.delta), dict(known.files), dict(known.partitions)
        ),
    )
    for summary in staged:
        oid = oids.get((summary.schema, summary.table))
        current = now.get(oid) if oid is not None else None
        if oid is None or current is None:
            continue
        moved_from = result.known.delta.get(oid)
        if f"{current[0]}.{current[1]}" in fresh and moved_from is not None and moved_from != current:
            log.info(
                "%s (OID %d) is snapshotted under its current name: it flows into Delta table %s from now on, "
                "and Delta table %s is no longer written",
                _dotted(current),
                oid,
                _dotted(current),
                _dotted(moved_from),
            )
            result.known.delta[oid] = first_name[oid] = current
    told: set[int] = set()
    for summary in staged:
        name = (summary.schema, summary.table)
        oid = oids.get(name)
        if oid is None:
            if selected is not None and name in selected:
                raise CatalogError(unknown_table_message(name))
            log.warning(
                "%s has %d staged change(s) but no table has that name now and no earlier batch recorded it (it "
                "was dropped, or renamed before pgdecode first staged it): they are left out; if it was renamed, "
                "resnapshot it under its new name (pgdecode_backfill mode=resnapshot)",
                _dotted(name),
                summary.rows,
            )
            result.dropped_changes += summary.rows
            continue
        current = now.get(oid)
        if current is None:
            log.warning(
                "%s (OID %d) was dropped: its %d staged change(s) from before the drop are left out; its Delta "
                "table %s is kept as last merged",
                _dotted(name),
                oid,
                summary.rows,
                _dotted(known.delta.get(oid, name)),
            )
            result.dropped_changes += summary.rows
            continue
        root = roots.get(current)
        if root is not None:
            result.known.add_root(*root)
        elif current in root_names:  # published through the root (publish_via_partition_root)
            result.known.add_root(oid, current)
        target = result.known.delta.get(oid) or (root[1] if root is not None else first_name[oid])
        summary.oid = oid
        summary.delta_table = list(target) if target != name else None
        result.current[name] = root[1] if root is not None else current
        result.known.add(oid, name, current)
        result.known.delta[oid] = target
        result.tables.append(summary)
        if root is None and current != target and oid not in told:
            told.add(oid)
            log.info(
                "%s is now %s (OID %d); its changes keep flowing into Delta table %s",
                _dotted(target),
                _dotted(current),
                oid,
                _dotted(target),
            )
    # Renames of followed tables without changes in this batch: their next changes carry the new name.
    for oid, current in now.items():
        if oid in result.known.names:
            result.known.add(oid, current)
    return result


def _staged_oids(
    catalog: Catalog, staged: Iterable[TableSummary], known: KnownTables, stream_oids: Mapping[Name, list[int]]
) -> dict[Name, int]:
    """Each staged name's table OID: pgoutput's Relation message, else the catalog's table of that
    name now, else the OID an earlier batch recorded for it; names none of these know are left out."""
    oids: dict[Name, int] = {}
    staged = list(staged)
    named_now = catalog.relation_oids((s.schema, s.table) for s in staged if not stream_oids.get((s.schema, s.table)))
    for summary in staged:
        name = (summary.schema, summary.table)
        from_stream = stream_oids.get(name)
        if from_stream:
            if len(from_stream) > 1:
                log.warning(
                    "%s named %d tables in this batch (OIDs %s): it was dropped and re-created, or renamed and "
                    "replaced; their changes flow into one Delta table, so resnapshot it (pgdecode_backfill "
                    "mode=resnapshot) to make it equal the table named so now",
                    _dotted(name),
                    len(from_stream),
                    from_stream,
                )
            oids[name] = from_stream[-1]
            continue
        oid = named_now.get(name)
        if oid is None:
            oid = known.oid_named(name)
        if oid is not None:
            oids[name] = oid
    return oids


def unknown_table_message(name: Name) -> str:
    """The one wording of a selected table whose staged name cannot be followed."""
    return (
        f"table {_dotted(name)} has changes in this batch, but no table has that name now and no earlier batch "
        f"recorded its OID: it was renamed (or dropped) before pgdecode first staged it, and test_decoding prints "
        f"names only, so its new name is unknown. To continue: replace {_dotted(name)} in the tables list by its "
        f"new name (its changes under the old name are then left out), then resnapshot the table under its new "
        f"name (pgdecode_backfill mode=resnapshot, tables=[new name]). A pgoutput slot follows renames by OID."
    )


def recreated_message(name: Name, earlier: int, oid: int, delta: Name) -> str:
    """The one wording of a table dropped and created again under the same name."""
    return (
        f"{_dotted(name)} was dropped and re-created (OID {earlier}, now {oid}): its Delta table {_dotted(delta)} "
        f"still holds the rows of the dropped table; resnapshot it (pgdecode_backfill mode=resnapshot) to make it "
        f"equal the new one"
    )


def record_tables(catalog: Catalog, names: Iterable[Name]) -> KnownTables:
    """The OIDs of tables loaded under their names (an initial snapshot): each flows into the
    Delta table of that name, and later batches follow it from there."""
    known = KnownTables()
    names = list(names)
    named_now = catalog.relation_oids(names)
    for name in names:
        oid = named_now.get(name)
        if oid is not None:
            known.add(oid, name)
            known.delta[oid] = name
    return known
