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


def test_type_map_keeps_the_named_types_as_text_whatever_their_spelling():
    options = parse_table_options({"t": {"type_map": {"timestamptz": "string", "numeric(10,2)": "string"}}})
    staging = options_for(options, "public", "t").staging
    assert staging.keeps_as_text("timestamp with time zone") and staging.keeps_as_text("timestamp(3) with time zone")
    assert staging.keeps_as_text("numeric") and staging.keeps_as_text("numeric(38,0)")
    assert not staging.keeps_as_text("timestamp without time zone") and not staging.keeps_as_text("integer")
    assert DEFAULT_OPTIONS.staging.text_types == frozenset()


@pytest.mark.parametrize(
    ("type_map", "named"),
    [({"numeric": "decimal(38,0)"}, "type_map.numeric"), ({" ": "string"}, "type_map"), (["numeric"], "type_map")],
)
def test_a_type_map_other_than_names_to_string_is_refused_naming_the_table(type_map, named):
    with pytest.raises(ConfigurationError) as info:
        parse_table_options({"public.t": {"type_map": type_map}})
    assert "table_options['public.t']" in str(info.value) and named in str(info.value)
    assert "type_map of PostgreSQL type names to 'string'" in str(info.value)
