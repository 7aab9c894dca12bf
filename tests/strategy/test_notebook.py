"""Training from a notebook (issue 36): ``examples/quickstart.ipynb``, executed in a real Jupyter kernel, trains on 2
CPU processes (forked from the kernel, as Lightning's ``ddp_notebook`` does; the script launcher is refused in an
interactive session), and the weights back in the notebook's ``model``, tables included, equal those of the same
code run as a script (2 ranks, the script launcher) bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_rec.checkpoint import export
from lightning_rec.testing import shell_env
from tests.helpers.data import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


@pytest.mark.dist
def test_the_quickstart_notebook_trains_on_two_processes_and_keeps_the_weights(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    notebook.cells.append(
        nbformat.v4.new_code_cell(f"torch.save(model.state_dict(), {str(tmp_path / 'notebook.pt')!r})")
    )
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    shown = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "final train_loss=" in shown, shown[-2000:]
    assert "FutureWarning" not in shown, shown[-2000:]  # torch's for TorchRec's row-wise collectives (issue 44)
    trained = torch.load(tmp_path / "notebook.pt")

    # The same cells as a script: Lightning's script launcher starts rank 1 by running it again.
    script = "\n\n".join([*code, 'trainer.save_checkpoint("script.ckpt")'])
    (tmp_path / "script.py").write_text(script)
    out = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, env=shell_env(), timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    export(tmp_path / "script.ckpt", tmp_path / "script.pt")
    reference = torch.load(tmp_path / "script.pt")
    assert set(reference) <= set(trained), sorted(set(reference) - set(trained))
    for name, tensor in reference.items():
        assert torch.equal(trained[name], tensor), name
    assert trained["ebc.embedding_bags.t_user.weight"].device.type == "cpu"
