"""What every benchmark variant trains: sizes, the model, the batches, the starting weights, the plan constraints."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "BenchModel",
    "EXTRA_VARIANTS",
    "GPU_SIZES",
    "LOOKUP_SWEEP",
    "OPTIMIZERS",
    "SIZES",
    "Size",
    "VARIANTS",
    "fused_params",
    "init_weights",
    "make_batches",
    "table_constraints",
    "torch_optimizer",
]

VARIANTS = ("raw", "raw_pipeline", "recshard", "recshard_pipelined", "lightning_ddp", "lightning_sparse")
# Measured only when asked for (``--variants``): recshard without any input check (bounds_check="none",
# nonfinite="ignore"), to price them; recshard reading the loss before its backward pass (nonfinite="strict");
# lightning_sparse's model in a plain PyTorch loop (one process), for Lightning's own overhead.
EXTRA_VARIANTS = ("recshard_unchecked", "recshard_strict", "plain_sparse")


@dataclass
class Size:
    """One benchmark size.

    Args:
        name: label in the report.
        tables: number of tables (one feature each).
        rows: rows per table.
        dim: embedding dimension.
        batch_size: samples per step and process.
        pooling: ids per sample and feature.
        world_size: processes (gloo on CPU, nccl on CUDA).
        steps: timed steps; ``warmup`` untimed steps run first.
        sharding: the sharding type of every table.
        dense: dense features per sample (4; 13 at the Criteo-like sizes, as in Criteo).
        distinct_batches: how many different batches are built and cycled through (0: one per step). The GPU
            sizes cycle a few, so that the host does not hold ``warmup + steps`` batches of 68 MB.
        optimizer: ``"sgd"`` or ``"adagrad"``: torch's for the dense layers (and the plain-Lightning tables),
            FBGEMM's exact equivalent for the fused tables (see :func:`fused_params`).
        gpu: sized for a GPU: the bench refuses it on a machine without CUDA unless shrunk (``--rows``) or
            forced (``--allow-cpu``).
    """

    name: str
    tables: int
    rows: int
    dim: int
    batch_size: int
    pooling: int = 4
    world_size: int = 1
    steps: int = 20
    warmup: int = 5
    sharding: str = "table_wise"
    dense: int = 4
    distinct_batches: int = 0
    optimizer: str = "sgd"
    gpu: bool = False

    def table_bytes(self) -> int:
        """Bytes of all tables in fp32 (optimizer state and gradients not counted)."""
        return self.tables * self.rows * self.dim * 4

    def ids_per_step(self) -> int:
        """Ids looked up per step and process: tables x batch x pooling (every sample has ``pooling`` ids per
        feature). With several processes this is also the average per rank of the ids its tables serve."""
        return self.tables * self.batch_size * self.pooling


# GPU-sized, Criteo-like (26 sparse features, 13 dense; 13.3 GB of fp32 tables), one process: one-hot and
# multi-hot (20 ids per feature: 8.5M ids, 68 MB of int64 per batch; 4 distinct batches, cycled).
_CRITEO = Size(
    "criteo_onehot",
    tables=26,
    rows=1_000_000,
    dim=128,
    batch_size=16384,
    pooling=1,
    steps=30,
    warmup=5,
    dense=13,
    distinct_batches=4,
    gpu=True,
)
SIZES = {
    "tiny": Size("tiny", tables=4, rows=1000, dim=16, batch_size=64, pooling=2, steps=200, warmup=20),
    "realistic": Size("realistic", tables=8, rows=200_000, dim=64, batch_size=4096, steps=60),
    "realistic_2proc": Size("realistic_2proc", tables=8, rows=200_000, dim=64, batch_size=4096, world_size=2, steps=40),
    # Tables dominate memory (2 GB of fp32 rows): where plain nn.EmbeddingBag's dense gradients cost the most.
    "large": Size("large", tables=8, rows=1_000_000, dim=64, batch_size=4096, steps=8, warmup=3),
    "criteo_onehot": _CRITEO,
    "criteo_multihot": replace(_CRITEO, name="criteo_multihot", pooling=20),
}
GPU_SIZES = tuple(name for name, size in SIZES.items() if size.gpu)
# Tiny to large, one process: where recshard's CPU lookup takes FBGEMM's path and where its split
# (benchmarks/cpu_lookup_sweep.py; tests/strategy/test_cpu_lookup.py asserts the path the default picks for each).
# "issue_tiny" is issue 38's model (3 tables x 100 rows x 16, batch 64, one id per feature).
LOOKUP_SWEEP = (
    Size("issue_tiny", tables=3, rows=100, dim=16, batch_size=64, pooling=1, steps=100, warmup=10),
    Size("tiny", tables=4, rows=1000, dim=16, batch_size=64, pooling=2, steps=100, warmup=10),
    Size("small", tables=8, rows=10_000, dim=16, batch_size=256, pooling=4, steps=60, warmup=5),
    Size("medium", tables=8, rows=50_000, dim=32, batch_size=1024, pooling=4, steps=30, warmup=3),
    Size("medium_wide", tables=8, rows=100_000, dim=64, batch_size=1024, pooling=4, steps=20, warmup=3),
    Size("realistic", tables=8, rows=200_000, dim=64, batch_size=4096, pooling=4, steps=12, warmup=2),
    Size("large", tables=8, rows=1_000_000, dim=64, batch_size=4096, pooling=4, steps=6, warmup=2),
)
OPTIMIZERS = ("sgd", "adagrad")
# torch.optim.Adagrad's default eps: FBGEMM's EXACT_ADAGRAD gets the same, as recshard derives it from the
# torch optimizer's param group (lightning_rec._strategy.optim.embedding_optimizer_from_torch).
_ADAGRAD_EPS = 1e-10


def fused_params(optimizer: str, lr: float) -> dict[str, Any]:
    """The hand-written TorchRec loops' ``fused_params``: FBGEMM's exact counterpart of ``torch.optim.SGD(lr=lr)``
    or ``torch.optim.Adagrad(lr=lr)`` (default eps, no weight decay, no lr decay), the update recshard derives
    from the same torch optimizer, so that ``raw`` and ``recshard`` train identically.

    Example::

        >>> fused_params("adagrad", 0.01)["eps"]
        1e-10
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if optimizer == "sgd":
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    if optimizer == "adagrad":
        return {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr, "eps": _ADAGRAD_EPS}
    raise ValueError(f"bench: unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}")


def torch_optimizer(optimizer: str, params, lr: float):
    """``torch.optim.SGD`` or ``torch.optim.Adagrad`` with torch's defaults (both accept sparse gradients)."""
    import torch

    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=_ADAGRAD_EPS)
    raise ValueError(f"bench: unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}")


def _model_parts(size: Size, plain_tables: bool, sparse: bool = False):
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    features = [f"f{i}" for i in range(size.tables)]
    if plain_tables:
        tables = nn.ModuleDict(
            {
                f: nn.EmbeddingBag(size.rows, size.dim, mode="sum", include_last_offset=True, sparse=sparse)
                for f in features
            }
        )
    else:
        tables = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{f}", embedding_dim=size.dim, num_embeddings=size.rows, feature_names=[f])
                for f in features
            ],
            device=torch.device("meta"),
        )
    mlp = nn.Sequential(
        nn.Linear(size.tables * size.dim + size.dense, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    return features, tables, mlp


class BenchModel:
    """Factory of the benchmark model: forward(batch) -> (loss, (loss, logits)), the form TorchRec's pipeline expects."""

    @staticmethod
    def build(size: Size, plain_tables: bool = False, sparse: bool = False):
        import torch
        import torch.nn.functional as F
        from torch import nn

        features, tables, mlp = _model_parts(size, plain_tables, sparse)

        class BenchModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tables, self.mlp, self.features = tables, mlp, features

            def pooled(self, kjt):
                if isinstance(self.tables, nn.ModuleDict):
                    jts = kjt.to_dict()
                    return [self.tables[f](jts[f].values(), jts[f].offsets()) for f in self.features]
                out = self.tables(kjt).to_dict()
                return [out[f] for f in self.features]

            def forward(self, batch):
                logits = self.mlp(
                    torch.cat([*self.pooled(batch.sparse_features), batch.dense_features], dim=1)
                ).squeeze(1)
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
                return loss, (loss.detach(), logits.detach())  # TorchRec's pipeline returns the second part

        return BenchModel()


def make_batches(size: Size, rank: int, n: int):
    """``n`` TorchRec batches for ``rank``: random ids, dense features and labels, seeded by the rank.

    Only ``size.distinct_batches`` different batches are built (all ``n`` when it is 0) and cycled through.

    Args:
        size: the benchmark size (tables, rows, batch size, pooling, dense features).
        rank: the rank whose batches these are (seed ``1000 + rank``).
        n: how many batches.

    Returns:
        A list of ``n`` ``torchrec.datasets.utils.Batch``.
    """
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(min(n, size.distinct_batches or n)):
        count = size.tables * size.batch_size * size.pooling
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(size.tables)],
            values=torch.randint(0, size.rows, (count,), generator=g),
            lengths=torch.full((size.tables * size.batch_size,), size.pooling, dtype=torch.int32),
        )
        out.append(
            Batch(
                dense_features=torch.rand(size.batch_size, size.dense, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (size.batch_size,), generator=g).float(),
            )
        )
    return [out[i % len(out)] for i in range(n)]


def _phase_name(name: str) -> str:
    # The table's own name sets the phase ("f0.weight" -> "f0"), whichever module holds it (EBC or ModuleDict).
    key = name.replace("embedding_bags.t_", "").replace("tables.", "")
    return key.replace("tables.", "").replace(".weight", "")


def init_weights(module) -> None:
    """Same starting weights in every variant, whatever the plan: a value per (table or layer name, global index).

    :func:`lightning_rec.testing.init.deterministic_init` at amplitude 0.05, filled 8192 rows at a time on the
    table's own device: the float64 temporaries stay a few MB and do not set the peak RSS of the run, and a GPU
    fills 13 GB of Criteo-like tables in seconds.

    Args:
        module: a model from :meth:`BenchModel.build`, unsharded or inside ``DistributedModelParallel``.
    """
    from lightning_rec.testing.init import deterministic_init

    deterministic_init(module, scale=0.05, phase_name=_phase_name, block_rows=8192)


def table_constraints(size: Size) -> dict[str, dict[str, Any]]:
    """The planner constraints of every table: ``size.sharding`` on the fused kernel.

    Returns:
        ``{table name: ParameterConstraints keyword arguments}``.
    """
    return {f"t_f{i}": {"sharding_types": [size.sharding], "compute_kernels": ["fused"]} for i in range(size.tables)}


def _plan_rows(plan) -> dict[str, Any]:
    from lightning_rec._planner.table import plan_rows

    return {r.table: [r.sharding_type, r.compute_kernel, r.ranks] for r in plan_rows(plan)}
