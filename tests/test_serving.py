"""Serving export (``lightning_rec.serving``), the artifact side: a sharded checkpoint becomes a TorchScript artifact
with quantized tables that predicts in a fresh process without torchrec, lightning or lightning_rec,
exactly like the trained module for fp32 tables: zoo models, tutorial-style and script-trained user models, a model
trained on 2 ranks against plain PyTorch; the dense width export reads; the artifact's own checks of ids and
lengths. What export refuses (naming the part and the reason, writing nothing) is in ``test_serving_refusals.py``;
the C++ example (both formats) in ``test_serving_cpp.py``.
The main job's artifact against ``lightning-rec predict`` is in ``tests/test_main_job.py``."""

from __future__ import annotations

import copy
import runpy
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec import RecLightningModule, RecShardStrategy
from lightning_rec._pretrained import table_holders
from lightning_rec.config import EmbeddingOptimizer
from lightning_rec.errors import ExportError
from lightning_rec.models import DLRMModule
from lightning_rec.models.base import CTRModule
from lightning_rec.serving import export_inference, inference_spec, load_inference, load_pt2, serving_inputs
from lightning_rec.testing import QUIET_TRAINER, shell_env
from tests.helpers import user_scenarios, zoo_deepfm, zoo_dlrm, zoo_two_tower
from tests.helpers.dist import run_ranks
from tests.helpers.serving import serve_fresh
from tests.helpers.side_by_side import side_by_side
from tests.helpers.user_models import REORDERING_PLAN, ValuesModel, samples, to_batch
from tests.helpers.zoo import ZooCase, seeded_module


def trained_checkpoint(module: nn.Module, batches: list[Any], path: Path) -> Path:
    """``module`` trained for ``len(batches)`` steps on one process, saved as a sharded checkpoint directory."""
    trainer = L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=len(batches), **QUIET_TRAINER
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    trainer.save_checkpoint(path)
    return path


def _dlrm_dot() -> DLRMModule:
    features = zoo_dlrm.movielens()[1]
    return DLRMModule(features, 2, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])


def _fast(build: Callable[[], CTRModule]) -> Callable[[], CTRModule]:
    """``build``'s CTR module with ten times the zoo cases' learning rates (tables 0.05 -> 0.5, dense layers
    1e-3 -> 1e-2), rebuilt from its hyperparameters, so that a few steps make the tables matter (see ``_BOUND``)."""

    def rebuilt() -> CTRModule:
        module = build()
        fast = {"embedding_optimizer": EmbeddingOptimizer("rowwise_adagrad", lr=0.5), "dense_lr": 0.01}
        return type(module)(**{**module.hparams, **fast})

    return rebuilt


# name -> (case whose data it uses, the module to build (default: the case's), the parts it serves)
MODELS: dict[str, Any] = {
    "dlrm": (zoo_dlrm.CASE, _fast(_dlrm_dot), [None]),
    "dcnv2": (zoo_dlrm.CASE, _fast(zoo_dlrm.CASE.build), [None]),
    "deepfm": (zoo_deepfm.CASE, _fast(zoo_deepfm.CASE.build), [None]),
    "two_tower": (zoo_two_tower.CASE, None, ["query", "candidate"]),  # its outputs read nothing but its tables
}

# A quantized artifact's error on the held-out batch is bounded relative to what the tables contribute: at most
# k x the change that replacing every table with zeros (or with its own rows shuffled) makes, both in the largest and
# in the mean absolute difference per output. An absolute bound passed artifacts whose tables were garbage: after 2
# steps at the zoo's learning rates, zeroing every table moved the CTR probabilities by 0.003-0.012 on average
# (0.011-0.024 at most), about the old int8 tolerance (2e-2) and far under int4's (0.2). Row-wise quantization (a scale and a bias per row) errs by up to half a
# step, range/510 for int8 and range/30 for int4 (8 gaussian values span ~3x their rms): relative to the rows
# themselves about 0.6% (int8) and 10% (int4) at worst; fp16 keeps 11 bits (0.05%). Measured after 4 steps at
# `_fast`'s rates (the two towers: 2 steps at the zoo's), the change with zeroed tables (max / mean) and the error's
# largest ratio to it over (max, mean) x (zeroed, shuffled):
#                  zeroed tables     fp16     int8     int4
#   dlrm (dot)     0.280 / 0.085     -        0.0018   0.034
#   dcnv2          0.185 / 0.043     0.0002   0.0027   0.039
#   deepfm         0.314 / 0.098     -        0.0017   0.054
#   query tower    0.558 / 0.206     -        0.0013   0.028
#   candidate      0.235 / 0.050     -        0.0019   0.037
# k leaves 7x room or more at fp16/int8 and 4.6x at int4; int8's k is under every int4 ratio seen. Tables the
# artifact does not hold (zeros: ratio 1) or reads wrong (shuffled rows: 0.6-1.5) are far outside it.
_BOUND = {"fp16": 0.005, "int8": 0.02, "int4": 0.25}
_SIGNAL = 0.02  # the tables must move the outputs by at least this much on average for the bound to mean anything


def _arguments(spec, batch: Any, part: str | None):
    if part is None:  # a CTR Batch
        return serving_inputs(spec, batch.sparse_features, batch.dense_features)
    return serving_inputs(spec, batch[part])


def _eager(module: RecLightningModule, batch: Any, part: str | None) -> torch.Tensor:
    net = module.inference_module(part)
    with torch.no_grad():
        if part is None:
            return net(batch.dense_features, batch.sparse_features)
        return net(batch[part])


def _with_tables(module: RecLightningModule, fill: str) -> RecLightningModule:
    """A copy of ``module`` with every table replaced: ``"zeros"``, or ``"shuffled"`` (its own rows in a seeded
    random order). Its :func:`_eager` outputs are what an fp32 artifact of those tables serves (the fp32 artifact
    gives the module's outputs bit for bit): the reference a quantized artifact must stay much closer to than."""
    module = copy.deepcopy(module)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for holders in table_holders(module).values():
            for _, table, rows, _ in holders:
                table.weight.copy_(
                    torch.zeros_like(table.weight)
                    if fill == "zeros"
                    else table.weight[torch.randperm(rows, generator=g)]
                )
    return module


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_model_serves_without_lightning_rec_like_the_trained_module(tmp_path, name):
    """Trained, checkpointed (sharded), exported per table dtype, served in a fresh process: fp32 tables give the
    loaded module's own outputs bit for bit; fp16, int8 and int4 tables stay within ``_BOUND`` of them relative to
    what the tables contribute (the outputs with every table zeroed, or its rows shuffled)."""
    case, build, parts = MODELS[name]
    case = case if build is None else ZooCase(**{**case.__dict__, "build": build})
    module = seeded_module(case)
    ckpt = trained_checkpoint(module, case.batches(2 if build is None else 4), tmp_path / "ckpt")
    loaded = type(module).load_from_checkpoint(ckpt).eval()
    heldout = case.heldout()
    jobs, expected = [], []
    for part in parts:
        references = {fill: _eager(_with_tables(loaded, fill), heldout, part) for fill in ("zeros", "shuffled")}
        for dtype in ("fp32", "fp16", "int8", "int4") if name == "dcnv2" else ("fp32", "int8", "int4"):
            artifact = tmp_path / f"{part or name}_{dtype}.pt"
            spec = export_inference(ckpt, artifact, table_dtype=dtype, part=part)
            assert inference_spec(artifact) == spec and spec.table_dtype == dtype and spec.part == part
            jobs.append((artifact, [_arguments(spec, heldout, part)]))
            expected.append((dtype, part, _eager(loaded, heldout, part), references))
    served = serve_fresh(jobs, tmp_path)
    for (dtype, part, want, references), got in zip(expected, served):
        assert got.shape == want.shape, (dtype, part)
        if dtype == "fp32":
            assert torch.equal(got, want), (part, (got - want).abs().max())
            continue
        assert not torch.equal(got, want), "quantized tables should not be the float rows"
        error = (got - want).abs()
        for fill, reference in references.items():
            signal = (reference - want).abs()
            assert signal.mean() >= _SIGNAL, f"{part}: the tables ({fill}) barely matter: {signal.mean():.4f}"
            ratios = (float(error.max() / signal.max()), float(error.mean() / signal.mean()))
            assert max(ratios) <= _BOUND[dtype], (
                f"{dtype} {part}: error {error.max():.5f} (max) / {error.mean():.5f} (mean) is {max(ratios):.3f}x "
                f"what {fill} tables change ({signal.max():.4f} / {signal.mean():.4f}); bound {_BOUND[dtype]}"
            )


class TutorialModel(RecLightningModule):
    """Written as TorchRec's tutorials write it: tables built on CPU with their own weights, ``kt.values()``, dict
    batches, its own ``forward(dense, kjt)``, no ``inference_module`` and no hyperparameters."""

    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=30, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=50, feature_names=["item", "seen"]),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        with torch.no_grad():
            for i, bag in enumerate(self.ebc.embedding_bags.values()):
                bag.weight.copy_(torch.randn(bag.weight.shape, generator=torch.Generator().manual_seed(i)))
        self.bottom = nn.Linear(3, 4)
        self.top = nn.Linear(16, 1)

    def forward(self, dense, kjt):
        kt = self.ebc(kjt)
        return self.top(torch.cat([torch.relu(self.bottom(dense)), kt.values()], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        logits = self(batch["dense"], batch["sparse"])
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def tutorial_batch(seed: int, rows: int = 8) -> dict[str, Any]:
    """A seeded dict batch of ``rows`` samples for :class:`TutorialModel`: dense values, ids and labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * rows,), generator=g)
    limits = torch.tensor([30, 50, 50]).repeat_interleave(rows).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * limits).long()
    return {
        "dense": torch.randn(rows, 3, generator=g),
        "sparse": KeyedJaggedTensor(keys=["user", "item", "seen"], values=values, lengths=lengths),
        "label": torch.randint(0, 2, (rows,), generator=g).float(),
    }


@pytest.mark.dist
def test_a_tutorial_style_model_serves_its_own_forward(tmp_path):
    """No ``inference_module``, no ``num_dense_features``: its ``forward(dense, kjt)`` serves, the dense width is
    read from the Linear that takes it, and a shared table (``item``/``seen``) keeps both features."""
    ckpt = trained_checkpoint(TutorialModel(), [tutorial_batch(i) for i in range(3)], tmp_path / "ckpt")
    spec = export_inference(ckpt, tmp_path / "model.pt", table_dtype="fp32")  # the class the checkpoint names
    assert spec.features == ["user", "item", "seen"] and spec.num_dense_features == 3 and not spec.weighted
    loaded = TutorialModel.load_from_checkpoint(ckpt).eval()
    batch = tutorial_batch(99, rows=5)
    with torch.no_grad():
        want = loaded(batch["dense"], batch["sparse"])
    (got,) = serve_fresh([(tmp_path / "model.pt", [serving_inputs(spec, batch["sparse"], batch["dense"])])], tmp_path)
    assert torch.equal(got, want), (got - want).abs().max()


# ---- a user's model, trained sharded on 2 ranks, against plain PyTorch ------------------------------------------


class _ValuesNet(nn.Module):
    """What a user returns from ``inference_module``: their tables and MLP, taking ``(dense, kjt)``."""

    def __init__(self, ebc: nn.Module, over: nn.Module) -> None:
        super().__init__()
        self.ebc, self.over = ebc, over

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(torch.cat([self.ebc(kjt).values(), dense], dim=1)).squeeze(1)


class ServedValuesModel(ValuesModel):
    """The tutorial-style :class:`ValuesModel` (``forward(batch_dict)``) made servable the documented way."""

    def inference_module(self, part: str | None = None) -> nn.Module:
        return _ValuesNet(self.ebc, self.over)


@pytest.mark.dist
def test_a_users_model_trained_on_two_ranks_serves_like_plain_pytorch(tmp_path):
    """A model written as TorchRec's tutorial writes one (CPU tables with their own rows, ``kt.values()``, dict
    batches), trained on 2 ranks under a plan that reorders the pooled columns, exported from its sharded checkpoint:
    the artifact, in a process without lightning_rec, predicts the held-out rows as the same model trained with
    plain PyTorch on whole batches does; int8 tables stay close."""
    ranks = run_ranks(user_scenarios.fit, 2, tmp_path, constraints=REORDERING_PLAN, save="ckpt")
    assert [r["reordered"] for r in ranks] == [True, True], "the plan must reorder kt.values() for this to test it"
    reference = torch.tensor(ranks[0]["ref_logits"])
    with pytest.raises(ExportError, match=r"ValuesModel cannot be exported .*forward\(batch\)"):
        export_inference(tmp_path / "ckpt", tmp_path / "no.pt")  # the class the checkpoint names has no net
    heldout = to_batch(samples(16, user_scenarios.HELDOUT_SEED))
    jobs = []
    for dtype in ("fp32", "int8"):
        artifact = tmp_path / f"model_{dtype}.pt"
        spec = export_inference(tmp_path / "ckpt", artifact, table_dtype=dtype, model_class=ServedValuesModel)
        assert spec.features == ["user", "genre", "item"] and spec.num_dense_features == 2
        jobs.append((artifact, [serving_inputs(spec, heldout["sparse"], heldout["dense"])]))
    fp32, int8 = serve_fresh(jobs, tmp_path)
    torch.testing.assert_close(fp32, reference, atol=1e-5, rtol=0)
    unsharded = ServedValuesModel.load_from_checkpoint(tmp_path / "ckpt").eval()
    with torch.no_grad():
        assert torch.equal(fp32, unsharded(heldout)), "fp32 tables: the checkpoint's model, bit for bit"
    assert 0 < (int8 - fp32).abs().max() <= 2e-2


class _DensePath(TutorialModel):
    """The dense input normalised first (``BatchNorm1d``/``LayerNorm``), or concatenated with ``kt.values()``."""

    def __init__(self, path: str = "batchnorm") -> None:
        super().__init__()
        self.path = path
        if path == "batchnorm":
            self.bottom = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 4))
        elif path == "layernorm":
            self.bottom = nn.Sequential(nn.LayerNorm(3), nn.ReLU(), nn.Linear(3, 4))
        else:
            self.top = nn.Linear(12 + 3, 1)

    def forward(self, dense, kjt):
        if self.path == "concatenated":
            return self.top(torch.cat([self.ebc(kjt).values(), dense], dim=1)).squeeze(1)
        return super().forward(dense, kjt)


@pytest.mark.parametrize("path", ["batchnorm", "layernorm", "concatenated"])
def test_the_dense_width_is_read_from_the_first_layer_the_dense_input_reaches(tmp_path, path):
    ckpt = trained_checkpoint(_DensePath(path), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    spec = export_inference(ckpt, tmp_path / "model.pt", table_dtype="fp32", init_args={"path": path})
    assert spec.num_dense_features == 3
    loaded = _DensePath.load_from_checkpoint(ckpt, path=path).eval()
    batch = tutorial_batch(5)
    with torch.no_grad():
        want = loaded(batch["dense"], batch["sparse"])
        got = load_inference(tmp_path / "model.pt")(*serving_inputs(spec, batch["sparse"], batch["dense"]))
    assert torch.equal(got, want)


_SCRIPT = """
import torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
import lightning_rec


def batch(seed, rows=8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3, (2 * rows,), generator=g)
    values = (torch.rand(int(lengths.sum()), generator=g) * 20).long()
    sparse = KeyedJaggedTensor(keys=["user", "item"], values=values, lengths=lengths)
    return {"dense": torch.randn(rows, 3, generator=g), "sparse": sparse, "label": torch.rand(rows, generator=g)}


class Model(lightning_rec.RecLightningModule):
    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=20, feature_names=[f])
                  for f in ("user", "item")]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.top = nn.Sequential(nn.Linear(19, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, kjt):
        return self.top(torch.cat([self.ebc(kjt).values(), dense], 1)).squeeze(1)

    def training_step(self, b, i):
        return nn.functional.binary_cross_entropy_with_logits(self(b["dense"], b["sparse"]), b["label"])

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


if __name__ == "__main__":
    trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_progress_bar=False, callbacks=[L.pytorch.callbacks.ModelCheckpoint("ckpts", save_last=True)])
    trainer.fit(Model(), DataLoader([batch(i) for i in range(3)], batch_size=None, collate_fn=lambda b: b))
"""


@pytest.mark.dist
def test_a_script_trained_model_exports_from_the_shell(tmp_path):
    """``python train.py`` (its model in ``__main__``, Trainer(devices=2), ModelCheckpoint), then ``lightning-rec
    export``: without ``--model-class`` a one-line error says how to name the class (no traceback, nothing written);
    with ``--model-class train.Model`` from the script's folder the artifact predicts what the checkpoint's model
    does, its dense width read through ``torch.cat([kt.values(), dense])``; so does its ``--format pt2`` package."""
    (tmp_path / "train.py").write_text(_SCRIPT)
    env = shell_env()
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    export = [str(Path(sys.executable).with_name("lightning-rec")), "export", "ckpts/last.ckpt"]
    torchscript, named = ["--format", "inference", "--table-dtype", "fp32"], ["--model-class", "train.Model"]
    exports = {
        "refused": [*export, "refused.pt", *torchscript],
        "model.pt": [*export, "model.pt", *torchscript, *named],
        "model.pt2": [*export, "model.pt2", "--format", "pt2", "--table-dtype", "fp32", *named],
    }
    run = partial(subprocess.run, cwd=tmp_path, capture_output=True, text=True, env=env)
    # The three exports side by side (tests/helpers/side_by_side.py): each is one process importing, then tracing or
    # compiling, on one core; they read the checkpoint and write files of their own.
    with side_by_side({name: partial(run, command) for name, command in exports.items()}) as done:
        out = done["refused"].result()
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert (
            "Model was defined in the script that trained it" in out.stderr
            and "--model-class script.Model" in out.stderr
        )
        assert not (tmp_path / "refused.pt").exists()
        out = done["model.pt"].result()
        assert out.returncode == 0, out.stderr[-3000:]
        pt2_out = done["model.pt2"].result()
    assert "forward(dense_features[B, 3], values, lengths)" in out.stdout
    script = runpy.run_path(str(tmp_path / "train.py"))
    model = script["Model"].load_from_checkpoint(tmp_path / "ckpts" / "last.ckpt").eval()
    batch = script["batch"](42)
    with torch.no_grad():
        want = model(batch["dense"], batch["sparse"])
    spec = inference_spec(tmp_path / "model.pt")
    (got,) = serve_fresh([(tmp_path / "model.pt", [serving_inputs(spec, batch["sparse"], batch["dense"])])], tmp_path)
    assert torch.equal(got, want), (got - want).abs().max()
    # The same from a .pt2 package (torch.export + AOTInductor): to 1e-6.
    assert pt2_out.returncode == 0, pt2_out.stderr[-3000:]
    package = load_pt2(tmp_path / "model.pt2")
    got = package(*serving_inputs(package.spec, batch["sparse"], batch["dense"]))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()


def test_the_artifact_refuses_ids_outside_their_tables_and_malformed_lengths(tmp_path):
    """``bounds_check="error"`` (the default, as in training): an id outside its table raises, naming the feature,
    the id and the table's rows; lengths that do not fit the features or the values are refused. ``"warn"`` keeps
    FBGEMM's serving default: a too large id reads row 0."""
    ckpt = trained_checkpoint(TutorialModel(), [tutorial_batch(i) for i in range(2)], tmp_path / "ckpt")
    spec = export_inference(ckpt, tmp_path / "strict.pt", table_dtype="fp32")
    lenient = export_inference(ckpt, tmp_path / "lenient.pt", table_dtype="fp32", bounds_check="warn")
    assert (spec.bounds_check, lenient.bounds_check) == ("error", "warn")
    strict, lenient = load_inference(tmp_path / "strict.pt"), load_inference(tmp_path / "lenient.pt")
    dense, lengths = torch.zeros(1, 3), torch.tensor([1, 1, 1])
    good = torch.tensor([29, 0, 49])  # user (30 rows), item and seen (one table of 50 rows)
    with torch.no_grad():
        assert torch.equal(strict(dense, good, lengths), lenient(dense, good, lengths))
        for bad, message in (
            (
                torch.tensor([30, 0, 0]),
                r"feature 'user': id 30 is outside its table of 30 rows \(ids run from 0 to 29\)",
            ),
            (torch.tensor([0, 0, -1]), r"feature 'seen': id -1 is outside its table of 50 rows"),
        ):
            with pytest.raises(Exception, match=message):
                strict(dense, bad, lengths)
        too_large = torch.tensor([30, 0, 0])
        assert torch.equal(lenient(dense, too_large, lengths), lenient(dense, torch.tensor([0, 0, 0]), lengths))
        with pytest.raises(Exception, match=r"lengths has 4 entries; the artifact reads 3 features"):
            strict(dense, good, torch.tensor([1, 1, 1, 0]))
        with pytest.raises(Exception, match=r"lengths add up to 4 ids, but values holds 3"):
            strict(dense, good, torch.tensor([1, 2, 1]))
        with pytest.raises(Exception, match=r"lengths holds a negative length"):
            strict(dense, good, torch.tensor([2, -1, 2]))  # adds up to 3: only the sign tells
