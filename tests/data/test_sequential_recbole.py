"""RecBole's sequential protocol (``MovieLensSequenceDataModule(protocol="recbole")``, issue 48): the order, the
every-prefix examples and their leave-one-out split checked against RecBole 1.2.1's own output on a hand-made table,
the packed training rows against those examples, the evaluation rows on MovieLens-100K, and the full-ranking rule
(only id 0 excluded; ``torch.topk``) through the module's evaluation."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_rec.config import SparseFeature
from lightning_rec.data._sequential_recbole import PrefixExamples, prefix_examples, prefix_windows, user_sequences
from lightning_rec.data.movielens_sequential import MovieLensSequenceDataModule
from lightning_rec.models.sequential import SequentialRecModule, full_softmax_loss
from tests.helpers.data import movielens_dir

# A hand-made atomic file (user, item, timestamp; file order), with ties in time, users of 1 to 7 items and rows out
# of order. The expected examples below are what RecBole 1.2.1 printed for it (SequentialDataset + build(), GRU4Rec,
# MAX_ITEM_LIST_LENGTH 3, eval_args {group_by: user, order: TO, split: {LS: valid_and_test}}), regrouped by user:
# (history, target) in time order. User 2 (one item) has no example; user 3 (two) one training example; user 4
# (three) a training and a test example, no validation.
HAND = [
    (5, 1, 50), (1, 3, 10), (5, 2, 20), (5, 3, 20), (2, 4, 5), (5, 4, 10), (3, 5, 1), (3, 6, 1), (4, 7, 3),
    (4, 8, 2), (4, 9, 1), (5, 5, 60), (5, 6, 60), (5, 7, 70), (1, 8, 10), (1, 9, 10), (1, 2, 30), (6, 1, 9),
    (6, 2, 8), (6, 3, 7), (6, 4, 6), (6, 5, 5), (6, 6, 4),
]  # fmt: skip
RECBOLE = {
    "train": {
        1: [([3], 8)],
        3: [([5], 6)],
        4: [([9], 8)],
        5: [([4], 2), ([4, 2], 3), ([4, 2, 3], 1), ([2, 3, 1], 5)],
        6: [([6], 5), ([6, 5], 4), ([6, 5, 4], 3)],
    },
    "val": {1: [([3, 8], 9)], 5: [([3, 1, 5], 6)], 6: [([5, 4, 3], 2)]},
    "test": {1: [([3, 8, 9], 2)], 4: [([9, 8], 7)], 5: [([1, 5, 6], 7)], 6: [([4, 3, 2], 1)]},
}


def _table(rows: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    user, item, time = (torch.tensor(c) for c in zip(*rows))
    return user, item, time


def _by_user(ex: PrefixExamples) -> dict[int, list[tuple[list[int], int]]]:
    out: dict[int, list[tuple[list[int], int]]] = {}
    off = ex.history.offsets.tolist()
    for i, u in enumerate(ex.users.tolist()):
        out.setdefault(u, []).append((ex.history.values[off[i] : off[i + 1]].tolist(), int(ex.target[i])))
    return out


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_examples_are_recboles(split: str) -> None:
    seqs = user_sequences(*_table(HAND))
    assert seqs.users.tolist() == [1, 2, 3, 4, 5, 6]
    assert _by_user(prefix_examples(seqs, split, max_len=3)) == RECBOLE[split]


def _recbole_reference(rows: list[tuple[int, int, int]], max_len: int) -> dict[str, dict]:
    """RecBole's data_augmentation + leave_one_out transcribed loop for loop (stable sorts by time then user; the
    window ``seq_start``; ``_split_index_by_leave_one_out(leave_one_num=2)`` over each user's examples)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i][2])
    order = sorted(order, key=lambda i: rows[i][0])
    examples: dict[int, list] = {}
    seq_start, last = 0, None
    for i, r in enumerate(order):
        uid = rows[r][0]
        if uid != last:
            last, seq_start = uid, i
            continue
        if i - seq_start > max_len:
            seq_start += 1
        examples.setdefault(uid, []).append(([rows[order[j]][1] for j in range(seq_start, i)], rows[r][1]))
    out: dict[str, dict] = {"train": {}, "val": {}, "test": {}}
    for uid, ex in examples.items():
        held = min(2, len(ex) - 1)
        cut = len(ex) - held
        if cut:
            out["train"][uid] = ex[:cut]
        for name, e in zip(("val", "test")[2 - held :], ex[cut:]):
            out[name][uid] = [e]
    return out


def test_examples_match_recboles_loop_on_random_tables() -> None:
    rng = random.Random(0)
    for _ in range(20):
        rows = [(rng.randrange(1, 8), rng.randrange(1, 30), rng.randrange(0, 6)) for _ in range(rng.randrange(1, 60))]
        seqs = user_sequences(*_table(rows))
        want = _recbole_reference(rows, max_len=4)
        for split in ("train", "val", "test"):
            assert _by_user(prefix_examples(seqs, split, max_len=4)) == want[split]


def _packed(rows: list[tuple[int, int, int]], max_len: int, stride: int) -> dict[int, list]:
    """The (history, target) examples the packed rows train: each row's positions from train_from on."""
    w = prefix_windows(user_sequences(*_table(rows)), max_len=max_len, stride=stride)
    off = w.history.offsets.tolist()
    out: dict[int, list] = {}
    for r, u in enumerate(w.users.tolist()):
        hist, tgt = w.history.values[off[r] : off[r + 1]].tolist(), w.target.values[off[r] : off[r + 1]].tolist()
        assert len(hist) <= max_len
        for t in range(int(w.train_from[r]), len(hist)):
            out.setdefault(u, []).append((hist[: t + 1], tgt[t]))
    return out


@pytest.mark.parametrize("stride", [1, 2, 4])
def test_packed_rows_train_every_example_once(stride: int) -> None:
    """stride 1: exactly RecBole's training examples; any stride: every training target once, in order, from a
    suffix of its RecBole history at least max_len - stride + 1 long (its whole prefix when shorter)."""
    rng = random.Random(1)
    for _ in range(10):
        rows = [(rng.randrange(1, 5), rng.randrange(1, 30), rng.randrange(0, 9)) for _ in range(rng.randrange(2, 70))]
        want = _recbole_reference(rows, max_len=4)["train"]
        got = _packed(rows, max_len=4, stride=stride)
        if stride == 1:
            assert got == want
        assert {u: [t for _, t in ex] for u, ex in got.items()} == {u: [t for _, t in ex] for u, ex in want.items()}
        for u, ex in want.items():
            for (hist, _), (full, _) in zip(got[u], ex):
                assert full[len(full) - len(hist) :] == hist and len(hist) >= min(len(full), 4 - stride + 1)


@pytest.fixture(scope="module")
def dm() -> MovieLensSequenceDataModule:
    return MovieLensSequenceDataModule(
        str(movielens_dir()), download=False, protocol="recbole", num_negatives=0, train_stride=10
    )


def test_movielens_rows(dm: MovieLensSequenceDataModule) -> None:
    """943 users, all with >= 20 ratings: one validation and one test example each, 100,000 - 3 * 943 training
    examples; evaluation rows exclude nothing (RecBole's FullSortEvalDataLoader builds no history for a
    sequential model) and hold the 50 most recent items."""
    seqs = dm.sequences
    lengths = seqs.lengths()
    ends = seqs.items.offsets[1:]
    for stage, back in (("val", 2), ("test", 1)):
        ds = dm.split(stage)
        assert len(ds) == 943 and ds.seen is not None and ds.seen.values.numel() == 0
        assert ds.target.values.tolist() == seqs.items.values[ends - back].tolist()
        assert ds.history.offsets.diff().tolist() == (lengths - back).clamp(max=50).tolist()
    train = dm.split("train")
    trained = train.history.offsets.diff() - train.train_from
    assert int(trained.sum()) == 100_000 - 3 * 943
    batch = train[(0, torch.arange(4))]
    assert batch["features"]["catalog"].values().tolist() == list(range(dm.num_items))
    assert batch["features"]["negatives"].values().numel() == 0 and batch["train_from"].shape == (4,)


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"protocol 'RecBole' is not one of 'project', 'recbole'; did you mean"):
        MovieLensSequenceDataModule(protocol="RecBole")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_negatives must be >= 1, got 0"):
        MovieLensSequenceDataModule(num_negatives=0)
    with pytest.raises(ValueError, match=r"train_stride must be in \[1, max_len=50\], got 51"):
        MovieLensSequenceDataModule(protocol="recbole", train_stride=51)
    with pytest.raises(ValueError, match="loss 'full' is not one of"):
        SequentialRecModule([SparseFeature("item", 10, multi_hot=True)], loss="full")  # type: ignore[arg-type]


class _FixedScores(SequentialRecModule):
    """The module's evaluation over given last states and catalog embeddings (no network)."""

    def __init__(self, last: torch.Tensor, catalog: torch.Tensor) -> None:
        super().__init__([SparseFeature("item", catalog.shape[0], multi_hot=True)], metrics="recbole", ks=[2])
        self.fixed = {"last": last, "catalog": catalog}

    def forward(self, batch: dict) -> dict:
        return self.fixed


def test_full_ranking_excludes_only_padding(dm: MovieLensSequenceDataModule) -> None:
    """Row 0 of the test split: its own history items scored highest still take the top places (RecBole ranks
    them); id 0 scored highest never does; the target third."""
    batch = dm.split("test")[torch.tensor([0])]
    history = batch["features"]["history"].values()
    target = int(batch["features"]["target"].values()[0])
    scores = torch.zeros(dm.num_items)
    scores[0] = 10.0
    scores[history[:2]] = torch.tensor([5.0, 4.0])
    scores[target] = 3.0
    module = _FixedScores(torch.ones(1, 1), scores.unsqueeze(1))
    module._evaluate(batch, module.test_metrics)
    got = {k: round(v.item(), 6) for k, v in module.test_metrics.compute().items()}
    assert got["test/hit@2"] == 0.0  # places 0 and 1: the two history items
    scores[history[1]] = 2.0  # now the target is second
    module.test_metrics.reset()
    module._evaluate(batch, module.test_metrics)
    got = {k: round(v.item(), 6) for k, v in module.test_metrics.compute().items()}
    assert got["test/hit@2"] == 1.0 and got["test/mrr@2"] == 0.5


def test_full_softmax_loss_is_mean_ce_over_trained_positions() -> None:
    torch.manual_seed(0)
    hidden, catalog = torch.randn(2, 4, 3), torch.randn(6, 3)
    out = {"hidden": hidden, "lengths": torch.tensor([4, 2]), "catalog": catalog}
    targets = torch.tensor([[1, 2, 3, 4], [5, 1, 0, 0]])
    got = full_softmax_loss(out, targets, train_from=torch.tensor([2, 0]))
    terms = []
    for row, positions in ((0, (2, 3)), (1, (0, 1))):
        for t in positions:
            logits = hidden[row, t] @ catalog[1:].T  # id 0 is never ranked
            terms.append(torch.logsumexp(logits, 0) - logits[targets[row, t] - 1])
    assert got.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


def test_gru4rec_is_recboles_forward() -> None:
    """GRU4Rec's hidden states and last state equal RecBole's ``GRU4Rec.forward`` (embedding, GRU without biases,
    dense, gathered at ``item_seq_len - 1``) run on each row alone, unpadded: padding never reaches a row."""
    from torchrec import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from lightning_rec.config import SEQUENCE_FEATURES
    from lightning_rec.models.sequential import GRU4Rec

    torch.manual_seed(0)
    net = GRU4Rec(20, embedding_dim=8, max_len=5, hidden_size=6).eval()
    net.item_ec = EmbeddingCollection(tables=net.item_ec.embedding_configs(), device=torch.device("cpu"))
    rows = [[3, 4, 5], [7], [1, 2, 3, 4, 5]]
    lengths = torch.tensor([len(r) for r in rows] + [0] * 9)  # history, then empty target/negatives/catalog
    kjt = KeyedJaggedTensor(keys=list(SEQUENCE_FEATURES), values=torch.tensor(sum(rows, [])), lengths=lengths)
    with torch.no_grad():
        out = net(kjt)
        table = net.item_ec.embeddings["t_item"].weight
        for i, r in enumerate(rows):
            states, _ = net.encoder.gru(table[torch.tensor(r)].unsqueeze(0))
            want = net.encoder.dense(states[0])
            assert torch.allclose(out["hidden"][i, : len(r)], want, atol=1e-6)
            assert torch.allclose(out["last"][i], want[-1], atol=1e-6)
    assert net.encoder.gru.bias is False and net.encoder.gru.hidden_size == 6
