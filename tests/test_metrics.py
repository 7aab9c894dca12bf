"""CTR metrics: formulas, agreement with TorchRec's NE, and exactness across ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torchrec.metrics.ne import compute_ne, get_ne_states

from lightning_rec.metrics import LogLoss, NormalizedEntropy, ctr_metrics
from tests.helpers.dist import run_ranks
from tests.helpers.metric_scenarios import fixed_data


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


def test_ne_matches_torchrec() -> None:
    preds, target = fixed_data(777, seed=3)
    ours = NormalizedEntropy()
    ours.update(preds, target)
    states = get_ne_states(target.double(), preds.double(), torch.ones(777, dtype=torch.float64), eta=1e-12)
    theirs = compute_ne(states["cross_entropy_sum"], states["weighted_num_samples"], states["pos_labels"],
                        states["neg_labels"], eta=1e-12)
    assert ours.compute().item() == pytest.approx(theirs.item(), rel=1e-9)


def test_base_rate_prediction_has_ne_one_and_mismatched_shapes_fail() -> None:
    ne = NormalizedEntropy()
    ne.update(torch.full((10,), 0.3), torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0]))
    assert ne.compute().item() == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError, match="one shape"):
        LogLoss().update(torch.rand(3), torch.ones(4))


def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    preds, target = fixed_data(1001)
    single = ctr_metrics()
    single.update(preds, target)
    expected = {k: float(v) for k, v in single.compute().items()}
    ranks = run_ranks("tests.helpers.metric_scenarios:ctr", 2, tmp_path, rows=1001)
    for r in ranks:
        assert r == pytest.approx(expected, abs=1e-6)
    # a rank's own share alone gives different numbers: the sync is what makes them equal
    alone = ctr_metrics()
    alone.update(preds[:333], target[:333])
    assert {k: float(v) for k, v in alone.compute().items()} != pytest.approx(expected, abs=1e-6)
