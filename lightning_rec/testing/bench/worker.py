"""One run of one variant, in a fresh worker process started by :func:`lightning_rec.testing.bench.runner.run_variant`.

Embedding bandwidth (``emb_gb_s``, ``emb_bw_frac`` in the record): a model of the bytes the table kernels must
move, not a measurement of them. Per step and process it counts ``ids x dim x 4 bytes x 3``: the forward reads
every looked-up row once, the fused backward reads it and writes it back once (``ids`` = tables x batch x
pooling, see :meth:`Size.ids_per_step`). It ignores optimizer state (Adagrad's accumulator doubles the
backward's traffic), deduplication of repeated ids (fewer rows moved), the pooled outputs and the gradients of
the pooled outputs, and it is the same count for every variant: a variant that moves more (``lightning_ddp``
writes a dense gradient of every table every step) shows up as a lower fraction, not as more bytes.
``emb_gb_s`` is that count over the step time; ``copy_gb_s`` is the device's copy bandwidth, measured in the same
process after the run (``torch.Tensor.copy_`` of a large buffer, bytes read + written per second, the best of
5; host memory on CPU); ``emb_bw_frac`` = ``emb_gb_s / copy_gb_s``. On CPU at small sizes the rows stay in the
caches, so the fraction can exceed 1.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import replace
from typing import Any, cast

from lightning_rec.testing.bench.workload import (
    BenchModel,
    Size,
    _plan_rows,
    fused_params,
    init_weights,
    make_batches,
    table_constraints,
    torch_optimizer,
)
from lightning_rec.testing.trainer import QUIET_TRAINER

__all__ = ["RESULT_PREFIX", "copy_bandwidth", "lightning_module", "raw_torchrec", "run_worker"]

RESULT_PREFIX = "BENCH_RESULT "
# Passes over every looked-up row per step in the bandwidth model above: forward read, backward read + write.
EMB_PASSES = 3


def _stamp() -> tuple[float, int]:
    """(time, minor page faults so far) after a step: faults per step show memory the allocator hands back to the OS
    and touches again every step, a cost that ms/step alone does not explain."""
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Clock:
    """Stamps after every step. On CUDA it synchronises the device only after the last warmup step and after the
    last step (a per-step sync would serialise what the variants overlap, and hide what the strategy's
    non-blocking transfers save); per-step stamps then time kernel launches, so the step time on CUDA is the
    mean between the two synchronised stamps (see :func:`_step_ms`)."""

    def __init__(self, size: Size, device) -> None:
        self.size, self.device = size, device
        self.stamps: list[tuple[float, int]] = []

    def tick(self) -> None:
        """Stamp the end of a step (synchronising the device first where the timing needs it)."""
        if self.device.type == "cuda" and len(self.stamps) + 1 in (
            self.size.warmup,
            self.size.warmup + self.size.steps,
        ):
            import torch

            torch.cuda.synchronize(self.device)
        self.stamps.append(_stamp())


def _step_ms(stamps: list[tuple[float, int]], warmup: int, device_type: str) -> float:
    """Milliseconds per timed step: the median of the per-step times on CPU, the mean between the synchronised
    stamps on CUDA."""
    timed = stamps[warmup - 1 :]
    if device_type == "cuda":
        return 1000 * (timed[-1][0] - timed[0][0]) / (len(timed) - 1)
    return 1000 * statistics.median(b[0] - a[0] for a, b in zip(timed, timed[1:]))


def copy_bandwidth(device, repeats: int = 5) -> float:
    """The device's copy bandwidth in GB/s (1e9 bytes): ``dst.copy_(src)`` of a buffer far larger than any cache
    (256 MiB on CPU; up to 1 GiB on CUDA, at most a quarter of the free memory), bytes read + written per second,
    the best of ``repeats`` after one warm-up copy.

    Example::

        >>> import torch
        >>> copy_bandwidth(torch.device("cpu")) > 0
        True
    """
    import torch

    nbytes = 256 << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = max(16 << 20, min(1 << 30, free // 4))
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(repeats + 1):  # the first copy warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / min(seconds[1:]) / 1e9


def _loader(size: Size, rank: int, device):
    """Every variant's DataLoader: the pre-built batches, pinned by the loader's thread when CUDA is there (on
    CPU pinning has nothing to do)."""
    import torch

    return torch.utils.data.DataLoader(
        make_batches(size, rank, size.warmup + size.steps), batch_size=None, pin_memory=device.type == "cuda"
    )


def _planner_hbm(device) -> dict[str, Any]:
    """On CUDA the planner gets the device's real memory (TorchRec assumes 32 GB, which the Criteo-like tables
    with Adagrad state nearly fill); the same in ``raw`` and ``recshard``, so their plans stay comparable."""
    import torch

    return {"hbm_cap": torch.cuda.get_device_properties(device).total_memory} if device.type == "cuda" else {}


def raw_torchrec(size: Size, lr: float, device):
    """The hand-written TorchRec setup of the ``raw`` variants: the bench model in DMP (planned over the default
    process group) and a ``CombinedOptimizer`` of the fused one and the dense one. Returns ``(dmp, optimizer)``."""
    from lightning_rec._planner.sharders import EBCSharder
    from lightning_rec.testing.reference import reference_dmp, reference_optimizer

    model = BenchModel.build(size)
    # TorchRec's EBC sharder, admitting its CUDA-listed sharding types (row-wise) on CPU too, as recshard's does.
    sharder = EBCSharder(fused_params=fused_params(size.optimizer, lr))
    dmp = reference_dmp(model, [sharder], device, table_constraints(size), **_planner_hbm(device))
    init_weights(dmp.module)
    return dmp, reference_optimizer(dmp, lambda ps: torch_optimizer(size.optimizer, ps, lr))


def _run_raw(size: Size, lr: float, device, pipelined: bool) -> dict[str, Any]:
    import torch.distributed as dist

    dmp, optimizer = raw_torchrec(size, lr, device)
    loader = _loader(size, dist.get_rank(), device)
    clock = _Clock(size, device)
    losses: list[Any] = []  # detached tensors, read once at the end: float(loss) per step would sync the device
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        it = iter(loader)
        for _ in range(size.warmup + size.steps):
            loss, _ = pipeline.progress(it)  # runs forward, backward and the optimizer step
            losses.append(loss.detach())
            clock.tick()
    else:
        losses = _plain_loop(dmp, optimizer, loader, device, clock)
    return {"stamps": clock.stamps, "losses": [float(x) for x in losses], "plan": _plan_rows(dmp.plan)}


def _plain_loop(model, optimizer, loader, device, clock: _Clock) -> list[Any]:
    """The textbook loop (copy, zero_grad, forward, backward, step) over ``loader``; the detached losses."""
    losses: list[Any] = []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        clock.tick()
    return losses


def _run_plain(size: Size, lr: float, device) -> dict[str, Any]:
    """``lightning_sparse``'s model and optimizer in a plain PyTorch loop (one process): with it, the same run
    measures Lightning's own per-step overhead (``lightning_overhead_ms``), which no strategy can remove."""
    import torch

    with torch.device(device):
        model = BenchModel.build(size, plain_tables=True, sparse=True)
    init_weights(model)
    optimizer = torch_optimizer(size.optimizer, model.parameters(), lr)
    clock = _Clock(size, device)
    losses = _plain_loop(model, optimizer, _loader(size, 0, device), device, clock)
    return {"stamps": clock.stamps, "losses": [float(x) for x in losses], "plan": None}


def lightning_module(size: Size, lr: float, plain_tables: bool, sparse: bool = False):
    """The bench's LightningModule at ``size``: sharded tables, or plain ``nn.EmbeddingBag``s (``plain_tables``, with
    ``sparse`` gradients) for the plain-PyTorch baseline."""
    import lightning as L

    import lightning_rec

    base = lightning_rec.RecLightningModule if not plain_tables else L.LightningModule

    class Module(base):  # type: ignore[misc, valid-type]  # a base chosen at run time
        def __init__(self) -> None:
            super().__init__()
            self.model = BenchModel.build(size, plain_tables, sparse)
            self.losses: list[Any] = []

        def forward(self, batch):
            return self.model(batch)

        def training_step(self, batch, batch_idx):
            loss, _ = self(batch)
            self.losses.append(loss.detach())  # read at the end: float(loss) per step would sync the device
            return loss

        def configure_optimizers(self):
            # recshard derives the tables' fused optimizer from this one (lightning_rec._strategy.optim).
            return torch_optimizer(size.optimizer, self.parameters(), lr)

    return Module()


def _run_lightning(
    size: Size,
    lr: float,
    device,
    plain_tables: bool,
    pipeline: bool = False,
    checks: str = "default",
    sparse: bool = False,
) -> dict[str, Any]:
    import contextlib

    import lightning as L
    import torch

    from lightning_rec._strategy.recshard import RecShardStrategy
    from lightning_rec.config import TopologyConfig

    clock = _Clock(size, device)

    class Clock(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            if not plain_tables:
                init_weights(pl_module.model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.tick()

    # Plain tables on CUDA are built there: 13 GB of Criteo-like tables would otherwise be initialised on the
    # host and copied (the host RSS of these variants then leaves the tables out, as recshard's does).
    where = torch.device(device) if plain_tables and device.type == "cuda" else contextlib.nullcontext()
    with where:
        module = lightning_module(size, lr, plain_tables, sparse)
    if plain_tables:
        init_weights(module.model)
        strategy: Any = "ddp" if size.world_size > 1 else "auto"
    else:
        unchecked: dict[str, Any] = {
            "default": {},
            "none": {"bounds_check": "none", "nonfinite": "ignore"},
            "strict": {"nonfinite": "strict"},
        }[checks]
        topology = TopologyConfig(**_planner_hbm(device)) if device.type == "cuda" else None
        strategy = RecShardStrategy(
            constraints=table_constraints(size), report_plan=False, pipeline=pipeline, topology=topology, **unchecked
        )
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu",
        devices=size.world_size,
        strategy=strategy,
        max_steps=size.warmup + size.steps,
        callbacks=[Clock()],
        **QUIET_TRAINER,
    )
    trainer.fit(module, _loader(size, int(os.environ["RANK"]), device))
    plan = None if plain_tables else _plan_rows(cast(RecShardStrategy, trainer.strategy).sharding_plan)
    return {"stamps": clock.stamps, "losses": [float(x) for x in module.losses], "plan": plan}


def _bandwidth_in_turn(device) -> float:
    """:func:`copy_bandwidth`, one rank after the other (ranks on one host would otherwise share its memory
    bandwidth while measuring it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return copy_bandwidth(device)
    gb_s = 0.0
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            gb_s = copy_bandwidth(device)
        dist.barrier()
    return gb_s


def run_worker(variant: str, size: Size, lr: float, bandwidth: bool = True) -> None:
    """Train ``variant`` at ``size`` in this process (one rank) and print its record (``BENCH_RESULT {...}``).

    Args:
        bandwidth: measure the device's copy bandwidth after the run (``copy_gb_s``, ``emb_bw_frac``; ``None``
            without it); ``benchmarks/profile_step.py`` leaves it out of its profile.
    """
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        # recshard's CPU lookup tries both of its paths in a big lookup's first training steps (TRIAL_CALLS): the
        # warm-up holds them, in every variant alike, so that the timed steps are the ones a long fit runs.
        from lightning_rec.testing.instruments import TRIAL_CALLS

        size = replace(size, warmup=max(size.warmup, TRIAL_CALLS))
    if variant in ("raw", "raw_pipeline"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        out = _run_raw(size, lr, device, pipelined=variant == "raw_pipeline")
    elif variant == "plain_sparse":
        out = _run_plain(size, lr, device)
    else:
        out = _run_lightning(
            size,
            lr,
            device,
            plain_tables=variant in ("lightning_ddp", "lightning_sparse"),
            pipeline=variant == "recshard_pipelined",
            checks={"recshard_unchecked": "none", "recshard_strict": "strict"}.get(variant, "default"),
            sparse=variant == "lightning_sparse",
        )
    timed = out["stamps"][size.warmup - 1 :]
    ms = _step_ms(out["stamps"], size.warmup, device.type)
    faults = (timed[-1][1] - timed[0][1]) / max(1, len(timed) - 1)
    # Read before the bandwidth measurement, whose buffers are not the variant's.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    emb_bytes = size.ids_per_step() * size.dim * 4 * EMB_PASSES
    copy_gb_s = _bandwidth_in_turn(device) if bandwidth else None
    emb_gb_s = emb_bytes / (ms / 1000) / 1e9
    record = {
        "variant": variant,
        "size": size.name,
        "rank": int(os.environ["RANK"]),
        "ms_per_step": ms,
        "page_faults_per_step": faults,
        "peak_rss_bytes": rss,
        "peak_device_mem_bytes": device_mem,
        "emb_bytes_per_step": emb_bytes,
        "emb_gb_s": emb_gb_s,
        "copy_gb_s": copy_gb_s,
        "emb_bw_frac": emb_gb_s / copy_gb_s if copy_gb_s else None,
        "losses": out["losses"],
        "plan": out["plan"],
        "device": device.type,
    }
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    if dist.is_initialized():
        dist.barrier()
        # The raw loop and Lightning's ddp do not tear gloo down; without this the process can abort at exit
        # (see lightning_rec._strategy.faults.close_process_group_at_exit).
        dist.destroy_process_group()
