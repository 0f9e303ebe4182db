"""A throwaway S3-compatible server for tests, benchmarks and ``make demo-s3``.

It is moto's server mode (``moto[server]`` from PyPI) run as a local process on 127.0.0.1: a real
HTTP S3 endpoint that pyarrow, boto3 and Hadoop's S3A client talk to as to any other store. Run
``python -m pgdecode_testing.s3_server [bucket ...]`` to start one by hand: it
prints the endpoint and keeps the server up until Ctrl-C.

Example::

    with LocalS3Server() as server:
        server.create_bucket("lake")
        settings = server.settings  # an ObjectStoreSettings for Storage("s3://lake/...", settings)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from airflow_provider_pgdecode.batch.storage import ObjectStoreSettings

ACCESS_KEY = "pgdecode-test-key"
SECRET_KEY = "pgdecode-test-secret-4e1b9c"
"""The throwaway server's credentials (moto accepts any; tests look for this one in logs)."""
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalS3Server:
    """moto's S3 server as a child process on a free port of 127.0.0.1."""

    def __init__(self, port: int | None = None, log_path: str | os.PathLike[str] | None = None) -> None:
        self.port = port or _free_port()
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"pgdecode-s3-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> ObjectStoreSettings:
        return ObjectStoreSettings(
            endpoint_url=self.endpoint_url, region=REGION, access_key=ACCESS_KEY, secret_key=SECRET_KEY
        )

    def airflow_conn_json(self) -> str:
        """The server as an Airflow ``aws`` connection (``AIRFLOW_CONN_<ID>``): key pair, endpoint_url, region."""
        import json

        return json.dumps(
            {
                "conn_type": "aws",
                "login": ACCESS_KEY,
                "password": SECRET_KEY,
                "extra": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            }
        )

    def start(self, timeout: float = 60.0) -> LocalS3Server:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the S3 server did not listen on port {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def create_bucket(self, name: str) -> str:
        """Create a bucket (an existing one is kept); return ``s3://name``."""
        import pyarrow.fs as pafs

        settings = self.settings
        pafs.S3FileSystem(
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            region=REGION,
            endpoint_override=f"127.0.0.1:{self.port}",
            scheme="http",
            allow_bucket_creation=True,
        ).create_dir(name)
        return f"s3://{name}"

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    buckets = sys.argv[1:] if argv is None else argv
    with LocalS3Server() as server:
        for bucket in buckets:
            server.create_bucket(bucket)
        print(f"S3 endpoint {server.endpoint_url} (key {ACCESS_KEY}), buckets: {', '.join(buckets) or 'none'}")
        print("Ctrl-C stops it.")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
