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


# ---- your own files (issue 44): every file mistake is one line and exit 2, before any rank starts -------------------
def _own_data(tmp_path: Path, **init_args) -> Path:
    """A TabularDataModule + DLRM config on 2 ranks; ``init_args`` replace the DataModule's."""
    (tmp_path / "train.csv").write_text("clicked,bought,user_id\n" + "".join(f"{i % 2},0,{i}\n" for i in range(8)))
    (tmp_path / "val.csv").write_text("clicked,bought,user_id\n1,0,3\n0,1,FR\n")
    schema = {"labels": [{"column": "clicked"}], "sparse": [{"column": "user_id", "ids": "hash", "num_embeddings": 9}]}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "recshard", "logger": False},
        "model": {"class_path": "lightning_rec.models.DLRMModule"},
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {"schema": schema, "train": [str(tmp_path / "train.csv")], **init_args},
        },
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


RAW = {"labels": [{"column": "clicked"}], "sparse": [{"column": "user_id", "ids": "raw", "num_embeddings": 9}]}
TWO_LABELS = {
    "labels": [{"column": "clicked"}, {"column": "bought"}],
    "sparse": [{"column": "user_id", "ids": "hash", "num_embeddings": 9}],
}


@pytest.mark.parametrize(
    "init_args, expected",
    [
        ({"val": ["{tmp}/nope.csv"]}, "TabularDataModule: val: '{tmp}/nope.csv' does not exist."),
        ({"val": ["{tmp}/*.parquet"]}, "TabularDataModule: val: '{tmp}/*.parquet' matches no file."),
        (
            {"val": ["{tmp}/missing/*.csv"]},
            "TabularDataModule: val: '{tmp}/missing/*.csv' matches no file: the folder '{tmp}/missing' does not exist.",
        ),
        (
            {"val": ["https://example.com/clicks/day-1.parquet"]},
            "TabularDataModule: val: 'https://example.com/clicks/day-1.parquet': https:// URLs are not read; a path, a "
            "glob, a directory, a file:// URL or object storage (s3://, gs://, gcs://, az://) is.",
        ),
        ({"val": ["file://{tmp}/nope.csv"]}, "TabularDataModule: val: 'file://{tmp}/nope.csv' does not exist."),
        (
            {"val": ["{tmp}/val.csv"], "schema": RAW},
            "{tmp}/val.csv, line 3: column 'user_id': text in an integer id column (ids: raw reads each id as its row; "
            "for text ids declare ids: hash or vocab) (value 'FR'). HINT: fix the data, or set `bad_rows: drop` to drop "
            "such rows (they are counted).",
        ),
        (
            {"schema": TWO_LABELS},
            "TabularDataModule has 2 label columns (schema.labels: clicked, bought), more labels than the model takes: "
            "DLRMModule takes 1 (one output head). HINT: keep one label column in the schema (one model per label), or "
            "use a model with one head per label.",
        ),
    ],
    ids=["missing-path", "empty-glob", "missing-folder", "https-url", "file-url", "text-in-raw-ids", "two-labels"],
)
def test_a_file_mistake_is_one_line_and_exit_2_before_any_rank_starts(
    tmp_path, capsys, monkeypatch, init_args, expected
):
    import lightning.pytorch as pl

    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("Trainer.fit ran: its ranks would start"))
    init_args = {k: [v.format(tmp=tmp_path) for v in x] if k == "val" else x for k, x in init_args.items()}
    line = _error(capsys, ["fit", "--config", str(_own_data(tmp_path, **init_args))])
    assert line.partition(": error: ")[2] == expected.format(tmp=tmp_path), line


def test_a_file_url_reads_the_file(tmp_path):
    from lightning_rec.data import TabularDataModule

    _own_data(tmp_path)
    schema = {"labels": [{"column": "clicked"}], "sparse": [{"column": "user_id", "ids": "hash", "num_embeddings": 9}]}
    dm = TabularDataModule(schema=schema, train=[f"file://{tmp_path}/train.csv"])
    dm.check()
    assert dm.row_counts["train"]["rows"] == 8
