"""CUDA tests (nccl, ROW_WISE, fused Adam). They need a GPU and the CUDA build of FBGEMM; elsewhere they skip."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import checkpoint_scenarios, scenarios, user_scenarios
from tests.helpers.dist import run_ranks

pytestmark = [
    pytest.mark.dist,
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
        scenarios.train,
        world_size,
        tmp_path,
        steps=40,
        batch_size=64,
        model={"lr": 0.2},
        strategy={"constraints": ROW_WISE_PLAN},
        trainer={"accelerator": "gpu"},
    )
    assert {r["table"]: r["sharding_type"] for r in res[0]["plan"]}["t_user"] == "row_wise"
    for r in res:
        assert sum(r["losses"][-5:]) < 0.75 * sum(r["losses"][:5])


def test_fused_adam_is_available_on_cuda(tmp_path):
    res = run_ranks(
        scenarios.train, 1, tmp_path, steps=10, model={"optimizer": "adam", "lr": 0.01}, trainer={"accelerator": "gpu"}
    )
    assert len(res[0]["losses"]) == 10


def test_checkpoint_saved_on_gpu_loads_on_cpu_and_exports(tmp_path):
    """A row-wise (CUDA-only) checkpoint reloads on the GPU under other plans, on the CPU under the three CPU plans,
    and exports; predictions agree across devices (different kernels: to 1e-5)."""
    from lightning_rec.checkpoint import export, load_exported
    from tests.helpers.checkpoint_scenarios import fixed_batch
    from tests.helpers.models import RecModel

    S = checkpoint_scenarios.reshard
    gpu = run_ranks(
        S, 1, tmp_path, save_plan="row_wise_mixed", load_plans=["row_wise_mixed", "table_wise"], accelerator="gpu"
    )[0]
    cpu = run_ranks(S, 1, tmp_path, save_plan=None, load_plans=["table_wise", "column_wise", "data_parallel"])[0]
    expected = torch.tensor(gpu["saved"])
    for key, predictions in {**gpu["loaded"], **cpu["loaded"]}.items():
        torch.testing.assert_close(torch.tensor(predictions), expected, rtol=0, atol=1e-5, msg=key)
    export(tmp_path / "saved_1.ckpt", tmp_path / "m.safetensors")
    plain = RecModel()
    plain.load_state_dict(load_exported(tmp_path / "m.safetensors"), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.sigmoid(plain(fixed_batch())), expected, rtol=0, atol=1e-5)


def test_exact_resume_on_gpu_with_row_wise_tables(tmp_path):
    """Row-wise Adagrad on row-wise/table-wise/replicated CUDA tables: 3 epochs straight == 1 epoch + resume."""
    from tests.helpers.models import assemble

    S = checkpoint_scenarios.fit_epochs
    common = dict(plan="row_wise_mixed", accelerator="gpu", emb_optimizer={"name": "rowwise_adagrad", "lr": 0.1})
    straight = run_ranks(S, 1, tmp_path / "straight", tag="w", epochs=3, **common)[0]
    first = run_ranks(S, 1, tmp_path / "split", tag="first", epochs=1, **common)[0]
    resumed = run_ranks(S, 1, tmp_path / "split", tag="resumed", epochs=3, ckpt_path=first["last"], **common)[0]
    assert first["losses"] + resumed["losses"] == pytest.approx(straight["losses"], abs=1e-6)
    assert resumed["restored_sums"] == pytest.approx(first["final_sums"], rel=1e-6)
    a = assemble([torch.load(tmp_path / "straight" / "w.weights0.pt")])
    b = assemble([torch.load(tmp_path / "split" / "resumed.weights0.pt")])
    for name in a:
        torch.testing.assert_close(a[name].cpu(), b[name].cpu(), rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_recshard_step_syncs_no_more_than_the_hand_written_torchrec_loop_on_cuda(tmp_path, pipeline):
    """Issue 14's property where it matters: torch's own CUDA sync detector and the dispatch-level counter, per step,
    recshard against TorchRec's tutorial loop on the same model and batches (pinned memory for both)."""
    S = user_scenarios.syncs
    ours = run_ranks(S, 1, tmp_path, pipeline=pipeline, fmt="batch", accelerator="gpu")[0]
    raw = run_ranks(S, 1, tmp_path, pipeline=pipeline, fmt="batch", loop="raw", accelerator="gpu")[0]
    assert ours["cuda_per_step"] <= raw["cuda_per_step"], (ours["origins"], raw["origins"])
    # The counter counts reads of host memory too (the input checks read the batch before its copy): left out here.
    from tests.strategy.test_syncs import HOST_SIDE

    waits = {k: n for k, n in ours["by_origin"].items() if k not in HOST_SIDE}
    raw_waits = {k: n for k, n in raw["by_origin"].items() if k not in HOST_SIDE}
    assert sum(waits.values()) <= sum(raw_waits.values()), (ours["origins"], raw["origins"])
    assert not [k for k in waits if " lightning_rec/" in k], ours["origins"]
