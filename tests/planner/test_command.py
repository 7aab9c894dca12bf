"""lightning_rec._planner.command: ``lightning-rec plan``'s work, the flags typed (no CLI, no subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_rec._planner.command import PlanOptions, calibration_note, run_plan, sharding_of
from lightning_rec._strategy.recshard import RecShardStrategy
from lightning_rec._strategy.sharding_config import ShardingConfig
from tests.planner.tables import Tiny


def test_the_flags_fill_in_from_the_trainer_config() -> None:
    clusters = PlanOptions().clusters({"num_nodes": 2, "devices": 4, "accelerator": "cpu"})
    assert [(c.hosts, c.devices_per_host, c.device_type) for c in clusters] == [(2, 4, "cpu")]
    swept = PlanOptions(hosts=[1, 2], devices_per_host=[8], device_type="a100-40g").clusters({})
    assert [c.describe() for c in swept] == ["1 x 8 a100-40g", "2 x 8 a100-40g"]
    with pytest.raises(ValueError, match="--device-type h100 and --device cpu name two devices"):
        PlanOptions(device_type="h100", device="cpu")


def test_the_configs_strategy_gives_the_sharding_or_recshards_defaults() -> None:
    strategy = RecShardStrategy(constraints={"user": {"sharding_types": ["table_wise"]}})
    assert sharding_of({"strategy": strategy}) is strategy.sharding
    notes: list[str] = []
    assert isinstance(sharding_of({"strategy": "ddp"}, say=notes.append), ShardingConfig)
    assert notes == ["note: the config's strategy is 'ddp', not recshard; planning with recshard's defaults."]
    assert "--device cpu" in calibration_note("cpu", None) and "cpu preset" in calibration_note("cpu", "cpu")


def test_one_cluster_is_printed_and_written_a_sweep_too(tmp_path: Path) -> None:
    said: list[str] = []
    sharding = ShardingConfig.from_arguments()
    run_plan(Tiny(), sharding, PlanOptions(device="cpu").clusters({"devices": 2}), str(tmp_path / "one"), said.append)
    assert said[0].startswith("plan for 1 x 2 cpu: 2 rank(s), 2 per host, cpu, preset cpu, batch 512 per rank")
    assert json.loads((tmp_path / "one" / "plan.json").read_text())["world_size"] == 2
    assert (tmp_path / "one" / "plan.png").exists() and "--trainer.strategy.init_args.plan=" in said[-1]
    said.clear()
    run_plan(
        Tiny(), sharding, PlanOptions(hosts=[1, 2], device="cpu").clusters({}), str(tmp_path / "many"), said.append
    )
    assert [r["world_size"] for r in json.loads((tmp_path / "many" / "sweep.json").read_text())] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "many").glob("plan_*.json")) == ["plan_1x1.json", "plan_2x1.json"]
