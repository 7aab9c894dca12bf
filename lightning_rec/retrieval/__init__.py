"""Retrieval from a two-tower model: the catalogue embedded by the candidate tower of a sharded checkpoint into a FAISS
index (:func:`build_index`, ``lightning-rec index CKPT OUT``), and top-k answered for a request by the query
tower's ``.pt2`` package and that index (:class:`Retriever`). FAISS is an optional dependency:
``pip install 'lightning-rec[retrieval]'``.

Example::

    from lightning_rec.retrieval import Retriever, build_index
    build_index("runs/two_tower/checkpoints/last.ckpt", "index", kind="hnsw")
    retriever = Retriever("query_tower.pt2", "index")
    top = retriever(query_kjt, k=10)           # top.item_ids (B, 10), top.scores (B, 10)

See docs/retrieval.md.
"""

from lightning_rec.retrieval.folder import LoadedIndex, load_index
from lightning_rec.retrieval.index import KINDS, Catalogue, IndexKind, build_index, catalogue_of, index_params
from lightning_rec.retrieval.retriever import Retriever, TopK, search_index
from lightning_rec.retrieval.sharded_topk import catalogue_topk, ebc_lookup, row_range
from lightning_rec.retrieval.topk import ExactTopK, StreamingTopK, merge_topk, screen_error_bound

__all__ = [
    "KINDS",
    "Catalogue",
    "ExactTopK",
    "IndexKind",
    "LoadedIndex",
    "Retriever",
    "StreamingTopK",
    "TopK",
    "build_index",
    "catalogue_topk",
    "catalogue_of",
    "ebc_lookup",
    "index_params",
    "load_index",
    "merge_topk",
    "row_range",
    "screen_error_bound",
    "search_index",
]
