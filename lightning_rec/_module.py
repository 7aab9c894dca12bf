"""``RecLightningModule``: a LightningModule whose batches carry KeyedJaggedTensors and whose tables are sharded."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import Self

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict

from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.errors import ExportError


class RecLightningModule(pl.LightningModule):
    """Base class for recommendation models trained with :class:`~lightning_rec.RecShardStrategy`.

    Write it like any LightningModule. Build embedding modules (``EmbeddingBagCollection`` /
    ``EmbeddingCollection``) anywhere in ``__init__``, preferably on ``device="meta"`` so no rank allocates a
    table it will not own; the strategy plans, shards and materialises them. Batches reach ``training_step``
    as you produced them (a :class:`~lightning_rec._batch.Batch`, or a dict/tuple holding a
    ``KeyedJaggedTensor``), already on the right device.

    The embedding optimizer (FBGEMM, fused into the backward pass) is derived from ``configure_optimizers``:
    the optimizer family and hyperparameters of the param group that holds the embedding parameters. Override
    :meth:`configure_embedding_optimizer` to choose it explicitly instead (row-wise Adagrad is the usual choice
    for large tables); the dense optimizer is then whatever ``configure_optimizers`` returns.

    Example::

        class Model(RecLightningModule):
            def __init__(self):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=[...], device=torch.device("meta"))
                self.over = torch.nn.Linear(32, 1)

            def training_step(self, batch, batch_idx):
                x = self.ebc(batch.sparse_features).values()  # the unsharded key order, under any plan
                return F.binary_cross_entropy_with_logits(self.over(x).squeeze(1), batch.labels)

            def configure_optimizers(self):
                return torch.optim.Adagrad(self.parameters(), lr=0.1)   # tables: fused Adagrad, lr=0.1
    """

    if TYPE_CHECKING:  # for the type checker only: Lightning's `hparams` is an AttributeDict (`self.hparams.lr`),
        # which its declaration widens to any MutableMapping

        @property
        def hparams(self) -> AttributeDict: ...

    def __getstate__(self) -> dict[str, Any]:
        """As a LightningModule's (``torch.save(model)``, ``copy.deepcopy``, pickling), refused in one line naming
        the way to an unsharded copy while TorchRec's sharded modules are inside (they hold hooks and process
        groups, and TorchRec cannot pickle them)."""
        from torchrec.distributed.types import ShardedModule

        sharded = [name for name, sub in self.named_modules() if isinstance(sub, ShardedModule)]
        if sharded:
            raise TypeError(
                f"{type(self).__name__} holds tables sharded by TorchRec ({', '.join(sharded[:3])}"
                f"{', ...' if len(sharded) > 3 else ''}), which cannot be pickled or copied. HINT: for an unsharded "
                "copy, save a checkpoint (`trainer.save_checkpoint(path)`) and load it with "
                "`lightning_rec.checkpoint.load_module(ModelClass, path)` (or `ModelClass.load_from_checkpoint`), "
                "or export its weights (`lightning-rec export`)."
            )
        return super().__getstate__()

    def configure_embedding_optimizer(self) -> EmbeddingOptimizer | None:
        """Declare the fused embedding optimizer explicitly.

        Returns:
            an :class:`~lightning_rec._strategy.optim.EmbeddingOptimizer`, or ``None`` (the default) to derive it from the
            param group holding the embedding parameters in ``configure_optimizers``.

        Example::

            def configure_embedding_optimizer(self):
                return EmbeddingOptimizer("rowwise_adagrad", lr=0.05)
        """
        return None

    def inference_module(self, part: str | None = None) -> torch.nn.Module:
        """The network that serves, for :func:`lightning_rec.serving.export_inference` (``lightning-rec export
        --format torchscript``): an ``nn.Module`` of this module's own layers whose ``forward`` takes
        ``(dense_features: Tensor, sparse_features: KeyedJaggedTensor)`` or ``(sparse_features: KeyedJaggedTensor)``
        and returns a tensor (scores, probabilities, embeddings). Called on the unsharded module loaded from a
        checkpoint. ``part`` names one of several networks (e.g. a two-tower model's ``"query"`` tower).

        The default serves this module itself when its ``forward`` may have that form (two arguments, or one that
        is not annotated as something else than a ``KeyedJaggedTensor``); the export then calls it on a
        ``KeyedJaggedTensor`` and refuses it, with this hint, if that fails (a ``forward`` that takes a training
        batch, labels and all, says nothing about what serves).

        Example::

            def inference_module(self, part=None):
                return self.net            # forward(dense_features, sparse_features) -> logits
        """
        required = [
            p for p in inspect.signature(self.forward).parameters.values() if p.default is inspect.Parameter.empty
        ]
        annotation = required[0].annotation if len(required) == 1 else None
        one_kjt = annotation is inspect.Parameter.empty or "KeyedJaggedTensor" in str(annotation)
        if part is None and (len(required) == 2 or (len(required) == 1 and one_kjt)):
            return self
        raise ExportError(
            f"{type(self).__name__} cannot be exported for serving: it does not override `inference_module()`"
            + (f" (and has no part {part!r})" if part is not None else "")
            + f", and its forward({', '.join(p.name for p in required)}) does not take `(dense_features, "
            "sparse_features)` or `(sparse_features: KeyedJaggedTensor)`. HINT: override `inference_module()` to "
            "return the nn.Module that serves."
        )

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path | IO,
        map_location: str | torch.device | int | Callable | dict[Any, Any] | None = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, which also takes this package's sharded checkpoint directories
        (written on any number of ranks): the module comes back unsharded, every table whole, on CPU unless
        ``map_location`` says otherwise (see :func:`lightning_rec.checkpoint.load_module`). Single-file checkpoints
        go to Lightning's own loader.

        Example::

            model = MyModel.load_from_checkpoint("lightning_logs/version_0/checkpoints/last.ckpt")
            model.eval()
            with torch.no_grad():
                logits = model(batch)
        """
        from lightning_rec.checkpoint import _layout as layout
        from lightning_rec.checkpoint._export import load_module

        if isinstance(checkpoint_path, (str, Path)) and Path(layout.recover(Path(checkpoint_path))).is_dir():
            if hparams_file is not None:
                raise ValueError(
                    f"{cls.__name__}.load_from_checkpoint: `hparams_file` is not supported for checkpoint directories; "
                    "their hyperparameters are read from the checkpoint. HINT: pass overrides as keyword arguments."
                )
            if map_location is not None and not isinstance(map_location, (str, torch.device)):
                raise ValueError(
                    f"{cls.__name__}.load_from_checkpoint: for checkpoint directories `map_location` must be a device, "
                    f"got {type(map_location).__name__}."
                )
            return load_module(
                cls, checkpoint_path, map_location=map_location, strict=strict, weights_only=weights_only, **kwargs
            )
        return super().load_from_checkpoint(
            checkpoint_path,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )
