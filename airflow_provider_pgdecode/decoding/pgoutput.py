"""A parser for PostgreSQL's built-in ``pgoutput`` plugin (the logical replication protocol).

Each row of ``pg_logical_slot_peek_binary_changes`` holds one message; the first byte says
which (PostgreSQL's "Logical Replication Message Formats"). Integers are big-endian, strings
NUL-terminated. Relation (``R``) and Type (``Y``) messages only fill this parser's caches: they
are re-sent on every SQL call, so a parser lives for one call. Everything else becomes an event
of the model shared with ``test_decoding``, with column values as the text the type's output
function printed (``t`` tuple data), so that both plugins stage identical values.

Inside a streamed transaction (between Stream Start and Stream Stop, protocol 2+), data
messages carry the xid of the (sub)transaction that made the change; that xid is what the
assembler needs to drop a rolled-back subtransaction's changes on Stream Abort.

Its C twin, for the extract's native fast path, is ``capture/csrc/pgoutput.c``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from struct import Struct

from airflow_provider_pgdecode.decoding.events import (
    UNCHANGED_TOAST,
    Begin,
    Change,
    ColumnValue,
    Commit,
    CommitPrepared,
    Event,
    Message,
    Operation,
    Origin,
    Prepare,
    RollbackPrepared,
    RowImage,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.raw_char import InvalidText, char_text
from airflow_provider_pgdecode.errors import ConfigurationError, DecodingError

_I16 = Struct(">h")
_I32 = Struct(">i")
_U32 = Struct(">I")
_U64 = Struct(">Q")
_BEGIN = Struct(">QqI")  # final_lsn, commit_ts, xid
_COMMIT = Struct(">bQQq")  # flags, commit_lsn, end_lsn, commit_ts
_STREAM_COMMIT = Struct(">IbQQq")  # xid, flags, commit_lsn, end_lsn, commit_ts
_TWO_PHASE = Struct(">bQQqI")  # flags, lsn, end_lsn, timestamp, xid (then gid)
_BEGIN_PREPARE = Struct(">QQqI")  # prepare_lsn, end_lsn, prepare_ts, xid (then gid)
_STREAM_ABORT_INFO = Struct(">Qq")  # abort_lsn, abort_ts (protocol 4, streaming=parallel only)
_ROLLBACK_PREPARED = Struct(">bQQqqI")  # flags, prepare_end_lsn, rollback_end_lsn, prepare_ts, rollback_ts, xid

_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

#: format_type() names of built-in types by OID (what test_decoding prints for them): every type
#: of pg_type below FirstGenbkiObjectId (10000), for which pgoutput sends no Type message, but the
#: pseudo-types (no column has one). The same on PostgreSQL 14 to 18 (tests/decoding/test_builtin_types.py
#: compares it with each server's pg_type).
BUILTIN_TYPE_NAMES: dict[int, str] = {
    16: "boolean",
    17: "bytea",
    18: '"char"',
    19: "name",
    20: "bigint",
    21: "smallint",
    22: "int2vector",
    23: "integer",
    24: "regproc",
    25: "text",
    26: "oid",
    27: "tid",
    28: "xid",
    29: "cid",
    30: "oidvector",
    71: "pg_type",
    75: "pg_attribute",
    81: "pg_proc",
    83: "pg_class",
    114: "json",
    142: "xml",
    143: "xml[]",
    194: "pg_node_tree",
    199: "json[]",
    210: "pg_type[]",
    270: "pg_attribute[]",
    271: "xid8[]",
    272: "pg_proc[]",
    273: "pg_class[]",
    600: "point",
    601: "lseg",
    602: "path",
    603: "box",
    604: "polygon",
    628: "line",
    629: "line[]",
    650: "cidr",
    651: "cidr[]",
    700: "real",
    701: "double precision",
    718: "circle",
    719: "circle[]",
    774: "macaddr8",
    775: "macaddr8[]",
    790: "money",
    791: "money[]",
    829: "macaddr",
    869: "inet",
    1000: "boolean[]",
    1001: "bytea[]",
    1002: '"char"[]',
    1003: "name[]",
    1005: "smallint[]",
    1006: "int2vector[]",
    1007: "integer[]",
    1008: "regproc[]",
    1009: "text[]",
    1010: "tid[]",
    1011: "xid[]",
    1012: "cid[]",
    1013: "oidvector[]",
    1014: "character[]",
    1015: "character varying[]",
    1016: "bigint[]",
    1017: "point[]",
    1018: "lseg[]",
    1019: "path[]",
    1020: "box[]",
    1021: "real[]",
    1022: "double precision[]",
    1027: "polygon[]",
    1028: "oid[]",
    1033: "aclitem",
    1034: "aclitem[]",
    1040: "macaddr[]",
    1041: "inet[]",
    1042: "character",
    1043: "character varying",
    1082: "date",
    1083: "time without time zone",
    1114: "timestamp without time zone",
    1115: "timestamp without time zone[]",
    1182: "date[]",
    1183: "time without time zone[]",
    1184: "timestamp with time zone",
    1185: "timestamp with time zone[]",
    1186: "interval",
    1187: "interval[]",
    1231: "numeric[]",
    1248: "pg_database",
    1263: "cstring[]",
    1266: "time with time zone",
    1270: "time with time zone[]",
    1560: "bit",
    1561: "bit[]",
    1562: "bit varying",
    1563: "bit varying[]",
    1700: "numeric",
    1790: "refcursor",
    2201: "refcursor[]",
    2202: "regprocedure",
    2203: "regoper",
    2204: "regoperator",
    2205: "regclass",
    2206: "regtype",
    2207: "regprocedure[]",
    2208: "regoper[]",
    2209: "regoperator[]",
    2210: "regclass[]",
    2211: "regtype[]",
    2842: "pg_authid",
    2843: "pg_auth_members",
    2949: "txid_snapshot[]",
    2950: "uuid",
    2951: "uuid[]",
    2970: "txid_snapshot",
    3220: "pg_lsn",
    3221: "pg_lsn[]",
    3361: "pg_ndistinct",
    3402: "pg_dependencies",
    3614: "tsvector",
    3615: "tsquery",
    3642: "gtsvector",
    3643: "tsvector[]",
    3644: "gtsvector[]",
    3645: "tsquery[]",
    3734: "regconfig",
    3735: "regconfig[]",
    3769: "regdictionary",
    3770: "regdictionary[]",
    3802: "jsonb",
    3807: "jsonb[]",
    3904: "int4range",
    3905: "int4range[]",
    3906: "numrange",
    3907: "numrange[]",
    3908: "tsrange",
    3909: "tsrange[]",
    3910: "tstzrange",
    3911: "tstzrange[]",
    3912: "daterange",
    3913: "daterange[]",
    3926: "int8range",
    3927: "int8range[]",
    4066: "pg_shseclabel",
    4072: "jsonpath",
    4073: "jsonpath[]",
    4089: "regnamespace",
    4090: "regnamespace[]",
    4096: "regrole",
    4097: "regrole[]",
    4191: "regcollation",
    4192: "regcollation[]",
    4451: "int4multirange",
    4532: "nummultirange",
    4533: "tsmultirange",
    4534: "tstzmultirange",
    4535: "datemultirange",
    4536: "int8multirange",
    4600: "pg_brin_bloom_summary",
    4601: "pg_brin_minmax_multi_summary",
    5017: "pg_mcv_list",
    5038: "pg_snapshot",
    5039: "pg_snapshot[]",
    5069: "xid8",
    6101: "pg_subscription",
    6150: "int4multirange[]",
    6151: "nummultirange[]",
    6152: "tsmultirange[]",
    6153: "tstzmultirange[]",
    6155: "datemultirange[]",
    6157: "int8multirange[]",
}


#: Protocol version each PostgreSQL major version supports at most.
def max_proto_version(server_version_num: int) -> int:
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    if server_version_num >= 140000:
        return 2
    return 1


def pgoutput_options(
    publication: str,
    server_version_num: int,
    *,
    proto_version: int | None = None,
    two_phase: bool = False,
    streaming: bool = True,
    messages: bool = True,
    origin: str | None = None,
) -> list[tuple[str, str]]:
    """The plugin options to read a slot with: the highest protocol the server speaks by default.

    :param publication: publication name(s), comma-separated.
    :param two_phase: decode prepared transactions at PREPARE (protocol 3+, a two-phase slot).
    :param streaming: stream large in-progress transactions (protocol 2+).
    :param origin: ``none`` to skip changes that arrived through replication (PostgreSQL 16+).
    """
    top = max_proto_version(server_version_num)
    version = top if proto_version is None else proto_version
    if not 1 <= version <= top:
        raise ConfigurationError(f"pgoutput protocol {version} is not supported by this server (1 to {top})")
    options = [("proto_version", str(version)), ("publication_names", publication)]
    if messages and server_version_num >= 140000:
        options.append(("messages", "true"))
    if streaming and version >= 2:
        options.append(("streaming", "on" if server_version_num >= 160000 else "true"))
    if two_phase:
        if version < 3:
            raise ConfigurationError("two-phase decoding with pgoutput needs protocol 3 (PostgreSQL 15+)")
        options.append(("two_phase", "true"))
    if origin is not None:
        if server_version_num < 160000:
            raise ConfigurationError("pgoutput's origin option needs PostgreSQL 16+")
        options.append(("origin", origin))
    return options


@dataclass(slots=True)
class Relation:
    relid: int
    schema: str
    table: str
    replica_identity: str
    names: tuple[str, ...]
    types: tuple[str, ...]
    key_flags: tuple[bool, ...]


class _Malformed(Exception):
    pass


def _timestamp(micros: int) -> datetime | None:
    if micros == 0:
        return None
    return _PG_EPOCH + timedelta(microseconds=micros)


class PgOutputParser:
    """Turns rows of a ``pgoutput`` slot into events. One instance per peek call.

    :param proto_version: the protocol version the slot is read with.
    :param encoding: the database encoding as a Python codec name.
    :param type_names: ``format_type`` names by type OID, from the catalog (the extract loads
        them); without it, built-in types are named from a table and others from Type messages.
    """

    __test__ = False
    plugin = "pgoutput"

    def __init__(
        self,
        proto_version: int = 4,
        encoding: str = "utf-8",
        type_names: dict[int, str] | None = None,
    ) -> None:
        self.proto_version = proto_version
        self.encoding = encoding
        self.type_names = type_names or {}
        self.relations: dict[int, Relation] = {}
        #: Every ``(schema, table)`` a Relation message named, with the OIDs it named that way
        #: (in order): how a batch knows which table each staged name is, across renames.
        self.relation_oids: dict[tuple[str, str], list[int]] = {}
        self._types: dict[int, str] = {}
        self._streaming = False
        self._stream_xid: int | None = None

    def parse(self, lsn: Lsn, xid: int | None, data: bytes) -> Event | None:
        """Parse one message; ``None`` for Relation and Type messages (they only fill caches)."""
        try:
            return self._parse(lsn, xid, data)
        except (_Malformed, IndexError, UnicodeDecodeError) as exc:
            raise DecodingError(f"malformed pgoutput message: {exc}", lsn=lsn, data=data) from None
        except InvalidText as exc:
            raise DecodingError(f"cannot read pgoutput message: {exc}", lsn=lsn, data=data) from None
        except Exception as exc:  # struct.error and friends
            if type(exc).__name__ == "error":
                raise DecodingError(f"truncated pgoutput message ({exc})", lsn=lsn, data=data) from None
            raise

    # -- helpers ----------------------------------------------------------------------------

    def _string(self, data: bytes, pos: int) -> tuple[str, int]:
        end = data.find(b"\x00", pos)
        if end < 0:
            raise _Malformed(f"string at byte {pos} has no terminating NUL (message cut short)")
        return data[pos:end].decode(self.encoding), end + 1

    def _type_name(self, oid: int) -> str:
        name = self.type_names.get(oid) or BUILTIN_TYPE_NAMES.get(oid) or self._types.get(oid)
        if name is None:
            raise _Malformed(f"type OID {oid} is neither built in nor described by a Type message")
        return name

    def _sub_xid(self, data: bytes, pos: int) -> tuple[int | None, int]:
        """The [xid] field data messages carry inside a streamed transaction (protocol 2+)."""
        if self._streaming:
            return _U32.unpack_from(data, pos)[0], pos + 4
        return None, pos

    def _change_header(self, data: bytes, xid: int | None) -> tuple[int | None, Relation, int]:
        """The owning xid, the relation and the position after them, of an I/U/D message."""
        sub, pos = self._sub_xid(data, 1)
        relation = self._relation(_U32.unpack_from(data, pos)[0])
        return (sub if sub is not None else xid), relation, pos + 4

    def _relation(self, relid: int) -> Relation:
        relation = self.relations.get(relid)
        if relation is None:
            raise _Malformed(f"change for relation {relid} before its Relation message")
        return relation

    def _tuple(self, data: bytes, pos: int, relation: Relation, key_only: bool) -> tuple[RowImage, int]:
        (count,) = _I16.unpack_from(data, pos)
        pos += 2
        if count != len(relation.names):
            raise _Malformed(
                f"tuple of {count} columns for {relation.schema}.{relation.table}, which has {len(relation.names)}"
            )
        names = relation.names
        types = relation.types
        flags = relation.key_flags
        values: list[ColumnValue] = []
        keep: list[int] = []
        encoding = self.encoding
        for i in range(count):
            kind = data[pos]
            pos += 1
            if kind == 116:  # 't' text
                (length,) = _I32.unpack_from(data, pos)
                pos += 4
                if pos + length > len(data):
                    raise _Malformed(
                        f"value of column {names[i]!r} is {length} bytes, the message holds {len(data) - pos}"
                    )
                raw = data[pos : pos + length]
                try:
                    values.append(raw.decode(encoding))
                except UnicodeDecodeError:  # a "char" above 127 from PostgreSQL 14 (decoding/raw_char.py)
                    values.append(char_text(raw, types[i], encoding, names[i]))
                pos += length
            elif kind == 110:  # 'n' NULL (in a K tuple: not part of the key)
                values.append(None)
            elif kind == 117:  # 'u' unchanged TOAST
                values.append(UNCHANGED_TOAST)
            elif kind == 98:  # 'b' binary
                raise _Malformed(
                    "binary tuple data: pgdecode reads pgoutput in text mode; do not set the binary option"
                )
            else:
                raise _Malformed(f"unknown tuple data kind {chr(kind)!r}")
            if key_only and not flags[i]:
                continue
            keep.append(i)
        if key_only:
            return (
                RowImage(tuple(names[i] for i in keep), tuple(types[i] for i in keep), tuple(values[i] for i in keep)),
                pos,
            )
        return RowImage(names, types, tuple(values)), pos

    def _old_tuple(self, data: bytes, pos: int, relation: Relation) -> tuple[RowImage, int]:
        marker = data[pos]
        if marker == 75:  # 'K': key columns only; other columns are sent as 'n'
            return self._tuple(data, pos + 1, relation, key_only=True)
        if marker == 79:  # 'O': the whole old row (REPLICA IDENTITY FULL)
            image, pos = self._tuple(data, pos + 1, relation, key_only=False)
            # test_decoding omits NULL columns from old rows; do the same so both plugins agree.
            kept = [i for i, v in enumerate(image.values) if v is not None]
            if len(kept) != len(image.values):
                image = RowImage(
                    tuple(image.names[i] for i in kept),
                    tuple(image.types[i] for i in kept),
                    tuple(image.values[i] for i in kept),
                )
            return image, pos
        raise _Malformed(f"expected 'K' or 'O' before an old tuple, got {chr(marker)!r}")

    # -- dispatch ---------------------------------------------------------------------------

    def _parse(self, lsn: Lsn, xid: int | None, data: bytes) -> Event | None:
        kind = data[0]
        if kind == 73:  # 'I'
            owner, relation, pos = self._change_header(data, xid)
            if data[pos] != 78:
                raise _Malformed("expected 'N' in Insert")
            new, _ = self._tuple(data, pos + 1, relation, False)
            return Change(lsn, owner, Operation.INSERT, relation.schema, relation.table, None, new)
        if kind == 85:  # 'U'
            owner, relation, pos = self._change_header(data, xid)
            old = None
            if data[pos] in (75, 79):
                old, pos = self._old_tuple(data, pos, relation)
            if data[pos] != 78:
                raise _Malformed("expected 'N' in Update")
            new, _ = self._tuple(data, pos + 1, relation, False)
            return Change(lsn, owner, Operation.UPDATE, relation.schema, relation.table, old, new)
        if kind == 68:  # 'D'
            owner, relation, pos = self._change_header(data, xid)
            old, _ = self._old_tuple(data, pos, relation)
            return Change(lsn, owner, Operation.DELETE, relation.schema, relation.table, old, None)
        if kind == 66:  # 'B'
            final_lsn, commit_ts, txid = _BEGIN.unpack_from(data, 1)
            return Begin(lsn, txid, Lsn(final_lsn), _timestamp(commit_ts))
        if kind == 67:  # 'C'
            _, _, _, commit_ts = _COMMIT.unpack_from(data, 1)
            return Commit(lsn, xid, _timestamp(commit_ts))
        if kind == 82:  # 'R'
            self._parse_relation(data)
            return None
        if kind == 89:  # 'Y'
            _, pos = self._sub_xid(data, 1)
            (oid,) = _U32.unpack_from(data, pos)
            schema, pos = self._string(data, pos + 4)
            name, pos = self._string(data, pos)
            if oid not in BUILTIN_TYPE_NAMES:
                self._types[oid] = _qualified_type_name(schema, name)
            return None
        if kind == 84:  # 'T'
            sub, pos = self._sub_xid(data, 1)
            (count,) = _I32.unpack_from(data, pos)
            options = data[pos + 4]
            pos += 5
            relations = []
            for _ in range(count):
                relation = self._relation(_U32.unpack_from(data, pos)[0])
                relations.append((relation.schema, relation.table))
                pos += 4
            return Truncate(
                lsn, sub if sub is not None else xid, tuple(relations), bool(options & 1), bool(options & 2)
            )
        if kind == 77:  # 'M'
            sub, pos = self._sub_xid(data, 1)
            flags = data[pos]
            prefix, pos = self._string(data, pos + 9)
            (length,) = _I32.unpack_from(data, pos)
            content = data[pos + 4 : pos + 4 + length]
            if len(content) != length:
                raise _Malformed("message content shorter than its length")
            transactional = bool(flags & 1)
            owner = (sub if sub is not None else xid) if transactional else (xid or None)
            return Message(lsn, owner, transactional, prefix, content)
        if kind == 79:  # 'O' origin
            (origin_lsn,) = _U64.unpack_from(data, 1)
            name, _ = self._string(data, 9)
            return Origin(lsn, xid, name, Lsn(origin_lsn))
        if kind == 83:  # 'S' stream start
            stream_xid, first = _U32.unpack_from(data, 1)[0], data[5]
            self._streaming = True
            self._stream_xid = stream_xid
            return StreamStart(lsn, stream_xid, bool(first))
        if kind == 69:  # 'E' stream stop
            self._streaming = False
            stream_xid, self._stream_xid = self._stream_xid, None
            return StreamStop(lsn, stream_xid)
        if kind == 99:  # 'c' stream commit
            stream_xid, _, _, _, commit_ts = _STREAM_COMMIT.unpack_from(data, 1)
            return StreamCommit(lsn, stream_xid, _timestamp(commit_ts))
        if kind == 65:  # 'A' stream abort
            stream_xid, subxid = _U32.unpack_from(data, 1)[0], _U32.unpack_from(data, 5)[0]
            if len(data) < 9 + _STREAM_ABORT_INFO.size:
                return StreamAbort(lsn, stream_xid, subxid)
            # Protocol 4 with streaming=parallel adds where and when the abort happened.
            abort_lsn, abort_ts = _STREAM_ABORT_INFO.unpack_from(data, 9)
            return StreamAbort(lsn, stream_xid, subxid, Lsn(abort_lsn), _timestamp(abort_ts))
        if kind == 98:  # 'b' begin prepare
            _, _, _, txid = _BEGIN_PREPARE.unpack_from(data, 1)
            return Begin(lsn, txid)
        if kind in (80, 75, 112):  # 'P' prepare, 'K' commit prepared, 'p' stream prepare
            _, _, _, when, txid = _TWO_PHASE.unpack_from(data, 1)
            gid, _ = self._string(data, 1 + _TWO_PHASE.size)
            if kind == 80:
                return Prepare(lsn, txid, gid, _timestamp(when))
            if kind == 75:
                return CommitPrepared(lsn, txid, gid, _timestamp(when))
            return StreamPrepare(lsn, txid, gid, _timestamp(when))
        if kind == 114:  # 'r' rollback prepared
            _, _, _, _, rollback_ts, txid = _ROLLBACK_PREPARED.unpack_from(data, 1)
            gid, _ = self._string(data, 1 + _ROLLBACK_PREPARED.size)
            return RollbackPrepared(lsn, txid, gid, _timestamp(rollback_ts))
        raise _Malformed(f"unknown message type {chr(kind)!r}")

    def _parse_relation(self, data: bytes) -> None:
        _, pos = self._sub_xid(data, 1)
        (relid,) = _U32.unpack_from(data, pos)
        schema, pos = self._string(data, pos + 4)
        table, pos = self._string(data, pos)
        replica_identity = chr(data[pos])
        (count,) = _I16.unpack_from(data, pos + 1)
        pos += 3
        names, types, flags = [], [], []
        for _ in range(count):
            flag = data[pos]
            name, pos = self._string(data, pos + 1)
            (type_oid,) = _U32.unpack_from(data, pos)
            pos += 8  # type oid and typmod (the catalog gives typmods to the merge job)
            names.append(name)
            types.append(self._type_name(type_oid))
            flags.append(bool(flag & 1))
        self.relations[relid] = Relation(
            relid, schema or "pg_catalog", table, replica_identity, tuple(names), tuple(types), tuple(flags)
        )
        seen = self.relation_oids.setdefault((schema or "pg_catalog", table), [])
        if relid not in seen:
            seen.append(relid)


def _qualified_type_name(schema: str, name: str) -> str:
    """What format_type prints for a non-built-in type visible on the search path (schema omitted)."""
    if name.startswith("_"):
        return _qualified_type_name(schema, name[1:]) + "[]"
    if name.isidentifier() and name == name.lower():
        return name
    return '"' + name.replace('"', '""') + '"'


__all__ = ["BUILTIN_TYPE_NAMES", "PgOutputParser", "Relation", "max_proto_version", "pgoutput_options"]
