"""Starting tables from given rows: ``lightning_rec._pretrained.load_rows`` and the ``PretrainedRows`` callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_rec
from lightning_rec._pretrained import load_rows, read_rows
from lightning_rec.callbacks import PretrainedRows
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.models import assemble, local_weights, plan_shards
from tests.helpers.user_models import samples, to_batch

# (table, feature, rows): an EBC over user/genre/item and an EC sharing nothing with it.
BAG_TABLES = [("t_user", "user", 60), ("t_genre", "genre", 20), ("t_item", "item", 90)]
SEQ_TABLE = ("t_item_seq", "item", 90)
DIM = 8


def _ebc(device: str = "meta") -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=5, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=7, feature_names=["item"]),
        ],
        device=torch.device(device),
    )


def test_meta_tables_take_the_rows_and_allocated_tables_copy_them() -> None:
    ebc = _ebc()
    rows = torch.arange(20.0).reshape(5, 4)
    load_rows(ebc, {"t_user": rows})
    assert torch.equal(ebc.embedding_bags["t_user"].weight, rows) and ebc.embedding_bags["t_user"].weight.requires_grad
    assert ebc.embedding_bags["t_item"].weight.is_meta, "a table not named stays as it was"
    cpu = _ebc("cpu")
    before = cpu.embedding_bags["t_user"].weight
    load_rows(cpu, {"t_user": rows.numpy()})
    assert cpu.embedding_bags["t_user"].weight is before and torch.equal(before, rows)


def test_files_of_rows(tmp_path: Path) -> None:
    rows = torch.randn(7, 4)
    np.save(tmp_path / "item.npy", rows.numpy())
    torch.save(rows, tmp_path / "item.pt")
    torch.save({"t_item": rows, "t_user": torch.zeros(5, 4)}, tmp_path / "tables.pt")
    # What `lightning-rec export` writes: state-dict keys.
    safetensors.torch.save_file(
        {"model.ebc.embedding_bags.t_item.weight": rows, "model.ebc.embedding_bags.t_user.weight": torch.zeros(5, 4)},
        str(tmp_path / "export.safetensors"),
    )
    for name in ("item.npy", "item.pt", "tables.pt", "export.safetensors"):
        assert torch.equal(read_rows(tmp_path / name, "t_item"), rows), name
        ebc = _ebc()
        load_rows(ebc, {"t_item": str(tmp_path / name)})
        assert torch.equal(ebc.embedding_bags["t_item"].weight, rows), name
    before = (tmp_path / "item.npy").read_bytes()
    ebc = _ebc()
    load_rows(ebc, {"t_item": tmp_path / "item.npy"})
    with torch.no_grad():
        ebc.embedding_bags["t_item"].weight.add_(1.0)  # training the table never writes into the user's file
    assert (tmp_path / "item.npy").read_bytes() == before


def test_errors_name_the_table_and_change_nothing(tmp_path: Path) -> None:
    ebc = _ebc()
    good = torch.ones(5, 4)
    with pytest.raises(KeyError, match=r"no table 't_movie'.*t_item, t_user"):
        load_rows(ebc, {"t_user": good, "t_movie": torch.ones(7, 4)})
    with pytest.raises(
        ValueError, match=r"table 't_item' \(<root>\) has 7 rows of 4 values; the rows given are \(7, 5\)"
    ):
        load_rows(ebc, {"t_user": good, "t_item": torch.ones(7, 5)})
    bad = torch.ones(7, 4)
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"table 't_item': row 3 holds a non-finite value \(nan\)"):
        load_rows(ebc, {"t_user": good, "t_item": bad})
    with pytest.raises(ValueError, match="must be floating point"):
        load_rows(ebc, {"t_item": torch.ones(7, 4, dtype=torch.long)})
    assert all(p.is_meta for p in ebc.parameters()), "a failed call changes nothing, not even the valid tables"
    torch.save({"a": torch.ones(7, 4), "b": torch.ones(7, 4)}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match=r"table 't_item': .*two.pt holds 2 tensors and none of them"):
        load_rows(ebc, {"t_item": tmp_path / "two.pt"})
    with pytest.raises(FileNotFoundError, match="t_item"):
        load_rows(ebc, {"t_item": tmp_path / "missing.npy"})
    twice = torch.nn.ModuleDict({"a": _ebc(), "b": _ebc()})
    with pytest.raises(KeyError, match=r"'t_user' is declared by 2 modules \(a, b\)"):
        load_rows(twice, {"t_user": good})
    with pytest.raises(ValueError, match="holds no unsharded"):
        load_rows(torch.nn.Linear(2, 2), {"t_user": good})


@pytest.mark.dist
def test_every_plan_starts_from_the_files_rows(tmp_path: Path) -> None:
    """Tables built on meta, rows from .npy / .pt files through the PretrainedRows callback: on 2 ranks, under
    table-wise, column-wise, table-column-wise and data-parallel plans, every shard holds exactly the file's rows.

    The column-wise and table-column-wise tables are really split, in two column blocks of 4 (``min_partition``:
    without it TorchRec keeps an 8-wide table in one shard at column 0), so a shard at column offset 4 is filled."""
    g = torch.Generator().manual_seed(5)
    rows = {t: torch.randn(n, DIM, generator=g) for t, _, n in [*BAG_TABLES, SEQ_TABLE]}
    files = {}
    for i, (name, r) in enumerate(rows.items()):
        files[name] = str(tmp_path / (f"{name}.npy" if i % 2 else f"{name}.pt"))
        np.save(files[name], r.numpy()) if i % 2 else torch.save(r, files[name])
    plans = {
        "a": {
            "t_user": {"sharding_types": ["table_wise"]},
            "t_genre": {"sharding_types": ["data_parallel"]},
            "t_item": {"sharding_types": ["column_wise"], "min_partition": 4},
            "t_item_seq": {"sharding_types": ["column_wise"], "min_partition": 4},
        },
        "b": {
            "t_user": {"sharding_types": ["table_column_wise"], "min_partition": 4},
            "t_genre": {"sharding_types": ["column_wise"], "min_partition": 4},
            "t_item": {"sharding_types": ["table_wise"]},
            "t_item_seq": {"sharding_types": ["table_wise"]},
        },
    }
    res = run_ranks(start_from_files, 2, tmp_path, files=files, plans=plans)
    assert res[0]["types"] == ["column_wise", "data_parallel", "table_column_wise", "table_wise"]
    # The shards each plan made (the same on every rank): (row, column) offsets of each shard.
    whole, halves = [[0, 0]], [[0, 0], [0, 4]]
    expected = {
        "a": {"t_user": whole, "t_genre": [], "t_item": halves, "t_item_seq": halves},
        "b": {"t_user": halves, "t_genre": halves, "t_item": whole, "t_item_seq": whole},
    }
    for r in res:
        assert {tag: {t: s["offsets"] for t, s in shards.items()} for tag, shards in r["shards"].items()} == expected
        # each split table has a shard on each rank
        assert all(
            s["ranks"] == [0, 1] for shards in r["shards"].values() for s in shards.values() if len(s["offsets"]) > 1
        )
    for tag in plans:
        start = assemble([torch.load(tmp_path / f"{tag}.start{r}.pt") for r in range(2)])
        for name, r in rows.items():
            key = next(k for k in start if k.endswith(f".{name}.weight"))
            torch.testing.assert_close(start[key], r, atol=0, rtol=0, msg=f"{tag}: {name}")


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module): a model with tables on meta starts from rows in
# files (``PretrainedRows``) on a given plan.
# ------------------------------------------------------------------------------------------------------------


class MetaModel(lightning_rec.RecLightningModule):
    """Tables on meta (no rows of their own), pooled EBC output + the EC's values, SGD with lr 0 (nothing moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                for t, f, n in BAG_TABLES
            ],
            device=torch.device("meta"),
        )
        t, f, n = SEQ_TABLE
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f])],
            device=torch.device("meta"),
        )
        self.over = torch.nn.Linear(len(BAG_TABLES) * DIM + 2, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        items = KeyedJaggedTensor.from_jt_dict({"item": batch["sparse"]["item"]})
        seq = self.ec(items)["item"].values().sum()
        logits = self.over(torch.cat([self.ebc(batch["sparse"]).values(), batch["dense"]], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch["label"]) + 0 * seq

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Start(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(local_weights(pl_module), self.path)


def start_from_files(
    rank: int, world_size: int, out_dir: Path, files: dict[str, str], plans: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """For each plan: fit one step from rows in ``files``; each rank saves what it holds at train start as
    ``<plan>.start<rank>.pt``; report the sharding types used and the shards of every table (:func:`plan_shards`),
    by plan."""
    L.seed_everything(0)
    types = set()
    shards = {}
    for tag, constraints in plans.items():
        trainer = L.Trainer(
            strategy=lightning_rec.RecShardStrategy(constraints=constraints),
            accelerator="cpu",
            devices=world_size,
            max_steps=1,
            **QUIET_TRAINER,
            callbacks=[PretrainedRows(files), _Start(out_dir / f"{tag}.start{rank}.pt")],
        )
        batch = to_batch(samples(8, 3)[rank * 4 : (rank + 1) * 4])
        trainer.fit(MetaModel(), DataLoader([batch], batch_size=None))
        shards[tag] = plan_shards(trainer.strategy.sharding_plan)
        types.update(t["type"] for t in shards[tag].values())
    return {"types": sorted(types), "shards": shards}
