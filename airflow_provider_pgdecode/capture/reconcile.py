"""Where the next batch starts: the previous checkpoint, reconciled with the slot. Plain Python.

Each incremental run starts from the checkpoint the previous successful run's confirm step
returned (its end LSN and the prepared transactions it left pending). The slot's own
``confirmed_flush_lsn`` is the other half of the truth, and the two normally agree. When they
do not, :func:`reconcile` decides:

* **no checkpoint** (first run, or XCom history cleared): start from the slot's confirmed
  position. When a staged batch ends exactly there, its checkpoint is adopted, so prepared
  transactions it left pending are not lost.
* **slot at or behind the checkpoint** (normal, or a confirm that did not persist): resume
  from the checkpoint; :func:`~airflow_provider_pgdecode.capture.extract.extract_batch` skips
  rows at or before the checkpoint's end, and the next confirm moves the slot forward.
* **slot ahead of the checkpoint**: if staged batches chain from the checkpoint's end to the
  slot's position exactly, a confirm advanced the slot but its checkpoint never reached XCom;
  the last batch's checkpoint is adopted. Otherwise the changes in between were consumed by
  someone else and are not in Delta: :class:`CheckpointError` says so and how to recover.

Example::

    from airflow_provider_pgdecode.capture.reconcile import reconcile

    decision = reconcile(previous_checkpoint_dict, slot_info, "/data/staging")
    print(decision.action, decision.message)
    manifest = extract_batch(conn, slot, "/data/staging", checkpoint=decision.checkpoint)
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_pgdecode.batch.chains import find_chain, staged_ranges
from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import Storage, as_storage
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import CheckpointError, StagingError
from airflow_provider_pgdecode.postgres.slot import SlotInfo

START = "start"
"""No checkpoint: the batch starts at the slot's confirmed position."""
RESUME = "resume"
"""The slot is where the checkpoint ended: the normal case."""
SLOT_BEHIND = "slot_behind"
"""The slot is behind the checkpoint (a batch staged ahead, or its last advance did not persist): resume from
the checkpoint."""
ADOPTED = "adopted"
"""A staged batch's checkpoint was adopted (a confirm advanced the slot but its XCom was lost)."""


@dataclass(frozen=True)
class Reconciliation:
    """What :func:`reconcile` decided.

    :param checkpoint: the checkpoint to hand to ``extract_batch`` (``None``: start from the slot).
    :param action: one of :data:`START`, :data:`RESUME`, :data:`SLOT_BEHIND`, :data:`ADOPTED`.
    :param message: one sentence for the task log.
    :param start_lsn: where the next batch starts.
    :param adopted: the staged batches (in order) whose checkpoint chain was adopted.
    """

    checkpoint: Checkpoint | None
    action: str
    message: str
    start_lsn: Lsn
    adopted: tuple[str, ...] = ()


def coerce_checkpoint(value: Checkpoint | Mapping[str, Any] | None) -> Checkpoint | None:
    """A :class:`Checkpoint` from an XCom value (a dict), a Checkpoint, or ``None``/``{}``."""
    if value is None or isinstance(value, Checkpoint):
        return value
    if not isinstance(value, Mapping):
        raise CheckpointError(
            f"the previous checkpoint is a {type(value).__name__}, not a dict: {value!r}. "
            "checkpoint_task_id must name the confirm task (it returns the checkpoint)"
        )
    if not value:
        return None
    try:
        return Checkpoint.from_dict(dict(value))
    except StagingError as exc:
        raise CheckpointError(
            f"{exc}. checkpoint_task_id must name the confirm task (it returns the checkpoint)"
        ) from None


def _latest_ending_at(ranges: Sequence[tuple[Lsn, Lsn, str]], target: Lsn) -> str | None:
    ending = [path for s, e, path in ranges if e == target]
    return ending[-1] if ending else None


def _adopt(path: str, slot_name: str, target: Lsn, staging: Storage | None) -> Checkpoint:
    try:
        manifest = BatchManifest.read(staging.at(path) if staging is not None else path)
    except StagingError as exc:
        raise CheckpointError(
            f"the staged batch {path} would tell where replication slot {slot_name!r} stands, but it cannot "
            f"be read: {exc}"
        ) from None
    if manifest.slot != slot_name or Lsn.parse(manifest.end_lsn) != target:
        raise CheckpointError(
            f"the staged batch {path} does not match its name (slot {manifest.slot!r}, end {manifest.end_lsn}); "
            f"expected slot {slot_name!r} ending at {target}. Move it out of the staging directory"
        )
    return Checkpoint.from_manifest(manifest)


def reconcile(
    checkpoint: Checkpoint | Mapping[str, Any] | None,
    slot: SlotInfo,
    staging_root: str | os.PathLike[str] | Storage | None = None,
) -> Reconciliation:
    """Decide where the next batch of ``slot`` starts (see the module docstring).

    :param checkpoint: the previous successful run's checkpoint (the confirm task's XCom value),
        or ``None``.
    :param slot: the slot as it is now (:meth:`SlotClient.describe`).
    :param staging_root: the staging root of the batches (``<staging_root>/<slot>/<start>-<end>``);
        without it no staged batch can be adopted.
    :raises CheckpointError: the checkpoint belongs to another slot, or the slot is ahead of
        anything staged from the checkpoint (changes were consumed by another reader).
    """
    name = slot.slot_name
    confirmed = slot.confirmed_flush_lsn if slot.confirmed_flush_lsn is not None else Lsn(0)
    previous = coerce_checkpoint(checkpoint)
    staging = as_storage(staging_root) if staging_root is not None else None
    ranges = staged_ranges(staging, name) if staging is not None else []

    if previous is None:
        path = _latest_ending_at(ranges, confirmed)
        if path is not None:
            adopted = _adopt(path, name, confirmed, staging)
            return Reconciliation(
                adopted,
                ADOPTED,
                f"No checkpoint in XCom (first run, or XCom history cleared); the staged batch {path} ends at "
                f"slot {name}'s position {confirmed}: adopting its checkpoint "
                f"({len(adopted.prepared_pending)} prepared transaction(s) pending)",
                confirmed,
                (str(path),),
            )
        return Reconciliation(
            None,
            START,
            f"No checkpoint in XCom (first run, or XCom history cleared): starting from slot {name}'s "
            f"confirmed position {confirmed}",
            confirmed,
        )

    if previous.slot != name:
        raise CheckpointError(
            f"the previous checkpoint belongs to replication slot {previous.slot!r}, not {name!r}: "
            "checkpoint_task_id points at another pipeline's confirm task. Give each slot its own DAG "
            "(or its own confirm task id)"
        )
    end = previous.end_lsn
    if confirmed == end:
        return Reconciliation(
            previous,
            RESUME,
            f"Resuming slot {name} from checkpoint {end} ({len(previous.prepared_pending)} prepared "
            "transaction(s) pending)",
            end,
        )
    if confirmed < end:
        return Reconciliation(
            previous,
            SLOT_BEHIND,
            f"Slot {name} is at {confirmed}, behind checkpoint {end} (the batch ending there is staged and not "
            "confirmed yet, as when the drain extracts a batch ahead while the one before merges; or the slot's "
            f"last advance did not persist, e.g. a server crash before a checkpoint): resuming from {end}; rows "
            "up to it are not staged again and the next confirm moves the slot forward",
            end,
        )

    chain = find_chain(ranges, end, confirmed)
    if chain:
        adopted = _adopt(chain[-1], name, confirmed, staging)
        return Reconciliation(
            adopted,
            ADOPTED,
            f"Slot {name} is at {confirmed}, ahead of checkpoint {end}; the staged batches "
            f"{', '.join(posixpath.basename(p) for p in chain)} lead there exactly, so a confirm advanced the slot but its "
            f"checkpoint never reached XCom: adopting the checkpoint of {chain[-1]}",
            confirmed,
            tuple(str(p) for p in chain),
        )
    where = f"under {staging.uri(name)}" if staging is not None else "(no staging_root given)"
    raise CheckpointError(
        f"replication slot {name!r} is at {confirmed}, ahead of the last merged checkpoint {end} "
        f"(batch {previous.batch_path}), and no staged batches {where} lead from {end} to {confirmed}. "
        f"The {int(confirmed) - int(end)} bytes of WAL between were consumed by another reader of the slot "
        "(pg_logical_slot_get_changes, pg_replication_slot_advance, or another pipeline on the same slot), "
        "so their changes are not in Delta; nothing was extracted. To recover: stop the other reader, then "
        "re-snapshot the affected tables with the pgdecode_backfill DAG (it starts a new checkpoint), or "
        f"drop and recreate the slot (SELECT pg_drop_replication_slot('{name}')) and backfill"
    )
