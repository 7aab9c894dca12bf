"""torchrun, stopped by a signal in one line: ``python -m lightning_rec.integrations.torchrun`` takes torchrun's
arguments and runs torchrun's agent in this process, unchanged, but for its end when the agent itself is signalled.

Kubernetes stops a pod by sending SIGTERM to the container's first process, torchrun's agent. The agent passes it to
its ranks, which save and exit 143 (:mod:`lightning_rec._strategy.preemption`), and then raises
``SignalException`` out of ``main``: a 20-line traceback after the ranks' lines, and exit code 1, as if the
launcher had failed. Here the agent ends with one line and ``128 + signal`` (143 for SIGTERM), the ranks' own code::

    torchrun: stopped by SIGTERM; its ranks were passed the signal and have ended (exit 143)

Every other outcome (the job's end, a rank's failure and its report, ``--help``) is torchrun's own.

Example::

    python -m lightning_rec.integrations.torchrun --nproc-per-node 2 --max-restarts 3 \\
        -m lightning_rec fit --config my.yaml --ckpt_path=last
"""

from __future__ import annotations

import signal
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Run torchrun (``torch.distributed.run``) with ``argv`` (``None``: ``sys.argv[1:]``); a signal to the agent
    ends it with one line on stderr and exit code ``128 + signal``.

    Raises:
        SystemExit: torchrun's exit, or ``128 + signal`` after a signal.
    """
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run.main(argv)
    except SignalException as stop:
        number = int(stop.sigval)
        code = 128 + number
        name = signal.Signals(number).name
        print(
            f"torchrun: stopped by {name}; its ranks were passed the signal and have ended (exit {code})",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(code) from None


if __name__ == "__main__":
    main()
