"""Checks of what enters the sharded tables and the loss, so that bad data fails loudly, precisely and early,
without making the GPU wait.

TorchRec trusts its inputs. Out of the box, an id outside its table is remapped to row 0 (with a warning on
CPU, silently with ``bounds_check_mode=IGNORE``) and training goes on with the wrong row; a
``KeyedJaggedTensor`` that lacks a feature fails with a bare ``IndexError`` inside the input distribution; one
whose features come in another order than the first batch's is silently paired with the wrong tables (the
sharded module freezes the order it saw first); lengths that do not add up to the values are undefined
behaviour inside FBGEMM's kernels. And a NaN in a dense input or in the loss reaches the fused embedding
optimizer, which writes it into the table rows inside the backward pass, for good.

:class:`InputChecks` (owned by :class:`~lightning_rec.RecShardStrategy`) checks every batch in two places:

* **on the host, before the batch is copied to the device** (:meth:`InputChecks.check_host`): the contents of
  every KJT (lengths, offsets, weights, each id against its feature's table) and every dense floating tensor
  (NaN/inf). Reading host memory costs the device nothing: no host-device sync, so the host can keep queueing
  work for the GPU. CPU tensors are read through numpy, without any torch op;
* **at every sharded embedding module's door** (its ``input_dist``, which plain training, evaluation and
  TorchRec's pipeline all go through): the features, dtypes and shapes against that module, which reads no
  tensor contents. A KJT the host did not check (one built inside ``forward``, or changed in place there) has its
  contents checked here too, which on a GPU costs one host sync per module and step.

Every check runs before the input distribution, so before any collective, forward or backward: a rejected batch
has changed no weight and no optimizer state. The errors (:class:`InputError`, :class:`NonFiniteError`) name the
module, the feature, the table, the offending value and what was expected, and the training step.

The loss is checked after the forward, where it is on the device: ``nonfinite="error"`` (the default) copies it
to host memory without waiting and reads it at the next step (or before any checkpoint is written, and at the
end of fitting), so a NaN loss is reported one step late, naming its step, after that step's update;
``nonfinite="strict"`` reads it before the backward pass and refuses the step, at the cost of one host sync per
step (BENCHMARKS.md). The checks of one KJT live in :mod:`lightning_rec._inputs.kjt`, what each module expects in
:mod:`lightning_rec._inputs.specs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import _compat
from lightning_rec._inputs.kjt import check_features, check_on_host, host_numpy
from lightning_rec._inputs.specs import FeatureTables, ModuleInputs
from lightning_rec.config import NonFinitePolicy
from lightning_rec.errors import InputError, NonFiniteError

__all__ = ["InputChecks", "NonFinitePolicy", "batch_leaves", "check_finite"]

_POLICIES = typing.get_args(NonFinitePolicy)


def check_finite(tensor: torch.Tensor, what: str, where: str | Callable[[], str] = "") -> str | None:
    """``None`` if ``tensor`` is all finite, else a message naming ``what``, the first bad value and ``where`` (or
    what the function ``where`` returns). Reads the tensor: on a device, the host waits for it.

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


def has_no_samples(batch: Any) -> bool:
    """Whether every ``KeyedJaggedTensor`` of ``batch`` (at least one) holds no samples (stride 0); metadata only.

    Example::

        >>> empty = KeyedJaggedTensor(keys=["user"], values=torch.tensor([], dtype=torch.long),
        ...                           lengths=torch.tensor([], dtype=torch.long))
        >>> has_no_samples({"sparse": empty}), has_no_samples(torch.ones(2))
        (True, False)
    """
    kjts = [t for _, t in batch_leaves(batch) if isinstance(t, KeyedJaggedTensor)]
    return bool(kjts) and all(not kjt.keys() or kjt.lengths().numel() == 0 for kjt in kjts)


def batch_leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """Every tensor and ``KeyedJaggedTensor`` of a batch (``Batch``, dataclass, mapping, sequence), with its path.

    Example::

        >>> [path for path, _ in batch_leaves({"dense": torch.ones(2), "ids": [torch.zeros(1)]})]
        ["batch['dense']", "batch['ids'][0]"]
    """
    if isinstance(batch, (torch.Tensor, KeyedJaggedTensor)):
        yield path, batch
    elif type(batch) is Batch:  # the common case, without dataclasses' introspection
        yield f"{path}.dense_features", batch.dense_features
        yield f"{path}.sparse_features", batch.sparse_features
        yield f"{path}.labels", batch.labels
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from batch_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from batch_leaves(value, f"{path}[{i}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from batch_leaves(getattr(batch, field.name), f"{path}.{field.name}")


@dataclasses.dataclass
class _Trusted:
    """A device KJT whose contents were checked on the host: its features, and its tensors as they were then."""

    features: frozenset[str]
    values: weakref.ref[torch.Tensor]
    lengths_storage: int
    versions: tuple[int, int]  # of the values and the lengths (or offsets): what changing them in place moves


@dataclasses.dataclass
class _PendingLoss:
    """A loss on its way to host memory, read one step later."""

    where: str
    value: torch.Tensor  # host memory (pinned on CUDA), written by a non-blocking copy
    copied: Any | None  # the CUDA event recorded after the copy (None on CPU: already there)


# How many checked KJTs the doors remember: enough for the batches a pipeline holds (3) with several KJTs each.
_TRUSTED_KJTS = 16

HostChecked = list[tuple[str, KeyedJaggedTensor, frozenset[str]]]
"""What :meth:`InputChecks.check_host` checked: (path, host KJT, its checked features), for :meth:`InputChecks.trust`."""


class InputChecks:
    """The strategy's checks of batches, table inputs and losses, with messages that say where training was.

    Args:
        check_ids: check that every id lies in its table (``bounds_check="error"``).
        check_structure: check the KJTs' features, lengths and dtypes (off only with ``bounds_check="none"``).
        nonfinite: NaN/inf in a dense input (always refused before the step, or warned about) or the loss:
            ``"error"`` (the loss is read one step later, without a host sync, and :class:`NonFiniteError` names its
            step), ``"strict"`` (the loss is read before the backward pass, which it then refuses: one host sync
            per step), ``"warn"`` (warn one step later and go on) or ``"ignore"`` (no check).
        position: describes where training is, given how many batches ahead of the current step the checked
            batch is (``1`` while a pipelined strategy distributes the next batch's inputs), and optionally the
            checked batch's index in its epoch.

    Example::

        checks = InputChecks(check_ids=True, nonfinite="error", position=lambda ahead, batch=None: f"step {ahead}")
        specs = input_specs(model)                                        # before sharding
        checks.install(dmp.module, specs)                               # after: the sharded modules' doors
        checked = checks.check_host(batch)     # before the copy to the device
        batch = batch.to(device, non_blocking=True)
        checks.trust(checked, batch)           # the doors need not read these KJTs again
        checks.check_loss(loss)                # before the backward
    """

    def __init__(
        self, check_ids: bool, nonfinite: NonFinitePolicy, position: Callable[..., str], check_structure: bool = True
    ) -> None:
        if nonfinite not in _POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, _POLICIES))}, got {nonfinite!r}.")
        self.check_ids = check_ids
        self.check_structure = check_structure or check_ids
        self.nonfinite = nonfinite
        self.tables = FeatureTables({})
        self._position = position
        self._ahead = 0
        self._batch: int | None = None
        # By the data pointer of a checked device KJT's values; the newest _TRUSTED_KJTS (a few batches in flight).
        self._trusted: OrderedDict[int, _Trusted] = OrderedDict()
        self._pending: deque[_PendingLoss] = deque()
        self.door_reads = 0  # KJTs whose contents were read at a module's door (not checked on the host)
        self._named_unread: set = set()  # (path, features) already warned about
        self._vbe_refusals: dict = {}  # module path -> why it cannot train on a variable-batch KJT
        self.empty_step = False  # this rank's current training batch has no samples (see check_loss)

    @contextlib.contextmanager
    def ahead(self, batches: int = 1) -> Iterator[None]:
        """Within this block, checked inputs belong to the batch ``batches`` steps after the current one."""
        self._ahead += batches
        try:
            yield
        finally:
            self._ahead -= batches

    @contextlib.contextmanager
    def at_batch(self, index: int) -> Iterator[None]:
        """Within this block, checked inputs belong to batch ``index`` of the current epoch."""
        self._batch, outer = index, self._batch
        try:
            yield
        finally:
            self._batch = outer

    def where(self) -> str:
        """Where training is now, for messages."""
        try:
            return self._position(self._ahead) if self._batch is None else self._position(self._ahead, self._batch)
        except Exception:  # noqa: BLE001 - a message must never fail the check it explains
            return ""

    def install(
        self,
        sharded_root: nn.Module,
        specs: Mapping[str, ModuleInputs],
        variable_batch_refusals: Mapping[str, str] | None = None,
    ) -> None:
        """Put :func:`check_features` in front of ``input_dist`` of each sharded module named in ``specs`` (paths
        in ``sharded_root``, the module DMP wraps); without structure checks, take it away. Idempotent.

        ``variable_batch_refusals``: by module path, why that module cannot train on a variable-batch-per-feature
        (VBE) KJT; such a KJT is refused at its door with the reason, before TorchRec fails on it."""
        self.tables = FeatureTables.of(specs)
        self._vbe_refusals = dict(variable_batch_refusals or {})
        for path, spec in specs.items():
            sharded = sharded_root.get_submodule(path)
            if not self.check_structure:
                _compat.unpatch_method(sharded, "input_dist")
                continue
            original = _compat.original_method(sharded, "input_dist")

            def input_dist(
                ctx: Any, features: Any, *args: Any, _original=original, _spec=spec, _checks=self, **kwargs: Any
            ) -> Any:
                features = _checks.at_door(features, _spec)
                return _original(ctx, features, *args, **kwargs)

            # TorchRec calls `module.input_dist(...)` both from the module's own forward and from its train pipeline,
            # so this is the one door for every batch.
            _compat.patch_method(sharded, "input_dist", input_dist)

    # ---------------------------------------------------------------------------------------------------------
    # Batches: contents on the host, the rest at the door
    # ---------------------------------------------------------------------------------------------------------

    def check_host(self, batch: Any) -> HostChecked:
        """Check a batch before it is copied to the device: NaN/inf in its dense floating tensors, and the contents
        of its KJTs (see :func:`~lightning_rec._inputs.kjt.check_on_host`). Raises :class:`NonFiniteError` or
        :class:`InputError`; returns what to :meth:`trust` once the batch is on the device."""
        leaves = list(batch_leaves(batch))
        if self.nonfinite != "ignore":
            self._check_dense([(p, t) for p, t in leaves if isinstance(t, torch.Tensor)])
        if not self.check_structure:
            return []
        checked: HostChecked = []
        for path, kjt in leaves:
            if isinstance(kjt, KeyedJaggedTensor):
                features = check_on_host(kjt, self.tables, check_ids=self.check_ids, where=self.where)
                if features:
                    checked.append((path, kjt, features))
                    self._name_unread(path, kjt.keys())
        return checked

    def _name_unread(self, path: str, keys: list[str]) -> None:
        """Warn once about features of a table input that no sharded module reads: allowed (each module reads its
        own features, as in TorchRec), but often a typo or a table left out of the model."""
        unread = tuple(k for k in keys if k not in self.tables.features)
        if unread and (path, unread) not in self._named_unread:
            self._named_unread.add((path, unread))
            warnings.warn(
                f"{path} carries feature(s) {list(unread)} that no embedding table of the model reads; they are "
                f"ignored (the tables read {sorted(self.tables.features)}). HINT: check the feature names of the "
                "EmbeddingBagConfig/EmbeddingConfig, or leave these features out of the batch.",
                stacklevel=2,
            )

    def trust(self, checked: HostChecked, device_batch: Any) -> None:
        """Let the doors skip reading the contents of ``device_batch``'s KJTs that :meth:`check_host` checked (the
        same paths, keys and sizes), until they are freed or changed in place."""
        if not checked:
            return
        on_device = dict(batch_leaves(device_batch))
        for path, host, features in checked:
            kjt = on_device.get(path)
            if not isinstance(kjt, KeyedJaggedTensor) or not _same_form(host, kjt):
                continue  # a custom transfer moved things around: the door reads it
            values = kjt.values()
            if values.numel() == 0 or values.is_inference():
                continue  # no storage to know it by, or no version counter to notice a change by: read at the door
            ptr = values.untyped_storage().data_ptr()
            self._trusted.pop(ptr, None)
            self._trusted[ptr] = _Trusted(features, weakref.ref(values), _lengths_storage(kjt), _versions(kjt))
        while len(self._trusted) > _TRUSTED_KJTS:
            self._trusted.popitem(last=False)  # an old KJT that comes back is read at the door

    def at_door(self, features: Any, spec: ModuleInputs) -> KeyedJaggedTensor:
        """Check what a sharded module is given (its contents only if the host did not check them)."""
        if spec.path in self._vbe_refusals and isinstance(features, KeyedJaggedTensor):
            if features.variable_stride_per_key():
                raise InputError(
                    f"{self.where() + ': ' if self.where() else ''}module {spec.path!r}: the KeyedJaggedTensor has a "
                    f"variable batch size per feature (VBE), which it cannot train on: {self._vbe_refusals[spec.path]}. "
                    "HINT: give every feature the same batch size, or shard its tables table-wise or column-wise "
                    "with sgd, rowwise_adagrad or adam."
                )
        trusted = self._trusted_features(features)
        data = trusted is None or not trusted.issuperset(spec.features)
        self.door_reads += data
        return check_features(features, spec, check_ids=self.check_ids, where=self.where, data=data)

    def _trusted_features(self, kjt: Any) -> frozenset[str] | None:
        if not isinstance(kjt, KeyedJaggedTensor) or not self._trusted:
            return None
        values = kjt.values()
        if not isinstance(values, torch.Tensor) or values.numel() == 0:
            return None
        entry = self._trusted.get(values.untyped_storage().data_ptr())
        if (
            entry is None
            or entry.values() is None
            or entry.lengths_storage != _lengths_storage(kjt)
            or entry.versions != _versions(kjt)
        ):
            return None
        return entry.features

    def _check_dense(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        found = [(path, t) for path, t in tensors if t.is_floating_point() and t.numel()]
        if not found:
            return
        # A float64 sum of finite values is finite (near float max it may overflow; then check_finite looks closer).
        # Host tensors are summed by numpy (no torch op); one already on a device is read there (the host waits).
        on_device = [(path, t) for path, t in found if t.device.type != "cpu"]
        totals = {path: float(host_numpy(t).sum(dtype="float64")) for path, t in found if t.device.type == "cpu"}
        if on_device:
            sums = torch.stack([t.sum().to(torch.float64) for _, t in on_device]).tolist()
            totals.update(zip((path for path, _ in on_device), sums))
        for path, tensor in found:
            if math.isfinite(totals[path]):
                continue
            message = check_finite(tensor, f"the dense input {path}", self.where)
            if message is not None:
                self._report(message, "HINT: clean or impute the data (e.g. `torch.nan_to_num`).", before=True)

    # ---------------------------------------------------------------------------------------------------------
    # The loss
    # ---------------------------------------------------------------------------------------------------------

    def check_loss(self, loss: torch.Tensor) -> None:
        """Check the loss before the backward pass (which would write a NaN into the tables): at once in
        ``"strict"`` mode, else by reading earlier steps' losses and sending this one to host memory."""
        if self.nonfinite == "ignore" or not isinstance(loss, torch.Tensor):
            return
        if self.empty_step:
            # A mean over no samples is NaN, but nothing flows back from it: the gradients of an empty batch's
            # outputs are empty, so its tables and layers get nothing (zeros, averaged with the other ranks').
            return
        if self.nonfinite == "strict":
            message = check_finite(loss.detach(), "the loss", self.where)
            if message is not None:
                self._report(message, _HINT_LOSS, before=True)
            return
        self.poll(wait=False)
        value = loss.detach().float().sum()
        copied = None
        # The same copy on every device (on CPU a 4-byte copy): the path a GPU takes runs, and is counted, on CPU too.
        host = torch.empty((), dtype=torch.float32, pin_memory=value.device.type == "cuda")
        host.copy_(value, non_blocking=True)
        if value.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        self._pending.append(_PendingLoss(self.where(), host, copied))

    def poll(self, wait: bool = True) -> None:
        """Report the losses sent to host memory by :meth:`check_loss` that are non-finite. Without ``wait``, only
        those whose copy is done (the host waits only if it runs more than two steps ahead of the device)."""
        while self._pending:
            pending = self._pending[0]
            if pending.copied is not None and not pending.copied.query():
                if not wait and len(self._pending) <= 2:
                    return
                pending.copied.synchronize()
            self._pending.popleft()
            value = float(pending.value.numpy())  # host memory: no torch op
            if not math.isfinite(value):
                self._pending.clear()
                self._report(
                    f"{pending.where + ': ' if pending.where else ''}the loss is {value}.", _HINT_LOSS, before=False
                )

    def forget(self) -> None:
        """Drop losses not yet read (after a failure: nothing more to report)."""
        self._pending.clear()

    def _report(self, message: str, hint: str, before: bool) -> None:
        if self.nonfinite in ("error", "strict"):
            if before:
                message += " Nothing was updated with this batch."
            else:
                message += (
                    " It was found after that step's update (`nonfinite='error'` reads the loss one step late, so that "
                    "the GPU never waits): the tables and optimizer state may hold NaN/inf since then; no checkpoint "
                    "was written after it. `nonfinite='strict'` refuses such a step before its update (one host sync "
                    "per step)."
                )
            raise NonFiniteError(f"{message} {hint} `RecShardStrategy(nonfinite='warn')` only warns (and trains on).")
        warnings.warn(f"{message} Training goes on (nonfinite='warn').", stacklevel=3)


_HINT_LOSS = (
    "HINT: lower the learning rate, clip dense gradients (`gradient_clip_val`), check the inputs and labels, and "
    "resume from the last checkpoint."
)


def _lengths_of(kjt: KeyedJaggedTensor) -> torch.Tensor | None:
    lengths = kjt.lengths_or_none()
    return lengths if lengths is not None else kjt.offsets_or_none()


def _lengths_storage(kjt: KeyedJaggedTensor) -> int:
    lengths = _lengths_of(kjt)
    return lengths.untyped_storage().data_ptr() if isinstance(lengths, torch.Tensor) else 0


def _versions(kjt: KeyedJaggedTensor) -> tuple[int, int]:
    lengths = _lengths_of(kjt)
    return _compat.tensor_version(kjt.values()), _compat.tensor_version(lengths) if lengths is not None else -1


def _same_form(host: KeyedJaggedTensor, device: KeyedJaggedTensor) -> bool:
    """Whether ``device`` is ``host`` copied: the same keys and sizes (metadata only)."""
    if host is device:
        return True
    pairs = [
        (host.values(), device.values()),
        (host.lengths_or_none(), device.lengths_or_none()),
        (host.offsets_or_none(), device.offsets_or_none()),
        (host.weights_or_none(), device.weights_or_none()),
    ]
    return host.keys() == device.keys() and all(
        (a is None) == (b is None) and (a is None or a.shape == b.shape) for a, b in pairs
    )
