"""`lightning-rec plan`: a cluster's sharding plan made on this machine with the tables on `meta`, device presets,
the topology sweep, the does-not-fit explanation, and a plan file read back and checked against the run."""

from __future__ import annotations

import json
import resource
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

import lightning_rec
from lightning_rec._cli import run
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.files import check_plan, read_plan, to_sharding_plan
from lightning_rec._planner.fit import DoesNotFit
from lightning_rec._planner.offline import plan_cluster
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.sweep import sweep
from lightning_rec._planner.table import plan_rows
from lightning_rec._planner.topology import DEVICE_PRESETS, make_topology
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec.config import EmbeddingOptimizer, TopologyConfig
from tests.helpers.dist import run_ranks

REPO = Path(__file__).resolve().parents[1]
CRITEO = str(REPO / "examples/configs/criteo_dlrm.yaml")
SYNTHETIC = str(REPO / "examples/configs/synthetic_dlrm.yaml")
CRITEO_40M = [  # 26 tables x 40M rows x 128: 532 GB of fp32 weights
    "--data.init_args.num_embeddings=40000000",
    "--model.init_args.embedding_dim=128",
    "--model.init_args.dense_arch_layer_sizes=[512,256,128]",
]
_GB = 1024**3


class UserModel(L.LightningModule):
    """Written as a TorchRec user writes one: an EBC and an EC built with their own devices unset (so `meta` under
    the planner), pooled output read with `kt.values()`."""

    def __init__(self, rows: int = 1000, dim: int = 16) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=rows, feature_names=["u"]),
                EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=rows * 4, feature_names=["i"]),
                EmbeddingBagConfig(name="cat", embedding_dim=dim // 2, num_embeddings=50, feature_names=["c"]),
            ]
        )
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="hist", embedding_dim=dim, num_embeddings=rows, feature_names=["h"])]
        )
        self.head = torch.nn.Linear(dim * 2 + dim // 2, 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.head(self.ebc(kjt).values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def _meta(factory: Any) -> Any:
    with torch.device("meta"):
        return factory()


def test_plan_command_plans_a_criteo_sized_model_without_allocating_it(tmp_path: Path, capsys: Any) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run(["plan", "--config", CRITEO, *CRITEO_40M, "--hosts", "2", "--devices-per-host", "8", "--device", "h100",
         "--output", str(tmp_path)])  # fmt: skip
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grew < 2 * _GB, f"planning allocated {grew / _GB:.1f} GiB: the tables were not on meta"

    doc = json.loads((tmp_path / "plan.json").read_text())
    assert (doc["world_size"], doc["local_world_size"], doc["num_hosts"]) == (16, 8, 2)
    assert doc["device_type"] == "cuda" and doc["preset"] == "h100" and doc["estimates_available"] is True
    assert len(doc["tables"]) == 26
    for t in doc["tables"]:
        assert t["shape"] == [40_000_000, 128]
        covered = sum(s["sizes"][0] * s["sizes"][1] for s in t["shards"])
        assert covered == 40_000_000 * 128, f"{t['name']}: its shards do not cover the table"
        for s in t["shards"]:
            assert s["placement"] == f"rank:{s['rank']}/cuda:{s['rank'] % 8}"
    weights = 26 * 40_000_000 * 128 * 4
    hbm = sum(r["hbm_bytes"] for r in doc["ranks"])
    assert weights <= hbm, "every table's weights are in some rank's HBM estimate"
    assert all(r["hbm_bytes"] <= 80 * _GB for r in doc["ranks"]), "no rank exceeds an H100's 80 GiB"
    for r in doc["ranks"]:
        assert r["step_ms"] == pytest.approx(r["lookup_ms"] + r["input_dist_ms"] + r["output_dist_ms"])
        assert r["lookup_ms"] > 0 and r["input_dist_ms"] > 0 and r["output_dist_ms"] > 0
    assert doc["step_ms"] == max(r["step_ms"] for r in doc["ranks"])
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "plan for 2 x 8 h100" in out and "input a2a (ms)" in out and "calibration" in out


def test_presets_set_memory_and_bandwidth_and_explicit_numbers_override_them() -> None:
    h100 = make_topology(world_size=16, local_world_size=8, device_type="cuda", preset="h100")
    a100 = make_topology(world_size=16, local_world_size=8, device_type="cuda", preset="a100-40g")
    assert h100.devices[0].storage.hbm == 80 * _GB and a100.devices[0].storage.hbm == 40 * _GB
    assert h100.hbm_mem_bw > a100.hbm_mem_bw and h100.local_world_size == 8
    mine = make_topology(
        world_size=2, local_world_size=2, device_type="cuda", preset=DEVICE_PRESETS["h100"].with_memory(hbm_gb=24)
    )
    assert mine.devices[0].storage.hbm == 24 * _GB
    capped = make_topology(
        world_size=2, local_world_size=2, device_type="cuda", preset="h100", topology=TopologyConfig(hbm_cap=_GB)
    )
    assert capped.devices[0].storage.hbm == _GB, "the strategy's own hbm_cap wins over the preset"
    assert {"h100", "a100-80g", "a100-40g", "cpu"} <= set(DEVICE_PRESETS)
    with pytest.raises(ValueError, match=r"'h100' is a cuda device.*cpu"):
        make_topology(world_size=2, local_world_size=2, device_type="cpu", preset="h100")
    with pytest.raises(ValueError, match=r"unknown device preset 'v100'.*h100"):
        Cluster(preset="v100")
    # The planner sees them: the same tables need more ranks' worth of memory on a 40 GB card.
    model = _meta(lambda: UserModel(rows=20_000_000, dim=128))
    small = plan_cluster(model, ShardingConfig.from_arguments(), Cluster(1, 8, preset="a100-40g"))
    big = plan_cluster(model, ShardingConfig.from_arguments(), Cluster(1, 8, preset="h100"))
    assert small.preset == "a100-40g" and big.preset == "h100"
    assert big.step_ms < small.step_ms, "an H100's HBM and NVLink are faster than an A100's"


def test_plan_file_round_trips_to_the_same_sharding_plan(tmp_path: Path) -> None:
    model = _meta(UserModel)
    constraints = {
        "user": {"sharding_types": ["column_wise"], "min_partition": 8},
        "item": {"sharding_types": ["row_wise"]},
        "cat": {"sharding_types": ["data_parallel"]},
        "hist": {"sharding_types": ["table_wise"]},
    }
    sharder = ShardingConfig.from_arguments(constraints=constraints)
    for cluster in (Cluster(2, 2, "cuda"), Cluster(1, 2, "cpu")):
        report = plan_cluster(model, sharder, cluster)
        plan = sharder.plan  # None: planned here
        assert plan is None
        report.write_json(tmp_path / "plan.json")
        again = read_plan(tmp_path / "plan.json")
        rebuilt = to_sharding_plan(again)
        assert {t.sharding_type for t in report.tables} == {"column_wise", "row_wise", "data_parallel", "table_wise"}
        original = _replan(model, sharder, cluster)
        assert rebuilt == original, "the plan read back is the plan TorchRec made, field for field"
        assert again.to_dict() == report.to_dict()


def _replan(model: Any, sharder: ShardingConfig, cluster: Cluster) -> Any:
    from lightning_rec._planner.offline import planning_optimizer
    from lightning_rec._planner.planner import make_plan

    emb_opt, per_table = planning_optimizer(model, sharder, cluster.device_type)
    request = sharder.request(
        sharder.inventory(model),
        emb_opt,
        per_table,
        world_size=cluster.world_size,
        local_world_size=cluster.devices_per_host,
        device_type=cluster.device_type,
        preset=cluster.device(),
    )
    plan, _ = make_plan(model, request)
    return plan


def test_a_plan_for_another_run_is_refused_naming_the_mismatch(tmp_path: Path) -> None:
    model = _meta(UserModel)
    sharder = ShardingConfig.from_arguments()
    report = plan_cluster(model, sharder, Cluster(2, 2, "cuda"))
    kw: dict[str, Any] = dict(world_size=4, local_world_size=2, device_type="cuda")
    check_plan(report, model, sharder.module_types, **kw)  # the run it was made for

    def refused(match: str, module: Any = model, **over: Any) -> None:
        with pytest.raises(ValueError, match=match):
            check_plan(report, module, sharder.module_types, **{**kw, **over})

    refused(r"it is for 4 rank\(s\), this run has 2", world_size=2)
    refused(r"it puts 2 rank\(s\) on a host, this run 4", local_world_size=4)
    refused(r"it is for cuda, this run is on cpu", device_type="cpu")
    refused(r"table 'item' is \[4000, 16\] in the plan, \[8000, 16\] in the model", module=_meta(lambda: _resized()))
    wrapper = torch.nn.Module()
    wrapper.model = model
    refused(r"sit under 'ebc', 'ec' in the plan, under 'model.ebc', 'model.ec' in the model", module=wrapper)

    on_cpu = PlanReport.from_dict({**report.to_dict(), "device_type": "cpu"})
    for t in on_cpu.tables:
        if t.table == "user":
            t.compute_kernel = "fused_uvm_caching"
        if t.table == "hist":
            t.sharding_type = "data_parallel"
    with pytest.raises(ValueError, match=r"'user' uses the 'fused_uvm_caching' kernel, which cpu cannot train") as e:
        check_plan(on_cpu, model, sharder.module_types, **{**kw, "device_type": "cpu"})
    assert "table 'hist' is data_parallel, which cpu cannot train (it can: table_wise, column_wise, row_wise)" in str(
        e.value
    )

    bad = report.to_dict()
    bad["tables"] = [t for t in bad["tables"] if t["name"] != "cat"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"it has no table 'cat' \(of 'ebc'\), which the model has"):
        check_plan(read_plan(tmp_path / "bad.json"), model, sharder.module_types, **kw)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match=r"junk.json.*not a sharding plan.*world_size"):
        read_plan(tmp_path / "junk.json")
    with pytest.raises(ValueError, match=r"plan='.*missing.json'\): no such file.*lightning-rec plan"):
        lightning_rec.RecShardStrategy(plan=str(tmp_path / "missing.json"))


def _resized() -> UserModel:
    m = UserModel()
    m.ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="user", embedding_dim=16, num_embeddings=1000, feature_names=["u"]),
            EmbeddingBagConfig(name="item", embedding_dim=16, num_embeddings=8000, feature_names=["i"]),
            EmbeddingBagConfig(name="cat", embedding_dim=8, num_embeddings=50, feature_names=["c"]),
        ]
    )
    return m


def test_a_model_that_does_not_fit_names_its_tables_and_the_smallest_topology_that_holds_them() -> None:
    model = _meta(
        lambda: UserModel(rows=40_000_000, dim=128)
    )  # item: 160M x 128 = 76 GiB, as much again of Adagrad state
    sharder = ShardingConfig.from_arguments(
        constraints={"item": {"sharding_types": ["table_wise"]}}  # one rank must hold it whole
    )
    with pytest.raises(DoesNotFit) as caught:
        plan_cluster(model, sharder, Cluster(1, 2, preset="a100-40g", ddr_gb=1))
    err = caught.value
    assert list(err.needs)[0] == "item" and err.needs["item"] >= 160_000_000 * 128 * 4
    assert "item (152.6 GiB in its smallest shard) does not fit on any of these ranks" in str(err)  # + Adagrad state
    assert err.smallest_fit is None, "table-wise, no number of 40 GB cards holds it"

    free = ShardingConfig.from_arguments()
    with pytest.raises(DoesNotFit) as caught:
        plan_cluster(model, free, Cluster(1, 2, preset="a100-40g", ddr_gb=1))
    err = caught.value
    assert "item (76.3 GiB in its smallest shard)" in str(err), "row-wise over 2 ranks: half of it (and its state) each"
    fit = err.smallest_fit
    assert fit is not None and fit.devices_per_host == 2 and fit.hosts > 1
    plan_cluster(model, free, fit)  # the suggestion plans
    smaller = Cluster(fit.hosts // 2, 2, preset="a100-40g", ddr_gb=1)
    if smaller.hosts > 1:
        with pytest.raises(DoesNotFit):
            plan_cluster(model, free, smaller)
    assert f"{fit.describe()} ({fit.world_size} ranks)" in str(err)


def test_sweep_gives_one_row_per_topology_and_memory_per_rank_falls(tmp_path: Path, capsys: Any) -> None:
    run(["plan", "--config", CRITEO, "--data.init_args.num_embeddings=1000000", "--hosts", "1,2,4",
         "--devices-per-host", "2", "--device", "cpu", "--output", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["hosts"], r["world_size"]) for r in rows] == [(1, 2), (2, 4), (4, 8)]
    fits = [r for r in rows if r["fits"]]
    mem = [r["max_memory_bytes"] for r in fits]
    assert mem == sorted(mem, reverse=True) and mem[-1] < mem[0], "more ranks, less memory each"
    for r in fits:
        plan = json.loads((tmp_path / f"plan_{r['hosts']}x2.json").read_text())
        assert plan["world_size"] == r["world_size"] and plan["preset"] == "cpu"
        assert r["samples_per_s"] == pytest.approx(r["world_size"] * plan["batch_size"] / (plan["step_ms"] / 1000))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "samples/s" in out and "calibration" in out


def test_a_user_model_plans_with_the_optimizer_fit_would_derive() -> None:
    from lightning_rec._planner.offline import planning_optimizer

    model = _meta(UserModel)
    sharder = ShardingConfig.from_arguments()
    emb_opt, _ = planning_optimizer(model, sharder, "cpu")
    assert (emb_opt.name, emb_opt.lr) == ("adagrad", 0.1), "from configure_optimizers, called without a Trainer"

    class NeedsTrainer(UserModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.trainer.max_steps)  # no Trainer here

    notes: list = []
    emb_opt, _ = planning_optimizer(_meta(NeedsTrainer), sharder, "cpu", warn=notes.append)
    assert len(notes) == 1 and "did not run without a Trainer" in notes[0]
    rows = sweep(model, sharder, [Cluster(1, 1, "cpu"), Cluster(1, 2, "cpu")])
    assert [r.report is not None for r in rows] == [True, True]


@pytest.mark.dist
def test_plan_made_here_is_the_plan_fit_makes_and_fit_trains_with_it(tmp_path: Path) -> None:
    run(["plan", "--config", SYNTHETIC, "--hosts", "1", "--devices-per-host", "2", "--device-type", "cpu",
         "--output", str(tmp_path / "plan")])  # fmt: skip
    plan_file = tmp_path / "plan" / "plan.json"
    res = run_ranks(fit_config, 2, tmp_path / "runs", config=SYNTHETIC, plan=str(plan_file))
    assert all(r["planned_equals_file"] for r in res), "the plan fit computed is the one `plan` wrote"
    assert res[0]["planned_types"] == {
        t["name"]: t["sharding_type"] for t in json.loads(plan_file.read_text())["tables"]
    }
    for r in res:
        assert r["with_plan"]["losses"] == r["planned"]["losses"], "same plan, same seed: the same numbers"
        assert r["with_plan"]["losses"] and r["refused"].startswith("RecShardStrategy: the given plan does not fit")
        assert "it is for 4 rank(s), this run has 2; it puts 4 rank(s) on a host, this run 2" in r["refused"]
        assert r["mine"]["types"]["t_country"] == "table_wise", "a plan the planner would not make is used as given"
        assert len(r["mine"]["losses"]) == 3 and all(0 < x < 10 for x in r["mine"]["losses"]), "and trains"
    assert res[0]["mine"]["country_weights_here"] == [], "t_country is not on rank 0"
    assert res[1]["mine"]["country_weights_here"] == [[200, 16]], "t_country lives whole on rank 1"


def test_the_fused_optimizers_state_is_in_the_memory_estimate_and_planning_leaves_no_mark() -> None:
    model = _meta(lambda: UserModel(rows=100_000, dim=64))  # tables dominate the io buffers
    sharder = ShardingConfig.from_arguments(
        constraints={t: {"sharding_types": ["table_wise"]} for t in ("user", "item", "cat", "hist")}
    )

    def memory(name: str) -> int:
        report = plan_cluster(model, sharder, Cluster(1, 2, "cpu"), optimizer=(EmbeddingOptimizer(name, lr=0.1), None))
        return sum(r.memory_bytes for r in report.ranks)

    sgd, adam, rowwise = memory("sgd"), memory("adam"), memory("rowwise_adagrad")
    weights = sum(
        p.numel() * 4 for n, p in model.named_parameters() if "weight" in n and p.dim() == 2 and p.shape[0] >= 50
    )
    assert adam - sgd == pytest.approx(2 * weights, rel=0.01), "Adam: two more copies of every table"
    rows = 100_000 + 400_000 + 50 + 100_000
    assert rowwise - sgd == pytest.approx(rows * 4, rel=0.01), "row-wise Adagrad: one float per row"
    assert all("_optimizer_classes" not in p.__dict__ for p in model.parameters()), "restored after planning"


def test_device_flags_name_a_type_or_a_preset(tmp_path: Path) -> None:
    for flags, (device_type, preset) in {
        ("--device-type", "a100-40g"): ("cuda", "a100-40g"),
        ("--preset", "h100"): ("cuda", "h100"),
        ("--device", "cpu"): ("cpu", "cpu"),
        ("--device-type", "cpu"): ("cpu", None),
    }.items():
        out = tmp_path / "_".join(flags)
        run(["plan", "--config", SYNTHETIC, *flags, "--output", str(out)])
        doc = json.loads((out / "plan.json").read_text())
        assert (doc["device_type"], doc["preset"], doc["world_size"]) == (device_type, preset, 2), flags
    with pytest.raises(SystemExit):
        run(["plan", "--config", SYNTHETIC, "--device-type", "h100", "--device", "a100-40g"])


def test_without_torchrecs_topology_factory_the_same_topology_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec.distributed.planner.types as planner_types

    def described() -> tuple:
        t = make_topology(world_size=16, local_world_size=8, device_type="cuda", preset="a100-40g")
        bw = t.comms_bandwidths
        return (
            t.devices[0].storage,
            t.local_world_size,
            t.hbm_mem_bw,
            t.ddr_mem_bw,
            bw.intra_host_bw,
            bw.inter_host_bw,
        )

    factory = described()
    monkeypatch.delattr(planner_types, "TopologyFactory")  # as in TorchRec 1.6 (the GPU machine's)
    assert described() == factory


def test_torchrecs_own_test_model_plans_and_its_plan_file_checks_against_it(tmp_path: Path) -> None:
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    tables = [
        EmbeddingBagConfig(name=f"table_{i}", embedding_dim=16, num_embeddings=100, feature_names=[f"feature_{i}"])
        for i in range(4)
    ]
    weighted = [EmbeddingBagConfig(name="weighted", embedding_dim=8, num_embeddings=50, feature_names=["wf"])]
    model = TestSparseNN(
        tables=tables, weighted_tables=weighted, num_float_features=16, sparse_device=torch.device("meta")
    )
    sharder = ShardingConfig.from_arguments()
    report = plan_cluster(model, sharder, Cluster(1, 2, "cpu"), optimizer=(EmbeddingOptimizer("adagrad", lr=0.1), None))
    assert sorted((t.module, t.table) for t in report.tables) == sorted(
        [("sparse.ebc", f"table_{i}") for i in range(4)] + [("sparse.weighted_ebc", "weighted")]
    )
    report.write_json(tmp_path / "plan.json")
    check_plan(read_plan(tmp_path / "plan.json"), model, sharder.module_types, world_size=2, local_world_size=2,
               device_type="cpu")  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module): `fit` from a config, with and without the plan
# `lightning-rec plan` wrote.
# ------------------------------------------------------------------------------------------------------------


def _fit(config: str, out_dir: Path, steps: int, plan: Any = None) -> Any:
    args = [
        "fit", "--config", config, "--trainer.devices=2", f"--trainer.max_steps={steps}", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out_dir}", "--data.init_args.train_rows=4096", "--data.init_args.val_rows=512",
        # the config says `strategy: recshard`: the README's override names the argument alone
        *([f"--trainer.strategy.init_args.plan={plan}"] if plan else []),
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(args + ["--trainer.callbacks+=tests.test_planning.LossRecorder"])


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
