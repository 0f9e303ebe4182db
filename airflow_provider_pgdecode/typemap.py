"""The type map: PostgreSQL type → staged Arrow type → Delta type, in one place.

Every layer that needs to know what a PostgreSQL type becomes asks this module: the batch
format (``batch/values.py`` stages decoded text as the Arrow type named here), the Spark job
(``spark/spark_types.py`` creates Delta columns of the type named here and checks staged files
against the Arrow type named here), and the test oracle (``testing/compare.py``).

Pure Python (the standard library and :mod:`airflow_provider_pgdecode.errors` only), so every
layer can import it. Types are *names*:

* PostgreSQL types as ``format_type`` prints them (``integer``, ``character varying(20)``,
  ``timestamp(3) with time zone``, ``numeric(12,2)``, ``text[]``), plus the aliases the merge
  job also accepts (``int4``, ``varchar``, ``timestamptz`` ...);
* Arrow types as pyarrow prints them (``str(pa.int32())`` is ``int32``, lists are
  ``list<item: int32>``), so the names here are the ``arrow`` field of the manifest;
* Delta types as Spark SQL prints them (``DataType.simpleString()``: ``int``,
  ``decimal(12,2)``, ``array<string>``).

The table (:data:`TYPES`) holds one entry per type; the rules for what the table cannot list
(numeric precision and scale, type modifiers, arrays, user-defined types, unknown types) are
the small functions below it. ``python -m airflow_provider_pgdecode.typemap --markdown`` prints
the table documented in docs/merge.md ("Type mapping"); a test keeps the two equal.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from airflow_provider_pgdecode.errors import ConfigurationError, UnmappedTypeError


class Kind:
    """How the merge job turns a staged value into its Delta value."""

    PLAIN = "plain"
    """Staged already as the Delta type (or a cast without loss)."""
    NUMERIC_TEXT = "numeric"
    """Staged as exact decimal text; cast to the Delta decimal (NaN/Infinity become NULL)."""
    TIMESTAMP_AS_UTC = "timestamp_as_utc"
    """Staged as a timestamp without zone; its wall-clock time is kept as a UTC instant."""


KIND_LABELS = {
    Kind.PLAIN: "plain",
    Kind.NUMERIC_TEXT: "numeric text",
    Kind.TIMESTAMP_AS_UTC: "timestamp as UTC",
}

SPARK_MAX_DECIMAL_PRECISION = 38
DEFAULT_UNBOUNDED_NUMERIC = "decimal(38,18)"
"""Delta type for ``numeric`` declared without precision (see :func:`parse_unbounded_numeric_rule`)."""

NUMERIC_SPECIAL_VALUES = ("NaN", "Infinity", "-Infinity")
"""Values PostgreSQL's numeric can hold and a Spark decimal cannot; staged as this text."""

TEXT = "string"
"""The Arrow and the Delta name of text: what every type without an entry is staged as."""


@dataclass(frozen=True)
class PgType:
    """One PostgreSQL type and what it becomes.

    ``name`` is ``format_type``'s spelling without modifiers; ``aliases`` are other spellings
    the merge job accepts (``type_overrides``, hand-written manifests). ``arrow`` is the staged
    Arrow type, ``delta`` the Delta type (for ``numeric``: without a typmod, with the default
    unbounded rule), ``kind`` the conversion from one to the other (:class:`Kind`).
    ``modifiers``: type modifiers in the name (``varchar(20)``, ``time(3) with time zone``)
    are accepted and change nothing. ``array_delimiter`` is the element separator of the type's
    array literal (``typdelim``); arrays are staged as lists only for ``,``. ``note`` is for the
    documented table.
    """

    name: str
    arrow: str
    delta: str
    kind: str = Kind.PLAIN
    aliases: tuple[str, ...] = ()
    modifiers: bool = False
    array_delimiter: str = ","
    note: str = ""


def _text(
    *names: str, note: str = "as printed", aliases: Mapping[str, tuple[str, ...]] | None = None, **options: str
) -> tuple[PgType, ...]:
    """Types staged as the text PostgreSQL printed and kept as Delta ``string``."""
    return tuple(
        PgType(name, TEXT, TEXT, aliases=(aliases or {}).get(name, ()), modifiers=True, note=note, **options)
        for name in names
    )


_KEY_INFINITIES = "in a key column a bad value instead (see below; `type_map` keeps them)"
_INFINITIES = f"`infinity` / `-infinity` become 9999-12-31 / 0001-01-01, {_KEY_INFINITIES}"
_TS_INFINITIES = f"`infinity` / `-infinity` become 9999-12-31 23:59:59.999999 / 0001-01-01 00:00:00, {_KEY_INFINITIES}"
_OUT_OF_RANGE = "BC and past year 9999: a bad value (see below)"

TYPES: tuple[PgType, ...] = (
    PgType("smallint", "int16", "smallint", aliases=("int2",)),
    PgType("integer", "int32", "int", aliases=("int", "int4")),
    PgType("bigint", "int64", "bigint", aliases=("int8",)),
    PgType("oid", "int64", "bigint", note="unsigned 32-bit, so 64 bits"),
    PgType("real", "float", "float", aliases=("float4",), note="`NaN`, `Infinity`, `-Infinity` kept"),
    PgType("double precision", "double", "double", aliases=("float8",), note="`NaN`, `Infinity`, `-Infinity` kept"),
    PgType(
        "numeric",
        TEXT,
        DEFAULT_UNBOUNDED_NUMERIC,
        Kind.NUMERIC_TEXT,
        aliases=("decimal",),
        note="exact decimal text; the Delta type follows the typmod (rules below); "
        "`NaN`, `Infinity`, `-Infinity` become NULL in a decimal column",
    ),
    PgType(
        "boolean", "bool", "boolean", aliases=("bool",), note="`true`/`false` (test_decoding) or `t`/`f` (pgoutput)"
    ),
    PgType("date", "date32[day]", "date", note=f"{_INFINITIES}; {_OUT_OF_RANGE}"),
    PgType(
        "timestamp without time zone",
        "timestamp[us]",
        "timestamp",
        Kind.TIMESTAMP_AS_UTC,
        aliases=("timestamp",),
        modifiers=True,
        note=f"the wall-clock time, read as UTC; {_TS_INFINITIES}; {_OUT_OF_RANGE}",
    ),
    PgType(
        "timestamp with time zone",
        "timestamp[us, tz=UTC]",
        "timestamp",
        aliases=("timestamptz",),
        modifiers=True,
        note=f"the UTC instant; {_TS_INFINITIES}; {_OUT_OF_RANGE}",
    ),
    PgType("bytea", "binary", "binary", note="the bytes (`bytea_output=hex`)"),
    *_text(
        "text",
        "character varying",
        "character",
        "name",
        "citext",
        aliases={"character varying": ("varchar",), "character": ("char", "bpchar")},
        note="as printed; `character(n)` keeps its padding",
    ),
    *_text(
        '"char"',
        note="as PostgreSQL 15+ prints it: a byte above 127 as `\\ooo` (`\\303`), also from PostgreSQL 14, "
        "which prints the byte itself (not UTF-8)",
    ),
    *_text("uuid", "json", "jsonb", "jsonpath", "xml", "inet", "cidr", "macaddr", "macaddr8"),
    PgType("money", TEXT, TEXT, modifiers=True, note="as printed, currency symbol included (`lc_monetary`)"),
    PgType(
        "interval",
        TEXT,
        TEXT,
        modifiers=True,
        note="as printed (`IntervalStyle=postgres`); with fields too (`interval day to second`)",
    ),
    *_text(
        "time without time zone",
        "time with time zone",
        aliases={
            "time without time zone": ("time",),
            "time with time zone": ("timetz",),
        },
    ),
    *_text("bit", "bit varying", aliases={"bit varying": ("varbit",)}, note="the bits, e.g. `1010`"),
    *_text("pg_lsn", "tsvector", "tsquery", "txid_snapshot", "pg_snapshot", "xid", "xid8", "cid", "tid"),
    *_text("point", "line", "lseg", "path", "polygon", "circle"),
    *_text(
        "box", array_delimiter=";", note="as printed; `box[]` is staged as one text (its elements are separated by `;`)"
    ),
    *_text(
        "int4range",
        "int8range",
        "numrange",
        "tsrange",
        "tstzrange",
        "daterange",
        "int4multirange",
        "int8multirange",
        "nummultirange",
        "tsmultirange",
        "tstzmultirange",
        "datemultirange",
        note="as printed, e.g. `[1,10)`",
    ),
    *_text(
        "regclass",
        "regtype",
        "regproc",
        "regprocedure",
        "regoper",
        "regoperator",
        "regconfig",
        "regdictionary",
        "regnamespace",
        "regrole",
        "regcollation",
        note="as printed: the object's name",
    ),
)
"""Every PostgreSQL type with a native mapping. A type not listed here (and not an array of one or a
``numeric`` with a typmod) is staged and kept in Delta as the text PostgreSQL printed: an
extension's type, a user's (enum, domain, composite, range)."""

_BY_NAME: dict[str, PgType] = {}
for _entry in TYPES:
    for _name in (_entry.name, *_entry.aliases):
        if _name in _BY_NAME:  # pragma: no cover - a mistake in the table
            raise AssertionError(f"type name {_name!r} listed twice")
        _BY_NAME[_name] = _entry
del _entry, _name

# Modifiers PostgreSQL prints inside a type name: varchar(20), bit(8), time(3) with time zone,
# timestamp(6) without time zone, interval(3). Interval fields (interval year to month) are
# handled by the interval prefix rule in find().
_TYPMOD = re.compile(r"\(\s*\d+\s*(?:,\s*-?\d+\s*)?\)")
_NUMERIC = re.compile(r"^(?:numeric|decimal)(?:\(\s*(\d+)\s*(?:,\s*(-?\d+)\s*)?\))?$")
_DECIMAL_RULE = re.compile(r"^decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)$")


# --- rules ---------------------------------------------------------------------------------


def strip_modifiers(name: str) -> str:
    """``name`` without the type modifiers ``format_type`` prints (``varchar(20)`` → ``varchar``)."""
    return re.sub(r"\s+", " ", _TYPMOD.sub("", name)).strip()


def numeric_typmod(name: str) -> tuple[int | None, int | None] | None:
    """``(precision, scale)`` of a ``numeric``/``decimal`` type name (``None`` parts when not
    declared), or ``None`` when ``name`` is not numeric."""
    match = _NUMERIC.match(name.strip().lower().replace(" ", ""))
    if match is None:
        return None
    return (int(match.group(1)) if match.group(1) else None, int(match.group(2)) if match.group(2) else None)


def array_element(name: str) -> str | None:
    """The element type of an array type name (``text[]`` → ``text``), else ``None``.

    ``format_type`` prints one ``[]`` whatever the number of dimensions; more are stripped too.
    """
    text = name.strip()
    if not text.endswith("[]"):
        return None
    element = text[:-2]
    while element.endswith("[]"):
        element = element[:-2]
    return element


def find(name: str) -> PgType | None:
    """The entry of a (non-array) PostgreSQL type name, or ``None``.

    Case-insensitive; aliases count; type modifiers are ignored where the type takes them
    (any ``numeric(p,s)`` finds ``numeric``; ``interval`` with fields finds ``interval``).
    """
    lowered = name.strip().lower()
    if numeric_typmod(lowered) is not None:
        return _BY_NAME["numeric"]
    entry = _BY_NAME.get(lowered)
    if entry is not None:
        return entry
    base = strip_modifiers(lowered)
    entry = _BY_NAME.get(base)
    if entry is not None and entry.modifiers:
        return entry
    if base.startswith("interval"):
        return _BY_NAME["interval"]
    return None


ARRAYS_AS_LIST = "list"
ARRAYS_AS_JSON = "json"
"""How a table's array columns are staged (the per-table option ``arrays``): as lists of the
element's type (default; one dimension only), or as JSON text (nested arrays, any dimensions)."""


def type_key(name: str) -> str:
    """The name a type is known by in a table's ``type_map``: its entry's name when it has one
    (aliases resolved, modifiers ignored: ``timestamptz``, ``numeric(10,2)``, ``varchar(20)`` →
    ``timestamp with time zone``, ``numeric``, ``character varying``), else its lowercase name
    without modifiers (``ltree``, ``public.mood``)."""
    entry = find(name)
    return entry.name if entry is not None else strip_modifiers(name.strip().lower())


@dataclass(frozen=True)
class Staging:
    """How one table's columns are staged, from its table options: arrays as lists or as JSON
    text (``arrays``), and the types it keeps as the text PostgreSQL printed (``type_map``, as
    :func:`type_key` names them). Arrays of a kept type are staged as lists of text."""

    arrays: str = ARRAYS_AS_LIST
    text_types: frozenset[str] = frozenset()

    @classmethod
    def of(cls, type_map: Iterable[str], arrays: str = ARRAYS_AS_LIST) -> Staging:
        """The staging of a table whose options name ``type_map`` (type names, any spelling) and ``arrays``."""
        return cls(arrays, frozenset(type_key(name) for name in type_map))

    @property
    def of_elements(self) -> Staging:
        """How an array's elements are staged: the kept types, arrays not as JSON."""
        return Staging(text_types=self.text_types)

    def keeps_as_text(self, pg_type: str) -> bool:
        """Whether the table's ``type_map`` keeps the (non-array) type ``pg_type`` as text."""
        return bool(self.text_types) and type_key(pg_type) in self.text_types


DEFAULT_STAGING = Staging()


def staged_arrow_type(pg_type: str, staging: Staging = DEFAULT_STAGING) -> str:
    """The Arrow type (pyarrow's name) a column of ``pg_type`` is staged as. Never fails:
    a type without an entry (an enum, a domain, an extension's type) is staged as text.
    ``staging.arrays == "json"``: an array is staged as its JSON text; a type of the table's
    ``type_map`` (or an array of it) as text (a list of text)."""
    element = array_element(pg_type)
    if element is not None:
        if not array_staged_as_list(element) or staging.arrays == ARRAYS_AS_JSON:
            return TEXT
        return f"list<item: {staged_arrow_type(element, staging.of_elements)}>"
    if staging.keeps_as_text(pg_type):
        return TEXT
    entry = find(pg_type)
    return entry.arrow if entry is not None else TEXT


def array_staged_as_list(element: str) -> bool:
    """True when an array of ``element`` is staged as a list: its literal separates elements by
    ``,``. Otherwise (``box[]``) the array is staged, and kept in Delta, as its text."""
    entry = find(element)
    return entry is None or entry.array_delimiter == ","


def parse_unbounded_numeric_rule(rule: str) -> str:
    """The Delta type for unbounded ``numeric``: ``decimal(P,S)`` (P ≤ 38) or ``string``."""
    text = rule.strip().lower()
    if text == TEXT:
        return TEXT
    match = _DECIMAL_RULE.match(text)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        if 1 <= precision <= SPARK_MAX_DECIMAL_PRECISION and scale <= precision:
            return f"decimal({precision},{scale})"
    raise ConfigurationError(
        f"unbounded numeric rule must be 'string' or 'decimal(P,S)' with 1 <= P <= 38 and S <= P: {rule!r}"
    )


def numeric_delta_type(precision: int | None, scale: int | None, unbounded: str = DEFAULT_UNBOUNDED_NUMERIC) -> str:
    """Delta type of ``numeric(precision, scale)``.

    ``numeric`` without precision takes ``unbounded``; ``numeric(p)`` is ``numeric(p,0)``.
    A negative scale (PostgreSQL 15+: rounds to tens, hundreds...) widens to
    ``decimal(p - scale, 0)``; a scale above the precision gives ``decimal(scale, scale)``.
    Precision above 38 (Spark's limit) is kept exactly as ``string``.
    """
    if precision is None:
        return unbounded
    scale = scale or 0
    if scale < 0:
        precision, scale = precision - scale, 0
    elif scale > precision:
        precision = scale
    if precision > SPARK_MAX_DECIMAL_PRECISION:
        return TEXT
    return f"decimal({precision},{scale})"


@dataclass(frozen=True)
class ColumnMapping:
    """What one catalog type (with its typmod) becomes: see :func:`resolve`."""

    catalog_type: str
    arrow: str
    """The Arrow type the merge job expects staged."""
    delta: str
    kind: str = Kind.PLAIN
    element: ColumnMapping | None = None
    """For arrays staged as lists: the element's mapping."""
    unbounded: bool = False
    """``numeric`` without precision: values may have digits the mapped decimal cannot hold."""


def resolve(
    catalog_type: str,
    *,
    unbounded_numeric: str = DEFAULT_UNBOUNDED_NUMERIC,
    type_overrides: Mapping[str, str] | None = None,
    user_type: str | None = None,
    arrays: str = ARRAYS_AS_LIST,
) -> ColumnMapping:
    """What a catalog type name (as ``format_type`` prints it, typmod included) becomes in
    Delta; a type without a native mapping becomes ``string``, the text PostgreSQL printed.

    ``unbounded_numeric`` is the Delta type of ``numeric`` without precision (from
    :func:`parse_unbounded_numeric_rule`). ``type_overrides`` maps a type name (as the
    manifest spells it, without ``[]``) to ``string``, the only Delta type allowed (anything
    else: :class:`~airflow_provider_pgdecode.errors.UnmappedTypeError`). ``user_type`` (the
    manifest's ``user_type``: ``enum``, ``domain`` ...) maps the type (or its element) to
    ``string`` unless ``type_overrides`` names it. ``arrays="json"`` (the table was staged with the option
    ``arrays: json``; the manifest's ``arrow`` is ``string``): an array maps to ``string``.
    """
    text = catalog_type.strip()
    element_name = array_element(text)
    if element_name is not None and arrays == ARRAYS_AS_JSON:
        return ColumnMapping(catalog_type, TEXT, TEXT)
    if element_name is not None:
        element = resolve(
            element_name, unbounded_numeric=unbounded_numeric, type_overrides=type_overrides, user_type=user_type
        )
        if not array_staged_as_list(element_name.strip()):
            return ColumnMapping(catalog_type, TEXT, TEXT)
        return ColumnMapping(
            catalog_type, f"list<item: {element.arrow}>", f"array<{element.delta}>", element.kind, element=element
        )

    overrides = dict(type_overrides or {})
    if user_type is not None:
        overrides = {text: TEXT, **overrides}
    if text in overrides:
        if overrides[text].strip().lower() != TEXT:
            raise UnmappedTypeError(
                f"type override {text!r} -> {overrides[text]!r}: a user-defined type is staged as the text "
                f"PostgreSQL printed and can only map to 'string'"
            )
        return ColumnMapping(catalog_type, TEXT, TEXT)

    typmod = numeric_typmod(text)
    if typmod is not None:
        precision, scale = typmod
        return ColumnMapping(
            catalog_type,
            TEXT,
            numeric_delta_type(precision, scale, unbounded_numeric),
            Kind.NUMERIC_TEXT,
            unbounded=precision is None,
        )
    entry = find(text)
    if entry is None:
        # An extension's or a user's type (hstore, ltree, isbn, PostGIS geometry, a composite ...):
        # both plugins print its text output, which is staged and kept as it is.
        return ColumnMapping(catalog_type, TEXT, TEXT)
    return ColumnMapping(catalog_type, entry.arrow, entry.delta, entry.kind)


# --- documentation -------------------------------------------------------------------------

DOC_BEGIN = "<!-- typemap:begin -->"
DOC_END = "<!-- typemap:end -->"
DOC_FILE = "docs/merge.md"
"""The document holding the generated table (docs/staging-format.md links to it)."""


@dataclass(frozen=True)
class _Rule:
    """A row of the documented table for what a rule computes rather than an entry lists."""

    pattern: str
    arrow: str
    delta: str
    conversion: str
    note: str
    example: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()
    user_type: str | None = None


_NUMERIC_LABEL = KIND_LABELS[Kind.NUMERIC_TEXT]
_PLAIN_LABEL = KIND_LABELS[Kind.PLAIN]

_RULES: tuple[_Rule, ...] = (
    _Rule(
        "`numeric(p,s)`, p ≤ 38",
        TEXT,
        "`decimal(p,s)`",
        _NUMERIC_LABEL,
        "exact: PostgreSQL already rounded to s",
        "numeric(12,2)",
    ),
    _Rule("`numeric(p)`", TEXT, "`decimal(p,0)`", _NUMERIC_LABEL, "", "numeric(7)"),
    _Rule("`numeric(p,s)`, p > 38", TEXT, "`string`", _NUMERIC_LABEL, "the exact text", "numeric(50,2)"),
    _Rule("`numeric(p,-s)` (PostgreSQL 15+)", TEXT, "`decimal(p+s,0)`", _NUMERIC_LABEL, "", "numeric(5,-2)"),
    _Rule("`numeric(p,s)`, s > p", TEXT, "`decimal(s,s)`", _NUMERIC_LABEL, "", "numeric(2,5)"),
    _Rule(
        "`numeric` (no precision)",
        TEXT,
        f"`{DEFAULT_UNBOUNDED_NUMERIC}` or `--unbounded-numeric`",
        _NUMERIC_LABEL,
        "every value checked to fit, see below",
        "numeric",
    ),
    _Rule(
        "other type modifiers",
        "as without",
        "as without",
        "as without",
        "`character varying(20)`, `bit(8)`, `time(3) with time zone`, `interval(3)` map as the type without them",
        "timestamp(3) with time zone",
    ),
    _Rule(
        "`T[]` (one dimension)",
        "`list<item: A>` (A: T's Arrow type)",
        "`array<D>` (D: T's Delta type)",
        "as T",
        "elements converted as T; NULL elements kept; an explicit lower bound (`[0:1]={a,b}`) dropped; "
        "a multi-dimensional value is a bad value (see below) unless the table's arrays are staged as JSON",
        "numeric(6,2)[]",
    ),
    _Rule(
        "`T[]` of a table with the option `arrays: json` (any dimensions)",
        TEXT,
        "`string`",
        "JSON",
        "nested JSON arrays: integers and booleans as JSON numbers and booleans, finite floats as numbers, "
        "other elements as the text PostgreSQL printed; NULL as `null`; explicit lower bounds dropped",
    ),
    _Rule(
        "`box[]` (element separator not `,`)", TEXT, "`string`", _PLAIN_LABEL, "the array literal as printed", "box[]"
    ),
    _Rule(
        "enums, domains, composite and range types (the manifest's `user_type`)",
        TEXT,
        "`string`",
        _PLAIN_LABEL,
        "the text PostgreSQL printed (a domain over a number too); arrays of them: `array<string>`",
        "mood",
        user_type="enum",
    ),
    _Rule(
        "any other type: an extension's (`hstore`, `ltree`, `isbn`, PostGIS `geometry` ...) or a user's",
        TEXT,
        "`string`",
        _PLAIN_LABEL,
        "the text PostgreSQL printed (its output function's, as `psql` shows it); arrays of them: `array<string>`",
        "geometry",
    ),
)


def _code(name: str) -> str:
    return "`" + name + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The type table as Markdown: entries (adjacent ones alike share a row), then the rules."""
    lines = [
        "| PostgreSQL type (`format_type`; also accepted) | staged (Arrow) | Delta | conversion | notes |",
        "|---|---|---|---|---|",
    ]
    rows: list[tuple[list[PgType], tuple[str, str, str, str]]] = []
    for entry in TYPES:
        key = (entry.arrow, entry.delta, entry.kind, entry.note)
        if rows and rows[-1][1] == key:
            rows[-1][0].append(entry)
        else:
            rows.append(([entry], key))
    for entries, (arrow, delta, kind, note) in rows:
        names = ", ".join(
            _code(e.name) + (" (" + ", ".join(_code(a) for a in e.aliases) + ")" if e.aliases else "") for e in entries
        )
        lines.append(f"| {_cell(names)} | {_code(arrow)} | {_code(delta)} | {KIND_LABELS[kind]} | {_cell(note)} |")
    for rule in _RULES:
        note = rule.note
        if rule.example is not None:
            mapped = resolve(rule.example, type_overrides=dict(rule.overrides), user_type=rule.user_type)
            example = f"e.g. `{rule.example}` → `{mapped.arrow}` / `{mapped.delta}`"
            note = f"{note}; {example}" if note else example
        arrow = _code(rule.arrow) if rule.arrow == TEXT else rule.arrow
        lines.append(
            f"| {_cell(rule.pattern)} | {_cell(arrow)} | {_cell(rule.delta)} | {rule.conversion} | {_cell(note)} |"
        )
    return "\n".join(lines) + "\n"


def doc_section(text: str) -> str:
    """What a document holds between the typemap markers (the generated table)."""
    start = text.index(DOC_BEGIN) + len(DOC_BEGIN)
    end = text.index(DOC_END, start)
    return text[start:end].strip("\n") + "\n"


def replace_doc_section(text: str, table: str) -> str:
    """``text`` with the part between the typemap markers replaced by ``table``."""
    start = text.index(DOC_BEGIN) + len(DOC_BEGIN)
    end = text.index(DOC_END, start)
    return text[:start] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``--markdown``: print the table; ``--update-docs [ROOT]``: rewrite it in docs/merge.md."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--markdown"]:
        sys.stdout.write(markdown_table())
        return 0
    if args[:1] == ["--update-docs"]:
        root = Path(args[1]) if len(args) > 1 else Path(__file__).resolve().parents[1]
        path = root / DOC_FILE
        path.write_text(replace_doc_section(path.read_text(encoding="utf-8"), markdown_table()), encoding="utf-8")
        return 0
    sys.stderr.write("usage: python -m airflow_provider_pgdecode.typemap --markdown | --update-docs [REPO_ROOT]\n")
    return 2


__all__ = [
    "ARRAYS_AS_JSON",
    "ARRAYS_AS_LIST",
    "DEFAULT_UNBOUNDED_NUMERIC",
    "NUMERIC_SPECIAL_VALUES",
    "SPARK_MAX_DECIMAL_PRECISION",
    "TEXT",
    "TYPES",
    "ColumnMapping",
    "DEFAULT_STAGING",
    "Staging",
    "Kind",
    "PgType",
    "array_element",
    "array_staged_as_list",
    "find",
    "markdown_table",
    "numeric_delta_type",
    "numeric_typmod",
    "parse_unbounded_numeric_rule",
    "resolve",
    "staged_arrow_type",
    "strip_modifiers",
    "type_key",
]


if __name__ == "__main__":
    sys.exit(main())
