"""Score a file (issue 44, item 7): ``lightning-rec predict --config ... --data.predict_files <files> --output
scores.parquet`` writes the schema's key columns beside each row's score (and its label, where the files have one),
one row per input row in the input's order, dropped rows counted and logged, on 1 and 2 ranks.

The scores written are compared, joined back by key, with the trained model's outputs computed here independently:
the checkpoint loaded into the plain module on this process, the rows read from the file with pyarrow and turned into
the model's input by hand (hashed user ids, the training file's item vocabulary, the training file's price mean and
std), not through the DataModule or the writer.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from lightning_rec.callbacks import ScoreWriter
from lightning_rec.config import SparseFeature
from lightning_rec.data import DataError, RecDataModule, RecDataset, TabularDataModule
from lightning_rec.data.schema import Schema, hash_ids

USERS = 100  # hash rows of user_id
SCHEMA: dict[str, Any] = {
    "labels": [{"column": "clicked"}],
    "dense": [{"column": "price", "transform": "standardize"}],
    "sparse": [
        {"column": "user_id", "ids": "hash", "num_embeddings": USERS},
        {"column": "item_id", "ids": "vocab"},
    ],
    "keys": ["user_id", "item_id"],
}


def _clicks(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 40, n)
    items = rng.integers(0, 25, n)
    price = rng.gamma(2.0, 3.0, n)
    logit = 0.8 * np.sin(users) + 0.6 * np.cos(items) + 0.1 * price - 0.6
    clicked = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float64)
    return pa.table(
        {
            "user_id": pa.array(users, pa.int64()),
            "item_id": pa.array([f"i{x}" for x in items]),
            "price": pa.array(price),
            "clicked": pa.array(clicked),
        }
    )


def _pairs() -> pa.Table:
    """(user, item) pairs to score: an odd number of rows, each pair once but for 12 whole rows repeated at the end,
    an item never seen in training (out of vocabulary), and one row with a null user id (dropped: bad_rows drop)."""
    users, items = np.meshgrid(np.arange(45), np.arange(6))  # users 40-44 never trained on either
    users, items = users.reshape(-1)[:245], items.reshape(-1)[:245]
    item_ids = [f"i{x}" if x < 5 else "i999" for x in items]  # 'i999': out of vocabulary
    rng = np.random.default_rng(7)
    table = pa.table(
        {
            "user_id": pa.array(users.tolist(), pa.int64()),
            "item_id": pa.array(item_ids),
            "price": pa.array(rng.gamma(2.0, 3.0, len(users))),
            "clicked": pa.array((rng.random(len(users)) < 0.3).astype(np.float64)),
        }
    )
    table = pa.concat_tables([table, table.slice(30, 12)])  # 12 duplicate rows
    bad = table.slice(100, 1).set_column(0, "user_id", pa.array([None], pa.int64()))
    return pa.concat_tables([table.slice(0, 200), bad, table.slice(200)])  # 258 rows, 1 bad: 257 scored


def _config(tmp: Path, **data: Any) -> dict[str, Any]:
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": "recshard",
            "max_steps": 30,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp / "fit"),
        },
        "model": {"class_path": "lightning_rec.models.DLRMModule", "init_args": {"embedding_dim": 16}},
        "data": {
            "class_path": "lightning_rec.data.TabularDataModule",
            "init_args": {
                "schema": SCHEMA,
                "train": str(tmp / "train.parquet"),
                "val": str(tmp / "val.parquet"),
                "batch_size": 32,
                "bad_rows": "drop",
                **data,
            },
        },
    }


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    from lightning_rec.testing import shell_env

    script = str(Path(sys.executable).with_name("lightning-rec"))
    out = subprocess.run([script, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=shell_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One training run (1 rank), then ``predict --output`` of the pairs on 1 rank (CSV without labels, to Parquet)
    and on 2 ranks (Parquet with labels, to CSV)."""
    tmp = tmp_path_factory.mktemp("scoring")
    pq.write_table(_clicks(700, 0), tmp / "train.parquet", row_group_size=256)
    pq.write_table(_clicks(120, 1), tmp / "val.parquet")
    pairs = _pairs()
    pcsv.write_csv(pairs.drop_columns(["clicked"]), tmp / "pairs.csv")
    pq.write_table(pairs, tmp / "pairs.parquet", row_group_size=100)
    (tmp / "fit.yaml").write_text(yaml.safe_dump(_config(tmp)))
    _cli(["fit", "--config", str(tmp / "fit.yaml")], tmp)
    [ckpt] = sorted((tmp / "fit").rglob("*.ckpt"))
    runs = {}
    for devices, pairs_file, output in ((1, "pairs.csv", "scores.parquet"), (2, "pairs.parquet", "scores.csv")):
        args = ["predict", "--config", str(tmp / "fit.yaml"), f"--ckpt_path={ckpt}", f"--trainer.devices={devices}"]
        args += [
            f"--trainer.default_root_dir={tmp / f'predict{devices}'}",
            "--data.predict_files",
            str(tmp / pairs_file),
        ]
        out = _cli([*args, "--output", str(tmp / output)], tmp)
        runs[devices] = (tmp / output, out.stdout + out.stderr)
    return {"tmp": tmp, "ckpt": ckpt, "pairs": pairs, "runs": runs}


def _independent_scores(ckpt: Path, tmp: Path, rows: pa.Table) -> np.ndarray:
    """The trained model's probability of each of ``rows``, without the DataModule, the strategy or the writer."""
    from torchrec import KeyedJaggedTensor

    from lightning_rec.checkpoint import load_module
    from lightning_rec.models import DLRMModule

    train = pq.read_table(tmp / "train.parquet")
    items, counts = np.unique(np.asarray(train["item_id"].to_pylist()), return_counts=True)
    vocabulary = [v for _, v in sorted(zip(-counts, items.tolist()))]  # by count, ties by value; row i + 1
    item_rows = np.array([vocabulary.index(v) + 1 if v in vocabulary else 0 for v in rows["item_id"].to_pylist()])
    price = np.asarray(train["price"])
    dense = (np.asarray(rows["price"]) - price.mean()) / price.std()
    users = hash_ids(np.asarray(rows["user_id"]), USERS)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "item_id"],
        values=torch.from_numpy(np.concatenate([users, item_rows])).long(),
        lengths=torch.ones(2 * rows.num_rows, dtype=torch.int32),
    )
    model = load_module(DLRMModule, ckpt).eval()
    with torch.no_grad():
        logits = model.model(torch.from_numpy(dense).float()[:, None], kjt)
    return torch.sigmoid(logits.squeeze(-1)).numpy()


def _read(path: Path) -> pa.Table:
    return pq.read_table(path) if path.suffix == ".parquet" else pcsv.read_csv(path)


@pytest.mark.dist
@pytest.mark.parametrize("devices", [1, 2])
def test_scores_joined_back_by_key_equal_the_model_s_outputs(scored: dict[str, Any], devices: int) -> None:
    output, log = scored["runs"][devices]
    pairs: pa.Table = scored["pairs"]
    good = pairs.filter(pc.is_valid(pairs["user_id"]))
    written = _read(output)
    labeled = devices == 2  # the Parquet pairs have their label column, the CSV ones none
    assert written.column_names == ["user_id", "item_id", "probability"] + (["label"] if labeled else [])
    # one row per input row, in the input's order: the keys as the file holds them, the dropped row left out
    assert written.num_rows == good.num_rows == 257
    assert written["user_id"].to_pylist() == good["user_id"].to_pylist()
    assert written["item_id"].to_pylist() == good["item_id"].to_pylist()
    # joined back by key (duplicate rows are whole duplicates: one score per key)
    expected = _independent_scores(scored["ckpt"], scored["tmp"], good)
    by_key: dict[tuple, float] = {}
    for key, p in zip(zip(good["user_id"].to_pylist(), good["item_id"].to_pylist()), expected.tolist()):
        assert by_key.setdefault(key, p) == p
    assert len(by_key) == 245
    got = {
        k: p
        for k, p in zip(
            zip(written["user_id"].to_pylist(), written["item_id"].to_pylist()), written["probability"].to_pylist()
        )
    }
    assert got.keys() == by_key.keys()
    worst = max(abs(got[k] - by_key[k]) for k in by_key)
    assert worst <= 1e-6, worst
    assert len({round(p, 4) for p in got.values()}) > 100, "the scores tell the pairs apart"
    if labeled:
        assert written["label"].to_pylist() == good["clicked"].to_pylist()
    # the dropped row is counted in the log (rank 0's line)
    assert "TabularDataModule: predict: 258 rows read, 1 dropped (bad_rows: drop); 257 rows" in log
    assert "ScoreWriter: wrote 257 rows" in log
    assert not output.with_name(output.name + ".parts").exists(), "the ranks' parts are removed"


# ---- fast: the DataModule's side, the writer's and the CLI's refusals ------------------------------------------------


def _dm(tmp: Path, **kw: Any) -> TabularDataModule:
    pq.write_table(_clicks(200, 0), tmp / "train.parquet")
    return TabularDataModule(schema=SCHEMA, train=str(tmp / "train.parquet"), batch_size=16, **kw)


def test_predict_files_keep_their_keys_in_order_and_drop_bad_rows_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pairs = _pairs()
    pcsv.write_csv(pairs.drop_columns(["clicked"]).slice(0, 150), tmp_path / "a.csv")
    pq.write_table(pairs.drop_columns(["clicked"]).slice(150), tmp_path / "b.parquet")
    dm = _dm(tmp_path, predict_files=[str(tmp_path / "a.csv"), str(tmp_path / "b.parquet")], bad_rows="drop")
    with caplog.at_level(logging.INFO):
        dm.check()
    keys = dm.predict_keys()
    good = pairs.filter(pc.is_valid(pairs["user_id"]))
    assert keys.column_names == ["user_id", "item_id"] and keys.num_rows == 257
    assert keys["user_id"].to_pylist() == good["user_id"].to_pylist()
    assert keys["item_id"].to_pylist() == good["item_id"].to_pylist()
    assert dm.predict_labeled is False
    dm.setup("predict")
    rows = dm.split("predict")
    assert len(rows) == 257 and float(rows.labels.abs().sum()) == 0.0  # no labels: 0, not NaN (checked inputs)
    assert any(
        "predict: 258 rows read, 1 dropped (bad_rows: drop); 257 rows; no label column" in r for r in caplog.messages
    )


def test_without_keys_the_key_is_the_row_s_place_in_the_files(tmp_path: Path) -> None:
    pairs = _pairs()
    pq.write_table(pairs, tmp_path / "p.parquet")
    schema = {k: v for k, v in SCHEMA.items() if k != "keys"}
    pq.write_table(_clicks(200, 0), tmp_path / "train.parquet")
    dm = TabularDataModule(
        schema=schema, train=str(tmp_path / "train.parquet"), predict_files=str(tmp_path / "p.parquet"), bad_rows="drop"
    )
    assert dm.predict_keys()["row"].to_pylist() == [i for i in range(258) if i != 200]
    assert dm.predict_labeled is True


def test_files_to_score_with_and_without_labels_are_refused_naming_both(tmp_path: Path) -> None:
    pairs = _pairs()
    pq.write_table(pairs, tmp_path / "a.parquet")
    pq.write_table(pairs.drop_columns(["clicked"]), tmp_path / "b.parquet")
    dm = _dm(tmp_path, predict_files=[str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], bad_rows="drop")
    with pytest.raises(DataError) as err:
        dm.check()
    assert str(err.value).startswith(
        f"{tmp_path / 'b.parquet'}: no label column 'clicked', but {tmp_path / 'a.parquet'}"
    )


def test_a_key_column_missing_from_a_file_to_score_is_named(tmp_path: Path) -> None:
    pcsv.write_csv(
        _pairs().drop_columns(["clicked"]).slice(0, 10).rename_columns(["user", "item_id", "price"]), tmp_path / "p.csv"
    )
    dm = _dm(tmp_path, predict_files=str(tmp_path / "p.csv"))
    with pytest.raises(DataError, match=r"p\.csv: no column 'user_id'"):
        dm.check()


@pytest.mark.parametrize("keys", ["user_id", ["user_id", "user_id"], [""]])
def test_schema_keys_are_a_list_of_distinct_column_names(keys: Any) -> None:
    with pytest.raises(ValueError, match="Schema: keys"):
        Schema(**{**SCHEMA, "keys": keys})


def test_the_writer_refuses_a_file_type_it_does_not_write() -> None:
    with pytest.raises(ValueError, match=r"ScoreWriter: output 'scores\.json': a \.parquet"):
        ScoreWriter("scores.json")


def test_predict_output_is_checked_before_any_rank_starts_and_only_predict_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lightning.pytorch as pl

    from lightning_rec._cli import run

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Trainer ran: --output was not checked first")

    monkeypatch.setattr(pl.Trainer, "predict", started)
    monkeypatch.setattr(pl.Trainer, "fit", started)
    pq.write_table(_clicks(200, 0), tmp_path / "train.parquet")
    pq.write_table(_clicks(50, 1), tmp_path / "val.parquet")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_config(tmp_path)))
    for args, said in (
        (["predict", "--output", "s.json"], "predict: error: ScoreWriter: output 's.json': a .parquet"),
        (["predict", "--output", "s.csv", "--data.stream=true"], "predict: error: TabularDataModule(stream=True) does"),
        (["fit", "--output", "s.parquet"], "error: Unrecognized arguments: --output s.parquet"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run([args[0], "--config", str(tmp_path / "c.yaml"), *args[1:]])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert said.lower() in err.lower(), err

    # accepted: the writer is among the callbacks, and the predictions are not also kept in memory
    calls = []

    def predict(  # Trainer.predict's signature: the CLI takes the subcommand's arguments from it
        trainer: pl.Trainer,
        model: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
        weights_only: bool | None = None,
    ) -> None:
        calls.append((trainer, {"return_predictions": return_predictions}))

    monkeypatch.setattr(pl.Trainer, "predict", predict)
    run(["predict", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "s.parquet")])
    [(trainer, kwargs)] = calls
    [writer] = [c for c in trainer.callbacks if isinstance(c, ScoreWriter)]
    assert writer.output == tmp_path / "s.parquet" and kwargs["return_predictions"] is False


class _Rows(RecDataModule):
    """Any DataModule (no ``predict_keys``): 11 rows, ids 100..110."""

    sparse_features = [SparseFeature("user", 200)]
    num_dense_features = 1

    def split(self, name: str) -> RecDataset:
        return RecDataset(torch.arange(11.0)[:, None], torch.ones(11), {"user": torch.arange(100, 111)})


class _Echo(pl.LightningModule):
    """predict_step: an int64 per row, a float, and a (B, 2) output."""

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids = batch.sparse_features["user"].values()
        x = batch.dense_features[:, 0]
        return {"id": ids + 2**40, "score": x / 4, "pair": torch.stack([x, -x], 1)}


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_any_datamodule_s_rows_are_written_in_order_with_their_own_types(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"scores{suffix}"
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[ScoreWriter(str(out))]
    )
    dm = _Rows(batch_size=4)
    trainer.predict(_Echo(), datamodule=dm, return_predictions=False)
    table = _read(out)
    assert table.column_names == ["row", "id", "score", "pair"]
    assert table["row"].to_pylist() == list(range(11))
    assert table["id"].to_pylist() == [2**40 + 100 + i for i in range(11)]  # int64 kept, not rounded to float
    assert table["score"].to_pylist() == [i / 4 for i in range(11)]
    pairs = table["pair"].to_pylist()
    assert pairs == (
        [[float(i), -float(i)] for i in range(11)]
        if suffix == ".parquet"
        else [f"[{float(i)!r}, {-float(i)!r}]" for i in range(11)]
    )


@pytest.mark.dist
def test_a_1m_row_file_scores_on_2_ranks_at_no_less_than_training_s_rows_per_s() -> None:
    """benchmarks/scoring_throughput.py (docs/benchmarks/data.md): fit one epoch on a 1M-row Parquet log and score the
    same file with ``predict --output``, 2 ranks each, in one run; scoring, the file written included, is not slower
    per row than training."""
    import json

    from lightning_rec.testing import shell_env

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scoring_throughput.py"
    cmd = [sys.executable, str(script), "--rows", "1000000", "--batch-size", "8192"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=shell_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["rows_written"] == 1_000_000
    assert record["score_rows_per_s"] >= record["train_rows_per_s"], record


def test_streamed_files_to_score_without_labels_are_refused_by_check(tmp_path: Path) -> None:
    pcsv.write_csv(_pairs().drop_columns(["clicked"]).slice(0, 20), tmp_path / "p.csv")
    dm = _dm(tmp_path, predict_files=str(tmp_path / "p.csv"), stream=True)
    with pytest.raises(DataError, match=r"stream=True\): the files to score .* have no label column 'clicked'"):
        dm.check()
    pcsv.write_csv(_pairs().slice(0, 20), tmp_path / "q.csv")  # with labels: streamed and scored
    dm = _dm(tmp_path, predict_files=str(tmp_path / "q.csv"), stream=True)
    dm.check()
    assert sum(len(b.labels) for b in dm.split("predict")) == 20
