"""``export_inference``: a sharded checkpoint -> a quantized TorchScript artifact (see :mod:`lightning_rec.serving`)."""

import dataclasses
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn

from lightning_rec.config import BoundsCheck
from lightning_rec.errors import ExportError
from lightning_rec.serving.artifact import (
    SPEC_FILE,
    InferenceSpec,
    ServingWrapper,
    SparseOnly,
    example_inputs,
    input_records,
    warmup_record,
)
from lightning_rec.serving.cpu import CpuTarget, compile_options
from lightning_rec.serving.integrity import ARTIFACT_VERSION, seal
from lightning_rec.serving.network import (
    KERNELS,
    call_failed,
    check_row_width,
    network_features,
    num_dense,
    output_meaning,
    position_limits,
    quantize,
    raw_id_features,
    served_features,
    serving_network,
    takes_dense,
)
from lightning_rec.serving.pt2 import check_compiler, stack_versions, write_pt2
from lightning_rec.serving.requests import checked_record, datamodule_state

__all__ = ["Format", "TableDtype", "export_inference"]

TableDtype = Literal["fp32", "fp16", "int8", "int4"]
Format = Literal["torchscript", "pt2", "inference"]  # "inference": the CLI's earlier name for "torchscript"

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float,
    "fp16": torch.half,
    "int8": torch.qint8,
    "int4": torch.quint4x2,
}

# The training strategy's policy names for FBGEMM's modes (an id outside its table).
_BOUNDS_CHECK = {
    "error": BoundsCheckMode.NONE,  # check_inputs, compiled into the artifact, has already read every id and length
    "warn": BoundsCheckMode.WARNING,
    "ignore": BoundsCheckMode.IGNORE,
    "none": BoundsCheckMode.NONE,
}


def export_inference(
    checkpoint: str | Path,
    output: str | Path,
    *,
    format: Format | None = None,
    table_dtype: TableDtype = "int8",
    part: str | None = None,
    model_class: str | type | None = None,
    num_dense_features: int | None = None,
    weights_only: bool | None = None,
    init_args: dict[str, Any] | None = None,
    bounds_check: BoundsCheck = "error",
    datamodule: Any = None,
    cpu: CpuTarget | None = None,
) -> InferenceSpec:
    """Write the serving network of a sharded checkpoint as a quantized TorchScript artifact or ``.pt2`` package
    (one process, CPU).

    Args:
        checkpoint: a checkpoint directory written on any number of ranks with any plan.
        output: the artifact's path (written to a temporary name, then renamed; an existing file is replaced only
            once the new one is complete and, loaded back, gave the eager model's outputs).
        format: ``"torchscript"`` (``torch.jit``; loads with ``torch.jit.load`` in Python or C++) or ``"pt2"``
            (``torch.export`` + AOTInductor, compiled with the machine's C++ compiler in 10-80 s; loads with
            :func:`~lightning_rec.serving.load_pt2`, ``torch._inductor.aoti_load_package`` or C++'s
            ``AOTIModelPackageLoader``, only under the torch and FBGEMM that wrote it: see
            :mod:`lightning_rec.serving.pt2`). Default: ``"pt2"`` for an ``output`` ending in ``.pt2``, else
            ``"torchscript"``. ``"inference"``, the CLI's earlier name for TorchScript, is accepted as ``"torchscript"``
            (the spec records ``"torchscript"``).
        table_dtype: the tables' storage: ``"fp32"`` (the trained rows, bit for bit), ``"fp16"``, ``"int8"`` or
            ``"int4"`` (row-wise quantized, with a per-row scale and bias). The dense layers stay fp32.
        part: which network to export, for modules that serve more than one (the two-tower model's ``"query"`` or
            ``"candidate"`` tower; see the module's ``inference_module``).
        model_class: the LightningModule class (or ``"package.module.Class"``); default: the one the checkpoint
            was saved from.
        num_dense_features: the width of the dense input; default: the module's ``num_dense_features``
            hyperparameter.
        weights_only: ``False`` lets the checkpoint's ``meta.pt`` unpickle arbitrary objects (trusted only).
        init_args: arguments of the module's ``__init__`` the checkpoint did not save (no
            ``save_hyperparameters()``), or that override saved ones, as for ``load_from_checkpoint``.
        bounds_check: what the artifact does with an id outside its table: ``"error"`` (:func:`check_inputs` raises
            a ``ValueError`` naming the feature, the id and the table's rows, and refuses malformed ``lengths``,
            before the kernels run; they then skip their own check), ``"warn"``/``"ignore"`` (a too large id reads row 0,
            FBGEMM's default for inference kernels), ``"none"`` (no check). As the training strategy's
            ``bounds_check``.
        datamodule: the ``TabularDataModule`` (set up, or restored with ``load_state_dict``) whose id mappings,
            transforms and fill values the artifact records as ``raw_inputs`` (see
            :class:`~lightning_rec.serving.RequestEncoder`); default: the one the checkpoint's DataModule state
            holds (Lightning saves it in every checkpoint of a run with a ``TabularDataModule``).
        cpu: ``"pt2"`` only: the CPUs the compiled code is for, recorded in the spec and checked by every loader:
            ``"portable"`` (the default: on x86-64 the ``x86-64-v3`` level, AVX2) or ``"native"`` (the exporting
            CPU's instruction sets, AVX-512 and AMX where it has them); see :mod:`lightning_rec.serving.cpu`.

    Returns:
        the artifact's :class:`InferenceSpec`.

    Raises:
        ExportError: naming the part of the model that cannot be exported and why (or, for ``"pt2"``, a missing C++
            compiler, with what to install); nothing is written then.
        CheckpointError: the checkpoint is incomplete, corrupt or does not match the module.

    Example::

        spec = export_inference("checkpoints/last.ckpt", "query_tower.pt", part="query", table_dtype="fp16")
        spec.features           # ['user_id', 'history', ...]: the order of `lengths`
        export_inference("checkpoints/last.ckpt", "model_int8.pt2")     # a .pt2 package (format="pt2")
    """
    from lightning_rec.checkpoint import _safe_io as safe_io
    from lightning_rec.checkpoint._export import load_module, with_pinned

    output = Path(output)
    format = format or ("pt2" if output.suffix == ".pt2" else "torchscript")
    if format == "inference":  # the CLI's earlier name (`--format inference`): what a user wrote keeps working
        format = "torchscript"
    if format not in ("torchscript", "pt2"):
        raise ExportError(f"format must be 'torchscript' (alias 'inference') or 'pt2', got {format!r}.")
    if table_dtype not in _DTYPES:
        raise ExportError(f"table_dtype must be one of {sorted(_DTYPES)}, got {table_dtype!r}.")
    if bounds_check not in _BOUNDS_CHECK:
        raise ExportError(f"bounds_check must be one of {list(_BOUNDS_CHECK)}, got {bounds_check!r}.")
    if format == "pt2" and output.suffix != ".pt2":
        raise ExportError(
            f"{str(output)!r}: a .pt2 package's name must end in .pt2 (PyTorch's loaders refuse any other name)."
        )
    if cpu is not None and format != "pt2":
        raise ExportError(f"cpu={cpu!r} applies to --format pt2 (compiled code); TorchScript artifacts hold none.")
    if cpu not in (None, "portable", "native"):
        raise ExportError(f"cpu must be 'portable' or 'native', got {cpu!r}.")
    options, cpu_record = compile_options(cpu or "portable") if format == "pt2" else ({}, None)
    if format == "pt2":
        check_compiler()  # before anything is loaded: minutes of work would end there
    path = Path(checkpoint)
    meta, identity = with_pinned(path, lambda pinned: (safe_io.load_meta(pinned, weights_only), pinned.identity))
    cls = _model_class(model_class, meta, path)
    module: nn.Module = load_module(cls, path, weights_only=weights_only, **(init_args or {})).eval()
    net = serving_network(module, part)
    feature_rows, weighted, tables = network_features(net)
    all_features = list(feature_rows)
    features = served_features(net, all_features)  # what the artifact takes (the rest passed empty)
    check_row_width(tables, table_dtype, type(net).__name__)
    dense = takes_dense(net)
    num_dense_features = num_dense(module, num_dense_features, net, all_features, weighted) if dense else 0
    rows = [feature_rows[f] for f in features]
    limits = position_limits(net)
    spec = InferenceSpec(
        features=features,
        num_dense_features=num_dense_features,
        weighted=weighted,
        table_dtype=table_dtype,
        tables=tables,
        model=f"{cls.__module__}.{cls.__qualname__}",
        part=part,
        bounds_check=bounds_check,
        format=format,
        feature_rows=rows,
        raw_id_features=sorted(raw_id_features(net)),
        max_lengths={f: n for f, n in limits.items() if f in features},
        versions=stack_versions(),
        artifact_version=ARTIFACT_VERSION,
        checkpoint={"step": int(meta.get("global_step", 0)), "id": identity},
        cpu=cpu_record,
        raw_inputs=checked_record(
            datamodule.state_dict() if datamodule is not None else datamodule_state(meta),
            features,
            num_dense_features,
            weighted,
        ),
        inputs=input_records(num_dense_features, len(features), weighted),
    )
    # The network itself, not a copy: `module` was loaded for this export alone, and quantize() swaps its tables for
    # the quantized ones in place, so that each float table is freed as soon as its quantized one exists (a copy
    # held a second float copy of every table: 1.28 GB more at 5M x 64).
    serving = ServingWrapper(
        net,
        features,
        dense,
        rows,
        exported=format == "pt2",
        raw_id_features=spec.raw_id_features,
        max_lengths=spec.max_lengths,
        num_dense=num_dense_features,
        network_features=all_features,
        # FBGEMM's warn/ignore bounds checks set a too large id to 0 in the tensor they are given: never the caller's
        copy_values=bounds_check in ("warn", "ignore"),
        check_ids=bounds_check == "error",  # the lengths and dense shapes are checked under every policy
    ).eval()
    # The training module's own tensors under their training keys, before quantize() renames what it wraps (a
    # feature processor's position weights): the package records which of its constants each one is. The float
    # tables are left out: quantize() frees each one once its quantized table exists.
    table_weights = tuple(f"{kind}.{t}.weight" for t in tables for kind in ("embedding_bags", "embeddings"))
    training = {k: v for k, v in module.state_dict(keep_vars=True).items() if not k.endswith(table_weights)}
    quantized = quantize(serving, _DTYPES[table_dtype])
    for kernel in quantized.modules():
        if type(kernel).__name__ in KERNELS:  # TorchScript keeps the attribute in the artifact
            kernel.bounds_check_mode_int = _BOUNDS_CHECK[bounds_check].value
    example = example_inputs(spec)
    try:
        with torch.no_grad():
            quantized(*example)  # TorchRec caches the feature order on the first call: it must not be the trace's
    except Exception as err:
        raise ExportError(call_failed(module, net, dense, err)) from err
    served = SparseOnly(quantized) if not dense else quantized
    warmup = warmup_record(spec, served)
    out = torch.tensor(warmup["output"])
    spec = dataclasses.replace(
        spec,
        output={"meaning": output_meaning(net), "dtype": "float32", "shape": ["B", *out.shape[1:]]},
        warmup=warmup,
    )
    if format == "pt2":
        return write_pt2(served, spec, output, options, training=training)
    scripted = _script(served, type(net).__name__)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    raw = output.with_name(f".{output.name}.raw")
    try:
        scripted.save(str(raw), _extra_files={SPEC_FILE: json.dumps(asdict(spec))})
        _without_debug_info(raw, partial)
    finally:
        raw.unlink(missing_ok=True)
    seal(partial)
    os.replace(partial, output)
    return spec


def _without_debug_info(source: Path, target: Path) -> None:
    """Copy the TorchScript archive ``source`` to ``target`` without its ``*.debug_pkl`` records: the source ranges
    of error messages, which hold the absolute path of every Python file the code came from (this machine's
    site-packages and working copy). ``torch.jit.load`` (Python, C++) reads an archive without them; a runtime error
    then names the TorchScript code's line instead of the Python source's."""
    reader = torch._C.PyTorchFileReader(str(source))
    writer = torch._C.PyTorchFileWriter(str(target))
    for name in reader.get_all_records():
        if not name.endswith(".debug_pkl"):
            data = reader.get_record(name)
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()


def _model_class(model_class: str | type | None, meta: dict[str, Any], path: Path) -> type:
    """The class to rebuild: the one the user names (imported as named), else the one the checkpoint names, imported
    only from installed code, never from inside or beside the checkpoint (see
    :mod:`lightning_rec.checkpoint._named_class`)."""
    from lightning_rec.checkpoint._named_class import named_class

    name = model_class or meta.get("lightning_rec", {}).get("module_class")
    if name is None:
        raise ExportError(
            f"{str(path)!r} does not name the LightningModule it was saved from (checkpoints written before "
            "lightning_rec recorded it). HINT: pass `model_class=` (`--model-class package.module.Class`)."
        )
    return named_class(name, path, named_by_user=model_class is not None)


def _script(model: nn.Module, name: str) -> torch.jit.ScriptModule:
    from torchrec.fx import Tracer

    try:
        graph = Tracer(leaf_modules=KERNELS).trace(model)
    except Exception as err:  # fx raises several types; the message names the construct
        raise ExportError(
            f"{name} cannot be traced for serving (torch.fx): {type(err).__name__}: {err}. HINT: serving needs a "
            "forward without data-dependent Python control flow (branch on tensor values, .item(), .tolist())."
        ) from err
    try:
        return torch.jit.script(torch.fx.GraphModule(model, graph))
    except Exception as err:
        raise ExportError(f"{name} cannot be compiled with TorchScript: {type(err).__name__}: {err}") from err
