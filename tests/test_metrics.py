"""CTR metrics: formulas, agreement with TorchRec's NE, input checks, and exactness across ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.metrics.ne import compute_ne, get_ne_states

from lightning_rec.metrics import LogLoss, NormalizedEntropy, ctr_metrics
from tests.helpers.dist import run_ranks


def fixed_data(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities that carry some signal and 0/1 targets, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.rand(rows, generator=g) < 0.4).long()
    preds = torch.sigmoid(torch.randn(rows, generator=g) + 1.2 * (target - 0.5))
    return preds, target


def rank_slices(rows: int, world_size: int) -> list[slice]:
    """Uneven contiguous shares: rank 0 gets about a third of an even share, the rest split what is left."""
    first = rows // (3 * world_size) if world_size > 1 else rows
    rest = torch.arange(first, rows).tensor_split(world_size - 1) if world_size > 1 else []
    return [slice(0, first)] + [slice(int(r[0]), int(r[-1]) + 1) for r in rest]


def _values(metrics) -> dict:
    return {k: float(v) for k, v in metrics.compute().items()}


def test_log_loss_and_ne_formulas() -> None:
    preds, target = fixed_data(500)
    ll = LogLoss()
    ll.update(preds, target)
    expected = -sum(math.log(p) if t else math.log(1 - p) for p, t in zip(preds.tolist(), target.tolist())) / 500
    assert ll.compute().item() == pytest.approx(expected, rel=1e-9)
    ne = NormalizedEntropy()
    ne.update(preds, target)
    p = target.double().mean().item()
    assert ne.compute().item() == pytest.approx(expected / -(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-9)


def test_auroc_and_accuracy_formulas() -> None:
    preds, target = fixed_data(300, seed=5)
    m = ctr_metrics("val/")
    for chunk in torch.arange(300).split(64):
        m.update(preds[chunk], target[chunk])
    got = _values(m)
    assert set(got) == {"val/auroc", "val/log_loss", "val/ne", "val/accuracy"}
    pos, neg = preds[target == 1].double(), preds[target == 0].double()
    # AUROC = P(a positive scores above a negative), ties counting half (Mann-Whitney U)
    diff = pos[:, None] - neg[None, :]
    auroc = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert got["val/auroc"] == pytest.approx(auroc, abs=1e-6)
    assert got["val/accuracy"] == pytest.approx(((preds >= 0.5).long() == target).double().mean().item(), abs=1e-7)
    assert 0.6 < auroc < 0.95, "the fixed data carries signal, so the checks above are not trivial"


def test_ne_matches_torchrec() -> None:
    preds, target = fixed_data(777, seed=3)
    ours = NormalizedEntropy()
    for chunk in torch.arange(777).split(100):
        ours.update(preds[chunk], target[chunk])
    states = get_ne_states(target.double(), preds.double(), torch.ones(777, dtype=torch.float64), eta=1e-12)
    theirs = compute_ne(
        states["cross_entropy_sum"],
        states["weighted_num_samples"],
        states["pos_labels"],
        states["neg_labels"],
        eta=1e-12,
    )
    assert ours.compute().item() == pytest.approx(theirs.item(), rel=1e-9)


def test_base_rate_prediction_has_ne_one_and_better_is_lower() -> None:
    target = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    ne = NormalizedEntropy()
    ne.update(torch.full((10,), 0.3), target)
    assert ne.compute().item() == pytest.approx(1.0, rel=1e-9)
    better = NormalizedEntropy()
    better.update(torch.where(target == 1, 0.8, 0.1), target)
    assert better.compute().item() < 0.5


def test_confident_mistakes_are_finite() -> None:
    ll = LogLoss(eps=1e-7)
    ll.update(torch.tensor([0.0, 1.0]), torch.tensor([1, 0]))
    assert ll.compute().item() == pytest.approx(-math.log(1e-7), rel=1e-6)


def test_bad_inputs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="LogLoss.*one shape"):
        LogLoss().update(torch.rand(3), torch.ones(4))
    with pytest.raises(ValueError, match=r"NormalizedEntropy.*\[0, 1\].*HINT: pass torch.sigmoid"):
        NormalizedEntropy().update(torch.tensor([-2.0, 3.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="LogLoss.*probabilities"):
        ctr_metrics().update(torch.tensor([0.5, float("nan")]), torch.tensor([0, 1]))
    unchecked = LogLoss(validate_args=False)
    unchecked.update(torch.tensor([-2.0, 3.0]), torch.tensor([0, 1]))  # clamped, as documented
    assert math.isfinite(unchecked.compute().item())


@pytest.mark.dist
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    rows = 1001
    shares = [s.stop - s.start for s in rank_slices(rows, 2)]
    assert sum(shares) == rows and shares[0] != shares[1], "an uneven split is what this test is about"
    preds, target = fixed_data(rows)
    single = ctr_metrics()
    single.update(preds, target)
    expected = _values(single)
    ranks = run_ranks(ctr, world_size=2, out_dir=tmp_path, rows=rows)
    for r in ranks:
        assert r["metrics"] == pytest.approx(expected, abs=1e-6)
    assert [r["rows"] for r in ranks] == shares
    # A rank's own share alone gives other numbers: the sync is what makes them equal.
    for share in rank_slices(rows, 2):
        alone = ctr_metrics()
        alone.update(preds[share], target[share])
        assert _values(alone) != pytest.approx(expected, abs=1e-4)


# ------------------------------------------------------------------------------------------------------------
# What each rank runs (run_ranks imports it from this module).
# ------------------------------------------------------------------------------------------------------------


def ctr(rank: int, world_size: int, out_dir: Path, rows: int = 1001, seed: int = 0) -> dict[str, Any]:
    """Each rank updates on an uneven share of the same rows; compute() syncs over the process group."""
    dist.init_process_group("gloo")
    preds, target = fixed_data(rows, seed)
    mine = rank_slices(rows, world_size)[rank]
    metrics = ctr_metrics()
    for chunk in torch.arange(mine.start, mine.stop).split(97):  # several updates per rank
        metrics.update(preds[chunk], target[chunk])
    result = {"metrics": {k: float(v) for k, v in metrics.compute().items()}, "rows": mine.stop - mine.start}
    dist.destroy_process_group()  # as a script that started its own process group ends (see lightning_rec._strategy.faults)
    return result
