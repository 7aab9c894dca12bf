"""DataLoader workers start wherever PyTorch's would (issue 44): from the package's fork server where it can serve them,
else as PyTorch would (:func:`lightning_rec._forkserver.worker_start_method` says when, and why). A user's dataset
class defined in a notebook cell or in a script read from standard input trains with workers; a script without
``if __name__ == "__main__":`` too; and ranks forked from a kernel that started a fork server (the package's or
multiprocessing's own) still start their workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_rec import _forkserver
from lightning_rec.testing import shell_env
from tests.helpers.side_by_side import selected, side_by_side

# A user's own dataset and DataModule, as written in a notebook cell or a script: the class lives in __main__.
_USER_DATA = """
import torch
from lightning_rec.data import RecDataModule, RecDataset, SparseFeature


class Clicks(RecDataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        users, items = torch.randint(0, 50, (n,), generator=g), torch.randint(0, 80, (n,), generator=g)
        super().__init__(torch.rand(n, 1, generator=g), ((users + items) % 3 == 0).float(), {"user": users, "item": items})


class Data(RecDataModule):
    sparse_features = [SparseFeature("user", 50), SparseFeature("item", 80)]
    num_dense_features = 1

    def split(self, name):
        if name == "train":
            return Clicks(1024, 0)
        # the package's own class: nothing of __main__ in it, so its workers would come from the fork server
        g = torch.Generator().manual_seed(1)
        users, items = torch.randint(0, 50, (256,), generator=g), torch.randint(0, 80, (256,), generator=g)
        return RecDataset(torch.rand(256, 1, generator=g), (users % 2).float(), {"user": users, "item": items})
"""

_MODEL = """
import lightning as L
import torch.nn.functional as F
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
import lightning_rec


class Model(lightning_rec.RecLightningModule):
    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=n, feature_names=[f])
                  for f, n in [("user", 50), ("item", 80)]]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.over = torch.nn.Linear(17, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        return self.over(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.binary_cross_entropy_with_logits(self(batch), batch.labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def fit(workers, devices):
    L.seed_everything(0)
    model = Model()
    trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=devices, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=Data(batch_size=64, num_workers=workers))
    return model.state_dict(), float(trainer.callback_metrics["val_loss"])


def plain(t):  # a 1-rank run's tables stay sharded (one shard each); a notebook's come back whole
    return torch.cat([s.tensor.flatten() for s in t.local_shards()]) if hasattr(t, "local_shards") else t


def same(a, b):
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(plain(a[0][k]), plain(b[0][k])) for k in a[0])
"""


def _run(args: list[str], cwd, script: str | None = None, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, *args],
        input=script,
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env or shell_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


_FORKED = _USER_DATA + textwrap.dedent("""
    import os
    from multiprocessing import forkserver
    from lightning_rec.data import batch_loader

    forkserver.ensure_running()  # the parent's, as a kernel's library might start it
    pid = os.fork()
    if pid == 0:
        dataset = Data(batch_size=64).split("val")  # the package's class: the fork server's, if it could
        rows = [b.labels.tolist() for b in batch_loader(dataset, 64, num_workers=2)]
        os._exit(0 if rows == [b.labels.tolist() for b in batch_loader(dataset, 64)] else 3)
    print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
# The user scripts the tests below run, by test: (the script's file name, "-" for standard input; its text).
_SCRIPTS = {
    "test_a_dataset_class_in_a_script_read_from_standard_input_trains_with_workers": (
        "-",
        _USER_DATA + _MODEL + "\nprint('same', same(fit(2, 1), fit(0, 1)))\n",
    ),
    "test_a_script_without_a_main_guard_starts_its_workers": (
        "unguarded.py",
        _USER_DATA
        + textwrap.dedent("""
            from lightning_rec.data import batch_loader
            data = Data(batch_size=64)
            rows = [b.labels.tolist() for b in batch_loader(data.split("train"), 64, num_workers=2)]
            print("same", rows == [b.labels.tolist() for b in batch_loader(data.split("train"), 64)])
            """),
    ),
    "test_a_process_forked_after_multiprocessings_own_fork_server_started_starts_its_workers": (
        "forked.py",
        f"if __name__ == '__main__':\n{textwrap.indent(_FORKED, '    ')}",
    ),
}


def _run_script(name: str, text: str, cwd: Path, env: dict[str, str]) -> str:
    """``python <name>`` (``python -`` with the text on standard input) in ``cwd``: its output."""
    if name == "-":
        return _run(["-"], cwd, text, env)
    (cwd / name).write_text(text)
    return _run([name], cwd, env=env)


@pytest.fixture(scope="module")
def scripts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The scripts of :data:`_SCRIPTS` whose tests this session runs, each in a folder of its own, side by side
    (tests/helpers/side_by_side.py: each is one process, mostly importing, on one core)."""
    env = shell_env()  # read here, not in the jobs' threads while a test may be changing os.environ
    jobs = {
        test: partial(_run_script, name, text, tmp_path_factory.mktemp("script"), env)
        for test, (name, text) in _SCRIPTS.items()
        if selected(request, test)
    }
    with side_by_side(jobs) as runs:
        yield runs


@pytest.fixture
def script(request: pytest.FixtureRequest, scripts: dict[str, Future]) -> Future:
    """This test's script (:data:`_SCRIPTS`): ``.result()`` waits for its output (and fails the test unless it
    exited 0)."""
    return scripts[request.node.originalname]


def test_what_a_fork_server_child_could_not_get_starts_as_pytorch_would(monkeypatch):
    """Each reason for not using the fork server, on its own: an argument that cannot be pickled, and a class or a
    function defined in a ``__main__`` without a file (as a notebook's or ``python -``'s)."""
    assert _forkserver.worker_start_method(print, (lambda batch: batch,), {}) is None

    main = types.ModuleType("__main__")  # an interactive session's: no __file__, no __spec__
    exec("class Clicks:\n    pass\n\ndef collate(batch):\n    return batch\n", vars(main))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert _forkserver.worker_start_method(print, (main.Clicks(),), {}) is None
    assert _forkserver.worker_start_method(print, ([1, 2], main.collate), {}) is None
    assert _forkserver.worker_start_method(print, (main.Clicks,), {}) is None


@pytest.mark.dist
def test_package_datasets_still_come_from_the_fork_server(monkeypatch):
    """What the fork server can serve, it does: the package's datasets and functions, from any ``__main__``."""
    from lightning_rec.data import RecDataset

    dataset = RecDataset(torch.zeros(4, 1), torch.zeros(4), {"user": torch.arange(4)})
    assert _forkserver.worker_start_method(print, (dataset, torch.cat), {}) == "forkserver"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert _forkserver.worker_start_method(print, (dataset, torch.cat), {}) == "forkserver"


@pytest.mark.dist
def test_a_dataset_class_in_a_script_read_from_standard_input_trains_with_workers(script):
    """``python - < train.py`` with the dataset class in the script: two workers train the same weights as none."""
    assert script.result().split()[-2:] == ["same", "True"]


@pytest.mark.dist
def test_a_script_without_a_main_guard_starts_its_workers(script):
    """On Linux PyTorch's workers start from a script without ``if __name__ == "__main__":`` (they are forked); a
    child of the fork server would run the script again and start workers from a worker."""
    assert script.result().split()[-2:] == ["same", "True"]


@pytest.mark.dist
def test_a_process_forked_after_multiprocessings_own_fork_server_started_starts_its_workers(script):
    """A fork server started by multiprocessing itself (not through this package) in a parent: a forked child cannot
    reach it (``ChildProcessError``), so its loaders' workers start as PyTorch's would."""
    assert script.result().split()[-3:] == ["child", "exit", "0"]


@pytest.mark.dist
def test_a_dataset_class_in_a_notebook_cell_trains_on_two_ranks_after_the_kernel_started_the_fork_server(tmp_path):
    """In a Jupyter kernel: a package loader with workers starts the fork server in the kernel; then the notebook
    launcher forks 2 ranks, whose workers load a dataset class defined in a cell (training) and the package's own
    (validation; the kernel's fork server cannot serve a rank). Two workers train the weights and validation loss
    that no workers do, bit for bit."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_starts_server = textwrap.dedent("""
        import os
        from lightning_rec import _forkserver
        from lightning_rec.data import batch_loader

        warm = batch_loader(Data(batch_size=64).split("val"), 64, num_workers=2)
        print("kernel's server", len(list(warm)), _forkserver._started == [os.getpid()])
        """)
    train = "with_workers, without = fit(2, 2), fit(0, 2)\nprint('same', same(with_workers, without))"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(c) for c in (_USER_DATA, _MODEL, kernel_starts_server, train)]
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    shown = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "kernel's server 4 True" in shown, shown[-3000:]
    assert "same True" in shown, shown[-3000:]
