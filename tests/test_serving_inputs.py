"""Whatever a caller passes, a served artifact answers as the eager model does or raises an error it can catch
(issue 45, items 1-4 and the spec of item 9): a matrix of inputs (dtypes, feature counts, dense widths and rows,
lengths negative / not adding up / longer than SASRec's ``max_len``, ids outside their table, empty batches and
requests, layouts) x loaders (``load_pt2``, ``torch._inductor.aoti_load_package``, ``torch.jit.load``) x zoo models
(DeepFM: dense and sparse; SASRec: a sequence with ``max_len``; the two-tower query tower: per-id weights). Each
model's loaders run in a fresh process without ``AOTI_RUNTIME_CHECK_INPUTS``, which records each case's outcome before
the next: an abort (an error thrown inside OpenMP, a read past a buffer that crashes) fails the test naming the case
instead of killing pytest. Also: a caller's tensors are never written to (``--bounds-check warn`` rewrote ``values``),
SASRec's artifact takes the one feature it reads, and the spec lists the inputs' dtypes, the output's meaning and a
warm-up request the artifact must answer as recorded. Every package is compiled once (module fixture)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_rec._compat.torch import aoti_input_checks_class
from lightning_rec.errors import ServingError
from lightning_rec.serving import export_inference, load_inference, load_pt2, warm_up
from lightning_rec.serving.network import network_features
from tests.helpers import zoo_deepfm, zoo_sequential, zoo_two_tower
from tests.helpers.zoo_packages import zoo_checkpoint, zoo_package
from tests.test_serving import MODELS as CTR_MODELS

pytestmark = pytest.mark.dist

# name -> (case, the module to build (default: the case's), the part it serves, training steps)
ZOO: dict[str, Any] = {
    "deepfm": (zoo_deepfm.CASE, CTR_MODELS["deepfm"][1], None, 4),
    "sasrec": (zoo_sequential.CASE, None, None, 2),
    "query": (zoo_two_tower.CASE, None, "query", 2),
}
LOADERS = ("load_pt2", "aoti_load_package", "torch.jit.load")
# what each model's network can take, known here rather than read from the spec under test: SASRec's max_len
LIMITS: dict[str, dict[str, int]] = {"sasrec": {"history": zoo_sequential.MAX_LEN}}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Each zoo model trained a few steps and exported with fp32 tables as a ``.pt2`` package and a TorchScript
    artifact (``bounds_check="error"``, the default); DeepFM also under ``"warn"`` (both formats). The checkpoints
    and packages are the session's (tests/helpers/zoo_packages.py): tests/test_serving_pt2.py serves the same."""
    models = {}
    for name, (case, build, part, steps) in ZOO.items():
        work = tmp_path_factory.mktemp(name)
        ckpt = zoo_checkpoint(case, build, steps, tmp_path_factory)
        trained = type((build or case.build)()).load_from_checkpoint(ckpt).eval()
        warn = name == "deepfm"
        paths = {"pt": work / f"{name}.pt"} | ({"warn.pt": work / f"{name}_warn.pt"} if warn else {})
        specs = {
            kind: export_inference(
                ckpt, path, table_dtype="fp32", part=part, bounds_check="warn" if "warn" in kind else "error"
            )
            for kind, path in paths.items()
        }
        for kind in ("pt2", "warn.pt2") if warn else ("pt2",):
            paths[kind], specs[kind] = zoo_package(ckpt, part, "warn" if "warn" in kind else "error")
        net = trained.inference_module(part)
        models[name] = SimpleNamespace(spec=specs["pt2"], specs=specs, paths=paths, net=net, case=case, part=part)
    return models


def _eager(model: SimpleNamespace, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The trained module's serving network on the artifact's arguments (as int64 ids and lengths, float32 values),
    its other features (SASRec's target, negatives, catalog) empty."""
    spec = model.spec
    dense, rest = args[: bool(spec.num_dense_features)], args[bool(spec.num_dense_features) :]
    values, lengths, *weights = rest
    batch = lengths.numel() // len(spec.features)
    per_feature = lengths.long().view(len(spec.features), batch)
    every = list(network_features(model.net)[0])
    full = torch.cat([per_feature[spec.features.index(f)] if f in spec.features else torch.zeros(batch).long()
                      for f in every])  # fmt: skip
    kjt = KeyedJaggedTensor(
        keys=every, values=values.long(), lengths=full, weights=weights[0].float() if weights else None
    )
    with torch.no_grad():
        return model.net(*(d.float() for d in dense), kjt)


def _good(spec, batch: int = 5, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``batch`` samples of 1-3 ids per feature over each feature's whole table, as the spec lists them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(spec.features) * batch,), generator=g)
    rows = torch.tensor(spec.feature_rows).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    dense = (torch.randn(batch, spec.num_dense_features, generator=g),) if spec.num_dense_features else ()
    weights = (torch.rand(values.numel(), generator=g),) if spec.weighted else ()
    return (*dense, values, lengths, *weights)


ANSWER = "answer"


def _cases(spec, limits: dict[str, int]) -> dict[str, tuple[tuple[torch.Tensor, ...], dict[str, str]]]:
    """case -> (arguments, loader -> what it must do: ``ANSWER`` (the eager model's output on the same request) or
    a regex its error's text matches)."""
    offset = 1 if spec.num_dense_features else 0
    good = _good(spec)
    dense, (values, lengths, *weights) = good[:offset], good[offset:]
    num, batch = len(spec.features), lengths.numel() // len(spec.features)

    def with_(values=values, lengths=lengths, dense=dense, weights=tuple(weights)):
        return (*dense, values, lengths, *weights)

    every = dict.fromkeys(LOADERS, ANSWER)
    cases: dict[str, tuple[tuple[torch.Tensor, ...], dict[str, str]]] = {"int64": (good, every)}
    # dtypes: TorchScript and load_pt2 take any; the package names the input and the dtype it got
    index = {name: i for i, name in enumerate(r["name"] for r in spec.inputs)}
    for arg, dtype in (("lengths", torch.int32), ("values", torch.int32), ("lengths", torch.int16)):
        changed = with_(**{arg: {"lengths": lengths, "values": values}[arg].to(dtype)})
        got = str(dtype).removeprefix("torch.")
        aoti = rf"input {index[arg]} \({arg}\): unmatched dtype, expected: 4\(at::kLong\), but got: \d+\({got}\)"
        cases[f"{arg} {got}"] = (changed, {**every, "aoti_load_package": aoti})
    if offset:
        f64 = with_(dense=(dense[0].double(),))
        cases["dense float64"] = (
            f64,
            {**every, "aoti_load_package": r"input 0 \(dense_features\): unmatched dtype.*float64"},
        )
        columns = dense[0].t().contiguous().t()  # the same values, column-major
        cases["dense column-major"] = (
            with_(dense=(columns,)),
            {**every, "aoti_load_package": r"dense_features.*stride"},
        )
        wide = with_(dense=(torch.cat([dense[0], dense[0][:, :1]], 1),))
        cases["dense too wide"] = (wide, {
            "load_pt2": rf"dense_features has shape \[{batch}, {spec.num_dense_features + 1}\]",
            "aoti_load_package": rf"input 0 \(dense_features\): unmatched dim value at 1, expected: {spec.num_dense_features}",
            "torch.jit.load": rf"dense_features has shape \[{batch}, {spec.num_dense_features + 1}\]",
        })  # fmt: skip
        rows = with_(dense=(torch.cat([dense[0], dense[0][:1]]),))
        cases["dense one row more"] = (rows, {
            "load_pt2": rf"dense_features has shape \[{batch + 1}, ",
            "aoti_load_package": r"lightning_rec: lengths must hold one length per \(feature, sample\)",
            "torch.jit.load": rf"dense_features has shape \[{batch + 1}, ",
        })  # fmt: skip
    if num > 1:  # one feature fewer or more (a sparse-only model reads that as another batch size when F divides)
        for label, lens, vals in (
            ("one feature fewer", lengths[batch:], values[int(lengths[:batch].sum()) :]),
            ("one feature more", torch.cat([lengths, lengths[:batch]]), torch.cat([values, values[: int(lengths[:batch].sum())]])),
        ):  # fmt: skip
            ws = tuple(torch.ones(vals.numel()) for _ in weights)
            size = rf"lengths has {lens.numel()} entries; the artifact reads {num} features"
            graph = r"lightning_rec: lengths must hold one length per \(feature, sample\)"
            expected = {"load_pt2": size, "aoti_load_package": graph, "torch.jit.load": size}
            if not offset and lens.numel() % num == 0:
                expected = every  # without dense features, F x B' ids are B' samples: a correct request
            cases[label] = (with_(values=vals, lengths=lens, weights=ws), expected)
    negative = lengths.clone()
    negative[0], negative[1] = negative[0] + negative[1] + 1, -1  # adds up: only the sign tells
    raised = {"load_pt2": "lengths holds a negative length", "aoti_load_package": "lightning_rec: lengths holds a "
              "negative length", "torch.jit.load": "lengths holds a negative length"}  # fmt: skip
    cases["negative length"] = (with_(lengths=negative), raised)
    more = lengths.clone()
    more[-1] += 1
    add_up = rf"lengths add up to {int(more.sum())} ids, but values holds {values.numel()}"
    graph_add_up = "lightning_rec: lengths do not add up to the ids in values"
    cases["lengths add up to more ids"] = (with_(lengths=more), {
        "load_pt2": add_up, "aoti_load_package": graph_add_up, "torch.jit.load": add_up})  # fmt: skip
    fewer = lengths.clone()
    fewer[-1] -= 1
    add_up = rf"lengths add up to {int(fewer.sum())} ids, but values holds {values.numel()}"
    cases["lengths add up to fewer ids"] = (with_(lengths=fewer), {
        "load_pt2": add_up, "aoti_load_package": graph_add_up, "torch.jit.load": add_up})  # fmt: skip
    feature, rows = spec.features[-1], spec.feature_rows[-1]
    for bad in (rows, -1):
        ids = values.clone()
        ids[-1] = bad
        named = rf"feature '{feature}': id {bad} is outside its table of {rows} rows"
        cases[f"id {bad}"] = (with_(values=ids), {
            "load_pt2": named, "aoti_load_package": "lightning_rec: an id is outside its feature's table",
            "torch.jit.load": named})  # fmt: skip
    for feature, most in limits.items():  # SASRec: a history longer than max_len aborted the process
        f = spec.features.index(feature)
        long = lengths.clone()
        long[f * batch] = most + 1
        extra = int(long.sum()) - values.numel()
        ids = torch.cat([values[: int(lengths[: f * batch].sum())], torch.zeros(extra + int(lengths[f * batch]), dtype=torch.long),
                         values[int(lengths[: f * batch + 1].sum()) :]])  # fmt: skip
        ws = tuple(torch.ones(ids.numel()) for _ in weights)
        named = rf"feature '{feature}': sample 0 has {most + 1} ids, more than the {most} it may bring"
        cases[f"{feature} of max_len + 1 ids"] = (with_(values=ids, lengths=long, weights=ws), {
            "load_pt2": named, "aoti_load_package": "lightning_rec: a sample has more ids than its feature may bring",
            "torch.jit.load": named})  # fmt: skip
        exact = lengths.clone()
        exact[f * batch] = most
        ids = torch.cat([values[: int(lengths[: f * batch].sum())], torch.arange(most),
                         values[int(lengths[: f * batch + 1].sum()) :]])  # fmt: skip
        ws = tuple(torch.ones(ids.numel()) for _ in weights)
        cases[f"{feature} of max_len ids"] = (with_(values=ids, lengths=exact, weights=ws), every)
    no_ids = tuple(torch.zeros(0) for _ in weights)
    cases["no ids at all"] = (with_(values=values[:0], lengths=torch.zeros_like(lengths), weights=no_ids), every)
    empty_dense = (dense[0][:0],) if offset else ()
    cases["empty batch"] = (with_(values=values[:0], lengths=lengths[:0], dense=empty_dense, weights=no_ids), every)
    one = _good(spec, batch=1, seed=1)
    cases["one sample"] = (one, every)
    cases["float ids"] = (with_(values=values.float()), {
        "load_pt2": r"values holds floating-point numbers; the artifact takes integers", "torch.jit.load": r"values "
        r"holds floating-point numbers; the artifact takes integers", "aoti_load_package": r"input \d \(values\): unmatched dtype"})  # fmt: skip
    if spec.weighted:
        cases["weights float64"] = (with_(weights=(weights[0].double(),)), {
            **every, "aoti_load_package": r"\(weights\): unmatched dtype.*float64"})  # fmt: skip
    return cases


# The serving process: each loader of one model, each case in turn; every outcome is written (and flushed) before the
# next case runs, so an abort leaves the cases before it and names the one it died in.
_RUN = """
import json, sys, torch
import fbgemm_gpu  # noqa: F401  (the kernels' operators, as a serving host imports them)
paths, inputs, report = sys.argv[1], sys.argv[2], sys.argv[3]
paths = json.loads(paths)
cases = torch.load(inputs, weights_only=True)
with open(report, "w") as out:
    for loader in {loaders!r}:
        if loader == "load_pt2":
            from lightning_rec.serving import load_pt2
            model = load_pt2(paths["pt2"])
        elif loader == "aoti_load_package":
            model = torch._inductor.aoti_load_package(paths["pt2"])
        else:
            model = torch.jit.load(paths["pt"])
        for name, args in cases.items():
            out.write(json.dumps({{"loader": loader, "case": name, "started": True}}) + "\\n")
            out.flush()
            before = [a.clone() for a in args]
            try:
                with torch.inference_mode():
                    got = model(*args)
                record = {{"output": got.tolist(), "dtype": str(got.dtype)}}
            except Exception as err:
                record = {{"error": type(err).__name__ + ": " + str(err)}}
            record["mutated"] = [i for i, (a, b) in enumerate(zip(args, before)) if not torch.equal(a, b)]
            out.write(json.dumps({{"loader": loader, "case": name, **record}}) + "\\n")
            out.flush()
print("DONE")
"""


def _serve(paths: dict[str, Path], cases: dict[str, tuple], work: Path) -> tuple[subprocess.CompletedProcess, list]:
    inputs, report = work / "cases.pt", work / "report.jsonl"
    torch.save({name: args for name, (args, _) in cases.items()}, inputs)
    env = {k: v for k, v in os.environ.items() if k != "AOTI_RUNTIME_CHECK_INPUTS"}  # the package's own checks
    out = subprocess.run(
        [sys.executable, "-c", _RUN.format(loaders=LOADERS), json.dumps({k: str(v) for k, v in paths.items()}),
         str(inputs), str(report)],
        capture_output=True, text=True, timeout=600, env=env, cwd=work,
    )  # fmt: skip
    records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return out, records


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_loader_answers_like_the_eager_model_or_raises_whatever_the_caller_passes(served, name, tmp_path):
    """The matrix (see the module): each (case, loader) gives the eager model's output (1e-6) or an error naming
    what is wrong; the process never dies; no loader writes to the caller's tensors."""
    model = served[name]
    cases = _cases(model.spec, LIMITS.get(name, {}))
    out, records = _serve(model.paths, cases, tmp_path)
    last = records[-1] if records else None
    assert out.returncode == 0 and "DONE" in out.stdout, (
        f"the serving process died (exit {out.returncode}) in {last}: {out.stderr[-2000:]}"
    )
    results = {(r["loader"], r["case"]): r for r in records if "started" not in r}
    failures = []
    for case, (args, expected) in cases.items():
        for loader in LOADERS:
            got, want = results[(loader, case)], expected[loader]
            if got["mutated"]:
                failures.append(f"{loader} / {case}: wrote to the caller's arguments {got['mutated']}")
            if want == ANSWER:
                if "error" in got:
                    failures.append(f"{loader} / {case}: raised {got['error'][:300]}")
                    continue
                # no sample: TorchRec's eager KJT cannot be split (IndexError); the answer is no row
                eager = _eager(model, args) if args[-2 if model.spec.weighted else -1].numel() else torch.zeros(0)
                answer = torch.tensor(got["output"]).reshape(eager.shape)
                if not torch.allclose(answer, eager, rtol=0, atol=1e-6):
                    failures.append(
                        f"{loader} / {case}: answered {(answer - eager).abs().max():.3g} off the eager model"
                    )
            elif "error" not in got:
                failures.append(f"{loader} / {case}: answered instead of raising /{want}/")
            elif not re.search(want, got["error"], re.S):
                failures.append(f"{loader} / {case}: raised {got['error'][:400]!r}, not /{want}/")
    assert not failures, "\n".join(failures)


def test_warn_mode_reads_row_zero_for_a_bad_id_and_leaves_the_callers_tensors_alone(served):
    """``--bounds-check warn`` (FBGEMM's serving default): an id outside its table reads row 0, in both formats and
    every loader, and the caller's ``values`` keeps the bad id (FBGEMM's check rewrote it in place, so a caller that
    reused its tensors got other answers); the same call twice gives the same answer."""
    model = served["deepfm"]
    spec = model.specs["warn.pt2"]
    dense, values, lengths = _good(spec, batch=6, seed=3)
    bad = values.clone()
    bad[::3] = torch.tensor(spec.feature_rows).repeat_interleave(6).repeat_interleave(lengths)[::3] + 7
    zeroed = torch.where(bad == values, values, torch.zeros_like(values))
    want = _eager(model, (dense, zeroed, lengths))
    loaders = {
        "load_pt2": load_pt2(model.paths["warn.pt2"]),
        "aoti_load_package": torch._inductor.aoti_load_package(str(model.paths["warn.pt2"])),
        "torch.jit.load": load_inference(model.paths["warn.pt"]),
    }
    for loader, call in loaders.items():
        request = bad.clone()
        with torch.inference_mode():
            first, second = call(dense, request, lengths), call(dense, request, lengths)
        assert torch.equal(request, bad), f"{loader} rewrote the caller's values"
        assert torch.allclose(first, want, rtol=0, atol=1e-6) and torch.equal(first, second), loader


def test_sasrec_serves_its_history_alone_with_its_limit_in_the_spec(served):
    """SASRec's artifact takes the one feature it reads (its history) and records ``max_len`` as that feature's
    limit; its answer is the eager network's with the other features empty (the matrix above checks the rest)."""
    spec = served["sasrec"].spec
    assert spec.features == ["history"] and spec.max_lengths == {"history": zoo_sequential.MAX_LEN}
    assert [r["name"] for r in spec.inputs] == ["values", "lengths"]


def test_the_spec_lists_inputs_output_and_a_warm_up_each_loader_answers(served, tmp_path):
    """The spec lists each argument's name and dtype (what the package takes), the output's meaning, dtype and
    shape, and a warm-up request (ids over the whole tables) with its answer: every loader gives it
    (:func:`warm_up`, ``Pt2Model.warm_up``); a recorded answer that differs is refused."""
    for name, model in served.items():
        spec = model.spec
        dtypes = [(r["name"], r["dtype"]) for r in spec.inputs]
        want = [("dense_features", "float32")] if spec.num_dense_features else []
        want += [("values", "int64"), ("lengths", "int64")] + ([("weights", "float32")] if spec.weighted else [])
        assert dtypes == want, name
        assert spec.output["meaning"] == model.net.serving_output
        got = load_pt2(model.paths["pt2"]).warm_up()
        assert list(got.shape[1:]) == spec.output["shape"][1:] and str(got.dtype) == f"torch.{spec.output['dtype']}"
        assert len(spec.warmup["inputs"][-1 if not spec.weighted else -2]) == 3 * len(spec.features)
        for loaded in (torch._inductor.aoti_load_package(str(model.paths["pt2"])), load_inference(model.paths["pt"])):
            assert torch.equal(warm_up(loaded, model.specs["pt"]), warm_up(loaded, spec))
    spec = served["deepfm"].spec
    broken = type(spec)(
        **{**spec.__dict__, "warmup": {**spec.warmup, "output": [v + 0.01 for v in spec.warmup["output"]]}}
    )
    with pytest.raises(ServingError, match=r"warm-up request gave another output than at export"):
        warm_up(load_pt2(served["deepfm"].paths["pt2"]), broken)


def test_the_input_checks_are_compiled_in_under_this_torch():
    """The code generator that ``aoti_input_checks`` wraps is the installed torch's (a release that renames it fails
    here, by name, before a package is compiled without its checks)."""
    cls = aoti_input_checks_class()
    assert cls.__name__ == "CppWrapperCpu" and callable(cls.generate_input_output_runtime_checks)
