"""Quantized comms (``RecShardStrategy(qcomms=...)``): what the embedding all-to-alls carry per training step, and how
far training drifts from full precision.

TorchRec's own test model (``TestSparseNN``: an EBC, a position-weighted EBC and a weighted EBC; inputs from
``ModelInput.generate``) trains on 2 gloo ranks, once per precision, from the same rows and batches. Every call of
TorchRec's embedding comms (``torchrec/distributed/comm_ops.py``: the pooled all-to-all and its gradient, the row-wise
reduce-scatter and its all-gather) is counted in bytes on rank 0; the KJT input distribution is never quantized and
is counted apart.

    .venv/bin/python benchmarks/qcomms.py --plan table_wise --precisions fp32,fp16,bf16,int8
    .venv/bin/python benchmarks/qcomms.py --plan row_wise --precisions fp32,fp16,bf16

Prints one row per precision and a JSON line: embedding bytes per step and their ratio to fp32, the largest loss and
prediction differences from the fp32 run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_COLLECTIVES = ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor")


@contextlib.contextmanager
def counting_comms(counts: dict[str, int]) -> Iterator[None]:
    """Sum the bytes each ``torch.distributed`` collective of ``_COLLECTIVES`` sends, by caller: ``"embeddings"`` for
    TorchRec's embedding comms (``comm_ops.py``), ``"inputs"`` for everything else (the KJT input distribution)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            caller = sys._getframe(1).f_code.co_filename
            key = "embeddings" if caller.endswith("comm_ops.py") else "inputs"
            if tensor is not None:
                counts[key] = counts.get(key, 0) + tensor.numel() * tensor.element_size()
            return originals[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def train(rank: int, world_size: int, out_dir: Path, precision: str, plan: str, steps: int, batch: int) -> dict:
    """One rank: train TestSparseNN ``steps`` steps with ``qcomms=precision``; count the comms; predict held-out rows."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    import lightning_rec
    from lightning_rec.testing import QUIET_TRAINER

    tables = [
        EmbeddingBagConfig(name=f"table_{i}", embedding_dim=16, num_embeddings=100, feature_names=[f"feature_{i}"])
        for i in range(4)
    ]
    weighted = [EmbeddingBagConfig(name="weighted", embedding_dim=8, num_embeddings=50, feature_names=["wf"])]
    torch.manual_seed(0)
    model = TestSparseNN(
        tables=tables, weighted_tables=weighted, num_float_features=16, sparse_device=torch.device("cpu")
    )
    inputs = [
        ModelInput.generate(
            batch_size=batch,
            world_size=world_size,
            num_float_features=16,
            tables=tables,
            weighted_tables=weighted,
            random_seed=100 + s,
        )[1][rank]
        for s in range(steps + 1)
    ]

    class Module(lightning_rec.RecLightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            loss, _ = self.model(b)
            self.losses.append(float(loss.detach()))
            return loss

        def predict_step(self, b: Any, i: int) -> torch.Tensor:
            return self.model(b)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adagrad(self.parameters(), lr=0.02)

    module = Module()
    trainer = L.Trainer(
        strategy=lightning_rec.RecShardStrategy(
            qcomms=precision, constraints={t.name: {"sharding_types": [plan]} for t in tables + weighted}
        ),
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        **QUIET_TRAINER,
    )
    counts: dict[str, int] = {}
    with warnings.catch_warnings(), counting_comms(counts):
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(inputs[:steps], batch_size=None))
    preds = torch.cat(trainer.predict(module, DataLoader(inputs[steps:], batch_size=None))).tolist()
    return {
        "losses": module.losses,
        "preds": preds,
        "embedding_bytes_per_step": counts.get("embeddings", 0) / steps,
        "input_bytes_per_step": counts.get("inputs", 0) / steps,
    }


def measure(precisions: list[str], plan: str, steps: int, batch: int) -> dict[str, Any]:
    """Every precision on 2 ranks; rank 0's numbers, differences against the first precision's run."""
    from lightning_rec.testing.launch import run_ranks

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in precisions:
            runs[p] = run_ranks(
                "benchmarks.qcomms:train",
                2,
                Path(tmp) / p,
                pythonpath=[str(REPO)],
                precision=p,
                plan=plan,
                steps=steps,
                batch=batch,
            )
    base = runs[precisions[0]]
    out: dict[str, Any] = {"plan": plan, "steps": steps, "batch_per_rank": batch, "baseline": precisions[0]}
    for p, ranks in runs.items():
        losses = [sum(r["losses"][i] for r in ranks) / 2 for i in range(steps)]
        base_losses = [sum(r["losses"][i] for r in base) / 2 for i in range(steps)]
        preds = [x for r in ranks for x in r["preds"]]
        base_preds = [x for r in base for x in r["preds"]]
        out[p] = {
            "embedding_bytes_per_step": ranks[0]["embedding_bytes_per_step"],
            "bytes_vs_baseline": ranks[0]["embedding_bytes_per_step"] / base[0]["embedding_bytes_per_step"],
            "input_bytes_per_step": ranks[0]["input_bytes_per_step"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, base_losses)),
            "max_pred_diff": max(abs(a - b) for a, b in zip(preds, base_preds)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="table_wise", help="every table's sharding type")
    parser.add_argument("--precisions", default="fp32,fp16,bf16,int8", help="the first is the baseline")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank")
    args = parser.parse_args()
    result = measure(args.precisions.split(","), args.plan, args.steps, args.batch)
    for p in args.precisions.split(","):
        r = result[p]
        print(
            f"{p:>5}: embedding comms {r['embedding_bytes_per_step']:>9.0f} B/step ({r['bytes_vs_baseline']:.3f}x), "
            f"inputs {r['input_bytes_per_step']:.0f} B/step, max |dloss| {r['max_loss_diff']:.2e}, "
            f"max |dpred| {r['max_pred_diff']:.2e}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
