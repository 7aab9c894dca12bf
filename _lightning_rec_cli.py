"""The ``lightning-rec`` console script's first stop: it answers ``lightning-rec --help`` without importing torch,
TorchRec or Lightning (hundredths of a second instead of about five), then hands every other command to
``lightning_rec._cli``.

It lives outside the ``lightning_rec`` package on purpose: importing any ``lightning_rec.*`` module first runs the
package's ``__init__``, which imports TorchRec and FBGEMM and registers the ``recshard`` strategy with Lightning.
When TorchRec, FBGEMM or torch is missing or cannot load, that ``__init__`` says what to install in one line, and
this prints that line (exit 1) instead of a traceback.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

__all__ = ["main"]

_PROG = "lightning-rec"
# The commands `lightning_rec._cli.run` dispatches: LightningCLI's four (its parser describes them in full) and the
# four handled before LightningCLI. A test compares this list with that parser's.
COMMANDS = {
    "fit": "train (and validate) a model: lightning-rec fit --config deepfm",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "predictions for the predict set",
    "plan": "the sharding plan fit would make, for a cluster of any size, made on this machine",
    "export": "a sharded checkpoint to one unsharded state dict, or a servable artifact",
    "prepare": "fetch or convert a dataset ahead of time",
    "index": "a FAISS index of the catalogue from a two-tower checkpoint's candidate tower",
}


def shipped_configs() -> list[str]:
    """The names of the configs shipped inside the package (``lightning_rec/configs/NAME.yaml``), found without
    importing it."""
    spec = find_spec("lightning_rec")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted({p.stem for folder in folders for p in (Path(folder) / "configs").glob("*.yaml")})


def help_text() -> str:
    width = max(map(len, COMMANDS)) + 2
    commands = "\n".join(f"  {name:<{width}}{text}" for name, text in COMMANDS.items())
    names = ", ".join(shipped_configs()) or "(none found)"
    return (
        f"usage: {_PROG} COMMAND [--config CONFIG] [--trainer.X=... --model.X=... --data.X=...]\n\n"
        "TorchRec's sharded recommendation training under Lightning: LightningCLI's commands, and four of its "
        "own.\n\n"
        f"commands (each answers --help):\n{commands}\n\n"
        "--config takes a YAML file, or the name of a shipped config (its end is enough when only one ends so: "
        f"deepfm):\n  {names}\n\n"
        "options:\n  -h, --help  show this help and exit\n"
    )


def main() -> None:
    """The ``lightning-rec`` console script (arguments from ``sys.argv``)."""
    argv = sys.argv[1:]
    if argv in (["-h"], ["--help"]):
        sys.stdout.write(help_text())
        return
    if not argv:
        sys.stderr.write(f"usage: {_PROG} COMMAND ...\n{_PROG}: error: give a command: {', '.join(COMMANDS)}\n")
        sys.exit(2)
    try:
        from lightning_rec._cli import main as cli_main
    except ImportError as err:
        if err.name is not None and err.name.partition(".")[0] in ("torch", "torchrec", "fbgemm_gpu"):
            sys.exit(f"{_PROG}: error: {err}")  # lightning_rec/__init__.py's one line: what to install
        raise
    cli_main()


if __name__ == "__main__":
    main()
