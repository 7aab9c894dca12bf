"""Raw ids at serving (``lightning_rec.serving.requests``): an artifact exported from a checkpoint of a
``TabularDataModule`` run records each feature's id mapping (hash and its size, the vocabulary, raw), the dense
transforms with their statistics and the fill values; :class:`RequestEncoder` turns raw request rows into exactly the
tensors the DataModule made of the same rows (hashed ids, unseen ones too, vocabulary rows with out-of-vocabulary
values, raw ids, list features and their weights, standardised and ``log1p`` dense values, filled missing values),
for a shipped model (DLRM) and a weighted user model. The record's hash description is checked against the
DataModule's hashing; the C++ hash (``examples/serve_cpp/hash_ids.h``) is in ``test_serving_cpp.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection

from lightning_rec import RecLightningModule, RecShardStrategy
from lightning_rec.data import DataError, TabularDataModule
from lightning_rec.data.schema import hash_arrow
from lightning_rec.errors import ServingError
from lightning_rec.models import DLRMModule
from lightning_rec.models.dlrm import table_configs
from lightning_rec.serving import (
    InferenceSpec,
    RequestEncoder,
    encode_request,
    export_inference,
    inference_spec,
    load_inference,
    serving_inputs,
)
from lightning_rec.serving.requests import HASH, checked_record, datamodule_state, raw_inputs_record
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import in_this_process

SCHEMA: dict[str, Any] = {
    "labels": [{"column": "clicked"}],
    "dense": [
        {"column": "price", "transform": "log1p"},
        {"column": "age", "transform": "standardize"},  # mean and std learned from the training split
        {"column": "score"},
    ],
    "sparse": [
        {"column": "user_id", "ids": "hash", "num_embeddings": 97},
        {"column": "item", "ids": "vocab", "min_count": 2},
        {"column": "history", "ids": "vocab", "list": True, "table": "item"},
        {"column": "tags", "ids": "hash", "num_embeddings": 31, "list": True},
        {"column": "country", "ids": "raw", "num_embeddings": 8},
        {"column": "device", "ids": "hash", "num_embeddings": 13},
    ],
}
# The weighted model's: tags with their weights (DLRM's tables pool without weights).
WEIGHTED_SCHEMA = {
    **SCHEMA,
    "sparse": [{**c, "weights": "tag_w"} if c["column"] == "tags" else c for c in SCHEMA["sparse"]],
}
FILL = {"price": "mean", "age": 30.0}
_ITEMS = [f"item-{k}" for k in range(12)] + ["crème", "商品", "🙂"]
_DEVICES = ["ios", "android", "web", "42", "007", "-3", "tv ☂"]


def click_log(n: int, seed: int, unseen: bool) -> pa.Table:
    """A click log as a user has one: int64 user ids (negatives too), text items (unicode too), lists of items and
    of weighted tags (empty lists too), a raw country code, text devices (some integer-looking), prices and ages
    with missing values. ``unseen``: items and tags training never saw."""
    rng = np.random.default_rng(seed)
    items = _ITEMS + (["never-seen", "ünseen"] if unseen else [])
    tags = [f"t{k}" for k in range(9)] + (["new-tag"] if unseen else [])

    def some(pool: list[str], k: int) -> list[str]:
        return [pool[i] for i in rng.integers(0, len(pool), k)]

    def missing(values: np.ndarray, share: float) -> list[float | None]:
        return [None if rng.random() < share else float(v) for v in values]

    lengths = rng.integers(0, 4, n)
    item = some(items, n)
    item[:2] = ["solo-a", "solo-b"]  # seen once in training: under min_count, out of vocabulary
    return pa.table(
        {
            "clicked": rng.integers(0, 2, n),
            "user_id": rng.integers(-40, 400, n),
            "item": item,
            "history": [some(items, k) for k in rng.integers(0, 4, n)],
            "tags": [some(tags, k) for k in lengths],
            "tag_w": [rng.random(k).astype(np.float32).tolist() for k in lengths],
            "country": rng.integers(0, 8, n),
            "device": some(_DEVICES, n),
            "price": missing(rng.exponential(20.0, n), 0.15),
            "age": missing(rng.normal(35, 9, n), 0.15),
            "score": rng.normal(0, 1, n),
        }
    )


class WeightedModel(RecLightningModule):
    """A user's model whose collection pools with the batch's per-id weights (``is_weighted``), serving its own
    ``forward(dense, kjt)``."""

    def __init__(self, sparse_features: list, num_dense_features: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        tables = table_configs(sparse_features, 4)
        self.ebc = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("cpu"))
        self.top = nn.Linear(4 * len(sparse_features) + num_dense_features, 1)  # one pooled column a feature

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        return self.top(torch.cat([self.ebc(kjt).values(), dense], dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch.dense_features, batch.sparse_features)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def _fit_and_save(module: RecLightningModule, dm: TabularDataModule, path: Path) -> Path:
    trainer = L.Trainer(strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=3, **QUIET_TRAINER)
    trainer.fit(module, datamodule=dm)
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """DLRM and :class:`WeightedModel` trained 3 steps on a click log through ``TabularDataModule`` (train and
    validation files), their checkpoints exported as fp32 TorchScript artifacts."""
    work = tmp_path_factory.mktemp("raw_requests")
    pq.write_table(click_log(400, seed=0, unseen=False), work / "train.parquet")
    pq.write_table(click_log(48, seed=1, unseen=True), work / "val.parquet")

    def datamodule(schema: dict[str, Any]) -> TabularDataModule:
        return TabularDataModule(
            schema=schema, train=[str(work / "train.parquet")], val=[str(work / "val.parquet")], fill=FILL,
            batch_size=64,
        )  # fmt: skip

    dms = {"dlrm": datamodule(SCHEMA), "weighted": datamodule(WEIGHTED_SCHEMA)}
    dm = dms["dlrm"]
    with in_this_process(work):  # this fixture runs before conftest's per-test isolation
        dlrm = DLRMModule(
            dm.sparse_features, dm.num_dense_features, 8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]
        )
        _fit_and_save(dlrm, dm, work / "dlrm.ckpt")
        if dist.is_initialized():
            dist.destroy_process_group()
        weighted = dms["weighted"]
        _fit_and_save(WeightedModel(weighted.sparse_features, 3), weighted, work / "weighted.ckpt")
    specs = {
        name: export_inference(work / f"{name}.ckpt", work / f"{name}.pt", table_dtype="fp32")
        for name in ("dlrm", "weighted")
    }
    return SimpleNamespace(work=work, dm=dm, dms=dms, specs=specs, val=pq.read_table(work / "val.parquet"))


def _same(got: Any, want: Any) -> None:
    """Equal bit for bit, dtypes included."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want), (got, want)


@pytest.mark.dist
def test_the_artifact_records_each_features_mapping_transform_and_fill(trained):
    """What the DataModule learned and was told, in the artifact's spec (read back from the file): hash sizes,
    the shared vocabulary (learned with ``min_count``), raw sizes, list and weights, the standardisation's learned
    mean and std, the fill values (the training split's mean of ``price``, the constant of ``age``)."""
    dm = trained.dm
    spec = inference_spec(trained.work / "dlrm.pt")
    assert spec == trained.specs["dlrm"]
    record = spec.raw_inputs
    assert record is not None and record["version"] == 1 and record["hash"] == HASH
    sparse = {e["feature"]: e for e in record["sparse"]}
    assert list(sparse) == [c["column"] for c in SCHEMA["sparse"]]
    assert (sparse["user_id"]["ids"], sparse["user_id"]["num_embeddings"]) == ("hash", 97)
    assert sparse["tags"]["list"] and sparse["tags"]["weights"] is None and sparse["tags"]["num_embeddings"] == 31
    weighted = {e["feature"]: e for e in trained.specs["weighted"].raw_inputs["sparse"]}
    assert weighted["tags"]["weights"] == "tag_w"
    assert (sparse["country"]["ids"], sparse["country"]["num_embeddings"]) == ("raw", 8)
    vocab = dm.vocabularies["item"].values
    assert sorted(vocab) == sorted(_ITEMS), "min_count leaves the items seen once out of the vocabulary"
    assert sparse["item"]["vocabulary"] == sparse["history"]["vocabulary"] == "item"
    assert record["vocabularies"] == {"item": vocab}
    assert sparse["item"]["num_embeddings"] == len(vocab) + 1 and sparse["item"]["out_of_vocabulary_row"] == 0
    dense = {d["column"]: d for d in record["dense"]}
    assert (dense["age"]["mean"], dense["age"]["std"]) == dm.dense_stats["age"] and dense["age"]["fill"] == 30.0
    assert dense["price"]["transform"] == "log1p" and dense["price"]["fill"] == dm.fill_means["price"]
    assert dense["score"]["fill"] is None
    assert json.loads(json.dumps(record)) == record


def _request(table: pa.Table, kind: str) -> Any:
    """The validation rows as a server receives them: a pyarrow table, Python lists per column (``None`` where
    missing), or the same with every id as text (a JSON request): ``"42"`` is the id ``42``."""
    if kind == "arrow":
        return table
    rows = table.to_pydict()
    if kind == "text_ids":
        rows["user_id"] = [str(v) for v in rows["user_id"]]
        rows["country"] = [int(v) for v in rows["country"]]
    return rows


@pytest.mark.dist
@pytest.mark.parametrize("model", ["dlrm", "weighted"])
@pytest.mark.parametrize("kind", ["arrow", "lists", "text_ids"])
def test_a_raw_request_becomes_the_datamodules_batch_bit_for_bit(trained, model, kind):
    """The validation file's raw rows (unseen users and devices, integer-looking device text, out-of-vocabulary
    items, empty lists, new tags, missing prices and ages), sent as a request, become the DataModule's own
    validation batch: the ``KeyedJaggedTensor``'s values, lengths and weights and the dense features, equal bit for
    bit; and the artifact's arguments equal those ``serving_inputs`` builds from that batch."""
    dm, spec = trained.dms[model], trained.specs[model]
    val = trained.val
    n = val.num_rows
    want = dm.split("val")[torch.arange(n)]
    encoder = RequestEncoder(trained.work / f"{model}.pt")  # the spec read from the artifact's path
    got = encoder.batch(_request(val, kind))
    assert got.sparse_features.keys() == want.sparse_features.keys()
    _same(got.sparse_features.values(), want.sparse_features.values())
    _same(got.sparse_features.lengths(), want.sparse_features.lengths())
    _same(got.dense_features, want.dense_features)
    ids = want.sparse_features.to_dict()
    assert (ids["item"].values() == 0).any() and (ids["history"].lengths() == 0).any(), "OOV and empty lists"
    assert val.column("price").null_count and val.column("age").null_count, "missing values to fill"
    if model == "weighted":
        assert spec.weighted
        _same(got.sparse_features.weights(), want.sparse_features.weights())
    args = encoder(_request(val, kind))
    expected = serving_inputs(spec, want.sparse_features, want.dense_features)
    assert len(args) == len(expected) == (4 if spec.weighted else 3)
    for a, e in zip(args, expected):
        _same(a, e)
    artifact = load_inference(trained.work / f"{model}.pt")
    with torch.inference_mode():
        _same(artifact(*args), artifact(*expected))


@pytest.mark.dist
def test_any_subset_of_rows_in_any_order_encodes_as_those_rows(trained):
    """A request of a few rows, reordered, one row alone: each row's inputs do not depend on the others."""
    dm, val = trained.dm, trained.val
    for rows in ([7, 2, 30], [11]):
        want = dm.split("val")[torch.tensor(rows)]
        args = encode_request(trained.specs["dlrm"], val.take(pa.array(rows)))
        for a, e in zip(args, serving_inputs(trained.specs["dlrm"], want.sparse_features, want.dense_features)):
            _same(a, e)


@pytest.mark.dist
def test_a_column_with_a_fill_may_be_left_out_and_is_filled_as_in_training(trained):
    """Without ``price`` (filled with the training mean) and ``age`` (filled with 30.0): the dense values are the
    transforms of those fills, as the DataModule computes them for missing values."""
    val = trained.val.drop_columns(["price", "age"])
    dense = RequestEncoder(trained.specs["dlrm"]).batch(val).dense_features
    mean = trained.dm.fill_means["price"]
    age_mean, age_std = trained.dm.dense_stats["age"]
    assert torch.equal(dense[:, 0], torch.full((val.num_rows,), np.float32(np.log1p(mean))))
    assert torch.equal(dense[:, 1], torch.full((val.num_rows,), np.float32((30.0 - age_mean) / age_std)))


# ---- fast: the record alone ----------------------------------------------------------------------------------------

_STATE = {
    "schema": {
        "labels": [{"column": "y"}],
        "dense": [{"column": "p", "transform": "standardize", "mean": 2.0, "std": 4.0}],
        "sparse": [{"column": "u", "ids": "hash", "num_embeddings": 1000}, {"column": "c", "ids": "vocab"}],
    },
    "vocabularies": {"c": ["x", "y"]},
    "dense_stats": {},
    "fill_means": {},
    "fill": {},
}


def _spec(record: dict[str, Any] | None, features: tuple[str, ...] = ("u", "c")) -> InferenceSpec:
    return InferenceSpec(list(features), 1, False, "fp32", {}, "users.Model", raw_inputs=record)


def test_a_hand_written_request_maps_hash_vocab_and_transform():
    """Two rows: hashed ids are the DataModule hash's rows, vocabulary values their rows (0 out of vocabulary),
    the dense value standardised with the recorded mean and std."""
    dense, values, lengths = encode_request(
        _spec(raw_inputs_record(_STATE)), {"u": [5, -5], "c": ["y", "z"], "p": [6.0, 2.0]}
    )
    assert values.tolist() == [*hash_arrow(pa.array([5, -5]), 1000).tolist(), 2, 0]
    assert lengths.tolist() == [1, 1, 1, 1] and dense.tolist() == [[1.0], [0.0]]


def test_requests_the_artifact_cannot_read_are_refused_naming_the_column():
    encoder = RequestEncoder(_spec(raw_inputs_record(_STATE)))
    with pytest.raises(DataError, match=r"request: no column 'p' .* the artifact reads \['p', 'u', 'c'\]"):
        encoder({"u": [1], "c": ["x"]})
    with pytest.raises(DataError, match=r"request: column 'u': .*one type per column"):
        encoder({"u": [1, "a"], "c": ["x", "y"], "p": [1.0, 2.0]})
    with pytest.raises(DataError, match=r"request, 2 rows, row 1: column 'p': null, NaN or inf \(value None\)\.$"):
        encoder({"u": [1, 2], "c": ["x", "y"], "p": [1.0, None]})  # no fill recorded for p
    with pytest.raises(DataError, match=r"request: columns of different lengths"):
        encoder({"u": [1, 2], "c": ["x"], "p": [1.0, 2.0]})


def test_an_artifact_without_a_record_or_with_another_version_is_refused_by_name():
    with pytest.raises(ServingError, match=r"\(users.Model\) records no raw-input mapping.*TabularDataModule"):
        RequestEncoder(_spec(None))
    with pytest.raises(ServingError, match=r"record is version 2; this lightning_rec reads version 1"):
        RequestEncoder(_spec({**raw_inputs_record(_STATE), "version": 2}))


def test_a_tower_reads_only_its_own_features_columns():
    """An artifact that reads ``u`` alone (a two-tower model's query tower) needs no other column."""
    spec = InferenceSpec(["u"], 0, False, "fp32", {}, "users.Model", raw_inputs=raw_inputs_record(_STATE))
    values, lengths = encode_request(spec, {"u": [3]})
    assert values.tolist() == hash_arrow(pa.array([3]), 1000).tolist() and lengths.tolist() == [1]


def _recorded_hash(value: int | str, num_embeddings: int) -> int:
    """The row :data:`HASH` describes, computed from the record's text alone (its constants and steps)."""
    mask = 2**64 - 1
    ints, text = HASH["integers"], HASH["text"]
    constants = [int(c, 16) for c in re.findall(r"0x[0-9A-F]+", " ".join(ints["steps"]))]
    shifts = [int(s) for s in re.findall(r">> (\d+)", " ".join(ints["steps"]))]

    def splitmix(x: int) -> int:
        z = (x + constants[0]) & mask
        z = ((z ^ (z >> shifts[0])) * constants[1]) & mask
        z = ((z ^ (z >> shifts[1])) * constants[2]) & mask
        return z ^ (z >> shifts[2])

    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value) and -(2**63) <= int(value) < 2**64:
        value = int(value)  # text["integer_text"]
    if isinstance(value, int):
        return splitmix(value & mask) % num_embeddings
    z = int(text["offset_basis"], 16)
    for b in value.encode("utf-8"):
        if b:
            z = ((z ^ b) * int(text["prime"], 16)) & mask
    return z % num_embeddings


def test_the_recorded_hash_is_the_one_the_datamodule_hashes_with():
    """A reader of the record alone (a C++ or Java server) hashes every id to the row the DataModule's hashing
    gives: integers (negative, the int64 extremes), text (unicode, empty, a zero byte) and integer-looking text."""
    ints = [0, 1, -1, 42, -(2**63), 2**63 - 1, 123456789012345]
    texts = [
        "",
        "a",
        "user-42",
        "crème",
        "商品",
        "🙂",
        "a\x00b",
        "42",
        "-7",
        "007",
        "+4",
        "4.0",
        str(2**64),
        str(2**64 - 1),
    ]
    for n in (1, 97, 2**31 - 1):
        assert hash_arrow(pa.array(ints, pa.int64()), n).tolist() == [_recorded_hash(v, n) for v in ints]
        assert hash_arrow(pa.array(texts), n).tolist() == [_recorded_hash(v, n) for v in texts]


def test_export_records_the_checkpoints_datamodule_state_only_when_it_describes_the_network():
    """The DataModule state is found among a checkpoint's entries; a state whose features or dense width differ
    from the served network's is not recorded, with a warning naming the difference."""
    meta = {"epoch": 0, "TabularDataModule": _STATE, "lightning_rec": {"module_class": "x.Y"}}
    assert datamodule_state(meta) is _STATE and datamodule_state({"epoch": 0}) is None
    assert checked_record(_STATE, ["c", "u"], 1, False) == raw_inputs_record(_STATE)
    with pytest.warns(UserWarning, match=r"reads features \['x'\] the DataModule does not make"):
        assert checked_record(_STATE, ["u", "x"], 1, False) is None
    with pytest.warns(UserWarning, match=r"reads 4 dense features, the DataModule makes 1"):
        assert checked_record(_STATE, ["u"], 4, False) is None


@pytest.mark.dist
def test_the_cli_path_fit_export_then_encode_a_raw_request(tmp_path, capsys):
    """As a user does it: ``lightning-rec fit --config`` on a ``TabularDataModule`` (the checkpoint Lightning
    writes), ``lightning-rec export ... --format inference``, which says the mapping is recorded; then the raw
    validation rows, encoded from the artifact alone, are the arguments the DataModule's own batch gives."""
    import yaml

    from lightning_rec._cli import run

    pq.write_table(click_log(400, seed=2, unseen=False), tmp_path / "train.parquet")
    pq.write_table(click_log(30, seed=3, unseen=True), tmp_path / "val.parquet")
    data = {
        "schema": SCHEMA,
        "train": [str(tmp_path / "train.parquet")],
        "val": [str(tmp_path / "val.parquet")],
        "fill": FILL,
        "batch_size": 128,
    }
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "recshard", "max_epochs": 1},
        "model": {
            "class_path": "lightning_rec.models.DLRMModule",
            "init_args": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [8, 1]},
        },
        "data": {"class_path": "lightning_rec.data.TabularDataModule", "init_args": data},
    }
    (tmp_path / "clicks.yaml").write_text(yaml.safe_dump(config))
    run(["fit", "--config", str(tmp_path / "clicks.yaml"), f"--trainer.default_root_dir={tmp_path}"])
    (ckpt,) = (tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
    capsys.readouterr()
    run(["export", str(ckpt), str(tmp_path / "model.pt"), "--format", "inference", "--table-dtype", "fp32"])
    assert "raw ids: the id mappings, transforms and fills recorded" in capsys.readouterr().out
    dm = TabularDataModule(**data)
    dm.setup("fit")
    val = pq.read_table(tmp_path / "val.parquet")
    want = dm.split("val")[torch.arange(val.num_rows)]
    spec = inference_spec(tmp_path / "model.pt")
    for got, expected in zip(
        encode_request(tmp_path / "model.pt", val.to_pydict()),
        serving_inputs(spec, want.sparse_features, want.dense_features),
    ):
        _same(got, expected)
