"""The one translation of pgdecode errors into Airflow's retry semantics."""

from __future__ import annotations

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_pgdecode import errors
from airflow_provider_pgdecode.errors import CatalogError, PgDecodeError, SlotInUseError, is_deterministic
from airflow_provider_pgdecode.postgres.health import slot_in_use, slot_lost
from airflow_provider_pgdecode.utils.fail_fast import fail_fast

DETERMINISTIC = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, PgDecodeError) and not cls.retryable
]


@pytest.mark.parametrize("cls", DETERMINISTIC, ids=lambda cls: cls.__name__)
def test_every_deterministic_error_fails_the_task_for_good(cls: type[PgDecodeError]) -> None:
    error = cls("table public.t has no primary key") if cls is not errors.DecodingError else cls("bad", lsn="0/1")
    with pytest.raises(AirflowFailException) as raised:
        with fail_fast():
            raise error
    assert str(raised.value) == str(error)
    assert raised.value.__cause__ is error


def test_the_prefix_says_what_was_left_undone() -> None:
    with pytest.raises(AirflowFailException, match=r"^batch /b is merged, but .*: replication slot 's' is lost"):
        with fail_fast("batch /b is merged, but the slot was not advanced"):
            raise slot_lost("s")


@pytest.mark.parametrize(
    "error",
    [
        slot_in_use("s"),  # another consumer holds the slot: wait and retry
        psycopg.OperationalError("connection refused"),  # the server restarts
        ConnectionResetError("reset by peer"),
        AirflowException("an Airflow error keeps its own semantics"),
    ],
    ids=type,
)
def test_transient_errors_pass_through_so_retries_apply(error: Exception) -> None:
    assert not is_deterministic(error)
    with pytest.raises(type(error)) as raised:
        with fail_fast():
            raise error
    assert raised.value is error
    assert not isinstance(raised.value, AirflowFailException)


def test_only_a_busy_slot_a_lost_connection_and_an_unreachable_spark_server_are_retryable() -> None:
    assert SlotInUseError.retryable and is_deterministic(CatalogError("x"))
    assert sorted(
        cls.__name__ for cls in vars(errors).values() if isinstance(cls, type) and getattr(cls, "retryable", False)
    ) == ["SlotConnectionLostError", "SlotInUseError", "SparkConnectUnreachableError"]
