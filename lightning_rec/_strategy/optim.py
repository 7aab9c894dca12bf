"""Embedding (fused, in-backward) optimizers and how they combine with the user's dense optimizers.

TorchRec's FBGEMM kernels update embedding rows inside the backward pass. Such an optimizer is described by
:class:`~lightning_rec.config.EmbeddingOptimizer` (typed configuration, which validates itself for a device and
turns itself into TorchRec ``fused_params``; importable from here too). This module

* derives it from the optimizer a user returned from ``configure_optimizers`` (same family, same
  hyperparameters) or refuses with a clear error when FBGEMM has no equivalent kernel;
* removes embedding parameters from the user's optimizer (so they are never updated twice);
* combines both into :class:`RecOptimizer`, a TorchRec ``CombinedOptimizer`` that Lightning can drive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch.optim import Optimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from lightning_rec import _compat
from lightning_rec.checkpoint._optimizer_state import ComposedOptimizer
from lightning_rec.config import _OPTIMIZER_FACTS, BoundsCheck, EmbeddingOptimizer

_BOUNDS_CHECK_MODES: dict[str, BoundsCheckMode] = {
    "error": BoundsCheckMode.FATAL,
    "warn": BoundsCheckMode.WARNING,
    "ignore": BoundsCheckMode.IGNORE,
    "none": BoundsCheckMode.NONE,
}


def bounds_check_params(mode: BoundsCheck) -> dict[str, Any]:
    """``fused_params`` selecting FBGEMM's behaviour for ids outside a table.

    Args:
        mode: ``"error"`` (raise), ``"warn"`` (FBGEMM warns and reads row 0 instead), ``"ignore"`` (silently
            read row 0) or ``"none"`` (no check at all: fastest, undefined on bad ids).
    """
    if mode not in _BOUNDS_CHECK_MODES:
        raise ValueError(f"bounds_check must be one of {sorted(_BOUNDS_CHECK_MODES)}, got {mode!r}.")
    return {"bounds_check_mode": _BOUNDS_CHECK_MODES[mode]}


# ---------------------------------------------------------------------------------------------------------
# Deriving the embedding optimizer from what the user returned in `configure_optimizers`.
# ---------------------------------------------------------------------------------------------------------


def _torchrec_rowwise_adagrad() -> type | None:
    try:
        from torchrec.optim import RowWiseAdagrad

        return RowWiseAdagrad
    except ImportError:  # pragma: no cover - torchrec always ships it today
        return None


def _require_default(optimizer: Optimizer, group: Mapping[str, Any], key: str, default: Any) -> None:
    value = group.get(key, default)
    if value != default:
        raise ValueError(
            f"The embedding tables are optimized by {type(optimizer).__name__}({key}={value!r}), but FBGEMM's "
            f"fused {type(optimizer).__name__} only supports {key}={default!r}: the tables would be trained "
            "differently from what you asked. HINT: declare the embedding optimizer explicitly with "
            "`RecLightningModule.configure_embedding_optimizer()` (or the strategy's `embedding_optimizer=`), "
            f"or give the embedding parameters their own param group without {key}."
        )


def embedding_optimizer_from_torch(optimizer: Optimizer, group: Mapping[str, Any]) -> EmbeddingOptimizer:
    """The fused equivalent of ``optimizer``'s update rule for the parameters of ``group``.

    Raises a ``ValueError`` naming the supported choices when FBGEMM has no equivalent (for example SGD with
    momentum, or AdamW), instead of silently training the tables with a different rule.

    Example::

        >>> opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        >>> embedding_optimizer_from_torch(opt, opt.param_groups[0]).name
        'adagrad'
    """
    kind = type(optimizer)
    for flag in ("maximize", "differentiable"):
        _require_default(optimizer, group, flag, False)
    if kind is torch.optim.SGD:
        for key in ("momentum", "dampening", "weight_decay"):
            _require_default(optimizer, group, key, 0)
        _require_default(optimizer, group, "nesterov", False)
        return EmbeddingOptimizer("sgd", lr=float(group["lr"]))
    if kind is torch.optim.Adagrad:
        for key in ("lr_decay", "initial_accumulator_value", "weight_decay"):
            _require_default(optimizer, group, key, 0)
        return EmbeddingOptimizer("adagrad", lr=float(group["lr"]), eps=float(group["eps"]))
    if kind is _torchrec_rowwise_adagrad():
        for key in ("lr_decay", "initial_accumulator_value", "weight_decay"):
            _require_default(optimizer, group, key, 0)
        return EmbeddingOptimizer("rowwise_adagrad", lr=float(group["lr"]), eps=float(group["eps"]))
    if kind is torch.optim.Adam:
        _require_default(optimizer, group, "amsgrad", False)
        _require_default(optimizer, group, "weight_decay", 0)
        return EmbeddingOptimizer("adam", lr=float(group["lr"]), eps=float(group["eps"]), betas=tuple(group["betas"]))
    raise ValueError(
        f"The embedding tables are in a {kind.__module__}.{kind.__name__} param group, and FBGEMM has no fused "
        "(in-backward) version of it. Fused embedding optimizers: torch.optim.SGD (no momentum), "
        "torch.optim.Adagrad, torchrec.optim.RowWiseAdagrad, torch.optim.Adam (CUDA only). HINT: use one of "
        "those for the embedding parameters, or declare the embedding optimizer explicitly with "
        "`RecLightningModule.configure_embedding_optimizer()` and keep any optimizer for the dense part."
    )


def embedding_groups(
    optimizers: Iterable[Optimizer], is_embedding: Callable[[torch.Tensor], bool]
) -> list[tuple[int, dict[str, Any]]]:
    """Every (optimizer index, param group) that holds embedding parameters, in order."""
    return [
        (idx, group)
        for idx, opt in enumerate(optimizers)
        for group in opt.param_groups
        if any(is_embedding(p) for p in group["params"])
    ]


def find_embedding_group(
    optimizers: Iterable[Optimizer], is_embedding: Callable[[torch.Tensor], bool]
) -> tuple[int, dict[str, Any]] | None:
    """Locate the single (optimizer index, param group) that holds the embedding parameters.

    Returns ``None`` when no optimizer holds any. Raises when they are spread over several groups (see
    :func:`resolve_embedding_optimizer`, which trains each table by its own group when it knows the tables).
    """
    found = embedding_groups(optimizers, is_embedding)
    if len(found) > 1:
        raise ValueError(
            f"The embedding parameters are spread over {len(found)} optimizer param groups. A fused embedding "
            "optimizer needs one set of hyperparameters per table. HINT: put each table's weight in one param group, "
            "or declare the embedding optimizer with `RecLightningModule.configure_embedding_optimizer()`."
        )
    return found[0] if found else None


TableOptimizers = dict[str, tuple[EmbeddingOptimizer, dict[str, Any] | None]]
"""Per table name: the fused optimizer derived from the param group holding its weight, and that group (whose
learning rate it follows; ``None`` for a table given its own with ``apply_optimizer_in_backward``)."""


def _from_in_backward(optimizer_class: type, kwargs: Mapping[str, Any]) -> EmbeddingOptimizer:
    """The fused equivalent of an optimizer TorchRec's ``apply_optimizer_in_backward`` gave a table."""
    probe = optimizer_class([torch.nn.Parameter(torch.zeros(1, 1))], **kwargs)
    return embedding_optimizer_from_torch(probe, probe.param_groups[0])


def strip_params(optimizer: Optimizer, is_embedding: Callable[[torch.Tensor], bool]) -> int:
    """Remove embedding parameters (and any state created for them) from ``optimizer``, in place.

    The optimizer object, its param groups (now possibly empty, but still carrying their learning rates for
    LR schedulers) and the state of the remaining parameters are kept, so schedulers bound to it keep working.

    Returns:
        the number of parameters removed.
    """
    removed = 0
    for group in optimizer.param_groups:
        keep = []
        for p in group["params"]:
            if is_embedding(p):
                optimizer.state.pop(p, None)
                removed += 1
            else:
                keep.append(p)
        group["params"] = keep
    return removed


def is_fused_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a view of a fused (TBE) table that TorchRec updates in the backward pass."""
    return hasattr(param, _compat.IN_BACKWARD_OPTIMIZER_ATTR)


class RecOptimizer(CombinedOptimizer, ComposedOptimizer):
    """TorchRec's ``CombinedOptimizer`` of fused embedding optimizers and a dense optimizer, driven by Lightning.

    Differences from the plain ``CombinedOptimizer`` that Lightning needs:

    * ``step(closure)`` runs the closure exactly **once** (``CombinedOptimizer`` hands it to every
      sub-optimizer; the fused ones ignore it, so Lightning's closure would run zero or several times), then
      steps the dense optimizer. The embedding rows were already updated inside the closure's backward pass.
    * the embedding learning rate follows ``lr_source``, the dense param group that held the embedding
      parameters in ``configure_optimizers``: an LR scheduler that moves it moves the tables' rate too.
    * :attr:`optimizer` is the user's own optimizer, which Lightning's ``LearningRateMonitor`` reports (as it reports
      the optimizer a DeepSpeed one wraps): ``lr-Adagrad`` with the user's param groups, as without sharding.
    * checkpoints read it as a :class:`~lightning_rec.checkpoint._optimizer_state.ComposedOptimizer`.

    Args:
        fused: the fused embedding optimizer (``DistributedModelParallel.fused_optimizer``).
        dense: the user's optimizer over the dense parameters (embedding parameters already removed).
        dense_params: the dense parameters by fully qualified name (keys of the checkpointed state).
        lr_source: the param group whose ``lr`` the embedding tables follow, or ``None`` to keep the
            fused optimizer's own learning rate.
        table_optimizer: an ordinary optimizer (same rule as the fused one) for table parameters that TorchRec
            keeps on a non-fused kernel (``data_parallel`` tables on CPU), with ``table_params`` by name; or a list
            of them (tables with rules of their own).
        lr_sources: instead of ``lr_source``, pairs ``(group, source)``: the fused or table optimizer's param group
            that follows the learning rate of the user's param group ``source`` (tables in several groups).

    Example::

        optimizer = RecOptimizer(dmp.fused_optimizer, torch.optim.Adagrad(dense, lr=0.1), dict(dense_named))
        loss = optimizer.step(closure)  # closure runs forward + backward once; tables update in backward
    """

    def __init__(
        self,
        fused: KeyedOptimizer,
        dense: Optimizer,
        dense_params: Mapping[str, torch.Tensor],
        lr_source: dict[str, Any] | None = None,
        table_optimizer: Optimizer | Sequence[Optimizer] | None = None,
        table_params: Mapping[str, torch.Tensor] | None = None,
        lr_sources: Sequence[tuple[dict[str, Any], dict[str, Any]]] | None = None,
    ) -> None:
        self.dense = dense
        tables = [table_optimizer] if isinstance(table_optimizer, Optimizer) else list(table_optimizer or [])
        self.table_optimizers: list[Optimizer] = tables
        self.table_optimizer = tables[0] if len(tables) == 1 else None  # the usual single one
        self.dense_params: dict[str, torch.Tensor] = dict(dense_params)
        self.table_params: dict[str, torch.Tensor] = dict(table_params or {})
        # `KeyedOptimizerWrapper` builds its optimizer from a factory; ours already exists (schedulers are
        # bound to it), so the factory hands it back. State and param groups are shared, not copied.
        keyed: list[KeyedOptimizer] = [fused, KeyedOptimizerWrapper(dict(dense_params), lambda _params: dense)]
        by_id = {id(p): n for n, p in self.table_params.items()}
        for opt in tables:
            named = {by_id[id(p)]: p for g in opt.param_groups for p in g["params"]}
            keyed.append(KeyedOptimizerWrapper(named, lambda _params, _opt=opt: _opt))
        # No key prefixes: optimizer state stays keyed by parameter FQN, like the model state_dict.
        super().__init__(keyed)
        self.fused = fused
        self._lr_sources: list[tuple[dict[str, Any], dict[str, Any]]] = (
            list(lr_sources)
            if lr_sources is not None
            else [(group, lr_source) for group in self._follower_groups()]
            if lr_source is not None
            else []
        )
        self._pushed_lrs: list[float] | None = None  # the rates last pushed into the kernels by `sync_lr`
        self.sync_lr()

    def _follower_groups(self) -> list[dict[str, Any]]:
        groups = list(self.fused.param_groups)
        for opt in self.table_optimizers:
            groups += opt.param_groups
        return groups

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer from ``configure_optimizers`` (its param groups keep their learning rates, the
        tables' parameters removed): what ``LearningRateMonitor`` names and logs, ``lr-<its class>[/<group>]``."""
        return self.dense

    @property
    def embedding_lrs(self) -> list[float]:
        """The learning rates the embedding tables are trained with right now (one per kernel group)."""
        return [float(g["lr"]) for g in self._follower_groups()]

    def restore_embedding_lrs(self, lrs: Sequence[float]) -> None:
        """Set the tables' learning rates to ``lrs`` (as :attr:`embedding_lrs` listed them; a list of another
        length, from another plan, sets them all to its first rate), then follow the source group again."""
        groups = self._follower_groups()
        for i, group in enumerate(groups):
            group["lr"] = lrs[i] if len(lrs) == len(groups) else lrs[0]
        self.fused.step()  # pushes the rates into the kernels
        self.sync_lr()

    def sync_lr(self) -> None:
        """Copy the source groups' learning rates into the fused kernels (idempotent; called every step, so
        it returns at once unless a rate moved)."""
        if not self._lr_sources:
            return
        lrs = [source["lr"] for _, source in self._lr_sources]
        if lrs == self._pushed_lrs and all(group["lr"] == source["lr"] for group, source in self._lr_sources):
            return
        for group, source in self._lr_sources:
            group["lr"] = source["lr"]
        self.fused.step()  # a fused optimizer's step() only pushes param_groups' lr into the kernels
        self._pushed_lrs = lrs

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync_lr()
        self.dense.zero_grad(set_to_none=set_to_none)
        for opt in self.table_optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        # No sync_lr here: the tables update inside the closure's backward, after `zero_grad` (and Lightning's
        # `on_train_batch_start`) pushed the rate.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.dense.step()
        for opt in self.table_optimizers:
            opt.step()
        return loss


# ---------------------------------------------------------------------------------------------------------
# What the strategy does with them at set-up.
# ---------------------------------------------------------------------------------------------------------


def resolve_embedding_optimizer(
    optimizers: list[Optimizer],
    is_embedding: Callable[[torch.Tensor], bool],
    *,
    declared: EmbeddingOptimizer | None,
    has_tables: bool,
    device_type: str,
    owner: str = "RecShardStrategy",
    table_weights: Mapping[str, torch.Tensor] | None = None,
) -> tuple[EmbeddingOptimizer, dict[str, Any] | None, TableOptimizers | None]:
    """The fused optimizer, the param group whose learning rate it follows (``None``: its own), and per-table
    optimizers when the tables sit in several param groups (``None`` otherwise).

    An explicitly ``declared`` optimizer wins; otherwise it is derived from the param group holding the
    tables. Tables spread over several groups (other learning rates, other optimizers) each get the fused version
    of their own group's rule, as TorchRec trains tables with their own fused parameters (``table_weights``: each
    table's weight, to find its group; the first group's rule is then the default). With optimizers but no such
    group the update rule is unknown (an error); with no optimizers at all (evaluation) a zero-lr SGD stands in,
    since no update happens.

    Example::

        >>> t1, t2 = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(4, 2))
        >>> opt = torch.optim.Adagrad([{"params": [t1], "lr": 0.1}, {"params": [t2], "lr": 0.3}])
        >>> _, _, per_table = resolve_embedding_optimizer([opt], lambda p: p is t1 or p is t2, declared=None,
        ...     has_tables=True, device_type="cpu", table_weights={"t1": t1, "t2": t2})
        >>> {t: o.lr for t, (o, _) in per_table.items()}
        {'t1': 0.1, 't2': 0.3}
    """
    # Tables given an optimizer of their own with TorchRec's `apply_optimizer_in_backward` keep it, as in TorchRec.
    own = {
        table: _from_in_backward(*rule)
        for table, weight in (table_weights or {}).items()
        if declared is None and (rule := _compat.in_backward_optimizer(weight)) is not None
    }
    own_ids = {id(table_weights[t]) for t in own} if table_weights else set()
    found = embedding_groups(optimizers, lambda p: is_embedding(p) and id(p) not in own_ids)
    per_table: TableOptimizers | None = None
    if declared is not None:
        emb_opt, lr_source = declared, None
    elif (len(found) > 1 or own) and table_weights is not None:
        derived = {id(group): embedding_optimizer_from_torch(optimizers[idx], group) for idx, group in found}
        per_table = {table: (rule, None) for table, rule in own.items()}
        for table, weight in table_weights.items():
            if table in own:
                continue
            group = next((g for _, g in found if any(p is weight for p in g["params"])), None)
            if group is None:
                raise ValueError(
                    f"{owner}: the embedding parameters are spread over {len(found)} param groups, and table "
                    f"{table!r} is in none of them, so its update rule is unknown. HINT: put every table's weight "
                    "in one of the param groups of `configure_optimizers`."
                )
            per_table[table] = (derived[id(group)], group)
        for opt, _ in per_table.values():
            opt.validate_for(device_type)
        emb_opt, lr_source = next(iter(per_table.values()))[0], None
    elif found:
        located = find_embedding_group(optimizers, is_embedding)
        assert located is not None  # `found` holds a group of them (and several raise)
        idx, group = located
        emb_opt, lr_source = embedding_optimizer_from_torch(optimizers[idx], group), group
    elif optimizers and has_tables:
        raise ValueError(
            f"{owner}: no optimizer returned by `configure_optimizers` holds the embedding "
            "parameters, so their update rule is unknown. HINT: include them (e.g. "
            "`torch.optim.Adagrad(self.parameters(), lr=0.1)`), declare the embedding optimizer with "
            "`configure_embedding_optimizer()`, or give tables their own with TorchRec's "
            "`apply_optimizer_in_backward`."
        )
    else:
        emb_opt, lr_source = EmbeddingOptimizer("sgd", lr=0.0), None  # evaluation only: no update happens
    emb_opt.validate_for(device_type)
    return emb_opt, lr_source, per_table


def combine_optimizers(
    fused: KeyedOptimizer,
    optimizers: list[Optimizer],
    *,
    named_parameters: Mapping[str, torch.nn.Parameter],
    is_embedding: Callable[[torch.Tensor], bool],
    lr_source: dict[str, Any] | None,
    table_params: Mapping[str, torch.nn.Parameter],
    embedding_optimizer: EmbeddingOptimizer,
    per_table: TableOptimizers | None = None,
) -> tuple[RecOptimizer, list[Optimizer]]:
    """Strip the tables from the user's optimizers and put the fused one beside the right dense optimizer.

    With ``per_table`` (tables in several param groups), each fused param group follows the learning rate of the
    group its tables came from, and tables on a non-fused kernel get an optimizer per rule.

    Returns:
        the :class:`RecOptimizer` and the optimizer list Lightning should drive (the RecOptimizer replaces the
        optimizer whose param group held the tables, or the first one).
    """
    for opt in optimizers:
        strip_params(opt, is_embedding)
    names = {id(p): n for n, p in named_parameters.items() if not is_fused_parameter(p)}
    optimizers = list(optimizers) or [torch.optim.SGD([torch.nn.Parameter(torch.zeros(0))], lr=0.0)]  # fused only
    host = 0
    if lr_source is not None:
        host = next(i for i, o in enumerate(optimizers) if any(g is lr_source for g in o.param_groups))
    dense = optimizers[host]
    dense_params = (p for g in dense.param_groups for p in g["params"])
    dense_named = {names.get(id(p), f"param_{i}"): p for i, p in enumerate(dense_params)}
    if per_table is None:
        rec = RecOptimizer(
            fused,
            dense,
            dense_named,
            lr_source=lr_source,
            table_optimizer=embedding_optimizer.torch_optimizer(table_params.values()) if table_params else None,
            table_params=dict(table_params),
        )
    else:
        table_opts, pairs = _per_table_optimizers(fused, table_params, per_table)
        rec = RecOptimizer(
            fused, dense, dense_named, table_optimizer=table_opts, table_params=dict(table_params), lr_sources=pairs
        )
    optimizers[host] = rec
    return rec, optimizers


def _table_of(fqn: str) -> str:
    """The table of a table weight's name (``...embedding_bags.<table>.weight``, ``...embeddings.<table>.weight``)."""
    return fqn.rsplit(".", 2)[-2]


def _per_table_optimizers(
    fused: KeyedOptimizer, table_params: Mapping[str, torch.nn.Parameter], per_table: TableOptimizers
) -> tuple[list[Optimizer], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """An optimizer per rule for the non-fused tables, and which user group each fused or table group follows."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    names = {id(p): n for n, p in fused.params.items()}
    for group in fused.param_groups:
        tables = [_table_of(names[id(p)]) for p in group["params"] if id(p) in names]
        sources = [per_table[t][1] for t in tables if t in per_table]
        if sources and sources[0] is not None:  # TorchRec groups tables by their fused parameters: one source a group
            pairs.append((group, sources[0]))
    by_rule: dict[Any, tuple[EmbeddingOptimizer, dict[str, Any] | None, list[torch.nn.Parameter]]] = {}
    for name, param in table_params.items():
        rule, source = per_table[_table_of(name)]
        by_rule.setdefault(id(source) if source is not None else repr(rule), (rule, source, []))[2].append(param)
    optimizers = []
    for rule, source, params in by_rule.values():
        opt = rule.torch_optimizer(params)
        optimizers.append(opt)
        pairs += [(group, source) for group in opt.param_groups if source is not None]
    return optimizers, pairs


def optimizer_state_class(emb_opt_type: Any) -> type | None:
    """The optimizer class whose state TorchRec's planner would add for FBGEMM's ``emb_opt_type`` (its storage
    estimator knows SGD: none, Adam: two copies of the table, TorchRec's RowWiseAdagrad: one float per row, any other
    class: one copy). Partial row-wise Adam/LAMB (a full first moment, a row-wise second) count as one copy. Read
    from the optimizer's facts (``lightning_rec.config._OPTIMIZER_FACTS``).

    Example::

        >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
        >>> optimizer_state_class(EmbOptimType.ADAM).__name__, optimizer_state_class(EmbOptimType.EXACT_SGD).__name__
        ('Adam', 'SGD')
    """
    import torchrec.optim as trec_optim

    if emb_opt_type is None:
        return None
    classes = {
        "SGD": torch.optim.SGD,
        "Adagrad": torch.optim.Adagrad,
        "RowWiseAdagrad": trec_optim.RowWiseAdagrad,
        "Adam": torch.optim.Adam,
    }
    state = next((f.planner_state for f in _OPTIMIZER_FACTS.values() if f.emb_opt_type == emb_opt_type), "Adagrad")
    return classes[state]
