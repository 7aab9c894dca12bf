"""From a sharded checkpoint to a model that serves: a quantized TorchScript artifact that loads without this
package (only ``torch`` and FBGEMM's operators), in Python or C++.

:func:`export_inference` loads the checkpoint unsharded (saved at any world size, with any plan), asks the module
for the network that serves (:meth:`~lightning_rec.RecLightningModule.inference_module`), swaps every
``EmbeddingBagCollection``/``EmbeddingCollection`` for TorchRec's quantized inference module with tables in the
chosen dtype (FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` kernels), traces it with TorchRec's ``fx``
tracer (the kernels stay leaves), compiles it with TorchScript and saves it, with a JSON description of its inputs
(``extra/lightning_rec.json`` in the archive). TorchRec's own recipe (``torchrec/inference/dlrm_predict.py``).

Why TorchScript rather than ``torch.export``: the quantized kernels hold a ``torch.classes.fbgemm.AtomicCounter``
that has no fake implementation, so ``torch.export`` refuses them (torch 2.13, FBGEMM 1.8); TorchScript saves the
``KeyedJaggedTensor`` code into the archive, so loading needs neither TorchRec nor this package, and libtorch loads
it from C++.

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
from lightning_rec.serving.integrity import verify
from lightning_rec.serving.pt2 import Pt2Model, load_pt2, pt2_spec
from lightning_rec.serving.requests import RequestEncoder, encode_request

__all__ = [
    "SPEC_FILE",
    "Format",
    "InferenceSpec",
    "Pt2Model",
    "RequestEncoder",
    "TableDtype",
    "check_inputs",
    "encode_request",
    "export_inference",
    "inference_spec",
    "load_inference",
    "load_pt2",
    "pt2_spec",
    "serving_inputs",
    "verify",
    "warm_up",
]
