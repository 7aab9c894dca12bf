"""Config mistakes print one line and exit 2 (issue 36): what is wrong, where, what is accepted or a "did you
mean", as ``lightning-rec export`` does; not jsonargparse's 40-80 lines of usage, Union subtypes and namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_rec._cli import run
from tests.helpers.data import REPO

CONFIG = REPO / "examples" / "configs" / "movielens_deepfm.yaml"


def _config(tmp_path: Path, edit) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    edit(config)
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _rename(section: str, old: str, new: str):
    def edit(config):
        block = config[section]["init_args"] if "init_args" in config[section] else config[section]
        block[new] = block.pop(old)

    return edit


@pytest.mark.parametrize(
    "edit, args, expected",
    [
        (
            _rename("model", "embedding_dim", "embeding_dim"),
            [],
            "model (lightning_rec.models.DeepFMModule): option 'embeding_dim' is not "
            "accepted; did you mean 'embedding_dim'? (it takes sparse_features, num_dense_features, embedding_dim,",
        ),
        (
            _rename("trainer", "max_epochs", "max_epoch"),
            [],
            "Subcommand 'fit' does not accept option 'trainer.max_epoch'; did you mean 'trainer.max_epochs'?",
        ),
        (
            None,
            ["--model.init_args.dense_optimizer=adamw"],
            "model.dense_optimizer (lightning_rec.models.DeepFMModule): 'adamw' is not one of 'adam', 'adagrad', "
            "'sgd'; did you mean 'adam'?",
        ),
        (
            None,
            ["--data.init_args.batch_size=-3"],  # refused by the DataModule's own __init__
            "MovieLensDataModule: batch_size must be >= 1, got -3.",
        ),
    ],
    ids=["model-argument-typo", "trainer-key-typo", "value-not-allowed", "refused-by-init"],
)
def test_a_config_mistake_is_one_line_and_exit_2(tmp_path, capsys, edit, args, expected):
    config = _config(tmp_path, edit) if edit else CONFIG
    line = _error(capsys, ["fit", "--config", str(config), *args])
    prog, _, message = line.partition(": error: ")  # prog: `lightning-rec fit` (here, in-process, `__main__.py fit`)
    assert prog.endswith(" fit") and message.startswith(expected), line


def test_missing_data_files_are_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """The shipped Criteo config without its files: named in one line by the main process (no rank, no sharding)."""
    monkeypatch.chdir(tmp_path)
    line = _error(capsys, ["fit", "--config", "criteo_dlrm", "--trainer.devices=2"])
    assert "CriteoDataModule: train input 'data/criteo/train.txt' does not exist" in line, line
    assert not (tmp_path / "lightning_logs").exists()
