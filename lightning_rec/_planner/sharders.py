"""The sharders of every TorchRec embedding module that trains: EBC and EC, position-weighted and managed-collision
ones, with the fused optimizer and quantized comms passed into each (a user's too). The planner asks them what each
table can be sharded as (:mod:`lightning_rec._planner.planner`); ``DistributedModelParallel`` shards with them.

What TorchRec can run on each device, and the refusals that name what cannot: :mod:`lightning_rec._planner.devices`.

Example::

    sharders = make_sharders(EmbeddingOptimizer("adagrad", lr=0.1).to_fused_params())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.types import ModuleSharder

from lightning_rec import _compat
from lightning_rec._planner.devices import kernels_on
from lightning_rec.config import QuantizedComms

__all__ = ["EBCSharder", "MCEBCSharder", "MCECSharder", "make_sharders", "qcomms_registry"]

# The fused_params keys that describe the embedding optimizer (EmbeddingOptimizer.to_fused_params writes them).
_OPTIMIZER_KEYS = ("optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode")


class EBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's ``EmbeddingBagCollectionSharder``, offering ``row_wise``, ``table_row_wise`` and ``grid_shard`` on
    CPU too (TorchRec lists them for CUDA only; over gloo they train exactly like the unsharded module).

    Example::

        sharder = EBCSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
        "row_wise" in sharder.sharding_types("cpu")   # True
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:  # noqa: D102
        return super().sharding_types("cuda" if compute_device_type == "cpu" else compute_device_type)


class MCEBCSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingBagCollectionSharder`` (row-wise tables, the raw id space split across
    ranks with them), with the fused kernel on CPU; its tables go through ``ebc_sharder`` (default
    :class:`EBCSharder`, which admits row-wise on CPU)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


class MCECSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's ``ManagedCollisionEmbeddingCollectionSharder``, as :class:`MCEBCSharder` for unpooled tables."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:  # noqa: D102
        return kernels_on(super().compute_kernels(sharding_type, compute_device_type), compute_device_type)


def qcomms_registry(qcomms: QuantizedComms | None) -> dict[str, Any] | None:
    """TorchRec's codec registry for ``qcomms`` (``None``: full precision)."""
    if qcomms is None:
        return None
    # No device: TorchRec then keeps bf16 as asked. Given the CPU device it replaces bf16 by fp16 ("not supported on
    # GLOO"), yet gloo carries bfloat16 all-to-alls with this torch (tests/strategy/test_torchrec_models.py).
    return get_qcomm_codecs_registry(qcomms.to_torchrec())


def make_sharders(
    fused_params: Mapping[str, Any],
    extra: Sequence[ModuleSharder[nn.Module]] = (),
    owner: str = "RecShardStrategy",
    qcomms: QuantizedComms | None = None,
) -> list[ModuleSharder[nn.Module]]:
    """A sharder for every TorchRec embedding module that trains, each with ``fused_params`` (the fused optimizer
    and FBGEMM's arguments).

    The built-in ones are :class:`EBCSharder`, TorchRec's ``EmbeddingCollectionSharder`` and
    ``FeatureProcessedEmbeddingBagCollectionSharder`` (position-weighted tables) and :class:`MCEBCSharder` /
    :class:`MCECSharder` (managed collision). A sharder in ``extra`` replaces the built-in one for its module type,
    and an ``extra`` EBC/EC sharder is also what the feature-processed and managed-collision sharders shard their
    tables with. An ``extra`` embedding sharder keeps every ``fused_params`` entry it sets and gets the others from
    ``fused_params``: the fused optimizer derived from ``configure_optimizers`` reaches it too (it is a copy: the
    user's sharder is left as it was). ``qcomms`` quantizes the built-in sharders' all-to-alls (an ``extra`` sharder
    keeps its own ``qcomm_codecs_registry``).

    Raises:
        ValueError: if an ``extra`` sharder sets an optimizer entry (``optimizer``, ``learning_rate``, ...) that
            differs from the one ``fused_params`` derives, naming both.
    """
    fused, codecs = dict(fused_params), qcomms_registry(qcomms)
    given = {s.module_type: _with_fused_params(s, fused, owner) for s in extra}
    ebc = given.get(EmbeddingBagCollection) or EBCSharder(fused_params=dict(fused), qcomm_codecs_registry=codecs)
    ec = given.get(EmbeddingCollection) or EmbeddingCollectionSharder(
        fused_params=dict(fused), qcomm_codecs_registry=codecs
    )
    built_in: list[ModuleSharder[nn.Module]] = [
        ebc,
        ec,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc, qcomm_codecs_registry=codecs),
        MCEBCSharder(
            ebc_sharder=ebc,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
        MCECSharder(
            ec_sharder=ec,
            mc_sharder=ManagedCollisionCollectionSharder(),
            qcomm_codecs_registry=codecs,
        ),
    ]
    by_type: dict[type, ModuleSharder[nn.Module]] = {s.module_type: s for s in built_in}
    by_type.update(given)
    return list(by_type.values())


def _with_fused_params(
    sharder: ModuleSharder[nn.Module], fused: Mapping[str, Any], owner: str
) -> ModuleSharder[nn.Module]:
    own = _compat.sharder_fused_params(sharder)
    if own is None:
        return sharder  # not an embedding sharder: nothing of ours to pass in
    conflicts = [k for k in _OPTIMIZER_KEYS if k in own and k in fused and own[k] != fused[k]]
    if conflicts:
        raise ValueError(
            f"{owner}: the sharder {type(sharder).__name__} sets the embedding optimizer "
            + ", ".join(f"{k}={own[k]!r}" for k in conflicts)
            + " in its fused_params, but the optimizer derived from `configure_optimizers` (or "
            "`configure_embedding_optimizer`) has "
            + ", ".join(f"{k}={fused[k]!r}" for k in conflicts)
            + ": the tables would not be trained the way the module says. HINT: leave the optimizer out of the "
            "sharder's fused_params (the strategy passes it in), or declare the same one in the module."
        )
    # TorchRec's own sharders become the ones that run row-wise on CPU too (a subclass, no other change): a user who
    # passes TorchRec's managed-collision sharder gets what TorchRec gives on CUDA, not "no available sharding type".
    upgrades: dict[type, type] = {
        EmbeddingBagCollectionSharder: EBCSharder,
        ManagedCollisionEmbeddingBagCollectionSharder: MCEBCSharder,
        ManagedCollisionEmbeddingCollectionSharder: MCECSharder,
    }
    return _compat.with_sharder_fused_params(sharder, {**fused, **own}, upgrades)
