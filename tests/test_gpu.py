"""CUDA tests (nccl, ROW_WISE, fused Adam). They need a GPU and the CUDA build of FBGEMM; elsewhere they skip."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the CUDA build of FBGEMM"),
]

ROW_WISE_PLAN = {
    "t_user": {"sharding_types": ["row_wise"]},
    "t_item": {"sharding_types": ["table_wise"]},
    "t_genre": {"sharding_types": ["data_parallel"]},
}


def test_row_wise_training_with_nccl_reduces_the_loss(tmp_path):
    world_size = min(2, torch.cuda.device_count())
    res = run_ranks(
        "train", world_size, tmp_path, steps=40, batch_size=64, model={"lr": 0.2},
        strategy={"constraints": ROW_WISE_PLAN}, trainer={"accelerator": "gpu"},
    )
    assert {r["table"]: r["sharding_type"] for r in res[0]["plan"]}["t_user"] == "row_wise"
    for r in res:
        assert sum(r["losses"][-5:]) < 0.75 * sum(r["losses"][:5])


def test_fused_adam_is_available_on_cuda(tmp_path):
    res = run_ranks("train", 1, tmp_path, steps=10, model={"optimizer": "adam", "lr": 0.01},
                    trainer={"accelerator": "gpu"})
    assert len(res[0]["losses"]) == 10
