"""A training script started the ordinary way, ``python -m tests.helpers.launched_job``: Lightning's own launcher
starts rank 1 as a child process (re-running this module), as `Trainer(devices=2)` does for users.

    --out DIR          where the failure time and, on success, ``finished`` are written
    --fail R:STEP:HOW  make rank R fail at training step STEP (see lightning_rec.testing.FailAt)
"""

import argparse
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER, FailAt
from tests.helpers.models import RecModel, make_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail", default=None)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    callbacks = []
    if args.fail:
        rank, step, how = args.fail.split(":")
        callbacks.append(FailAt(int(rank), int(step), how, args.out))
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=callbacks,
    )
    trainer.fit(RecModel(), DataLoader(make_batches(args.steps, 32, seed=trainer.global_rank), batch_size=None))
    (Path(args.out) / f"finished.rank{trainer.global_rank}").write_text("ok")
    if trainer.global_rank == 0:
        (Path(args.out) / "finished").write_text("ok")


if __name__ == "__main__":
    main()
