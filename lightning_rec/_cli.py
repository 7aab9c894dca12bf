"""``lightning-rec``: LightningCLI for recommendation models, with the ``recshard`` strategy registered.

Subcommands are LightningCLI's (``fit``, ``validate``, ``test``, ``predict``; ``--print_config``, ``--config``)
plus ``prepare``, which fetches a dataset ahead of time (the DataModules also fetch on first use), ``plan``, which
makes the sharding plan of a config for a cluster of any size on this machine (tables on ``meta``; see README
"Planning for a cluster"), and ``export``, which turns a sharded checkpoint into one unsharded state dict file, or
(``--format torchscript``; ``inference``, its former name, is still accepted) into a servable TorchScript artifact
with quantized tables, or (``--format pt2``) a ``torch.export`` + AOTInductor package, and ``index``, which embeds the
catalogue with a two-tower checkpoint's candidate tower into a FAISS index (:mod:`lightning_rec.retrieval`)::

    lightning-rec fit --config examples/configs/movielens_dlrm.yaml
    lightning-rec fit --config examples/configs/movielens_dlrm.yaml --trainer.max_epochs=2 --data.batch_size=1024
    lightning-rec prepare movielens --data_dir data/ml-100k
    lightning-rec plan --config examples/configs/criteo_dlrm.yaml --hosts 2 --devices-per-host 8 --device h100
    lightning-rec fit --config examples/configs/criteo_dlrm.yaml --trainer.strategy.init_args.plan=plan/plan.json
    lightning-rec export lightning_logs/version_0/checkpoints/last.ckpt model.safetensors
    lightning-rec export lightning_logs/version_0/checkpoints/last.ckpt model_int8.pt --format torchscript
    lightning-rec export lightning_logs/version_0/checkpoints/last.ckpt model_int8.pt2 --format pt2
    lightning-rec index runs/movielens_two_tower/checkpoints/last.ckpt index --kind hnsw --devices 2

``--config`` takes a YAML file or the name of a config shipped in the package (``lightning_rec/configs``; the
repository's ``examples/configs`` links there): ``lightning-rec fit --config deepfm`` runs ``movielens_deepfm.yaml``
from any directory.

DataModules publish ``sparse_features`` and ``num_dense_features``; they are linked into the model's
arguments of the same names, so a model config never repeats table sizes. By default, metrics go to a CSV
log under ``trainer.default_root_dir`` and the progress bar shows samples/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger

import lightning_rec  # noqa: F401  (registers the "recshard" strategy)
from lightning_rec import _compat
from lightning_rec._cli_errors import OneLineErrors, one_line
from lightning_rec.callbacks import ScoreWriter, Throughput

__all__ = ["RecCLI", "main", "run", "shipped_config"]


class ConfigBesideLogs(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback``, writing the run's ``config.yaml`` only beside a logger's files.

    Without a logger (``trainer.logger: false``), Lightning writes it into ``default_root_dir``, the working directory
    by default: a file the user did not ask for, which makes the next run there fail ("SaveConfigCallback expected
    config.yaml to NOT exist"), as does a first run whose own config is ``./config.yaml``. With a logger it is
    Lightning's callback unchanged (every rank takes the same branch: the logger is in the config every rank reads).
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:  # noqa: D102
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class RecCLI(LightningCLI):
    """LightningCLI with the DataModule's feature specs linked into the model, a CSV logger and throughput.

    Any ``LightningModule`` can be configured (``model.class_path``); if its ``__init__`` takes
    ``sparse_features`` and/or ``num_dense_features`` they are filled from the DataModule.

    Example::

        RecCLI(args=["fit", "--config", "examples/configs/synthetic_dlrm.yaml", "--trainer.max_steps=10"])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", OneLineErrors)  # config mistakes in one line, exit 2
        kwargs.setdefault("save_config_callback", ConfigBesideLogs)  # no config.yaml where no logger writes
        super().__init__(*args, **kwargs)

    def instantiate_classes(self) -> None:
        """Build what the config describes; a model, data or trainer argument their own ``__init__`` refuses
        (``ValueError``/``TypeError``), or a file it names that is not there or may not be read
        (``FileNotFoundError``, ``PermissionError``: e.g. a DataModule's input read while its ``sparse_features`` are
        linked into the model, a bucket without credentials), prints its message in one line and exits 2
        (``JSONARGPARSE_DEBUG=true``: the traceback). This runs in the launching process, before any
        rank starts."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError, PermissionError) as err:
            if os.environ.get("JSONARGPARSE_DEBUG"):
                raise
            root = err
            while root.__cause__ is not None:  # jsonargparse wraps the class's own error in its Union report
                root = root.__cause__  # type: ignore[assignment]
            prog = self.parser.prog.replace(" [options]", "") + (f" {self.subcommand}" if self.subcommand else "")
            self.parser.exit(2, f"{prog}: error: {one_line(str(root))}\n")

    def _check_data(self) -> None:
        """The DataModule's input files, checked in this process before any rank starts (``check_files``, where
        the DataModule has one), and its label columns against the model's heads (``num_labels``, where both say);
        a mistake is one line and exit 2."""
        from lightning_rec.models.base import check_labels

        check = getattr(self.datamodule, "check_files", None)
        try:
            if check is not None:
                check()
            check_labels(self.model, self.datamodule)
        except (FileNotFoundError, PermissionError, ValueError) as err:  # PermissionError: a bucket's access
            prog = self.parser.prog.replace(" [options]", "") + (f" {self.subcommand}" if self.subcommand else "")
            self.parser.exit(2, f"{prog}: error: {err}\n")

    def before_fit(self) -> None:
        self._check_data()

    def before_validate(self) -> None:
        self._check_data()

    def before_test(self) -> None:
        self._check_data()

    def before_predict(self) -> None:
        """``--output``: a :class:`~lightning_rec.callbacks.ScoreWriter` to that file, once it is known (here, before
        any rank starts) that the file type is one it writes and the DataModule can say which rows it scores."""
        self._check_data()
        output = self.config_init["predict"].get("output")
        if not output:
            return
        try:
            writer = ScoreWriter(output)
            keys = getattr(self.datamodule, "predict_keys", None)
            if callable(keys):
                keys()
        except ValueError as err:
            self.parser.exit(2, f"{self.parser.prog.replace(' [options]', '')} predict: error: {one_line(str(err))}\n")
        self.trainer.callbacks.append(writer)  # type: ignore[attr-defined]  # a property mypy does not see
        if self.config_init["predict"].get("return_predictions") is None:  # the file holds them: not memory too
            self.config_init["predict"]["return_predictions"] = False

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """LightningCLI's parsers, and ``predict --output``."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if add_subcommands:
            _compat.subcommand_parser(self, "predict").add_argument(
                "--output",
                type=str | None,
                default=None,
                help="Write one row per row scored to this file (.parquet/.pq, or .csv/.tsv): the row's keys (the "
                "schema's `keys`, e.g. [user_id, item_id]; else `row`, its place in the files) beside predict_step's "
                "outputs (probability, label where the files have one). Rows to score: --data.predict_files.",
            )

    def add_arguments_to_parser(self, parser: Any) -> None:
        for key in ("sparse_features", "num_dense_features"):
            parser.link_arguments(f"data.{key}", f"model.init_args.{key}", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        if config.get("logger") in (None, True):
            kwargs.setdefault("logger", CSVLogger(save_dir=config.get("default_root_dir") or "."))
        return super().instantiate_trainer(**kwargs)


def _prepare(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-rec prepare", description="Fetch a dataset ahead of time.")
    parser.add_argument("dataset", choices=["movielens"])
    parser.add_argument("--data_dir", default="data/ml-100k")
    parser.add_argument(
        "--format",
        choices=["native", "parquet"],
        default="native",
        help="parquet: also write the ratings as one Parquet table (DATA_DIR/ml-100k.parquet) with vocabulary files, "
        "for examples/configs/movielens_parquet.yaml",
    )
    parser.add_argument("--output", default=None, help="parquet: the table's path (default: DATA_DIR/ml-100k.parquet)")
    args = parser.parse_args(argv)
    from lightning_rec.data._movielens_files import export_parquet, prepare_movielens

    if args.format == "parquet":
        print(f"MovieLens-100K written to {export_parquet(args.data_dir, args.output)} (and vocab_*.txt beside it)")
        return
    print(f"MovieLens-100K ready in {prepare_movielens(args.data_dir)}")


def _export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-rec export",
        description="Turn a sharded checkpoint (any world size, any plan) into one file: the unsharded state dict "
        "(--format weights: safetensors for *.safetensors, else a torch.save file that loads with weights_only=True), "
        "or a servable artifact with quantized tables that loads without lightning_rec: TorchScript (--format "
        "torchscript; 'inference', its former name, is accepted) or a torch.export + AOTInductor package (--format "
        "pt2, for C++ and Python; see docs/serving.md).",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory, e.g. lightning_logs/version_0/checkpoints/last.ckpt"
    )
    parser.add_argument("output", help="e.g. model.safetensors, model.pt, model_int8.pt or model_int8.pt2")
    parser.add_argument(
        "--format",
        # export_inference's names; "inference", this option's earlier name for TorchScript, still works
        type=lambda name: "torchscript" if name == "inference" else name,
        choices=["weights", "torchscript", "pt2"],
        default="weights",
        help="weights (the unsharded state dict), torchscript (alias: inference) or pt2; as export_inference's format",
    )
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
    parser.add_argument(
        "--cpu",
        choices=["portable", "native"],
        default=None,
        help="pt2: the CPUs the compiled code runs on: portable (default; x86-64-v3, AVX2) or native (this CPU's "
        "instruction sets); recorded in the package and checked by every loader",
    )
    args = parser.parse_args(argv)
    from lightning_rec.errors import CheckpointError, ExportError, UnsafeCheckpointError

    try:
        if args.format == "weights":
            from lightning_rec.checkpoint._export import export

            shapes = export(args.checkpoint, args.output, prefix=args.prefix)
            print(f"wrote {len(shapes)} tensors ({sum(s.numel() for s in shapes.values()):,} values) to {args.output}")
            return
        from lightning_rec.serving.export import export_inference

        # --model-class script.Model from the script's folder, as `python -m` would find it. Only for a class the
        # user names: the one a checkpoint names is never looked for in the working directory (it may hold the
        # checkpoint, and a module shipped with it).
        if args.model_class is not None and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        spec = export_inference(
            args.checkpoint,
            args.output,
            format=args.format,
            table_dtype=args.table_dtype,
            part=args.part,
            model_class=args.model_class,
            num_dense_features=args.num_dense_features,
            bounds_check=args.bounds_check,
            cpu=args.cpu,
        )
    except (CheckpointError, ExportError, UnsafeCheckpointError) as err:  # the user's input: the message, no traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    dense = f"dense_features[B, {spec.num_dense_features}], " if spec.num_dense_features else ""
    print(
        f"wrote {args.output}: {spec.model}{f' ({spec.part})' if spec.part else ''}, {len(spec.tables)} "
        f"{spec.table_dtype} tables; forward({dense}values, lengths{', weights' if spec.weighted else ''}) with "
        f"features {spec.features}; raw ids: "
        + (
            "the id mappings, transforms and fills recorded (lightning_rec.serving.RequestEncoder applies them)"
            if spec.raw_inputs
            else "no mapping recorded (the checkpoint holds no TabularDataModule state)"
        )
    )


def _index_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-rec index",
        allow_abbrev=False,
        description="Embed the whole catalogue with the candidate tower of a sharded checkpoint (on --devices ranks, "
        "through the sharded model: each rank embeds a slice, the embeddings are gathered, never a table) and write "
        "the folder OUT: index.faiss (flat, hnsw or ivf; inner product), item_ids.npy (row -> item id) and "
        "manifest.json (checkpoint, global step, run, kind and parameters, faiss version, SHA-256 of the files). OUT "
        "appears whole (written beside it, then renamed). Needs faiss: pip install 'lightning-rec[retrieval]'. "
        "See docs/retrieval.md.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/two_tower/checkpoints/last.ckpt")
    parser.add_argument("output", help="the index folder to create, e.g. index/")
    parser.add_argument("--kind", default="flat", help="flat (exact), hnsw or ivf (default: flat)")
    parser.add_argument("--devices", type=int, default=1, help="CPU ranks that embed the catalogue (default: 1)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it is an index folder (else an existing OUT is refused)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="the fit config: its `data` section (class_path, init_args) names the DataModule whose catalogue is "
        "indexed (default: MovieLensRetrievalDataModule on --data-dir)",
    )
    parser.add_argument("--data-dir", default=None, help="the data folder (default: the config's, else data/ml-100k)")
    parser.add_argument("--batch-size", type=int, default=4096, help="items per rank per batch (default: 4096)")
    parser.add_argument(
        "--model-class", default=None, help="package.module.Class (default: the class the checkpoint names)"
    )
    parser.add_argument("--hnsw-m", type=int, default=None, help="hnsw: links per node (default: 32)")
    parser.add_argument("--hnsw-ef-construction", type=int, default=None, help="hnsw: build width (default: 200)")
    parser.add_argument("--hnsw-ef-search", type=int, default=None, help="hnsw: search width (default: 128)")
    parser.add_argument(
        "--ivf-nlist", type=int, default=None, help="ivf: k-means lists (default: min(4 sqrt(items), items / 39))"
    )
    parser.add_argument(
        "--nprobe", type=int, default=None, help="ivf: lists searched (default: max(16, nlist / 8), at most nlist)"
    )
    return parser


def _index_datamodule(config: str | None, data_dir: str | None) -> Any:
    """The DataModule whose catalogue is indexed: the one the fit config's ``data`` section names, else
    MovieLens's retrieval DataModule (``data_dir`` over the config's)."""
    import importlib

    import yaml  # type: ignore[import-untyped]  # PyYAML (LightningCLI's dependency) ships no stubs

    if config is None:
        from lightning_rec.data.movielens_retrieval import MovieLensRetrievalDataModule

        return MovieLensRetrievalDataModule(data_dir or "data/ml-100k")
    found = shipped_config(config) if not os.path.exists(config) else None
    if found is None and not os.path.isfile(config):
        raise FileNotFoundError(f"the config {config!r} (--config) is neither a file nor a shipped config.")
    text = Path(found or config).read_text()
    data = (yaml.safe_load(text) or {}).get("data")
    if not isinstance(data, dict) or "class_path" not in data:
        raise ValueError(f"the config {config!r} (--config) has no `data` section with a class_path.")
    module_name, _, name = str(data["class_path"]).rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    init_args = dict(data.get("init_args") or {})
    if data_dir is not None:
        init_args["data_dir"] = data_dir
    return cls(**init_args)


def _index(argv: list[str]) -> None:
    """``lightning-rec index``: the arguments checked here, before anything is read; the work in
    :func:`lightning_rec.retrieval.build_index`."""
    parser = _index_parser()
    args = parser.parse_args(argv)
    from lightning_rec.errors import CheckpointError, ExportError, UnsafeCheckpointError
    from lightning_rec.retrieval import folder as retrieval_folder
    from lightning_rec.retrieval import index as retrieval_index

    params = {
        "hnsw_m": args.hnsw_m,
        "hnsw_ef_construction": args.hnsw_ef_construction,
        "hnsw_ef_search": args.hnsw_ef_search,
        "ivf_nlist": args.ivf_nlist,
        "nprobe": args.nprobe,
    }
    try:
        retrieval_index.index_params(args.kind, params)
        if args.devices < 1 or args.batch_size < 1:
            raise ValueError(
                f"the ranks and the batch must be >= 1, got --devices {args.devices} --batch-size {args.batch_size}."
            )
        retrieval_folder.faiss_module()
        retrieval_folder.check_output(args.output, args.overwrite)
        datamodule = _index_datamodule(args.config, args.data_dir)
        manifest = retrieval_index.build_index(
            args.checkpoint,
            args.output,
            kind=args.kind,
            datamodule=datamodule,
            devices=args.devices,
            overwrite=args.overwrite,
            batch_size=args.batch_size,
            model_class=args.model_class,
            **params,
        )
    except (
        ValueError,
        FileExistsError,
        FileNotFoundError,
        ImportError,
        CheckpointError,
        ExportError,
        UnsafeCheckpointError,
    ) as err:  # the user's input: the message, no traceback
        parser.exit(2, f"{parser.prog}: error: {one_line(str(err))}\n")
    if manifest is not None:
        print(
            f"wrote {args.output}: {manifest['kind']} index of {manifest['num_items']} items x {manifest['dim']} "
            f"({manifest['params'] or 'exact'}), checkpoint step {manifest['checkpoint']['global_step']}, "
            f"{manifest['devices']} rank(s)"
        )


class _PlanCLI(RecCLI):
    """The config as ``fit`` reads it, without a Trainer: the model is built with its tensors on ``meta``."""

    def _add_instantiators(self) -> None:
        super()._add_instantiators()

        def on_meta(class_type: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.device("meta"):
                return class_type(*args, **kwargs)

        self.parser.add_instantiator(on_meta, LightningModule, subclasses=True, prepend=True)

    def instantiate_classes(self) -> None:
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self.config_init.get("data")
        self.model = self.config_init.get("model")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or a comma-separated list of numbers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _plan_parser() -> argparse.ArgumentParser:
    from lightning_rec._planner.topology import DEVICE_PRESETS, presets_text

    parser = argparse.ArgumentParser(
        prog="lightning-rec plan",
        allow_abbrev=False,
        description="Make the sharding plan `fit` would make for a cluster, here, with the model's tables on the "
        "meta device (nothing allocated, no GPU or process group needed): every table's sharding type, kernel, "
        "ranks and shards, and per rank the planner's memory and step-time estimates. Takes `fit`'s --config and "
        "--model.../--data.../--trainer... overrides. Writes DIR/plan.json (give it to fit as "
        "--trainer.strategy.init_args.plan=DIR/plan.json) and DIR/plan.png; with several --hosts or "
        "--devices-per-host, one row per topology (DIR/sweep.json, DIR/sweep.png).",
        epilog=f"device presets: {presets_text()}",
    )
    parser.add_argument(
        "--hosts", type=_ints, default=None, help="hosts (nodes), or a list: 1,2,4,8 (default: trainer.num_nodes)"
    )
    parser.add_argument(
        "--devices-per-host", type=_ints, default=None, help="ranks per host, or a list (default: trainer.devices)"
    )
    parser.add_argument(
        "--device-type",
        choices=["cuda", "cpu", *[n for n in DEVICE_PRESETS if n != "cpu"]],
        default=None,
        help="cuda or cpu (default: the preset's, else the trainer's accelerator); a preset name works too",
    )
    parser.add_argument(
        "--device",
        "--preset",
        dest="device",
        choices=sorted(DEVICE_PRESETS),
        default=None,
        help="a device preset: memory and bandwidths",
    )
    parser.add_argument("--hbm-gb", type=float, default=None, help="device memory per rank, GiB (over the preset's)")
    parser.add_argument("--ddr-gb", type=float, default=None, help="host memory per rank, GiB (over the preset's)")
    parser.add_argument(
        "--batch-size-per-rank",
        type=int,
        default=None,
        help="the cost model's batch (default: the strategy's topology.batch_size, else 512)",
    )
    parser.add_argument("--output", default=None, help="a directory for plan.json and plan.png (default: print only)")
    return parser


def _plan(argv: list[str]) -> None:
    """``lightning-rec plan``: the flags and the config parsed here, the planning in
    :mod:`lightning_rec._planner.command`."""
    from lightning_rec._planner.command import PlanOptions, run_plan, sharding_of
    from lightning_rec._planner.fit import DoesNotFit

    parser = _plan_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        options = PlanOptions(**vars(args))
    except ValueError as err:
        parser.error(str(err))
    if not any(a == "--config" or a.startswith("--config=") or a.startswith("--model") for a in rest):
        parser.error("give the model: --config CONFIG.yaml (as for `fit`), or --model.class_path=...")

    with warnings.catch_warnings():  # the rest of our own command line, not a mistake
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = _PlanCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=rest,
            run=False,
            auto_configure_optimizers=False,
        )
    trainer_config = cli.config_init.get("trainer") or {}
    sharding = sharding_of(trainer_config)
    try:
        clusters = options.clusters(trainer_config)
    except ValueError as err:
        parser.error(str(err))
    try:
        run_plan(cli.model, sharding, clusters, options.output)
    except DoesNotFit as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


_DESCRIPTION = "TorchRec's sharded training under Lightning: LightningCLI's commands, and four of its own."
# LightningCLI lists only its own subcommands; the four handled before it (see `run`) are listed here.
_OTHER_COMMANDS = (
    "other commands (each with --help): "
    "plan (the sharding plan fit would make, for a cluster, from this machine); "
    "export (a sharded checkpoint to one unsharded state dict, or a serving artifact); "
    "index (a FAISS index of the catalogue from a two-tower checkpoint's candidate tower); "
    "prepare (fetch or convert a dataset ahead of time)"
)


SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # package data; examples/configs in the repository links here


def shipped_config(name: str) -> Path | None:
    """The shipped config a bare ``--config`` name means: its file name without ``.yaml`` (``movielens_deepfm``) or,
    when only one file ends so, the part after the dataset (``deepfm``); ``None`` when no shipped config is called so.

    Raises:
        ValueError: ``name`` is the end of several shipped configs' names (``dlrm``).

    Example::

        >>> shipped_config("deepfm").name
        'movielens_deepfm.yaml'
    """
    files = sorted(SHIPPED_CONFIGS.glob("*.yaml"))
    exact = [f for f in files if f.stem == name]
    ends = exact or [f for f in files if f.stem.endswith(f"_{name}")]
    if len(ends) > 1:
        raise ValueError(f"{name!r} is the end of several shipped configs: {', '.join(f.stem for f in ends)}")
    return ends[0] if ends else None


def _shipped_config_paths(argv: list[str]) -> list[str]:
    """``--config NAME`` (also ``-c NAME``, ``--config=NAME``) with the path of the shipped config ``NAME`` names, so
    ``lightning-rec fit --config deepfm`` runs from any directory. A file of that name here wins; a value with a
    folder or a suffix is a path, left to LightningCLI; a bare name that is neither a file nor a shipped config exits
    2 with the shipped names."""
    out = list(argv)
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            at, value, prefix = i + 1, argv[i + 1], ""
        elif arg.startswith("--config="):
            at, value, prefix = i, arg.partition("=")[2], "--config="
        else:
            continue
        if os.path.exists(value) or os.sep in value or "/" in value or Path(value).suffix:
            continue
        try:
            found = shipped_config(value)
        except ValueError as err:  # the end of several names: they are the choices
            sys.stderr.write(f"lightning-rec: error: --config {err}\n")
            raise SystemExit(2) from None
        if found is None:
            names = ", ".join(sorted(f.stem for f in SHIPPED_CONFIGS.glob("*.yaml")))
            sys.stderr.write(
                f"lightning-rec: error: --config {value!r} is neither a file nor a shipped config: {names}\n"
            )
            raise SystemExit(2)
        out[at] = f"{prefix}{found}"
    return out


def _strategy_class_for_init_args(argv: list[str]) -> list[str]:
    """``--trainer.strategy.init_args.X=...`` on a config that says ``strategy: recshard`` (a name, which takes no
    arguments): name the class first, ``--trainer.strategy={"class_path": "lightning_rec.RecShardStrategy"}``, so the
    override applies as it does to a config that names the class (whose other arguments are kept)."""
    at = next((i for i, a in enumerate(argv) if a.startswith("--trainer.strategy.init_args.")), None)
    named = any(a == "--trainer.strategy" or a.startswith("--trainer.strategy=") for a in argv)
    if at is None or named:
        return list(argv)
    return [*argv[:at], '--trainer.strategy={"class_path": "lightning_rec.RecShardStrategy"}', *argv[at:]]


def run(args: list[str] | None = None) -> RecCLI | None:
    """Run one ``lightning-rec`` command in this process and return the CLI (``None`` for ``prepare``/``export``/
    ``plan``/``index``).

    Args:
        args: the command line without the program name; ``None`` reads ``sys.argv``.

    Example::

        cli = run(["fit", "--config", "synthetic_dlrm", "--trainer.max_steps=5"])  # a shipped config, by name
        cli.trainer.callback_metrics["val/auroc"]
    """
    argv = sys.argv[1:] if args is None else args
    if argv[:1] not in (["prepare"], ["export"], ["index"]):
        named = _shipped_config_paths(argv)
        if named != argv:  # LightningCLI reads sys.argv when args is None: hand it the rewritten line instead
            argv = args = named
    if argv[:1] == ["prepare"]:
        _prepare(argv[1:])
        return None
    if argv[:1] == ["export"]:
        _export(argv[1:])
        return None
    if argv[:1] == ["plan"]:
        _plan(argv[1:])
        return None
    if argv[:1] == ["index"]:
        _index(argv[1:])
        return None
    rewritten = _strategy_class_for_init_args(argv)
    with warnings.catch_warnings():  # a rewritten command line is still this one
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return RecCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={"callbacks": [Throughput()]},
            args=rewritten if rewritten != argv else args,
            auto_configure_optimizers=False,
            parser_kwargs={"description": _DESCRIPTION, "epilog": _OTHER_COMMANDS},
        )


def main() -> None:
    """Every ``lightning-rec`` command but the top-level ``--help``, which ``_lightning_rec_cli.main`` (the console
    script) answers without importing this package (arguments from ``sys.argv``)."""
    run()


if __name__ == "__main__":
    main()
