"""What publishing while training costs (issue 47; docs/fresh-models.md "The publisher", BENCHMARKS.md): the training
pause per publish against a step's time, a delta's bytes against the full export's, and publish-to-served.

    .venv/bin/python benchmarks/publish.py --rows 1000000 --dim 64          # ~6 min: the delta after 1% of an epoch
    .venv/bin/python benchmarks/publish.py --movielens                      # ~3 min: MovieLens-100K's DLRM-DCNv2
    .venv/bin/python benchmarks/publish.py --rows 10000000 --dim 64 --every 10 --batch-size 1024   # ~15 min, ~10 GB

One process trains a DLRM (``--rows`` x ``--dim`` power-law table and a 1,000-row one, synthetic data, batches of
``--batch-size``; or ``--movielens``: the zoo's DLRM-DCNv2 on MovieLens-100K's ratings) under recshard with a
:class:`~lightning_rec.publish.ModelPublisher` (int8 tables, version 1 full, every later one a delta) publishing every
``--every`` steps (default: 1% of an epoch, ``--epoch`` samples, by default 10 x ``--rows``; MovieLens: its 80,000
training ratings). Measured in the same run:

- **pause**: the time the training loop spends in the publisher at a publish (touched ids all-reduced, rows read and
  quantized, the part written, the manifest, the rename, the pointer; version 1 adds the synchronous sharded
  checkpoint the full is exported from), against the median step without a publish;
- **delta bytes**: each delta's files against the full ``.pt2``'s bytes (the package: compiled code and tables);
- **publish-to-served**: once the first full is out, a second process follows the directory with
  :class:`~lightning_rec.serving.FreshModel` (checking ``LATEST`` every millisecond); the time from a publish's start
  in the trainer to the moment the follower serves that version (both clocks are the same machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def follow(root: str, out: str, until: int) -> None:
    """The follower: serve ``root`` with FreshModel, record when each version became served, up to ``until``."""
    from lightning_rec.serving import FreshModel

    model = FreshModel(root)
    served = {model.version: time.time()}
    Path(out + ".ready").write_text(str(model.version))
    while model.version < until:
        version = model.refresh()
        if version not in served:
            served[version] = time.time()
        time.sleep(0.001)
    Path(out).write_text(json.dumps(served))


def _module_and_data(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """The LightningModule, its DataModule and the epoch's samples."""
    from lightning_rec import EmbeddingOptimizer
    from lightning_rec.models import DLRMModule

    if args.movielens:
        from lightning_rec.data import MovieLensDataModule

        dm = MovieLensDataModule(batch_size=args.batch_size)
        dm.prepare_data()
        dm.setup("fit")
        module = DLRMModule(
            dm.sparse_features,
            dm.num_dense_features,
            embedding_dim=16,
            dense_arch_layer_sizes=[32, 16],
            over_arch_layer_sizes=[32, 1],
            interaction="dcn",
        )
        return module, dm, len(dm.train_dataloader().dataset)
    from lightning_rec.data import SyntheticDataModule, SyntheticTable

    epoch = args.epoch or 10 * args.rows
    dm = SyntheticDataModule(
        [SyntheticTable("big", args.rows, distribution="power_law"), SyntheticTable("small", 1000)],
        num_dense_features=4,
        train_rows=args.batch_size * min(args.max_steps, 500),  # epochs repeat: max_epochs=-1
        val_rows=args.batch_size,
        batch_size=args.batch_size,
    )
    module = DLRMModule(
        dm.sparse_features,
        dm.num_dense_features,
        embedding_dim=args.dim,
        dense_arch_layer_sizes=[64, args.dim],
        over_arch_layer_sizes=[64, 1],
        embedding_optimizer=EmbeddingOptimizer("rowwise_adagrad", lr=0.02),
    )
    return module, dm, epoch


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import lightning as L

    from lightning_rec import RecShardStrategy
    from lightning_rec.publish import ModelPublisher
    from lightning_rec.serving.deltas import read_latest, read_manifest

    module, dm, epoch = _module_and_data(args)
    every = args.every or max(1, round(0.01 * epoch / args.batch_size))
    root = work / "pub"
    marks: dict[str, Any] = {"starts": {}, "pauses": {}, "steps": []}
    follower: dict[str, Any] = {}

    class Timed(ModelPublisher):
        def publish(self, trainer: Any, pl_module: Any) -> int:
            start = time.time()
            version = super().publish(trainer, pl_module)
            marks["starts"][version], marks["pauses"][version] = start, time.time() - start
            return version

    class Clock(L.Callback):
        """Step times (before the publisher's hook), the follower started once the first full is out, the stop."""

        def on_train_batch_start(self, *a: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if trainer.global_step % every:
                marks["steps"].append(time.perf_counter() - self.t0)
            if "process" not in follower and read_latest(root):
                out = str(work / "served.json")
                follower["out"], follower["target"] = out, publisher.version + args.publishes
                # this file's follow() in a process of its own (run as a file: the repository is not put on the path)
                code = (
                    "import runpy, sys; "
                    "runpy.run_path(sys.argv[4], run_name='follower')['follow'](sys.argv[1], sys.argv[2], int(sys.argv[3]))"
                )
                follower["process"] = subprocess.Popen(
                    [sys.executable, "-c", code, str(root), out, str(follower["target"]), str(Path(__file__).resolve())]
                )
                # Training waits for the follower's first load (its full package), so that the next versions are
                # timed against a server already following; no version is published meanwhile.
                while not Path(out + ".ready").exists():
                    if follower["process"].poll() is not None:
                        raise SystemExit("the follower failed to start")
                    time.sleep(0.05)
                follower["ready"] = int(Path(out + ".ready").read_text())
            if "ready" in follower and publisher.version >= follower["target"]:
                trainer.should_stop = True

    publisher = Timed(root, every_n_steps=every, full_every=10**6, keep=10**6, table_dtype="int8")
    trainer = L.Trainer(
        strategy=RecShardStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        max_epochs=-1,
        limit_val_batches=0,
        default_root_dir=work,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock(), publisher],
    )
    trainer.fit(module, datamodule=dm)
    if "process" not in follower:
        raise SystemExit("the first full was not out before --max-steps: raise --max-steps")
    follower["process"].wait(timeout=600)
    served = {int(k): v for k, v in json.loads(Path(follower["out"]).read_text()).items()}
    timed = [v for v in served if v > follower["ready"]]
    full = read_manifest(root / "full" / "v000001.json")
    full_bytes = sum(f["bytes"] for f in full.files.values())
    deltas = {
        v: sum(f["bytes"] for f in read_manifest(root / "versions" / f"v{v:06d}" / "manifest.json").files.values())
        for v in marks["pauses"]
        if v > 1
    }
    step = statistics.median(marks["steps"])
    delta_pauses = [p for v, p in marks["pauses"].items() if v > 1]
    return {
        "table": "MovieLens-100K DLRM-DCNv2" if args.movielens else f"{args.rows} x {args.dim} (power law) + 1000",
        "batch_size": args.batch_size,
        "every_n_steps": every,
        "epoch_samples": epoch,
        "epoch_fraction_per_delta": every * args.batch_size / epoch,
        "step_ms": 1000 * step,
        "delta_pause_ms": 1000 * statistics.median(delta_pauses),
        "delta_pause_over_step": statistics.median(delta_pauses) / step,
        "full_pause_ms": 1000 * marks["pauses"][1],
        "full_pause_over_step": marks["pauses"][1] / step,
        "full_bytes": full_bytes,
        "delta_bytes_median": statistics.median(deltas.values()),
        "delta_over_full": statistics.median(deltas.values()) / full_bytes,
        "publish_to_served_ms": {v: round(1000 * (served[v] - marks["starts"][v]), 1) for v in timed},
        "publish_to_served_ms_median": 1000 * statistics.median(served[v] - marks["starts"][v] for v in timed),
        "publish_to_served_ms_max": 1000 * max(served[v] - marks["starts"][v] for v in timed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the big table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--movielens", action="store_true", help="MovieLens-100K's DLRM-DCNv2 instead")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 4096 (MovieLens: 256)")
    parser.add_argument("--epoch", type=int, default=None, help="samples in an epoch (default: 10 x --rows)")
    parser.add_argument("--every", type=int, default=None, help="steps between versions (default: 1%% of an epoch)")
    parser.add_argument("--publishes", type=int, default=5, help="deltas timed once the follower serves")
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--work", default=None, help="working folder (default: a temporary one, removed)")
    args = parser.parse_args()
    args.batch_size = args.batch_size or (256 if args.movielens else 4096)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=1))


if __name__ == "__main__":
    main()
