"""Free TCP ports on the loopback interface, for ``MASTER_PORT`` and rendezvous endpoints."""

from __future__ import annotations

import socket


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
