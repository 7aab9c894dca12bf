"""An index from a sharded checkpoint (``lightning-rec index``, :func:`lightning_rec.retrieval.build_index`) and top-k
served by the query tower's ``.pt2`` package and that index (:class:`lightning_rec.retrieval.Retriever`), on
MovieLens-100K.

One two-tower model is trained briefly in this process and saved once (module fixture); every case reads that
checkpoint. The query tower's ``.pt2`` package is the session's (tests/helpers/zoo_packages.py: compiled once for the
serving tests too), and the catalogue is indexed on 2 ranks through the CLI in real processes once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from lightning_rec import RecShardStrategy
from lightning_rec._cli import run
from lightning_rec.data import MovieLensRetrievalDataModule
from lightning_rec.models import TwoTowerModule
from lightning_rec.retrieval import Retriever, build_index, index_params, load_index, search_index
from lightning_rec.retrieval.folder import INDEX_FILE, ITEM_IDS_FILE, MANIFEST_FILE, faiss_module
from lightning_rec.retrieval.index import _slices
from lightning_rec.serving import export_inference
from tests.helpers import zoo_two_tower
from tests.helpers.data import movielens_dir
from tests.helpers.dist import in_this_process
from tests.helpers.zoo_packages import zoo_checkpoint, zoo_package

pytest.importorskip("faiss", reason="the `retrieval` extra (faiss-cpu) is not installed")


def _quiet(**kwargs: Any) -> dict[str, Any]:
    return dict(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Any]:
    """A small two-tower model (16-wide towers) trained 30 steps on one process and saved; its flat index (built in
    this process), the eager model loaded back, and the test queries (each user's held-out item and exclusions)."""
    work = tmp_path_factory.mktemp("two_tower")
    dm = MovieLensRetrievalDataModule(str(movielens_dir()), download=False, batch_size=256)
    with in_this_process(work):
        L.seed_everything(0, workers=True)
        model = TwoTowerModule(
            dm.sparse_features, embedding_dim=16, query_layer_sizes=[32, 16], candidate_layer_sizes=[32, 16]
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=RecShardStrategy(),
            max_steps=30,
            limit_val_batches=0,
            enable_checkpointing=False,
            **_quiet(),
        )
        trainer.fit(model, dm)
        trainer.save_checkpoint(work / "ckpt")
    with in_this_process(work):
        manifest = build_index(work / "ckpt", work / "flat", datamodule=dm)
    eager = TwoTowerModule.load_from_checkpoint(work / "ckpt").eval()
    rows = dm.split("test")
    index = torch.arange(len(rows))
    excluded, lengths = rows.exclude.take(index)
    items = torch.arange(1, dm.interactions.num_items)
    with torch.no_grad():
        queries = eager.model.query_tower(rows.query(index))
        catalogue = eager.model.candidate_tower(rows.candidate(items))
    return {
        "work": work,
        "dm": dm,
        "manifest": manifest,
        "rows": rows,
        "items": items,
        "queries": queries,
        "catalogue": catalogue,
        "exclude": [e.tolist() for e in excluded.split(lengths.tolist())],
        "target": rows.item.numpy(),
    }


def _brute_force(queries: torch.Tensor, catalogue: torch.Tensor, items: torch.Tensor, exclude, k: int):
    """Exact top-k by the towers' dot product over every item, the excluded ones at -inf (plain torch)."""
    scores = queries @ catalogue.T
    for q, ids in enumerate(exclude):
        known = [i - 1 for i in ids if 1 <= i <= items.numel()]  # item id i is catalogue row i - 1
        scores[q, known] = float("-inf")
    top = scores.topk(k, dim=1)
    return items[top.indices], top.values


def _recall_at_10(top_ids: torch.Tensor, target: np.ndarray) -> float:
    return float(np.mean([t in row for t, row in zip(target, top_ids.numpy())]))


@pytest.mark.dist
def test_flat_index_holds_the_candidate_tower_and_a_manifest_tied_to_the_checkpoint(trained) -> None:
    work, manifest = trained["work"], trained["manifest"]
    loaded = load_index(work / "flat")
    assert sorted(p.name for p in (work / "flat").iterdir()) == sorted([INDEX_FILE, ITEM_IDS_FILE, MANIFEST_FILE])
    assert loaded.item_ids.tolist() == trained["items"].tolist() == list(range(1, 1683))
    vectors = torch.from_numpy(loaded.index.reconstruct_n(0, loaded.index.ntotal))
    torch.testing.assert_close(vectors, trained["catalogue"], atol=1e-6, rtol=0)
    complete = json.loads((work / "ckpt" / "COMPLETE").read_text())
    assert manifest == json.loads((work / "flat" / MANIFEST_FILE).read_text()) == loaded.manifest
    assert manifest["checkpoint"]["global_step"] == manifest["global_step"] == 30 == complete["global_step"]
    assert manifest["checkpoint"]["path"] == str((work / "ckpt").resolve())
    assert manifest["checkpoint"]["run"] == manifest["run"] == complete["run"]
    assert (manifest["num_items"], manifest["dim"], manifest["metric"]) == (1682, 16, "inner_product")
    assert (manifest["kind"], manifest["params"], manifest["faiss"]) == ("flat", {}, faiss_module().__version__)
    for name in (INDEX_FILE, ITEM_IDS_FILE):
        import hashlib

        assert manifest["files"][name]["sha256"] == hashlib.sha256((work / "flat" / name).read_bytes()).hexdigest()
    # a changed file is named, not served
    copy = work / "tampered"
    shutil.copytree(work / "flat", copy)
    ids = np.load(copy / ITEM_IDS_FILE)
    ids[[0, 1]] = ids[[1, 0]]
    np.save(copy / ITEM_IDS_FILE, ids)
    with pytest.raises(ValueError, match=f"{ITEM_IDS_FILE}' is not the file the index was written with"):
        load_index(copy)


@pytest.mark.dist
def test_retriever_answers_as_the_eager_model_and_exact_search(trained, tmp_path_factory, tmp_path) -> None:
    """The query tower's .pt2 package (fp32 tables) + the flat index of the same checkpoint answer each test user's
    top 10, their seen items excluded, as the eager towers' brute-force scores do.

    The package is the session's two-tower query package (tests/helpers/zoo_packages.py: the zoo's two-tower trained
    2 steps, compiled once for tests/test_serving_pt2.py and tests/test_serving_inputs.py too); its checkpoint is
    indexed here."""
    ckpt = zoo_checkpoint(zoo_two_tower.CASE, None, 2, tmp_path_factory)
    package, _ = zoo_package(ckpt, "query")
    with in_this_process(tmp_path):
        build_index(ckpt, tmp_path / "flat", datamodule=trained["dm"])
    retriever = Retriever(package, tmp_path / "flat")
    eager = TwoTowerModule.load_from_checkpoint(ckpt).eval()
    n, rows, exclude = 200, trained["rows"], trained["exclude"][:200]
    request = rows.query(torch.arange(n))
    with torch.no_grad():
        queries, catalogue = (
            eager.model.query_tower(request),
            eager.model.candidate_tower(rows.candidate(trained["items"])),
        )
    top = retriever(request, k=10, exclude=exclude)
    expected_ids, expected_scores = _brute_force(queries, catalogue, trained["items"], exclude, 10)
    torch.testing.assert_close(top.scores, expected_scores, atol=1e-5, rtol=0)
    # the same items, where the scores are not tied within the package's rounding
    distinct = (expected_scores[:, :-1] - expected_scores[:, 1:]).abs() > 1e-5
    clear = distinct.all(dim=1)
    assert clear.sum() > n * 0.9
    assert torch.equal(top.item_ids[clear], expected_ids[clear])
    assert not any(set(t) & set(e) for t, e in zip(top.item_ids.tolist(), exclude))
    # the package's own arguments answer the same
    args = (request.values(), request.lengths().long(), request.weights())
    torch.testing.assert_close(retriever(args, k=10, exclude=exclude).scores, top.scores)

    # the TorchScript artifact of the same tower serves the same answers
    with in_this_process(tmp_path):
        export_inference(ckpt, tmp_path / "query.pt", part="query", table_dtype="fp32", format="torchscript")
    scripted = Retriever(tmp_path / "query.pt", tmp_path / "flat")(request, k=10, exclude=exclude)
    torch.testing.assert_close(scripted.scores, top.scores, atol=1e-5, rtol=0)
    assert torch.equal(scripted.item_ids[clear], top.item_ids[clear])

    # an index of another checkpoint save is refused by name, unless allowed; one of another width always
    other = tmp_path / "other_save"
    shutil.copytree(tmp_path / "flat", other)
    manifest = json.loads((other / MANIFEST_FILE).read_text())
    manifest["checkpoint"]["id"] = "0" * 64
    (other / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="from checkpoint step 2 .* and the index from step 2 .*do not match"):
        Retriever(package, other)
    assert Retriever(package, other, allow_other_checkpoint=True)(request, k=3).item_ids.shape == (n, 3)
    with pytest.raises(ValueError, match="embeds queries in 8 dimensions and the index holds 16"):
        Retriever(package, trained["work"] / "flat", allow_other_checkpoint=True)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_ann_recall_at_10_within_one_percent_of_exact_search(trained, kind: str) -> None:
    """The shipped defaults: the held-out item's recall@10 over the 942 test users within 1% (relative) of exact
    search's, which is itself the brute-force ranking."""
    work = trained["work"]
    with in_this_process(work):
        manifest = build_index(work / "ckpt", work / kind, kind=kind, datamodule=trained["dm"])
    assert manifest["params"] == index_params(kind, {}, num_items=1682)
    queries, exclude, target = trained["queries"], trained["exclude"], trained["target"]
    exact = search_index(load_index(work / "flat"), queries, 10, exclude)
    brute, _ = _brute_force(queries, trained["catalogue"], trained["items"], exclude, 10)
    assert _recall_at_10(exact.item_ids, target) == _recall_at_10(brute, target) > 0.05
    ann = search_index(load_index(work / kind), queries, 10, exclude)
    exact_recall, ann_recall = _recall_at_10(exact.item_ids, target), _recall_at_10(ann.item_ids, target)
    assert abs(ann_recall - exact_recall) <= 0.01 * exact_recall, (kind, ann_recall, exact_recall)
    overlap = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(ann.item_ids.tolist(), exact.item_ids.tolist())])
    assert overlap >= 0.99, (kind, overlap)


@pytest.mark.dist
def test_two_ranks_through_the_cli_shard_the_item_table_and_write_the_same_vectors(trained) -> None:
    work = trained["work"]
    out = work / "two_ranks"
    command = [sys.executable, "-m", "lightning_rec", "index", str(work / "ckpt"), str(out), "--kind", "hnsw",
               "--devices", "2", "--data-dir", str(movielens_dir())]  # fmt: skip
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = next(line.split() for line in (done.stdout + done.stderr).splitlines() if " t_item_id " in f" {line} ")
    assert plan[2:4] == ["row_wise", "0,1"], plan  # the item table is split over the ranks, not gathered on one
    assert f"wrote {out}: hnsw index of 1682 items x 16" in done.stdout
    loaded = load_index(out)
    assert loaded.manifest["devices"] == 2 and loaded.manifest["checkpoint"] == trained["manifest"]["checkpoint"]
    assert loaded.item_ids.tolist() == trained["items"].tolist()
    vectors = torch.from_numpy(loaded.index.reconstruct_n(0, loaded.index.ntotal))
    torch.testing.assert_close(vectors, trained["catalogue"], atol=1e-6, rtol=0)
    assert not [p.name for p in work.iterdir() if p.name.startswith(".two_ranks")]  # no staging left


@pytest.mark.dist
def test_an_existing_folder_is_replaced_only_when_asked_and_only_if_it_is_an_index(trained, capsys) -> None:
    work = trained["work"]
    out = work / "replace"
    shutil.copytree(work / "flat", out)
    (out / "stale").write_text("from the old index")
    args = ["index", str(work / "ckpt"), str(out), "--data-dir", str(movielens_dir())]
    with pytest.raises(SystemExit) as exit_info:
        run(args)
    assert exit_info.value.code == 2
    assert "exists; an index is never written over it" in capsys.readouterr().err
    assert (out / "stale").exists()
    with in_this_process(work):
        run([*args, "--overwrite", "--kind", "ivf"])
    assert json.loads((out / MANIFEST_FILE).read_text())["kind"] == "ivf" and not (out / "stale").exists()
    (work / "notes").mkdir()
    with pytest.raises(SystemExit):
        run(["index", str(work / "ckpt"), str(work / "notes"), "--overwrite"])
    assert "is not an index folder" in capsys.readouterr().err


# -- refused before anything is read (no checkpoint needed) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--kind", "hsnw"], "index kind 'hsnw' is not one of 'flat', 'hnsw', 'ivf'; did you mean 'hnsw'?"),
        (["--kind", "ivf", "--hnsw-m", "8"], "hnsw_m=8 applies to kind 'hnsw', not 'ivf'."),
        (["--kind", "hnsw", "--hnsw-ef-search", "0"], "hnsw_ef_search must be >= 1, got 0."),
        (["--devices", "0"], "the ranks and the batch must be >= 1, got --devices 0 --batch-size 4096."),
    ],
)
def test_mistakes_are_one_line_and_exit_2_before_the_checkpoint_is_read(tmp_path, capsys, options, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["index", str(tmp_path / "no_such_checkpoint"), str(tmp_path / "out"), *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err == f"lightning-rec index: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_without_faiss_the_error_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-rec\[retrieval\]'"):
        load_index(tmp_path)
    with pytest.raises(SystemExit):
        run(["index", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert "lightning-rec[retrieval]" in capsys.readouterr().err


def test_each_rank_embeds_an_equal_slice_the_last_padded_with_the_last_item() -> None:
    """Every rank runs the same batches (the sharded lookups are collectives); the gathered rows, cut to the
    catalogue's length, are the catalogue in order."""
    slices = _slices(5, 2, batch_size=2)
    assert [[b.tolist() for b in rank] for rank in slices] == [[[0, 1], [2]], [[3, 4], [4]]]
    gathered = torch.cat([torch.cat(rank) for rank in slices])[:5]
    assert gathered.tolist() == [0, 1, 2, 3, 4]
    assert [[b.tolist() for b in rank] for rank in _slices(4, 1, batch_size=3)] == [[[0, 1, 2], [3]]]


def test_search_leaves_out_excluded_items_and_pads_a_small_catalogue() -> None:
    faiss = faiss_module()
    flat = faiss.IndexFlatIP(2)
    flat.add(np.array([[1, 0], [0.8, 0.6], [0, 1]], dtype=np.float32))
    from lightning_rec.retrieval import LoadedIndex

    index = LoadedIndex(flat, np.array([10, 20, 30]), {})
    top = search_index(index, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), k=3, exclude=[[10], []])
    assert top.item_ids.tolist() == [[20, 30, -1], [30, 20, 10]]
    assert top.scores[0, :2].tolist() == pytest.approx([0.8, 0.0]) and top.scores[0, 2] == float("-inf")
    assert search_index(index, torch.tensor([[1.0, 0.0]]), k=1, exclude=[[10]]).item_ids.tolist() == [[20]]
    with pytest.raises(ValueError, match="exclude holds 1 lists for 2 queries"):
        search_index(index, torch.zeros(2, 2), exclude=[[]])
    for wrong in (torch.zeros(2, 3), torch.zeros(2)):  # another width, or one vector without its batch dimension
        with pytest.raises(ValueError, match=r"queries must be \(B, 2\) for this index of 2-wide vectors"):
            search_index(index, wrong)


def test_the_command_answers_help_with_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["index", "--help"])
    shown = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert {"--kind", "--devices", "--overwrite", "--hnsw-m", "--ivf-nlist", "--nprobe"} <= set(shown.split())
