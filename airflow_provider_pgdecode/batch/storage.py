"""Where batches live: a local directory or an S3-compatible bucket, behind one interface.

Every read, write, list and delete of the batch format goes through :class:`Storage`, so the
same code stages to ``/data/staging`` and to ``s3://lake/staging``. It is built on
:mod:`pyarrow.fs`: pyarrow is already the batch format's library (it writes and reads the
Parquet parts), its :class:`~pyarrow.fs.S3FileSystem` runs in the Spark driver with no further
dependency, and it needs none of fsspec/s3fs/aiobotocore, whose botocore pins fight the Amazon
provider's (docs/object-storage.md).

Credentials are an :class:`ObjectStoreSettings`: built by the operators from an Airflow ``aws``
connection, handed to the Spark job as ``AWS_*`` environment variables (never on a command line),
and read back from the environment by :meth:`ObjectStoreSettings.from_env`.

A batch on object storage is committed by its manifest alone (there is no rename): its parts are
uploaded first, the manifest last; a batch directory without a manifest does not exist for any
reader (docs/staging-format.md).

Example::

    from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings, Storage

    store = Storage("s3://lake/staging", ObjectStoreSettings(endpoint_url="http://127.0.0.1:9000"))
    store.write_bytes("pgdecode_slot/notes.txt", b"hello")
    assert store.read_bytes("pgdecode_slot/notes.txt") == b"hello"
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from airflow_provider_pgdecode.errors import ConfigurationError, StagingError

OBJECT_STORE_SCHEMES = ("s3", "s3a")
"""URI schemes of S3-compatible object storage (``s3a`` is Hadoop's name, accepted as ``s3``)."""

SPOOL_ENV = "PGDECODE_SPOOL_DIR"
"""Local directory where a batch bound for object storage is written before its upload."""


@dataclass(frozen=True)
class ObjectStoreSettings:
    """How to reach an S3-compatible store. Secrets never show in ``repr`` (logs, tracebacks).

    :param endpoint_url: e.g. ``http://127.0.0.1:9000`` for a local S3-compatible server;
        ``None`` for AWS itself.
    :param region: the bucket's region (``us-east-1`` when not given).
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    ENV = {
        "endpoint_url": "AWS_ENDPOINT_URL_S3",
        "region": "AWS_REGION",
        "access_key": "AWS_ACCESS_KEY_ID",
        "secret_key": "AWS_SECRET_ACCESS_KEY",
        "session_token": "AWS_SESSION_TOKEN",
    }

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values that must never appear in a command line, a log or XCom."""
        return tuple(s for s in (self.secret_key, self.session_token) if s)

    def to_env(self) -> dict[str, str]:
        """The ``AWS_*`` environment variables that carry these settings to another process."""
        return {name: str(getattr(self, attr)) for attr, name in self.ENV.items() if getattr(self, attr)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ObjectStoreSettings:
        """The settings in ``env`` (default ``os.environ``): ``AWS_ENDPOINT_URL_S3`` (or
        ``AWS_ENDPOINT_URL``), ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), the key pair and token."""
        env = os.environ if env is None else env
        values = {attr: env.get(name) or None for attr, name in cls.ENV.items()}
        values["endpoint_url"] = values["endpoint_url"] or env.get("AWS_ENDPOINT_URL") or None
        values["region"] = values["region"] or env.get("AWS_DEFAULT_REGION") or None
        return cls(**values)

    def filesystem(self) -> pafs.S3FileSystem:
        """A pyarrow S3 filesystem for these settings."""
        options: dict[str, Any] = {"region": self.region or "us-east-1"}
        if self.access_key:
            options.update(access_key=self.access_key, secret_key=self.secret_key, session_token=self.session_token)
        if self.endpoint_url:
            endpoint = urlparse(self.endpoint_url)
            if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
                raise ConfigurationError(
                    f"endpoint_url {self.endpoint_url!r} is not an http(s) URL; set the connection's extra "
                    '{"endpoint_url": "http://host:port"} for an S3-compatible store'
                )
            options.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
            # S3-compatible servers address buckets by path, not by virtual host.
            options["force_virtual_addressing"] = False
        return pafs.S3FileSystem(**options)

    def delta_rs_options(self) -> dict[str, str]:
        """delta-rs ``storage_options`` for these settings, the credentials included (never logged).
        Its commits write the log file without a lock service (``AWS_S3_ALLOW_UNSAFE_RENAME``):
        one writer per table at a time, what Delta's own S3 log store assumes too."""
        options = {"AWS_REGION": self.region or "us-east-1", "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
        if self.endpoint_url:
            options["AWS_ENDPOINT_URL"] = self.endpoint_url
            options["AWS_ALLOW_HTTP"] = str(self.endpoint_url.startswith("http:")).lower()
            options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        if self.access_key:
            options["AWS_ACCESS_KEY_ID"] = self.access_key
            options["AWS_SECRET_ACCESS_KEY"] = self.secret_key or ""
            if self.session_token:
                options["AWS_SESSION_TOKEN"] = self.session_token
        return options

    def hadoop_conf(self) -> dict[str, str]:
        """Hadoop S3A settings (``fs.s3a.*``) for Spark, the credentials included: set them on the
        running session's Hadoop configuration, never as ``--conf`` (a command line) or SparkConf
        (the event log)."""
        conf = {"fs.s3a.path.style.access": "true" if self.endpoint_url else "false"}
        if self.endpoint_url:
            conf["fs.s3a.endpoint"] = self.endpoint_url
            conf["fs.s3a.connection.ssl.enabled"] = str(self.endpoint_url.startswith("https:")).lower()
        conf["fs.s3a.endpoint.region"] = self.region or "us-east-1"
        if self.access_key:
            conf["fs.s3a.access.key"] = self.access_key
            conf["fs.s3a.secret.key"] = self.secret_key or ""
            if self.session_token:
                conf["fs.s3a.session.token"] = self.session_token
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
            else:
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        return conf


def is_object_store(location: str | os.PathLike[str]) -> bool:
    """True for ``s3://`` and ``s3a://`` locations."""
    return urlparse(os.fspath(location)).scheme in OBJECT_STORE_SCHEMES


def spark_uri(location: str | os.PathLike[str]) -> str:
    """The location as Spark's Hadoop filesystems name it: ``s3a://`` for object storage."""
    text = os.fspath(location)
    if is_object_store(text):
        return "s3a://" + text.split("://", 1)[1]
    return text


def _normalize(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location)
    parsed = urlparse(text)
    if parsed.scheme in OBJECT_STORE_SCHEMES:
        if not parsed.netloc:
            raise ConfigurationError(f"{text!r} names no bucket; write s3://bucket/prefix")
        return "s3://" + (parsed.netloc + "/" + parsed.path.strip("/")).rstrip("/")
    if parsed.scheme == "file":
        return parsed.path.rstrip("/") or "/"
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ConfigurationError(
            f"{text!r}: unsupported location scheme {parsed.scheme!r}; use a local path or s3://bucket/prefix"
        )
    return os.path.abspath(text)


class Storage:
    """A root location (local directory or ``s3://bucket/prefix``) and the filesystem that reaches it.

    Paths given to the methods are relative to the root, ``/``-separated. Every ``OSError`` becomes
    a :class:`~airflow_provider_pgdecode.errors.StagingError` naming the location and the cause.
    """

    def __init__(
        self, root: str | os.PathLike[str], settings: ObjectStoreSettings | None = None, *, _fs: Any = None
    ) -> None:
        self.root = _normalize(root)
        self.is_local = not self.root.startswith("s3://")
        self.settings = (
            settings if settings is not None else (None if self.is_local else ObjectStoreSettings.from_env())
        )
        if _fs is not None:
            self.filesystem = _fs
        elif self.is_local:
            self.filesystem = pafs.LocalFileSystem()
        else:
            assert self.settings is not None
            self.filesystem = self.settings.filesystem()

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def __fspath__(self) -> str:
        """A local storage is path-like (``Path(store)``); an object store is not."""
        if not self.is_local:
            raise TypeError(f"{self.root} is on object storage, not a local path")
        return self.root

    def __str__(self) -> str:
        return self.root

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def child(self, *parts: str) -> Storage:
        """The storage rooted at ``parts`` under this one (same filesystem and settings)."""
        return Storage(self.uri(*parts), self.settings, _fs=self.filesystem)

    def at(self, location: str | os.PathLike[str]) -> Storage:
        """The storage rooted at another location of the same kind (same settings), e.g. a
        batch directory named by a manifest or a checkpoint."""
        target = _normalize(location)
        if target.startswith("s3://") == (not self.is_local):
            return Storage(target, self.settings, _fs=self.filesystem)
        return Storage(target, self.settings if not target.startswith("s3://") else None)

    def uri(self, *parts: str) -> str:
        """The full location of ``parts``: an absolute local path or an ``s3://`` URI."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def _path(self, relative: str) -> str:
        uri = self.uri(relative) if relative else self.root
        return uri[len("s3://") :] if uri.startswith("s3://") else uri

    def _error(self, exc: OSError, relative: str, action: str) -> StagingError:
        from airflow_provider_pgdecode.errors import staging_io_error

        return staging_io_error(exc, self.uri(relative) if relative else self.root, action)

    # -- reading -----------------------------------------------------------------------------

    def exists(self, relative: str = "") -> bool:
        try:
            return self.filesystem.get_file_info(self._path(relative)).type != pafs.FileType.NotFound
        except OSError as exc:
            raise self._error(exc, relative, "look up") from exc

    def is_file(self, relative: str) -> bool:
        try:
            return self.filesystem.get_file_info(self._path(relative)).type == pafs.FileType.File
        except OSError as exc:
            raise self._error(exc, relative, "look up") from exc

    def read_bytes(self, relative: str) -> bytes:
        """The object's bytes as stored (``compression=None``: pyarrow would otherwise gunzip a
        ``.gz`` name on read and gzip it again on write)."""
        try:
            with self.filesystem.open_input_stream(self._path(relative), compression=None) as stream:
                return bytes(stream.read())
        except FileNotFoundError:
            raise
        except OSError as exc:
            if _not_found(exc):
                raise FileNotFoundError(self.uri(relative)) from exc
            raise self._error(exc, relative, "read") from exc

    def read_text(self, relative: str) -> str:
        return self.read_bytes(relative).decode("utf-8")

    def open_input(self, relative: str) -> Any:
        """A seekable file for pyarrow readers (``pq.read_table(store.open_input(p))``)."""
        try:
            return self.filesystem.open_input_file(self._path(relative))
        except OSError as exc:
            raise self._error(exc, relative, "open") from exc

    def list_dir(self, relative: str = "") -> list[tuple[str, bool]]:
        """``(name, is_directory)`` of the entries directly under ``relative``, sorted; ``[]`` when
        it does not exist."""
        selector = pafs.FileSelector(self._path(relative), allow_not_found=True, recursive=False)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as exc:
            raise self._error(exc, relative, "list") from exc
        return sorted((info.base_name, info.type == pafs.FileType.Directory) for info in infos)

    def walk_files(self, relative: str = "") -> list[str]:
        """Every file under ``relative``, as paths relative to it, sorted."""
        base = self._path(relative).rstrip("/")
        selector = pafs.FileSelector(base, allow_not_found=True, recursive=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as exc:
            raise self._error(exc, relative, "list") from exc
        return sorted(info.path[len(base) + 1 :] for info in infos if info.type == pafs.FileType.File)

    def mtime(self, relative: str) -> float:
        """Seconds since the epoch of the last write (``0.0`` when the store does not say)."""
        try:
            info = self.filesystem.get_file_info(self._path(relative))
        except OSError as exc:
            raise self._error(exc, relative, "look up") from exc
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.uri(relative))
        return info.mtime.timestamp() if info.mtime is not None else 0.0

    # -- writing -----------------------------------------------------------------------------

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write a whole object: on object storage one PUT (atomic); on a local disk a temporary
        file made durable, then renamed over the target, so a reader never sees half of it."""
        try:
            if self.is_local:
                target = Path(self._path(relative))
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, target)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                fsync_dir(target.parent)
            else:
                with self.filesystem.open_output_stream(self._path(relative), compression=None) as stream:
                    stream.write(data)
        except OSError as exc:
            raise self._error(exc, relative, "write") from exc

    def write_text(self, relative: str, text: str) -> None:
        self.write_bytes(relative, text.encode("utf-8"))

    def open_output(self, relative: str) -> IO[bytes]:
        """A stream for pyarrow writers; the object appears when the stream is closed."""
        try:
            if self.is_local:
                Path(self._path(relative)).parent.mkdir(parents=True, exist_ok=True)
            return self.filesystem.open_output_stream(self._path(relative), compression=None)
        except OSError as exc:
            raise self._error(exc, relative, "write") from exc

    def make_dirs(self, relative: str = "") -> None:
        try:
            self.filesystem.create_dir(self._path(relative), recursive=True)
        except OSError as exc:
            raise self._error(exc, relative, "create directory") from exc

    def delete_file(self, relative: str) -> None:
        """Remove one file; a missing one is not an error."""
        try:
            self.filesystem.delete_file(self._path(relative))
        except FileNotFoundError:
            pass
        except OSError as exc:
            if not _not_found(exc):
                raise self._error(exc, relative, "remove") from exc

    def delete_tree(self, relative: str = "") -> None:
        """Remove a directory and everything under it; a missing one is not an error."""
        try:
            if self.exists(relative):
                self.filesystem.delete_dir(self._path(relative))
        except OSError as exc:
            if not _not_found(exc):
                raise self._error(exc, relative, "remove") from exc

    def upload_tree(self, local_dir: str | os.PathLike[str], relative: str, *, last: str | None = None) -> None:
        """Copy every file of ``local_dir`` to ``relative``, the file named ``last`` (a manifest)
        after all others, so that it marks the copy as complete."""
        source = Path(local_dir)
        files = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
        ordered = [f for f in files if f != last] + ([last] if last in files else [])
        for name in ordered:
            try:
                with open(source / name, "rb") as src, self.open_output(posixpath.join(relative, name)) as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
            except OSError as exc:
                raise self._error(exc, posixpath.join(relative, name), "upload") from exc


def _not_found(exc: OSError) -> bool:
    text = str(exc)
    return isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "Path does not exist" in text


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a local directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def as_storage(location: str | os.PathLike[str] | Storage, settings: ObjectStoreSettings | None = None) -> Storage:
    """A :class:`Storage` for a location given as a path, a URI or a Storage already."""
    if isinstance(location, Storage):
        return location
    return Storage(location, settings)


def spool_dir() -> Path:
    """The local directory where batches bound for object storage are written before upload:
    ``$PGDECODE_SPOOL_DIR``, else the system's temporary directory."""
    base = Path(os.environ.get(SPOOL_ENV) or tempfile.gettempdir()) / "pgdecode-spool"
    base.mkdir(parents=True, exist_ok=True)
    return base


def iter_names(store: Storage, relative: str = "", *, directories: bool = True) -> Iterator[str]:
    """Names of the directories (or files) directly under ``relative``."""
    for name, is_dir in store.list_dir(relative):
        if is_dir == directories:
            yield name


__all__ = [
    "OBJECT_STORE_SCHEMES",
    "ObjectStoreSettings",
    "SPOOL_ENV",
    "Storage",
    "as_storage",
    "fsync_dir",
    "is_object_store",
    "iter_names",
    "spark_uri",
    "spool_dir",
]
