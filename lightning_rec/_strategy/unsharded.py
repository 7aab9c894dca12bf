"""Make a sharded embedding module behave like the unsharded one it replaced.

TorchRec's sharded modules differ from the unsharded ones in two ways a model does not see coming:

* **Output order.** A sharded ``EmbeddingBagCollection`` returns its ``KeyedTensor`` grouped by sharding type
  (and a sharded ``EmbeddingCollection`` its dict in that order), so the key order depends on the plan. A model
  that reads ``kt.values()`` (as TorchRec's tutorial does) would learn one column layout and be fed another after
  resharding. :func:`restore_output_order` puts the keys back in the unsharded module's order::

      unsharded EBC (tables t_user, t_genre, t_item)     sharded over 2 ranks (t_genre data-parallel)
      keys    user | genre | item                          user | item | genre     <- grouped by sharding type
      values  [B, 8] [B, 8]  [B, 8]                         columns in that order

  The orders are compared once, at the first forward; when they already agree the original method is put back,
  so a matching plan costs nothing.
* **Initial weights.** A table built on CPU (pretrained rows, ``load_state_dict`` before ``fit``, a custom init)
  is re-initialised by most sharders. :func:`capture_weights` keeps references to the rows an unsharded module
  holds and :func:`restore_weights` copies every rank's shards from them after sharding, for every sharding type
  and kernel. Tables on ``meta`` hold nothing and keep the sharder's initialisation.

Example::

    held = capture_weights(model)
    orders = output_orders(model)
    dmp = DistributedModelParallel(model, ...)
    restore_weights(dmp.module, held, process_group)
    restore_output_order(dmp.module, orders)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.permute_pooled_embedding_modules import PermutePooledEmbeddings
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

from lightning_rec import _compat
from lightning_rec._tables import TABLE_MODULE_TYPES, embedding_modules, inner_collection, table_configs

__all__ = ["capture_weights", "output_orders", "restore_output_order", "restore_weights"]


# ---------------------------------------------------------------------------------------------------------------
# Output order
# ---------------------------------------------------------------------------------------------------------------


def output_orders(
    module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES
) -> dict[str, list[str]]:
    """The output keys of every unsharded ``EmbeddingBagCollection``/``EmbeddingCollection`` in ``module``, in the
    order the unsharded module returns them, by module path (call it before sharding)."""
    orders: dict[str, list[str]] = {}
    for path, sub in embedding_modules(module, module_types).items():
        if inner_collection(sub) is None:  # a custom sharder's module: its own output contract
            continue
        orders[path] = list(itertools.chain.from_iterable(get_embedding_names_by_table(table_configs(sub))))
    return orders


class _Reorder:
    """The awaitable callback that puts a sharded module's output keys in the unsharded order.

    Pooled outputs (``[batch, columns]``) are permuted by FBGEMM's ``permute_pooled_embs`` kernel (one pass, with
    its own backward: what TorchRec uses to reorder pooled embeddings itself); other layouts by a ``torch.cat`` of
    slices.
    """

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self._perms: dict[tuple, list[int] | None] = {}  # sharded key order -> source position of each key
        self._kernels: dict[tuple, PermutePooledEmbeddings] = {}  # (sharded keys, device) -> the permute kernel

    def needed(self, keys: list[str]) -> bool:
        return list(keys) != self.order

    def __call__(self, out: Any) -> Any:
        if isinstance(out, KeyedTensor):
            return self._keyed_tensor(out)
        if isinstance(out, dict):
            return {k: out[k] for k in self.order if k in out} if len(out) == len(self.order) else out
        return out

    def _perm(self, keys: list[str]) -> list[int] | None:
        key = tuple(keys)
        if key not in self._perms:
            where = {k: i for i, k in enumerate(keys)}
            # Not the keys this module was built with: leave such an output alone.
            self._perms[key] = [where[k] for k in self.order] if set(where) == set(self.order) else None
        return self._perms[key]

    def _keyed_tensor(self, kt: KeyedTensor) -> KeyedTensor:
        keys, lengths, values = kt.keys(), kt.length_per_key(), kt.values()
        perm = self._perm(keys)
        if perm is None:
            return kt
        if kt.key_dim() == 1 and values.dim() == 2:
            kernel = self._kernels.get((tuple(keys), values.device))
            if kernel is None:
                kernel = self._kernels[(tuple(keys), values.device)] = PermutePooledEmbeddings(
                    lengths, perm, values.device
                )
            permuted = kernel(values)
        else:
            parts = values.split(lengths, dim=kt.key_dim())
            permuted = torch.cat([parts[i] for i in perm], dim=kt.key_dim())
        return KeyedTensor(
            keys=self.order, length_per_key=[lengths[i] for i in perm], values=permuted, key_dim=kt.key_dim()
        )


def _output_keys(out: Any) -> list[str] | None:
    if isinstance(out, KeyedTensor):
        return out.keys()
    if isinstance(out, dict):
        return list(out)
    return None


def restore_output_order(sharded_root: nn.Module, orders: dict[str, list[str]]) -> None:
    """Make every sharded module named in ``orders`` return its keys in the unsharded order.

    The sharded module's ``compute_and_output_dist`` (what both its own ``forward`` and TorchRec's pipelined
    forward call) is wrapped: the first output's keys are compared with the unsharded order; if they agree the
    class's own method is put back, otherwise a reordering callback is added to every output awaitable from then
    on. Gradients flow through the reordering (FBGEMM's pooled-embedding permutation).

    Args:
        sharded_root: the module DMP sharded (``dmp.module``).
        orders: from :func:`output_orders`, taken before sharding.
    """
    for path, order in orders.items():
        sharded = sharded_root.get_submodule(path) if path else sharded_root
        if _compat.patchable(sharded, "compute_and_output_dist"):  # else: a module the plan left unsharded
            _wrap(sharded, _Reorder(order))


def _wrap(sharded: nn.Module, reorder: _Reorder) -> None:
    original: Callable[..., Any] = _compat.original_method(sharded, "compute_and_output_dist")

    def decide(out: Any) -> Any:
        keys = _output_keys(out)
        if keys is None or not reorder.needed(keys):
            _compat.unpatch_method(sharded, "compute_and_output_dist")  # the class's own method again: no cost per step
            return out
        _compat.patch_method(sharded, "compute_and_output_dist", reordering)
        return reorder(out)

    def wrapped(callback: Callable[[Any], Any]) -> Callable[..., Any]:
        def compute_and_output_dist(ctx: Any, dist_input: Any) -> Any:
            awaitable = original(ctx, dist_input)
            # A managed-collision module returns (embeddings, remapped ids): the embeddings are reordered.
            pooled = awaitable[0] if isinstance(awaitable, tuple) else awaitable
            pooled.callbacks.append(callback)  # applied to the value the awaitable's wait() returns
            return awaitable

        return compute_and_output_dist

    reordering = wrapped(reorder)
    _compat.patch_method(sharded, "compute_and_output_dist", wrapped(decide))


# ---------------------------------------------------------------------------------------------------------------
# Initial weights
# ---------------------------------------------------------------------------------------------------------------


def capture_weights(
    module: nn.Module, module_types: Sequence[type[nn.Module]] = TABLE_MODULE_TYPES
) -> dict[str, dict[str, torch.Tensor]]:
    """References (no copies) to the table weights every unsharded embedding module holds, by module path, then by
    state-dict key; tables on ``meta`` hold nothing and are left out. Call it before sharding."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for path, sub in embedding_modules(module, module_types).items():
        tensors = {
            k: t
            for k, t in sub.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and not t.is_meta and _is_held(sub, k)
        }
        if tensors:
            held[path] = {k: t.detach() for k, t in tensors.items()}
    return held


def _is_held(module: nn.Module, key: str) -> bool:
    """Whether the state-dict entry ``key`` is carried over into the sharded module: everything but a
    managed-collision module's collision state, which describes the id space of one shard layout (its output
    segments, its sorted raw ids per shard) and starts afresh when sharded; a checkpoint restores it."""
    return not isinstance(module, BaseManagedCollisionEmbeddingCollection) or key.startswith("_embedding_module.")


@torch.no_grad()
def restore_weights(
    sharded_root: nn.Module, held: dict[str, dict[str, torch.Tensor]], pg: dist.ProcessGroup | None = None
) -> None:
    """Copy the weights captured by :func:`capture_weights` into the sharded modules: each rank fills its own shards
    (row and column slices of the full table), replicated tables are filled whole.

    With several ranks, the held weights are first compared across ranks (three float64 reductions per table): if
    a table differs, rank 0's rows are broadcast and used, as DDP does for dense layers, with a warning naming the
    tables.
    """
    if pg is not None and dist.get_world_size(pg) > 1:
        _agree_with_rank_zero(held, pg)
    for path, tensors in held.items():
        sharded = sharded_root.get_submodule(path) if path else sharded_root
        targets = sharded.state_dict()
        for key, source in tensors.items():
            if key not in targets:
                continue
            _copy_into(targets[key], source, f"{path}.{key}" if path else key)


def _copy_into(target: Any, source: torch.Tensor, name: str) -> None:
    if isinstance(target, _compat.ShardedTensor):
        if tuple(target.size()) != tuple(source.shape):
            raise RuntimeError(f"{name}: sharded size {tuple(target.size())} != held {tuple(source.shape)}")
        for shard in target.local_shards():
            region = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
            shard.tensor.copy_(source[region])
    elif isinstance(target, DTensor):
        local = target.to_local()  # TorchRec's LocalShardsWrapper: the rank's shards and their global offsets
        if not (hasattr(local, "local_shards") and hasattr(local, "local_offsets")):
            raise NotImplementedError(f"{name}: cannot place held weights into a {type(local).__name__} DTensor shard")
        for tensor, offsets in zip(local.local_shards(), local.local_offsets()):
            region = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))
            tensor.copy_(source[region])
    else:
        target.copy_(source)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 numbers that tell two tables apart (sum, norm, row-position-weighted sum) without copying."""
    rows = t.reshape(t.shape[0], -1) if t.dim() > 0 else t.reshape(1, 1)
    position = torch.arange(1, rows.shape[0] + 1, dtype=torch.float64, device=t.device)
    return torch.stack(
        [
            rows.sum(dtype=torch.float64),
            torch.linalg.vector_norm(rows, dtype=torch.float64),
            (rows.sum(1, dtype=torch.float64) * position).sum(),
        ]
    )


def _agree_with_rank_zero(held: dict[str, dict[str, torch.Tensor]], pg: dist.ProcessGroup) -> None:
    names = [(path, key) for path in sorted(held) for key in sorted(held[path])]
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    )
    # Every rank must take part in the same collectives: the set of held tables comes from the model's
    # construction, identical on every rank; a rank with other tables would fail the shape check below.
    mine = (
        torch.stack([_fingerprint(held[p][k]) for p, k in names]).to(device)
        if names
        else torch.zeros(0, 3, device=device)
    )
    count = torch.tensor([len(names)], device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(counts, count, group=pg)
    if len({int(c) for c in counts}) != 1:
        raise RuntimeError(
            "RecShardStrategy: ranks hold weights for different numbers of tables before sharding "
            f"({[int(c) for c in counts]}). HINT: build the embedding modules the same way on every rank."
        )
    if not names:
        return
    zero = mine.clone()
    dist.broadcast(zero, src=dist.get_global_rank(pg, 0), group=pg)
    # Identical rows give identical sums; a tolerance only absorbs a different reduction order.
    differs = ~torch.isclose(zero, mine, rtol=1e-12, atol=0).all(dim=1)
    flags = differs.to(torch.int32)
    dist.all_reduce(flags, group=pg)  # every rank learns which tables some rank disagrees on
    to_sync = [names[i] for i in flags.nonzero().flatten().tolist()]
    if not to_sync:
        return
    rank_zero_warn(
        "RecShardStrategy: the embedding tables held different weights on different ranks before sharding: "
        f"{', '.join(f'{p}.{k}' if p else k for p, k in to_sync)}. Using rank 0's, as DDP does for dense layers. "
        "HINT: call `L.seed_everything(...)` before building the model, or load the same rows on every rank."
    )
    for path, key in to_sync:
        _broadcast_in_place(held[path][key], pg, device)


def _broadcast_in_place(
    t: torch.Tensor, pg: dist.ProcessGroup, device: torch.device, chunk_bytes: int = 64 << 20
) -> None:
    """Broadcast ``t`` from rank 0 in place; through ``device`` in row chunks when ``t`` lives elsewhere (NCCL)."""
    src = dist.get_global_rank(pg, 0)
    if t.device == device and t.is_contiguous():
        dist.broadcast(t, src=src, group=pg)
        return
    rows = t.reshape(t.shape[0], -1) if t.dim() > 0 else t.reshape(1, 1)
    step = max(1, chunk_bytes // max(1, rows.shape[1] * rows.element_size()))
    for start in range(0, rows.shape[0], step):
        buf = rows[start : start + step].to(device).contiguous()
        dist.broadcast(buf, src=src, group=pg)
        rows[start : start + step].copy_(buf)
