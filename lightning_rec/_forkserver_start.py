"""The fork server's first import (its preload, :data:`lightning_rec._forkserver.PRELOAD`): the server dies with the
process that started it.

The server otherwise ends when every holder of its "alive" pipe is gone, and only after its interpreter's exit, with
torch imported (9 s on a loaded 2-core machine here), its DataLoader workers with it; killed by Linux when its parent
dies, it is gone at once, and its workers (killed with their parent, :func:`lightning_rec._forkserver.die_with_parent`)
too. Only when the starting process said so (:data:`lightning_rec._forkserver.PARENT_VARIABLE`: it started the server
from its main thread, whose end is the process's): the variable is taken out of the environment here, so the
server's children do not see it. Importing this module anywhere else does nothing.
"""

from __future__ import annotations

import os

from lightning_rec._forkserver import PARENT_VARIABLE, die_with_parent

_parent = os.environ.pop(PARENT_VARIABLE, None)
if _parent is not None and _parent.isdigit() and int(_parent) == os.getppid():
    die_with_parent(int(_parent))
