"""Free TCP ports on the loopback interface, for ``MASTER_PORT`` and rendezvous endpoints; the environment of a
rank started by hand, and of a user's fresh shell."""

from __future__ import annotations

import os
import socket

__all__ = ["RENDEZVOUS_VARS", "free_port", "rank_env", "shell_env"]

# What torchrun (or an earlier in-process run) leaves in the environment: a fresh shell has none of them.
RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on ``127.0.0.1`` that no process was listening on a moment ago.

    The port is released before it is returned, so another process could take it in between; good enough for
    starting test and benchmark ranks on one machine.

    Returns:
        The port number.

    Example::

        >>> from lightning_rec.testing.ports import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, local_world_size: int = 0) -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of ``world_size`` on one host (``MASTER_ADDR`` 127.0.0.1), for
    a process that runs itself as a rank (a benchmark script, say).

    Example::

        >>> rank_env(0, 1, 29500)["LOCAL_WORLD_SIZE"]
        '1'
    """
    local = local_world_size or world_size
    values = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": world_size,
        "RANK": rank,
        "LOCAL_RANK": rank % local,
        "LOCAL_WORLD_SIZE": local,
        "NODE_RANK": rank // local,
    }
    return {k: str(v) for k, v in values.items()}


def shell_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment as a user's fresh shell has it: without the rendezvous variables
    (:data:`RENDEZVOUS_VARS`) and without ``drop``, for starting a script or ``lightning-rec`` as a user would.

    Example::

        >>> env = shell_env(drop=("OMP_NUM_THREADS",))
        >>> any(name in env for name in (*RENDEZVOUS_VARS, "OMP_NUM_THREADS"))
        False
    """
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS and k not in drop}
