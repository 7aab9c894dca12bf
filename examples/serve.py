"""Serve an artifact written by ``lightning-rec export CKPT OUT --format torchscript`` (TorchScript) or ``--format pt2``
(a ``.pt2`` package: torch.export + AOTInductor), with torch and FBGEMM only (no lightning_rec, no torchrec): check
that it is the file export wrote (each record's SHA-256) and, for a package, that this torch and CPU can run it; load
it, read what it expects, predict.

    python examples/serve.py model_int8.pt inputs.pt predictions.pt
    python examples/serve.py model_int8.pt2 inputs.pt predictions.pt

``inputs.pt``: a list of argument tuples, one per batch (``torch.save``), e.g. from
``lightning_rec.serving.serving_inputs``; ``predictions.pt``: the outputs, concatenated.
"""

import hashlib
import json
import platform
import sys
import zipfile

import fbgemm_gpu  # noqa: F401  (registers the operators and classes of FBGEMM's inference kernels)
import torch
from torch.export.pt2_archive import PT2ArchiveReader


def verify(artifact: str) -> None:
    """Exit unless every record of the artifact has the SHA-256 its manifest (``extra/lightning_rec.sha256``, one
    ``<hex>  <record>`` line per record, written at export) records, and no record was added or removed
    (``lightning_rec.serving.verify`` does the same)."""
    with zipfile.ZipFile(artifact) as archive:
        records = {i.filename.partition("/")[2]: i for i in archive.infolist()}
        records.pop(".data/serialization_id", None)  # torch's random id of each write: no content
        manifest = records.pop("extra/lightning_rec.sha256", None)
        if manifest is None:
            sys.exit(f"{artifact} carries no content hash (extra/lightning_rec.sha256): export it again.")
        expected = dict(line.split("  ", 1)[::-1] for line in archive.read(manifest).decode().splitlines())
        if set(expected) != set(records):
            sys.exit(f"{artifact} was modified after export: its records {sorted(set(expected) ^ set(records))}.")
        for name, sha in expected.items():
            digest = hashlib.sha256()
            try:
                with archive.open(records[name]) as record:
                    while chunk := record.read(1 << 20):
                        digest.update(chunk)
            except zipfile.BadZipFile as err:  # the zip's CRC-32
                sys.exit(f"{artifact} is damaged: its record {name!r}: {err}")
            if digest.hexdigest() != sha:
                sys.exit(f"{artifact} was modified after export: its record {name!r} does not match its SHA-256.")


def check_cpu(artifact: str, cpu: dict | None) -> None:
    """Exit if this CPU lacks an instruction set the package's compiled code uses (its spec's ``cpu``)."""
    if not cpu:
        return
    if cpu["machine"] != platform.machine():
        sys.exit(f"{artifact} was compiled for {cpu['machine']} CPUs; this machine is {platform.machine()}.")
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("flags", "Features"))]
    except OSError:  # not Linux: nothing to check against
        return
    flags = set(lines[0].split(":", 1)[1].split()) if lines else None
    missing = [f for f in cpu["features"] if flags is not None and f not in flags]
    if missing:
        sys.exit(f"{artifact} was compiled for {cpu['target']} CPUs, and this CPU lacks {', '.join(missing)}.")


def load(artifact: str):
    """The callable model and its spec (features, tables, ...), after checking the file is the one export wrote."""
    verify(artifact)
    if not artifact.endswith(".pt2"):
        extra = {"lightning_rec.json": ""}
        model = torch.jit.load(artifact, map_location="cpu", _extra_files=extra)
        return model, json.loads(extra["lightning_rec.json"])
    spec = json.loads(PT2ArchiveReader(artifact).read_string("extra/lightning_rec.json"))
    written = spec["versions"]["torch"]
    if written != torch.__version__:  # its compiled code calls into the torch that compiled it
        sys.exit(f"{artifact} was compiled under torch {written}, this is torch {torch.__version__}: export it again.")
    check_cpu(artifact, spec.get("cpu"))
    return torch._inductor.aoti_load_package(artifact), spec


def main(artifact: str, inputs: str, output: str) -> None:
    model, spec = load(artifact)
    batches = torch.load(inputs, weights_only=True)
    with torch.inference_mode():
        predictions = torch.cat([model(*batch) for batch in batches])
    torch.save(predictions, output)
    print(f"{spec['model']}: {len(predictions)} predictions from features {spec['features']}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
