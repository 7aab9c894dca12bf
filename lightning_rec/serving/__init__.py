"""From a sharded checkpoint to a model that serves: a ``.pt2`` package (``torch.export`` + AOTInductor) or a
TorchScript artifact, with quantized tables, that loads without this package (only ``torch`` and FBGEMM's
operators), in Python or C++.

:func:`export_inference` loads the checkpoint unsharded (saved at any world size, with any plan), asks the module
for the network that serves (:meth:`~lightning_rec.RecLightningModule.inference_module`), swaps every
``EmbeddingBagCollection``/``EmbeddingCollection`` for TorchRec's quantized inference module with tables in the
chosen dtype (FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` kernels), traces it with TorchRec's ``fx``
tracer (the kernels stay leaves), compiles it with TorchScript (``format="torchscript"``) and saves it, with a JSON
description of its inputs (``extra/lightning_rec.json`` in the archive). TorchRec's own recipe (``torchrec/inference/dlrm_predict.py``).

Both formats serve (``format=``, ``lightning-rec export --format torchscript|pt2``). ``format="pt2"`` (the
default for an output ending in ``.pt2``) captures the same network with ``torch.export``, the quantized kernels'
FBGEMM ``AtomicCounter``/``TensorQueue`` registered as fake classes as TorchRec does, and compiles it ahead of time
with AOTInductor (:mod:`lightning_rec.serving.pt2`; :func:`load_pt2`, ``aoti_load_package``, C++'s
``AOTIModelPackageLoader``); it needs a C++ compiler at export and runs only under the torch and FBGEMM that wrote
it. TorchScript saves the ``KeyedJaggedTensor`` code into the archive, so loading needs neither TorchRec nor this
package, no compiler, and the archive outlives torch upgrades (``torch.jit`` is deprecated). See docs/serving.md.

The artifact takes plain tensors, one sample per row::

    forward(dense_features: Tensor[B, D] float32,  # only if the served network reads dense features
            values: Tensor[N] int64,                # every id, feature by feature (feature-major, as a KJT)
            lengths: Tensor[F * B] int64,           # ids per (feature, sample), feature-major
            weights: Optional[Tensor[N]] = None)    # float32 per-id weights, for weighted collections
        -> Tensor                                  # what the network returns (CTR models: probabilities [B])

TorchScript artifacts and :func:`load_pt2` take any integer dtype and layout (converted); a ``.pt2`` package called
directly (``aoti_load_package``, C++) takes exactly these and refuses others naming the input. Whatever a caller
passes, the artifact answers as the eager model would or raises: lengths not ``F x B`` long, negative, not adding
up to ``values`` or longer than a feature may bring (the spec's ``max_lengths``), ids outside their tables, a wrong
dense shape. The spec (``extra/lightning_rec.json``) lists the ``inputs``, the ``output`` and a ``warmup`` request
(:func:`warm_up`).

The feature order ``F`` is fixed at export and written in ``extra/lightning_rec.json`` (``"features"``). A model
trained on a :class:`~lightning_rec.data.TabularDataModule` also records there how raw ids and values become these
inputs (``"raw_inputs"``: each feature's hash, vocabulary or raw ids, each dense column's transform and fill), and
:class:`RequestEncoder` (:func:`encode_request`) applies it to a raw request, as training did.

Example::

    export_inference("checkpoints/last.ckpt", "model_int8.pt", table_dtype="int8")

    # anywhere, without lightning_rec or torchrec:
    import torch, fbgemm_gpu                        # fbgemm_gpu registers the kernels' operators
    model = torch.jit.load("model_int8.pt")
    with torch.inference_mode():
        probabilities = model(dense, values, lengths)
"""

from lightning_rec.serving.artifact import (
    SPEC_FILE,
    InferenceSpec,
    check_inputs,
    inference_spec,
    load_inference,
    serving_inputs,
    warm_up,
)
from lightning_rec.serving.export import Format, TableDtype, export_inference
from lightning_rec.serving.fresh import FreshModel, follow
from lightning_rec.serving.integrity import verify
from lightning_rec.serving.pt2 import Pt2Model, load_pt2, pt2_spec
from lightning_rec.serving.requests import RequestEncoder, encode_request

__all__ = [
    "SPEC_FILE",
    "Format",
    "FreshModel",
    "InferenceSpec",
    "Pt2Model",
    "RequestEncoder",
    "TableDtype",
    "check_inputs",
    "encode_request",
    "export_inference",
    "follow",
    "inference_spec",
    "load_inference",
    "load_pt2",
    "pt2_spec",
    "serving_inputs",
    "verify",
    "warm_up",
]
