"""Reference models: plain TorchRec ``nn.Module``\\ s (tables on ``meta``, sharded from outside) wrapped by thin
RecLightningModules.

==================  ===========================  ==========================================  ===============================
task                network                      LightningModule                             config (MovieLens-100K)
==================  ===========================  ==========================================  ===============================
CTR                 ``DLRM`` / ``DLRM_DCN``      :class:`DLRMModule`                         ``movielens_dlrm.yaml``
CTR                 :class:`DeepFMNN`            :class:`DeepFMModule`                       ``movielens_deepfm.yaml``
CTR                 :class:`LogisticRegression`  :class:`LogisticRegressionModule`           ``recbole_parity/lr.yaml``
retrieval           :class:`TwoTower`            :class:`TwoTowerModule`                     ``movielens_two_tower.yaml``
next item           :class:`SASRec`              :class:`SequentialRecModule`                ``movielens_sasrec.yaml``
next item           :class:`GRU4Rec`             :class:`SequentialRecModule` (``gru``)      ``recbole_parity/gru4rec.yaml``
==================  ===========================  ==========================================  ===============================
"""

from lightning_rec.models.deepfm import DeepFMModule, DeepFMNN, build_deepfm
from lightning_rec.models.dlrm import DLRMModule, build_dlrm, table_configs
from lightning_rec.models.logistic_regression import (
    LogisticRegression,
    LogisticRegressionModule,
    build_logistic_regression,
)
from lightning_rec.models.sequential import GRU4Rec, SASRec, SequentialRecModule
from lightning_rec.models.two_tower import TwoTower, TwoTowerModule, build_two_tower

__all__ = [
    "DLRMModule",
    "DeepFMModule",
    "DeepFMNN",
    "GRU4Rec",
    "LogisticRegression",
    "LogisticRegressionModule",
    "SASRec",
    "SequentialRecModule",
    "TwoTower",
    "TwoTowerModule",
    "build_deepfm",
    "build_dlrm",
    "build_logistic_regression",
    "build_two_tower",
    "table_configs",
]
