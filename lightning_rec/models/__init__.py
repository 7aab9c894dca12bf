"""Reference models: plain TorchRec ``nn.Module``s wrapped by thin RecLightningModules."""

from lightning_rec.models.dlrm import DLRMModule, build_dlrm, table_configs

__all__ = ["DLRMModule", "build_dlrm", "table_configs"]
