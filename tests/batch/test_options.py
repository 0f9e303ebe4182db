import pytest

from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, options_for, parse_table_options, yes_or_no
from airflow_provider_pgdecode.errors import ConfigurationError


def test_parse_names_tables_and_defaults():
    options = parse_table_options({"pgbench_history": {"mode": "append_only"}, "s.t": {"on_bad_value": "quarantine"}})
    assert options_for(options, "public", "pgbench_history").mode == "append_only"
    assert options_for(options, "s", "t").on_bad_value == "quarantine"
    assert options_for(options, "s", "t").mode == "merge"
    assert options_for(options, "public", "other") == DEFAULT_OPTIONS


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"public.t": {"mode": "upsert"}}, "mode"),
        ({"public.t": {"on_bad_vaule": "fail"}}, "on_bad_vaule"),
        ({"public.t": "append_only"}, "must be a mapping"),
    ],
)
def test_bad_options_name_table_and_field(value, named):
    with pytest.raises(ConfigurationError) as err:
        parse_table_options(value)
    assert "public.t" in str(err.value) and named in str(err.value)


def test_value_limits_and_array_staging_are_validated():
    options = parse_table_options({"t": {"max_value_bytes": 1024, "arrays": "json"}})
    assert (options_for(options, "public", "t").max_value_bytes, options_for(options, "public", "t").arrays) == (
        1024,
        "json",
    )
    assert DEFAULT_OPTIONS.max_value_bytes == 64 * 1024 * 1024 and DEFAULT_OPTIONS.arrays == "list"
    for bad, named in (({"max_value_bytes": 0}, "max_value_bytes"), ({"arrays": "nested"}, "arrays")):
        with pytest.raises(ConfigurationError, match=f"public.t.*{named}"):
            parse_table_options({"public.t": bad})


def test_history_and_soft_delete_modes_are_accepted_and_the_wording_lists_every_mode():
    options = parse_table_options({"public.orders": {"mode": "history"}, "public.customers": {"mode": "soft_delete"}})
    assert options_for(options, "public", "orders").mode == "history"
    assert options_for(options, "public", "customers").mode == "soft_delete"
    with pytest.raises(ConfigurationError) as err:
        parse_table_options({"public.t": {"mode": "scd2"}})
    assert "mode in ('merge', 'append_only', 'history', 'soft_delete')" in str(err.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (" Yes ", True),
        ("ON", True),
        ("1", True),
        ("off", False),
        ("False", False),
        ("0", False),
        ("", None),
        ("maybe", None),
        (None, None),
    ],
)
def test_yes_or_no_reads_the_words_every_setting_accepts(value: object, expected: bool | None) -> None:
    assert yes_or_no(value) is expected
