"""Top-k for a request, end to end: the query tower's serving package embeds the request, the item index (written by
:func:`~lightning_rec.retrieval.build_index`) finds the nearest items by inner product.

Example::

    lightning-rec export runs/two_tower/checkpoints/last.ckpt query.pt2 --format pt2 --part query --table-dtype fp32
    lightning-rec index runs/two_tower/checkpoints/last.ckpt index --kind hnsw

    retriever = Retriever("query.pt2", "index")
    rows = dm.split("test")                                  # MovieLensRetrievalDataModule
    top = retriever(rows.query(torch.arange(4)), k=10)       # 4 users' requests as a KeyedJaggedTensor
    top.item_ids, top.scores                                  # (4, 10) each, best first
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_rec.retrieval.folder import LoadedIndex, load_index

__all__ = ["Retriever", "TopK", "search_index"]


class TopK(NamedTuple):
    """The answer to a request of ``B`` queries: ``item_ids`` ``(B, k)`` int64 and ``scores`` ``(B, k)`` float32
    (the query and item embeddings' inner product), best first; where fewer than ``k`` items remain (a small
    catalogue, exclusions), the row ends with item id ``-1`` and score ``-inf``."""

    item_ids: Tensor
    scores: Tensor


class Retriever:
    """Answer top-k item ids and scores for requests: the query tower's serving package (a ``.pt2`` from
    ``lightning-rec export CKPT query.pt2 --format pt2 --part query``, or the TorchScript artifact) and an index folder
    (``lightning-rec index CKPT OUT``) of the same checkpoint.

    The two must come from one checkpoint save (the package's spec and the index's manifest record its identity);
    a query tower of another save would search an index of other item vectors, so it is refused unless
    ``allow_other_checkpoint=True``.

    Args:
        query_model: the query tower's ``.pt2`` package (loaded by :func:`~lightning_rec.serving.load_pt2`) or
            TorchScript artifact (:func:`~lightning_rec.serving.load_inference`).
        index: an index folder (see :func:`~lightning_rec.retrieval.load_index`), or one already loaded.
        allow_other_checkpoint: serve a pair written from different checkpoint saves.
        verify: check the files' SHA-256 against what export and index wrote.

    Example::

        retriever = Retriever("query.pt2", "index")
        top = retriever(query_kjt, k=10, exclude=[[50, 181], []])    # leave out items the users have seen
        top.item_ids[0], top.scores[0]

    Raises:
        ValueError: the package and the index come from different saves, or their widths differ.
    """

    def __init__(
        self,
        query_model: str | Path,
        index: str | Path | LoadedIndex,
        *,
        allow_other_checkpoint: bool = False,
        verify: bool = True,
    ) -> None:
        from lightning_rec.serving.artifact import inference_spec, load_inference
        from lightning_rec.serving.pt2 import load_pt2

        self.index = index if isinstance(index, LoadedIndex) else load_index(index, verify=verify)
        path = Path(query_model)
        if path.suffix == ".pt2":
            pt2 = load_pt2(path, verify=verify)
            self.model: Any = pt2
            self.spec = pt2.spec
        else:
            self.model = load_inference(path, verify=verify)
            self.spec = inference_spec(path)
        built = self.index.manifest.get("checkpoint", {})
        served = self.spec.checkpoint or {}
        if not allow_other_checkpoint and served.get("id") != built.get("id"):
            raise ValueError(
                f"{str(path)!r} was exported from checkpoint step {served.get('step')} (save {served.get('id')}) "
                f"and the index from step {built.get('global_step')} (save {built.get('id')}, {built.get('path')}): "
                "their embeddings do not match. HINT: export and index the same checkpoint, or pass "
                "allow_other_checkpoint=True."
            )
        warm = self.spec.warmup or {}
        output = warm.get("output")
        width = len(output[0]) if output else None
        if width is not None and width != int(self.index.manifest["dim"]):
            raise ValueError(
                f"{str(path)!r} embeds queries in {width} dimensions and the index holds {self.index.manifest['dim']}."
            )

    @property
    def manifest(self) -> dict[str, Any]:
        """The index's manifest (checkpoint, kind, parameters, ...)."""
        return self.index.manifest

    def embed(self, request: Any) -> Tensor:
        """``(B, D)`` query embeddings of ``request``: a ``KeyedJaggedTensor`` of the query tower's features (any
        order, extra features ignored) or the package's own arguments ``(values, lengths[, weights])``."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from lightning_rec.serving.artifact import serving_inputs

        args = serving_inputs(self.spec, request) if isinstance(request, KeyedJaggedTensor) else tuple(request)
        with torch.inference_mode():
            return self.model(*args).float()

    def search(self, queries: Tensor, k: int = 10, exclude: Sequence[Sequence[int]] | None = None) -> TopK:
        """The ``k`` items of the index nearest to each of ``queries`` ``(B, D)`` (inner product), leaving out each
        query's ``exclude`` item ids (e.g. what the user has seen); see :func:`search_index`."""
        return search_index(self.index, queries, k, exclude)

    def __call__(self, request: Any, k: int = 10, exclude: Sequence[Sequence[int]] | None = None) -> TopK:
        """Top-``k`` item ids and scores for each query of ``request`` (see :meth:`embed` and :meth:`search`)."""
        return self.search(self.embed(request), k, exclude)


def search_index(
    index: LoadedIndex, queries: Tensor, k: int = 10, exclude: Sequence[Sequence[int]] | None = None
) -> TopK:
    """The ``k`` items of ``index`` nearest to each of ``queries`` ``(B, D)`` by inner product, best first, leaving out
    each query's ``exclude`` item ids: the index is asked for ``k`` plus the longest exclusion list, the excluded
    items are dropped, the first ``k`` kept.

    Example::

        >>> import faiss, numpy as np
        >>> flat = faiss.IndexFlatIP(2); flat.add(np.array([[1, 0], [0, 1], [0.6, 0.8]], dtype=np.float32))
        >>> top = search_index(LoadedIndex(flat, np.array([7, 8, 9]), {}), torch.tensor([[1.0, 0.0]]), 2, [[7]])
        >>> top.item_ids.tolist(), top.scores.tolist()
        ([[9, 8]], [[0.6000000238418579, 0.0]])
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    if queries.dim() != 2 or queries.shape[1] != index.index.d:
        raise ValueError(
            f"queries must be (B, {index.index.d}) for this index of {index.index.d}-wide vectors, got "
            f"{tuple(queries.shape)}. HINT: embed them with the query tower of the checkpoint the index was built from."
        )
    if exclude is not None and len(exclude) != queries.shape[0]:
        raise ValueError(f"exclude holds {len(exclude)} lists for {queries.shape[0]} queries; give one per query.")
    ntotal = int(index.index.ntotal)
    most = max((len(e) for e in exclude), default=0) if exclude is not None else 0
    fetch = min(k + most, ntotal)  # enough that k remain after the exclusions
    vectors = np.ascontiguousarray(queries.detach().float().cpu().numpy())
    scores, rows = index.index.search(vectors, fetch)
    ids = np.where(rows >= 0, index.item_ids[np.clip(rows, 0, None)], -1)
    out_ids = np.full((len(ids), k), -1, dtype=np.int64)
    out_scores = np.full((len(ids), k), -np.inf, dtype=np.float32)
    for q in range(len(ids)):
        keep = ids[q] >= 0
        if exclude is not None and len(exclude[q]):
            keep &= ~np.isin(ids[q], np.asarray(exclude[q], dtype=np.int64))
        kept_ids, kept_scores = ids[q][keep][:k], scores[q][keep][:k]
        out_ids[q, : len(kept_ids)] = kept_ids
        out_scores[q, : len(kept_scores)] = kept_scores
    return TopK(torch.from_numpy(out_ids), torch.from_numpy(out_scores))
