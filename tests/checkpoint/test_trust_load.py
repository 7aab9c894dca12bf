"""Loading and exporting a checkpoint from someone else (issue 51, items 1 and 7): no code of the checkpoint runs,
and its manifest and index cannot make a load read outside its folder, read without end, or leave a tensor out.

Each case crafts a checkpoint as an attacker or a damaged disk would: a tiny real checkpoint (an ``nn.Linear``
saved by :func:`lightning_rec.checkpoint._io.save`, no Trainer), then one file changed and the manifest sealed again
(so that only the check under test stands between the file and the loader).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_rec import _cli as cli
from lightning_rec.checkpoint import CheckpointError, _io, _layout, _safe_io, export, is_checkpoint, load_exported
from lightning_rec.checkpoint._named_class import named_class
from lightning_rec.serving import export_inference
from lightning_rec.testing import shell_env

_PAYLOAD = """\
from pathlib import Path
Path({marker!r}).write_text("ran")  # what an attacker's module does on import
import lightning.pytorch as pl
class Model(pl.LightningModule):
    pass
"""


def _saved_as(module_class: str, path: Path) -> Path:
    """A tiny real checkpoint at ``path`` whose ``meta.pt`` names ``module_class`` as the class it was saved from."""
    module_name, _, name = module_class.rpartition(".")
    cls = type(name, (nn.Linear,), {"__module__": module_name, "__qualname__": name})
    torch.manual_seed(0)
    module = cls(3, 2)
    _io.save({"state_dict": module.state_dict(), "global_step": 1}, path, module=module)
    return path


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """One tiny checkpoint (two tensors, ``model/weight`` and ``model/bias``, in two files) and its export."""
    work = tmp_path_factory.mktemp("original")
    path = _saved_as("lightning_rec.RecLightningModule", work / "c.ckpt")
    export(path, work / "weights.pt")
    return path, load_exported(work / "weights.pt")


@pytest.fixture
def ckpt(original, tmp_path):
    """A fresh copy of the tiny checkpoint to tamper with."""
    copy = tmp_path / "run" / "c.ckpt"
    shutil.copytree(original[0], copy, symlinks=True)
    return copy


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _seal(folder: Path, files: dict | None = None) -> None:
    """Write ``folder``'s manifest again: its listed files' sizes and hashes as they are now, plus ``files``."""
    manifest = json.loads((folder / "COMPLETE").read_text())
    listed = {n: _digest((folder / n).read_bytes()) for n in manifest["files"] if (folder / n).is_file()}
    manifest["files"] = {**listed, **(files or {})}
    (folder / "COMPLETE").unlink()
    (folder / "COMPLETE").write_text(json.dumps(manifest))


def _tamper_metadata(folder: Path, change) -> None:
    """Apply ``change`` to the checkpoint's DCP index (``.metadata``) and seal the manifest again."""
    metadata = _safe_io.read_metadata(folder)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _seal(folder)


def _storage_of(metadata, key: str) -> MetadataIndex:
    return next(index for index in metadata.storage_data if index.fqn == key)


# ---------------------------------------------------------------------------------------------------------
# Item 7: a manifest cannot reach outside its folder
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parent", "absolute", "nested"])
def test_a_manifest_entry_naming_a_file_outside_the_folder_is_refused_by_name(ckpt, tmp_path, kind):
    """An entry ``../secret.bin`` (or its absolute path, or ``x/../../secret.bin``) with the right size and hash of
    a file outside the checkpoint is refused, naming the entry, by the export and by the checks that find
    checkpoints (``is_checkpoint``, ``read_manifest``)."""
    secret = ckpt.parent / "secret.bin"
    secret.write_bytes(b"not the checkpoint's")
    name = {"parent": "../secret.bin", "absolute": str(secret), "nested": "x/../../secret.bin"}[kind]
    _seal(ckpt, {name: _digest(secret.read_bytes())})
    with pytest.raises(CheckpointError, match=rf"the manifest entry {name!r} is not a file name inside the checkpoint"):
        export(ckpt, tmp_path / "out.pt")
    with pytest.raises(CheckpointError, match="not a file name inside"):
        _layout.read_manifest(ckpt)
    assert not is_checkpoint(ckpt) and not (tmp_path / "out.pt").exists()


def test_a_symlink_out_of_the_folder_is_refused_and_one_inside_it_is_followed(ckpt, original, tmp_path):
    """``meta.pt`` replaced by a link to an identical copy outside the folder: refused, naming the entry and where it
    leads. The same link to a file inside the folder is an ordinary checkpoint and exports the same weights."""
    outside = ckpt.parent / "meta.copy"
    shutil.move(ckpt / "meta.pt", outside)
    (ckpt / "meta.pt").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"'meta.pt' is a symbolic link to .*meta.copy', outside the checkpoint"):
        export(ckpt, tmp_path / "out.pt")
    (ckpt / "meta.pt").unlink()
    shutil.move(outside, ckpt / "meta.real")
    (ckpt / "meta.pt").symlink_to("meta.real")  # relative, inside
    export(ckpt, tmp_path / "out.pt")
    got, want = load_exported(tmp_path / "out.pt"), original[1]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(30)  # a regression hangs (reads /dev/zero or waits for a FIFO's writer): it fails here instead
@pytest.mark.parametrize("entry", ["devzero_link", "devzero_name", "fifo", "complete_devzero", "complete_fifo"])
def test_an_entry_that_never_ends_or_blocks_is_refused_before_reading(ckpt, tmp_path, entry):
    """A data file linked to ``/dev/zero`` (recorded size 0, so a size check alone passes and the hash reads on
    forever), the name ``/dev/zero`` itself, a FIFO inside the folder, and ``COMPLETE`` itself a link to
    ``/dev/zero`` or a FIFO: each refused at once, naming it, nothing read."""
    data = "__0_0.distcp"
    if entry == "devzero_link":
        (ckpt / data).unlink()
        (ckpt / data).symlink_to("/dev/zero")
        _seal(ckpt, {data: _digest(b"")})
        message = rf"'{data}' is a symbolic link to '/dev/zero', outside the checkpoint folder"
    elif entry == "devzero_name":
        _seal(ckpt, {"/dev/zero": _digest(b"")})
        message = r"the manifest entry '/dev/zero' is not a file name inside"
    elif entry == "fifo":
        (ckpt / data).unlink()
        os.mkfifo(ckpt / data)
        _seal(ckpt, {data: _digest(b"")})
        message = rf"the manifest entry '{data}' is not a regular file \(a FIFO\)"
    else:
        (ckpt / "COMPLETE").unlink()
        if entry == "complete_fifo":
            os.mkfifo(ckpt / "COMPLETE")
            message = r"'COMPLETE' is not a regular file \(a FIFO\)"
        else:
            (ckpt / "COMPLETE").symlink_to("/dev/zero")
            message = r"'COMPLETE' is a symbolic link to '/dev/zero'"
    with pytest.raises(CheckpointError, match=message):
        export(ckpt, tmp_path / "out.pt")
    if entry.startswith("complete"):  # what finds checkpoints (`ckpt_path="last"`) skips it, without blocking
        assert not is_checkpoint(ckpt)


@pytest.mark.parametrize("case", ["outside", "unlisted", "past_the_end"])
def test_a_storage_entry_outside_the_listed_files_is_refused_naming_the_tensor(ckpt, tmp_path, case):
    """DCP's index (``.metadata``) says where each tensor's bytes are: a file name leading out of the folder, a file
    the manifest does not list, or bytes past a file's recorded size are refused, naming the tensor."""
    (ckpt / "extra.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())

    def change(metadata):
        index = _storage_of(metadata, "model/weight")
        info = metadata.storage_data[index]
        if case == "outside":
            info.relative_path = "../extra.distcp"
        elif case == "unlisted":
            info.relative_path = "extra.distcp"
        else:
            info.length = (ckpt / info.relative_path).stat().st_size + 1 << 30

    _tamper_metadata(ckpt, change)
    message = {
        "outside": r"the file of the tensor 'model/weight' '../extra.distcp' is not a file name inside",
        "unlisted": r"the tensor 'model/weight' is stored in 'extra.distcp', a file the checkpoint's manifest does not",
        "past_the_end": r"the tensor 'model/weight' is stored at bytes 0-\d+ of '__0_\d.distcp', which has \d+ bytes",
    }[case]
    with pytest.raises(CheckpointError, match=message):
        export(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("case", ["bytes_entry", "dropped_storage", "dropped_chunk"])
def test_a_tensor_missing_from_the_index_is_an_error_naming_it_not_a_skip(ckpt, tmp_path, capsys, case):
    """A tensor whose index entry was turned into a DCP "bytes" entry, whose storage item was dropped, or whose only
    chunk was dropped: the export fails naming it (before, the first wrote the other tensors and exited 0, the last
    left the tensor's memory uninitialised); from the shell, in one line with exit 2."""

    def change(metadata):
        if case == "bytes_entry":
            metadata.state_dict_metadata["model/bias"] = BytesStorageMetadata()
        elif case == "dropped_storage":
            del metadata.storage_data[_storage_of(metadata, "model/bias")]
        else:
            metadata.state_dict_metadata["model/bias"].chunks.clear()

    _tamper_metadata(ckpt, change)
    message = {
        "bytes_entry": "the tensor 'model/bias' is recorded as a pickled object, not a tensor",
        "dropped_storage": r"the tensor 'model/bias' has no stored data for its chunk at \[0\]",
        "dropped_chunk": "the tensor 'model/bias' is stored as 0 of its 2 elements",
    }[case]
    with pytest.raises(CheckpointError, match=message):
        export(ckpt, tmp_path / "out.pt")
    with pytest.raises(SystemExit) as exit_:
        cli.run(["export", str(ckpt), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.replace("\\", "") in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists()


def test_a_tensor_whose_bytes_cannot_be_read_is_an_error_naming_it(ckpt, tmp_path):
    """A data file damaged where ``model/bias`` is stored, the manifest sealed again so that the hashes agree: the
    export fails naming the tensor, not with a zip or unpickling traceback."""
    metadata = _safe_io.read_metadata(ckpt)
    info = metadata.storage_data[_storage_of(metadata, "model/bias")]
    data = bytearray((ckpt / info.relative_path).read_bytes())
    data[info.offset : info.offset + 4] = b"\0\0\0\0"  # the stored tensor's zip header
    (ckpt / info.relative_path).write_bytes(bytes(data))
    _seal(ckpt)
    with pytest.raises(CheckpointError, match=r"the tensor 'model/bias' \(chunk at \[0\]\) cannot be read"):
        export(ckpt, tmp_path / "out.pt")


# ---------------------------------------------------------------------------------------------------------
# Item 1: no checkpoint runs code
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def beside_the_working_directory(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory, on ``sys.path`` as ``python -m`` or an interactive session puts it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("vendorckpt", "evil", "mine", "goodpkg")]:
        del sys.modules[name]


@pytest.mark.parametrize("where", ["inside", "inside_namespace", "beside"])
def test_a_module_inside_or_beside_the_checkpoint_is_never_imported(beside_the_working_directory, where):
    """The checkpoint names a LightningModule in a module shipped inside its folder (``vendorckpt/payload.py``, as a
    package or a namespace package) or beside it (``evil.py``), with the working directory on ``sys.path``: refused
    in one line saying how to name the class; the module's code never ran (its marker is absent)."""
    work = beside_the_working_directory
    marker = work / "marker"
    if where == "beside":
        ckpt, name = _saved_as("evil.Model", work / "vendorckpt"), "evil.Model"
        (work / "evil.py").write_text(_PAYLOAD.format(marker=str(marker)))
    else:
        ckpt, name = _saved_as("vendorckpt.payload.Model", work / "vendorckpt"), "vendorckpt.payload.Model"
        (ckpt / "payload.py").write_text(_PAYLOAD.format(marker=str(marker)))
        if where == "inside":
            (ckpt / "__init__.py").write_text(_PAYLOAD.format(marker=str(marker)))
    with pytest.raises(CheckpointError) as err:
        export_inference(Path("vendorckpt"), work / "out.pt")
    message = str(err.value)
    assert f"names {name!r} as the LightningModule it was saved from" in message, message
    assert ("inside the checkpoint folder" if where != "beside" else "beside the checkpoint folder") in message
    assert "--model-class package.module.Class" in message and "\n" not in message
    assert not marker.exists() and not (work / "out.pt").exists()


@pytest.mark.parametrize(
    "name, why",
    [
        ("subprocess.Popen", r"from Python's standard library \(subprocess\)"),
        ("os.system", r"from Python's standard library \(os\)"),
        ("builtins.eval", r"from Python's standard library \(builtins\)"),
        ("torch.nn.Linear", "which is the class Linear, not a LightningModule class"),
        ("lightning_rec.checkpoint.export", "which is a function, not a LightningModule class"),
        ("os.path..join", "which is not a dotted class name"),
    ],
)
def test_a_checkpoint_naming_anything_but_a_lightning_module_is_refused_in_one_line(tmp_path, capsys, name, why):
    """``subprocess.Popen``, ``os.system`` (nothing imported from the standard library for it), an installed class
    or function that is not a LightningModule, a name that is no class name: the export refuses in one line (the
    shell: exit 2, no traceback) saying how to name the class."""
    ckpt = _saved_as("lightning_rec.RecLightningModule", tmp_path / "c.ckpt")
    meta = _safe_io.load_meta(ckpt / "meta.pt")
    meta["lightning_rec"]["module_class"] = name
    (ckpt / "meta.pt").write_bytes(_safe_io.dumps_meta(meta))
    _seal(ckpt)
    with pytest.raises(CheckpointError, match=rf"names {name!r} as the LightningModule it was saved from, {why}"):
        export_inference(ckpt, tmp_path / "out.pt")
    with pytest.raises(SystemExit) as exit_:
        cli.run(["export", str(ckpt), str(tmp_path / "out.pt"), "--format", "inference"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--model-class package.module.Class" in err and not (tmp_path / "out.pt").exists()


def test_an_installed_class_and_one_the_user_names_are_imported(beside_the_working_directory):
    """A correct model is not refused: a checkpoint naming a class of a package found on ``sys.path`` away from the
    checkpoint (here a folder added as an installed package's would be) or of this package gets it; a class the user
    names is imported as named, even beside the checkpoint (their own code)."""
    work = beside_the_working_directory
    site = work / "site" / "goodpkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "models.py").write_text("import lightning.pytorch as pl\nclass Model(pl.LightningModule):\n    pass\n")
    sys.path.insert(1, str(work / "site"))
    try:
        ckpt = work / "runs" / "version_0" / "last.ckpt"
        assert named_class("goodpkg.models.Model", ckpt, named_by_user=False).__module__ == "goodpkg.models"
    finally:
        sys.path.remove(str(work / "site"))
    from lightning_rec.models import DLRMModule

    assert named_class("lightning_rec.models.dlrm.DLRMModule", ckpt, named_by_user=False) is DLRMModule
    (work / "mine.py").write_text(_PAYLOAD.format(marker=str(work / "mine_ran")))
    with pytest.raises(CheckpointError, match="beside the checkpoint folder"):
        named_class("mine.Model", work / "vendorckpt", named_by_user=False)
    assert not (work / "mine_ran").exists()
    assert named_class("mine.Model", work / "vendorckpt", named_by_user=True).__name__ == "Model"
    assert (work / "mine_ran").exists()


def test_a_class_in_the_working_directory_is_imported_only_when_the_user_names_it(tmp_path, monkeypatch):
    """Trained with ``python train.py`` beside ``models.py`` (the checkpoint names ``models.Model``), exported from
    that folder: the working directory is not searched for the checkpoint's class, so the export stops in one line
    that says which ``--model-class`` to pass; ``models.py`` did not run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (tmp_path / "models.py").write_text(_PAYLOAD.format(marker=str(tmp_path / "ran")))
    ckpt = _saved_as("models.Model", tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    with pytest.raises(CheckpointError) as err:
        export_inference(ckpt, tmp_path / "out.pt")
    assert "models is in the working directory" in str(err.value) and "`--model-class models.Model`" in str(err.value)
    assert not (tmp_path / "ran").exists() and "models" not in sys.modules


@pytest.mark.dist
def test_exporting_a_vendor_checkpoint_from_its_folder_runs_none_of_its_code(tmp_path):
    """The issue's case as a user meets it: ``lightning-rec export vendorckpt out.pt --format inference`` run from
    the folder holding ``vendorckpt/`` (whose ``payload.py`` and ``__init__.py`` write a marker on import and whose
    ``meta.pt`` names ``vendorckpt.payload.Model``): exit 2, one line saying how to name the class, no traceback, no
    marker, no artifact. (With the working directory on ``sys.path``, as under ``python -m``: the in-process cases
    above.)"""
    ckpt = _saved_as("vendorckpt.payload.Model", tmp_path / "vendorckpt")
    marker = tmp_path / "marker"
    (ckpt / "payload.py").write_text(_PAYLOAD.format(marker=str(marker)))
    (ckpt / "__init__.py").write_text(_PAYLOAD.format(marker=str(marker)))
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("lightning-rec")),
            "export",
            "vendorckpt",
            "out.pt",
            "--format",
            "inference",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=shell_env(),
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'vendorckpt.payload.Model'" in lines[0] and "inside the checkpoint folder" in lines[0]
    assert "--model-class package.module.Class" in lines[0]
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
