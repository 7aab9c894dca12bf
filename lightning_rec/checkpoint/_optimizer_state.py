"""Optimizer state in a plan-independent form, so a checkpoint reshards across world sizes and plans.

TorchRec's fused optimizer names a table's state ``"<table>.momentum1"`` and shards it like the table; an
ordinary torch optimizer (Lightning's dense optimizers, and the one for ``data_parallel`` tables on CPU) keys
state by parameter index with its own names (``"sum"``, ``"exp_avg"``). In a checkpoint every optimizer's
state is keyed by parameter FQN, and a table's state has the fused name whichever kernel held it::

    {"state": {"ebc.embedding_bags.t_user.weight": {"momentum1": ShardedTensor},
               "mlp.0.weight": {"step": Tensor, "sum": Tensor}},
     "param_groups": [{"params": ["mlp.0.weight", ...], "lr": 0.1, ...}],   # dense groups, by FQN
     "embedding_lrs": [0.1]}                                                 # fused groups' rates

Row-wise Adagrad keeps one accumulator per row *and column shard* (``rows * shards`` values); loading it into
another number of column shards averages per row (weighted by shard width) and says so: exact when the plan
is unchanged, the best available estimate otherwise.

An optimizer made of several (the strategy's ``RecOptimizer``) is read through :class:`ComposedOptimizer`, the
interface it implements; nothing here imports the strategy.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torchrec.optim.keyed import KeyedOptimizer

from lightning_rec import _compat
from lightning_rec.config import _OPTIMIZER_FACTS

# The torch equivalent's class name -> {fused (FBGEMM) state name: its name}, and torch state name -> fused name, for
# tables on a non-fused kernel: from the optimizers' facts (lightning_rec.config).
_FUSED_TO_TORCH = {
    f.torch_equivalent: dict(f.state_names) for f in _OPTIMIZER_FACTS.values() if f.torch_equivalent and f.state_names
}
_TORCH_TO_FUSED = {torch: fused for names in _FUSED_TO_TORCH.values() for fused, torch in names.items()}
_ROWWISE = "momentum1"


class ComposedOptimizer(abc.ABC):
    """An optimizer made of several, as a checkpoint reads and restores it: TorchRec's fused (in-backward) table
    optimizer, the user's dense optimizer, and ordinary optimizers for tables on a non-fused kernel.

    The strategy's :class:`~lightning_rec._strategy.optim.RecOptimizer` implements it; a checkpoint then keys the
    fused state by table FQN, the dense and table optimizers' state by parameter FQN, and keeps the tables' learning
    rates (see the module docstring).

    Attributes:
        fused: the fused table optimizer (``DistributedModelParallel.fused_optimizer``).
        dense: the user's optimizer over the dense parameters.
        dense_params: the dense parameters by FQN.
        table_optimizers: ordinary optimizers for table parameters on a non-fused kernel.
        table_params: those table parameters by FQN.
    """

    fused: KeyedOptimizer
    dense: Optimizer
    dense_params: dict[str, Tensor]
    table_optimizers: list[Optimizer]
    table_params: dict[str, Tensor]

    @property
    @abc.abstractmethod
    def embedding_lrs(self) -> list[float]:
        """The learning rates the tables are trained with right now (saved with the state)."""

    @abc.abstractmethod
    def restore_embedding_lrs(self, lrs: Sequence[float]) -> None:
        """Set the tables' learning rates to ``lrs`` (as :attr:`embedding_lrs` listed them, maybe on another plan)."""


def is_tensor(value: Any) -> bool:
    """Tensors and ShardedTensors (what goes through DCP)."""
    return isinstance(value, (Tensor, _compat.ShardedTensor))


def _torch_state_by_fqn(optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


def _groups_by_fqn(optimizer: Optimizer, names: Mapping[int, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def _table_state_to_canonical(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        if name == "step":
            continue  # the fused kernels keep no step; Adagrad's only matters with lr_decay, which they lack
        canonical = _TORCH_TO_FUSED.get(name, name)
        out[canonical] = (
            value.reshape(-1) if canonical == _ROWWISE and value.dim() == 2 and value.shape[1] == 1 else value
        )
    return out


def canonical_state(optimizer: Optimizer, named_parameters: Mapping[str, Tensor]) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter FQN with plan-independent names (see the module docstring)."""
    optimizer = _compat.unwrap_optimizer(optimizer)
    if not isinstance(optimizer, ComposedOptimizer):
        names = {id(p): n for n, p in named_parameters.items()}
        return {"state": _torch_state_by_fqn(optimizer, names), "param_groups": _groups_by_fqn(optimizer, names)}
    dense_names = {id(p): n for n, p in optimizer.dense_params.items()}
    state = {
        fqn: {name.rsplit(".", 1)[-1]: value for name, value in entries.items()}
        for fqn, entries in optimizer.fused.state_dict()["state"].items()
    }
    state.update(_torch_state_by_fqn(optimizer.dense, dense_names))
    table_names = {id(p): n for n, p in optimizer.table_params.items()}
    for table_optimizer in optimizer.table_optimizers:
        for fqn, entries in _torch_state_by_fqn(table_optimizer, table_names).items():
            state[fqn] = _table_state_to_canonical(entries)
    return {
        "state": state,
        "param_groups": _groups_by_fqn(optimizer.dense, dense_names),
        "embedding_lrs": optimizer.embedding_lrs,
    }


class OptimizerTarget:
    """Where one optimizer's checkpointed state goes: in place for fused tables, fresh tensors otherwise.

    Built from the live optimizer and the checkpoint's entries (``{fqn: {name: (shape, dtype)}}``);
    :attr:`problems` lists everything that does not fit, :meth:`apply` installs the state once DCP filled
    :attr:`tensors`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        named_parameters: Mapping[str, Tensor],
        model_state: Mapping[str, Any],
        saved: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
        saved_groups: Sequence[Mapping[str, Any]],
        table_widths: Mapping[str, list[int]],
        saved_extra: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.optimizer = _compat.unwrap_optimizer(optimizer)
        self.tensors: dict[tuple[str, str], Tensor] = {}  # (fqn, name) -> what DCP loads into
        self.problems: list[str] = []
        self._saved_groups = saved_groups
        self._extra = saved_extra or {}  # non-tensor state values (kept in meta.pt)
        self._convert: dict[tuple[str, str], _compat.ShardedTensor] = {}  # row-wise accumulators to re-split
        self._table_widths = table_widths
        self._torch: list[tuple[Optimizer, dict[int, str]]] = []  # torch optimizers fed by load_state_dict
        self._rows: dict[str, int] = {}
        live: dict[str, dict[str, Any]] = {}  # fused state, in place
        owners: dict[str, str] = {}  # fqn -> "dense"/"table"/"fused"
        if isinstance(self.optimizer, ComposedOptimizer):
            live = canonical_state(self.optimizer, named_parameters)["state"]
            live = {
                fqn: e
                for fqn, e in live.items()
                if fqn not in self.optimizer.dense_params and fqn not in self.optimizer.table_params
            }
            # Every sharded table is the fused optimizer's, also on ranks that hold none of it (no local state).
            owners.update({fqn: "fused" for fqn, v in model_state.items() if isinstance(v, _compat.ShardedTensor)})
            owners.update({fqn: "fused" for fqn in live})
            owners.update({fqn: "dense" for fqn in self.optimizer.dense_params})
            owners.update({fqn: "table" for fqn in self.optimizer.table_params})
            self._torch.append((self.optimizer.dense, {id(p): n for n, p in self.optimizer.dense_params.items()}))
            table_names = {id(p): n for n, p in self.optimizer.table_params.items()}
            self._torch += [(table_optimizer, table_names) for table_optimizer in self.optimizer.table_optimizers]
            self._rows = {fqn: int(v.size(0)) for fqn, v in model_state.items() if fqn in owners and is_tensor(v)}
        else:
            names = {id(p): n for n, p in named_parameters.items()}
            owned = {names[id(p)] for g in self.optimizer.param_groups for p in g["params"] if id(p) in names}
            owners.update({fqn: "dense" for fqn in owned})
            self._torch.append((self.optimizer, names))

        for fqn in sorted(set(saved) - set(owners)):
            self.problems.append(
                f"optimizer state for {fqn}: in the checkpoint, but the optimizer has no such parameter"
            )
        for fqn, entries in sorted(live.items()):
            if entries and fqn not in saved:
                self.problems.append(f"optimizer state for {fqn}: missing from the checkpoint")
        for fqn, saved_entries in saved.items():
            if fqn not in owners:
                continue
            for name, (shape, dtype) in saved_entries.items():
                target = live.get(fqn, {}).get(name) if owners[fqn] == "fused" else None
                if owners[fqn] == "fused" and fqn not in live:
                    continue  # no shard of this table here
                if owners[fqn] == "fused" and target is None:
                    self.problems.append(f"optimizer state {fqn}/{name}: in the checkpoint, not in the fused optimizer")
                elif target is not None and tuple(target.size()) != tuple(shape):
                    if self._rowwise_convertible(fqn, name, target, shape):
                        self._convert[(fqn, name)] = target
                        self.tensors[(fqn, name)] = torch.empty(shape, dtype=dtype)
                    else:
                        self.problems.append(
                            f"optimizer state {fqn}/{name}: shape {tuple(shape)} in the checkpoint, "
                            f"{tuple(target.size())} in the optimizer"
                        )
                else:
                    self.tensors[(fqn, name)] = target if target is not None else torch.empty(shape, dtype=dtype)
            for name in set(live.get(fqn, {})) - set(saved_entries):
                self.problems.append(f"optimizer state {fqn}/{name}: missing from the checkpoint")
        self._check_groups()

    def _rowwise_convertible(self, fqn: str, name: str, target: Any, shape: Sequence[int]) -> bool:
        rows = self._rows.get(fqn)
        return (
            name == _ROWWISE
            and rows is not None
            and len(shape) == 1
            and target.dim() == 1
            and shape[0] % rows == 0
            and target.size(0) % rows == 0
        )

    def _check_groups(self) -> None:
        dense, names = self._torch[0]
        live = [[names.get(id(p), "?") for p in g["params"]] for g in dense.param_groups]
        saved = [list(g.get("params", [])) for g in self._saved_groups]
        if saved and sorted(map(sorted, live)) != sorted(map(sorted, saved)):
            self.problems.append(
                f"optimizer param groups: the checkpoint has {len(saved)} group(s) of {[len(g) for g in saved]} "
                f"parameters, the optimizer {len(live)} of {[len(g) for g in live]} (configure_optimizers changed?)"
            )

    def apply(self, embedding_lrs: Sequence[float] | None, global_step: int) -> None:
        """Install the loaded state (after DCP filled :attr:`tensors`)."""
        for (fqn, name), target in self._convert.items():
            self._split_rowwise(fqn, self.tensors[(fqn, name)], target)
        (dense, dense_names), *tables = self._torch  # the dense optimizer, then the data-parallel tables' one
        self._load_torch(dense, dense_names, False, global_step, saved_groups=self._saved_groups)
        for optimizer, names in tables:
            self._load_torch(optimizer, names, True, global_step, saved_groups=None)
        if isinstance(self.optimizer, ComposedOptimizer) and embedding_lrs:
            self.optimizer.restore_embedding_lrs(embedding_lrs)

    def _load_torch(
        self,
        optimizer: Optimizer,
        names: Mapping[int, str],
        is_table: bool,
        global_step: int,
        saved_groups: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        by_name: dict[str, dict[str, Any]] = {fqn: dict(self._extra.get(fqn, {})) for fqn in names.values()}
        for (fqn, name), value in self.tensors.items():
            if fqn in by_name:
                by_name[fqn][name] = value
        saved_by_params = {tuple(sorted(g["params"])): g for g in saved_groups or []}
        # In place, not `optimizer.load_state_dict` (which swaps in new group dicts): the RecOptimizer follows
        # its source group's learning rate by reference, and schedulers hold the optimizer.
        for group in optimizer.param_groups:
            fqns = [names[id(p)] for p in group["params"]]
            saved = saved_by_params.get(tuple(sorted(fqns)))
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k != "params"})
            for fqn, param in zip(fqns, group["params"]):
                entries = by_name.get(fqn) or {}
                if is_table and entries:
                    entries = self._table_state_from_canonical(optimizer, fqn, entries, global_step)
                optimizer.state.pop(param, None)
                if entries:
                    optimizer.state[param] = {
                        k: v.to(dtype=param.dtype, device=param.device) if isinstance(v, Tensor) and k != "step" else v
                        for k, v in entries.items()
                    }

    def _table_state_from_canonical(
        self, optimizer: Optimizer, fqn: str, entries: dict[str, Tensor], global_step: int
    ) -> dict[str, Tensor]:
        mapping = _FUSED_TO_TORCH.get(type(optimizer).__name__, {})
        out = {mapping.get(k, k): v for k, v in entries.items()}
        if "sum" in out and type(optimizer).__name__ == "RowWiseAdagrad":
            out["sum"] = self._rowwise_mean(fqn, out["sum"]).reshape(-1, 1)
        out.setdefault("step", torch.tensor(float(global_step)))
        return out

    def _rowwise_mean(self, fqn: str, source: Tensor) -> Tensor:
        """Per-row accumulator from one saved with any number of column shards (width-weighted mean)."""
        rows = self._rows[fqn]
        blocks = source.reshape(-1, rows)
        if blocks.shape[0] == 1:
            return blocks[0]
        widths = self._table_widths.get(fqn) or []
        weights = torch.tensor(
            widths if len(widths) == blocks.shape[0] else [1.0] * blocks.shape[0], dtype=blocks.dtype
        )
        rank_zero_warn(
            f"{fqn}: row-wise Adagrad accumulators were saved for {blocks.shape[0]} column shards and are loaded "
            "into another plan; each row gets the width-weighted mean of its saved accumulators. Training continues "
            "from there, but not bit-exactly as it would have on the saved plan."
        )
        return (blocks * weights[:, None]).sum(0) / weights.sum()

    def _split_rowwise(self, fqn: str, source: Tensor, target: _compat.ShardedTensor) -> None:
        rows = self._rows[fqn]
        per_row = self._rowwise_mean(fqn, source)
        for shard in target.local_shards():
            start, n = shard.metadata.shard_offsets[0] % rows, shard.tensor.numel()
            shard.tensor.detach().copy_(per_row[start : start + n])
