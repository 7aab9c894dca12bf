"""Local object-storage servers on loopback for the tests and benchmarks of ``s3://`` and ``gs://`` data: moto's S3
server (a bucket filled from local files, IAM users with and without read access, and the environment the AWS tools
read) and a Google Cloud Storage emulator, each in its own process.

Needs ``moto[server]`` and ``gcp-storage-emulator`` (the ``test`` extra).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lightning_rec.testing.ports import free_port

__all__ = ["LocalGCS", "LocalS3", "aws_env"]

_READ_ALL = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})


def _serve(command: list[str], port: int, timeout: float, name: str) -> subprocess.Popen[bytes]:
    """Start ``command`` (a server on ``127.0.0.1:port``) and return once it accepts connections."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:  # ready when it accepts a connection (or it died: then say so)
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} before it listened.")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            if time.monotonic() > deadline:
                process.terminate()
                process.wait(timeout=30)
                raise TimeoutError(f"{name} did not listen on port {port} within {timeout:.0f} s.") from None
            time.sleep(0.05)  # polling a port that is not open yet, not waiting for an event


class LocalGCS:
    """A Google Cloud Storage emulator (``gcp-storage-emulator``, in memory) on ``127.0.0.1`` at a free port, started
    by ``with`` and stopped after; ``STORAGE_EMULATOR_HOST`` set to it meanwhile, as Google's client libraries read it.

    Example::

        with LocalGCS() as gcs:
            gcs.upload("clicks", {"2026/a.parquet": "data/a.parquet"})
            TabularDataModule(schema=..., train="gs://clicks/2026/*.parquet").sparse_features
    """

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self.startup_timeout = startup_timeout
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._saved: str | None = None

    @property
    def endpoint(self) -> str:
        """The emulator's URL (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalGCS:
        self.port = free_port()
        command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--in-memory"]
        self._process = _serve(command, self.port, self.startup_timeout, "the GCS emulator")
        self._saved = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = self.endpoint
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = self._saved
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._process = None

    def upload(self, bucket: str, files: Mapping[str, str | os.PathLike[str]]) -> None:
        """Create ``bucket`` (if new) and put each local file at its key (``{key: path}``)."""
        import pyarrow.fs as pafs

        gcs = pafs.GcsFileSystem(
            anonymous=True, scheme="http", endpoint_override=f"127.0.0.1:{self.port}", project_id="local"
        )
        gcs.create_dir(bucket)
        for key, path in files.items():
            with open(path, "rb") as src, gcs.open_output_stream(f"{bucket}/{key}") as dst:
                dst.write(src.read())


class LocalS3:
    """moto's S3 server on ``127.0.0.1`` at a free port, started by ``with`` and stopped after.

    Args:
        startup_timeout: seconds to wait for the server to accept connections.

    Example::

        with LocalS3() as s3:
            s3.upload("clicks", {"2026/a.parquet": "data/a.parquet"})
            keys = s3.user("reader", read=True)
            with aws_env(s3.endpoint, *keys):
                TabularDataModule(schema=..., train="s3://clicks/2026/*.parquet").sparse_features
    """

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self.startup_timeout = startup_timeout
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The server's URL (``http://127.0.0.1:PORT``), for ``AWS_ENDPOINT_URL``."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalS3:
        self.port = free_port()
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._process = _serve(command, self.port, self.startup_timeout, "moto's S3 server")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._process = None

    def client(self, service: str = "s3") -> Any:
        """A boto3 client of ``service`` on this server, as the unauthenticated administrator (before
        :meth:`enforce_auth`)."""
        import boto3  # type: ignore[import-untyped]  # boto3 ships no type information

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id="admin",
            aws_secret_access_key="admin",
            region_name="us-east-1",
        )

    def upload(self, bucket: str, files: Mapping[str, str | os.PathLike[str]]) -> None:
        """Create ``bucket`` (if new) and put each local file at its key (``{key: path}``)."""
        s3 = self.client()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for key, path in files.items():
            s3.upload_file(str(path), bucket, key)

    def user(self, name: str, read: bool) -> tuple[str, str]:
        """An IAM user's ``(access key id, secret)``: with ``read``, allowed everything on S3; else nothing."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        if read:
            iam.put_user_policy(UserName=name, PolicyName="read", PolicyDocument=_READ_ALL)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def enforce_auth(self) -> None:
        """From now on every request is authenticated and authorised against IAM (moto serves anyone until then)."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form's body would be parsed away before moto reads it
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


@contextmanager
def aws_env(endpoint: str | None, key: str | None, secret: str | None, **extra: str) -> Iterator[None]:
    """The AWS variables set as for the AWS CLI (endpoint, keys, region ``us-east-1``; no profile files, no instance
    metadata) and the others removed, restored after; ``extra``: more variables (``AWS_PROFILE=...``)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for k in saved:
        del os.environ[k]
    values = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        **extra,
    }
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[k]
        os.environ.update(saved)
