"""recshard's CPU lookup (:mod:`lightning_rec._strategy.cpu_lookup`) against FBGEMM's own TBE: the same bits.

Two TBEs with the same tables and weights, one with FBGEMM's forward and one with :class:`CpuLookup`, take the same
steps: tables of three widths, two features sharing a table, empty bags, learnt per-sample weights; the outputs,
tables, optimizer state and the per-sample weights' gradients must be equal to the bit. Training through the strategy
is compared with unsharded TorchRec in ``test_torchrec_models.py`` (1 and 2 ranks).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

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
from lightning_rec._strategy import backward_threads, cpu_lookup
from lightning_rec._strategy.cpu_lookup import (
    FAST,
    FBGEMM,
    MIN_FAST_WORK,
    TRIAL_CALLS,
    TRIAL_STEPS,
    CpuLookup,
    PathTrial,
    choose_path,
    ineligible_reason,
    release_threads,
)
from lightning_rec.testing.bench import LOOKUP_SWEEP

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
    ours.forward = CpuLookup(ours, ours.forward, threads=threads, min_work=0)  # the split on every call (> 1 thread)
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
    assert one["lookups"] and set(one["lookups"].values()) == {("fbgemm", 1, False)}


@pytest.mark.parametrize("on_trial", [False, True], ids=["default", "every_call_on_trial"])
def test_a_tutorial_style_model_takes_the_cpu_lookup_and_trains_like_plain_pytorch(tmp_path, monkeypatch, on_trial):
    """kt.values(), tables built on CPU with their own rows, dict batches, no logger; one rank with two threads (as
    Lightning gives one process on two cores), a plan that splits a table's columns: the same losses and held-out
    logits as plain PyTorch on the unsharded model. ``on_trial``: every call measured, as a big model's are (a
    block on FBGEMM's path, then the split's)."""
    from tests.helpers import user_scenarios
    from tests.helpers.user_models import REORDERING_PLAN

    calls: list[str] = []
    original = cpu_lookup.CpuLookup.__call__

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(self.last)
        return out

    monkeypatch.setattr(cpu_lookup.CpuLookup, "__call__", counted)
    if on_trial:
        monkeypatch.setattr(cpu_lookup, "MIN_FAST_WORK", 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        result = user_scenarios.fit(
            0, 1, tmp_path, constraints=REORDERING_PLAN, steps=TRIAL_CALLS + 2 if on_trial else 5
        )
    finally:
        torch.set_num_threads(threads)
    if torch.get_num_threads() < 2 and not calls:
        pytest.skip("one core: the CPU lookup is left out with one thread")
    assert calls, "the fused tables went through the CPU lookup"
    if on_trial:
        assert FAST in calls and FBGEMM in calls, "the trial ran both paths"
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=1e-5)
    assert result["logits"] == pytest.approx(result["ref_logits"], abs=1e-5)


# The path the default allows at every row of benchmarks/cpu_lookup_sweep.py (BENCHMARKS.md, "Never slower than
# FBGEMM's path"): FBGEMM's wherever the sweep measured the split slower than FBGEMM's path run without the split's
# threads (up to 2x at small); at realistic and large (FAST) the split where a trial of both measures it faster;
# never with one thread.
SWEEP_PATHS = {
    "issue_tiny": FBGEMM,
    "tiny": FBGEMM,
    "small": FBGEMM,
    "medium": FBGEMM,
    "medium_wide": FBGEMM,
    "realistic": FAST,
    "large": FAST,
}


@pytest.mark.parametrize("size", LOOKUP_SWEEP, ids=lambda s: s.name)
def test_the_default_leaves_small_lookups_to_fbgemm_at_every_size_of_the_sweep(size):
    assert choose_path(size.ids_per_step(), size.dim, threads=2) == SWEEP_PATHS[size.name]
    assert choose_path(size.ids_per_step(), size.dim, threads=1) == FBGEMM


def _uniform_tbe(tables, rows, dim):
    spec = (rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen([spec] * tables, optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1)


def test_a_small_lookup_keeps_fbgemm_s_path_and_a_big_one_splits_call_by_call():
    """Issue 38's tiny model (3 tables x 100 x 16, batch 64, one id each) with two threads: FBGEMM's path, no trial;
    the same lookup with as many ids as the threshold asks: on trial (a block on FBGEMM's path, then the split). Same
    bits on every call."""
    tbe, ref = _uniform_tbe(3, 100, 16), _uniform_tbe(3, 100, 16)
    with torch.no_grad():
        for a, b in zip(tbe.split_embedding_weights(), ref.split_embedding_weights()):
            b.copy_(a)
    lookup = CpuLookup(tbe, tbe.forward, threads=2)
    lookup.enable()
    g = torch.Generator().manual_seed(0)
    big = -(-MIN_FAST_WORK // (3 * 16))  # bags of one id
    paths = []
    for batch in [64] + [big] * (TRIAL_STEPS + 2):  # the tiny call; the trial's FBGEMM block and the split's first
        ids = torch.randint(0, 100, (3 * batch,), generator=g)
        offsets = torch.arange(3 * batch + 1)
        out, want = tbe(ids, offsets), ref(ids, offsets)
        paths.append(lookup.last)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        out.sum().backward()
        want.sum().backward()
        for a, b in zip(tbe.split_embedding_weights(), ref.split_embedding_weights()):
            assert torch.equal(a, b)
    assert paths == [FBGEMM] * (TRIAL_STEPS + 2) + [FAST]
    assert len(lookup.trial.times[FBGEMM]) == TRIAL_STEPS and not lookup.trial.times[FAST]  # the tiny call untimed
    lookup.enable(False)


def test_a_trial_keeps_the_faster_path_and_measures_again():
    trial = PathTrial(steps=2, retry_every=3)
    # training calls at these times: the split's steps take 3 s, FBGEMM's 1 s, but each block's first step 100 s
    paths, now = [], 0.0
    for _ in range(6):
        paths.append(trial.next(now))
        now += 100.0 if len(paths) in (1, 4) else 3.0 if paths[-1] == FAST else 1.0
    assert paths == [FBGEMM] * 3 + [FAST] * 3 and trial.chosen is None
    assert trial.times == {FAST: [3.0], FBGEMM: [1.0, 1.0]}  # the warm-up steps are not in them (the last is open)
    assert [trial.next(now + i) for i in range(3)] == [FBGEMM] * 3 and trial.chosen == FBGEMM
    assert trial.times == {FAST: [3.0, 3.0], FBGEMM: [1.0, 1.0]}
    assert trial.next(now + 3) == FBGEMM and trial.chosen is None  # retry_every calls later: on trial again
    assert trial.times == {FAST: [], FBGEMM: []}
    # the other way round: the split faster (after each block's untimed call)
    trial, now = PathTrial(steps=1), 0.0
    for _ in range(4):
        now += 1.0 if trial.next(now) == FAST else 2.0
    assert trial.next(now) == FAST and trial.chosen == FAST


def test_calls_without_grad_follow_the_trial_s_choice_and_time_nothing():
    tbe = _uniform_tbe(3, 100, 16)
    lookup = CpuLookup(tbe, tbe.forward, threads=2, min_work=1)
    lookup.enable()
    ids, offsets = torch.arange(6) % 100, torch.arange(7)
    with torch.no_grad():
        tbe(ids, offsets)
    assert lookup.last == FBGEMM and lookup.trial.times == {FAST: [], FBGEMM: []}
    lookup.trial.chosen = FAST
    with torch.no_grad():
        tbe(ids, offsets)
    assert lookup.last == FAST


def test_a_model_s_lookups_share_one_trial_and_fbgemm_s_path_runs_without_the_split_s_threads(monkeypatch):
    """Two TBEs of one model, sharing a trial as install_cpu_lookup gives them one: the first to be called leads (its
    calls are timed), the other takes the same path in the same step. Whenever a step is on FBGEMM's path, the split's
    backward threads are stopped before it runs (FBGEMM's path runs as in a process that never split:
    :func:`release_threads`), and they stay stopped once the trial keeps FBGEMM's path."""
    release_threads()
    now = [0.0]
    monkeypatch.setattr(cpu_lookup.time, "perf_counter", lambda: now[0])
    trial = PathTrial(steps=2, retry_every=100)
    tbes = [_uniform_tbe(4, 100, 16) for _ in range(2)]  # 4 tables, 2 threads: the split's backward uses the pool
    lookups = [CpuLookup(tbe, tbe.forward, threads=2, min_work=1, trial=trial) for tbe in tbes]
    for lookup in lookups:
        lookup.enable()
    ids, offsets = torch.arange(4 * 8) % 100, torch.arange(4 * 8 + 1)
    steps = []
    for _ in range(10):
        outs = [tbe(ids, offsets) for tbe in tbes]
        paths = [lookup.last for lookup in lookups]
        threads_in_forward = bool(backward_threads._POOLS)
        sum(out.sum() for out in outs).backward()
        steps.append((paths, threads_in_forward, bool(backward_threads._POOLS)))
        now[0] += 3.0 if paths[0] == FAST else 1.0  # the split's steps take 3 s, FBGEMM's 1 s
    assert [p for p, _, _ in steps] == [[FBGEMM] * 2] * 3 + [[FAST] * 2] * 3 + [[FBGEMM] * 2] * 4
    assert trial.chosen == FBGEMM and trial.times == {FAST: [3.0, 3.0], FBGEMM: [1.0, 1.0]}
    for paths, in_forward, after_backward in steps:
        if paths[0] == FAST:
            assert after_backward, "the split's backward ran on its threads"
        else:
            assert not in_forward and not after_backward, "FBGEMM's step ran beside the split's threads"
    lookups[0].enable(False)
    lookups[1].enable(False)


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc (Linux)")
def test_the_split_s_threads_start_no_openmp_workers_of_their_own(monkeypatch):
    """Each backward thread of the split runs one group of tables on one intra-op thread. A thread that ran an OpenMP
    region with more would keep a team of OpenMP workers for as long as it lives: more OpenMP threads than cores, and
    GNU OpenMP then makes every parallel region of the process wait for its workers to wake (the module docstring).
    So the pool adds exactly its own threads to the process, each with one intra-op thread, and the caller keeps its
    count. Counted, not timed: the OS threads started in the process during the steps."""
    release_threads()
    torch.exp(torch.ones(1 << 21))  # the main thread's own OpenMP team exists before the count
    tbe = _uniform_tbe(4, 1000, 16)  # 4 tables: two groups of two on two threads
    lookup = CpuLookup(tbe, tbe.forward, threads=2, min_work=0)
    lookup.enable()
    try:
        caller = torch.get_num_threads()
        ids, offsets = torch.arange(4 * 512 * 8) % 1000, torch.arange(0, 4 * 512 * 8 + 1, 8)  # big enough to split
        before = _os_threads()
        for _ in range(3):
            tbe(ids, offsets).sum().backward()
        assert len(_os_threads() - before) == 2, "the split's two threads, and no OpenMP worker of theirs"
        assert torch.get_num_threads() == caller
        pool = backward_threads._POOLS[2]
        assert [f.result() for f in [pool.submit(torch.get_num_threads) for _ in range(4)]] == [1] * 4

        # A thread whose count was set again after it started (a library's first parallel loop, say) makes the pool
        # start anew at the end of the step, its threads with one intra-op thread again.
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        tbe(ids, offsets).sum().backward()
        assert not backward_threads._POOLS
    finally:
        lookup.enable(False)


def test_a_backward_thread_that_cannot_start_fails_the_step_and_leaves_no_thread_waiting(monkeypatch):
    """The split starts its threads together (each waits for the others); if one cannot start (the process is out
    of threads, say), the step fails with that error, the started thread is let go and the pool is dropped: no
    thread is left waiting, which would hang the process at exit. The caller keeps its intra-op thread count."""
    release_threads()
    tbe = _uniform_tbe(4, 100, 8)
    lookup = CpuLookup(tbe, tbe.forward, threads=2, min_work=0)
    lookup.enable()
    submitted = []
    real_submit = ThreadPoolExecutor.submit

    def submit(self, fn, *args, **kwargs):
        if submitted:
            raise RuntimeError("can't start new thread")
        submitted.append(fn)
        return real_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", submit)
    caller = torch.get_num_threads()
    errors = []

    def step():  # on a thread of its own, so that a thread left waiting fails the test instead of hanging it
        ids, offsets = torch.arange(4 * 16) % 100, torch.arange(4 * 16 + 1)
        try:
            tbe(ids, offsets).sum().backward()
        except RuntimeError as error:
            errors.append(str(error))

    try:
        runner = threading.Thread(target=step, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive(), "the step waits for a thread that never started"
        assert errors == ["can't start new thread"]
        assert not backward_threads._POOLS and torch.get_num_threads() == caller
    finally:
        lookup.enable(False)
