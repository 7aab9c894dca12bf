"""Managed-collision tables across a reshard: each rank loads the collision slots of its own rows and raw ids.

A row-wise sharded ``MCHManagedCollisionModule`` keeps, on each rank, its slots sorted by raw id
(``_mch_sorted_raw_ids``), each with its global row (``_mch_remapped_ids_mapping``) and eviction metadata; its remap
binary-searches the sorted ids, and a raw id reaches the rank of its block of ``input_hash_size`` (one block a rank).
DCP loads a rank's slots by position, as it loads a table's rows, which is right on the saving job's layout only::

    saved on 2 ranks    rank 0 (rows 0-31, ids < 480)     rank 1 (rows 32-63, ids >= 480)
      raw ids           5   17  301 MAX ... MAX          600 959 MAX ... MAX
      rows              3   0   7   ...                  40  33  ...
    read on 1 rank by position: the 64 slots are not sorted, so 600 is searched in rank 0's MAX run: a miss.
    read on 2 ranks from 1 rank's sorted slots: rank 0 gets the 32 lowest ids, whichever rows they hold.

So where the saved slot blocks are not this job's, every rank reads the table's (small) collision buffers whole, takes
the slots whose rows it owns, in their saved order, and sorts them with TorchRec's own post-load step
(``validate_state``, which ``load_state_dict`` runs and an in-place DCP load does not). That is exact when each of
those slots holds a raw id routed to this rank, or none: always onto one rank, and after a job on more ranks kept each
id in its rank's rows. A job on fewer ranks admits ids into any row; TorchRec moves no embedding row when it reshards
(its ``validate_state`` asserts the saved row segments contain the new shard's), so such a load is refused, before
anything is modified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from lightning_rec import _compat

_EMPTY = torch.iinfo(torch.int64).max  # the raw id of a free slot
_IDS, _ROWS = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"


@dataclass
class _Table:
    """One collision module whose saved slot blocks are not this job's: where this rank's rows and raw ids lie."""

    name: str
    path: str
    module: MCHManagedCollisionModule
    buffers: dict[str, torch.Tensor]  # the slot buffers' state-dict keys -> their global shape's empty tensor
    rows: tuple[int, int]
    raw_ids: tuple[int, int]
    segments: list[int]
    shard: int
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


def _layout(value: Any) -> tuple[list[int], int, int, int] | None:
    """``(row segment starts, global rows, this rank's start, its rows)`` of a row-sharded buffer, else ``None``."""
    if not isinstance(value, _compat.ShardedTensor) or len(value.local_shards()) != 1:
        return None
    starts = sorted(int(s.shard_offsets[0]) for s in value.metadata().shards_metadata)
    local = value.local_shards()[0].metadata
    return starts, int(value.size(0)), int(local.shard_offsets[0]), int(local.shard_sizes[0])


def _saved_starts(md: TensorStorageMetadata) -> list[int]:
    return sorted({int(c.offsets[0]) for c in md.chunks})


class CollisionReload:
    """Puts each managed-collision table's saved slots where this job's ranks need them, around a DCP load.

    ``check`` (before anything is loaded) reads the collision buffers of every table saved on another row layout and
    lists the tables it cannot move; ``apply`` (after the DCP load) writes each rank's slots and sorts them.

    Example::

        collisions = CollisionReload.check(module, live, saved, read, rank, world_size, saved_world_size)
        problems += collisions.problems          # refused with the other problems, nothing modified
        dcp.load(...)
        collisions.apply()
    """

    def __init__(self, tables: list[_Table], problems: list[str]) -> None:
        self.tables = tables
        self.problems = problems

    @classmethod
    def check(
        cls,
        module: nn.Module,
        live: Mapping[str, Any],
        saved: Mapping[str, TensorStorageMetadata],
        read: Callable[[dict[str, torch.Tensor]], None],
        rank: int,
        world_size: int,
        saved_world_size: int | None,
    ) -> CollisionReload:
        """Every rank calls this (it reads collectively when any table needs moving: the same on every rank).

        Args:
            module: the sharded module being loaded.
            live: its state dict.
            saved: the checkpoint's tensors by state-dict key.
            read: loads the checkpoint's tensors of the given keys into the given (whole) tensors.
            rank: this rank.
            world_size: this job's ranks.
            saved_world_size: the saving job's ranks, for the messages.
        """
        tables = []
        for path, mc in module.named_modules():
            if not isinstance(mc, MCHManagedCollisionModule):
                continue
            layout = _layout(live.get(f"{path}.{_IDS}"))
            md = saved.get(f"{path}.{_IDS}")
            if layout is None or md is None or tuple(md.size) != (layout[1],):
                continue  # not sharded here, not saved, or of another size (a problem reported already)
            starts, size, start, rows = layout
            if _saved_starts(md) == starts:
                continue  # the saving job's blocks: DCP's load is the right one
            keys = {
                key: torch.empty(tuple(saved[key].size), dtype=value.local_shards()[0].tensor.dtype)
                for key, value in live.items()
                if key.startswith(f"{path}.") and _layout(value) is not None and key in saved
            }
            block = -(-mc.input_size() // len(starts))  # TorchRec's routing: ceil(input_hash_size / buckets)
            shard = starts.index(start)
            tables.append(
                _Table(
                    name=path.rsplit(".", 1)[-1],
                    path=path,
                    module=mc,
                    buffers=keys,
                    rows=(start, start + rows),
                    raw_ids=(shard * block, min((shard + 1) * block, _EMPTY)),
                    segments=[*starts, size],
                    shard=shard,
                )
            )
        if not tables:
            return cls([], [])
        read({key: t for table in tables for key, t in table.buffers.items()})
        problems = [p for t in tables if (p := _select(t, rank, world_size, saved_world_size))]
        return cls(tables, problems)

    def apply(self) -> None:
        """Write this rank's slots of each moved table (in saved order) and sort them as TorchRec's load does."""
        with torch.no_grad():
            for t in self.tables:
                for key, whole in t.buffers.items():
                    t.module.get_buffer(key[len(t.path) + 1 :]).copy_(whole[t.slots])
                # This job's row segments (the load wrote the saving job's into the module's only copy), which
                # validate_state checks this shard against before it sorts.
                segments = _compat.collision_output_segments(t.module)
                segments.copy_(torch.tensor(t.segments + [-1] * (len(segments) - len(t.segments))))
                t.module.validate_state()


def _select(t: _Table, rank: int, world_size: int, saved_world_size: int | None) -> str:
    """Find this rank's saved slots (``t.slots``); a problem if one holds a raw id routed to another rank."""
    ids, rows = t.buffers[f"{t.path}.{_IDS}"], t.buffers[f"{t.path}.{_ROWS}"]
    t.slots = torch.nonzero((rows >= t.rows[0]) & (rows < t.rows[1])).squeeze(1)
    where = f"managed-collision table {t.name!r} ({t.path})"
    if len(t.slots) != t.rows[1] - t.rows[0]:
        return f"{where}: the checkpoint's slots hold {len(t.slots)} of rows [{t.rows[0]}, {t.rows[1]}), not each once"
    held = ids[t.slots]
    stray = held[(held != _EMPTY) & ((held < t.raw_ids[0]) | (held >= t.raw_ids[1]))]
    if not len(stray):
        return ""
    saved = "another number of" if saved_world_size is None else str(saved_world_size)
    return (
        f"{where}: on {world_size} ranks it has {world_size} buckets of raw ids (input_hash_size "
        f"{t.module.input_size()}); rank {rank} owns rows [{t.rows[0]}, {t.rows[1]}) and the raw ids "
        f"[{t.raw_ids[0]}, {t.raw_ids[1]}), but the checkpoint, saved on {saved} rank(s), gives {len(stray)} of "
        f"those rows to raw ids of other buckets (e.g. {sorted(stray.tolist())[:5]}). TorchRec reshards a "
        "managed-collision table by whole buckets and moves no embedding row, so those ids would lose their rows. "
        f"HINT: load it on {saved} rank(s), or on 1 (which takes any layout); a table trained on 1 rank cannot "
        "be spread over more."
    )
