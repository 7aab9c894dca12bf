"""Ranks of tests/test_planning.py: `fit` from a config, with and without the plan `lightning-rec plan` wrote."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L


def _fit(config: str, out_dir: Path, steps: int, plan: Any = None) -> Any:
    from lightning_rec._cli import run

    args = [
        "fit", "--config", config, "--trainer.devices=2", f"--trainer.max_steps={steps}", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out_dir}", "--data.init_args.train_rows=4096", "--data.init_args.val_rows=512",
        # the config says `strategy: recshard`: the README's override names the argument alone
        *([f"--trainer.strategy.init_args.plan={plan}"] if plan else []),
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(args + ["--trainer.callbacks+=tests.helpers.planning_scenarios.LossRecorder"])


class LossRecorder(L.Callback):
    """Every training loss, as a float (read after fit)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _losses(cli: Any) -> list[float]:
    return next(c.losses for c in cli.trainer.callbacks if isinstance(c, LossRecorder))


def fit_config(rank: int, world_size: int, out_dir: Path, config: str, plan: str, steps: int = 3) -> dict[str, Any]:
    """Fit ``config`` on 2 ranks three times: the planner's plan, then ``plan`` (the file), then a plan for another
    world size (refused before anything is sharded)."""
    from lightning_rec._strategy.plan_file import read_plan, to_sharding_plan
    from lightning_rec._strategy.plan_report import plan_rows

    planned = _fit(config, out_dir / "planned", steps)
    from_file = to_sharding_plan(read_plan(plan))
    with_plan = _fit(config, out_dir / "with_plan", steps, plan)

    # A plan the planner would not make: t_country whole on rank 1. The run must shard with it.
    mine = json.loads(Path(plan).read_text())
    country = next(t for t in mine["tables"] if t["name"] == "t_country")
    country.update(
        sharding_type="table_wise",
        compute_kernel="fused",
        ranks=[1],
        shards=[{"rank": 1, "sizes": country["shape"], "offsets": [0, 0], "placement": "rank:1/cpu"}],
    )
    mine_path = out_dir / f"mine_{rank}.json"
    mine_path.write_text(json.dumps(mine))
    with_mine = _fit(config, out_dir / "mine", steps, str(mine_path))
    local = [
        list(shard.tensor.shape)
        for key, value in with_mine.trainer.strategy.model.state_dict().items()
        if "t_country" in key and hasattr(value, "local_shards")
        for shard in value.local_shards()
    ]

    other = json.loads(Path(plan).read_text())
    other["world_size"], other["local_world_size"] = 4, 4
    other_path = out_dir / f"other_{rank}.json"
    other_path.write_text(json.dumps(other))
    refused = ""
    try:
        _fit(config, out_dir / "refused", steps, str(other_path))
    except ValueError as err:
        refused = str(err)
    # The plan as each rank got it before sharding (TorchRec's grid-shard sharder later rewrites its own entries of
    # the plan object to table_row_wise on rank 1), then rebuilt from the file.
    planned_plan = to_sharding_plan(planned.trainer.strategy.plan_report)
    return {
        "planned_equals_file": planned_plan == from_file,
        "planned_types": {r.table: r.sharding_type for r in plan_rows(planned_plan)},
        "planned": {"losses": _losses(planned)},
        "with_plan": {"losses": _losses(with_plan)},
        "mine": {
            "types": {r.table: r.sharding_type for r in plan_rows(with_mine.trainer.strategy.sharding_plan)},
            "losses": _losses(with_mine),
            "country_weights_here": local,
        },
        "refused": refused,
    }
