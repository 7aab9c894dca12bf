"""``python -m lightning_rec.bench``: what recshard costs over hand-written TorchRec, and what it saves over a plain
Lightning model, measured A/B alternated in one run.

Variants (same model, data, plan, kernels and optimizer):

* ``raw``: a hand-written TorchRec loop: ``DistributedModelParallel`` + ``CombinedOptimizer``, fused tables;
* ``raw_pipeline``: TorchRec's ``TrainPipelineSparseDist`` driven by hand;
* ``recshard``: ``L.Trainer(strategy=RecShardStrategy(...))``;
* ``recshard_pipelined``: the same with ``RecShardStrategy(pipeline=True)``;
* ``lightning_ddp``: what a Lightning user writes without this package: ``nn.EmbeddingBag`` tables and the same
  optimizer under Lightning's default strategy (DDP with several processes);
* ``recshard_unchecked`` (only with ``--variants``): ``recshard`` without any input check (``bounds_check="none"``,
  ``nonfinite="ignore"``), to price them (``checked_vs_unchecked`` in the JSON line).

Sizes: ``tiny`` (loop overhead), ``realistic`` (a step of tens of ms: 8 tables of 200k x 64, batch 4096),
``realistic_2proc`` (the same on 2 gloo processes) and ``large`` (8 tables of 1M x 64: tables dominate memory,
the size for the comparison with plain Lightning). Every (variant, size, repeat) runs in fresh processes, so
peak RSS is the variant's own; the order of variants rotates between repeats. The run first checks that
``raw``, ``recshard`` and ``recshard_pipelined`` trained identically (per-step losses, plan, compute kernels),
then prints a table and, last, one JSON line with the ratios (medians over repeats)::

    python -m lightning_rec.bench --quick                 # < 5 minutes on 2 CPU cores, sizes tiny/realistic/2proc
    python -m lightning_rec.bench --sizes tiny,realistic,realistic_2proc,large --repeats 5
    python -m lightning_rec.bench --sizes realistic --batch-sizes 512,1024,2048,4096,8192 --plot bench.png
    python -m lightning_rec.bench --sizes tiny,realistic --variants raw,recshard,recshard_unchecked --repeats 5
"""

from lightning_rec.bench.runner import MALLOC_SETTINGS, check_identical, final_record, main, measure, plot_batch_sweep, run_variant
from lightning_rec.bench.workload import SIZES, VARIANTS, Size

__all__ = ["MALLOC_SETTINGS", "SIZES", "VARIANTS", "Size", "check_identical", "final_record", "main", "measure",
           "plot_batch_sweep", "run_variant"]
