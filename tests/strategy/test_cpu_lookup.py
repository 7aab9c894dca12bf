"""recshard's CPU lookup (:mod:`lightning_rec._strategy.cpu_lookup`) against FBGEMM's own TBE: the same bits.

Two TBEs with the same tables and weights, one with FBGEMM's forward and one with :class:`CpuLookup`, take the same
steps: tables of three widths, two features sharing a table, empty bags, learnt per-sample weights; the outputs,
tables, optimizer state and the per-sample weights' gradients must be equal to the bit. Training through the strategy
is compared with unsharded TorchRec in ``test_torchrec_models.py`` (1 and 2 ranks).
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from lightning_rec import _compat
from lightning_rec._strategy.cpu_lookup import CpuLookup, ineligible_reason

ROWS_DIMS = [(50, 8), (30, 4), (70, 16), (20, 8)]
FEATURE_TABLES = [0, 1, 1, 2, 3]  # features 1 and 2 read one table


def _tbe(optimizer=EmbOptimType.EXACT_SGD, pooling=PoolingMode.SUM) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in ROWS_DIMS]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, feature_table_map=FEATURE_TABLES, optimizer=optimizer, learning_rate=0.1, eps=1e-3, pooling_mode=pooling
    )


def _pair(optimizer, threads):
    ours, theirs = _tbe(optimizer), _tbe(optimizer)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights()):
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(a)
    ours.forward = CpuLookup(ours, ours.forward, threads=threads)
    return ours, theirs


def _batch(g, batch_size=6, empty_feature=None):
    lengths = torch.randint(0, 5, (len(FEATURE_TABLES), batch_size), generator=g)
    if empty_feature is not None:
        lengths[empty_feature] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
    ids = [
        torch.randint(0, ROWS_DIMS[t][0], (int(lengths[f].sum()),), generator=g) for f, t in enumerate(FEATURE_TABLES)
    ]
    return torch.cat(ids), offsets


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_cpu_lookup_gives_fbgemm_s_bits(optimizer, threads, weighted):
    ours, theirs = _pair(optimizer, threads)
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        ids, offsets = _batch(g, empty_feature=step % len(FEATURE_TABLES))
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        w_ours = w.clone().requires_grad_() if weighted else None
        w_theirs = w.clone().requires_grad_() if weighted else None
        out_ours, out_theirs = ours(ids, offsets, w_ours), theirs(ids, offsets, w_theirs)
        assert torch.equal(out_ours, out_theirs), step
        grad = torch.randn(out_ours.shape, generator=g)
        out_ours.backward(grad)
        out_theirs.backward(grad)
        if weighted:
            assert torch.equal(w_ours.grad, w_theirs.grad), step
    for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights()):
        assert torch.equal(a, b)
    assert torch.equal(ours.momentum1_host, theirs.momentum1_host)
    assert not torch.equal(ours.split_embedding_weights()[0], _pair(optimizer, threads)[1].split_embedding_weights()[0])


def test_the_backward_splits_tables_not_features_and_balances_ids():
    lookup = CpuLookup(_tbe(), _tbe().forward, threads=2)
    # ids per feature: 10, 1, 1, 7, 3; per table 10, 2 (features 1 and 2: never apart), 7, 3. Heaviest first, each to
    # the lighter group: 10 | 7, then 3 joins the 7, then the 2 the first group (a tie goes to the first).
    bounds = [0, 10, 11, 12, 19, 22]
    assert lookup._groups(bounds) == [[0, 1, 2], [3, 4]]
    assert CpuLookup(_tbe(), _tbe().forward, threads=1)._groups(bounds) == [[0, 1, 2, 3, 4]]


def test_a_variable_batch_call_keeps_fbgemm_s_forward():
    tbe = _tbe()
    calls = []

    def fbgemm_forward(*args, **kwargs):
        calls.append(args)
        return torch.zeros(1)

    lookup = CpuLookup(tbe, fbgemm_forward)
    lookup(torch.zeros(1, dtype=torch.long), torch.zeros(2, dtype=torch.long), None, None, [[1]] * 5)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "tbe, reason",
    [
        (lambda: _tbe(pooling=PoolingMode.MEAN), "pooling MEAN"),
        (lambda: _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD), "optimizer EXACT_ROWWISE_ADAGRAD"),
        (lambda: nn.Linear(2, 2), "Linear is not FBGEMM's training TBE"),
    ],
)
def test_what_keeps_fbgemm_s_forward_is_named(tbe, reason):
    module = tbe()
    assert reason in ineligible_reason(module)
    with pytest.raises(ValueError, match=reason):
        CpuLookup(module, module.forward)


def test_the_seam_refuses_what_it_was_not_written_for():
    with pytest.raises(TypeError, match="SplitTableBatchedEmbeddingBagsCodegen instances, got Linear"):
        _compat.patch_method(nn.Linear(2, 2), "forward", lambda x: x)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        list(_compat.fused_tbes(object()))
    assert list(_compat.fused_tbes(nn.Linear(2, 2))) == []


def test_every_patched_name_exists_in_the_installed_torchrec_and_fbgemm():
    """What the CPU lookup reads from TorchRec and FBGEMM (a new version that renames one must fail here)."""
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    assert "emb_module" in dir(BatchedFusedEmbeddingBag)
    assert "_lookups" in ShardedEmbeddingBagCollection.__init__.__code__.co_names
    tbe = _tbe(EmbOptimType.EXACT_ADAGRAD)
    for name in ("prepare_inputs", "placeholder_autograd_tensor", "weights_host", "momentum1_host", "step"):
        assert hasattr(tbe, name), name
    assert ineligible_reason(tbe) is None  # every argument of FBGEMM's backward op is known by name
    assert hasattr(torch.ops.fbgemm, "split_embedding_codegen_grad_indice_weights_cpu")


def test_one_thread_keeps_fbgemm_s_path_where_it_is_as_fast(tmp_path, monkeypatch):
    from tests.strategy.test_torchrec_models import TABLE_WISE_PLAN, fit

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as a launcher sets it for a rank per core (Lightning then keeps it)
    threads = torch.get_num_threads()
    try:
        one = fit(0, 1, tmp_path, constraints=TABLE_WISE_PLAN, steps=1, threads=1)
    finally:
        torch.set_num_threads(threads)
    assert one["lookups"] and set(one["lookups"].values()) == {("fbgemm", 1)}


def test_a_tutorial_style_model_takes_the_cpu_lookup_and_trains_like_plain_pytorch(tmp_path, monkeypatch):
    """kt.values(), tables built on CPU with their own rows, dict batches, no logger; one rank with two threads (as
    Lightning gives one process on two cores), a plan that splits a table's columns: the same losses and held-out
    logits as plain PyTorch on the unsharded model."""
    from lightning_rec._strategy import cpu_lookup
    from tests.helpers import user_scenarios
    from tests.helpers.user_models import REORDERING_PLAN

    calls = []
    original = cpu_lookup.CpuLookup.__call__
    monkeypatch.setattr(
        cpu_lookup.CpuLookup, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        result = user_scenarios.fit(0, 1, tmp_path, constraints=REORDERING_PLAN)
    finally:
        torch.set_num_threads(threads)
    if torch.get_num_threads() < 2 and not calls:
        pytest.skip("one core: the CPU lookup is left out with one thread")
    assert calls, "the fused tables went through the CPU lookup"
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
    assert result["logits"] == pytest.approx(result["ref_logits"], abs=1e-5)
