"""What a user sees on the console (issue 36): every log line once."""

from __future__ import annotations

import subprocess
import sys

from lightning_rec.testing import shell_env

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
