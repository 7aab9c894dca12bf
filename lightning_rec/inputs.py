"""Checks of what enters the sharded tables and the loss, so that bad data fails loudly, precisely and early.

TorchRec trusts its inputs. Out of the box, an id outside its table is remapped to row 0 (with a warning on
CPU, silently with ``bounds_check_mode=IGNORE``) and training goes on with the wrong row; a
``KeyedJaggedTensor`` that lacks a feature fails with a bare ``IndexError`` inside the input distribution; one
whose features come in another order than the first batch's is silently paired with the wrong tables (the
sharded module freezes the order it saw first); lengths that do not add up to the values are undefined
behaviour inside FBGEMM's kernels. And a NaN in a dense input or in the loss reaches the fused embedding
optimizer, which writes it into the table rows inside the backward pass, for good.

:class:`InputChecks` (owned by :class:`~lightning_rec.RecShardStrategy`) puts a check in front of every sharded
embedding module's ``input_dist``: the one door through which every batch enters the tables, in plain training,
evaluation and TorchRec's pipelined training alike. Every check runs before the input distribution, so before
any collective, forward or backward: a rejected batch has changed no weight and no optimizer state. The errors
(:class:`InputError`) name the module, the feature, the table, the offending value and what was expected, and
the training step.

Cost (one CPU core, BENCHMARKS.md): ~0.05 ms per step for 4 features x 64 samples, ~0.12 ms for 8 features x
4096 samples (130k ids), against steps of ~1.5 and ~60 ms; on CUDA a few host synchronisations per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "InputChecks", "InputError", "ModuleInputs", "NonFiniteError", "check_features", "check_finite", "input_specs",
]

NonFinitePolicy = Literal["error", "warn", "ignore"]
_ID_DTYPES = (torch.int32, torch.int64)
_HINT_IDS = (
    "HINT: hash or bucketize raw ids into [0, num_embeddings) in the data pipeline (e.g. `id % num_embeddings`), "
    "or enlarge the table; `RecShardStrategy(bounds_check='warn')` restores TorchRec's default (bad ids read row 0)."
)


class InputError(ValueError):
    """A batch the embedding tables cannot take. The message names the module, feature, table, offending value
    and what was expected, and where in training it happened; nothing was updated with the batch."""


class NonFiniteError(ValueError):
    """NaN or infinity in a dense input or in the loss, found before the backward pass could write it into the
    tables (``RecShardStrategy(nonfinite="error")``, the default)."""


@dataclass(frozen=True)
class ModuleInputs:
    """What one sharded embedding module expects of its ``KeyedJaggedTensor``.

    Args:
        path: the module's path in the LightningModule (for messages), e.g. ``"sparse_arch.ebc"``.
        features: its feature names, in the order of its table configs (the order it is given in).
        tables: per feature, the table name and its number of rows.
        weighted: whether its tables pool with per-id weights (``is_weighted``), so the KJT must carry them.

    Example::

        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        ...     name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"])], device=torch.device("meta"))
        >>> ModuleInputs.of("ebc", ebc).tables
        {'user': ('t_user', 10)}
    """

    path: str
    features: Tuple[str, ...]
    tables: Mapping[str, Tuple[str, int]]
    weighted: bool = False

    @classmethod
    def of(cls, path: str, module: nn.Module) -> Optional["ModuleInputs"]:
        """The inputs of an ``EmbeddingBagCollection``/``EmbeddingCollection`` (``None`` for other modules,
        e.g. a custom sharder's, whose inputs this package does not know)."""
        if isinstance(module, EmbeddingBagCollection):
            configs, weighted = module.embedding_bag_configs(), bool(module.is_weighted())
        elif isinstance(module, EmbeddingCollection):
            configs, weighted = module.embedding_configs(), False
        else:
            return None
        tables: Dict[str, Tuple[str, int]] = {}
        for config in configs:
            for feature in config.feature_names:
                tables.setdefault(feature, (config.name, int(config.num_embeddings)))
        return cls(path=path, features=tuple(tables), tables=tables, weighted=weighted)

    def describe(self, feature: str) -> str:
        """``"feature 'user' (table 't_user', 60 rows)"``, for messages."""
        table, rows = self.tables[feature]
        return f"feature {feature!r} (table {table!r}, {rows} rows)"


def input_specs(module: nn.Module, module_types: Sequence[type]) -> Dict[str, ModuleInputs]:
    """:class:`ModuleInputs` of every embedding module of ``module`` that will be sharded, by module path (read
    before sharding: the sharded modules keep their table configs private)."""
    from lightning_rec.sharding import embedding_modules

    specs = {path: ModuleInputs.of(path, m) for path, m in embedding_modules(module, module_types).items()}
    return {path: spec for path, spec in specs.items() if spec is not None}


def check_features(
    kjt: Any, spec: ModuleInputs, *, check_ids: bool = True, where: Union[str, Callable[[], str]] = ""
) -> KeyedJaggedTensor:
    """Check a ``KeyedJaggedTensor`` against what ``spec``'s module expects; return it in the module's feature order.

    Checked, in this order, each failure an :class:`InputError`: it is a KJT; its keys are unique and are
    exactly the module's features (none missing, none unknown); values are 1-D ``int32``/``int64`` ids; lengths
    (or offsets) are 1-D integers, one per sample and feature, non-negative, adding up to the number of values;
    the batch has at least one sample; a weighted module's weights are floating, one per id and finite (an
    unweighted module gets none); with ``check_ids``, every id lies in ``[0, num_embeddings)`` of its feature's
    table. Features in another order than the module's are put in its order (TorchRec would otherwise pair them
    with the wrong tables). On CUDA the checks cost a few host synchronisations per module and step.

    Args:
        kjt: what the module was given.
        spec: the module's expected inputs.
        check_ids: check the id ranges (``bounds_check="error"``).
        where: where in training this is, for the message (e.g. ``"training step 12 (epoch 0, batch 12)"``), or a
            function computing it (called on failure only).

    Returns:
        ``kjt``, or a permuted copy in the module's feature order.

    Example::

        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["user"], torch.tensor([3, 12]), torch.tensor([1, 1]))
        >>> spec = ModuleInputs("ebc", ("user",), {"user": ("t_user", 10)})
        >>> check_features(kjt, spec)
        Traceback (most recent call last):
        ...
        lightning_rec.inputs.InputError: module 'ebc': feature 'user' (table 't_user', 10 rows) has 1 id(s) outside [0, 10): 12 (sample 1). ...
    """
    def fail(message: str) -> InputError:
        position = where() if callable(where) else where
        return InputError(f"{position + ': ' if position else ''}module {spec.path!r}: {message}")

    if not isinstance(kjt, KeyedJaggedTensor):
        raise fail(f"expected a KeyedJaggedTensor of features {list(spec.features)}, got {type(kjt).__name__}.")
    keys = list(kjt.keys())
    _check_keys(keys, spec, fail)
    values = _tensor(kjt.values(), "values", fail)
    if values.dim() != 1 or values.dtype not in _ID_DTYPES:
        raise fail(f"values must be a 1-D tensor of int32/int64 ids, got a {values.dim()}-D {values.dtype} tensor.")
    lengths = _lengths(kjt, values, fail)
    per_key = _samples_per_key(kjt, keys, lengths, fail)
    if sum(per_key) == 0:
        raise fail(
            "the batch has no samples (stride 0). HINT: drop empty batches in the data pipeline "
            "(e.g. `DataLoader(..., drop_last=True)`) or skip them before they reach the model."
        )
    smallest, ids_per_key, id_range = _summary(lengths, per_key, values)
    if smallest < 0:
        i = int(torch.argmin(lengths))
        raise fail(f"lengths must be >= 0, got {int(lengths[i])} at position {i} ({_sample(keys, per_key, i)}).")
    total = sum(ids_per_key)
    if total != values.numel():
        raise fail(
            f"the lengths add up to {total} ids but there are {values.numel()} values. "
            "HINT: build the KJT with `KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)`, lengths laid out "
            "feature-major (all samples of the first feature, then the next)."
        )
    _check_weights(kjt.weights_or_none(), values, spec.weighted, fail)
    if check_ids and id_range is not None:
        _check_id_ranges(values, keys, ids_per_key, id_range, lengths, per_key, spec, fail)
    if keys != list(spec.features):
        kjt = kjt.permute([keys.index(f) for f in spec.features])
    return kjt


def _check_keys(keys: List[str], spec: ModuleInputs, fail: Callable[[str], InputError]) -> None:
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    missing = [f for f in spec.features if f not in keys]
    unknown = [k for k in dict.fromkeys(keys) if k not in spec.tables]
    problems = []
    if missing:
        problems.append(f"lacks feature(s) {missing} (" + ", ".join(f"table {spec.tables[f][0]!r}" for f in missing) + ")")
    if unknown:
        problems.append(f"has feature(s) {unknown} that no table of this module reads")
    if duplicated:
        problems.append(f"has duplicated feature(s) {duplicated}")
    if problems:
        raise fail(
            f"the KeyedJaggedTensor {' and '.join(problems)}; it has {keys}, the module expects {list(spec.features)}. "
            "HINT: give each embedding module exactly its own features (e.g. `kjt.split([...])`, or "
            "`KeyedJaggedTensor.from_lengths_sync(keys=[...], ...)` with the module's feature names)."
        )


def _tensor(value: Any, name: str, fail: Callable[[str], InputError]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise fail(f"{name} must be a tensor, got {type(value).__name__}.")
    return value


def _lengths(kjt: KeyedJaggedTensor, values: torch.Tensor, fail: Callable[[str], InputError]) -> torch.Tensor:
    """The lengths, from offsets when only those were given, checked for shape and dtype."""
    lengths, offsets = kjt.lengths_or_none(), kjt.offsets_or_none()
    for name, t in (("lengths", lengths), ("offsets", offsets)):
        if t is not None:
            _tensor(t, name, fail)
            if t.dim() != 1 or t.dtype not in _ID_DTYPES:
                raise fail(f"{name} must be a 1-D int32/int64 tensor, got a {t.dim()}-D {t.dtype} tensor.")
    if offsets is not None:
        if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != values.numel():
            first = int(offsets[0]) if offsets.numel() else None
            last = int(offsets[-1]) if offsets.numel() else None
            raise fail(
                f"offsets must start at 0 and end at the number of values ({values.numel()}), got first={first}, "
                f"last={last}."
            )
        from_offsets = offsets[1:] - offsets[:-1]
        if lengths is None:
            return from_offsets
        if lengths.numel() != from_offsets.numel() or not torch.equal(lengths.to(from_offsets.dtype), from_offsets):
            raise fail("lengths and offsets disagree (offsets must be the running sum of lengths, starting at 0).")
    if lengths is None:
        raise fail("the KeyedJaggedTensor has neither lengths nor offsets.")
    return lengths


def _samples_per_key(
    kjt: KeyedJaggedTensor, keys: List[str], lengths: torch.Tensor, fail: Callable[[str], InputError]
) -> List[int]:
    """Samples (lengths entries) of each feature: the batch size, or per feature for variable batch sizes."""
    if kjt.variable_stride_per_key():
        per_key = [int(s) for s in kjt.stride_per_key()]
        if sum(per_key) != lengths.numel():
            raise fail(f"there are {lengths.numel()} lengths but the per-feature batch sizes {per_key} add up to {sum(per_key)}.")
        return per_key
    n = lengths.numel()
    if n % len(keys):
        raise fail(
            f"there are {n} lengths for {len(keys)} features: not one per sample and feature "
            f"({n} is not a multiple of {len(keys)})."
        )
    stride = n // len(keys)
    declared = kjt.stride()
    if declared != stride:
        raise fail(f"the batch size (stride) is {declared} but the lengths hold {stride} samples per feature.")
    return [stride] * len(keys)


def _summary(
    lengths: torch.Tensor, per_key: List[int], values: torch.Tensor
) -> Tuple[int, List[int], Optional[Tuple[int, int]]]:
    """The smallest length, the ids of each feature and the smallest and largest id, fetched in one host sync
    (every sync and every small op counts: the checks run at every step)."""
    parts = [lengths.min().long().view(1) if lengths.numel() else lengths.new_zeros(1, dtype=torch.long)]
    if len(set(per_key)) == 1:
        parts.append(lengths.view(len(per_key), -1).sum(1).long())
    else:
        parts += [part.sum().long().view(1) for part in torch.split(lengths, per_key)]
    if values.numel():
        parts.append(torch.stack(torch.aminmax(values)).long())
    out = torch.cat(parts).tolist()
    n = len(per_key)
    return out[0], out[1 : 1 + n], (out[1 + n], out[2 + n]) if values.numel() else None


def _sample(keys: List[str], per_key: List[int], position: int) -> str:
    """``"feature 'x', sample 3"`` for a position in the lengths."""
    for key, n in zip(keys, per_key):
        if position < n:
            return f"feature {key!r}, sample {position}"
        position -= n
    return f"position {position}"


def _check_weights(
    weights: Optional[torch.Tensor], values: torch.Tensor, weighted: bool, fail: Callable[[str], InputError]
) -> None:
    """A weighted module needs one finite weight per id. An unweighted one must get none: sharded TorchRec would
    apply them (the unsharded module ignores them), silently training something else than the model says."""
    if weights is None:
        if weighted:
            raise fail("its tables are weighted (is_weighted=True) but the KeyedJaggedTensor carries no weights.")
        return
    if not weighted:
        raise fail(
            "the KeyedJaggedTensor carries per-id weights but the module's tables are unweighted (is_weighted=False); "
            "sharded TorchRec would pool with them, unsharded TorchRec ignores them. HINT: build the KJT without "
            "`weights`, or make the module weighted (e.g. `EmbeddingBagCollection(..., is_weighted=True)`)."
        )
    _tensor(weights, "weights", fail)
    if not weights.is_floating_point() or weights.shape != values.shape:
        raise fail(
            f"weights must be a floating tensor with one weight per id ({values.numel()}), got {weights.dtype} "
            f"of shape {tuple(weights.shape)}."
        )
    if not bool(torch.isfinite(weights).all()):
        i = int((~torch.isfinite(weights)).nonzero()[0])
        raise fail(f"weights must be finite, got {float(weights[i])} at position {i}.")


def _check_id_ranges(
    values: torch.Tensor, keys: List[str], ids_per_key: List[int], id_range: Tuple[int, int], lengths: torch.Tensor,
    per_key: List[int], spec: ModuleInputs, fail: Callable[[str], InputError],
) -> None:
    # Fast path: every id fits the smallest of these tables (``id_range``: the smallest and largest id).
    if id_range[0] >= 0 and id_range[1] < min(spec.tables[key][1] for key in keys):
        return
    # One min/max per feature, fetched at once (0.1 ms for 130k ids on one CPU core; one host sync on CUDA); the
    # details are computed on failure only.
    present = [(key, ids) for key, ids in zip(keys, torch.split(values, ids_per_key)) if ids.numel()]
    if not present:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(ids)) for _, ids in present]).tolist()
    for (key, ids), (low, high) in zip(present, bounds):
        rows = spec.tables[key][1]
        if low >= 0 and high < rows:
            continue
        bad = ((ids < 0) | (ids >= rows)).nonzero().flatten()
        first = int(bad[0])
        sample = _sample_of_id(lengths, per_key, keys.index(key), first)
        raise fail(
            f"{spec.describe(key)} has {bad.numel()} id(s) outside [0, {rows}): {int(ids[first])} (sample {sample})"
            f"{'' if bad.numel() == 1 else f', min {low}, max {high}'}. {_HINT_IDS}"
        )


def _sample_of_id(lengths: torch.Tensor, per_key: List[int], key_index: int, id_index: int) -> int:
    start = sum(per_key[:key_index])
    ends = torch.cumsum(lengths[start : start + per_key[key_index]], 0)
    return int(torch.searchsorted(ends, torch.tensor(id_index, dtype=ends.dtype), right=True))


def check_finite(tensor: torch.Tensor, what: str, where: Union[str, Callable[[], str]] = "") -> Optional[str]:
    """``None`` if ``tensor`` is all finite, else a message naming ``what``, the first bad value and ``where`` (or
    what the function ``where`` returns).

    Example::

        >>> check_finite(torch.tensor([1.0, float("nan")]), "the loss", "training step 3")
        'training step 3: the loss has 1 NaN/infinite value(s), e.g. nan at index (1,).'
    """
    # Fast path: one reduction, no mask (a sum of finite values overflows only near float max; then look closer).
    if tensor.numel() == 0 or math.isfinite(float(tensor.sum(dtype=torch.float64 if tensor.is_cpu else None))):
        return None
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return None
    where = where() if callable(where) else where
    bad = (~finite).nonzero()
    index = tuple(int(i) for i in bad[0])
    value = float(tensor[index]) if index else float(tensor)
    return (
        f"{where + ': ' if where else ''}{what} has {bad.shape[0]} NaN/infinite value(s), e.g. {value} "
        f"at index {index}."
    )


def floating_tensors(batch: Any, path: str = "batch") -> Iterator[Tuple[str, torch.Tensor]]:
    """Every floating-point tensor of a batch (``Batch``, dataclass, mapping, sequence), with its path.
    ``KeyedJaggedTensor``\\ s are skipped: their weights are checked where they enter the tables."""
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point():
            yield path, batch
    elif isinstance(batch, KeyedJaggedTensor):
        return
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from floating_tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from floating_tensors(value, f"{path}[{i}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from floating_tensors(getattr(batch, field.name), f"{path}.{field.name}")


class InputChecks:
    """The strategy's checks of batches, table inputs and losses, with messages that say where training was.

    Args:
        check_ids: check that every id lies in its table (``bounds_check="error"``).
        check_structure: check the KJTs' features, lengths and dtypes (off only with ``bounds_check="none"``).
        nonfinite: NaN/inf in a dense input or the loss: ``"error"`` (raise :class:`NonFiniteError` before the
            backward pass), ``"warn"`` (warn and go on) or ``"ignore"`` (no check).
        position: describes where training is, given how many batches ahead of the current step the checked
            batch is (``1`` while a pipelined strategy distributes the next batch's inputs).

    Example::

        checks = InputChecks(check_ids=True, nonfinite="error", position=lambda ahead: f"step {ahead}")
        specs = input_specs(model, [EmbeddingBagCollection])            # before sharding
        checks.install(dmp.module, specs)                               # after: the sharded modules' doors
        checks.check_batch(batch)            # dense inputs, before the forward
        checks.check_loss(loss)              # before the backward
    """

    def __init__(
        self, check_ids: bool, nonfinite: NonFinitePolicy, position: Callable[[int], str], check_structure: bool = True
    ) -> None:
        if nonfinite not in ("error", "warn", "ignore"):
            raise ValueError(f"nonfinite must be 'error', 'warn' or 'ignore', got {nonfinite!r}.")
        self.check_ids = check_ids
        self.check_structure = check_structure or check_ids
        self.nonfinite = nonfinite
        self._position = position
        self._ahead = 0

    @contextlib.contextmanager
    def ahead(self, batches: int = 1) -> Iterator[None]:
        """Within this block, checked inputs belong to the batch ``batches`` steps after the current one."""
        self._ahead += batches
        try:
            yield
        finally:
            self._ahead -= batches

    def where(self) -> str:
        """Where training is now, for messages."""
        try:
            return self._position(self._ahead)
        except Exception:  # noqa: BLE001 - a message must never fail the check it explains
            return ""

    def install(self, sharded_root: nn.Module, specs: Mapping[str, ModuleInputs]) -> None:
        """Put :func:`check_features` in front of ``input_dist`` of each sharded module named in ``specs`` (paths
        in ``sharded_root``, the module DMP wraps); without structure checks, take it away. Idempotent."""
        for path, spec in specs.items():
            sharded = sharded_root.get_submodule(path)
            original = getattr(sharded, "_lightning_rec_input_dist", None)
            if not self.check_structure:
                if original is not None:
                    object.__delattr__(sharded, "input_dist")
                    object.__delattr__(sharded, "_lightning_rec_input_dist")
                continue
            original = original or sharded.input_dist
            checks = self

            def input_dist(ctx: Any, features: Any, *args: Any, _original=original, _spec=spec, **kwargs: Any) -> Any:
                features = check_features(features, _spec, check_ids=checks.check_ids, where=checks.where)
                return _original(ctx, features, *args, **kwargs)

            # An instance attribute shadows the method: TorchRec calls `module.input_dist(...)` both from the
            # module's own forward and from its train pipeline, so this is the one door for every batch.
            object.__setattr__(sharded, "_lightning_rec_input_dist", original)
            object.__setattr__(sharded, "input_dist", input_dist)

    def check_batch(self, batch: Any) -> None:
        """Check the batch's dense inputs (every floating tensor outside the KJTs) for NaN/inf."""
        if self.nonfinite == "ignore":
            return
        if type(batch) is Batch:  # the common case, without walking the structure
            found = [("batch.dense_features", batch.dense_features), ("batch.labels", batch.labels)]
        else:
            found = list(floating_tensors(batch))
        found = [(path, t) for path, t in found if t.is_floating_point() and t.numel()]
        if not found:
            return
        # One reduction per tensor, one host sync: a float64 sum of finite values is finite (on CUDA the float32
        # sum may overflow near float max; then check_finite looks closer).
        sums = torch.stack([t.sum(dtype=torch.float64 if t.is_cpu else None).to(torch.float64) for _, t in found])
        for (path, tensor), total in zip(found, sums.tolist()):
            if math.isfinite(total):
                continue
            message = check_finite(tensor, f"the dense input {path}", self.where)
            if message is not None:
                self._report(message, "HINT: clean or impute the data (e.g. `torch.nan_to_num`).")

    def check_loss(self, loss: torch.Tensor) -> None:
        """Check the loss before the backward pass (which would write NaN into the tables)."""
        if self.nonfinite == "ignore" or not isinstance(loss, torch.Tensor):
            return
        message = check_finite(loss.detach(), "the loss", self.where)
        if message is not None:
            self._report(
                message, "HINT: lower the learning rate, clip dense gradients (`gradient_clip_val`), check the inputs "
                "and labels, and resume from the last checkpoint."
            )

    def _report(self, message: str, hint: str) -> None:
        if self.nonfinite == "error":
            raise NonFiniteError(
                f"{message} Nothing was updated with this batch. {hint} "
                "`RecShardStrategy(nonfinite='warn')` only warns (and trains on)."
            )
        warnings.warn(f"{message} Training goes on (nonfinite='warn').", stacklevel=3)
