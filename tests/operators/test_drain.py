from __future__ import annotations

from airflow_provider_pgdecode.operators.drain import eta_text


def test_the_time_left_counts_the_wal_the_source_writes_meanwhile() -> None:
    # 100 MB drained in 100 s while the source wrote 50 MB: the lag shrinks by 0.5 MB/s.
    assert eta_text(30_000_000, 100_000_000, 50_000_000, 100.0) == "60 s"
    assert eta_text(300_000_000, 100_000_000, 50_000_000, 100.0) == "10.0 min"
    # Without the source's writes the same lag would look twice as fast to drain.
    assert eta_text(30_000_000, 100_000_000, 0, 100.0) == "30 s"


def test_a_source_as_fast_as_the_drain_gets_a_warning_not_a_number() -> None:
    text = eta_text(30_000_000, 100_000_000, 100_000_000, 100.0)
    assert "no end" in text and "as fast as the drain" in text
    assert "no end" in eta_text(30_000_000, 100_000_000, 120_000_000, 100.0)


def test_nothing_done_yet_or_nothing_left() -> None:
    assert eta_text(30_000_000, 0, 0, 10.0) == "an unknown time"
    assert eta_text(0, 100, 5_000, 10.0) == "nothing"


def test_overlap_auto_takes_the_way_last_measured_faster() -> None:
    from airflow_provider_pgdecode.cycle.overlap import OverlapChoice

    auto = OverlapChoice("auto")
    assert not auto.ahead()  # nothing measured: one step after another
    auto.extracted_alone(2.0)
    auto.merged(1.0)
    assert auto.ahead() and "to be measured" in auto.reason()  # one overlapped step is tried
    auto.overlapped(3.5)  # slower than 3.0 s one after another (no cores to spare)
    assert not auto.ahead() and "3.0 s" in auto.reason() and "3.5 s" in auto.reason()
    auto.merged(10.0)  # a MERGE through Spark: 12 s one after another, the overlap measured pays
    assert auto.ahead()
    auto.overlapped(12.5)  # the extract beside it slowed it down more than it hid
    assert not auto.ahead()
    auto.extracted_alone(1.0)
    auto.merged(2.0)
    assert not auto.ahead()  # 3 s one after another
    for forced, expected in ((True, True), ("true", True), (False, False), ("no", False)):
        choice = OverlapChoice(forced)
        assert choice.ahead() is expected
        choice.extracted_alone(1.0)
        choice.merged(0.1)
        assert choice.ahead() is expected


def test_overlap_other_than_yes_no_or_auto_is_refused() -> None:
    import pytest

    from airflow_provider_pgdecode.cycle.overlap import OverlapChoice
    from airflow_provider_pgdecode.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="overlap must be true, false or 'auto', not 'sometimes'"):
        OverlapChoice("sometimes")
