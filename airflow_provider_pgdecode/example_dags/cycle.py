"""The CDC cycle's tasks, shared by ``pgdecode_incremental`` (on a clock) and
``pgdecode_event_driven`` (on the slot's Asset).

:func:`cycle_params` are the DAG params of a cycle; :func:`build_cycle` creates the tasks in
the DAG being defined and wires them: ``ensure_slot >> [slot_health, wait_for_changes]`` and
``wait_for_changes >> extract >> merge >> confirm >> drain``. The slot is only ever peeked;
confirm advances it after the merge succeeded. A batch is bounded (``max_batch_changes``,
``max_batch_wal_bytes``); when the cycle's batch ended at a bound, ``drain`` runs the same
extract, merge and confirm again in a loop until the slot is caught up (``drain: false`` leaves
the rest to the next runs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.sdk import BaseOperator, Param

from airflow_provider_pgdecode.capture.bounds import DEFAULT_MAX_BATCH_CHANGES, DEFAULT_MAX_BATCH_WAL_BYTES
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS
from airflow_provider_pgdecode.notifications.alerts import PgDecodeAlertNotifier
from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator
from airflow_provider_pgdecode.operators.drain import PgDecodeDrainOperator
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator
from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
from airflow_provider_pgdecode.sensors.slot_health import PgDecodeSlotHealthSensor
from airflow_provider_pgdecode.utils.config import pgdecode_int


@dataclass(frozen=True)
class Source:
    """Where a cycle reads: fixed values, or templates of the DAG's params.

    :param publication: ``None`` for test_decoding.
    """

    slot_name: str
    postgres_conn_id: str
    plugin: str
    publication: str | None


#: The source of a cycle as templates of its params (``pgdecode_incremental``: overridable per run).
PARAM_SOURCE = Source(
    slot_name="{{ params.slot_name }}",
    postgres_conn_id="{{ params.postgres_conn_id }}",
    plugin="{{ params.plugin }}",
    publication="{{ params.publication if params.plugin == 'pgoutput' else None }}",
)
SOURCE_PARAMS = ("postgres_conn_id", "slot_name", "plugin", "publication")


@dataclass(frozen=True)
class CycleSettings:
    """How a cycle waits, checks the slot and keeps staged batches (see :func:`build_cycle`)."""

    wait_seconds: int
    max_lag_bytes: int | None
    retention_days: int | None

    @classmethod
    def from_config(cls) -> CycleSettings:
        """The ``[pgdecode]`` settings ``wait_seconds``, ``max_lag_bytes``, ``retention_days`` in force now."""
        return cls(
            wait_seconds=pgdecode_int("wait_seconds") or 0,
            max_lag_bytes=pgdecode_int("max_lag_bytes"),
            retention_days=pgdecode_int("retention_days"),
        )


def with_defaults(params: dict[str, Param], defaults: Mapping[str, Any] | None) -> dict[str, Param]:
    """``params`` with the default values of some replaced (same schema and description); a name
    that is not a param is a :class:`ValueError` (a typo would otherwise be ignored)."""
    for name, value in (defaults or {}).items():
        if name not in params:
            raise ValueError(f"{name!r} is not a param of this DAG; its params are {', '.join(params)}")
        param = params[name]
        params[name] = Param(value, description=param.description, **param.schema)
    return params


def cycle_params(data_dir: str, *, source: bool = True, defaults: Mapping[str, Any] | None = None) -> dict[str, Param]:
    """The params of a cycle; ``source=False`` leaves out :data:`SOURCE_PARAMS` (a DAG whose
    slot is fixed when it is parsed, as one scheduled on the slot's Asset, or generated from a
    sources file). ``defaults`` replaces the default values of some (still overridable per run)."""
    params = {
        "postgres_conn_id": Param(
            "pgdecode_default",
            type="string",
            description="the source database's Airflow connection (type pgdecode; postgres works too)",
        ),
        "slot_name": Param(
            "pgdecode",
            type="string",
            pattern="^[a-z0-9_]{1,63}$",
            description="the logical replication slot (created, two-phase, when missing)",
        ),
        "plugin": Param("test_decoding", enum=list(SUPPORTED_PLUGINS), description="the slot's output plugin"),
        "publication": Param(
            "pgdecode", type="string", description="the publication a pgoutput slot reads (ignored for test_decoding)"
        ),
        "tables": Param(
            [],
            type="array",
            description="schema.table names or glob patterns (public.order_*, matched when a run starts) to load; "
            "empty: every table outside the system schemas (pgoutput: in the publication) minus exclude_tables",
        ),
        "exclude_tables": Param([], type="array", description="schema.table names or patterns never to load"),
        "table_options": Param(
            {},
            type="object",
            description='per table: {"schema.table": {"mode": "history", "on_bad_value": "quarantine", '
            '"max_value_bytes": 67108864, "arrays": "json", "type_map": {"numeric": "string"}}}; mode: merge '
            "(default), append_only, history (SCD type 2) or soft_delete; type_map keeps types as text; partitions: "
            "root (default) or leaves, a Delta table per partition (docs/merge.md)",
        ),
        "staging_uri": Param(
            f"{data_dir}/staging", type="string", description="a local directory or s3://bucket/prefix"
        ),
        "delta_root": Param(f"{data_dir}/delta", type="string", description="a local directory or s3://bucket/prefix"),
        "storage_conn_id": Param(
            "",
            type="string",
            description="an Airflow aws connection for s3:// locations (endpoint_url in its extra for "
            "S3-compatible stores); empty: local paths",
        ),
        "spark_conn_id": Param(
            "spark_default", type="string", description="the Spark connection (local[*], spark://host:7077 ...)"
        ),
        "max_batch_changes": Param(
            DEFAULT_MAX_BATCH_CHANGES,
            type=["integer", "null"],
            minimum=1,
            description="the most changes one batch stages (null: no bound); a larger transaction is a batch of its own",
        ),
        "max_batch_wal_bytes": Param(
            DEFAULT_MAX_BATCH_WAL_BYTES,
            type=["integer", "null"],
            minimum=1,
            description="the most WAL (bytes) one batch spans (null: no bound)",
        ),
        "failover": Param(
            False,
            type="boolean",
            description="create the slot as a failover slot (PostgreSQL 17+), kept by standbys that sync slots, "
            "so the pipeline carries on after a promotion (docs/standby.md)",
        ),
        "on_slot_lost": Param(
            "fail",
            enum=["fail", "resnapshot"],
            description="a lost slot (wal_removed, idle_timeout ...): fail, or resnapshot (recreate it and reload "
            "every table from a new snapshot, replacing each Delta table in one commit; docs/lost-slots.md)",
        ),
        "max_slot_recoveries_per_day": Param(
            1, type="integer", minimum=1, description="how often resnapshot may recover in 24 hours before it fails"
        ),
        "drain": Param(
            True,
            type="boolean",
            description="when a batch ends at a bound, extract, merge and confirm more batches in this run "
            "until the slot is caught up",
        ),
    }
    if not source:
        for name in SOURCE_PARAMS:
            del params[name]
    return with_defaults(params, defaults)


@dataclass(frozen=True)
class Cycle:
    """The tasks of one cycle."""

    ensure_slot: PgDecodeEnsureSlotOperator
    slot_health: PgDecodeSlotHealthSensor
    wait_for_changes: PgDecodeSlotChangesSensor
    extract: PgDecodeExtractOperator
    merge: PgDecodeMergeOperator
    confirm: PgDecodeConfirmOperator
    drain: PgDecodeDrainOperator


def build_cycle(
    *,
    wait_seconds: int,
    max_lag_bytes: int | None,
    retention_days: int | None,
    source: Source = PARAM_SOURCE,
    pool: str | None = None,
    alert_notifiers: Sequence[Callable[[Any], Any]] = (),
) -> Cycle:
    """Create and wire a cycle's tasks in the DAG being defined (``with DAG(...)``).

    :param wait_seconds: how long ``wait_for_changes`` waits before the cycle is skipped.
    :param max_lag_bytes: the health check fails past this slot lag; ``None``: no limit.
    :param retention_days: staged batches older than this that nothing needs are removed after
        each confirm; ``None`` keeps everything.
    :param source: the slot, its connection, plugin and publication: fixed values, or by default
        :data:`PARAM_SOURCE`, the DAG's params.
    :param pool: the Airflow pool of the tasks that run Spark (``merge``, and ``drain``, whose
        batches are merged too), so that the merges of many DAGs share a bounded number of
        slots; ``None``: Airflow's ``default_pool``. The pool must exist: the scheduler does not
        run a task of a missing pool (it only logs a warning).
    :param alert_notifiers: Airflow notifiers (Slack, email, ...) that get pgdecode's alerts
        (:class:`~airflow_provider_pgdecode.notifications.alerts.PgDecodeAlertNotifier`): the
        health check failing, quarantined changes, a parked table, a failed task.
    """
    ensure_slot, slot_health, wait_for_changes = _slot_tasks(source, max_lag_bytes, wait_seconds)
    extract, merge, confirm, drain = _batch_tasks(source, retention_days, {"pool": pool} if pool else {})
    if alert_notifiers:
        attach_alerts(
            alert_notifiers, (ensure_slot, slot_health, extract, merge, confirm, drain), (extract, merge, drain)
        )
    ensure_slot >> [slot_health, wait_for_changes]
    wait_for_changes >> extract >> merge >> confirm >> drain  # extract.output also orders merge and confirm
    return Cycle(ensure_slot, slot_health, wait_for_changes, extract, merge, confirm, drain)


def attach_alerts(
    notifiers: Sequence[Callable[[Any], Any]], failing: Sequence[BaseOperator], succeeding: Sequence[BaseOperator]
) -> None:
    """pgdecode's alerts to ``notifiers``: a failure of any task of ``failing``, and what the tasks
    of ``succeeding`` report when they succeed (quarantined changes, parked tables)."""
    alert = PgDecodeAlertNotifier(notifiers)
    for task in failing:
        task.on_failure_callback = [alert]
    for task in succeeding:
        task.on_success_callback = [alert]


def _slot_tasks(
    src: Source, max_lag_bytes: int | None, wait_seconds: int
) -> tuple[PgDecodeEnsureSlotOperator, PgDecodeSlotHealthSensor, PgDecodeSlotChangesSensor]:
    """The cycle's tasks that look after the slot: ensure it, check its health, wait for changes."""
    # [START howto_operator_pgdecode_ensure_slot]
    ensure_slot = PgDecodeEnsureSlotOperator(
        task_id="ensure_slot",
        slot_name=src.slot_name,
        plugin=src.plugin,
        two_phase=True,  # where it is safe: a failover slot on PostgreSQL 17 decodes prepared transactions at commit
        failover="{{ params.failover }}",
        postgres_conn_id=src.postgres_conn_id,
        on_slot_lost="{{ params.on_slot_lost }}",
    )
    # [END howto_operator_pgdecode_ensure_slot]
    # [START howto_operator_pgdecode_slot_health_sensor]
    slot_health = PgDecodeSlotHealthSensor(
        task_id="slot_health",
        slot_name=src.slot_name,
        plugin=src.plugin,
        postgres_conn_id=src.postgres_conn_id,
        max_lag_bytes=max_lag_bytes,
        heartbeat=True,  # an idle database's slot keeps advancing
        publication=src.publication,  # pgoutput: what the probe for pending changes reads with
        on_slot_lost="{{ params.on_slot_lost }}",  # resnapshot: a lost slot is left to the extract
        max_stalled_runs=3,  # changes pending, nothing extracted through 3 runs: fail, whatever the cause
        staging_root="{{ params.staging_uri }}",  # a parked table fails the check (docs/merge.md)
        storage_conn_id="{{ params.storage_conn_id }}",
        poke_interval=30,
        timeout=120,
    )
    # [END howto_operator_pgdecode_slot_health_sensor]
    # [START howto_operator_pgdecode_slot_changes_sensor]
    wait_for_changes = PgDecodeSlotChangesSensor(
        task_id="wait_for_changes",
        slot_name=src.slot_name,
        postgres_conn_id=src.postgres_conn_id,
        publication=src.publication,
        on_slot_lost="{{ params.on_slot_lost }}",
        staging_root="{{ params.staging_uri }}",  # table snapshot requests count as work
        storage_conn_id="{{ params.storage_conn_id }}",
        poke_interval=min(15, max(wait_seconds, 1)),
        timeout=wait_seconds,
        skip_on_timeout=True,  # no changes: the cycle is skipped; an error fails it
        # deferrable: [operators] default_deferrable, so a waiting cycle holds no worker slot
        # wherever a triggerer runs.
    )
    # [END howto_operator_pgdecode_slot_changes_sensor]
    return ensure_slot, slot_health, wait_for_changes


def _batch_tasks(
    src: Source, retention_days: int | None, spark_pool: dict[str, Any]
) -> tuple[PgDecodeExtractOperator, PgDecodeMergeOperator, PgDecodeConfirmOperator, PgDecodeDrainOperator]:
    """The cycle's tasks that move a batch: extract, merge, confirm, and drain the backlog."""
    # [START howto_operator_pgdecode_extract]
    extract = PgDecodeExtractOperator(
        task_id="extract",
        slot_name=src.slot_name,
        staging_root="{{ params.staging_uri }}",
        plugin=src.plugin,
        postgres_conn_id=src.postgres_conn_id,
        tables="{{ params.tables }}",
        exclude_tables="{{ params.exclude_tables }}",
        publication=src.publication,
        table_options="{{ params.table_options }}",
        checkpoint_task_id=["confirm", "drain"],  # the latest checkpoint either confirmed
        storage_conn_id="{{ params.storage_conn_id }}",
        max_batch_changes="{{ params.max_batch_changes }}",
        max_batch_wal_bytes="{{ params.max_batch_wal_bytes }}",
        on_slot_lost="{{ params.on_slot_lost }}",
        max_slot_recoveries_per_day="{{ params.max_slot_recoveries_per_day }}",
        multiple_outputs=True,  # its summary's keys as XComs too: extract.output["path"]
    )
    # [END howto_operator_pgdecode_extract]
    # [START howto_operator_pgdecode_merge]
    # An XComArg (typed Any: it stands for any templated argument): the operators resolve it when
    # they run, and it orders them after extract.
    extracted: Any = extract.output
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths=extracted["path"],
        delta_root="{{ params.delta_root }}",
        conn_id="{{ params.spark_conn_id }}",
        storage_conn_id="{{ params.storage_conn_id }}",
        **spark_pool,
    )
    # [END howto_operator_pgdecode_merge]
    # [START howto_operator_pgdecode_confirm]
    confirm = PgDecodeConfirmOperator(
        task_id="confirm",
        slot_name=src.slot_name,
        batch_path=extracted["path"],
        postgres_conn_id=src.postgres_conn_id,
        merge_task_id="merge",
        retention_days=retention_days,
        storage_conn_id="{{ params.storage_conn_id }}",
    )
    # [END howto_operator_pgdecode_confirm]
    # [START howto_operator_pgdecode_drain]
    drain = PgDecodeDrainOperator(
        task_id="drain",
        slot_name=src.slot_name,
        postgres_conn_id=src.postgres_conn_id,
        enabled="{{ params.drain }}",
        outlets=list(merge.outlets),  # its merges emit the same Asset events as the merge task's
        **spark_pool,
    )
    # [END howto_operator_pgdecode_drain]
    return extract, merge, confirm, drain
