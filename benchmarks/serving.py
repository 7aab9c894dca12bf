"""Serving artifacts of a trained CTR checkpoint, per table dtype: size (the archive, its tensors, the tables),
validation AUROC, and CPU latency per batch against the training module's eval forward, in the same process and
the same rows (README "Serving", BENCHMARKS.md).

    lightning-rec fit --config examples/configs/movielens_dlrm.yaml --trainer.default_root_dir=runs/serving
    python benchmarks/serving.py runs/serving/lightning_logs/version_0/checkpoints/last.ckpt

Latency: one intra-op thread, each batch size's calls interleaved (artifact, module, artifact, ...) so that the
machine's noise hits both; the median of ``--reps`` calls each, and their ratio. AUROC: the validation rows of
the MovieLens config the checkpoint was trained with (``--data_dir``).
"""

import argparse
import importlib
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from lightning_rec.data import MovieLensDataModule
from lightning_rec.serving import export_inference, inference_spec, load_inference, serving_inputs

DTYPES = ("fp32", "fp16", "int8", "int4")
# TorchRec's embedding modules, whose parameters are the tables (the rest of the network is dense).
TABLE_MODULES = (
    EmbeddingBagCollection,
    EmbeddingCollection,
    FeatureProcessedEmbeddingBagCollection,
    BaseManagedCollisionEmbeddingCollection,
)


def _tensor_bytes(artifact: Path) -> int:
    with zipfile.ZipFile(artifact) as z:
        return sum(i.file_size for i in z.infolist() if "/data/" in i.filename)


def _ms(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data_dir", default="data/ml-100k")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--sizes-only", action="store_true", help="sizes only (a checkpoint of other data)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = Path(args.checkpoint)
    work = Path(tempfile.mkdtemp(prefix="serving_bench_"))
    name = "{}.pt" if args.sizes_only else "model_{}.pt"  # (the archive's name is in it: part of its size)
    artifacts = {"fp32": work / name.format("fp32")}
    spec = export_inference(ckpt, artifacts["fp32"], table_dtype="fp32")  # names the module's class too
    module_name, _, class_name = spec.model.rpartition(".")
    module = getattr(importlib.import_module(module_name), class_name).load_from_checkpoint(ckpt).eval()
    net = module.inference_module()
    table_params = {id(p) for m in net.modules() if isinstance(m, TABLE_MODULES) for p in m.parameters()}
    dense_bytes = sum(p.numel() * 4 for p in net.parameters() if id(p) not in table_params)
    fp32_table_bytes = sum(p.numel() * 4 for p in net.parameters() if id(p) in table_params)
    hp = module.hparams
    if args.sizes_only:
        print(
            f"{ckpt} ({type(module).__name__}, embedding_dim {hp.get('embedding_dim')}): fp32 tables "
            f"{fp32_table_bytes:,} B, dense {dense_bytes:,} B"
        )
        print("| tables | artifact B | tables B (vs fp32) |\n|---|---|---|")
        for dtype in DTYPES:
            artifact = artifacts[dtype] = work / name.format(dtype)
            if dtype != "fp32":  # exported above
                export_inference(ckpt, artifact, table_dtype=dtype)
            tables = _tensor_bytes(artifact) - dense_bytes
            size = artifact.stat().st_size
            print(f"| {dtype} | {size:,} | {tables:,} ({fp32_table_bytes / tables:.2f}x smaller) |")
        return
    dm = MovieLensDataModule(data_dir=args.data_dir, val_fraction=0.1, split_seed=42, batch_size=512)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    labels = torch.cat([b.labels for b in batches]).long()
    with torch.no_grad():
        eager_auroc = float(binary_auroc(torch.cat([torch.sigmoid(module(b)) for b in batches]), labels))
    print(f"checkpoint {ckpt} ({type(module).__name__}, embedding_dim {hp.get('embedding_dim')}); training module")
    print(f"  eval forward: val AUROC {eager_auroc:.4f}; fp32 tables {fp32_table_bytes:,} B, dense {dense_bytes:,} B")
    print("| tables | artifact B | tensors B | tables B (vs fp32) | val AUROC (vs module) |")
    print("|---|---|---|---|---|")
    for dtype in DTYPES:
        artifact = artifacts[dtype] = work / name.format(dtype)
        if dtype != "fp32":  # exported above
            export_inference(ckpt, artifact, table_dtype=dtype)
        model = load_inference(artifact)
        with torch.inference_mode():
            probs = torch.cat([model(*serving_inputs(spec, b.sparse_features, b.dense_features)) for b in batches])
        auroc = float(binary_auroc(probs, labels))
        tables = _tensor_bytes(artifact) - dense_bytes
        print(
            f"| {dtype} | {artifact.stat().st_size:,} | {_tensor_bytes(artifact):,} | {tables:,} "
            f"({fp32_table_bytes / tables:.2f}x smaller) | {auroc:.4f} ({auroc - eager_auroc:+.4f}) |"
        )

    # The cost of the artifact's own input check (bounds_check="error", the default): the fp32 artifact without it.
    artifacts["fp32, unchecked"] = work / "model_fp32_unchecked.pt"
    export_inference(ckpt, artifacts["fp32, unchecked"], table_dtype="fp32", bounds_check="none")
    print("\nCPU latency per batch, 1 thread, median ms (training module eval forward / artifact):")
    print("| rows | module ms | " + " | ".join(f"{d} ms (speed-up)" for d in artifacts) + " |")
    print("|---|---|" + "---|" * len(artifacts))
    val = dm.split("val")
    spec = inference_spec(artifacts["fp32"])  # every dtype's artifact takes the same inputs
    models = {d: load_inference(a) for d, a in artifacts.items()}
    for rows in (1, 64, 512):
        batch = val[torch.arange(rows)]
        inputs = serving_inputs(spec, batch.sparse_features, batch.dense_features)
        cells = []
        with torch.inference_mode():
            for d, model in models.items():
                for _ in range(10):
                    model(*inputs), module(batch)  # warm-up
                pairs = [(_ms(model, *inputs), _ms(module, batch)) for _ in range(args.reps)]
                ours = statistics.median(p[0] for p in pairs)
                base = statistics.median(p[1] for p in pairs)
                cells.append((d, ours, base))
        base = statistics.median(c[2] for c in cells)
        print(f"| {rows} | {base:.3f} | " + " | ".join(f"{o:.3f} ({b / o:.2f}x)" for _, o, b in cells) + " |")


if __name__ == "__main__":
    main()
