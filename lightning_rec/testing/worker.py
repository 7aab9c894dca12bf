"""Entry point of one rank: ``python -m lightning_rec.testing.worker SCENARIO CONFIG_JSON OUT_DIR [MODULE]``.

SCENARIO is ``module:function``, or a function name in MODULE (see :func:`lightning_rec.testing.launch.launch`).
"""

import importlib
import json
import os
import sys
from pathlib import Path

__all__ = ["main"]


def main() -> None:
    """Run one rank's scenario and write its result to ``OUT_DIR/<SCENARIO>.rank<R>.json``."""
    name, config, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    default_module = sys.argv[4] if len(sys.argv) > 4 else None
    if "RANK" in os.environ:  # torchrun and torchrun-like launchers
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:  # srun
        rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    module, _, func = name.rpartition(":")
    module = module or default_module or ""
    if not module:
        raise ValueError(f"scenario {name!r} names no module: give 'module:function', or the module of the scenarios")
    scenario = getattr(importlib.import_module(module), func)
    result = scenario(rank=rank, world_size=world_size, out_dir=out_dir, **config)
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    # Then exit as a user's script does: no barrier, no os._exit. A finished job must exit 0 on its own (the
    # strategy tears its process group down at exit: lightning_rec._strategy.faults.close_process_group_at_exit).


if __name__ == "__main__":
    main()
