"""RecBole's sequential protocol (``MovieLensSequenceDataModule(protocol="recbole")``), written against RecBole 1.2.1
so each step can be checked against the function it follows (``recbole/data/dataset/sequential_dataset.py``,
``recbole/data/dataset/dataset.py``, ``recbole/data/dataloader/general_dataloader.py``).

1. **Order.** ``SequentialDataset.data_augmentation`` calls ``Dataset.sort(by=[user_id, timestamp])``, which is
   ``Interaction.sort``: a *stable* ``np.argsort`` by the last key, then by the first. So each user's interactions
   are in time order, ties in the order of the atomic file (no filtering happens in the quick-start config, so the
   file order is RecBole's load order).
2. **Examples.** ``data_augmentation`` turns a user's items ``x_0 .. x_{n-1}`` into ``n - 1`` examples: the target
   ``x_i`` (``i >= 1``) with the history ``x_{max(0, i - L)} .. x_{i-1}`` (``L = MAX_ITEM_LIST_LENGTH``, 50), the
   most recent items kept.
3. **Split.** ``Dataset.build`` sorts the examples by time (``order: TO``, stable: a user's examples keep the order
   of step 1) and ``Dataset.leave_one_out(group_by=user_id, "valid_and_test")``, i.e.
   ``_split_index_by_leave_one_out(leave_one_num=2)``: of a user's ``m = n - 1`` examples, ``min(2, m - 1)`` are
   held out, the last for test and (when two are held out) the one before it for validation. A user with 4 or more
   items has ``m - 2`` training examples, one validation and one test example; 3 items: one training and one test
   example (no validation); 2 items: one training example; 1 item: none.
4. **Ranking.** ``FullSortEvalDataLoader`` builds no history for a sequential model (``is_sequential``: its
   ``collate_fn`` returns ``history_index=None``), so ``Trainer._full_sort_batch_eval`` excludes only the padding
   id 0 (``scores[:, 0] = -inf``): every real item is ranked, including those already in the user's history. Each
   evaluation example has one positive, its target.

Training rows (:func:`prefix_windows`): a causal network (SASRec, a GRU) that reads a row left to right encodes
*every* prefix of it in one pass, so the training examples of step 2 are packed into rows of at most ``L`` inputs:
a row starting at item ``a`` trains position ``t`` on target ``x_{a+t+1}`` from the history ``x_a .. x_{a+t}``.
``stride = 1`` packs exactly RecBole's examples (row ``a > 0`` trains only its last position, whose history is the
example's ``L`` most recent items; row 0 trains targets ``1 .. L`` from their whole prefixes); a larger stride ``s``
trains every training target exactly once per epoch from a history of its ``L - s + 1`` to ``L`` most recent items
(all of them for the first ``L`` targets), at about ``1/s`` of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_rec.data.base import Jagged

__all__ = ["PrefixExamples", "PrefixWindows", "UserSequences", "prefix_examples", "prefix_windows", "user_sequences"]


def _jagged(values: torch.Tensor, lengths: torch.Tensor) -> Jagged:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Jagged(values.long(), offsets)


@dataclass(frozen=True)
class UserSequences:
    """Every user's items in RecBole's order (step 1 of the module docstring).

    Attributes:
        users: ``(U,)`` user ids, ascending.
        items: row ``u``: user ``users[u]``'s items, by time, ties in input order.
    """

    users: torch.Tensor
    items: Jagged

    def lengths(self) -> torch.Tensor:
        """``(U,)`` each user's number of items."""
        return self.items.offsets.diff()


def user_sequences(user: torch.Tensor, item: torch.Tensor, timestamp: torch.Tensor) -> UserSequences:
    """Each user's items in RecBole's ``Interaction.sort(by=[user_id, timestamp])`` order: stable by time, then
    stable by user (ties in time keep the input order).

    Example::

        >>> s = user_sequences(torch.tensor([2, 1, 2, 2]), torch.tensor([9, 4, 8, 7]), torch.tensor([5, 0, 1, 1]))
        >>> s.users.tolist(), s.items.values.tolist(), s.items.offsets.tolist()   # user 2: times 1, 1 (8 first), 5
        ([1, 2], [4, 8, 7, 9], [0, 1, 4])
    """
    if not (user.shape == item.shape == timestamp.shape) or user.dim() != 1:
        raise ValueError(
            f"user_sequences: user, item and timestamp must be 1-D of one length, got {tuple(user.shape)}, "
            f"{tuple(item.shape)}, {tuple(timestamp.shape)}. HINT: pass Interactions' columns."
        )
    by_time = torch.sort(timestamp, stable=True).indices
    order = by_time[torch.sort(user[by_time], stable=True).indices]
    users, counts = torch.unique_consecutive(user[order], return_counts=True)
    return UserSequences(users, _jagged(item[order], counts))


def _held_out(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(has_val, has_test)`` per user: RecBole's ``_split_index_by_leave_one_out(leave_one_num=2)`` over the
    ``n - 1`` examples of a user with ``n`` items holds out ``min(2, n - 2)`` of them (the last: test)."""
    examples = (lengths - 1).clamp(min=0)
    held = (examples - 1).clamp(min=0, max=2)
    return held >= 2, held >= 1


@dataclass(frozen=True)
class PrefixExamples:
    """RecBole's augmented examples of one split (``SequentialDataset.data_augmentation`` then
    ``Dataset.leave_one_out``), one row each.

    Attributes:
        users: ``(E,)`` the user of each example.
        history: each example's history, oldest first (at most ``max_len`` items).
        target: ``(E,)`` the item to predict.
    """

    users: torch.Tensor
    history: Jagged
    target: torch.Tensor


def _examples(seqs: UserSequences, user_rows: list[int], positions: list[int], max_len: int) -> PrefixExamples:
    offsets = seqs.items.offsets
    histories = [
        seqs.items.values[offsets[u] + max(0, p - max_len) : offsets[u] + p] for u, p in zip(user_rows, positions)
    ]
    lengths = torch.tensor([h.numel() for h in histories], dtype=torch.long)
    values = torch.cat(histories) if histories else torch.zeros(0, dtype=torch.long)
    index = torch.tensor([int(offsets[u]) + p for u, p in zip(user_rows, positions)], dtype=torch.long)
    return PrefixExamples(
        seqs.users[torch.tensor(user_rows, dtype=torch.long)], _jagged(values, lengths), seqs.items.values[index]
    )


def prefix_examples(seqs: UserSequences, split: str, max_len: int = 50) -> PrefixExamples:
    """The examples of ``split`` (``"train"``, ``"val"`` or ``"test"``) exactly as RecBole builds them (steps 2
    and 3 of the module docstring), users ascending, each user's examples in time order.

    Example::

        >>> s = user_sequences(torch.tensor([1] * 5 + [2] * 3), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.arange(8))
        >>> t = prefix_examples(s, "train", max_len=2)
        >>> t.users.tolist(), t.history.values.tolist(), t.history.offsets.tolist(), t.target.tolist()
        ([1, 1, 2], [1, 1, 2, 6], [0, 1, 3, 4], [2, 3, 7])
        >>> v, e = prefix_examples(s, "val", 2), prefix_examples(s, "test", 2)
        >>> v.users.tolist(), v.target.tolist(), e.users.tolist(), e.history.values.tolist(), e.target.tolist()
        ([1], [4], [1, 2], [3, 4, 6, 7], [5, 8])
    """
    if split not in ("train", "val", "test"):
        raise ValueError(f"prefix_examples: split must be 'train', 'val' or 'test', got {split!r}.")
    lengths = seqs.lengths()
    has_val, has_test = _held_out(lengths)
    user_rows: list[int] = []
    positions: list[int] = []
    for u, (n, v, t) in enumerate(zip(lengths.tolist(), has_val.tolist(), has_test.tolist())):
        if split == "train":
            last = n - int(v) - int(t)  # training targets are positions 1 .. last - 1
            user_rows += [u] * max(0, last - 1)
            positions += range(1, last)
        elif (split == "val" and v) or (split == "test" and t):
            user_rows.append(u)
            positions.append(n - 2 if split == "val" else n - 1)
    return _examples(seqs, user_rows, positions, max_len)


@dataclass(frozen=True)
class PrefixWindows:
    """The training examples of :func:`prefix_examples` packed into rows (see the module docstring).

    Attributes:
        users: ``(R,)`` the user of each row.
        history: each row's inputs (at most ``max_len``).
        target: each row's next items (same lengths as ``history``: position ``t`` predicts ``target[t]``).
        train_from: ``(R,)`` the first position of each row that is a training example (earlier positions are
            context only: their targets are trained in an earlier row).
    """

    users: torch.Tensor
    history: Jagged
    target: Jagged
    train_from: torch.Tensor


def prefix_windows(seqs: UserSequences, max_len: int = 50, stride: int = 1) -> PrefixWindows:
    """Pack every training example of ``seqs`` into rows of at most ``max_len`` inputs, starting every ``stride``
    items (see the module docstring); ``stride=1`` is RecBole's ``data_augmentation`` exactly.

    Every training target is trained at exactly one position of one row, with a history of at least
    ``max_len - stride + 1`` of its most recent items (its whole prefix when shorter).

    Example::

        >>> s = user_sequences(torch.tensor([1] * 6), torch.tensor([1, 2, 3, 4, 5, 6]), torch.arange(6))
        >>> w = prefix_windows(s, max_len=2, stride=1)   # training items 1..4: targets 2, 3, 4
        >>> [r.tolist() for r in w.history.values.split(w.history.offsets.diff().tolist())], w.train_from.tolist()
        ([[1, 2], [2, 3]], [0, 1])
        >>> w.target.values.tolist()
        [2, 3, 3, 4]
    """
    if max_len < 1 or stride < 1 or stride > max_len:
        raise ValueError(
            f"prefix_windows: need 1 <= stride <= max_len, got stride={stride}, max_len={max_len}. "
            "HINT: stride=1 is RecBole's every-prefix augmentation; stride=max_len the cheapest packing."
        )
    lengths = seqs.lengths()
    has_val, has_test = _held_out(lengths)
    train_items = lengths - has_val.long() - has_test.long()  # items x_0 .. x_{m-1}: targets 1 .. m-1
    users: list[int] = []
    starts: list[int] = []
    ends: list[int] = []  # exclusive end of the inputs, in the user's sequence
    train_from: list[int] = []
    for u, m in enumerate(train_items.tolist()):
        if m < 2:
            continue
        users.append(u)
        starts.append(0)
        ends.append(min(max_len, m - 1))
        train_from.append(0)
        # row a > 0 trains the targets p with ceil((p - max_len) / stride) * stride == a, i.e. a - stride + max_len
        # < p <= a + max_len: the positions t = p - a - 1 >= max_len - stride
        a = stride
        while a - stride + max_len < m - 1:
            users.append(u)
            starts.append(a)
            ends.append(min(a + max_len, m - 1))
            train_from.append(max_len - stride)
            a += stride
    offsets = seqs.items.offsets
    base = offsets[torch.tensor(users, dtype=torch.long)] if users else torch.zeros(0, dtype=torch.long)
    start_t = base + torch.tensor(starts, dtype=torch.long)
    row_len = torch.tensor(ends, dtype=torch.long) - torch.tensor(starts, dtype=torch.long)
    index = torch.repeat_interleave(start_t, row_len) + (
        torch.arange(int(row_len.sum())) - torch.repeat_interleave(torch.cumsum(row_len, 0) - row_len, row_len)
    )
    values = seqs.items.values
    return PrefixWindows(
        seqs.users[torch.tensor(users, dtype=torch.long)],
        _jagged(values[index], row_len),
        _jagged(values[index + 1], row_len),
        torch.tensor(train_from, dtype=torch.long),
    )
