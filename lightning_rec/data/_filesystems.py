"""Where :class:`~lightning_rec.data.TabularDataModule`'s files are: paths on this machine, or object storage
(``s3://bucket/key``, ``gs://bucket/key``, ``az://container/blob``), read through ``pyarrow.fs``'s own filesystems
(no other package: the PyPI wheels of pyarrow carry S3, GCS and Azure).

Credentials and endpoint are taken as each provider's own tools take them:

- ``s3://``: as the AWS CLI does: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
  ``AWS_PROFILE`` and ``~/.aws/credentials``/``~/.aws/config`` (SSO, roles, ``credential_process``), the instance's
  role; the endpoint of an S3-compatible store (MinIO, Ceph, R2, a local server) from ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT_URL``, the profile's ``services`` section or its ``endpoint_url`` (pyarrow reads the profile's
  credentials but not its endpoint, so the endpoint is resolved here, in the AWS CLI's order); the region from
  ``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile, else asked of the bucket.
- ``gs://``: Google's application default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
  application-default login``, the instance's service account); ``STORAGE_EMULATOR_HOST``: a local server, as for
  Google's client libraries.
- ``az://container/path``: the account ``AZURE_STORAGE_ACCOUNT_NAME``, with ``AZURE_STORAGE_ACCOUNT_KEY`` or else
  Azure's default credential chain (environment, managed identity, ``az login``).

A failure is one line naming the URL and its cause (no such bucket, no credentials, access denied, no match).
"""

from __future__ import annotations

import configparser
import fnmatch
import functools
import glob
import gzip
import io
import os
import re
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["SCHEMES", "expand_url", "first_line", "is_url", "open_file", "parquet_file", "size"]

# scheme -> how a user names it in messages
SCHEMES = {"s3": "S3", "gs": "Google Cloud Storage", "gcs": "Google Cloud Storage", "az": "Azure Blob Storage"}
# A remote file's read buffer: a request per 64 KiB read line by line (a CSV's header, the line ends its byte ranges
# are cut at); a read of more than that is one request of its own size.
_BUFFER = 64 << 10


def is_url(path: str) -> bool:
    """Whether ``path`` is an object-storage URL read here (``s3://``, ``gs://``, ``gcs://``, ``az://``)."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``url``; the key without its leading ``/``.

    Example::

        >>> split_url("s3://clicks/2026/*.parquet")
        ('s3', 'clicks', '2026/*.parquet')
    """
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key


def _aws_config(credentials: bool = False) -> tuple[configparser.ConfigParser, str, str]:
    """The AWS config (or credentials) file as the AWS CLI finds it, the profile in use and its section name."""
    name = "AWS_SHARED_CREDENTIALS_FILE" if credentials else "AWS_CONFIG_FILE"
    path = os.environ.get(name) or os.path.join("~", ".aws", "credentials" if credentials else "config")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(os.path.expanduser(path))
    except configparser.Error:
        pass  # a file the AWS tools would refuse too: pyarrow's own error will say
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    section = profile if credentials or profile == "default" else f"profile {profile}"
    return parser, profile, section


def _nested(value: str) -> dict[str, str]:
    """A nested AWS config value (``s3 =\\n  endpoint_url = ...``) as a dict."""
    out = {}
    for line in value.splitlines():
        key, sep, v = line.partition("=")
        if sep:
            out[key.strip()] = v.strip()
    return out


def s3_endpoint() -> str | None:
    """The S3 endpoint the AWS CLI would use (``None``: AWS's own), in its order: ``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``, the profile's ``services`` section (``s3 = endpoint_url = ...``), the profile's
    ``endpoint_url``; none of them when ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is true."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return os.environ[var]
    parser, _, section = _aws_config()
    if not parser.has_section(section):
        return None
    services = parser.get(section, "services", fallback=None)
    if services and parser.has_section(f"services {services}"):
        endpoint = _nested(parser.get(f"services {services}", "s3", fallback="")).get("endpoint_url")
        if endpoint:
            return endpoint
    return parser.get(section, "endpoint_url", fallback=None)


def _s3_region() -> str | None:
    if os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    parser, _, section = _aws_config()
    return parser.get(section, "region", fallback=None) if parser.has_section(section) else None


def s3_credentials() -> str | None:
    """Where the AWS tools would find credentials on this machine (a short description), or ``None`` when nowhere
    but perhaps the instance's metadata service (which cannot be known without asking it)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return "AWS_ACCESS_KEY_ID from the environment"
    for var in (
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        if os.environ.get(var):
            return f"{var} from the environment"
    keys = (
        "aws_access_key_id",
        "credential_process",
        "sso_session",
        "sso_start_url",
        "role_arn",
        "web_identity_token_file",
    )
    for credentials in (True, False):
        parser, profile, section = _aws_config(credentials)
        if parser.has_section(section) and any(parser.has_option(section, k) for k in keys):
            return f"profile {profile!r}"
    return None


def _no_credentials_hint() -> str:
    return (
        "no AWS credentials found (HINT: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with its "
        "credentials in ~/.aws/credentials, as for the AWS CLI)"
    )


# The variables the providers' tools (and pyarrow's clients) read credentials, endpoints and regions from.
_ENV_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCE_", "STORAGE_EMULATOR_HOST")


def environment() -> dict[str, str]:
    """This process's object-storage variables (``AWS_*``, ``AZURE_*``, ``GOOGLE_*``...), to hand to the processes
    that read for it (:func:`adopt_environment`)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def adopt_environment(env: dict[str, str]) -> None:
    """Make this process's object-storage variables ``env``: a DataLoader worker forked from the fork server has the
    server's environment, from when it started, not that of the process whose loader it serves (a notebook that set
    ``AWS_PROFILE`` afterwards, say)."""
    for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def _filesystem(scheme: str, bucket: str) -> Any:
    """The ``pyarrow.fs`` filesystem serving ``bucket``, built as the provider's tools would connect: one per
    bucket, process and set of object-storage variables."""
    return _connect(scheme, bucket, tuple(sorted(environment().items())))


@functools.cache  # a client per bucket and settings: its connections are reused by every file read
def _connect(scheme: str, bucket: str, env: tuple[tuple[str, str], ...]) -> Any:
    import pyarrow.fs as pafs

    if scheme == "s3":
        endpoint = s3_endpoint()
        region = _s3_region()
        if region is None and endpoint is None:
            try:
                region = pafs.resolve_s3_region(bucket)  # what FileSystem.from_uri does: a bucket's own region
            except OSError:
                region = None  # the request that follows says why (no such bucket, no network)
        options: dict[str, Any] = {"region": region} if region else {}
        if endpoint:
            scheme_, _, host = endpoint.partition("://")
            options.update(endpoint_override=host.rstrip("/") if host else endpoint, scheme=scheme_ if host else None)
        return pafs.S3FileSystem(**options)
    if scheme in ("gs", "gcs"):
        if not hasattr(pafs, "GcsFileSystem"):
            raise ImportError(
                "gs:// URLs are read with pyarrow's GCS filesystem, which this pyarrow was built without: "
                "`pip install --force-reinstall pyarrow` (the PyPI wheels have it)."
            )
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")  # Google's client libraries' variable for a local server
        if emulator:
            scheme_, _, host = emulator.partition("://")
            return pafs.GcsFileSystem(
                anonymous=True, scheme=scheme_ if host else "http", endpoint_override=host or emulator
            )
        return pafs.GcsFileSystem()
    if not hasattr(pafs, "AzureFileSystem"):
        raise ImportError(
            "az:// URLs are read with pyarrow's Azure filesystem, which this pyarrow was built without: "
            "`pip install --force-reinstall 'pyarrow>=16'` (the PyPI wheels have it)."
        )
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise PermissionError(
            "az:// URLs name a container, not its storage account: set AZURE_STORAGE_ACCOUNT_NAME (and "
            "AZURE_STORAGE_ACCOUNT_KEY, or sign in as Azure's tools do: `az login`, a managed identity)."
        )
    key = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    return pafs.AzureFileSystem(account_name=account, **({"account_key": key} if key else {}))


def _resolve(url: str, what: str) -> tuple[Any, str]:
    """``(filesystem, path inside it)`` of ``url``; a failure to connect named with the URL."""
    scheme, bucket, key = split_url(url)
    if not bucket:
        raise FileNotFoundError(f"TabularDataModule: {what}: {url!r} names no bucket ({scheme}://BUCKET/PATH).")
    try:
        return _filesystem(scheme, bucket), f"{bucket}/{key}".rstrip("/")
    except (ImportError, PermissionError) as err:
        raise type(err)(f"TabularDataModule: {what}: {url!r}: {err}") from None


def storage_error(url: str, what: str, err: OSError) -> OSError:
    """``err`` (pyarrow's message about a request) as one line naming ``url`` and the cause: no such bucket
    (``FileNotFoundError``), no credentials or access denied (``PermissionError``), else the provider's words."""
    text = " ".join(str(err).split())
    scheme, bucket, _ = split_url(url)
    head = f"TabularDataModule: {what}: {url!r}:"
    if re.search(r"NO_SUCH_BUCKET|bucket does not exist|Bucket .* not found|ContainerNotFound", text, re.I):
        return FileNotFoundError(f"{head} no such bucket {bucket!r} ({SCHEMES[scheme]}{_at_endpoint(scheme)}).")
    denied = re.search(
        r"ACCESS_DENIED|Access ?Denied|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|HTTP status 40[13]|"
        r"AuthorizationPermissionMismatch|AuthenticationFailed|PERMISSION_DENIED|UNAUTHENTICATED",
        text,
        re.I,
    )
    answered = "AWS Error" in text and "NETWORK_CONNECTION" not in text  # the server answered, and refused
    if scheme == "s3" and s3_credentials() is None and (denied or answered):
        return PermissionError(f"{head} {_no_credentials_hint()}.")
    if denied:
        who = f" for {s3_credentials()}" if scheme == "s3" else ""
        return PermissionError(
            f"{head} access denied{who} ({_first_sentence(text)}). HINT: credentials that may read the bucket."
        )
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(f"{head} does not exist.")
    return OSError(f"{head} {_first_sentence(text)}")


def _at_endpoint(scheme: str) -> str:
    endpoint = s3_endpoint() if scheme == "s3" else None
    return f" at {endpoint}" if endpoint else ""


def _first_sentence(text: str) -> str:
    """pyarrow's message, short: the operation and the server's words (``ListObjectsV2: Access Denied``), without
    the request id (different every time)."""
    text = re.sub(r"\s*\(Request ID: [^)]*\)", "", text).rstrip(". ")
    said = re.search(r"during (\w+) operation: (.*)", text)
    return f"{said.group(1)}: {said.group(2)}" if said else text


def _check_s3_credentials(url: str, what: str) -> None:
    """Refuse before any request when there are certainly no credentials: none in the environment or the AWS files,
    and the instance metadata service disabled (``AWS_EC2_METADATA_DISABLED``, as the AWS tools honour it)."""
    if split_url(url)[0] != "s3" or s3_credentials() is not None:
        return
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        raise PermissionError(f"TabularDataModule: {what}: {url!r}: {_no_credentials_hint()}.")


def expand_url(pattern: str, what: str, suffixes: Sequence[str]) -> list[str]:
    """The table files (names ending in ``suffixes``) an object-storage URL names, sorted: one object, a "folder"
    (a prefix: the tables directly under it) or a glob (``*``, ``?``, ``[...]`` within one path segment, as
    :mod:`glob` matches local paths).

    Raises:
        FileNotFoundError: no such bucket, or nothing matches, naming the URL.
        PermissionError: no credentials, or access denied, naming the URL.
    """
    import pyarrow.fs as pafs

    _check_s3_credentials(pattern, what)
    scheme, bucket, key = split_url(pattern)
    fs, path = _resolve(pattern, what)
    segments = key.rstrip("/").split("/") if key.strip("/") else []
    magic = next((i for i, s in enumerate(segments) if glob.has_magic(s)), None)
    try:
        if magic is None:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File:
                listed = [info]
                folder = False
            else:
                listed = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
                folder = True
        else:
            base = "/".join([bucket, *segments[:magic]])
            recursive = len(segments) - magic > 1  # a pattern with more segments after its first glob
            listed = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=recursive))
            folder = False
    except OSError as err:
        raise storage_error(pattern, what, err) from None
    files = [i.path for i in listed if i.type == pafs.FileType.File]
    if magic is not None:
        depth = len(segments) + 1
        files = [
            f
            for f in files
            if len(parts := f.split("/")) == depth
            and all(fnmatch.fnmatchcase(p, s) for p, s in zip(parts[1:], segments))
        ]
    found = sorted(f"{scheme}://{f}" for f in files if f.endswith(tuple(suffixes)))
    if not found and not files:
        _check_bucket(fs, pattern, what)  # a listing of a bucket that is not there is empty, not an error
    if not found:
        kinds = ", ".join(suffixes)
        if files:
            why = f"matches {len(files)} object(s) but none is a table ({kinds}), e.g. '{scheme}://{sorted(files)[0]}'."
        elif folder and not path.count("/"):
            why = "is an empty bucket."
        elif folder:
            why = "does not exist." if not listed else f"is a folder with no table file ({kinds})."
        else:
            why = "matches no file."
        raise FileNotFoundError(f"TabularDataModule: {what}: {pattern!r} {why}")
    return found


def _check_bucket(fs: Any, url: str, what: str) -> None:
    """Raise "no such bucket" (or why the bucket cannot be asked about) for ``url``'s bucket, if so."""
    import pyarrow.fs as pafs

    scheme, bucket, _ = split_url(url)
    try:
        missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except OSError as err:
        raise storage_error(url, what, err) from None
    if missing:
        raise FileNotFoundError(
            f"TabularDataModule: {what}: {url!r}: no such bucket {bucket!r} ({SCHEMES[scheme]}{_at_endpoint(scheme)})."
        )


class _Raw(io.RawIOBase):
    """A ``pyarrow`` random-access file as a raw Python file (``io.BufferedReader`` adds ``readline``)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._native.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        """The rest of the file in one request (``RawIOBase``'s own reads 8 KiB at a time: a request each)."""
        return bytes(self._native.read())

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._native.seek(offset, whence))

    def tell(self) -> int:
        return int(self._native.tell())

    def close(self) -> None:
        self._native.close()
        super().close()


def open_native(path: str, what: str = "file") -> Any:
    """A ``pyarrow`` random-access file of ``path`` (an object-storage URL), its errors naming the URL."""
    fs, inner = _resolve(path, what)
    try:
        return fs.open_input_file(inner)
    except OSError as err:
        raise storage_error(path, what, err) from None


def open_file(path: str, what: str = "file") -> IO[bytes]:
    """``open(path, "rb")`` for a local path or an object-storage URL (seekable, with ``readline``)."""
    if not is_url(path):
        return open(path, "rb")
    return io.BufferedReader(_Raw(open_native(path, what)), buffer_size=_BUFFER)


def source(path: str) -> Any:
    """What pyarrow's readers take for ``path``: the path itself on this machine (pyarrow opens it, and a ``.gz``
    CSV is decompressed by its name), or an opened remote file (decompressed here)."""
    if not is_url(path):
        return path
    native = open_native(path)
    if path.endswith(".gz"):
        import pyarrow as pa

        return pa.CompressedInputStream(native, "gzip")
    return native


def first_line(path: str) -> bytes:
    """The first line of file ``path`` (a CSV's header; decompressed for ``.gz``), with its line end. An
    object-storage file's is kept per process: each of its byte ranges is read with the header's names, and a request
    costs a round trip (and on some servers a read of the whole object)."""
    return _remote_first_line(path) if is_url(path) else _first_line(path)


def _first_line(path: str) -> bytes:
    with open_file(path) as raw, gzip.open(raw) if path.endswith(".gz") else raw as f:
        return bytes(f.readline())


@functools.lru_cache(maxsize=256)  # per object: the units of a listing see one version of it
def _remote_first_line(url: str) -> bytes:
    return _first_line(url)


def parquet_file(path: str) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``path``; an object-storage file's footer is read once per process (each of
    its row groups is opened on its own: without it, a request more each) and its column chunks are fetched together
    (``pre_buffer``: one request per row group instead of one per column)."""
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.ParquetFile(path)
    return pq.ParquetFile(source(path), metadata=_footer(path), pre_buffer=True)


@functools.lru_cache(maxsize=256)  # per object, as _remote_first_line
def _footer(url: str) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(source(url)).metadata


def size(path: str) -> int:
    """The size of ``path`` in bytes, local or remote."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, inner = _resolve(path, "file")
    try:
        info = fs.get_file_info(inner)
    except OSError as err:
        raise storage_error(path, "file", err) from None
    if info.size is None:
        raise FileNotFoundError(f"TabularDataModule: {path!r} does not exist.")
    return int(info.size)
