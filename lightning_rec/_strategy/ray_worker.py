"""A rank that Ray Train started: its cluster environment, device and local world size, as Ray tells them.

Ray Train starts one process per worker, starts the process group itself, and sets torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``; no ``GROUP_RANK``), so Lightning picks its fallback
``LightningEnvironment``, and ``devices="auto"`` (what Ray documents) counts the devices one worker sees: one CPU.
Lightning's own strategies then index their device list by local rank (an ``IndexError`` on rank 1) and take
``devices x num_nodes`` for the world size. Ray's ``RayDDPStrategy`` answers instead with Ray's device and
``RayLightningEnvironment`` with Ray's ranks; the strategy does the same through these functions, so that plain
``strategy="recshard"`` works inside a ``train_loop_per_worker``.

Ray is an optional dependency (the ``ray`` extra): nothing here imports it unless the process already has
(a Ray Train worker always has), so a process without Ray pays one ``sys.modules`` look-up.
"""

from __future__ import annotations

import sys

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment

__all__ = ["adopt_ray_environment", "is_ray_environment", "ray_device", "ray_local_world_size"]


def _in_ray_train_worker() -> bool:
    if "ray.train" not in sys.modules:  # a Ray Train worker imported it before running the user's function
        return False
    import ray.train

    try:
        ray.train.get_context()  # raises outside the function Ray Train runs
    except Exception:
        return False
    return True


def adopt_ray_environment(environment: ClusterEnvironment | None) -> ClusterEnvironment | None:
    """``environment``, or Ray's ``RayLightningEnvironment`` in its place where ``environment`` is Lightning's fallback
    (``LightningEnvironment``, which cannot know Ray's ranks) and this process is a Ray Train worker."""
    if type(environment) is not LightningEnvironment or not _in_ray_train_worker():
        return environment
    from ray.train.lightning import RayLightningEnvironment

    return RayLightningEnvironment()


def is_ray_environment(environment: ClusterEnvironment | None) -> bool:
    """Whether ``environment`` is Ray's (``ray.train.lightning.RayLightningEnvironment`` or a subclass)."""
    module = sys.modules.get("ray.train.lightning")
    return module is not None and isinstance(environment, module.RayLightningEnvironment)


def ray_device() -> torch.device:
    """The device Ray Train gave this worker (``ray.train.torch.get_device()``: the CPU, or its GPU)."""
    import ray.train.torch

    return ray.train.torch.get_device()


def ray_local_world_size() -> int:
    """How many of the run's workers Ray Train placed on this node."""
    import ray.train

    return int(ray.train.get_context().get_local_world_size())
