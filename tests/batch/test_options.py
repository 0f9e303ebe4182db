import pytest

from airflow_provider_pgdecode.batch.options import DEFAULT_OPTIONS, options_for, parse_table_options
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
