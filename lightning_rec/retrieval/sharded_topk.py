"""Exact top-k over a row-wise sharded candidate table: each rank scores the rows it holds, through the sharded
module's own lookup, and the ranks' ``(Q, k)`` lists are merged (:func:`catalogue_topk`); the table is never
gathered. The streaming top-k itself (the bf16 screen and the exact rescore) is :mod:`lightning_rec.retrieval.topk`.

Example::

    from lightning_rec.retrieval import catalogue_topk, ebc_lookup, row_range
    items = dmp.module.items                       # a sharded EmbeddingBagCollection, the item table row-wise
    top = catalogue_topk(queries, ebc_lookup(items, "item_id"), row_range(items, "t_item"), k=10)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rec.retrieval.topk import ExactTopK, StreamingTopK, merge_topk

__all__ = ["catalogue_topk", "ebc_lookup", "row_range"]


def row_range(module: torch.nn.Module, table: str) -> tuple[int, int]:
    """The global rows ``[start, stop)`` of ``table`` that this rank holds in a sharded embedding module.

    Args:
        module: a sharded ``EmbeddingBagCollection``/``EmbeddingCollection`` (e.g. ``dmp.module.tables``).
        table: the table's name.

    Returns:
        ``(start, stop)``; ``(0, 0)`` on a rank that holds none of it.

    Raises:
        ValueError: the table is not in ``module``, or is split by columns (each rank must hold whole rows).
    """
    suffix = f".{table}.weight"
    found = [v for name, v in module.state_dict().items() if name.endswith(suffix)]
    if not found:
        raise ValueError(f"row_range: no table {table!r} in {type(module).__name__}.")
    tensor: Any = found[0]
    if not hasattr(tensor, "local_shards"):  # an unsharded (or data-parallel) table: every row here
        return 0, int(tensor.shape[0])
    columns = int(tensor.size(1))
    spans = []
    for shard in tensor.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if offsets[1] != 0 or sizes[1] != columns:
            raise ValueError(
                f"row_range: table {table!r} is split by columns on this rank; catalogue_topk needs whole rows. "
                "HINT: shard it row_wise (or table_wise)."
            )
        spans.append((int(offsets[0]), int(offsets[0]) + int(sizes[0])))
    if not spans:
        return 0, 0
    spans.sort()
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"row_range: this rank's rows of table {table!r} are not one range: {spans}.")
    return spans[0][0], spans[-1][1]


def ebc_lookup(
    module: torch.nn.Module, feature: str, features: Sequence[str] | None = None
) -> Callable[[Tensor], Tensor]:
    """A function ``ids -> (len(ids), d)`` rows of a (sharded) ``EmbeddingBagCollection`` looked up through its
    forward: each id is a bag of one, under ``feature``; the module's other features get empty bags.

    On a sharded module the lookup is a collective: every rank calls it the same number of times with the same
    number of ids (each id is served by the rank that holds its row, so a rank asking for its own rows reads them
    locally and the table is never gathered).

    Args:
        module: the (sharded) ``EmbeddingBagCollection``.
        feature: the feature whose table holds the candidates.
        features: all of the module's features, in its order (its tables' ``feature_names``); default: just
            ``feature``.

    Example::

        lookup = ebc_lookup(dmp.module.items, "item_id")
        rows = lookup(torch.arange(start, start + 65536))     # (65536, d)
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(features) if features is not None else [feature]
    if feature not in keys:
        raise ValueError(f"ebc_lookup: feature {feature!r} is not among the module's features {keys}.")
    at = keys.index(feature)

    def lookup(ids: Tensor) -> Tensor:
        n = ids.numel()
        lengths = torch.zeros(len(keys), n, dtype=torch.int32)
        lengths[at] = 1
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.long(), lengths=lengths.reshape(-1))
        out = module(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        return out[feature]

    return lookup


def catalogue_topk(
    queries: Tensor,
    lookup: Callable[[Tensor], Tensor],
    rows: tuple[int, int],
    k: int,
    *,
    exclude_ids: Tensor | None = None,
    exclude_lengths: Tensor | None = None,
    chunk_rows: int = 65536,
    group: Any = None,
    query_block: int = 1024,
    item_block: int = 4096,
) -> ExactTopK:
    """The exact top ``k`` of every query over a catalogue whose rows are spread over the ranks.

    Each rank streams the rows ``rows`` it holds through ``lookup`` (``chunk_rows`` at a time, every rank the same
    number of calls of the same size, as a sharded lookup requires: short ranks repeat their first row and drop the
    copies) into a :class:`StreamingTopK`; the ranks' ``(Q, k)`` lists are then all-gathered and merged. Every rank
    returns the same result. Without a process group it is the one-rank computation.

    Args:
        queries: ``(Q, d)``, the same on every rank.
        lookup: ids -> their embeddings, e.g. :func:`ebc_lookup` of the sharded candidate table.
        rows: this rank's ``[start, stop)`` (e.g. :func:`row_range`); the ranks' ranges are disjoint.
        k: how many items per query.
        exclude_ids, exclude_lengths: as :class:`StreamingTopK` (every rank gets all of them).
        chunk_rows: rows per lookup.
        group: the process group (default: the default group, if initialised).
        query_block, item_block: as :class:`StreamingTopK`.

    Returns:
        The merged :class:`ExactTopK`.

    Example::

        dmp = DistributedModelParallel(model, ...)                    # the item table row_wise
        top = catalogue_topk(queries, ebc_lookup(dmp.module.items, "item_id"), row_range(dmp.module.items, "item"), 10)
    """
    start, stop = rows
    stream = StreamingTopK(
        queries,
        k,
        exclude_ids=exclude_ids,
        exclude_lengths=exclude_lengths,
        query_block=query_block,
        item_block=item_block,
    )
    distributed = dist.is_available() and dist.is_initialized()
    chunks = math.ceil((stop - start) / chunk_rows)
    if distributed:
        most = torch.tensor([chunks])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        chunks = int(most)
    for i in range(chunks):
        a = min(stop, start + i * chunk_rows)
        b = min(stop, a + chunk_rows)
        ids = torch.arange(a, b)
        if distributed and b - a < chunk_rows:
            ids = torch.cat([ids, torch.full((chunk_rows - (b - a),), start if stop > start else 0)])
        embeddings = lookup(ids)
        if b > a:
            stream.add(embeddings[: b - a], first_id=a)
    top = stream.result()
    if not distributed:
        return top
    world = dist.get_world_size(group)
    all_scores = [torch.empty_like(top.scores) for _ in range(world)]
    all_ids = [torch.empty_like(top.item_ids) for _ in range(world)]
    dist.all_gather(all_scores, top.scores, group=group)
    dist.all_gather(all_ids, top.item_ids, group=group)
    return merge_topk([ExactTopK(i, s) for s, i in zip(all_scores, all_ids)], k)
