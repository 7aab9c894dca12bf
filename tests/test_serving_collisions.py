"""Serving managed-collision ("zero-collision hashing") and position-weighted tables (issue 35): the trained collision
state (each slot's raw id -> row) and the trained position weights travel into the artifact, in both formats.

The model is written as a user writes one: a ``ManagedCollisionEmbeddingBagCollection`` (``user``, ``item``: raw ids
from a space 30x the table, ``MCHManagedCollisionModule`` with 2 buckets), a ``FeatureProcessedEmbeddingBagCollection``
with a ``PositionWeightedModuleCollection`` (``history``: each id weighted by its position in the list) and a dense
input, tables built on CPU with rows of their own, dict batches whose features come in another order than the
artifact's; its own ``forward(dense, kjt)`` serves (no ``inference_module``). It trains under recshard on 1 and on 2
ranks; each checkpoint is exported with fp32 tables as TorchScript (served in a process without lightning_rec) and
as a ``.pt2`` package, and both are compared on a probe of raw ids the tables hold (``seen``, from both buckets) and
ids they do not (``unseen``, which TorchRec's eval mode sends to the table's last row: its miss row).

The reference is the trained model: its own predictions in the training job (``Trainer.predict``; on 2 ranks the seen
ids only, since there each rank's bucket has a miss row of its own), and the module the checkpoint loads unsharded
(``load_from_checkpoint``), in eval mode, for every id. The inputs are checked against what the tables take (raw ids
below ``input_hash_size``, lists no longer than the position weights), by name. An unpooled managed-collision
``EmbeddingCollection`` serves too; a feature-processed module built on a dict of processors (which TorchRec's
quantized module cannot call) is refused by name.
"""

from __future__ import annotations

import copy
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
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
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
from lightning_rec.serving import export_inference, load_inference, load_pt2, serving_inputs
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.serving import serve_fresh
from tests.test_serving import trained_checkpoint

HASH_SIZE = 960  # raw ids of `user` and `item`: [0, 960), 2 buckets of 480 (one a rank on 2 ranks)
ROWS = 32  # rows of each managed-collision table (slots)
HISTORY_ROWS, MAX_HISTORY = 20, 4  # the position-weighted table, and the longest list it weighs
DIM, DENSE = 4, 2
MC_FEATURES = ("user", "item")
ORDER = ("history", "item", "user")  # the training batches' key order (the artifact's is the model's own)
STEPS = 4
_EMPTY = torch.iinfo(torch.int64).max  # the raw id of a free slot


class ZchModel(lightning_rec.RecLightningModule):
    """Managed-collision and position-weighted tables and a dense input into one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        cpu = torch.device("cpu")
        mc_tables = [
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
            for f in MC_FEATURES
        ]
        collisions = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    zch_size=ROWS,
                    device=cpu,
                    input_hash_size=HASH_SIZE,
                    eviction_interval=1,
                    eviction_policy=DistanceLFU_EvictionPolicy(),
                    buckets=2,
                )
                for t in mc_tables
            },
            embedding_configs=mc_tables,
        )
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=mc_tables, device=cpu), collisions, return_remapped_features=False
        )
        history = EmbeddingBagConfig(
            name="t_history", embedding_dim=DIM, num_embeddings=HISTORY_ROWS, feature_names=["history"]
        )
        self.fp_ebc = FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[history], is_weighted=True, device=cpu),
            PositionWeightedModuleCollection({"history": MAX_HISTORY}, device=cpu),
        )
        self.bottom = nn.Linear(DENSE, DIM)
        self.over = nn.Linear(4 * DIM, 1)
        with torch.no_grad():  # rows and position weights of its own (TorchRec's init: all position weights 1)
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            position_weights(self).add_(1.0)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        mc, _ = self.mc_ebc(kjt)
        fp = self.fp_ebc(kjt)
        return self.over(torch.cat([mc.values(), fp.values(), torch.relu(self.bottom(dense))], dim=1)).squeeze(1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(batch["dense"], batch["sparse"]), batch["label"])

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch["dense"], batch["sparse"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def position_weights(module: nn.Module) -> torch.Tensor:
    return dict(module.named_parameters())["fp_ebc._feature_processors.position_weights.history"].detach()


def _batch(
    user: list[list[int]], item: list[list[int]], history: list[list[int]], seed: int, keys: tuple[str, ...] = ORDER
) -> dict[str, Any]:
    """A dict batch of these ids per sample (its features in ``keys`` order), seeded dense values and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = {"user": user, "item": item, "history": history}
    lengths = torch.tensor([len(sample) for f in keys for sample in ids[f]])
    values = torch.tensor([i for f in keys for sample in ids[f] for i in sample], dtype=torch.long)
    return {
        "dense": torch.randn(len(user), DENSE, generator=g),
        "sparse": KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths),
        "label": torch.randint(0, 2, (len(user),), generator=g).float(),
    }


def training_batches(rank: int, size: int = 8) -> list[dict[str, Any]]:
    """``STEPS`` batches of this rank: 1-3 raw ids per managed-collision feature, 0-4 history ids, a few raw ids
    repeated in every batch (they win their slots)."""
    g = torch.Generator().manual_seed(rank)

    def lists(high: int, low_len: int, high_len: int, common: list[int] | None = None) -> list[list[int]]:
        out = [
            torch.randint(0, high, (int(n),), generator=g).tolist()
            for n in torch.randint(low_len, high_len + 1, (size,), generator=g)
        ]
        if common:
            out[0] = common
        return out

    return [
        _batch(
            lists(HASH_SIZE, 1, 3, [5, 600]),
            lists(HASH_SIZE, 1, 3, [17, 959]),
            lists(HISTORY_ROWS, 0, MAX_HISTORY),
            10 * rank + s,
        )
        for s in range(STEPS)
    ]


def slots(module: nn.Module) -> dict[str, list[int]]:
    """Each managed-collision feature's raw ids with a slot of their own (the trained collision state)."""
    buffers = dict(module.named_buffers())
    out = {}
    for f in MC_FEATURES:
        ids = buffers[f"mc_ebc._managed_collision_collection._managed_collision_modules.t_{f}._mch_sorted_raw_ids"]
        out[f] = sorted(int(i) for i in ids if i != _EMPTY)
    return out


def probe(held: dict[str, list[int]]) -> dict[str, Any]:
    """Eight samples: 0-5 bring raw ids the tables hold (from both buckets; some two at once), 6-7 raw ids they do
    not hold (one from each bucket); history lists of every length from 1 to the longest (and one empty)."""
    unseen = {
        f: [next(i for i in pool if i not in held[f]) for pool in ((7, 33, 101), (500, 958, 777))] for f in MC_FEATURES
    }
    ids: dict[str, list[list[int]]] = {}
    for f in MC_FEATURES:
        low, high = [i for i in held[f] if i < HASH_SIZE // 2], [i for i in held[f] if i >= HASH_SIZE // 2]
        assert low and high, held[f]
        seen = [[low[k % len(low)]] if k % 2 else [high[k % len(high)]] for k in range(6)]
        seen[4] = [low[-1], high[0]]
        ids[f] = seen + [[i] for i in unseen[f]]
    history = [[(3 * n + k) % HISTORY_ROWS for k in range(1 + n % MAX_HISTORY)] for n in range(7)] + [[]]
    return _batch(ids["user"], ids["item"], history, seed=99, keys=("user", "item", "history"))


def _trainer(world_size: int, steps: int = STEPS) -> L.Trainer:
    return L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=world_size, max_steps=steps, **QUIET_TRAINER
    )


def train(rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Train on this rank's batches, save ``ckpt``, then predict the probe of the saved slots (the same on every
    rank) with the trained, sharded model."""
    torch.manual_seed(rank)  # an evicted slot's row is drawn anew by its table's init_fn
    model = ZchModel()
    initial = position_weights(model).tolist()
    trainer = _trainer(world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(training_batches(rank), batch_size=None, collate_fn=lambda b: b))
    trainer.save_checkpoint(out_dir / "ckpt")
    held = slots(ZchModel.load_from_checkpoint(out_dir / "ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (logits,) = _trainer(world_size).predict(
            model, DataLoader([probe(held)], batch_size=None, collate_fn=lambda b: b)
        )
    return {"held": held, "logits": logits.tolist(), "initial_position_weights": initial}


def _serve_both(ckpt: Path, work: Path, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The TorchScript artifact's outputs (in a process without lightning_rec) and the ``.pt2`` package's on
    ``batch``, both exported from ``ckpt`` with fp32 tables; and the spec."""
    spec = export_inference(ckpt, work / "model.pt", table_dtype="fp32")
    pt2_spec = export_inference(ckpt, work / "model.pt2", table_dtype="fp32")
    assert spec.features == pt2_spec.features == ["user", "item", "history"]
    assert spec.num_dense_features == DENSE and not spec.weighted  # the position weights are made inside
    assert spec.feature_rows == [HASH_SIZE, HASH_SIZE, HISTORY_ROWS]  # raw ids: bounded by the space they come from
    assert spec.tables == {"t_user": [ROWS, DIM], "t_item": [ROWS, DIM], "t_history": [HISTORY_ROWS, DIM]}
    args = serving_inputs(spec, batch["sparse"], batch["dense"])
    (scripted,) = serve_fresh([(work / "model.pt", [args])], work)
    with torch.inference_mode():
        packaged = load_pt2(work / "model.pt2")(*args)
    return scripted, packaged, spec


def _check(ckpt: Path, work: Path, trained: dict[str, Any], world_size: int) -> None:
    batch = probe(trained["held"])
    module = ZchModel.load_from_checkpoint(ckpt).eval()
    weights = position_weights(module)
    assert not torch.allclose(weights, torch.tensor(trained["initial_position_weights"])), "position weights trained"
    with torch.no_grad():
        want = module(batch["dense"], batch["sparse"])
        # what the tables' state contributes, for the outputs to show it: every raw id in its miss row, position
        # weights of 1
        blank = copy.deepcopy(module)
        for name, buf in blank.named_buffers():
            if name.endswith("_mch_sorted_raw_ids"):
                buf.fill_(_EMPTY)
        unweighted = copy.deepcopy(module)
        position_weights(unweighted).fill_(1.0)
        for name, other in (("collision slots", blank), ("position weights", unweighted)):
            moved = (other(batch["dense"], batch["sparse"]) - want).abs()
            assert moved[:6].min() > 1e-3, f"the probe's outputs must depend on the {name}: {moved}"
        # unseen raw ids read the miss row, as every id does once the slots are emptied
        assert torch.equal(blank(batch["dense"], batch["sparse"])[6:], want[6:])
    trained_logits = torch.tensor(trained["logits"])
    seen = slice(0, 6) if world_size > 1 else slice(None)  # on 2 ranks an unseen id reads its bucket's miss row
    torch.testing.assert_close(want[seen], trained_logits[seen], atol=1e-6, rtol=0)
    scripted, packaged, _ = _serve_both(ckpt, work, batch)
    assert torch.equal(scripted, want), (scripted - want).abs().max()
    torch.testing.assert_close(packaged, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(scripted[seen], trained_logits[seen], atol=1e-6, rtol=0)


@pytest.mark.dist
def test_a_managed_collision_and_position_weighted_model_serves_its_trained_state(tmp_path):
    """Both formats give the trained model's predictions, seen and unseen raw ids alike; the inputs are checked
    against what the tables take: a raw id below ``input_hash_size`` (far above the table's rows) serves, one at it
    is refused by name, as is a list longer than the position weights (in the ``.pt2`` graph too: unchecked, it
    would read past them and abort the process)."""
    (trained,) = run_ranks(train, 1, tmp_path)
    _check(tmp_path / "ckpt", tmp_path, trained, 1)
    scripted, packaged = load_inference(tmp_path / "model.pt"), load_pt2(tmp_path / "model.pt2")
    unchecked = load_pt2(tmp_path / "model.pt2", check_inputs=False)  # the package's own checks alone
    dense = torch.zeros(1, DENSE)
    with torch.inference_mode():
        good = scripted(dense, torch.tensor([HASH_SIZE - 1, ROWS, 0]), torch.tensor([1, 1, 1]))
        assert torch.allclose(packaged(dense, torch.tensor([HASH_SIZE - 1, ROWS, 0]), torch.tensor([1, 1, 1])), good)
        raw, long = (
            (torch.tensor([HASH_SIZE, 0, 0]), torch.tensor([1, 1, 1])),
            (torch.arange(7), torch.tensor([1, 1, 5])),
        )
        with pytest.raises(
            Exception,
            match=rf"feature 'user': raw id {HASH_SIZE} is outside its managed-collision id "
            rf"space of {HASH_SIZE} ids \(input_hash_size: raw ids run from 0 to {HASH_SIZE - 1}\)",
        ):
            scripted(dense, *raw)
        with pytest.raises(ValueError, match=rf"feature 'user': raw id {HASH_SIZE} is outside its managed-collision"):
            packaged(dense, *raw)
        with pytest.raises(RuntimeError, match=r"outside its feature's table or managed-collision id space"):
            unchecked(dense, *raw)
        message = r"feature 'history': sample 0 has 5 ids, more than the 4 it may bring \(max_lengths: the positions"
        with pytest.raises(Exception, match=message):
            scripted(dense, *long)
        with pytest.raises(ValueError, match=message):
            packaged(dense, *long)
        with pytest.raises(RuntimeError, match=r"a sample has more ids than its feature may bring"):
            unchecked(dense, *long)


@pytest.mark.dist
def test_a_two_rank_checkpoint_serves_seen_raw_ids_as_the_two_rank_job_predicted_them(tmp_path):
    """From a 2-rank checkpoint (each rank held the slots and rows of its own bucket): a seen raw id is served as the
    2-rank job predicted it; an unseen one reads the table's last row, as the module the checkpoint loads unsharded
    does (the 2-rank job read its bucket's own last row)."""
    ranks = run_ranks(train, 2, tmp_path)
    assert ranks[0]["logits"] == ranks[1]["logits"]
    _check(tmp_path / "ckpt", tmp_path, ranks[0], 2)


class SequenceZchModel(lightning_rec.RecLightningModule):
    """A ``ManagedCollisionEmbeddingCollection`` (unpooled) serving each raw id's row."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        cpu = torch.device("cpu")
        tables = [EmbeddingConfig(name="t_user", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["user"])]
        collisions = ManagedCollisionCollection(
            {
                "t_user": MCHManagedCollisionModule(
                    zch_size=ROWS,
                    device=cpu,
                    input_hash_size=HASH_SIZE,
                    eviction_interval=1,
                    eviction_policy=DistanceLFU_EvictionPolicy(),
                )
            },
            embedding_configs=tables,
        )
        self.mc_ec = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables=tables, device=cpu), collisions)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.mc_ec(kjt)
        return out["user"].values()

    def training_step(self, batch: KeyedJaggedTensor, batch_idx: int) -> torch.Tensor:
        return (self(batch) ** 2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_managed_collision_embedding_collection_serves_each_raw_ids_row(tmp_path):
    """The unpooled module's quantized form (``QuantManagedCollisionEmbeddingCollection``) keeps its slots: each
    seen raw id gets its own trained row, an unseen one the miss row (TorchScript; the ``.pt2`` path is the same
    module, captured as above)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [
        KeyedJaggedTensor(
            keys=["user"], values=torch.randint(0, HASH_SIZE, (12,), generator=g), lengths=torch.full((4,), 3)
        )
        for _ in range(3)
    ]
    ckpt = trained_checkpoint(SequenceZchModel(), batches, tmp_path / "ckpt")
    module = SequenceZchModel.load_from_checkpoint(ckpt).eval()
    held = [
        int(i)
        for i in dict(module.named_buffers())[
            "mc_ec._managed_collision_collection._managed_collision_modules.t_user._mch_sorted_raw_ids"
        ]
        if i != _EMPTY
    ]
    assert len(held) > 8 and max(held) >= ROWS
    unseen = next(i for i in range(HASH_SIZE) if i not in held)
    values, lengths = torch.tensor([*held[:8], unseen]), torch.tensor([2, 3, 4])
    with torch.no_grad():
        want = module(KeyedJaggedTensor(keys=["user"], values=values, lengths=lengths))
    assert len(want[:8].unique(dim=0)) == 8  # the seen ids' rows, each its own
    spec = export_inference(ckpt, tmp_path / "model.pt", table_dtype="fp32")
    assert spec.feature_rows == [HASH_SIZE]
    with torch.inference_mode():
        assert torch.equal(load_inference(tmp_path / "model.pt")(values, lengths), want)


def test_a_feature_processed_module_built_on_a_dict_of_processors_is_refused_by_name():
    from torchrec.modules.feature_processor_ import PositionWeightedModule

    from lightning_rec.errors import ExportError
    from lightning_rec.serving.network import serving_network

    class DictProcessors(lightning_rec.RecLightningModule):
        def __init__(self) -> None:
            super().__init__()
            table = EmbeddingBagConfig(
                name="t_history", embedding_dim=DIM, num_embeddings=10, feature_names=["history"]
            )
            self.fp_ebc = FeatureProcessedEmbeddingBagCollection(
                EmbeddingBagCollection(tables=[table], is_weighted=True), {"history": PositionWeightedModule(3)}
            )

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.fp_ebc(kjt).values()

    with pytest.raises(
        ExportError,
        match=r"DictProcessors: FeatureProcessedEmbeddingBagCollection \('fp_ebc'\) takes its feature processors as a "
        r"dict .*HINT: build it with a FeatureProcessorsCollection, e.g. `PositionWeightedModuleCollection",
    ):
        serving_network(DictProcessors(), None)
