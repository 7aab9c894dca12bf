"""Serve an artifact written by ``lightning-rec export CKPT OUT --format inference``, with torch and FBGEMM only
(no lightning_rec, no torchrec): load it, read what it expects, predict.

    python examples/serve.py model_int8.pt inputs.pt predictions.pt

``inputs.pt``: a list of argument tuples, one per batch (``torch.save``), e.g. from
``lightning_rec.serving.serving_inputs``; ``predictions.pt``: the outputs, concatenated.
"""

import json
import sys

import fbgemm_gpu  # noqa: F401  (registers the operators and classes of FBGEMM's inference kernels)
import torch


def main(artifact: str, inputs: str, output: str) -> None:
    extra = {"lightning_rec.json": ""}
    model = torch.jit.load(artifact, map_location="cpu", _extra_files=extra)
    spec = json.loads(extra["lightning_rec.json"])
    batches = torch.load(inputs, weights_only=True)
    with torch.inference_mode():
        predictions = torch.cat([model(*batch) for batch in batches])
    torch.save(predictions, output)
    print(f"{spec['model']}: {len(predictions)} predictions from features {spec['features']}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
