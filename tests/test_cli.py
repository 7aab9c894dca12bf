"""The ``lightning-rec`` CLI: every shipped config loads, flags reach the strategy, runs write CSV metrics."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from lightning_rec import RecShardStrategy
from lightning_rec._cli import run
from tests.helpers.data import REPO, movielens_dir

CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def test_all_three_configs_are_shipped() -> None:
    assert {p.name for p in CONFIGS} >= {"movielens_dlrm.yaml", "synthetic_dlrm.yaml", "criteo_dlrm.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_no_shipped_config_splits_the_columns_of_a_table_row_wise_adagrad_trains(config: Path) -> None:
    """Row-wise Adagrad keeps one accumulator per row and column shard: a table split column-wise drifts from
    unsharded training (README, known limits). A column-wise constraint without ``min_partition`` keeps a table
    narrower than TorchRec's 128-column block in one shard; one with it splits."""
    shipped = yaml.safe_load(config.read_text())
    optimizer = (shipped["model"].get("init_args") or {}).get("embedding_optimizer") or {}
    strategy = (
        (shipped["trainer"].get("strategy") or {}) if isinstance(shipped["trainer"].get("strategy"), dict) else {}
    )
    constraints = (strategy.get("init_args") or {}).get("constraints") or {}
    if optimizer.get("name") != "rowwise_adagrad":
        return
    split = {"column_wise", "table_column_wise", "grid_shard"}
    for table, c in constraints.items():
        assert not (split & set(c.get("sharding_types", [])) and "min_partition" in c), (config.name, table, c)


@pytest.mark.dist
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(config: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_rec", "fit", "--config", str(config), "--print_config"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = yaml.safe_load(out.stdout)
    shipped = yaml.safe_load(config.read_text())
    assert printed["model"]["class_path"] == shipped["model"]["class_path"]
    assert printed["data"]["class_path"] == shipped["data"]["class_path"]
    assert printed["trainer"]["devices"] == shipped["trainer"]["devices"]


def _fit(args: list[str], tmp_path: Path) -> dict[str, float]:
    """Run ``fit`` in this process (1 rank) and return the last logged value of each CSV metric."""
    cli = run(
        [
            "fit",
            *args,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.devices=1",
            "--trainer.enable_checkpointing=false",
        ]
    )
    metrics_csv = Path(cli.trainer.logger.log_dir) / "metrics.csv"
    assert metrics_csv.is_file(), "metrics should land in a CSV log under default_root_dir by default"
    assert metrics_csv.is_relative_to(tmp_path)
    last: dict[str, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


@pytest.mark.dist
def test_strategy_arguments_and_constraints_from_flags(tmp_path: Path) -> None:
    cli = run(
        [
            "fit",
            "--config",
            str(REPO / "examples/configs/synthetic_dlrm.yaml"),
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=3",
            "--trainer.enable_checkpointing=false",
            "--trainer.strategy=lightning_rec.RecShardStrategy",
            '--trainer.strategy.constraints={"t_user": {"sharding_types": ["table_wise"]}}',
            "--trainer.strategy.bounds_check=warn",
            "--trainer.strategy.nonfinite=ignore",
            "--trainer.strategy.timeout=90",
            "--data.init_args.train_rows=2048",
            "--data.init_args.val_rows=512",
        ]
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RecShardStrategy)
    assert strategy.sharding.constraints["t_user"].sharding_types == ["table_wise"]
    assert strategy.sharding.fused_params["bounds_check_mode"].name == "WARNING"
    assert strategy.timeout == timedelta(seconds=90)
    assert strategy._input_checks.nonfinite == "ignore" and not strategy._input_checks.check_ids
    assert (
        strategy.sharding_plan.get_plan_for_module("model.sparse_arch.embedding_bag_collection")["t_user"].sharding_type
        == "table_wise"
    )


@pytest.mark.dist
def test_synthetic_fit_logs_metrics_and_throughput(tmp_path: Path) -> None:
    last = _fit(
        [
            "--config",
            str(REPO / "examples/configs/synthetic_dlrm.yaml"),
            "--trainer.max_epochs=1",
            "--trainer.log_every_n_steps=2",
            "--data.init_args.train_rows=4096",
            "--data.init_args.val_rows=1024",
        ],
        tmp_path,
    )
    assert {"val/auroc", "val/ne", "val/log_loss", "val/accuracy", "train/loss", "train/samples_per_s"} <= set(last)
    assert last["train/samples_per_s"] > 0
    assert 0.0 <= last["val/auroc"] <= 1.0


@pytest.mark.dist
def test_criteo_fit_on_a_generated_file(tmp_path: Path) -> None:
    from lightning_rec.data.criteo import write_criteo_tsv

    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    write_criteo_tsv(train, 3000, seed=0)
    write_criteo_tsv(val, 600, seed=1)
    last = _fit(
        [
            "--config",
            str(REPO / "examples/configs/criteo_dlrm.yaml"),
            "--trainer.max_epochs=1",
            f"--data.init_args.train=[{train}]",
            f"--data.init_args.val=[{val}]",
            "--data.init_args.num_embeddings=1000",
            "--data.init_args.batch_size=256",
            "--trainer.log_every_n_steps=2",
        ],
        tmp_path,
    )
    assert "val/auroc" in last and "train/loss" in last


@pytest.mark.dist
def test_prepare_subcommand(tmp_path: Path) -> None:
    data = movielens_dir()
    out = subprocess.run(
        [sys.executable, "-m", "lightning_rec", "prepare", "movielens", "--data_dir", str(data)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0 and str(data) in out.stdout, out.stderr


@pytest.mark.dist
@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluation_subcommands(subcommand: str, tmp_path: Path) -> None:
    cli = run(
        [
            subcommand,
            "--config",
            str(REPO / "examples/configs/synthetic_dlrm.yaml"),
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.init_args.train_rows=1024",
            "--data.init_args.val_rows=700",
            "--data.init_args.batch_size=256",
        ]
    )
    if subcommand == "predict":
        predictions = cli.trainer.predict_loop.predictions
        assert sum(p["probability"].numel() for p in predictions) == 700
        assert all(((p["probability"] >= 0) & (p["probability"] <= 1)).all() for p in predictions)
    else:
        prefix = "val" if subcommand == "validate" else "test"
        assert {f"{prefix}/auroc", f"{prefix}/ne"} <= set(cli.trainer.callback_metrics)


def test_help_lists_every_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        run(["--help"])
    assert ended.value.code == 0
    printed = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "plan", "export", "prepare", "index"):
        assert re.search(rf"\b{command}\b", printed), command
    for command in ("plan", "export", "prepare", "index"):  # each answers its own --help
        with pytest.raises(SystemExit) as ended:
            run([command, "--help"])
        assert ended.value.code == 0 and f"lightning-rec {command}" in capsys.readouterr().out


@pytest.mark.dist
def test_without_a_logger_a_run_writes_no_config_file_and_runs_again_beside_the_user_s_config_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``logger: false`` and no ``default_root_dir``: Lightning would write ``./config.yaml`` (refusing the user's own
    ``config.yaml`` there, and every later run); nothing is written, and the same command runs twice."""
    config = yaml.safe_load((REPO / "examples" / "configs" / "synthetic_dlrm.yaml").read_text())
    config["trainer"].pop("default_root_dir")
    config["trainer"].update(logger=False, enable_checkpointing=False, max_steps=2, devices=1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        run(["fit", "--config", "config.yaml", "--trainer.limit_val_batches=0"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == config  # the user's file, untouched
