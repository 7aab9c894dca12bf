"""How often a finished 2-process job aborts at exit (``terminate called without an active exception``), with and
without lightning_rec's clean exit (``lightning_rec.testing.close_process_group_at_exit``, what the strategy registers).

Modes, each run ``--runs`` times as two fresh processes:

* ``gloo``: two ranks start gloo, run 50 all-reduces and return (torch alone);
* ``gloo_destroy``: the same, then ``destroy_process_group()`` while another object still references the group
  (as DDP and TorchRec's modules do): the group's threads keep running;
* ``gloo_clean``: the same as ``gloo`` with ``close_process_group_at_exit()`` registered;
* ``recshard``: a 4-step recshard fit of a 3-table model, ``Trainer(devices=2)`` started plainly (Lightning's
  launcher starts rank 1), then 30 reductions, then a normal return.

    .venv/bin/python benchmarks/clean_exit.py --modes gloo,gloo_destroy,gloo_clean,recshard --runs 20

Prints aborted/runs per mode and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_rec.testing import QUIET_TRAINER
from lightning_rec.testing.ports import free_port

MODES = ("gloo", "gloo_destroy", "gloo_clean", "recshard")
_HELD: list = []


def _child(mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "recshard":
        _recshard_job()
        return
    dist.init_process_group("gloo")
    _HELD.append(dist.group.WORLD)  # a reference until exit, as DDP and TorchRec's modules hold one
    if mode == "gloo_clean":
        from lightning_rec.testing import close_process_group_at_exit

        close_process_group_at_exit()
    t = torch.ones(1000)
    for _ in range(50):
        dist.all_reduce(t)
    if mode == "gloo_destroy":
        dist.destroy_process_group()


def _recshard_job() -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import lightning_rec

    class Model(lightning_rec.RecLightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"])
                    for i in range(3)
                ],
                device=torch.device("meta"),
            )
            self.over = torch.nn.Linear(24, 1)

        def training_step(self, batch, batch_idx):
            kjt, label = batch
            return F.binary_cross_entropy_with_logits(self.over(self.ebc(kjt).values()).squeeze(1), label)

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    def batch(seed: int):
        g = torch.Generator().manual_seed(seed)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"],
            values=torch.randint(0, 50, (48,), generator=g),
            lengths=torch.ones(48, dtype=torch.int32),
        )
        return kjt, torch.randint(0, 2, (16,), generator=g).float()

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="recshard",
        accelerator="cpu",
        devices=2,
        max_steps=4,
        **QUIET_TRAINER,
    )
    trainer.fit(Model(), DataLoader([batch(trainer.global_rank * 10 + i) for i in range(4)], batch_size=None))
    for _ in range(30):
        trainer.strategy.reduce(torch.ones(1), reduce_op="sum")


def _run_once(mode: str) -> bool:
    """One 2-process run; True if any process aborted or exited non-zero."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode]
    if mode == "recshard":  # Lightning's launcher starts rank 1
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        return proc.returncode != 0 or "terminate called" in proc.stdout + proc.stderr
    port = str(free_port())
    procs = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    return any(p.returncode != 0 for p in procs) or any("terminate called" in o for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    result = {}
    for mode in args.modes.split(","):
        aborted = sum(_run_once(mode) for _ in range(args.runs))
        result[mode] = {"aborted": aborted, "runs": args.runs}
        print(f"{mode}: {aborted}/{args.runs} runs aborted at exit", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
