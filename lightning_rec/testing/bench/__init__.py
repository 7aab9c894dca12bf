"""``python -m lightning_rec.testing.bench``: what recshard costs over hand-written TorchRec, and what it saves over a plain
Lightning model, measured A/B alternated in one run.

Variants (same model, data, plan, kernels and optimizer; every DataLoader pins its batches when CUDA is there):

* ``raw``: a hand-written TorchRec loop: ``DistributedModelParallel`` + ``CombinedOptimizer``, fused tables, the
  batch copied with ``non_blocking=True``;
* ``raw_pipeline``: TorchRec's ``TrainPipelineSparseDist`` driven by hand;
* ``recshard``: ``L.Trainer(strategy=RecShardStrategy(...))``;
* ``recshard_pipelined``: the same with ``RecShardStrategy(pipeline=True)``;
* ``lightning_ddp``: what a Lightning user writes without this package: ``nn.EmbeddingBag`` tables (dense
  gradients) and the same optimizer under Lightning's default strategy (DDP with several processes);
* ``lightning_sparse``: the strongest plain-Lightning peer: ``nn.EmbeddingBag(sparse=True)`` and the same torch
  optimizer (SGD and Adagrad take sparse gradients); DDP with gloo on CPU, one process only on CUDA (NCCL has no
  sparse all-reduce for DDP);
* ``recshard_unchecked`` (only with ``--variants``): ``recshard`` without any input check (``bounds_check="none"``,
  ``nonfinite="ignore"``), to price them (``checked_vs_unchecked`` in the JSON line);
* ``recshard_strict`` (only with ``--variants``): ``recshard`` with ``nonfinite="strict"`` (the loss read before its
  backward pass: one host sync per step), to price it (``strict_vs_default``);
* ``plain_sparse`` (only with ``--variants``, one process): ``lightning_sparse``'s model in a plain PyTorch loop, so
  that one run also measures Lightning's own overhead (``lightning_overhead_ms`` at ``tiny``) and recshard's beyond
  it (``recshard_overhead_beyond_lightnings_ms``).

``--optimizer sgd|adagrad`` (default sgd): ``torch.optim.SGD``/``Adagrad`` for the dense layers and the plain
tables; the fused tables get FBGEMM's exact counterpart (``EXACT_SGD``/``EXACT_ADAGRAD``, what recshard derives
from the same torch optimizer). ``--sharding`` sets every table's sharding type (row-wise ones run on CPU too).

Sizes: ``tiny`` (loop overhead), ``realistic`` (a step of tens of ms: 8 tables of 200k x 64, batch 4096),
``realistic_2proc`` (the same on 2 gloo processes), ``large`` (8 tables of 1M x 64: tables dominate memory,
the size for the comparison with plain Lightning on CPU), and two GPU sizes, Criteo-like, one process:
``criteo_onehot`` (26 tables of 1M x 128, batch 16384, one id per feature, 13 dense features) and
``criteo_multihot`` (the same with 20 ids per feature). Without a GPU the GPU sizes run with 100,000 rows per table
(saying so; the batches and the model are the same), unless ``--rows`` says how many or ``--allow-cpu`` asks for
the full 13.3 GB of tables (twice that for ``lightning_ddp``). ``--rows``, ``--steps`` and ``--warmup`` override every size; one ``--batch-sizes`` value
sets the batch size, several sweep it.

Every (variant, size, repeat) runs in fresh processes, so peak RSS is the variant's own; the order of variants
rotates between repeats. Step time: the median per step on CPU; on CUDA the mean over the timed steps between
two device synchronisations (nothing else syncs per step: losses are read after the run). After the run each
process measures its device's copy bandwidth, and the bench reports the embedding bandwidth as a fraction of it
(``emb/copy``: a model of the table kernels' bytes, ``ids x dim x 4 x 3`` per step, see
:mod:`lightning_rec.testing.bench.worker`). The run first checks that ``raw``, ``recshard`` and ``recshard_pipelined``
trained identically (per-step losses, plan, compute kernels), then prints a table and, last, one JSON line with
the ratios (medians over repeats) and ``by_size``, every label's medians per variant::

    python -m lightning_rec.testing.bench --quick                 # sizes tiny/realistic/2proc, a few minutes on 2 CPU cores
    python -m lightning_rec.testing.bench --sizes tiny,realistic,realistic_2proc,large --repeats 5
    python -m lightning_rec.testing.bench --sizes realistic --batch-sizes 512,1024,2048,4096,8192 --plot bench.png
    python -m lightning_rec.testing.bench --sizes tiny,realistic --variants raw,recshard,recshard_unchecked --repeats 5
    # on one GPU (H100: issue 14's targets)
    python -m lightning_rec.testing.bench --sizes tiny,criteo_onehot,criteo_multihot --optimizer adagrad --repeats 2 \
        --variants raw,raw_pipeline,recshard,recshard_pipelined,lightning_sparse,lightning_ddp
    python -m lightning_rec.testing.bench --sizes criteo_onehot,criteo_multihot --optimizer adagrad --sharding row_wise \
        --variants raw,raw_pipeline,recshard,recshard_pipelined --repeats 2
    # the GPU sizes shrunk, on CPU (a smoke test, not a measurement)
    python -m lightning_rec.testing.bench --sizes criteo_multihot --rows 1000 --batch-sizes 128 --steps 4 --warmup 2 --repeats 1
"""

from lightning_rec.testing.bench.runner import (
    MALLOC_SETTINGS,
    SHARDINGS,
    check_identical,
    final_record,
    main,
    measure,
    plot_batch_sweep,
    run_variant,
)
from lightning_rec.testing.bench.worker import copy_bandwidth
from lightning_rec.testing.bench.workload import (
    GPU_SIZES,
    LOOKUP_SWEEP,
    OPTIMIZERS,
    SIZES,
    VARIANTS,
    Size,
    fused_params,
)

__all__ = [
    "GPU_SIZES",
    "LOOKUP_SWEEP",
    "MALLOC_SETTINGS",
    "OPTIMIZERS",
    "SHARDINGS",
    "SIZES",
    "VARIANTS",
    "Size",
    "check_identical",
    "copy_bandwidth",
    "final_record",
    "fused_params",
    "main",
    "measure",
    "plot_batch_sweep",
    "run_variant",
]
