"""``ModelPublisher``: publish a model while it trains, as versions a server follows (deltas between fulls).

Every ``every_n_steps`` training steps the callback writes a *version* into a publish directory: a **delta**, the
rows of each table that some batch touched since the previous version (in the served artifact's table dtype, built
with :func:`lightning_rec.serving.deltas.artifact_rows`) plus every dense parameter and buffer, and every
``full_every`` versions also a **full** ``.pt2`` of the same step (a sharded checkpoint written synchronously, then
``export_inference(..., format="pt2")`` in a background process). ``LATEST``, written last and atomically, points to
the newest version a server can reach (a full and every delta after it); a server started from the newest full
``<= LATEST`` and the deltas up to ``LATEST`` holds exactly the trained model of that step.

How the rows touched are known: a forward hook on each sharded embedding module marks the ids of its input (each
feature's ids, into the table the feature reads: shared tables and weighted features included) in a per-table bit
map of this rank; at a publish the maps of all ranks are combined (one all-reduce), and each rank writes the touched
rows it holds (row-wise and table-wise shards; a column-wise table's rows assembled from its column blocks on the
rank holding the first). A managed-collision table's ids are remapped inside the sharded module, so its rows are
published whole in every delta. FBGEMM's fused optimizers change only the rows of the batch (their weight decay
too), so the deltas are exact for them; a table trained by an ordinary optimizer that moves rows with a zero
gradient (momentum, Adam, weight decay) is refused when fitting starts.

The callback's state (the version, the ids touched since it, the versions since the last full) is part of every
Lightning checkpoint; on resume, versions already on disk after the checkpoint's are accounted for: the next version
follows the newest complete one, and its delta holds every row those versions changed too, so a server that took
them is corrected. What a killed publish left (a staging directory, a temporary file) is removed.

Example::

    from lightning_rec.publish import ModelPublisher
    trainer = L.Trainer(strategy="recshard", callbacks=[ModelPublisher("publish/", every_n_steps=500, full_every=20)])
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec import _publish_dir as pubdir
from lightning_rec._choices import check_choice
from lightning_rec._strategy.dmp import sharded_state
from lightning_rec._strategy.optim import RecOptimizer
from lightning_rec.checkpoint._layout import fsync_dir
from lightning_rec.serving.export import TableDtype

__all__ = ["ModelPublisher"]

_TABLE_KEY = re.compile(r"\.(?:embedding_bags|embeddings)\.([^.]+)\.weight$")
_STATE_VERSION = 1


class ModelPublisher(Callback):
    """Publish versions of the model into ``dirpath`` while it trains (see :mod:`lightning_rec.publish`).

    Args:
        dirpath: the publish directory (created; a directory from an earlier run of the same model is continued).
        every_n_steps: a version every this many optimizer steps (and one at the end of fitting).
        full_every: every this many versions is also a full ``.pt2`` (version 1 always is).
        keep: the newest versions kept on disk, beyond what a server starting now needs (the newest full at or
            before ``LATEST`` and every delta after it, never deleted).
        table_dtype: the served tables' storage, as :func:`~lightning_rec.serving.export_inference`'s.
        event_time: the batch's key (or attribute) holding each sample's event timestamp: the newest one trained on
            is recorded in each manifest as ``event_time``; ``None``: not recorded.
        export_args: more keyword arguments of :func:`~lightning_rec.serving.export_inference` for the fulls (e.g.
            ``num_dense_features``, ``init_args``).

    Raises:
        ValueError: a bad argument, named, before anything is written.

    Example::

        publisher = ModelPublisher("publish/", every_n_steps=100, full_every=10, keep=20, table_dtype="int8")
        trainer = L.Trainer(strategy="recshard", callbacks=[publisher], max_steps=10_000)
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int = 100,
        full_every: int = 10,
        keep: int = 10,
        table_dtype: TableDtype = "int8",
        event_time: str | None = None,
        export_args: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("full_every", full_every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelPublisher: {name} must be an integer >= 1, got {value!r}.")
        check_choice("ModelPublisher", "table_dtype", table_dtype, TableDtype)
        self.table_dtype: str = table_dtype
        reserved = {"format", "table_dtype"} & set(export_args or {})
        if reserved:
            raise ValueError(f"ModelPublisher: export_args cannot set {sorted(reserved)} (the publisher sets them).")
        self.dirpath = Path(dirpath)
        self.every_n_steps, self.full_every, self.keep = every_n_steps, full_every, keep
        self.event_time = event_time
        self.export_args = dict(export_args or {})
        self.version = 0  # the newest version written
        self._since_full = 0  # versions written since the newest full's
        self._masks: dict[str, Tensor] = {}  # table -> this rank's rows touched since `version`
        self._whole: set[str] = set()  # managed-collision tables: published whole
        self._hooks: list[Any] = []
        self._recording = False
        self._newest_event: Tensor | None = None
        self._last_step = -1
        self._exports: list[pubdir.BackgroundExport] = []  # oldest first; the first one runs
        self._failed: str | None = None  # rank 0: the last failed export's message
        self._restored: dict[str, Any] | None = None
        self._table_keys: dict[str, str] = {}  # training state_dict key -> table name

    # --- Lightning hooks ---

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = sharded_state(pl_module)
        if state is None:
            raise TypeError(
                f"ModelPublisher needs a model sharded by the recshard strategy; this Trainer runs "
                f"{type(trainer.strategy).__name__}. HINT: L.Trainer(strategy='recshard', ...)."
            )
        _refuse_row_moving_optimizers(trainer)
        self._track(pl_module, state.inputs)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored = self._restored or {}
        self._restored = None
        since = int(restored.get("version", 0))
        self._since_full = int(restored.get("since_full", 0))
        self._mark(restored.get("touched", {}))
        found: dict[str, Any] | None = None
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            pubdir.remove_incomplete(self.dirpath)
            on_disk = pubdir.complete_versions(self.dirpath)
            newest = max(on_disk, default=0)
            # Versions a killed run wrote after this checkpoint: a server may hold their rows, so they go again.
            later = pubdir.ids_of_deltas(self.dirpath, [v for v in on_disk if v > since])
            found = {"newest": newest, "later": later, "fulls": bool(pubdir.fulls(self.dirpath))}
            self._resume_exports(since)
            self._advance_pointer()
        found = trainer.strategy.broadcast(found, src=0)
        assert found is not None
        self._mark(found["later"])
        self.version = max(since, found["newest"])
        if self.version and not found["fulls"] and not self._exports_pending(trainer):
            self._since_full = self.full_every  # no full to start a chain from: the next version is one
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._recording = True
        if self.event_time is not None:
            times = batch[self.event_time] if isinstance(batch, Mapping) else getattr(batch, self.event_time)
            newest = torch.as_tensor(times).max()
            self._newest_event = newest if self._newest_event is None else torch.maximum(self._newest_event, newest)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._recording = False
        if trainer.is_global_zero and self._exports and not self._exports[0].running():
            self._finish_exports(wait=False)
        step = trainer.global_step
        if step != self._last_step and step % self.every_n_steps == 0:
            self.publish(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.publish(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A fit that fails or is preempted takes its exports with it; their checkpoints stay, and the next fit in
        # this directory exports them again (see `_resume_exports`).
        for export in self._exports:
            export.stop()
        self._exports = []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        # The exports still running are waited for here, after the last collective of the fit: a rank waiting in
        # one for rank 0's compiles would reach the process group's timeout.
        if stage == "fit" and trainer.is_global_zero and (self._exports or self._failed):
            failed = self._finish_exports(wait=True)
            if failed:
                raise RuntimeError(failed)

    @override
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while a checkpoint is dumped; rank 0's copy is the one saved, so it holds the union.
        return {
            "format": _STATE_VERSION,
            "version": self.version,
            "since_full": self._since_full,
            "touched": self._touched_everywhere(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != _STATE_VERSION:
            raise ValueError(
                f"ModelPublisher: the checkpoint's publisher state has format {state_dict.get('format')!r}; this "
                f"version reads {_STATE_VERSION}."
            )
        self._restored = dict(state_dict)

    # --- Publishing ---

    def publish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Write the next version now (every rank calls this; the hooks call it every ``every_n_steps``).

        Returns:
            the version written.
        """
        version, rank = self.version + 1, trainer.global_rank
        touched = self._touched_everywhere()
        decided: tuple[str, bool] | None = None
        if trainer.is_global_zero:  # a failed export (known to rank 0) makes this version a full again
            full = version == 1 or self._since_full + 1 >= self.full_every or self._failed is not None
            self._failed = None
            (self.dirpath / pubdir.VERSIONS).mkdir(parents=True, exist_ok=True)
            staging = self.dirpath / pubdir.VERSIONS / f".{pubdir.version_name(version)}.{secrets.token_hex(4)}"
            staging.mkdir()
            decided = (str(staging), full)
        decided = trainer.strategy.broadcast(decided, src=0)
        assert decided is not None
        staging, full = Path(decided[0]), decided[1]
        part = staging / pubdir.delta_part(rank)
        torch.save(self._delta(pl_module, touched, rank), part)
        from lightning_rec.serving.deltas import file_record

        records = _gather({part.name: file_record(part)})
        for mask in self._masks.values():
            mask.zero_()
        self.version, self._since_full, self._last_step = (
            version,
            0 if full else self._since_full + 1,
            trainer.global_step,
        )
        info: dict[str, Any] = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "world_size": trainer.world_size,
            "table_dtype": self.table_dtype,
            "event_time": None if self._newest_event is None else self._newest_event.item(),
        }
        checkpoint = self.dirpath / pubdir.CHECKPOINTS / pubdir.version_name(version)
        if full:  # the same step, synchronously: the export reads it in the background
            trainer.save_checkpoint(checkpoint)
        if trainer.is_global_zero:
            files = {name: record for rank_files in records for name, record in rank_files.items()}
            document = pubdir.manifest(version, "delta", files=files, **info)
            pubdir.write_json_atomic(staging / pubdir.MANIFEST, document)
            if full:
                export = {"export": self.export_args}
                self._exports.append(pubdir.BackgroundExport(self.dirpath, version, checkpoint, info, export))
                self._exports[0].start()
            self._before_pointer(version, "files")
            os.rename(staging, self.dirpath / pubdir.VERSIONS / pubdir.version_name(version))
            fsync_dir(self.dirpath / pubdir.VERSIONS)
            self._before_pointer(version, "renamed")
            self._advance_pointer()
        return version

    def _before_pointer(self, version: int, stage: str) -> None:
        """Between a version's files and the pointer (rank 0), at ``stage`` ``"files"`` (every file written, the
        directory not renamed into place) and ``"renamed"``: a seam for tests that kill the run exactly there."""

    def _advance_pointer(self) -> None:
        """Rank 0: move ``LATEST`` to the newest version a server can reach, then apply retention."""
        reachable = pubdir.newest_chain(self.dirpath)
        current = pubdir.read_latest(self.dirpath)
        if reachable is not None and (current is None or reachable > current):
            pubdir.write_pointer(self.dirpath, reachable)
        pubdir.retain(self.dirpath, self.keep)

    def _finish_exports(self, wait: bool) -> str | None:
        """Rank 0: collect the ended background exports (all of them with ``wait``; one runs at a time, in order),
        remove the checkpoints they were made from, start the next, move the pointer. A failed export is warned
        about and the next version is a full again (``_failed``); returns the failure."""
        while self._exports and (wait or self._exports[0].done()):
            export = self._exports.pop(0)
            failure = export.failure()
            if failure is None:
                pubdir.remove_checkpoint(export.checkpoint)
                export.log.unlink(missing_ok=True)
            else:
                rank_zero_warn(failure)
                self._failed = failure
        if self._exports:
            self._exports[0].start()
        self._advance_pointer()
        return self._failed

    def _resume_exports(self, since: int) -> None:
        """Rank 0 at the start of fitting: a checkpoint left without its full (the run ended during its export) is
        exported again; an incomplete one is removed."""
        folder = self.dirpath / pubdir.CHECKPOINTS
        have = set(pubdir.fulls(self.dirpath))
        for checkpoint in sorted(folder.iterdir()) if folder.is_dir() else ():
            version = int(checkpoint.name[1:]) if re.fullmatch(r"v\d{6,}", checkpoint.name) else None
            if version is None or version in have or not pubdir.is_complete_checkpoint(checkpoint):
                pubdir.remove_checkpoint(checkpoint)
                continue
            manifest = pubdir.version_manifest(self.dirpath, version)
            if manifest is None:  # its version never became complete: nothing to export for
                pubdir.remove_checkpoint(checkpoint)
                continue
            info = {k: manifest[k] for k in ("step", "epoch", "world_size", "table_dtype", "event_time")}
            self._exports.append(
                pubdir.BackgroundExport(self.dirpath, version, checkpoint, info, {"export": self.export_args})
            )
        if self._exports:
            self._exports[0].start()

    def _exports_pending(self, trainer: pl.Trainer) -> bool:
        return bool(trainer.strategy.broadcast(bool(self._exports), src=0))

    # --- Touched ids ---

    def _track(self, pl_module: pl.LightningModule, inputs: Mapping[str, Any]) -> None:
        """Hook every sharded embedding module: its input's ids mark rows of its tables."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._table_keys = [], {}
        state = pl_module.state_dict()
        for path, spec in inputs.items():
            tables = {table for table, _ in spec.tables.values()}
            for key in state:
                match = _TABLE_KEY.search(key)
                if key.startswith(f"{path}.") and match and match.group(1) in tables:
                    self._table_keys[key] = match.group(1)
            rows = {self._table_keys[k]: int(v.size(0)) for k, v in state.items() if k in self._table_keys}
            if spec.raw_ids:  # remapped inside the sharded module: these tables go whole
                self._whole |= tables
                continue
            features = {feature: table for feature, (table, _) in spec.tables.items()}
            for table in set(features.values()):
                if table not in self._masks:  # one extra slot: ids outside the table (bounds_check="ignore")
                    self._masks[table] = torch.zeros(rows[table] + 1, dtype=torch.bool, device=pl_module.device)
            module = pl_module.get_submodule(path)
            self._hooks.append(module.register_forward_hook(self._recorder(features), with_kwargs=True))

    def _recorder(self, features: dict[str, str]) -> Callable[..., None]:
        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._recording:
                return
            kjt = next((a for a in (*args, *kwargs.values()) if isinstance(a, KeyedJaggedTensor)), None)
            if kjt is None:
                return
            # After the module's input distribution: the per-key lengths are known, no extra host sync.
            values, offsets = kjt.values(), kjt.offset_per_key()
            for i, key in enumerate(kjt.keys()):
                table = features.get(key)
                if table is not None and offsets[i + 1] > offsets[i]:
                    mask = self._masks[table]
                    mask[values[offsets[i] : offsets[i + 1]].clamp(0, mask.numel() - 1)] = True

        return record

    def _mark(self, ids: Mapping[str, Tensor]) -> None:
        for table, rows in ids.items():
            if table in self._masks and len(rows):
                mask = self._masks[table]
                mask[torch.as_tensor(rows, device=mask.device).clamp(0, mask.numel() - 1)] = True

    def _touched_everywhere(self) -> dict[str, Tensor]:
        """Every rank's touched rows, by table (one all-reduce of the bit maps), as sorted CPU ids."""
        names = sorted(self._masks)
        if not names:
            return {}
        flat = torch.cat([self._masks[t][:-1] for t in names]).to(torch.uint8)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        out, start = {}, 0
        for table in names:
            n = self._masks[table].numel() - 1
            out[table] = flat[start : start + n].nonzero().flatten().cpu()
            start += n
        return out

    # --- The delta ---

    def _delta(self, pl_module: pl.LightningModule, touched: Mapping[str, Tensor], rank: int) -> dict[str, Tensor]:
        """This rank's part: the touched rows it holds (as the artifact stores them) and, on rank 0, the dense
        state. Collective: every rank calls it."""
        from lightning_rec.serving.deltas import artifact_rows, encode_part

        state = pl_module.state_dict()
        tables: dict[str, tuple[Tensor, Tensor]] = {}
        dense: dict[str, Tensor] = {}
        for key in sorted(state):  # the same order on every rank: some entries take collectives
            value, table = state[key], self._table_keys.get(key)
            if table is None:
                whole = _whole_tensor(value)
                if rank == 0:
                    dense[key] = whole
                continue
            ids = torch.arange(int(value.size(0))) if table in self._whole else touched.get(table, torch.empty(0))
            for row_ids, rows in _rows_held(value, ids.long(), rank):
                if len(row_ids):
                    tables[table] = (row_ids, artifact_rows(rows.float().cpu(), self.table_dtype))
        return encode_part(tables, dense)


def _gather(obj: Any) -> list[Any]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _whole_tensor(value: Any) -> Tensor:
    """A state entry as one tensor (a ShardedTensor, e.g. a managed-collision remap buffer, from every rank's
    shards: collective). Meaningful on every rank."""
    if not isinstance(value, _compat.ShardedTensor):
        return value
    shards = _gather([(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()])
    whole = torch.empty(tuple(value.size()), dtype=value.dtype)
    for offsets, tensor in (s for rank_shards in shards for s in rank_shards):
        whole[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    return whole


def _rows_held(value: Any, ids: Tensor, rank: int) -> list[tuple[Tensor, Tensor]]:
    """The rows ``ids`` of one table that this rank writes, whole (every column), with their ids.

    A replicated (data-parallel) table: rank 0. Row-wise and table-wise shards: the rank holding the rows. Column
    blocks: every rank sends its blocks of those rows to the rank holding the first block of their row range
    (collective, called for every column-split table on every rank).
    """
    if not isinstance(value, _compat.ShardedTensor):
        return [(ids, value.detach()[ids.to(value.device)])] if rank == 0 else []
    dim = int(value.size(1))
    layout = value.metadata().shards_metadata
    if all(m.shard_offsets[1] == 0 and m.shard_sizes[1] == dim for m in layout):
        held = []
        for shard in value.local_shards():
            (r0, _), (n, _) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            sel = ids[(ids >= r0) & (ids < r0 + n)]
            held.append((sel, shard.tensor.detach()[(sel - r0).to(shard.tensor.device)]))
        return held
    blocks = []
    for shard in value.local_shards():
        (r0, c0), (n, _) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        sel = ids[(ids >= r0) & (ids < r0 + n)]
        blocks.append((r0, n, c0, shard.tensor.detach()[(sel - r0).to(shard.tensor.device)].cpu()))
    gathered = [b for rank_blocks in _gather(blocks) for b in rank_blocks]
    held = []
    for m in layout:
        (r0, c0), (n, _) = m.shard_offsets, m.shard_sizes
        if c0 != 0 or m.placement is None or m.placement.rank() != rank:
            continue
        sel = ids[(ids >= r0) & (ids < r0 + n)]
        rows = torch.empty(len(sel), dim, dtype=value.dtype)
        for b_r0, b_n, b_c0, tensor in gathered:
            if (b_r0, b_n) == (r0, n):
                rows[:, b_c0 : b_c0 + tensor.shape[1]] = tensor
        held.append((sel, rows))
    return held


def _refuse_row_moving_optimizers(trainer: pl.Trainer) -> None:
    """Refuse a table trained by an ordinary optimizer that changes rows with a zero gradient (their step would be
    in no delta). Tables on FBGEMM's fused kernels are not checked: the fused update reads only the batch's rows."""
    for optimizer in trainer.optimizers:
        inner = _compat.unwrap_optimizer(optimizer)
        if not isinstance(inner, RecOptimizer):
            continue
        names = {id(p): n for n, p in inner.table_params.items()}
        for table_optimizer in inner.table_optimizers:
            for group in table_optimizer.param_groups:
                why = _moves_untouched_rows(table_optimizer, group)
                if why:
                    name = next((names[id(p)] for p in group["params"] if id(p) in names), "?")
                    raise ValueError(
                        f"ModelPublisher: table parameter {name!r} is trained by {type(table_optimizer).__name__} "
                        f"on a non-fused (data_parallel) kernel with {why}, which changes rows no batch touched, so "
                        "a delta would miss them. HINT: train the tables with SGD (no momentum) or Adagrad, without "
                        "weight decay, or shard this table row_wise/table_wise/column_wise (FBGEMM's fused update "
                        "changes only the batch's rows)."
                    )


def _moves_untouched_rows(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> str | None:
    if group.get("weight_decay", 0):
        return f"weight_decay={group['weight_decay']}"
    if isinstance(optimizer, torch.optim.SGD):
        return f"momentum={group['momentum']}" if group.get("momentum", 0) else None
    if isinstance(optimizer, torch.optim.Adagrad) or type(optimizer).__name__ == "RowWiseAdagrad":
        return None
    return "its update rule (state that moves a row whatever its gradient)"
