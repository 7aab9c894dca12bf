"""lightning_rec: TorchRec's sharded recommendation training as an ordinary Lightning strategy.

Importing the package registers the ``"recshard"`` strategy with Lightning (idempotently), so
``L.Trainer(strategy="recshard")`` works.

Example::

    import lightning as L, lightning_rec
    trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=2)
"""

import logging
import sys

try:
    if "fbgemm_gpu" not in sys.modules:
        # FBGEMM logs "Successfully loaded" on the root logger while it imports; with no handler there, Python's
        # logging installs a stderr handler on the root logger, and every Lightning INFO line then prints twice
        # (Lightning's own handler, then the root's). A handler held for the import keeps the root logger as it was.
        _held = logging.NullHandler()
        logging.getLogger().addHandler(_held)
        try:
            import fbgemm_gpu  # noqa: F401
        finally:
            logging.getLogger().removeHandler(_held)
    import torchrec  # noqa: F401
except (ModuleNotFoundError, OSError) as _err:
    # One line, no chained traceback: what is missing or does not load (an OSError: e.g. the CUDA build of FBGEMM
    # without an NVIDIA driver, or one built for another torch), and what to install. As TorchRec's own install
    # instructions do, the builds for this machine come from the PyTorch package index of its platform.
    _missing = isinstance(_err, ModuleNotFoundError)
    _top = (_err.name or "").partition(".")[0] if isinstance(_err, ModuleNotFoundError) else "fbgemm_gpu"
    if _missing and _top not in ("torch", "torchrec", "fbgemm_gpu"):
        raise
    _what = f"`{_top}` is not installed" if _missing else f"they do not load here ({' '.join(str(_err).split())})"
    raise (ModuleNotFoundError if _missing else ImportError)(
        f"lightning_rec needs PyTorch, TorchRec and FBGEMM built for this machine, and {_what}. HINT: CPU: pip install "
        "lightning-rec --extra-index-url https://download.pytorch.org/whl/cpu; CUDA: pip install lightning-rec (PyPI's "
        "CUDA builds), or add --extra-index-url https://download.pytorch.org/whl/cuXYZ for another CUDA version; in a "
        "clone of the repository: bash scripts/setup.sh",
        name=_top,
    ) from None

from torchrec.datasets.utils import Batch

from lightning_rec import _compat
from lightning_rec._batch import RowCollator, collate_rows
from lightning_rec._module import RecLightningModule
from lightning_rec._planner.cluster import Cluster
from lightning_rec._planner.estimates import RankEstimate
from lightning_rec._planner.fit import DoesNotFit
from lightning_rec._planner.offline import plan_cluster
from lightning_rec._planner.report import PlanReport
from lightning_rec._planner.sharders import EBCSharder
from lightning_rec._planner.table import PlanRow
from lightning_rec._pretrained import load_rows
from lightning_rec._strategy.optim import RecOptimizer
from lightning_rec._strategy.quiet import silence_proven_harmless
from lightning_rec._strategy.recshard import RecShardStrategy
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec.config import EmbeddingOptimizer, QuantizedComms, TableConstraints, TopologyConfig, checkpoint_safe
from lightning_rec.errors import InputError, NonFiniteError
from lightning_rec.progressive import ProgressiveEvaluation
from lightning_rec.publish import ModelPublisher

silence_proven_harmless()  # before a user's first KeyedJaggedTensor: README "What you will not see"

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Cluster",
    "DoesNotFit",
    "EBCSharder",
    "EmbeddingOptimizer",
    "InputError",
    "ModelPublisher",
    "NonFiniteError",
    "PlanReport",
    "PlanRow",
    "ProgressiveEvaluation",
    "QuantizedComms",
    "RankEstimate",
    "RecLightningModule",
    "RecOptimizer",
    "RecShardStrategy",
    "RowCollator",
    "ShardingConfig",
    "TableConstraints",
    "TopologyConfig",
    "checkpoint_safe",
    "collate_rows",
    "load_rows",
    "plan_cluster",
]

RecShardStrategy.register_strategies(_compat.StrategyRegistry)
