"""Export: a sharded checkpoint -> one ordinary, unsharded state dict file, for inference and for people who
do not use this package.

Example::

    from lightning_rec.checkpoint import export
    export("checkpoints/last.ckpt", "model.safetensors")            # or "model.pt" (torch.save, weights only)

    state = safetensors.torch.load_file("model.safetensors")        # or torch.load("model.pt", weights_only=True)
    model = MyModel(...)                                            # the plain, unsharded model
    model.load_state_dict(state, assign=True)                       # assign=True: tables built on "meta"

or from the shell: ``lightning-rec export checkpoints/last.ckpt model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_rec.checkpoint import layout, safe_io


def export(checkpoint: "str | Path", output: "str | Path", *, prefix: str = "", verify_hashes: bool = True) -> Dict[str, torch.Size]:
    """Write the model weights of a sharded checkpoint as one unsharded state dict file (one process, no GPU).

    Every table is assembled whole from its shards (so this needs memory for the whole model, once);
    optimizer state is left out.

    Args:
        checkpoint: a checkpoint directory written on any number of ranks with any plan.
        output: ``*.safetensors`` for safetensors, anything else for a ``torch.save`` file that loads with
            ``torch.load(..., weights_only=True)``. Written to a temporary name, then renamed.
        prefix: export only the weights under this prefix, without it: e.g. ``"model."`` gives the state dict of
            the ``nn.Module`` a LightningModule holds as ``self.model`` (``""``: everything).
        verify_hashes: check the checkpoint files' SHA-256 first.

    Returns:
        the exported names and shapes.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt, or no weight is under ``prefix``.
    """
    path, output = layout.recover(Path(checkpoint)), Path(output)
    problems = layout.verify_files(path, layout.read_manifest(path), 0, 1, hashes=verify_hashes)
    if problems:
        raise layout.CheckpointError(f"Cannot export {str(path)!r}:\n  - " + "\n  - ".join(problems))
    metadata = safe_io.read_metadata(path)
    targets: Dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(layout.MODEL_PREFIX + prefix) and isinstance(md, TensorStorageMetadata):
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if not targets:
        raise layout.CheckpointError(f"{str(path)!r} has no model weights under prefix {prefix!r}.")
    dcp.load(targets, storage_reader=safe_io.SafeFileSystemReader(path), no_dist=True)
    state = {}
    for key, tensor in targets.items():
        state[key[len(layout.MODEL_PREFIX + prefix):]] = tensor.contiguous()
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(partial), metadata={"format": "pt", "source": str(path)})
    else:
        torch.save(state, partial)
    partial.replace(output)
    return {k: v.shape for k, v in state.items()}


def load_exported(path: "str | Path", device: Optional[str] = "cpu") -> Dict[str, torch.Tensor]:
    """Read a file written by :func:`export` (safetensors or weights-only torch) as a state dict."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=device or "cpu")
    return torch.load(path, map_location=device, weights_only=True)
