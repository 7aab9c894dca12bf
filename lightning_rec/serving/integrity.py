"""Verified files: every artifact (a ``.pt2`` package or a TorchScript archive, both zip archives of records) carries
the SHA-256 of each of its records, written at export as the record ``extra/lightning_rec.sha256`` in the format of
``sha256sum`` (``<hex>  <record>`` per line, records named without the archive's root folder; all but torch's random
``.data/serialization_id``). :func:`verify`
recomputes them before anything is loaded and refuses a file in which any record changed, appeared or went missing,
naming the file and the record; it reads the file once, in bounded time and memory (1 MiB at a time).

This is a check against corruption (a flipped bit on disk or in a copy, a truncated upload), not a signature: whoever
can rewrite the file can rewrite its manifest. Sign or checksum the whole file in your deployment for authenticity.

torch's own loaders (``torch._inductor.aoti_load_package``, ``torch.jit.load``, C++'s ``AOTIModelPackageLoader``)
check nothing: :func:`~lightning_rec.serving.load_pt2`, :func:`~lightning_rec.serving.load_inference`,
``examples/serve.py`` and the C++ example (``examples/serve_cpp``) call the check; a server that calls torch's
loaders directly calls :func:`verify` first.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any

from lightning_rec.errors import ServingError

__all__ = ["ARTIFACT_VERSION", "MANIFEST_RECORD", "check_version", "seal", "verify"]

ARTIFACT_VERSION = 1  # the spec's layout and the artifact's records (1: with its manifest, checkpoint and cpu)

MANIFEST_RECORD = "extra/lightning_rec.sha256"
# torch's archive writer draws a new random id for every file it writes (no content): left out, so that an artifact
# copied record by record through torch's writer (the same content) still verifies.
_UNHASHED = ".data/serialization_id"
_CHUNK = 1 << 20


def _records(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """Record name (without the archive's root folder, as torch's readers name them) -> its zip entry."""
    records = {}
    for info in archive.infolist():
        root, _, name = info.filename.partition("/")
        if name and not info.is_dir() and name != _UNHASHED:
            records[name] = info
    return records


def _digest(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    digest = hashlib.sha256()
    with archive.open(info) as record:
        while chunk := record.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def seal(path: Path) -> str:
    """Append the manifest (every record's SHA-256) to the archive at ``path``, written by torch's archive writer;
    returns the artifact's content hash (the manifest's SHA-256)."""
    with zipfile.ZipFile(path) as archive:
        records = _records(archive)
        if MANIFEST_RECORD in records:
            raise ServingError(f"{str(path)!r} already carries {MANIFEST_RECORD}")
        root = next(iter(records.values())).filename.partition("/")[0]
        manifest = "".join(f"{_digest(archive, info)}  {name}\n" for name, info in records.items())
    # Stored, not compressed, as torch writes every record; zipfile appends after the last record and rewrites the
    # central directory, which torch's readers (miniz) read.
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{root}/{MANIFEST_RECORD}", manifest)
    return hashlib.sha256(manifest.encode()).hexdigest()


def verify(path: str | Path) -> str:
    """Check that the artifact at ``path`` is the file export wrote: every record's SHA-256 equals the one its
    manifest (``extra/lightning_rec.sha256``) records, and no record was added or removed. Returns the artifact's
    content hash (the manifest's SHA-256: one export, whatever its file is called), e.g. to log which model serves.

    Call it before torch's own loaders, which check nothing (:func:`~lightning_rec.serving.load_pt2` and
    :func:`~lightning_rec.serving.load_inference` call it themselves).

    Raises:
        ServingError: naming the file and the record that differs (or the archive's own damage), or an artifact
            without a manifest (written before lightning_rec recorded one, or by another tool).

    Example::

        from lightning_rec.serving import verify
        verify("model_int8.pt2")                                  # raises unless the file is as exported
        model = torch._inductor.aoti_load_package("model_int8.pt2")
    """
    name = str(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as err:
        raise ServingError(f"{name!r} is not a serving artifact (a zip archive): {type(err).__name__}: {err}") from None
    with archive:
        records = _records(archive)
        if MANIFEST_RECORD not in records:
            raise ServingError(
                f"{name!r} carries no content hash ({MANIFEST_RECORD}): it was written before lightning_rec recorded "
                "one, or by another tool, so nothing shows it is the file export wrote. HINT: export it again."
            )
        try:
            manifest = archive.read(records.pop(MANIFEST_RECORD))
            expected = _parse(manifest.decode())
        except (ValueError, UnicodeDecodeError, zipfile.BadZipFile, OSError) as err:
            raise ServingError(f"{name!r}: its manifest {MANIFEST_RECORD} is damaged ({err}).") from None
        for record in records:
            if record not in expected:
                raise ServingError(
                    f"{name!r} was modified after export: it holds a record {record!r} its manifest does not list. "
                    "HINT: copy the file again from where export wrote it, or export again."
                )
        for record, sha in expected.items():
            if record not in records:
                raise ServingError(f"{name!r} was modified after export: its record {record!r} is missing.")
            try:
                found = _digest(archive, records[record])
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:  # zipfile's CRC and size checks
                raise ServingError(
                    f"{name!r} is damaged: its record {record!r} cannot be read ({type(err).__name__}: {err}). HINT: "
                    "copy the file again from where export wrote it, or export again."
                ) from None
            if found != sha:
                raise ServingError(
                    f"{name!r} was modified after export: its record {record!r} has SHA-256 {found[:16]}..., its "
                    f"manifest records {sha[:16]}...; refusing to serve it. HINT: copy the file again from where "
                    "export wrote it, or export again."
                )
    return hashlib.sha256(manifest).hexdigest()


def check_version(spec: dict[str, Any], path: str | Path) -> None:
    """Refuse (``ServingError``) an artifact whose spec (``spec``, as read from its JSON) has a layout newer than this
    lightning_rec reads (``artifact_version`` above ``ARTIFACT_VERSION``): its records may mean other things."""
    version = spec.get("artifact_version", 0)
    if not isinstance(version, int) or version > ARTIFACT_VERSION:
        raise ServingError(
            f"{str(path)!r} is an artifact of version {version!r}, written by a newer lightning_rec; this one reads "
            f"versions up to {ARTIFACT_VERSION}. HINT: upgrade lightning_rec where it is loaded, or export it with "
            "this one."
        )


def _parse(text: str) -> dict[str, str]:
    """``sha256sum`` lines -> record -> hex digest."""
    expected = {}
    for number, line in enumerate(text.splitlines(), 1):
        sha, sep, record = line.partition("  ")
        if not sep or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha) or not record:
            raise ValueError(f"line {number} is not '<sha256 hex>  <record>'")
        expected[record] = sha
    return expected
