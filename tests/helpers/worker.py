"""Entry point of one rank: ``python -m tests.helpers.worker SCENARIO CONFIG_JSON OUT_DIR``.

SCENARIO is a function name in ``tests.helpers.scenarios``, or ``module:function`` for scenarios kept
elsewhere (e.g. ``tests.helpers.metric_scenarios:auroc``).
"""

import importlib
import json
import os
import sys
from pathlib import Path

from tests.helpers import scenarios


def main() -> None:
    name, config, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    if "RANK" in os.environ:  # torchrun and torchrun-like launchers
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:  # srun
        rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    module, _, func = name.rpartition(":")
    scenario = getattr(importlib.import_module(module) if module else scenarios, func)
    result = scenario(rank=rank, world_size=world_size, out_dir=out_dir, **config)
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    # Then exit as a user's script does: no barrier, no os._exit. A finished job must exit 0 on its own (the
    # strategy tears its process group down at exit: lightning_rec.faults.close_process_group_at_exit).


if __name__ == "__main__":
    main()
