"""``lightning-rec``: LightningCLI for recommendation models, with the ``recshard`` strategy registered.

Subcommands are LightningCLI's (``fit``, ``validate``, ``test``, ``predict``; ``--print_config``, ``--config``)
plus ``prepare``, which fetches a dataset ahead of time (the DataModules also fetch on first use), and
``export``, which turns a sharded checkpoint into one unsharded state dict file, or (``--format inference``) into
a servable TorchScript artifact with quantized tables::

    lightning-rec fit --config examples/configs/movielens_dlrm.yaml
    lightning-rec fit --config examples/configs/movielens_dlrm.yaml --trainer.max_epochs=2 --data.batch_size=1024
    lightning-rec prepare movielens --data_dir data/ml-100k
    lightning-rec export lightning_logs/version_0/checkpoints/last.ckpt model.safetensors
    lightning-rec export lightning_logs/version_0/checkpoints/last.ckpt model_int8.pt --format inference

DataModules publish ``sparse_features`` and ``num_dense_features``; they are linked into the model's
arguments of the same names, so a model config never repeats table sizes. By default, metrics go to a CSV
log under ``trainer.default_root_dir`` and the progress bar shows samples/s.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List, Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lightning_rec  # noqa: F401  (registers the "recshard" strategy)
from lightning_rec.callbacks import Throughput

__all__ = ["RecCLI", "main", "run"]


class RecCLI(LightningCLI):
    """LightningCLI with the DataModule's feature specs linked into the model, a CSV logger and throughput.

    Any ``LightningModule`` can be configured (``model.class_path``); if its ``__init__`` takes
    ``sparse_features`` and/or ``num_dense_features`` they are filled from the DataModule.

    Example::

        RecCLI(args=["fit", "--config", "examples/configs/synthetic_dlrm.yaml", "--trainer.max_steps=10"])
    """

    def add_arguments_to_parser(self, parser: Any) -> None:
        for key in ("sparse_features", "num_dense_features"):
            parser.link_arguments(f"data.{key}", f"model.init_args.{key}", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        if config.get("logger") in (None, True):
            kwargs.setdefault("logger", CSVLogger(save_dir=config.get("default_root_dir") or "."))
        return super().instantiate_trainer(**kwargs)


def _prepare(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-rec prepare", description="Fetch a dataset ahead of time.")
    parser.add_argument("dataset", choices=["movielens"])
    parser.add_argument("--data_dir", default="data/ml-100k")
    args = parser.parse_args(argv)
    from lightning_rec.data.movielens import prepare_movielens

    print(f"MovieLens-100K ready in {prepare_movielens(args.data_dir)}")


def _export(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-rec export",
        description="Turn a sharded checkpoint (any world size, any plan) into one file: the unsharded state dict "
        "(--format weights: safetensors for *.safetensors, else a torch.save file that loads with weights_only=True), "
        "or a servable TorchScript artifact with quantized tables that loads without lightning_rec "
        "(--format inference; see README 'Serving').",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory, e.g. lightning_logs/version_0/checkpoints/last.ckpt"
    )
    parser.add_argument("output", help="e.g. model.safetensors, model.pt, or model_int8.pt")
    parser.add_argument("--format", choices=["weights", "inference"], default="weights")
    parser.add_argument(
        "--prefix", default="", help='weights: export only the weights under this prefix, without it (e.g. "model.")'
    )
    parser.add_argument(
        "--table-dtype", choices=["fp32", "fp16", "int8", "int4"], default="int8", help="inference: the tables' dtype"
    )
    parser.add_argument("--part", default=None, help='inference: which network, e.g. "query" for a two-tower model')
    parser.add_argument(
        "--model-class",
        default=None,
        help="inference: package.module.Class, importable from here (default: the class the checkpoint names)",
    )
    parser.add_argument("--num-dense-features", type=int, default=None, help="inference: the dense input's width")
    parser.add_argument(
        "--bounds-check",
        choices=["error", "warn", "ignore", "none"],
        default="error",
        help="inference: an id outside its table raises (error), or reads row 0 (warn, ignore), or is not checked",
    )
    args = parser.parse_args(argv)
    from lightning_rec.errors import CheckpointError, ExportError

    try:
        if args.format == "weights":
            from lightning_rec.checkpoint import export

            shapes = export(args.checkpoint, args.output, prefix=args.prefix)
            print(f"wrote {len(shapes)} tensors ({sum(s.numel() for s in shapes.values()):,} values) to {args.output}")
            return
        from lightning_rec.serving import export_inference

        if os.getcwd() not in sys.path:  # --model-class script.Model from the script's folder, as `python -m` would
            sys.path.insert(0, os.getcwd())
        spec = export_inference(
            args.checkpoint,
            args.output,
            table_dtype=args.table_dtype,
            part=args.part,
            model_class=args.model_class,
            num_dense_features=args.num_dense_features,
            bounds_check=args.bounds_check,
        )
    except (CheckpointError, ExportError) as err:  # the user's input: the message, not a traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    dense = f"dense_features[B, {spec.num_dense_features}], " if spec.num_dense_features else ""
    print(
        f"wrote {args.output}: {spec.model}{f' ({spec.part})' if spec.part else ''}, {len(spec.tables)} "
        f"{spec.table_dtype} tables; forward({dense}values, lengths{', weights' if spec.weighted else ''}) with "
        f"features {spec.features}"
    )


def run(args: Optional[List[str]] = None) -> Optional[RecCLI]:
    """Run one ``lightning-rec`` command in this process and return the CLI (``None`` for ``prepare``/``export``).

    Args:
        args: the command line without the program name; ``None`` reads ``sys.argv``.

    Example::

        cli = run(["fit", "--config", "examples/configs/synthetic_dlrm.yaml", "--trainer.max_steps=5"])
        cli.trainer.callback_metrics["val/auroc"]
    """
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["prepare"]:
        _prepare(argv[1:])
        return None
    if argv[:1] == ["export"]:
        _export(argv[1:])
        return None
    return RecCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [Throughput()]},
        args=args,
        auto_configure_optimizers=False,
    )


def main() -> None:
    """The ``lightning-rec`` console script (arguments from ``sys.argv``)."""
    run()


if __name__ == "__main__":
    main()
