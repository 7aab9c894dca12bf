"""One run of one variant, in a fresh worker process started by :func:`lightning_rec.bench.runner.run_variant`."""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from typing import Any, Dict, List, Tuple

from lightning_rec.bench.workload import Size, _BenchModel, _batches, _constraints, _pattern_init, _plan_rows

_RESULT = "BENCH_RESULT "


def _stamp() -> Tuple[float, int]:
    """(time, minor page faults so far) after a step: faults per step show memory the allocator hands back to the OS
    and touches again every step, a cost that ms/step alone does not explain."""
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _run_raw(size: Size, lr: float, device, pipelined: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = _BenchModel.build(size)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})
    constraints = {t: ParameterConstraints(**c) for t, c in _constraints(size).items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=size.world_size, compute_device=device.type, local_world_size=size.world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    _pattern_init(dmp.module)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=lr))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    loader = torch.utils.data.DataLoader(_batches(size, dist.get_rank(), size.warmup + size.steps), batch_size=None)
    stamps: List[Tuple[float, int]] = []
    losses: List[float] = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        it = iter(loader)
        for _ in range(size.warmup + size.steps):
            loss, _ = pipeline.progress(it)  # runs forward, backward and the optimizer step
            losses.append(float(loss))
            stamps.append(_stamp())
    else:
        for batch in loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            stamps.append(_stamp())
    return {"stamps": stamps, "losses": losses, "plan": _plan_rows(dmp.plan)}


def _lightning_module(size: Size, lr: float, plain_tables: bool):
    import lightning as L
    import torch

    import lightning_rec

    base = lightning_rec.RecLightningModule if not plain_tables else L.LightningModule

    class Module(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model = _BenchModel.build(size, plain_tables)
            self.losses: List[float] = []

        def forward(self, batch):
            return self.model(batch)

        def training_step(self, batch, batch_idx):
            loss, _ = self(batch)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Module()


def _run_lightning(
    size: Size, lr: float, device, plain_tables: bool, pipeline: bool = False, checks: bool = True
) -> Dict[str, Any]:
    import lightning as L
    import torch

    from lightning_rec import RecShardStrategy

    stamps: List[Tuple[float, int]] = []

    class Clock(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            if not plain_tables:
                _pattern_init(pl_module.model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stamps.append(_stamp())

    module = _lightning_module(size, lr, plain_tables)
    if plain_tables:
        _pattern_init(module.model)
        strategy: Any = "ddp" if size.world_size > 1 else "auto"
    else:
        unchecked = {} if checks else {"bounds_check": "none", "nonfinite": "ignore"}
        strategy = RecShardStrategy(constraints=_constraints(size), plan_report=False, pipeline=pipeline, **unchecked)
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu", devices=size.world_size, strategy=strategy,
        max_steps=size.warmup + size.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[Clock()],
    )
    loader = torch.utils.data.DataLoader(_batches(size, int(os.environ["RANK"]), size.warmup + size.steps), batch_size=None)
    trainer.fit(module, loader)
    plan = None if plain_tables else _plan_rows(trainer.strategy.sharding_plan)
    return {"stamps": stamps, "losses": module.losses, "plan": plan}


def _worker(variant: str, size: Size, lr: float) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if torch.cuda.is_available() else torch.device("cpu")
    if variant in ("raw", "raw_pipeline"):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        out = _run_raw(size, lr, device, pipelined=variant == "raw_pipeline")
    else:
        out = _run_lightning(
            size, lr, device, plain_tables=variant == "lightning_ddp", pipeline=variant == "recshard_pipelined",
            checks=variant != "recshard_unchecked",
        )
    timed = out["stamps"][size.warmup - 1:]
    steps = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    faults = (timed[-1][1] - timed[0][1]) / max(1, len(timed) - 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "variant": variant, "size": size.name, "rank": int(os.environ["RANK"]), "ms_per_step": 1000 * statistics.median(steps),
        "page_faults_per_step": faults,
        "peak_rss_bytes": rss, "losses": out["losses"], "plan": out["plan"], "device": device.type,
    }
    print(_RESULT + json.dumps(record), flush=True)
    if dist.is_initialized():
        dist.barrier()
        # The raw loop and Lightning's ddp do not tear gloo down; without this the process can abort at exit
        # (see lightning_rec.faults.close_process_group_at_exit).
        dist.destroy_process_group()

