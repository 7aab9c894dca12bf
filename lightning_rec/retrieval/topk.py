"""Exact top-k retrieval over a catalogue too large for a queries x items score matrix, in bounded memory.

:class:`StreamingTopK` keeps, for each of ``Q`` queries, the ``k`` best items seen so far and takes the catalogue in
chunks of rows, so its memory is ``O(Q * k + query_block * item_block)`` whatever the catalogue's size (10k queries x
10M items would be a 400 GB ``float32`` matrix). :func:`~lightning_rec.retrieval.sharded_topk.catalogue_topk` runs it on every rank over the rows of a
row-wise sharded candidate table that the rank holds itself, looked up through the sharded module, and merges the
ranks' ``(Q, k)`` lists (an all-gather of ``Q x k``; the table is never gathered). :meth:`ExactTopK.hits` turns a result
into the hit matrix of :class:`~lightning_rec.metrics.TopKMetrics` (RecBole's recall, MRR, NDCG, hit, precision).

**Exact, yet mostly in bfloat16.** Every query-item pair is first scored by a ``bfloat16`` matrix product (the
*screen*: inputs rounded to bf16, products accumulated in fp32) at several times fp32's speed on CPUs with bf16 dot
products (AVX512-BF16, AMX). The screen's error has a proven bound (:func:`screen_error_bound`)::

    |screen(q, c) - q.c|  <=  alpha(d) * |q| * |c|  +  2^-126 * (d + sqrt(d) * (|q| + |c|))

    alpha(d) = (2u + u^2) + g(1 + u)^2 + u(1 + u)^2(1 + g),   u = 2^-8 (bf16),  g = d 2^-24 / (1 - d 2^-24)

(the inputs' rounding, then fp32 accumulation of ``d`` products, then the result's rounding to bf16; the second term
covers denormals flushed to zero). The *exact* score of a pair is ``q.c`` in float64 (every product of two fp32
numbers is exact in float64; the sum is the only rounding, ``<= d 2^-53`` relative, far below fp32's resolution).
A query's ``k``-th best exact score so far, ``tau``, is a lower bound of its final ``k``-th best, so an item can only
enter the top ``k`` if its screened score is ``>= tau - margin``; every such item is rescored exactly and merged,
all others are provably out. The result is therefore the exact top-``k`` (equal to a brute-force ranking of the
full float64, or fp32 where fp32 is exact, score matrix), not an approximation.

**Ties** are broken by the lower item id: among equal exact scores the lower id ranks first, as a stable
descending sort of the full score row would order them (``torch.topk`` leaves their order unspecified). Excluded
items never rank; a query with fewer than ``k`` items left gets ``-inf`` scores and id ``-1`` in its last places.

Example::

    from lightning_rec.retrieval import StreamingTopK
    stream = StreamingTopK(queries, k=10, exclude_ids=seen, exclude_lengths=seen_per_query)
    for start in range(0, num_items, 65536):
        stream.add(item_rows(start, start + 65536), first_id=start)   # any order, any chunk sizes
    top = stream.result()                  # top.item_ids (Q, 10) int64, top.scores (Q, 10) float64
    hits, positives = top.hits(positive_ids, positive_lengths)
    metrics = TopKMetrics(ks=(10,)); metrics.update(hits, positives)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "StreamingTopK",
    "ExactTopK",
    "merge_topk",
    "screen_error_bound",
]

_U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits), round to nearest
_U_FP32 = 2.0**-24
_FLUSHED = 2.0**-126  # the smallest normal float32/bfloat16: below it, bf16 dot-product units flush to zero
_EMPTY = torch.iinfo(torch.int64).max  # the id of an empty slot while streaming (sorts after every real id)
_SEGMENT = 256  # items per segment of a screen row whose maximum is checked (see StreamingTopK._block)
_KEY = 2**40  # exclusions are kept as query * _KEY + item
_MAX_NORM_PRODUCT = 2.0**60  # |q| |c| above this could overflow the screen (bf16 and fp32 end near 2^128)


def screen_error_bound(dim: int) -> float:
    """``alpha(d)``: the bf16 screen's relative error bound, ``|screen(q, c) - q.c| <= alpha(d) |q| |c|`` (plus the
    tiny absolute term of flushed denormals, see the module docstring).

    Derivation (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1): rounding each input to bf16 changes
    each product ``q_i c_i`` by at most ``(2u + u^2)|q_i c_i|``; a product of two bf16 numbers is exact in fp32 and
    ``d`` fp32 additions add at most ``g * sum|q^_i c^_i| <= g (1 + u)^2 sum|q_i c_i|``; rounding the fp32 result to
    bf16 adds ``u`` times its size ``<= (1 + u)^2 (1 + g) sum|q_i c_i|``; and ``sum|q_i c_i| <= |q| |c|``
    (Cauchy-Schwarz). A factor ``1 + 2^-16`` covers the float64 rounding of the norms and of the margin itself.

    Args:
        dim: the embedding dimension ``d``.

    Returns:
        ``alpha(d)``; about ``0.0117`` (``3u``) for any ``d`` up to thousands.

    Example::

        >>> round(screen_error_bound(32), 6)
        0.011767
    """
    if dim < 1 or dim * _U_FP32 >= 0.5:
        raise ValueError(f"screen_error_bound: dim must be in [1, 2^23), got {dim}.")
    u, g = _U_BF16, dim * _U_FP32 / (1 - dim * _U_FP32)
    return ((2 * u + u * u) + g * (1 + u) ** 2 + u * (1 + u) ** 2 * (1 + g)) * (1 + 2.0**-16)


@dataclass(frozen=True)
class ExactTopK:
    """The top ``k`` items of each query, best first (the layout of :class:`~lightning_rec.retrieval.TopK`, with
    exact float64 scores).

    Args:
        item_ids: ``(Q, k)`` int64 item ids (ties: the lower id first); ``-1`` in places no item filled.
        scores: ``(Q, k)`` float64 exact scores ``q.c``, descending; ``-inf`` in places no item filled.
    """

    item_ids: Tensor
    scores: Tensor

    def hits(self, positive_ids: Tensor, positive_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """The hit matrix and positive counts of :meth:`lightning_rec.metrics.TopKMetrics.update`.

        Args:
            positive_ids: every query's positive items, concatenated (a repeated item counts once).
            positive_lengths: ``(Q,)`` how many of ``positive_ids`` each query has.

        Returns:
            ``(hits, num_positives)``: ``(Q, k)`` bool, ``hits[q, j]`` = the query's ``j``-th item is a positive;
            ``(Q,)`` long, each query's number of distinct positives.

        Example::

            >>> top = ExactTopK(torch.tensor([[7, 4], [2, -1]]),
            ...                 torch.tensor([[3.0, 2.0], [1.0, -math.inf]], dtype=torch.float64))
            >>> hits, n = top.hits(torch.tensor([4, 9, 4, 2]), torch.tensor([3, 1]))
            >>> hits.int().tolist(), n.tolist()
            ([[0, 1], [1, 0]], [2, 1])
        """
        q = self.item_ids.shape[0]
        positive_ids, positive_lengths = positive_ids.reshape(-1).long(), positive_lengths.reshape(-1).long()
        if positive_lengths.numel() != q or int(positive_lengths.sum()) != positive_ids.numel():
            raise ValueError(
                f"ExactTopK.hits: positive_lengths must have one count per query ({q}) summing to the "
                f"{positive_ids.numel()} positive_ids, got {positive_lengths.numel()} counts summing to "
                f"{int(positive_lengths.sum())}."
            )
        base = max(int(positive_ids.max()) + 1 if positive_ids.numel() else 1, int(self.item_ids.max()) + 1, 1)
        rows = torch.repeat_interleave(torch.arange(q), positive_lengths)
        keys = torch.unique(rows * base + positive_ids)
        hits = torch.isin(torch.arange(q).unsqueeze(1) * base + self.item_ids, keys) & (self.item_ids >= 0)
        return hits, torch.bincount(keys // base, minlength=q)


def _order(scores: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` best ``(score, id)`` pairs: score descending, then id ascending; a repeated id counts once."""
    ids, by_id = torch.sort(ids, dim=1, stable=True)
    scores = scores.gather(1, by_id)
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[:, 1:] = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] != _EMPTY)
    scores = scores.masked_fill(repeated, -math.inf)
    ids = ids.masked_fill(repeated, _EMPTY)
    scores, by_score = torch.sort(scores, dim=1, descending=True, stable=True)
    return scores[:, :k], ids.gather(1, by_score)[:, :k]


def merge_topk(parts: Sequence[ExactTopK], k: int | None = None) -> ExactTopK:
    """One top-``k`` list per query from several lists of the same queries over disjoint items (e.g. one per rank).

    Args:
        parts: the lists, each ``(Q, k_i)``.
        k: the merged length (default: the first part's).

    Returns:
        The merged :class:`ExactTopK`, ordered as :class:`StreamingTopK` orders (score descending, then lower id).

    Example::

        >>> a = ExactTopK(torch.tensor([[3, 0]]), torch.tensor([[5.0, 1.0]], dtype=torch.float64))
        >>> b = ExactTopK(torch.tensor([[1, 8]]), torch.tensor([[5.0, 2.0]], dtype=torch.float64))
        >>> merge_topk([a, b]).item_ids.tolist()
        [[1, 3]]
    """
    k = parts[0].item_ids.shape[1] if k is None else k
    ids = torch.cat([p.item_ids for p in parts], 1)
    ids = torch.where(ids < 0, _EMPTY, ids)
    scores, ids = _order(torch.cat([p.scores for p in parts], 1), ids, k)
    return ExactTopK(torch.where(ids == _EMPTY, -1, ids), scores)


def _finite_rows(x: Tensor, what: str, dim: int | None) -> Tensor:
    """``x`` as contiguous float32 ``(n, d)``, checked; its rows' float64 norms."""
    if x.dim() != 2 or (dim is not None and x.shape[1] != dim) or not x.is_floating_point():
        want = f"(n, {dim})" if dim is not None else "(n, d)"
        raise ValueError(f"StreamingTopK: {what} must be a floating {want} tensor, got {x.dtype} {tuple(x.shape)}.")
    norms = x.double().norm(dim=1)
    if not bool(torch.isfinite(norms).all()):
        bad = int((~torch.isfinite(norms)).nonzero()[0])
        raise ValueError(f"StreamingTopK: {what} row {bad} is not finite (nan or inf). HINT: check the embeddings.")
    return norms


class StreamingTopK:
    """The exact top ``k`` items of each query over a catalogue given in chunks of rows (see the module docstring).

    Memory: the queries, ``(Q, k)`` float64 scores and int64 ids, and one ``(query_block, item_block)`` bf16 screen
    at a time (plus the chunk being added, in bf16 too); never a ``(Q, items)`` matrix.

    Args:
        queries: ``(Q, d)`` float query embeddings (scored in float32: other dtypes are converted).
        k: how many items per query.
        exclude_ids: items each query must not rank (e.g. its training items), concatenated over queries.
        exclude_lengths: ``(Q,)`` how many of ``exclude_ids`` each query has.
        query_block: queries per screen block.
        item_block: items per screen block.

    Example::

        >>> stream = StreamingTopK(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), k=2,
        ...                        exclude_ids=torch.tensor([2]), exclude_lengths=torch.tensor([0, 1]))
        >>> stream.add(torch.tensor([[3.0, 1.0], [1.0, 2.0]]), first_id=0)
        >>> stream.add(torch.tensor([[2.0, 5.0]]), first_id=2)
        >>> top = stream.result()
        >>> top.item_ids.tolist(), top.scores.tolist()
        ([[0, 2], [1, 0]], [[3.0, 2.0], [2.0, 1.0]])
    """

    def __init__(
        self,
        queries: Tensor,
        k: int,
        *,
        exclude_ids: Tensor | None = None,
        exclude_lengths: Tensor | None = None,
        query_block: int = 1024,
        item_block: int = 4096,
    ) -> None:
        if k < 1 or query_block < 1 or item_block < 1:
            raise ValueError(
                f"StreamingTopK: k, query_block and item_block must be >= 1, got {k}, {query_block}, {item_block}."
            )
        self.dim = queries.shape[-1]
        self._qnorm = _finite_rows(queries, "queries", None)
        self._qmax = float(self._qnorm.max()) if self._qnorm.numel() else 0.0
        self.k, self.query_block, self.item_block = k, query_block, item_block
        self._q32 = queries.detach().float().contiguous()
        self._qbf = self._q32.bfloat16()
        q = self._q32.shape[0]
        self._scores = torch.full((q, k), -math.inf, dtype=torch.float64)
        self._ids = torch.full((q, k), _EMPTY, dtype=torch.int64)
        self._alpha = screen_error_bound(self.dim)
        self._excluded = self._exclusions(exclude_ids, exclude_lengths, q)
        blocks = math.ceil(q / query_block)
        self._filling = [True] * blocks  # query blocks with a query short of k items
        self._positive: list[bool | None] = [None] * blocks  # query blocks whose thresholds are all > 0 (None: unknown)
        self._buffer = torch.empty(0, dtype=torch.bfloat16)  # the screen of a whole block, reused (no page faults)
        self._cmax = 0.0
        self._thr = torch.full((q,), -math.inf)
        self._thr_bits = torch.zeros(q, dtype=torch.int16)
        self.screened = 0  # query-item pairs scored by the screen
        self.rescored = 0  # pairs rescored exactly (the screen's survivors)

    @staticmethod
    def _exclusions(ids: Tensor | None, lengths: Tensor | None, q: int) -> Tensor:
        """The excluded (query, item) pairs as sorted keys ``query * 2^40 + item``."""
        if ids is None and lengths is None:
            return torch.empty(0, dtype=torch.long)
        if ids is None or lengths is None:
            raise ValueError("StreamingTopK: give both exclude_ids and exclude_lengths, or neither.")
        ids, lengths = ids.reshape(-1).long(), lengths.reshape(-1).long()
        if lengths.numel() != q or int(lengths.sum()) != ids.numel() or bool((lengths < 0).any()):
            raise ValueError(
                f"StreamingTopK: exclude_lengths must hold {q} counts (one per query) >= 0 summing to the "
                f"{ids.numel()} exclude_ids, got {lengths.numel()} counts summing to {int(lengths.sum())}."
            )
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < _KEY):
            raise ValueError(f"StreamingTopK: exclude_ids must be item ids in [0, 2^40), got {int(ids.min())}.")
        return torch.unique(torch.repeat_interleave(torch.arange(q), lengths) * _KEY + ids)

    def add(self, items: Tensor, first_id: int) -> None:
        """Score a chunk of the catalogue: ``items[i]`` is item ``first_id + i``.

        Chunks may come in any order and of any size; an item given twice counts once.

        Args:
            items: ``(n, d)`` float item embeddings.
            first_id: the id of ``items[0]``.
        """
        norms = _finite_rows(items, "items", self.dim)
        if norms.numel() and float(norms.max()) * self._qmax > _MAX_NORM_PRODUCT:
            raise ValueError(
                f"StreamingTopK: |query| x |item| reaches {float(norms.max()) * self._qmax:.3g} in the "
                f"items from id {first_id}; scores above 2^60 could overflow the bf16 screen. HINT: scale the "
                "embeddings down (the ranking does not change)."
            )
        c32 = items.detach().float().contiguous()
        cbf = c32.bfloat16()
        n = c32.shape[0]
        if not n:
            return
        if first_id < 0 or first_id + n > _KEY:
            raise ValueError(f"StreamingTopK: item ids must be in [0, 2^40), got {first_id}..{first_id + n - 1}.")
        q = self._q32.shape[0]
        # One margin for the chunk (its largest item norm): the thresholds change only where a merge raised a k-th
        # score, so they are computed once here and refreshed for the merged queries alone.
        self._cmax = float(norms.max())
        self._refresh(torch.arange(q))
        full = (self.query_block, self.item_block)
        if self._buffer.shape != full:
            self._buffer = torch.empty(full, dtype=torch.bfloat16)
        for c0 in range(0, n, self.item_block):
            c1 = min(n, c0 + self.item_block)
            for q0 in range(0, q, self.query_block):
                q1 = min(q, q0 + self.query_block)
                if (q1 - q0, c1 - c0) == full:
                    screen = torch.mm(self._qbf[q0:q1], cbf[c0:c1].T, out=self._buffer)
                else:
                    screen = torch.mm(self._qbf[q0:q1], cbf[c0:c1].T)
                self.screened += screen.numel()
                self._block(screen, q0, q1, c32[c0:c1], first_id + c0)

    def _threshold(self, rows: Tensor) -> Tensor:
        """The float32 screen threshold of the queries ``rows``: the k-th exact score so far minus the screen's
        error bound for this chunk, rounded down to float32 (the comparison with bf16 scores, made in float32, then
        loses nothing); ``-inf`` while a query has fewer than ``k`` items."""
        qn, cmax = self._qnorm[rows], self._cmax
        margin = self._alpha * qn * cmax + _FLUSHED * (self.dim + math.sqrt(self.dim) * (qn + cmax))
        exact = self._scores[rows, -1] - margin
        thr = exact.float()
        return torch.where(thr.double() > exact, torch.nextafter(thr, torch.tensor(-math.inf)), thr)

    def _refresh(self, rows: Tensor) -> None:
        """Recompute the thresholds of the queries ``rows`` (after their k-th score rose, or for a new chunk)."""
        thr = self._threshold(rows)
        self._thr[rows] = thr
        for b in torch.unique(rows // self.query_block).tolist():
            self._positive[b] = None
        # The int16 bits of the least bf16 number >= thr (for thr > 0, where bits order as the numbers do).
        up = thr.bfloat16()
        self._thr_bits[rows] = up.view(torch.int16) + (up.float() < thr).to(torch.int16)

    def _block(self, screen: Tensor, q0: int, q1: int, c32: Tensor, first_id: int) -> None:
        """Take one ``(queries q0:q1) x (items c32)`` screen block into the running top-k (excluded items are
        screened too, and dropped before their rescore: they are few, the blocks many)."""
        block = q0 // self.query_block
        if self._filling[block]:
            empty = self._scores[q0:q1, -1] == -math.inf
            if bool(empty.any()):
                # No k-th score yet (the first block, or too few items so far): the screen's own k best of the
                # block are rescored first, which gives these queries a threshold for the rest of the block.
                rows = empty.nonzero().squeeze(1)
                best, cols = screen[rows].topk(min(self.k, screen.shape[1]), dim=1)
                rows, cols = rows.repeat_interleave(cols.shape[1]), cols.reshape(-1)
                self._rescore(q0 + rows, cols, c32, first_id)
                screen[rows, cols] = -math.inf  # taken: not again below
            else:
                self._filling[block] = False
        thr = self._thr[q0:q1]
        # The maxima of short segments of each row, not of the whole row: only the segments that reach a threshold
        # are read again, which keeps the work of the early blocks (low thresholds, many rows reaching) small.
        width = screen.shape[1]
        seg = _SEGMENT if width % _SEGMENT == 0 else width
        segments = screen.view(q1 - q0, width // seg, seg)
        if self._positive[block] is None:
            self._positive[block] = bool((thr > 0).all())
        if self._positive[block]:
            # Positive bf16 numbers order as their bits read as int16 (negative ones and -inf read negative), and an
            # int16 maximum runs some 20x faster than a bf16 one: compare with the bits of the least bf16 >= thr.
            bits = segments.view(torch.int16).amax(2)
            reach = bits >= self._thr_bits[q0:q1].unsqueeze(1)
        else:
            reach = segments.amax(2) >= thr.unsqueeze(1)
        if not bool(reach.any()):
            return
        rows, which = reach.nonzero().unbind(1)  # row-major: rows ascending
        part = segments[rows, which]
        i, j = (part >= thr[rows].unsqueeze(1)).nonzero().unbind(1)
        keep = part[i, j] > -math.inf  # taken above (a query still filling has threshold -inf)
        i, j = i[keep], j[keep]
        self._rescore(q0 + rows[i], which[i] * seg + j, c32, first_id)

    def _rescore(self, rows: Tensor, cols: Tensor, c32: Tensor, first_id: int) -> None:
        """Exact float64 scores of the pairs (query ``rows[i]``, item ``cols[i]`` of ``c32``), merged into the
        running top-k (``rows`` ascending)."""
        if self._excluded.numel():
            keys = rows * _KEY + (cols + first_id)
            at = torch.searchsorted(self._excluded, keys).clamp(max=self._excluded.numel() - 1)
            keep = self._excluded[at] != keys
            rows, cols = rows[keep], cols[keep]
        if not rows.numel():
            return
        self.rescored += rows.numel()
        scores = (self._q32[rows].double() * c32[cols].double()).sum(1)
        urows, inverse, counts = torch.unique_consecutive(rows, return_inverse=True, return_counts=True)
        place = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts)[inverse]
        new_scores = torch.full((urows.numel(), int(counts.max())), -math.inf, dtype=torch.float64)
        new_ids = torch.full_like(new_scores, _EMPTY, dtype=torch.int64)
        new_scores[inverse, place] = scores
        new_ids[inverse, place] = cols + first_id
        self._scores[urows], self._ids[urows] = _order(
            torch.cat([self._scores[urows], new_scores], 1), torch.cat([self._ids[urows], new_ids], 1), self.k
        )
        self._refresh(urows)

    def result(self) -> ExactTopK:
        """The top ``k`` of every query over the chunks added so far."""
        return ExactTopK(torch.where(self._ids == _EMPTY, -1, self._ids), self._scores.clone())
