"""Managed-collision ("zero-collision hashing") tables under recshard, against TorchRec by hand.

The module is built as TorchRec's ZCH tests build it (``TestEBCSparseArchZCH``'s sort-based branch): a
``ManagedCollisionEmbeddingBagCollection`` over an ``EmbeddingBagCollection`` and a ``ManagedCollisionCollection`` of
``MCHManagedCollisionModule(..., eviction_policy=DistanceLFU_EvictionPolicy(), buckets=2)``; tables on CPU with rows
of their own; raw ids from a space 15x the table.

TorchRec shards such a table row-wise, each rank owning a block of the raw id space and of the rows (its own slots
and its own miss row), so on 2 ranks it does not compute what the unsharded module computes; the reference there is
TorchRec's own sharded training, written by hand (planner, ``ManagedCollisionEmbeddingBagCollectionSharder``, DMP,
``CombinedOptimizer``) on the same ranks and batches. On 1 rank the reference is the unsharded module.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

import lightning_rec
from lightning_rec import RecShardStrategy
from lightning_rec.errors import InputError
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks

HASH_SIZE = 960  # raw ids: [0, 960), split in 2 buckets of 480
ROWS = 64
LR = 0.1
TOL = 1e-5
FEATURES = ("f0", "f1")
ROW_WISE = {f"t_{f}": {"sharding_types": ["row_wise"]} for f in FEATURES}


def _managed_collision(pooled: bool, eviction_interval: int, hash_size: int = HASH_SIZE, buckets: int = 2) -> nn.Module:
    """A ``ManagedCollisionEmbeddingBagCollection`` (``pooled``) or ``...EmbeddingCollection`` of one table a
    feature, on CPU, as TorchRec's ZCH test arch builds it."""
    config = EmbeddingBagConfig if pooled else EmbeddingConfig
    # A row freed by eviction is refilled by its table's init_fn: a constant one keeps runs comparable.
    tables = [
        config(
            name=f"t_{f}",
            embedding_dim=8,
            num_embeddings=ROWS,
            feature_names=[f],
            init_fn=functools.partial(nn.init.constant_, val=0.05),
        )
        for f in FEATURES
    ]
    cpu = torch.device("cpu")
    collisions = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                zch_size=ROWS,
                device=cpu,
                input_hash_size=hash_size,
                eviction_interval=eviction_interval,
                eviction_policy=DistanceLFU_EvictionPolicy(),
                buckets=buckets,
            )
            for t in tables
        },
        embedding_configs=tables,
    )
    if pooled:
        return ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=cpu), collisions, return_remapped_features=True
        )
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=tables, device=cpu), collisions, return_remapped_features=True
    )


class ZchModel(lightning_rec.RecLightningModule):
    """Pooled managed-collision embeddings of two features into a linear layer; records losses and remapped ids."""

    def __init__(self, seed: int = 0, eviction_interval: int = 2, **mc: Any) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mc_ebc = _managed_collision(True, eviction_interval, **mc)
        with torch.no_grad():
            for p in self.mc_ebc.parameters():
                p.copy_(torch.randn(p.shape) * 0.3)
        self.over = nn.Linear(8 * len(FEATURES), 1)
        self.losses: list[float] = []
        self.remapped: list[dict[str, list[int]]] = []
        self.validated: list[float] = []

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        kt, remapped = self.mc_ebc(kjt)
        return self.over(kt.values()).squeeze(1), remapped

    def training_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        kjt, label = batch
        logits, remapped = self(kjt)
        loss = F.binary_cross_entropy_with_logits(logits, label)
        self.losses.append(float(loss.detach()))
        self.remapped.append({f: remapped[f].values().tolist() for f in FEATURES})
        return loss

    def predict_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])[0]

    def validation_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> None:
        self.validated += self(batch[0])[0].tolist()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _batches(rank: int, steps: int, size: int = 8, seed: int = 0) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """``steps`` batches of this rank: 1-3 raw ids per feature and sample, a few ids shared by every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (len(FEATURES) * size,), generator=g)
        values = torch.randint(0, HASH_SIZE, (int(lengths.sum()),), generator=g)
        values[:4] = torch.tensor([5, 600, 17, 959])  # the same raw ids on every rank
        kjt = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, lengths)
        out.append((kjt, torch.randint(0, 2, (size,), generator=g).float()))
    return out


def _trainer(world_size: int, steps: int = 1, **strategy: Any) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(**strategy),
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        **QUIET_TRAINER,
    )


def _torchrec_by_hand(rank: int, steps: int, eviction_interval: int) -> dict[str, Any]:
    """TorchRec's own sharded training of the same model, rows and batches, on the ranks already started."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.types import ShardedTensor

    from lightning_rec.testing.reference import reference_dmp, reference_optimizer

    class RowWiseOnCpu(EmbeddingBagCollectionSharder):  # TorchRec lists row-wise for CUDA only
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return super().sharding_types("cuda")

    model = ZchModel(eviction_interval=eviction_interval)
    rows = {k: v.clone() for k, v in model.state_dict().items() if "_embedding_module" in k}
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        ebc_sharder=RowWiseOnCpu(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}),
        mc_sharder=ManagedCollisionCollectionSharder(),
    )
    constraints = {t: {"sharding_types": ["row_wise"], "compute_kernels": ["fused"]} for t in ROW_WISE}
    dmp = reference_dmp(model, [sharder], torch.device("cpu"), constraints)
    with torch.no_grad():  # the rows the module was built with (TorchRec's sharders draw new ones)
        for key, t in dmp.state_dict().items():
            if key in rows and isinstance(t, ShardedTensor):
                for shard in t.local_shards():
                    (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(rows[key][r : r + n, c : c + m])
    optimizer = reference_optimizer(dmp, lambda ps: torch.optim.SGD(ps, lr=LR))
    losses, remapped = [], []
    for kjt, label in _batches(rank, steps):
        optimizer.zero_grad()
        logits, ids = dmp(kjt)
        loss = F.binary_cross_entropy_with_logits(logits, label)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        remapped.append({f: ids[f].values().tolist() for f in FEATURES})
    dist.barrier()
    return {"ref_losses": losses, "ref_remapped": remapped}


def _collision_state(module: nn.Module) -> dict[str, Any]:
    """Each collision buffer of this rank: (global row offset, values), ShardedTensor or whole."""
    from lightning_rec import _compat

    out = {}
    for key, t in module.state_dict().items():
        if "_mch_" not in key:
            continue
        if isinstance(t, _compat.ShardedTensor):
            out[key] = [(s.metadata.shard_offsets[0], s.tensor.tolist()) for s in t.local_shards()]
        else:
            out[key] = [(0, t.tolist())]
    return out


def fit(
    rank: int,
    world_size: int,
    out_dir: Path,
    steps: int = 4,
    eviction_interval: int = 2,
    save: str = "",
    sharders: Any = None,
) -> dict[str, Any]:
    """TorchRec by hand on these ranks, then recshard on the same rows and batches."""
    import torch.distributed as dist

    result: dict[str, Any] = {}
    if world_size > 1:
        dist.init_process_group("gloo")  # recshard joins this process group
        result = _torchrec_by_hand(rank, steps, eviction_interval)
    model = ZchModel(eviction_interval=eviction_interval)
    unsharded = copy.deepcopy(model) if world_size == 1 else None
    trainer = _trainer(world_size, steps, sharders=sharders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_batches(rank, steps), batch_size=None))
    if save:
        trainer.save_checkpoint(out_dir / save)
    if unsharded is not None:  # one rank: the unsharded module, trained by plain PyTorch
        optimizer = torch.optim.SGD(unsharded.parameters(), lr=LR)
        for kjt, label in _batches(rank, steps):
            optimizer.zero_grad()
            logits, ids = unsharded(kjt)
            loss = F.binary_cross_entropy_with_logits(logits, label)
            loss.backward()
            optimizer.step()
            result.setdefault("ref_losses", []).append(float(loss))
            result.setdefault("ref_remapped", []).append({f: ids[f].values().tolist() for f in FEATURES})
    plan = {t: s.sharding_type for m in trainer.strategy.sharding_plan.plan.values() for t, s in m.items()}
    return {
        **result,
        "losses": model.losses,
        "remapped": model.remapped,
        "raw": [{f: kjt[f].values().tolist() for f in FEATURES} for kjt, _ in _batches(rank, steps)],
        "plan": plan,
        "state": _collision_state(model),
    }


def restore(rank: int, world_size: int, out_dir: Path, ckpt: str) -> dict[str, Any]:
    """A fresh model (no ids seen) loads a checkpoint with ``trainer.validate``-free loading: ``fit`` for 0 steps."""
    model = ZchModel(seed=99)
    trainer = _trainer(world_size, steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_batches(rank, 1), batch_size=None), ckpt_path=ckpt)
    return {"state": _collision_state(model)}


def _assembled(results: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every collision buffer whole, from each rank's row blocks."""
    out: dict[str, list[Any]] = {}
    for key in results[0]["state"]:
        blocks = sorted(block for r in results for block in r["state"][key])
        out[key] = [x for _, values in blocks for x in values]
    return out


def _by_raw_id(state: dict[str, list[Any]]) -> dict[str, dict[int, tuple[int, ...]]]:
    """Per table: raw id -> (its row, its count, its last access), for the slots that hold an id."""
    out = {}
    for f in FEATURES:
        prefix = next(k for k in state if f".t_{f}._mch_sorted_raw_ids" in k).rsplit(".", 1)[0]
        raw = state[f"{prefix}._mch_sorted_raw_ids"]
        columns = [
            state[f"{prefix}.{n}"] for n in ("_mch_remapped_ids_mapping", "_mch_counts", "_mch_last_access_iter")
        ]
        out[f] = {x: tuple(c[i] for c in columns) for i, x in enumerate(raw) if x != torch.iinfo(torch.int64).max}
    return out


@pytest.mark.dist
def test_managed_collision_tables_train_as_torchrec_trains_them_and_every_rank_remaps_alike(tmp_path):
    results = run_ranks(fit, 2, tmp_path, steps=4, save="ckpt")
    for rank, r in enumerate(results):
        assert set(r["plan"].values()) == {"row_wise"}
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=TOL), rank
        assert r["remapped"] == r["ref_remapped"], rank
    # Every rank remaps a raw id to the same row (ids seen by both ranks included), within the table.
    seen: dict[tuple[int, str, int], int] = {}
    for r in results:
        for step, (raw, ids) in enumerate(zip(r["raw"], r["remapped"])):
            for f in FEATURES:
                assert all(0 <= i < ROWS for i in ids[f])
                for x, i in zip(raw[f], ids[f]):
                    assert seen.setdefault((step, f, x), i) == i, (step, f, x)
    shared = [(s, f, x) for (s, f, x) in seen if x in (5, 600, 17, 959)]
    assert len(shared) >= 8  # the ids both ranks sent
    misses = (ROWS // 2 - 1, ROWS - 1)  # each shard's last row takes the ids it has no slot for
    assert sum(i not in misses for (s, f, x), i in seen.items() if s == 3) >= 10  # evictions admitted ids

    # The collision state (sorted raw ids, their rows, counts, last access) is saved and restored 2 -> 1: the same
    # slots, sorted as one table (what the module computes from them: test_a_reshard_keeps_what_...).
    saved = _assembled(results)
    assert any(v != saved[k][:1] * len(v) for k, v in saved.items())  # the state is not its initial fill
    (one,) = run_ranks(restore, 1, tmp_path / "to1", ckpt=str(tmp_path / "ckpt"))
    assert _by_raw_id(_assembled([one])) == _by_raw_id(saved)

    # load_from_checkpoint in this (non-distributed) process: the unsharded module with the trained collision state.
    # (Its load hook re-sorts the buffers of the one bucket layout; what each raw id maps to is what was saved.)
    loaded = ZchModel.load_from_checkpoint(tmp_path / "ckpt")
    assert all(_by_raw_id(saved).values())
    assert _by_raw_id(_assembled([{"state": _collision_state(loaded)}])) == _by_raw_id(saved)
    # Serving the collision state (TorchScript and .pt2, 1 and 2 ranks): tests/test_serving_collisions.py.


def test_on_one_rank_managed_collision_trains_like_the_unsharded_module(tmp_path):
    result = fit(0, 1, tmp_path, steps=4, eviction_interval=1000)  # no eviction: the unsharded module never evicts
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
    assert result["remapped"] == result["ref_remapped"]


def test_torchrecs_own_managed_collision_sharder_passed_in_trains_as_the_built_in_one(tmp_path):
    """TorchRec's sharder lists row-wise for CUDA only and UVM kernels on CPU; passed in, its copy runs here too."""
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    passed = fit(0, 1, tmp_path / "passed", steps=3, eviction_interval=1000, sharders=[sharder])
    built_in = fit(0, 1, tmp_path / "built_in", steps=3, eviction_interval=1000)
    assert passed["losses"] == built_in["losses"] and passed["remapped"] == built_in["remapped"]
    assert passed["losses"] == pytest.approx(passed["ref_losses"], abs=TOL)
    assert type(sharder) is ManagedCollisionEmbeddingBagCollectionSharder  # the user's object is left as it was


def test_raw_ids_are_checked_against_the_hash_space_not_the_table(tmp_path):
    kjt, label = _batches(0, 1)[0]
    values = kjt.values().clone()
    values[3] = HASH_SIZE + 7  # inside no bucket: TorchRec would route it to a rank by `id % world_size`
    bad = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), values, kjt.lengths())
    with pytest.raises(
        InputError,
        match=rf"raw ids below input_hash_size {HASH_SIZE}\) has 1 id\(s\) outside "
        rf"\[0, {HASH_SIZE}\): {HASH_SIZE + 7}.*managed-collision module remaps raw ids",
    ):
        _trainer(1).fit(ZchModel(), DataLoader([(bad, label)], batch_size=None))
    # Raw ids far above the table's rows are what it takes.
    assert int(kjt.values().max()) >= ROWS


@pytest.mark.parametrize(
    ("kwargs", "constraints", "message"),
    [
        ({"buckets": 3}, None, r"buckets=3, which does not split over 2 ranks; build it with buckets=2"),
        ({}, {"t_f0": {"sharding_types": ["table_wise"]}}, r"'t_f0'.*shards row_wise only \(asked: \['table_wise'\]\)"),
    ],
)
def test_managed_collision_tables_torchrec_cannot_shard_are_refused_before_planning(kwargs, constraints, message):
    from lightning_rec._planner.devices import check_managed_collision
    from lightning_rec._tables import TABLE_MODULE_TYPES
    from lightning_rec.config import TableConstraints

    model = ZchModel(**kwargs)
    typed = {t: TableConstraints(**c) for t, c in (constraints or {}).items()}
    with pytest.raises(ValueError, match=message):
        check_managed_collision(model, TABLE_MODULE_TYPES, typed, world_size=2, device_type="cpu")
    with pytest.warns(UserWarning, match=r"keep the default input_hash_size"):
        check_managed_collision(ZchModel(hash_size=2**63 - 1), TABLE_MODULE_TYPES, {}, world_size=2, device_type="cpu")


def test_torchrecs_own_zch_test_model_trains_and_its_single_bucket_is_refused_on_two_ranks(tmp_path):
    """``TestSparseNN(zch_kwargs=...)``: TorchRec's ZCH test arch (managed-collision EBCs on meta, one bucket)."""
    from types import SimpleNamespace

    from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN

    from lightning_rec._planner.devices import check_managed_collision
    from lightning_rec._tables import TABLE_MODULE_TYPES
    from tests.strategy.test_torchrec_models import TorchRecModel

    tables = [
        EmbeddingBagConfig(name=f"table_{i}", embedding_dim=8, num_embeddings=32, feature_names=[f"feature_{i}"])
        for i in range(2)
    ]
    # (Its forward needs weighted tables too: it unpacks the weighted module's output unconditionally.)
    weighted = [EmbeddingBagConfig(name="weighted", embedding_dim=8, num_embeddings=32, feature_names=["wf"])]
    zch = {t.name: SimpleNamespace(mc_type="sort-zch", input_hash_size=4000) for t in tables + weighted}
    model = TestSparseNN(
        tables=tables,
        weighted_tables=weighted,
        num_float_features=16,
        dense_device=torch.device("cpu"),
        zch_kwargs=zch,
    )
    with pytest.raises(ValueError, match=r"'table_0' \(sparse.ebc\): its collision module has buckets=1"):
        check_managed_collision(model, TABLE_MODULE_TYPES, {}, world_size=2, device_type="cpu")
    inputs = [
        ModelInput.generate(4, 1, 16, tables, weighted, random_seed=s)[1][0] for s in range(3)
    ]  # ids below the 32 rows: raw ids well inside the hash space
    module = TorchRecModel(model)
    trainer = _trainer(1, 3)
    trainer.fit(module, DataLoader(inputs, batch_size=None))
    plan = trainer.strategy.sharding_plan.get_plan_for_module("model.sparse.ebc")
    assert {t: p.sharding_type for t, p in plan.items()} == {"table_0": "row_wise", "table_1": "row_wise"}
    assert trainer.strategy.sharding_plan.get_plan_for_module("model.sparse.weighted_ebc")[
        "weighted"
    ].sharding_type == ("row_wise")
    assert len(module.losses) == 3 and all(0 < loss < 10 for loss in module.losses)


class SequenceZchModel(lightning_rec.RecLightningModule):
    """A ``ManagedCollisionEmbeddingCollection`` (unpooled): every id's embedding, summed per feature, into a loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mc_ec = _managed_collision(False, eviction_interval=1)
        self.losses: list[float] = []
        self.remapped: list[dict[str, list[int]]] = []

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, remapped = self.mc_ec(kjt)
        self.remapped.append({f: remapped[f].values().tolist() for f in FEATURES})
        return sum((out[f].values().sum(0) ** 2).sum() for f in FEATURES)

    def training_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_a_managed_collision_embedding_collection_trains_like_the_unsharded_module_on_one_rank(tmp_path):
    model = SequenceZchModel()
    unsharded = copy.deepcopy(model)
    batches = _batches(0, 4)
    trainer = _trainer(1, 4)
    trainer.fit(model, DataLoader(batches, batch_size=None))
    plan = trainer.strategy.sharding_plan.get_plan_for_module("mc_ec")
    assert {t: p.sharding_type for t, p in plan.items()} == {f"t_{f}": "row_wise" for f in FEATURES}
    optimizer = torch.optim.SGD(unsharded.parameters(), lr=LR)
    expected = []
    for kjt, _ in batches:
        optimizer.zero_grad()
        loss = unsharded(kjt)
        loss.backward()
        optimizer.step()
        expected.append(float(loss))
    assert model.losses == pytest.approx(expected, rel=1e-5)
    assert model.remapped == unsharded.remapped
    assert any(i != ROWS - 1 for step in model.remapped[1:] for ids in step.values() for i in ids)  # ids admitted


def test_pretrained_rows_reach_a_managed_collision_table():
    from lightning_rec._pretrained import load_rows

    model = ZchModel()
    load_rows(model, {"t_f0": torch.full((ROWS, 8), 0.5)})
    (weight,) = [p for n, p in model.named_parameters() if n.endswith("embedding_bags.t_f0.weight")]
    assert torch.equal(weight.detach(), torch.full((ROWS, 8), 0.5))


def test_pipelining_a_managed_collision_module_is_refused_before_anything_is_sharded():
    model = ZchModel()
    with pytest.raises(
        ValueError,
        match=r"pipeline=True\) does not pipeline ManagedCollisionEmbeddingBagCollection "
        r"\('mc_ebc'\) yet.*HINT: train this model with `pipeline=False`",
    ):
        _trainer(1, 1, pipeline=True).fit(model, DataLoader(_batches(0, 1), batch_size=None))
    assert not model.losses and not any(p.is_meta for p in model.parameters())


# Resharding a trained collision table, checked on what the model computes: a probe of raw ids the tables hold.
PROBE = 8


def _probe(state: dict[str, list[Any]]) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """``PROBE`` samples of one raw id a feature, each an id the table holds, from both halves of the id space."""
    values = []
    for f in FEATURES:
        held = sorted(_by_raw_id(state)[f])
        halves = [[x for x in held if x < HASH_SIZE // 2], [x for x in held if x >= HASH_SIZE // 2]]
        assert all(halves), halves  # ids from both ranks' buckets
        values += [halves[k % 2][(k // 2) % len(halves[k % 2])] for k in range(PROBE)]
    lengths = torch.ones(len(FEATURES) * PROBE, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(list(FEATURES), torch.tensor(values), lengths), torch.zeros(PROBE)


def _predict(trainer: L.Trainer, model: nn.Module, probe: Any, ckpt: str | None = None) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (logits,) = trainer.predict(model, DataLoader([probe], batch_size=None), ckpt_path=ckpt)
    return logits.tolist()


def train_and_predict(rank: int, world_size: int, out_dir: Path, steps: int, save: str) -> dict[str, Any]:
    """Train (evicting), save, then predict on a probe of held ids (the same on every rank) in the same job."""
    import torch.distributed as dist

    model = ZchModel()
    trainer = _trainer(world_size, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_batches(rank, steps), batch_size=None))
    trainer.save_checkpoint(out_dir / save)
    states: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(states, {"state": _collision_state(model)})
    else:
        states = [{"state": _collision_state(model)}]
    state = _assembled(states)
    probe = _probe(state)
    return {"state": state, "logits": _predict(_trainer(world_size), model, probe)}


def reload(
    rank: int, world_size: int, out_dir: Path, ckpt: str, state: dict[str, list[Any]], refused: str = ""
) -> dict[str, Any]:
    """A fresh model loads ``ckpt`` through ``Trainer.predict/validate/fit(ckpt_path=...)`` and predicts the probe;
    then it is asked to load ``refused``."""
    probe = _probe(state)
    out: dict[str, Any] = {"predict": _predict(_trainer(world_size), ZchModel(seed=99), probe, ckpt)}
    if refused:
        from lightning_rec.errors import CheckpointError

        model = ZchModel(seed=99)
        try:
            _predict(_trainer(world_size), model, probe, refused)
        except CheckpointError as err:
            out["refusal"] = str(err)
        fresh = ZchModel(seed=99)
        out["untouched"] = all(
            x == torch.iinfo(torch.int64).max
            for k, v in _assembled([{"state": _collision_state(model)}]).items()
            if k.endswith("_mch_sorted_raw_ids")
            for x in v
        ) and torch.equal(model.over.weight, fresh.over.weight)
    if world_size == 1:
        validated = ZchModel(seed=99)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(1).validate(validated, DataLoader([probe], batch_size=None), ckpt_path=ckpt)
        out["validate"] = validated.validated
        # fit from the checkpoint for no further step, save it again (then read back on 2 ranks), predict
        fitted = ZchModel(seed=99)
        trainer = _trainer(1, steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(fitted, DataLoader(_batches(rank, 1), batch_size=None), ckpt_path=ckpt)
        trainer.save_checkpoint(out_dir / "refit")
        out["fit"] = _predict(_trainer(1), fitted, probe)
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 ranks train and save; 1 rank loads that (predict, validate, fit) and saves it again; 1 rank trains a table
    of its own."""
    out = tmp_path_factory.mktemp("mc_reshard")
    saved = run_ranks(train_and_predict, 2, out, steps=4, save="ckpt")
    (one,) = run_ranks(reload, 1, out / "to1", ckpt=str(out / "ckpt"), state=saved[0]["state"])
    (single,) = run_ranks(train_and_predict, 1, out / "one", steps=4, save="ckpt")
    return {"out": out, "saved": saved, "one": one, "single": single}


@pytest.fixture(scope="module")
def back_on_two(resharded: dict[str, Any]) -> list[dict[str, Any]]:
    """2 ranks load the 1-rank save of the 2-rank checkpoint, then are asked to load the table trained on 1 rank."""
    out = resharded["out"]
    ckpt, refused = str(out / "to1" / "refit"), str(out / "one" / "ckpt")
    return run_ranks(reload, 2, out / "to2", ckpt=ckpt, state=resharded["saved"][0]["state"], refused=refused)


@pytest.mark.dist
def test_a_two_rank_managed_collision_checkpoint_predicts_on_one_rank_as_it_did_on_two(resharded):
    """Issue 34, finding 7: a 2-rank checkpoint predicted on 1 rank through ``Trainer.predict(ckpt_path=...)`` sent
    the raw ids of rank 1's bucket to the miss row (DCP loaded the slots by position; they were not sorted)."""
    saved, one = resharded["saved"], resharded["one"]
    expected = saved[0]["logits"]
    assert saved[1]["logits"] == expected  # the probe is the same on both ranks
    assert len(set(expected)) > 2  # the probe's ids have rows of their own
    for how in ("predict", "validate", "fit"):
        assert one[how] == pytest.approx(expected, abs=1e-6), how
    # load_from_checkpoint (unsharded, TorchRec's load hook), of the 2-rank save and of the 1-rank one
    probe = _probe(saved[0]["state"])
    for ckpt in (resharded["out"] / "ckpt", resharded["out"] / "to1" / "refit"):
        model = ZchModel.load_from_checkpoint(ckpt).eval()
        with torch.no_grad():
            assert model(probe[0])[0].tolist() == pytest.approx(expected, abs=1e-6), ckpt


@pytest.mark.dist
def test_a_one_rank_save_of_a_two_rank_table_predicts_on_two_ranks_as_the_saving_job(resharded, back_on_two):
    """1 -> 2: the 1-rank job kept each id in its bucket's rows (it loaded them from 2 ranks), so 2 ranks take it."""
    expected = resharded["one"]["fit"]  # the saving job's predictions (equal to the 2-rank job's)
    for rank in back_on_two:
        assert rank["predict"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.dist
def test_a_table_trained_on_one_rank_is_refused_on_two_naming_table_buckets_and_world_sizes(resharded, back_on_two):
    """Trained on 1 rank, a table gives rows of one bucket to ids of the other: TorchRec cannot spread it over 2
    (without this check each rank looked ids up in rows it does not hold: ``Expected idx < num_rows``)."""
    assert resharded["single"]["logits"]  # it trained and predicts on its own rank
    for rank in back_on_two:
        assert rank["untouched"]
        assert re.search(
            r"managed-collision table 't_f[01]' \(mc_ebc\._managed_collision_collection\._managed_collision_modules"
            r"\.t_f[01]\): on 2 ranks it has 2 buckets of raw ids \(input_hash_size 960\); rank [01] owns rows "
            r"\[(0|32), (32|64)\) and the raw ids \[(0|480), (480|960)\), but the checkpoint, saved on 1 rank\(s\), "
            r"gives \d+ of those rows to raw ids of other buckets.*HINT: load it on 1 rank",
            rank["refusal"],
            re.S,
        ), rank["refusal"]
        assert "nothing was modified" in rank["refusal"]
