"""Serve an artifact written by ``lightning-rec export CKPT OUT --format inference`` (TorchScript) or ``--format pt2``
(a ``.pt2`` package: torch.export + AOTInductor), with torch and FBGEMM only (no lightning_rec, no torchrec): load it,
read what it expects, predict.

    python examples/serve.py model_int8.pt inputs.pt predictions.pt
    python examples/serve.py model_int8.pt2 inputs.pt predictions.pt

``inputs.pt``: a list of argument tuples, one per batch (``torch.save``), e.g. from
``lightning_rec.serving.serving_inputs``; ``predictions.pt``: the outputs, concatenated.
"""

import json
import sys

import fbgemm_gpu  # noqa: F401  (registers the operators and classes of FBGEMM's inference kernels)
import torch
from torch.export.pt2_archive import PT2ArchiveReader


def load(artifact: str):
    """The callable model and its spec (features, tables, ...)."""
    if not artifact.endswith(".pt2"):
        extra = {"lightning_rec.json": ""}
        model = torch.jit.load(artifact, map_location="cpu", _extra_files=extra)
        return model, json.loads(extra["lightning_rec.json"])
    spec = json.loads(PT2ArchiveReader(artifact).read_string("extra/lightning_rec.json"))
    written = spec["versions"]["torch"]
    if written != torch.__version__:  # its compiled code calls into the torch that compiled it
        sys.exit(f"{artifact} was compiled under torch {written}, this is torch {torch.__version__}: export it again.")
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
