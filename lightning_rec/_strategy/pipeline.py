"""Pipelined input distribution inside Lightning's training loop (``RecShardStrategy(pipeline=True)``).

TorchRec's ``TrainPipelineSparseDist`` overlaps the next batch's host-to-device copy and its KJT input
distribution (the all-to-alls that send each id to the rank holding its table shard) with the current batch's
forward and backward. Its ``progress()`` runs the whole step itself (forward, backward, optimizer), which would
bypass Lightning's closure, hooks, precision and logging. Here the same machinery (the pipeline object's own
queue, contexts, streams and model rewrite) is driven from Lightning's hooks instead, so the step stays
Lightning's:

* the train DataLoader is wrapped (:class:`PipelinedLoader`): batches are checked on the host
  (:meth:`~lightning_rec._inputs.checks.InputChecks.check_host`), copied to the device on TorchRec's copy stream and
  queued with their contexts one batch ahead of what Lightning has taken, so while batch *i* runs, batch *i+1* is
  already queued (a bad batch is therefore refused a step or two before its own step, naming that step);
* at the start of step *i* (:meth:`SparseDistPipeline.begin_step`): the finished batch *i-1* leaves the queue,
  batch *i*'s input distribution is completed, and batch *i+1*'s is started (its splits all-to-all);
* before step *i*'s backward (:meth:`SparseDistPipeline.before_backward`): batch *i+1*'s data all-to-all is
  waited for, so it overlaps the forward;
* validation, test and predict run the original (un-rewritten) forwards: the model is detached from the
  pipeline for them and re-attached at the next training step. They never run training steps.

The sharded modules' forwards read their inputs from the pipeline's context rather than their arguments, so a
pipelined ``training_step`` must call each sharded module once, on the batch it was given (as any
``forward`` that TorchRec can trace does). Per-step losses equal the non-pipelined ones.

Batches come in every format the non-pipelined path takes: TorchRec's ``Batch`` (or any ``Pipelineable``), and
dicts, tuples, lists or other collections holding tensors and ``KeyedJaggedTensor``s. TorchRec's pipeline only
takes ``Pipelineable`` batches, so the others travel through it in a :class:`PipelineableCollection` and reach
Lightning's hooks and ``training_step`` unwrapped, on the device.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from lightning_rec import _compat
from lightning_rec._inputs.checks import InputChecks
from lightning_rec.errors import InputError


def check_pipelinable(module: nn.Module, module_types: Any, owner: str = "RecShardStrategy") -> None:
    """Refuse ``pipeline=True`` for embedding modules this pipeline does not drive yet, naming them, before anything
    is sharded: a position-weighted ``FeatureProcessedEmbeddingBagCollection`` (its feature processor got the
    distributed KJT without its position weights) and managed-collision modules (their sharded input distribution
    takes another form). Found by trying both; without ``pipeline`` they train exactly.

    Raises:
        ValueError: naming every such module and what to do instead.
    """
    from lightning_rec._tables import embedding_modules, inner_collection

    odd = {
        path: type(sub).__name__
        for path, sub in embedding_modules(module, module_types).items()
        if inner_collection(sub) not in (None, sub)  # a feature processor or collision module in front of its tables
    }
    if odd:
        raise ValueError(
            f"{owner}(pipeline=True) does not pipeline "
            + ", ".join(f"{name} ({path!r})" for path, name in odd.items())
            + " yet: the pipelined input distribution covers EmbeddingBagCollection and EmbeddingCollection. "
            "HINT: train this model with `pipeline=False` (the default); it trains exactly there."
        )


class _NoStepOptimizer(torch.optim.Optimizer):
    """TorchRec's pipeline wants an optimizer; Lightning's loop owns the real one and steps it."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(0, requires_grad=True)], {})

    def step(self, closure: Any = None) -> NoReturn:  # pragma: no cover - never called
        raise RuntimeError("the pipelined strategy never lets TorchRec's pipeline step the optimizer")


class PipelineableCollection(Pipelineable):
    """Carries a batch that is not ``Pipelineable`` (a dict, tuple, list, ...) through TorchRec's pipeline.

    ``to`` and ``record_stream`` apply to every tensor and jagged tensor in the collection; indexing and attribute
    access go to the collection, so the argument paths TorchRec traced from ``forward`` (``batch["sparse"]``,
    ``batch[1]``) find the same ``KeyedJaggedTensor``.

    Example::

        >>> import torch
        >>> wrapped = PipelineableCollection({"dense": torch.ones(2, 3)})
        >>> wrapped.to(torch.device("cpu"), non_blocking=True)["dense"].shape
        torch.Size([2, 3])
    """

    _STREAMED = (torch.Tensor, KeyedJaggedTensor, JaggedTensor, KeyedTensor)

    def __init__(self, data: Any) -> None:
        self.data = data

    def to(self, device: torch.device, non_blocking: bool, data_copy_stream: Any = None) -> PipelineableCollection:
        # Lightning's collection walk: tensors and anything with `.to` (KJTs) move, non_blocking for CUDA tensors.
        return PipelineableCollection(move_data_to_device(self.data, device))

    def record_stream(self, stream: Any) -> None:
        apply_to_collection(self.data, self._STREAMED, lambda t: t.record_stream(stream))

    def pin_memory(self) -> PipelineableCollection:
        return PipelineableCollection(apply_to_collection(self.data, self._STREAMED, lambda t: t.pin_memory()))

    def __getitem__(self, key: Any) -> Any:
        return self.data[key]

    def __getattr__(self, name: str) -> Any:
        if name == "data":
            raise AttributeError(name)
        return getattr(self.data, name)


def _pipelineable(batch: Any) -> Any:
    return batch if isinstance(batch, (torch.Tensor, Pipelineable)) else PipelineableCollection(batch)


def _unwrap(batch: Any) -> Any:
    return batch.data if isinstance(batch, PipelineableCollection) else batch


class SparseDistPipeline:
    """TorchRec's ``TrainPipelineSparseDist`` queue, contexts and model rewrite, driven by Lightning's hooks.

    Args:
        model: the ``DistributedModelParallel`` wrapper.
        device: the training device.
        input_checks: the strategy's input checks, told when the inputs they check belong to the next batch.

    Example::

        pipeline = SparseDistPipeline(dmp, torch.device("cpu"))
        loader = pipeline.wrap(train_loader)      # Lightning iterates this
        # per step: pipeline.begin_step() before training_step; pipeline.before_backward() before backward
    """

    def __init__(self, model: nn.Module, device: torch.device, input_checks: InputChecks | None = None) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self._input_checks = input_checks
        self.engine = TrainPipelineSparseDist(model, _NoStepOptimizer(), device, execute_all_batches=True)
        self._running = False  # a step whose batch is still at the head of the queue
        self._rewritten = False  # sharded modules run the pipelined forward

    def wrap(self, dataloader: Any) -> PipelinedLoader:
        """The DataLoader Lightning should iterate for training."""
        return PipelinedLoader(dataloader, self)

    def reset(self) -> None:
        """Forget queued batches (a new epoch's iterator, or the end of fitting)."""
        self.detach()
        self.engine.reset()
        self._running = False

    def enqueue(self, iterator: Iterator[Any], index: int | None = None) -> Any:
        """Fetch the next batch (``index`` in its epoch, for messages), check it on the host, copy it to the device
        on the copy stream, queue it; ``StopIteration`` at the end."""
        checked: list[Any] = []

        def check(batch: Any) -> Any:
            if self._input_checks is not None:
                with self._input_checks.at_batch(index) if index is not None else contextlib.nullcontext():
                    checked.append(self._input_checks.check_host(batch))
            return _pipelineable(batch)

        if not self.engine.enqueue_batch(map(check, iterator)):
            raise StopIteration
        batch = _unwrap(self.engine.batches[-1])
        if self._input_checks is not None and checked:
            self._input_checks.trust(checked[0], batch)
        return batch

    def begin_step(self) -> Any:
        """Make the head of the queue the current batch, with its inputs distributed; start the next one's.

        Returns:
            the current batch, on the device.
        """
        engine = self.engine
        if self._running:
            engine.dequeue_batch()  # the previous step is done
        if not engine.batches:
            raise RuntimeError("the pipelined strategy has no queued batch for this training step")
        if not self._rewritten:
            try:
                _compat.pipeline_rewrite(engine)  # rewrites the forwards, starts batch 0's input dist
            except InputError:
                raise  # the batch, not the model, is at fault
            except Exception as err:
                raise RuntimeError(
                    "RecShardStrategy(pipeline=True): TorchRec could not trace your LightningModule's `forward` to find "
                    f"how each batch reaches the sharded embedding modules ({type(err).__name__}: {err}). HINT: define "
                    "`forward(self, batch)` that calls the embedding modules (once each) and call it from "
                    "`training_step` (e.g. `loss = F.bce(self(batch), batch.labels)`), or turn pipelining off."
                ) from err
            self._rewritten = True
        engine.wait_sparse_data_dist(engine.contexts[0])  # no-op if it was completed before the backward
        _compat.pipeline_set_context(engine, engine.contexts[0])
        _compat.pipeline_wait_for_batch(engine)
        if len(engine.batches) >= 2:
            with self._input_checks.ahead(1) if self._input_checks is not None else contextlib.nullcontext():
                engine.start_sparse_data_dist(engine.batches[1], engine.contexts[1])
        self._running = True
        return _unwrap(engine.batches[0])

    def before_backward(self) -> None:
        """Complete the next batch's input distribution (overlapping the current forward)."""
        if self._running and len(self.engine.batches) >= 2:
            self.engine.wait_sparse_data_dist(self.engine.contexts[1])

    def detach(self) -> None:
        """Give the sharded modules their own forwards back (for validation, test, predict); the next training
        step rewrites them again."""
        if self._rewritten:
            self.engine.detach()
            self._rewritten = False


class PipelinedLoader:
    """A training DataLoader whose batches go through :class:`SparseDistPipeline`'s queue.

    Attribute access (``sampler``, ``batch_size``, ``dataset``, ...) and ``len()`` go to the wrapped loader, so
    Lightning's epoch handling (``set_epoch``, batch counts) is unchanged. A resumable loader's state (Lightning's
    stateful-loader protocol, :class:`~lightning_rec.data.resume.ResumableLoader`) is reported as of the batches
    handed to Lightning: the one queued ahead was taken from the loader but not trained, so it is not counted.
    """

    def __init__(self, dataloader: Any, pipeline: SparseDistPipeline) -> None:
        self.dataloader = dataloader
        self.pipeline = pipeline
        self._ahead: deque[Any] = deque()  # queued in the pipeline, not yet handed to Lightning

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state, less the batches queued ahead (``{}`` if it keeps none)."""
        if not callable(getattr(self.dataloader, "state_dict", None)):
            return {}
        state = dict(self.dataloader.state_dict())
        if self._ahead and "served" in state:
            state["served"] = int(state["served"]) - len(self._ahead)
            state["finished"] = False
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand ``state`` to the wrapped loader (if it keeps one)."""
        if state and callable(getattr(self.dataloader, "load_state_dict", None)):
            self.dataloader.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        self.pipeline.reset()
        iterator = iter(self.dataloader)
        ahead = self._ahead = deque()
        exhausted = False
        fetched = 0
        while True:
            # Keep one batch queued beyond the one handed out: its input distribution overlaps this step.
            while len(ahead) < 2 and not exhausted:
                try:
                    ahead.append(self.pipeline.enqueue(iterator, fetched))
                    fetched += 1
                except StopIteration:
                    exhausted = True
            if not ahead:
                return
            yield ahead.popleft()

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "pipeline", "_ahead"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)
