"""The parity table: lightning_rec's models under RecBole's protocols beside RecBole's published quick-start numbers
(issue 48; docs/model-quality.md).

Each row is one config, ``benchmarks/recbole_parity/<row>.yaml`` (one process, ``devices: 1``, a ``ModelCheckpoint``
on the validation metric RecBole selects by), and one run of a row is::

    lightning-rec fit --config benchmarks/recbole_parity/<row>.yaml --seed_everything=<seed>
    # then the best epoch on validation, tested (what RecBole's Trainer.evaluate(load_best_model=True) does):
    lightning-rec test --config benchmarks/recbole_parity/<row>.yaml --ckpt_path=<that run's best checkpoint>

This script does exactly that for every (row, seed), in one process per run (``--jobs`` of them side by side; the
fit and the test share the process: ``python -m lightning_rec`` twice), and prints the table: row, task, metric,
the published number, ours as mean +- std over the seeds, RecBole itself run offline
(``benchmarks/recbole_quickstart.py``) where measured, and the verdict (``matches-or-beats``: the mean is at least
the published number, at most for log loss)::

    python benchmarks/recbole_parity.py                                  # every row, seeds 0-4, 2 jobs
    python benchmarks/recbole_parity.py --rows lr,deepfm --seeds 0 --json parity.json
    python benchmarks/recbole_parity.py --epochs 1                        # a smoke run (the CI test's)

A row whose YAML is missing is skipped with a message; a run that fails is shown with its log's last lines, and
the script then exits 1. The metrics read are the test keys the modules log: ``test/<metric>@10``
(:class:`~lightning_rec.metrics.TopKMetrics`: recall, mrr, ndcg, hit, precision) and ``test/auroc``,
``test/log_loss`` (:func:`~lightning_rec.metrics.ctr_metrics`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import runpy
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = Path(__file__).resolve().parent / "recbole_parity"

# RecBole's published quick-start test numbers (RecBole's docs, RUCAIBox/RecBole): task -> its page, the model, the
# metrics (RecBole's names) and their values, as the page prints them.
PUBLISHED: dict[str, dict[str, Any]] = {
    "general": {
        "source": "RUCAIBox/RecBole docs/source/get_started/started/general.rst",
        "model": "BPR, embedding 64",
        "metrics": {"recall@10": 0.2523, "mrr@10": 0.4855, "ndcg@10": 0.2920, "hit@10": 0.7953, "precision@10": 0.1962},
    },
    "sequential": {
        "source": "RUCAIBox/RecBole docs/source/get_started/started/sequential.rst",
        "model": "GRU4Rec, embedding 64, hidden 128",
        "metrics": {"recall@10": 0.1103, "mrr@10": 0.0337, "ndcg@10": 0.0513, "hit@10": 0.1103, "precision@10": 0.011},
    },
    "context": {
        "source": "RUCAIBox/RecBole docs/source/get_started/started/context-aware.rst",
        "model": "LR, embedding 10",
        "metrics": {"auc": 0.7765, "logloss": 0.5620},
    },
}

# RecBole 1.2.1 itself, run offline on this machine with the page's config verbatim and RecBole's default seed:
# `/tmp/recbole-venv/bin/python benchmarks/recbole_quickstart.py --task <task>` (its JSON line's "test").
# Measured 2026-11-29 (the split is RecBole's own in both: the same test-split digest, see
# tests/data/test_movielens_recbole.py): LR stopped early after 219 epochs, best epoch 207.
RECBOLE_OFFLINE: dict[str, dict[str, float]] = {
    "context": {"auc": 0.7765, "logloss": 0.5616},
}

# Lower is better for these (RecBole's `valid_metric_bigger: False` metrics); higher for every other.
LOWER_IS_BETTER = {"logloss"}

# Our logged test key of each published metric.
_OUR_KEY = {"auc": "test/auroc", "logloss": "test/log_loss"}


@dataclass(frozen=True)
class Row:
    """One row of the table: the config (``benchmarks/recbole_parity/<name>.yaml``), its task (a key of
    :data:`PUBLISHED`) and whose it is (the helper that writes it, named in the skip message)."""

    name: str
    task: str
    what: str

    @property
    def config(self) -> Path:
        return CONFIGS / f"{self.name}.yaml"


ROWS = {
    row.name: row
    for row in (
        Row("bpr", "general", "BPR-like: matrix factorisation (two-tower of id embeddings)"),
        Row("gru4rec", "sequential", "GRU4Rec-like"),
        Row("sasrec", "sequential", "SASRec"),
        Row("lr", "context", "LR-like: LogisticRegressionModule"),
        Row("deepfm", "context", "DeepFMModule"),
    )
}


def our_key(metric: str) -> str:
    """The key our modules log at test for a published metric (``recall@10`` -> ``test/recall@10``).

    Example::

        >>> our_key("auc"), our_key("ndcg@10")
        ('test/auroc', 'test/ndcg@10')
    """
    return _OUR_KEY.get(metric, f"test/{metric}")


def holds(metric: str, ours: float, published: float) -> bool:
    """Whether ``ours`` matches or beats ``published`` (at least it; at most for :data:`LOWER_IS_BETTER`).

    Example::

        >>> holds("auc", 0.78, 0.7765), holds("logloss", 0.56, 0.5620), holds("logloss", 0.57, 0.5620)
        (True, True, False)
    """
    return ours <= published if metric in LOWER_IS_BETTER else ours >= published


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value).

    Example::

        >>> mean_std([1.0, 2.0, 3.0])
        (2.0, 1.0)
    """
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _cli(args: list[str]) -> None:
    """``lightning-rec ARGS`` in this process (``python -m lightning_rec``: the console script's own path)."""
    argv = sys.argv
    sys.argv = ["lightning-rec", *args]
    try:
        runpy.run_module("lightning_rec", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv


def _test_metrics(rundir: Path) -> dict[str, float]:
    """The ``test/*`` numbers the test run logged (the CSV logger's ``metrics.csv`` under ``rundir``)."""
    for path in sorted(rundir.glob("lightning_logs/version_*/metrics.csv"), reverse=True):
        with path.open() as handle:
            rows = list(csv.DictReader(handle))
        metrics = {k: float(v) for row in rows for k, v in row.items() if k.startswith("test/") and v not in ("", None)}
        if metrics:
            return metrics
    return {}


def _one(config: str, seed: int, out: str, epochs: int | None) -> None:
    """One (row, seed) in this process, as the documented commands run it: ``lightning-rec fit``, then
    ``lightning-rec test`` of the best checkpoint; writes ``out`` (JSON)."""
    start = time.perf_counter()
    rundir = Path(out).parent
    common = ["--config", config, f"--seed_everything={seed}", f"--trainer.default_root_dir={rundir}"]
    common.append("--trainer.enable_progress_bar=false")
    _cli(["fit", *common] + ([f"--trainer.max_epochs={epochs}"] if epochs is not None else []))
    fit_s = time.perf_counter() - start
    # The row's ModelCheckpoint keeps one file, the best epoch on the validation metric: `best.ckpt`.
    best = sorted(rundir.glob("lightning_logs/version_*/checkpoints/best*.ckpt"))
    if len(best) != 1:
        raise SystemExit(f"{config}: expected one best checkpoint under {rundir}, found {[str(b) for b in best]}.")
    _cli(["test", *common, f"--ckpt_path={best[0]}"])
    result = {
        "seed": seed,
        "metrics": _test_metrics(rundir),
        "best_checkpoint": str(best[0]),
        "fit_s": round(fit_s, 1),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    Path(out).write_text(json.dumps(result))


def _launch(row: Row, seed: int, workdir: Path, epochs: int | None, threads: int) -> dict[str, Any]:
    """Run one (row, seed) in a process of its own; its result, or its failure with the log's tail."""
    rundir = workdir / f"{row.name}-seed{seed}"
    rundir.mkdir(parents=True, exist_ok=True)
    out, log = rundir / "result.json", rundir / "log.txt"
    command = [sys.executable, __file__, "--one", str(row.config), str(seed), str(out)]
    if epochs is not None:
        command += ["--epochs", str(epochs)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # Lightning then leaves the thread count alone
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0 or not out.is_file():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        return {"seed": seed, "error": f"exit {code}", "log": str(log), "log_tail": tail}
    result = json.loads(out.read_text())
    result["process_s"] = round(time.perf_counter() - start, 1)
    return result


def summarise(row: Row, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per published metric of the row's task: our mean and std over the runs that have it, the published and
    offline numbers and the verdict (``missing`` when no run logged the metric)."""
    published = PUBLISHED[row.task]["metrics"]
    offline = RECBOLE_OFFLINE.get(row.task, {})
    out: dict[str, dict[str, Any]] = {}
    for metric, value in published.items():
        values = [r["metrics"][our_key(metric)] for r in runs if our_key(metric) in r.get("metrics", {})]
        entry: dict[str, Any] = {"key": our_key(metric), "published": value, "recbole_offline": offline.get(metric)}
        if values:
            mean, std = mean_std(values)
            entry.update(mean=mean, std=std, n=len(values))
            entry["verdict"] = "matches-or-beats" if holds(metric, mean, value) else "below"
        else:
            entry["verdict"] = "missing"
        out[metric] = entry
    return out


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| row | task | metric | published | ours (mean +- std, n) | RecBole 1.2.1 offline | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["rows"].items():
        if "skipped" in entry:
            lines.append(f"| {name} | {ROWS[name].task} | | | skipped: {entry['skipped']} | | |")
            continue
        for metric, m in entry["summary"].items():
            ours = f"{m['mean']:.4f} +- {m['std']:.4f} ({m['n']})" if "mean" in m else "-"
            offline = "-" if m["recbole_offline"] is None else f"{m['recbole_offline']:.4f}"
            verdict = m["verdict"] + (" (lower is better)" if metric in LOWER_IS_BETTER else "")
            lines.append(
                f"| {name} | {entry['task']} | {metric} | {m['published']:.4f} | {ours} | {offline} | {verdict} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (--seed_everything)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (one process each)")
    parser.add_argument("--epochs", type=int, default=None, help="override every row's max_epochs (smoke runs)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a temporary directory)")
    parser.add_argument("--one", nargs=3, metavar=("CONFIG", "SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one[0], int(args.one[1]), args.one[2], args.epochs)
        return 0
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; the rows are {', '.join(ROWS)}.")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}.")
    if not seeds or args.jobs < 1:
        parser.error("--seeds needs at least one seed and --jobs at least 1.")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="recbole-parity-"))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)

    results: dict[str, Any] = {"published": PUBLISHED, "recbole_offline": RECBOLE_OFFLINE, "rows": {}}
    jobs = []
    for name in names:
        row = ROWS[name]
        if not row.config.is_file():
            message = f"{row.config.relative_to(ROOT)} is not there"
            print(f"skip {name}: {message}", file=sys.stderr)
            results["rows"][name] = {"task": row.task, "skipped": message}
            continue
        results["rows"][name] = {"task": row.task, "config": str(row.config.relative_to(ROOT)), "runs": []}
        jobs += [(row, seed) for seed in seeds]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = pool.map(lambda job: (job[0], _launch(job[0], job[1], workdir, args.epochs, threads)), jobs)
        for row, result in done:
            results["rows"][row.name]["runs"].append(result)
            status = result.get("error") or f"{result['wall_s']} s"
            print(f"{row.name} seed {result['seed']}: {status}", file=sys.stderr, flush=True)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    failed = False
    for name, entry in results["rows"].items():
        if "runs" in entry:
            ok = [r for r in entry["runs"] if "error" not in r]
            entry["summary"] = summarise(ROWS[name], ok)
            for bad in (r for r in entry["runs"] if "error" in r):
                failed = True
                print(f"{name} seed {bad['seed']} failed ({bad['error']}), {bad['log']}:", file=sys.stderr)
                print("\n".join(bad["log_tail"]), file=sys.stderr)
    print(_table(results))
    print(f"\n{len(jobs)} runs, {args.jobs} at a time: {results['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
