"""Re-run the test audit: apply one deliberate regression (a mutation) at a time and check that a test fails.

Each mutation replaces one exact snippet of the code (it must occur exactly once), runs the tests that must catch it,
and restores the file, whatever happens. A mutation that no test catches is the finding.

    .venv/bin/python scripts/mutations.py --list
    .venv/bin/python scripts/mutations.py                    # all of them (~4 min on 2 cores)
    .venv/bin/python scripts/mutations.py loss_item cpu_lookup_group

Exit status 1 when a mutation survives (every test passed with it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYNCS_1 = "tests/strategy/test_syncs.py::test_a_recshard_step_reads_exactly_what_is_pinned_and_no_more_than_torchrec_by_hand[dict-False-1]"
SYNCS_PIPE = "tests/strategy/test_syncs.py::test_a_recshard_step_reads_exactly_what_is_pinned_and_no_more_than_torchrec_by_hand[batch-True-1]"
PRE_BACKWARD = (
    "        self._input_checks.check_loss(closure_loss)  # the backward pass would write a NaN into the tables\n"
)


@dataclass(frozen=True)
class Mutation:
    """One regression: in ``path``, ``old`` (exactly once) becomes ``new``; one of ``tests`` must then fail."""

    name: str
    why: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS: list[Mutation] = [
    Mutation(
        "loss_item",
        "an .item() inside torch (formatting the loss) in the step",
        "lightning_rec/_strategy/recshard.py",
        PRE_BACKWARD,
        PRE_BACKWARD + '        _ = f"{closure_loss.detach():.4f}"\n',
        (SYNCS_1,),
    ),
    Mutation(
        "loss_cpu",
        "the loss copied to the host with .cpu() in the step",
        "lightning_rec/_strategy/recshard.py",
        PRE_BACKWARD,
        PRE_BACKWARD + "        _ = closure_loss.detach().cpu()\n",
        (SYNCS_1,),
    ),
    Mutation(
        "loss_to_blocking",
        "the loss copied to the host with a blocking .to() in the step",
        "lightning_rec/_strategy/recshard.py",
        PRE_BACKWARD,
        PRE_BACKWARD + '        _ = closure_loss.detach().to("cpu")\n',
        (SYNCS_PIPE,),
    ),
    Mutation(
        "loss_check_copy",
        "the loss check's non-blocking copy to host memory replaced by .cpu()",
        "lightning_rec/_inputs/checks.py",
        "        host.copy_(value, non_blocking=True)\n",
        "        host = value.cpu()\n",
        (SYNCS_1,),
    ),
    Mutation(
        "cpu_lookup_group",
        "the CPU lookup's threaded backward leaves one group of tables without its update",
        "lightning_rec/_strategy/cpu_lookup.py",
        "        run_on_threads(self._call, [(grad, *call) for call in calls])\n",
        "        run_on_threads(self._call, [(grad, *call) for call in calls[1:]])\n",
        ("tests/strategy/test_cpu_lookup.py",),
    ),
    Mutation(
        "cpu_lookup_openmp_team",
        "the CPU lookup's backward threads are born with the caller's intra-op thread count (each starts OpenMP workers)",
        "lightning_rec/_strategy/backward_threads.py",
        "    torch.set_num_threads(1)\n",
        "    torch.set_num_threads(outer)\n",
        ("tests/strategy/test_cpu_lookup.py::test_the_split_s_threads_start_no_openmp_workers_of_their_own",),
    ),
    Mutation(
        "cpu_lookup_weights",
        "the CPU lookup's forward ignores per-sample weights",
        "lightning_rec/_strategy/cpu_lookup.py",
        "                    per_sample_weights=None if weights is None else weights[s:e],\n",
        "                    per_sample_weights=None,\n",
        ("tests/strategy/test_cpu_lookup.py",),
    ),
    Mutation(
        "sasrec_column_split",
        "the shipped SASRec config splits its item table column-wise under row-wise Adagrad (drifts)",
        "examples/configs/movielens_sasrec.yaml",
        "          sharding_types: [row_wise]\n",
        "          sharding_types: [column_wise]\n          min_partition: 32\n",
        ("tests/test_cli.py::test_no_shipped_config_splits_the_columns_of_a_table_row_wise_adagrad_trains",),
    ),
    Mutation(
        "column_offsets",
        "the rows the unsharded tables held are copied into every shard as if it began at column 0",
        "lightning_rec/_strategy/unsharded.py",
        "            region = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))\n",
        "            region = tuple(slice(o, o + s) for o, s in zip([shard.metadata.shard_offsets[0], 0], shard.metadata.shard_sizes))\n",
        ("tests/test_pretrained.py::test_every_plan_starts_from_the_files_rows",),
    ),
    Mutation(
        "pipeline_rewrite",
        "TorchRec's pipeline rewrite silently skipped: both sides of 'pipelined == not pipelined' run the plain forward",
        "lightning_rec/_strategy/pipeline.py",
        "                _compat.pipeline_rewrite(engine)  # rewrites the forwards, starts batch 0's input dist\n",
        "                pass\n",
        ("tests/strategy/test_unsharded.py::test_pipelined_training_takes_dict_and_tuple_batches",),
    ),
    Mutation(
        "pipeline_off",
        "RecShardStrategy(pipeline=True) never builds the pipeline",
        "lightning_rec/_strategy/recshard.py",
        "                SparseDistPipeline(state.dmp, self.root_device, self._input_checks) if self.pipeline else None\n",
        "                None\n",
        ("tests/models/test_dlrm.py::test_dlrm_dcn_trains_like_plain_pytorch_pipelined_and_resharded",),
    ),
    Mutation(
        "int8_tables_zeroed",
        "the int8 serving artifact's tables are zeros",
        "lightning_rec/serving/export.py",
        "    quantized = quantize(serving, _DTYPES[table_dtype])\n",
        "    quantized = quantize(serving, _DTYPES[table_dtype])\n"
        + '    [k.weights_host.zero_() for k in quantized.modules() if type(k).__name__ in KERNELS and table_dtype == "int8"]\n',
        ("tests/test_serving.py::test_zoo_model_serves_without_lightning_rec_like_the_trained_module[dlrm]",),
    ),
    Mutation(
        "int4_tables_zeroed",
        "the int4 serving artifact's tables are zeros",
        "lightning_rec/serving/export.py",
        "    quantized = quantize(serving, _DTYPES[table_dtype])\n",
        "    quantized = quantize(serving, _DTYPES[table_dtype])\n"
        + '    [k.weights_host.zero_() for k in quantized.modules() if type(k).__name__ in KERNELS and table_dtype == "int4"]\n',
        ("tests/test_serving.py::test_zoo_model_serves_without_lightning_rec_like_the_trained_module[dlrm]",),
    ),
    Mutation(
        "cpp_ids_zero",
        "the C++ server reads every id as 0",
        "examples/serve_cpp/serve.cpp",
        "  args.push_back(torch::tensor(values, torch::kLong));\n",
        "  args.push_back(torch::zeros_like(torch::tensor(values, torch::kLong)));\n",
        ("tests/test_serving_cpp.py::test_cpp_serves_held_out_samples_like_python",),
    ),
    Mutation(
        "cpp_dense_layout",
        "the C++ server reads the dense values in the wrong layout",
        "examples/serve_cpp/serve.cpp",
        "    args.push_back(torch::tensor(dense, torch::kDouble).reshape({B, in.dense}));\n",
        "    args.push_back(torch::tensor(dense, torch::kDouble).reshape({in.dense, B}).t());\n",
        ("tests/test_serving_cpp.py::test_cpp_serves_held_out_samples_like_python",),
    ),
    Mutation(
        "cpp_pt2_any_torch",
        "the C++ server runs a .pt2 package compiled under another torch",
        "examples/serve_cpp/serve.cpp",
        "    if (written != TORCH_VERSION) {\n",
        "    if (false) {\n",
        ("tests/test_serving_cpp.py::test_a_package_from_another_torch_is_refused_by_cpp_and_by_serve_py",),
    ),
    Mutation(
        "score_output_types",
        "predict --output writes every output as float32 (ids above 2**24 rounded)",
        "lightning_rec/callbacks.py",
        "                value = value.detach().cpu()\n",
        "                value = value.detach().cpu().float()\n",
        ("tests/test_scoring.py::test_any_datamodule_s_rows_are_written_in_order_with_their_own_types",),
    ),
    Mutation(
        "score_row_order",
        "the rows a rank scored are taken in another order than its loader gave them (scores beside other rows' keys)",
        "lightning_rec/callbacks.py",
        "    return np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]) if batches else np.zeros(0, np.int64)\n",
        "    return np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])[::-1].copy()\n",
        ("tests/test_scoring.py::test_any_datamodule_s_rows_are_written_in_order_with_their_own_types",),
    ),
    Mutation(
        "score_keys_of_dropped_rows",
        "the keys of rows bad_rows: drop dropped stay in the keys of the rows scored",
        "lightning_rec/data/tabular.py",
        "                pa.concat_tables([p.keys for p in parts]).filter(pa.array(keep))\n",
        "                pa.concat_tables([p.keys for p in parts])\n",
        ("tests/test_scoring.py::test_predict_files_keep_their_keys_in_order_and_drop_bad_rows_counted",),
    ),
]


def run(mutation: Mutation) -> tuple[bool, float, str]:
    """Apply ``mutation``, run its tests, restore the file. Returns (caught, seconds, the tests' last line)."""
    path = REPO / mutation.path
    original = path.read_text()
    if original.count(mutation.old) != 1:
        raise SystemExit(
            f"{mutation.name}: the snippet occurs {original.count(mutation.old)} times in {mutation.path} "
            "(the code moved: update the mutation)"
        )
    start = time.monotonic()
    try:
        path.write_text(original.replace(mutation.old, mutation.new))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    finally:
        path.write_text(original)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return proc.returncode != 0, time.monotonic() - start, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutations {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:24} {m.path}: {m.why}")
        return
    survived = []
    for m in chosen:
        caught, seconds, last = run(m)
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:24} {seconds:6.1f}s  {last}", flush=True)
        if not caught:
            survived.append(m.name)
    if survived:
        raise SystemExit(f"{len(survived)} mutation(s) survived: {survived}")


if __name__ == "__main__":
    main()
