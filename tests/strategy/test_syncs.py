"""Host-device synchronisations per training step, counted on CPU (lightning_rec.testing.SyncCounter): a guard for
a GPU property. A recshard step syncs no more often than the hand-written TorchRec loop of the same model: its
input checks read batches on the host before the copy, and the loss one step late from host memory."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.testing import SyncCounter
from tests.helpers import user_scenarios
from tests.helpers.dist import run_ranks

SYNCS = user_scenarios.syncs


# What a step reads into host memory, per step, by op and the file:function that asked, pinned: one more read, or a
# new one, anywhere (recshard, Lightning, TorchRec, torch), fails. On CPU a read of a host tensor counts as if the
# tensor were on the device (lightning_rec.testing.SyncCounter), so the reads of host memory are here too, named in
# HOST_SIDE: none of them makes a GPU wait.
OPTIMIZER = {"_local_scalar_dense optimizer.py:_get_value": 4}  # torch's Adagrad: each parameter's step count (host)
VBE = {"cpu split_table_batched_embeddings_ops_training.py:_generate_vbe_metadata": 1}  # FBGEMM: a host tensor's .cpu()
DDP = {"_local_scalar_dense graph.py:_engine_run_backward": 4}  # DMP's DDP of the dense part, in its backward hooks
SPLITS = {"tolist dist_data.py:_safe_tolist_2d": 2}  # TorchRec: the all-to-all splits of the ids, read on the host
PREEMPTION_READ = "tolist lightning_rec/_strategy/preemption.py:agreed"
HOST_SIDE = {
    "numpy lightning_rec/_inputs/kjt.py:host_numpy": "recshard's input checks read the batch on the host, before its copy",
    "numpy lightning_rec/_inputs/checks.py:poll": "recshard reads the last step's loss from host memory (copied without blocking)",
    PREEMPTION_READ: "the ranks' signal flags, reduced on a gloo group about every 50 ms (a CPU tensor, replacing "
    "Lightning's per-step broadcast of a device tensor)",
    "cpu split_table_batched_embeddings_ops_training.py:_generate_vbe_metadata": "FBGEMM: feature_dims, on the host",
    "to lightning_rec/_batch.py:move": "the batch's copy to the device (non_blocking on a GPU; on CPU the host is the device)",
    "to apply_func.py:batch_to": "the same copy, by Lightning's collection walk (pipelined dict batches)",
    "to jagged_tensor.py:to": "the KJT's copy to the device (non_blocking on a GPU)",
    "to utils.py:to": "TorchRec's Batch copied to the device (non_blocking on a GPU)",
    "to permute_pooled_embedding_modules.py:__call__": "TorchRec moves its permutation buffers to where they are",
}
RECSHARD = {
    **OPTIMIZER,
    **VBE,
    "numpy lightning_rec/_inputs/kjt.py:host_numpy": 8,
    "numpy lightning_rec/_inputs/checks.py:poll": 1,
}
# (fmt, pipeline, ranks) -> recshard's reads per step (every rank): 1 and 2 ranks, pipelined and not, both batch
# formats, in four runs of ~12 s each. With several ranks a step may also read the preemption flags the ranks compared
# (host memory, about every 50 ms: how many of the counted steps do depends on their speed, so it is checked apart),
# instead of Lightning's per-step SIGTERM broadcast of a device tensor.
EXPECTED = {
    ("dict", False, 1): {
        **RECSHARD,
        "_local_scalar_dense user_models.py:training_step": 1,
        "to lightning_rec/_batch.py:move": 2,
        "to jagged_tensor.py:to": 2,
    },
    ("batch", True, 1): {
        **RECSHARD,
        **SPLITS,
        "_local_scalar_dense user_scenarios.py:training_step": 1,
        "tolist jagged_tensor.py:_safe_tolist": 3,
    },
    ("batch", False, 2): {
        **RECSHARD,
        **DDP,
        **SPLITS,
        "_local_scalar_dense user_scenarios.py:training_step": 1,
        "to jagged_tensor.py:to": 2,
        "to permute_pooled_embedding_modules.py:__call__": 4,
        "to utils.py:to": 2,
        "tolist jagged_tensor.py:_safe_tolist": 1,
    },
    ("dict", True, 2): {
        **RECSHARD,
        **DDP,
        **SPLITS,
        "_local_scalar_dense user_models.py:training_step": 1,
        "to apply_func.py:batch_to": 2,
        "to jagged_tensor.py:to": 2,
        "to permute_pooled_embedding_modules.py:__call__": 4,
        "tolist jagged_tensor.py:_safe_tolist": 4,
    },
}
RAW = {**OPTIMIZER, **VBE, **DDP, "_local_scalar_dense user_scenarios.py:_raw_torchrec_loop": 1}
RAW_EXPECTED = {  # (pipeline, ranks) -> TorchRec's tutorial loop on Batches (DMP keeps its DDP with one rank)
    (False, 1): RAW,
    (True, 1): {**RAW, **SPLITS, "tolist jagged_tensor.py:_safe_tolist": 3},
    (False, 2): {**RAW, **SPLITS, "tolist jagged_tensor.py:_safe_tolist": 1},
}


@pytest.mark.dist
@pytest.mark.parametrize("fmt, pipeline, ranks", list(EXPECTED))
def test_a_recshard_step_reads_exactly_what_is_pinned_and_no_more_than_torchrec_by_hand(tmp_path, fmt, pipeline, ranks):
    """Same model, plan, optimizers and batches; the raw loop is TorchRec's tutorial loop (TrainPipelineSparseDist
    when pipelined, on TorchRec ``Batch``es: TorchRec's pipeline takes no dicts). Every rank's counts."""
    ours = run_ranks(SYNCS, ranks, tmp_path, pipeline=pipeline, fmt=fmt)
    for rank, counts in enumerate(ours):
        assert counts["by_origin"].pop(PREEMPTION_READ, 0) <= (1 if ranks > 1 else 0), (rank, counts["origins"])
        assert counts["by_origin"] == EXPECTED[fmt, pipeline, ranks], (rank, counts["origins"])
    if (pipeline, ranks) in RAW_EXPECTED:  # (the hand-written loop takes TorchRec Batches whatever the format)
        raw = run_ranks(SYNCS, ranks, tmp_path / "raw", pipeline=pipeline, fmt="batch", loop="raw")
        for rank, counts in enumerate(raw):
            assert counts["by_origin"] == RAW_EXPECTED[pipeline, ranks], (rank, counts["origins"])
    # What a GPU would wait for (the host-side reads left out): never more than TorchRec by hand.
    gpu_waits = {k: n for k, n in EXPECTED[fmt, pipeline, ranks].items() if k not in HOST_SIDE}
    raw_waits = RAW_EXPECTED[pipeline, ranks] if (pipeline, ranks) in RAW_EXPECTED else RAW_EXPECTED[True, 1]
    lightnings = {k for k in gpu_waits if "training_epoch_loop.py" in k or ":training_step" in k}
    assert sum(n for k, n in gpu_waits.items() if k not in lightnings) <= sum(
        n for k, n in raw_waits.items() if "_raw_torchrec_loop" not in k
    )
    assert not [k for k in gpu_waits if " lightning_rec/" in k]  # recshard's own reads are all of host memory


def test_the_counter_counts_every_read_that_waits_for_a_gpu():
    import numpy as np

    original = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "__array__", "to")}
    t = torch.tensor([0.0, 1.0, 2.0])
    reads = {
        "_local_scalar_dense": lambda: t.sum().item(),
        "is_nonzero": lambda: bool(t.max() > 1),  # (bool() of a one-element tensor)
        "nonzero": lambda: t.nonzero(),
        "tolist": lambda: t.tolist(),
        "cpu": lambda: t.cpu(),
        "to": lambda: t.to("cpu"),
        "numpy": lambda: t.numpy(),
        "__array__": lambda: np.asarray(t),  # one read, though torch's __array__ calls numpy()
        "allclose": lambda: torch.allclose(t, t),
        "index": lambda: t[t > 1],  # a boolean mask
        "index_put_": lambda: t.clone().__setitem__(t > 1, 0.0),
        "repeat_interleave": lambda: t.repeat_interleave(torch.tensor([1, 2, 3])),
        "bincount": lambda: torch.bincount(torch.tensor([1, 2])),
    }
    free = [
        lambda: t * 2,
        lambda: t.to("cpu", non_blocking=True),
        lambda: t.to(torch.float64),
        lambda: t.repeat_interleave(torch.tensor([1, 2, 3]), output_size=6),
        lambda: t.clone().__setitem__(torch.tensor([1]), 0.0),
        lambda: t[torch.tensor([0, 2])],
    ]
    for op, read in reads.items():
        with SyncCounter() as syncs:
            read()
        assert [o for o, _ in syncs.origins] in ([op], ["_local_scalar_dense"] if op == "is_nonzero" else [op]), op
        assert syncs.count == 1 and syncs.count_from("test_syncs.py") == 1, op
    with SyncCounter() as syncs:
        for op in free:
            op()
        syncs.active = False
        _ = t.sum().item()  # paused
    assert syncs.count == 0, syncs.origins
    assert {name: getattr(torch.Tensor, name) for name in original} == original  # restored on exit
