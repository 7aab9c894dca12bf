"""What a user sees on the console (issue 36): every log line once, the validation metrics on the progress bar."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_rec import RecShardStrategy
from lightning_rec.testing import QUIET_TRAINER, shell_env
from tests.helpers.side_by_side import selected, side_by_side
from tests.helpers.zoo import seeded_module

_SCRIPT = """
import lightning_rec  # first, as the `lightning-rec` command imports it
import torch, lightning as L
from torch import nn

class Model(lightning_rec.RecLightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)

trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=4))
"""


def test_lightnings_info_lines_print_once(tmp_path):
    """Importing FBGEMM (through lightning_rec) used to give the root logger a stderr handler; Lightning, imported
    after it, then leaves its lines to the root logger (``INFO:lightning.pytorch...``), twice where it had
    already added its own."""
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=tmp_path, capture_output=True, text=True, env=shell_env(), timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert sum("`Trainer.fit` stopped" in line for line in lines) == 1, lines
    assert not [line for line in lines if line.startswith("INFO:")], lines


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dlrm", "deepfm", "two_tower", "sequential"])
def test_every_zoo_models_validation_metrics_are_on_the_progress_bar(name):
    """README says the validation metrics appear after each epoch: the progress bar shows what ``val/`` logs."""
    helper = importlib.import_module(f"tests.helpers.zoo_{name}")
    # the held-out batch, or for the two towers an evaluation batch (its queries' held-out items, ranked)
    batch = helper._splits().val[torch.arange(32)] if name == "two_tower" else helper.CASE.heldout()
    trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, **QUIET_TRAINER)
    trainer.validate(seeded_module(helper.CASE), DataLoader([batch], batch_size=None, collate_fn=lambda b: b))
    shown = [k for k in trainer.progress_bar_metrics if k.startswith("val/")]
    assert shown, (name, trainer.progress_bar_metrics, sorted(trainer.callback_metrics))


_TWO_RANKS = """
import warnings
import torch, lightning as L
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from lightning_rec import RecLightningModule, RecShardStrategy

class Model(RecLightningModule):
    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=20, feature_names=[f])
                  for f in ("user", "item")]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.over = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            warnings.warn("the user's own warning")
        return self.over(self.ebc(batch).values()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)

def batches():
    g = torch.Generator().manual_seed(0)
    return [KeyedJaggedTensor(keys=["user", "item"], values=torch.randint(0, 20, (8,), generator=g),
                              lengths=torch.ones(8, dtype=torch.long)) for _ in range(4)]

def trainer(steps):
    constraints = {"t_user": {"sharding_types": ["data_parallel"]}, "t_item": {"sharding_types": ["table_wise"]}}
    return L.Trainer(strategy=RecShardStrategy(constraints=constraints), accelerator="cpu", devices=2,
                     max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir="run")

if __name__ == "__main__":
    first = trainer(2)
    first.fit(Model(), torch.utils.data.DataLoader(batches(), batch_size=None))
    first.save_checkpoint("run/two.ckpt")
    trainer(4).fit(Model(), torch.utils.data.DataLoader(batches(), batch_size=None), ckpt_path="run/two.ckpt")
"""


@pytest.mark.dist
def test_warnings_proven_harmless_are_silenced_and_nothing_else(tmp_path):
    """Two ranks, a data-parallel table (FBGEMM's autograd warning), a checkpoint saved and loaded (torch's
    ShardedTensor deprecation, six of them from our own files), Lightning's pytree warning, torch.fx's tracing note:
    none reaches the console; the user's own warning does, and the plan table prints once per fit."""
    (tmp_path / "train.py").write_text(_TWO_RANKS)
    out = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, env=shell_env(), timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "the user's own warning" in console
    for message in ("an autograd kernel was not registered", "deprecating ShardedTensor", "LeafSpec", "is_fx_tracing"):
        assert message not in console, [line for line in console.splitlines() if message in line]
    assert console.count("sharding plan over 2 rank(s)") == 2, console  # one table per fit


SHIPPED = ["synthetic_dlrm", "movielens_deepfm", "movielens_dlrm", "movielens_sasrec", "movielens_two_tower"]


def _fit_a_few_steps(config: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``lightning-rec fit --config <config>`` for 3 steps and 2 validation batches in ``work``, as a user runs it."""
    from tests.helpers.data import movielens_dir

    (work / "data").mkdir()
    (work / "data" / "ml-100k").symlink_to(movielens_dir())
    return subprocess.run(
        [sys.executable, "-m", "lightning_rec", "fit", "--config", config, "--trainer.max_steps=3"]
        + ["--trainer.limit_val_batches=2", f"--trainer.default_root_dir={work / 'run'}"],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def shipped_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future]]:
    """The runs (:func:`_fit_a_few_steps`) of the configs this session tests, side by side, two at a time
    (tests/helpers/side_by_side.py: a run's ranks import one after the other, on one core). Each its own job in its
    own folder."""
    env = shell_env()  # read here, not in the jobs' threads while a test may be changing os.environ
    configs = selected(request, "test_a_shipped_config_prints_no_future_warning_and_no_line_twice", "config")
    jobs = {config: partial(_fit_a_few_steps, config, tmp_path_factory.mktemp(config), env) for config in configs}
    with side_by_side(jobs) as runs:
        yield runs


@pytest.mark.dist
@pytest.mark.parametrize("config", SHIPPED)
def test_a_shipped_config_prints_no_future_warning_and_no_line_twice(config, shipped_runs):
    """A few steps of a shipped config as a user runs it (2 ranks, progress bar on, its own sharding: row-wise tables
    where it has them): no FutureWarning (torch's for TorchRec's row-wise collectives included), and no line twice
    but the rules of Lightning's own banners (and an epoch bar's redraw)."""
    import re

    out = shipped_runs[config].result()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FutureWarning" not in out.stdout + out.stderr, out.stderr[-3000:]
    # tqdm draws a bar's last state again when it closes (in place on a terminal): an epoch bar's redraw is not a line.
    lines = [
        line.strip()
        for line in re.split(r"[\r\n]", out.stdout + out.stderr)
        if line.strip("- \t") and not line.startswith("Epoch ")
    ]
    twice = {line for line in lines if lines.count(line) > 1}
    assert not twice, (twice, out.stdout[-3000:] + out.stderr[-3000:])
