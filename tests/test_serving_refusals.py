"""Serving export (``lightning_rec.serving``), the refusals: a model that cannot be served is refused before
anything is written (an earlier artifact is kept), naming the part and the reason with a HINT: an untraceable network,
no serving network, wrong arguments, a checkpoint that does not name its class, arguments not saved, tables too narrow
for the quantized dtype, a forward that takes a training batch or the sparse features first. The models and the
checkpoint helper they share with the served-artifact tests are ``test_serving.py``'s."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import RecLightningModule
from lightning_rec.checkpoint import _layout as layout
from lightning_rec.checkpoint._safe_io import dumps_meta, load_meta
from lightning_rec.errors import CheckpointError, ExportError
from lightning_rec.models import SequentialRecModule
from lightning_rec.serving import export_inference, inference_spec
from tests.helpers import zoo_sequential, zoo_two_tower
from tests.helpers.zoo import seeded_module
from tests.test_serving import TutorialModel, trained_checkpoint, tutorial_batch


def _assert_refused(ckpt: Path, work: Path, match: str, error: type = ExportError, **kwargs: Any) -> None:
    """``export_inference(ckpt, ...)`` raises ``error`` matching ``match``, and writes nothing."""
    with pytest.raises(error, match=match):
        export_inference(ckpt, work / "model.pt", **kwargs)
    assert not (work / "model.pt").exists() and not list(work.glob(".*partial"))


class _Branchy(nn.Module):
    """A network whose output depends on a branch on tensor values: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"])],
            device=torch.device("cpu"),
        )

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        x = self.ebc(sparse_features).values().sum(1)
        if x.sum() > 0:
            return x
        return -x


class _BranchyModule(RecLightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Branchy()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.net(batch["sparse"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def inference_module(self, part: str | None = None) -> nn.Module:
        return self.net


def _branchy_checkpoint(path: Path) -> Path:
    kjt = KeyedJaggedTensor.from_lengths_sync(["user"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    return trained_checkpoint(_BranchyModule(), [{"sparse": kjt}], path)


def test_untraceable_network_is_refused_naming_it_and_the_existing_file_is_kept(tmp_path):
    ckpt = _branchy_checkpoint(tmp_path / "ckpt")
    output = tmp_path / "model.pt"
    output.write_bytes(b"the user's earlier artifact")
    with pytest.raises(ExportError, match=r"_Branchy cannot be traced for serving .*control flow"):
        export_inference(ckpt, output, table_dtype="fp32")
    assert output.read_bytes() == b"the user's earlier artifact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt"], "no partial file left behind"


class _NoServingNetwork(SequentialRecModule):
    """SASRec's module without its ``inference_module``: its forward takes a sequence batch (a dict)."""

    inference_module = RecLightningModule.inference_module


def test_modules_without_a_serving_network_and_wrong_arguments_are_refused(tmp_path):
    sequential = trained_checkpoint(
        _NoServingNetwork(**zoo_sequential.CASE.build().hparams), zoo_sequential.CASE.batches(1), tmp_path / "seq"
    )
    with pytest.raises(ExportError, match=r"cannot be exported for serving: it does not override `inference_module"):
        export_inference(sequential, tmp_path / "seq.pt")
    two_tower = trained_checkpoint(seeded_module(zoo_two_tower.CASE), zoo_two_tower.CASE.batches(1), tmp_path / "tt")
    with pytest.raises(ExportError, match=r"serves two towers; choose one with part='query' or part='candidate'"):
        export_inference(two_tower, tmp_path / "tt.pt")
    with pytest.raises(ExportError, match=r"table_dtype must be one of .*'int4'.*got 'int3'"):
        export_inference(two_tower, tmp_path / "tt.pt", part="query", table_dtype="int3")
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob(".*partial"))


def test_a_checkpoint_that_does_not_name_its_class_needs_model_class(tmp_path):
    """Checkpoints written before the module class was recorded: a hint to pass it (checked before anything is
    loaded); a class given explicitly is the one exported."""
    ckpt = _branchy_checkpoint(tmp_path / "ckpt")
    old = tmp_path / "old.ckpt"
    shutil.copytree(ckpt, old)
    meta = load_meta(old / "meta.pt")
    del meta["lightning_rec"]["module_class"]
    (old / "meta.pt").write_bytes(dumps_meta(meta))
    manifest = layout.read_manifest(old)  # sealed again, as a save of that time wrote it: meta.pt is verified
    (old / layout.COMPLETE_FILE).unlink()
    layout.mark_complete(old, {**manifest["files"], "meta.pt": layout.file_digest(old / "meta.pt")}, {})
    with pytest.raises(ExportError, match=r"does not name the LightningModule .*--model-class package.module.Class"):
        export_inference(old, tmp_path / "model.pt")
    with pytest.raises(ExportError, match=r"_Branchy cannot be traced"):  # got past the class: the network is refused
        export_inference(ckpt, tmp_path / "model.pt", model_class=f"{__name__}._BranchyModule")
    assert not (tmp_path / "model.pt").exists()


class _NoHyperparameters(TutorialModel):
    """A module whose ``__init__`` takes an argument it does not save (no ``save_hyperparameters()``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width


def test_a_module_that_did_not_save_its_arguments_gets_a_hint_and_init_args(tmp_path):
    ckpt = trained_checkpoint(_NoHyperparameters(3), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    _assert_refused(ckpt, tmp_path, r"cannot build _NoHyperparameters .*'width'.*save_hyperparameters", CheckpointError)
    spec = export_inference(ckpt, tmp_path / "model.pt", table_dtype="fp32", init_args={"width": 3})
    assert spec.num_dense_features == 3 and inference_spec(tmp_path / "model.pt") == spec


class _NarrowModel(RecLightningModule):
    """Tables 6 and 2 columns wide, read as ``kt.values()``: int8 fits them, int4 (4-column units) does not. Its
    ``forward(kjt)`` is not annotated: served all the same."""

    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t_wide", embedding_dim=6, num_embeddings=30, feature_names=["user"]),
            EmbeddingBagConfig(name="t_narrow", embedding_dim=2, num_embeddings=50, feature_names=["item", "seen"]),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.top = nn.Linear(10, 1)

    def forward(self, kjt):  # not annotated, as users often write it: the export finds it takes a KJT
        return self.top(self.ebc(kjt).values()).squeeze(1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch["sparse"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def test_tables_too_narrow_for_the_quantized_dtype_are_named_before_anything_is_written(tmp_path):
    """FBGEMM packs quantized rows in 2-byte units: int4 needs widths that are multiples of 4, int8 of 2. A table
    that does not fit is named, with the dtypes that would, before anything is written."""
    ckpt = trained_checkpoint(_NarrowModel(), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    match = r"t_wide \(embedding_dim 6\), t_narrow \(embedding_dim 2\) cannot be stored as int4: .*multiple of 4\. "
    _assert_refused(ckpt, tmp_path, match + r"HINT: --table-dtype int8 or fp16 or fp32", table_dtype="int4")
    spec = export_inference(ckpt, tmp_path / "model.pt", table_dtype="int8")
    assert spec.tables == {"t_wide": [30, 6], "t_narrow": [50, 2]} and spec.num_dense_features == 0


class _DictForward(_NarrowModel):
    """``forward(batch)`` on a dict batch, not annotated: only calling it on a KeyedJaggedTensor tells."""

    def forward(self, batch):
        return self.top(self.ebc(batch["sparse"]).values()).squeeze(1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch), batch["label"])


def test_a_forward_that_takes_a_training_batch_is_refused_with_the_hint(tmp_path):
    ckpt = trained_checkpoint(_DictForward(), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    match = r"_DictForward cannot be served as forward\(sparse_features\): calling it on a KeyedJaggedTensor of two "
    _assert_refused(
        ckpt, tmp_path, match + r"samples raised KeyError: 'sparse'\. HINT: override `_DictForward.inference"
    )


class _SparseFirst(TutorialModel):
    """``forward(kjt, dense)``: the artifact calls ``(dense_features, sparse_features)``."""

    def forward(self, kjt, dense):
        return super().forward(dense, kjt)

    def training_step(self, batch, batch_idx):
        logits = self(batch["sparse"], batch["dense"])
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])


class _SparseFirstAnnotated(_SparseFirst):
    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        return super().forward(kjt, dense)


@pytest.mark.parametrize(
    "cls, message",
    [
        (_SparseFirstAnnotated, r"forward\(kjt, dense\) takes the KeyedJaggedTensor first; the artifact calls "),
        (_SparseFirst, r"if its forward takes the KeyedJaggedTensor first, swap the arguments"),
    ],
)
def test_a_forward_that_takes_the_sparse_features_first_is_refused_naming_the_order(tmp_path, cls, message):
    ckpt = trained_checkpoint(cls(), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    _assert_refused(ckpt, tmp_path, message, table_dtype="fp32")
