"""Serving what is published (issue 47): :class:`~lightning_rec.serving.FreshModel` follows a publish directory, and
what a delta holds (:mod:`lightning_rec.serving.deltas`).

- ``artifact_rows`` gives, bit for bit, the bytes an export's table holds (fp32, fp16, int8, int4; a real ``.pt2``'s
  blob for int8);
- **exact**: a full package at step 2 plus the deltas of steps 4 and 6 (written here from the checkpoints: the rows
  that differ, the dense weights) serves what a full export at step 6 serves, bit for bit, on 1,000 probe requests,
  int8 tables (fp32 tables, and 2 training ranks, in tests/test_publish.py, whose publisher writes the deltas); at
  step 4 (no package compiled) the served tables and weights are the quantized module's;
- a request in flight during an update is answered by the old version; requests sent from threads while versions
  are applied are each answered by one version exactly, never a mix;
- a damaged (one byte flipped) or missing delta part, or a missing version, is refused by name and the server keeps
  serving its last good version.

The model is a user's (the TorchRec-tutorial-style ``ServedValuesModel``: CPU tables with rows of their own, a
``Linear`` with an 8-value and a 1-value bias, which AOTInductor would compile into the code unless the package keeps
them as constants). One fit and two AOTInductor compiles (steps 2 and 6, int8) are shared by the module.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_rec import RecShardStrategy
from lightning_rec.serving import FreshModel, export_inference, serving_inputs
from lightning_rec.serving.deltas import (
    FORMAT,
    DeltaError,
    Manifest,
    artifact_rows,
    file_record,
    full_manifest_path,
    full_path,
    read_delta,
    version_dir,
    write_part,
)
from lightning_rec.serving.layout import read_table_bytes
from lightning_rec.serving.network import quantize, serving_network
from lightning_rec.testing import QUIET_TRAINER
from tests.helpers.dist import in_this_process
from tests.helpers.user_models import global_batches, samples, to_batch
from tests.test_serving import ServedValuesModel

STEPS = (2, 4, 6)  # the full package's step, then the two deltas'
_DTYPES = {"fp32": torch.float, "fp16": torch.half, "int8": torch.qint8, "int4": torch.quint4x2}


# ---- what a delta holds (no fit, no compile) ---------------------------------------------------------------------


def _kernel_tables(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Table name -> its rows' bytes as the quantized kernels hold them (``uint8[rows, row_bytes]``)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    out = {}
    for kernel in module.modules():
        if isinstance(kernel, IntNBitTableBatchedEmbeddingBagsCodegen):
            for (view, _), spec in zip(
                kernel.split_embedding_weights(split_scale_shifts=False), kernel.embedding_specs
            ):
                out[spec[0]] = view
    return out


@pytest.mark.parametrize("dtype", sorted(_DTYPES))
def test_artifact_rows_are_the_quantized_kernels_bytes(dtype):
    """Any rows of a table, given as floats, become the bytes TorchRec's quantized module holds for them (each row
    on its own: the same bytes as in the whole table), padding included."""
    dims = {"a": 8, "b": 16 if dtype == "int4" else 12}
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=23, feature_names=[t]) for t, d in dims.items()
        ]
    )
    with torch.no_grad():
        for p in ebc.parameters():
            p.normal_(generator=torch.Generator().manual_seed(3))
    floats = {t: ebc.embedding_bags[t].weight.detach().clone() for t in dims}
    held = _kernel_tables(quantize(torch.nn.Sequential(ebc), _DTYPES[dtype]))
    for table, rows in floats.items():
        ids = torch.tensor([7, 0, 22, 3])
        assert torch.equal(artifact_rows(rows[ids], dtype), held[table][ids]), table
        assert torch.equal(artifact_rows(rows, dtype), held[table]), table


def _publish_version(root: Path, version: int, step: int, tables: dict, dense: dict, dtype: str, parts: int = 1):
    """Write version ``version``'s delta as the publisher does (parts, then the manifest, then LATEST)."""
    folder = version_dir(root, version)
    folder.mkdir(parents=True)
    files = {}
    names = sorted(tables)
    for rank in range(parts):
        mine = {t: tables[t] for t in names[rank::parts]}
        files[f"delta.r{rank}.pt"] = write_part(folder / f"delta.r{rank}.pt", mine, dense if rank == 0 else {})
    manifest = Manifest(
        version=version, kind="delta", previous=version - 1, step=step, event_time=None, epoch=0, world_size=parts,
        table_dtype=dtype, created=datetime.now(timezone.utc).isoformat(), files=files,
    )  # fmt: skip
    (folder / "manifest.json").write_text(manifest.to_json())
    (root / "LATEST").write_text(json.dumps({"version": version}))


def test_a_delta_reads_back_and_a_damaged_or_missing_file_is_refused_by_name(tmp_path):
    """Two parts read back merged; one flipped byte, a truncated or missing part, or a missing manifest: refused,
    naming the version and the file."""
    rows = artifact_rows(torch.randn(3, 8), "int8")
    tables = {"t_a": (torch.tensor([4, 1, 9]), rows), "t_b": (torch.tensor([2]), rows[:1])}
    dense = {"over.0.bias": torch.randn(8)}
    _publish_version(tmp_path, 2, 40, tables, dense, "int8", parts=2)
    delta = read_delta(tmp_path, 2)
    assert delta.manifest.format == FORMAT and delta.manifest.step == 40
    assert sorted(delta.tables) == ["t_a", "t_b"] and torch.equal(delta.tables["t_a"][1], rows)
    assert torch.equal(delta.tables["t_a"][0], torch.tensor([4, 1, 9])) and torch.equal(
        delta.dense["over.0.bias"], dense["over.0.bias"]
    )
    part = version_dir(tmp_path, 2) / "delta.r1.pt"
    good = part.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    part.write_bytes(bytes(flipped))
    with pytest.raises(DeltaError, match=r"version 2 .*delta\.r1\.pt has SHA-256"):
        read_delta(tmp_path, 2)
    part.write_bytes(good[:-1])
    with pytest.raises(DeltaError, match=r"version 2 .*delta\.r1\.pt holds \d+ bytes"):
        read_delta(tmp_path, 2)
    part.unlink()
    with pytest.raises(DeltaError, match=r"version 2 .*delta\.r1\.pt is missing"):
        read_delta(tmp_path, 2)
    (version_dir(tmp_path, 2) / "manifest.json").unlink()
    with pytest.raises(DeltaError, match=r"v000002/manifest\.json' is missing"):
        read_delta(tmp_path, 2)
    with pytest.raises(DeltaError, match=r"version 3 .*folder is missing"):
        read_delta(tmp_path, 3)


def test_the_package_names_each_training_tensor_it_reads_and_those_no_update_can_reach():
    """``constant_sources`` maps the graph's parameters to their training keys (by storage); a trained tensor read
    from a plain dict (as TorchRec's position weights are, through a ``.detach()``-ed view) becomes an anonymous
    constant, listed apart so that a server refuses to follow deltas it would serve stale."""
    from lightning_rec.serving.layout import constant_sources

    class DictHeld(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.weights = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.rand(3))})
            self.held = {"a": self.weights["a"].detach()}  # the same storage, not the Parameter

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.held["a"])

    module = DictHeld().eval()
    exported = torch.export.export(module, (torch.rand(2, 3),), strict=False)
    sources, fixed = constant_sources(exported, dict(module.state_dict(keep_vars=True)), [])
    assert sources == {"lin.weight": "lin.weight", "lin.bias": "lin.bias"} and fixed == ["weights.a"]


# ---- a trained model, its packages, and the versions written from its checkpoints ----------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[int, Path]:
    """ServedValuesModel trained for 6 steps of 16 samples, a checkpoint every 2 steps: step -> checkpoint."""
    out = tmp_path_factory.mktemp("fresh_fit")
    L.seed_everything(0, verbose=False)
    batches = [to_batch(rows) for rows in global_batches(STEPS[-1], 16)]
    trainer = L.Trainer(
        strategy=RecShardStrategy(), accelerator="cpu", devices=1, max_steps=STEPS[-1], default_root_dir=out,
        callbacks=[ModelCheckpoint(out / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)],
        **{**QUIET_TRAINER, "enable_checkpointing": True},
    )  # fmt: skip
    with in_this_process(out):  # a module fixture: conftest's per-test isolation does not reach it
        trainer.fit(ServedValuesModel(), DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    found = {int(p.name.split("=")[1].split(".")[0]): p for p in (out / "ckpt").iterdir()}
    assert sorted(found) == list(STEPS), found
    return found


@pytest.fixture(scope="module")
def packages(trained, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """(dtype, step) -> the full .pt2 export at the first and the last step, int8 (two compiles: CI time; fp32
    packages are followed in tests/test_publish.py)."""
    out = tmp_path_factory.mktemp("fresh_packages")
    return {
        (dtype, step): _export(trained[step], out / f"{dtype}_{step}.pt2", dtype)
        for dtype in ("int8",)
        for step in (STEPS[0], STEPS[-1])
    }


def _export(checkpoint: Path, path: Path, dtype: str) -> Path:
    export_inference(checkpoint, path, table_dtype=dtype, model_class=ServedValuesModel)
    return path


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ServedValuesModel.load_from_checkpoint(checkpoint).state_dict().items()}


def _table_key(state: dict[str, torch.Tensor], table: str) -> str:
    (key,) = [k for k in state if k.endswith(f"embedding_bags.{table}.weight")]
    return key


def publish(root: Path, dtype: str, trained, packages, upto: int = len(STEPS)) -> list[dict[str, int]]:
    """A publish directory: version 1 the full package at step 2, versions 2 and 3 the deltas of steps 4 and 6 (the
    rows that differ from the previous version's, as artifact_rows; every other tensor of the module whole);
    LATEST at ``upto``. Returns each delta's rows per table."""
    full = full_path(root, 1)
    full.parent.mkdir(parents=True)
    shutil.copyfile(packages[(dtype, STEPS[0])], full)
    manifest = Manifest(
        version=1, kind="full", previous=None, step=STEPS[0], event_time=None, epoch=0, world_size=1,
        table_dtype=dtype, created=datetime.now(timezone.utc).isoformat(), files={full.name: file_record(full)},
    )  # fmt: skip
    full_manifest_path(root, 1).write_text(manifest.to_json())
    (root / "LATEST").write_text(json.dumps({"version": 1}))
    spec_tables = json.loads(json.dumps(_spec(packages[(dtype, STEPS[0])]).tables))
    sizes: list[dict[str, int]] = []
    previous = _state(trained[STEPS[0]])
    for version, step in enumerate(STEPS[1:upto], start=2):
        state = _state(trained[step])
        tables, keys = {}, set()
        sizes.append({})
        for table in spec_tables:
            key = _table_key(state, table)
            keys.add(key)
            ids = torch.nonzero((state[key] != previous[key]).any(dim=1)).flatten()
            tables[table] = (ids, artifact_rows(state[key][ids], dtype))
            sizes[-1][table] = ids.numel()
        dense = {k: v for k, v in state.items() if k not in keys}
        _publish_version(root, version, step, tables, dense, dtype)
        previous = state
    return sizes


def _spec(path: Path):
    from lightning_rec.serving import pt2_spec

    return pt2_spec(path)


def _probes(spec, n: int = 1000) -> list[tuple[torch.Tensor, ...]]:
    """``n`` one-sample requests drawn like the training data (other seeds)."""
    out = []
    for row in samples(n, seed=2026):
        batch = to_batch([row])
        out.append(serving_inputs(spec, batch["sparse"], batch["dense"]))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["int8"])
def test_a_full_package_plus_deltas_serves_what_a_full_export_of_the_same_step_serves(
    tmp_path, trained, packages, dtype
):
    """Full at step 2 + the deltas of steps 4 and 6 == the full export at step 6, bit for bit, on 1,000 probe
    requests; the deltas are partial (rows no batch touched are not in them) and change the answers; at step 4 the
    served tables hold the quantized module's bytes and the weights are the checkpoint's. ``artifact_rows`` of the
    trained rows are the exported package's own table bytes."""
    from lightning_rec.serving import load_pt2

    # artifact_rows == the bytes of a real export's table (read from its weights blob where the spec says)
    first = packages[(dtype, STEPS[0])]
    spec = _spec(first)
    state = _state(trained[STEPS[0]])
    for table, entry in spec.table_layout.items():
        held = read_table_bytes(first, entry)[entry["offset"] : entry["offset"] + entry["rows"] * entry["row_bytes"]]
        assert torch.equal(artifact_rows(state[_table_key(state, table)], dtype).flatten(), held), table

    root = tmp_path / "pub"
    sizes = publish(root, dtype, trained, packages)
    rows = {t: n for t, (n, _) in spec.tables.items()}
    for delta in sizes:  # rows changed in every table, and rows left out (not touched) in some
        assert all(delta.values()) and any(delta[t] < rows[t] for t in rows), (sizes, rows)
    (root / "LATEST").write_text(json.dumps({"version": 2}))
    model = FreshModel(root)
    assert (model.version, model.step) == (2, STEPS[1])
    # step 4: what is served is the quantized module's tables and the checkpoint's weights (no compile needed)
    module = ServedValuesModel.load_from_checkpoint(trained[STEPS[1]]).eval()
    expected = _kernel_tables(quantize(serving_network(module, None), _DTYPES[dtype]))
    step4 = module.state_dict()
    for table, entry in spec.table_layout.items():
        kept = model._tables[entry["constant"]]
        served = kept.copies[kept.active][entry["offset"] : entry["offset"] + entry["rows"] * entry["row_bytes"]]
        assert torch.equal(served, expected[table].flatten()), table
    assert (
        spec.fixed_sources == []
        and spec.constant_sources
        and all(torch.equal(model._dense[fqn], step4[key]) for fqn, key in spec.constant_sources.items())
    )
    # step 6: the deltas applied on a running server == the full export at step 6
    (root / "LATEST").write_text(json.dumps({"version": 3}))
    assert model.refresh() == 3 and model.step == STEPS[2] and model.refused is None
    reference = load_pt2(packages[(dtype, STEPS[-1])])
    stale = load_pt2(first)
    changed = 0
    for args in _probes(spec):
        got, want = model(*args), reference(*args)
        assert torch.equal(got, want), (got, want)
        changed += not torch.equal(got, stale(*args))
    assert changed > 900, f"the deltas changed only {changed} of 1000 answers"
    # a server started on the directory (full + both deltas) serves the same
    again = FreshModel(root)
    assert again.version == 3
    args = _probes(spec, 1)[0]
    assert torch.equal(again(*args), reference(*args))


@pytest.fixture(scope="module")
def versions(trained, packages, tmp_path_factory) -> dict[str, Any]:
    """An int8 publish directory at versions 1..3, and each version's answers to a batch of probes (a server taken
    through the versions with no other request running)."""
    root = tmp_path_factory.mktemp("fresh_versions") / "pub"
    publish(root, "int8", trained, packages)
    spec = _spec(packages[("int8", STEPS[0])])
    batch = to_batch(samples(64, seed=7))
    args = serving_inputs(spec, batch["sparse"], batch["dense"])
    answers = []
    for upto in (1, 2, 3):
        (root / "LATEST").write_text(json.dumps({"version": upto}))
        answers.append(FreshModel(root)(*args))
    assert not torch.equal(answers[0], answers[1]) and not torch.equal(answers[1], answers[2])
    return {"root": root, "args": args, "answers": answers}


def _at(root: Path, version: int, into: Path) -> Path:
    """A copy of the publish directory ``root`` with LATEST at ``version``."""
    shutil.copytree(root, into)
    (into / "LATEST").write_text(json.dumps({"version": version}))
    return into


@pytest.mark.dist
def test_a_request_in_flight_during_an_update_is_answered_by_the_old_version(tmp_path, versions):
    """A request that started before an update began is answered by the version it started on: the update waits for
    it (the request is held inside the server until the update is waiting), and the next request gets the new one."""
    root = _at(versions["root"], 2, tmp_path / "pub")
    model = FreshModel(root)
    args, answers = versions["args"], versions["answers"]
    waiting, started = threading.Event(), threading.Event()
    writing = model._lock.writing

    def observed_writing():  # the update announces that it waits for the requests in flight
        waiting.set()
        return writing()

    model._lock.writing = observed_writing  # type: ignore[method-assign]
    inner = model._model

    class HeldRequest:  # the package call of the first request waits until the update is waiting for it
        spec = inner.spec

        def __call__(self, *a):
            started.set()
            assert waiting.wait(60), "the update never started"
            return inner(*a)

    model._model = HeldRequest()  # type: ignore[assignment]
    result: dict[str, torch.Tensor] = {}
    request = threading.Thread(target=lambda: result.setdefault("old", model(*args)))
    request.start()
    assert started.wait(60)
    (root / "LATEST").write_text(json.dumps({"version": 3}))
    model._model = inner  # the update swaps constants on the package itself; later requests run unheld
    model.refresh()
    request.join(60)
    assert torch.equal(result["old"], answers[1]), "the request in flight was not answered by the old version"
    assert model.version == 3 and torch.equal(model(*args), answers[2])


@pytest.mark.dist
def test_requests_from_threads_while_versions_are_applied_each_get_one_version(tmp_path, versions):
    """Four threads send requests while the server applies versions 2 and 3: every answer is exactly one version's
    (never a mix of tables and weights from two), and each thread sees the versions in order."""
    root = _at(versions["root"], 1, tmp_path / "pub")
    model = FreshModel(root)
    args, answers = versions["args"], versions["answers"]
    done = threading.Event()
    seen: list[list[int]] = [[] for _ in range(4)]
    ready = threading.Barrier(5)

    def client(mine: list[int]) -> None:
        first = True
        while True:
            last = done.is_set()
            got = model(*args)
            matches = [v for v, a in enumerate(answers, start=1) if torch.equal(got, a)]
            mine.append(matches[0] if matches else -1)
            if first:
                ready.wait(60)
                first = False
            if last:
                return

    threads = [threading.Thread(target=client, args=(s,)) for s in seen]
    for t in threads:
        t.start()
    ready.wait(60)  # every thread has its first answer (version 1) before any update
    for version in (2, 3):
        (root / "LATEST").write_text(json.dumps({"version": version}))
        assert model.refresh() == version
    done.set()
    for t in threads:
        t.join(120)
    for mine in seen:
        assert -1 not in mine, f"an answer matched no version: {mine}"
        assert mine == sorted(mine) and mine[0] == 1 and mine[-1] == 3, mine


@pytest.mark.dist
def test_a_damaged_or_missing_delta_is_refused_by_name_and_the_last_good_version_serves(
    tmp_path, versions, packages, caplog
):
    """Version 3's part with one byte flipped, then missing, then the whole version folder missing: each refused by
    name (a warning and ``refused``), the server answering as version 2; repaired, version 3 is applied. A server
    whose next delta is gone for good goes on from a newer full package."""
    root = _at(versions["root"], 2, tmp_path / "pub")
    model = FreshModel(root)
    args, answers = versions["args"], versions["answers"]
    part = version_dir(root, 3) / "delta.r0.pt"
    good = part.read_bytes()
    (root / "LATEST").write_text(json.dumps({"version": 3}))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    part.write_bytes(bytes(flipped))
    with caplog.at_level("WARNING", logger="lightning_rec.serving.fresh"):
        assert model.refresh() == 2
    assert model.refused is not None and model.refused[0] == 3 and "delta.r0.pt has SHA-256" in model.refused[1]
    assert "not serving version 3, staying on version 2" in caplog.text and "delta.r0.pt" in caplog.text
    assert torch.equal(model(*args), answers[1])
    part.unlink()
    assert model.refresh() == 2 and "delta.r0.pt is missing" in model.refused[1]
    # a server that starts now serves version 2 and says why not 3
    fresh = FreshModel(root)
    assert fresh.version == 2 and fresh.refused[0] == 3 and torch.equal(fresh(*args), answers[1])
    folder = version_dir(root, 3)
    shutil.move(folder, tmp_path / "aside")
    assert model.refresh() == 2 and "version 3" in model.refused[1] and "folder is missing" in model.refused[1]
    shutil.move(tmp_path / "aside", folder)
    part.write_bytes(good)
    assert model.refresh() == 3 and torch.equal(model(*args), answers[2])
    # a server whose next delta is gone (deleted by retention) goes on from a full package published after it
    shutil.rmtree(folder)
    full = full_path(root, 3)
    shutil.copyfile(packages[("int8", STEPS[-1])], full)
    manifest = Manifest(
        version=3, kind="full", previous=2, step=STEPS[-1], event_time=None, epoch=0, world_size=1,
        table_dtype="int8", created=datetime.now(timezone.utc).isoformat(), files={full.name: file_record(full)},
    )  # fmt: skip
    full_manifest_path(root, 3).write_text(manifest.to_json())
    assert fresh.version == 2 and fresh.refresh() == 3 and fresh.step == STEPS[-1]
    assert torch.equal(fresh(*args), answers[2])
