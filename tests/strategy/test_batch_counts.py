"""Ranks that run different numbers of training batches are named, not hung (torchrec#189): with a sized loader
before the first batch, with a bare iterable after the shorter rank's last step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from torch.utils.data import DataLoader, IterableDataset

import lightning_rec
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import run_ranks
from tests.helpers.models import RecModel, make_batches


@pytest.mark.dist
def test_an_iterable_that_gives_rank_1_fewer_batches_stops_both_ranks_naming_it(tmp_path: Path) -> None:
    res = run_ranks(uneven, 2, tmp_path, counts=[5, 4], sized=False)
    short, long = res[1], res[0]
    assert short["error"].startswith("UnequalBatchesError: RecShardStrategy: the ranks ran different numbers")
    # Rank 0 fetches its 5th (last) batch, and so knows its count, before its first collective of that step (no
    # per-step broadcast holds it back since recshard agrees on signals on the host): both counts are named.
    assert "rank 0 after 5 batches, rank 1 after 4 batches ran out" in short["error"]
    assert "HINT: give every rank the same number of batches" in short["error"]
    assert short["batches"] == 4, "stopped after its last batch, before pairing anything with rank 0's 5th"
    assert "Rank 1 stopped here after its 4 batches" in short["error"]
    assert long["error"] is not None and "rank 1" in long["error"], "rank 0 is told why it stopped"
    assert max(r["seconds"] for r in res) < 45, "named within seconds, not after the 60 s collective timeout"


@pytest.mark.dist
def test_sized_loaders_of_different_lengths_are_refused_before_the_first_batch_equal_ones_train(
    tmp_path: Path,
) -> None:
    res = run_ranks(equal_then_sized, 2, tmp_path)
    assert [(r["equal"]["error"], r["equal"]["batches"]) for r in res] == [(None, 12), (None, 12)], "no false alarm"
    for r in res:
        assert (
            "the ranks' training loaders have different lengths: rank 0: 5 batches, rank 1: 4 batches"
            in (r["sized"]["error"])
        )
        assert r["sized"]["batches"] == 0


def _counts_of_rank_0(tmp_path: Path) -> Any:
    """Rank 0 of 2 on a store where rank 1 already said its loader has 4 batches."""
    import torch.distributed as dist

    from lightning_rec._strategy.batch_counts import BatchCounts

    store = dist.FileStore(str(tmp_path / "store"), 2)
    dist.PrefixStore("lightning_rec/batch_counts/t/", store).set("loader1/len/rank1", "4")
    return BatchCounts(store, "t", rank=0, world_size=2)


@pytest.mark.parametrize(
    "limit, max_steps, refused",
    [(None, None, True), (1.0, None, True), (4, None, False), (0.8, None, False), (None, 3, False), (None, 5, True)],
)
def test_unequal_lengths_that_training_never_reaches_are_not_refused(
    limit: Any, max_steps: Any, refused: bool, tmp_path: Path
) -> None:
    from lightning_rec._strategy.batch_counts import UnequalBatchesError

    counts = _counts_of_rank_0(tmp_path)
    loader = list(range(5))  # rank 0: 5 batches
    if refused:
        with pytest.raises(UnequalBatchesError, match="rank 0: 5 batches, rank 1: 4 batches"):
            counts.wrap(loader, limit, max_steps)
    else:  # limit_train_batches=4 (or 80%), or max_steps=3: both ranks run the same batches, as TorchRec would
        assert list(counts.wrap(loader, limit, max_steps)) == loader


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports them from this module): training loaders that give the ranks different
# numbers of batches.
# ------------------------------------------------------------------------------------------------------------


class RankShard(IterableDataset):
    """A user's own IterableDataset sharded by rank, without a length: ``counts[rank]`` batches an epoch."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def uneven(rank: int, world_size: int, out_dir: Path, counts: list[int], sized: bool, epochs: int = 2) -> dict:
    """Fit ``epochs`` epochs with ``counts[rank]`` batches on this rank (a sized DataLoader or a bare iterable);
    report the error each rank stops with, the batches it trained and how long it took."""
    return _fit(rank, world_size, counts, sized, epochs)


def equal_then_sized(rank: int, world_size: int, out_dir: Path) -> dict:
    """Two fits in one job: equal bare iterables (4 batches, 3 epochs), then sized loaders of 5 and 4 batches."""
    return {"equal": _fit(rank, world_size, [4, 4], False, 3), "sized": _fit(rank, world_size, [5, 4], True, 2)}


def _fit(rank: int, world_size: int, counts: list[int], sized: bool, epochs: int) -> dict:
    batches = make_batches(counts[rank], 16, seed=100 + rank)
    data: Any = DataLoader(batches, batch_size=None) if sized else DataLoader(RankShard(batches), batch_size=None)
    model = RecModel()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=lightning_rec.RecShardStrategy(timeout=60),
        max_epochs=epochs,
        **QUIET_TRAINER,
    )
    start = time.monotonic()
    try:
        trainer.fit(model, data)
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}" + "".join(f"\n{n}" for n in getattr(e, "__notes__", []))
    return {"error": error, "batches": len(model.losses), "seconds": time.monotonic() - start}
