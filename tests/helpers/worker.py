"""Entry point of one rank: ``python -m tests.helpers.worker SCENARIO CONFIG_JSON OUT_DIR``.

SCENARIO is a function name in ``tests.helpers.scenarios``, or ``module:function`` for scenarios kept
elsewhere (e.g. ``tests.helpers.metric_scenarios:auroc``).
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

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
    if dist.is_initialized():
        # No rank may leave while another still reads from it. Then leave without tearing gloo down: a rank that
        # destroys its process group while a peer is still closing the last collective can make that peer abort
        # ("terminate called without an active exception"), which failed CI once. The result file is written.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
