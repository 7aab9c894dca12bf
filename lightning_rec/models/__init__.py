"""Reference models: plain TorchRec ``nn.Module``s wrapped by thin RecLightningModules."""

from lightning_rec.models.dlrm import DLRMModule, build_dlrm, table_configs
from lightning_rec.models.two_tower import TwoTower, TwoTowerModule, build_two_tower  # noqa: F401 (issue 15 model zoo)
from lightning_rec.models.sequential import SASRec, SequentialRecModule  # noqa: F401 (issue 15 model zoo)
from lightning_rec.models.deepfm import DeepFMModule, DeepFMNN, build_deepfm  # noqa: F401 (issue 15 model zoo)

__all__ = ["DLRMModule", "build_dlrm", "table_configs"]
