"""The only home of private imports and version gates, one module per upstream counterpart.

Lightning, TorchRec, torch and FBGEMM keep helpers every strategy needs (process-group start-up, launchers, the
planner's state, the train pipeline's parts, sharded tensors) behind underscore names. They are reached here, once,
so that an upgrade that moves one breaks one module with an obvious fix:

- :mod:`~lightning_rec._compat.lightning`: Lightning's process-group helpers, launchers, optimizer parsing, loops;
- :mod:`~lightning_rec._compat.torchrec`: the planner, the train pipeline, DMP, managed collision, fused parameters;
- :mod:`~lightning_rec._compat.patches`: the one seam for patches of TorchRec's, FBGEMM's and Lightning's objects;
- :mod:`~lightning_rec._compat.torch`: ShardedTensor, dispatch modes, the default store, AOTInductor's compiler and package loader;
- :mod:`~lightning_rec._compat.python`: the interpreter's own exit steps; multiprocessing's fork-server start.

The rest of the package reaches every name through this one: ``from lightning_rec import _compat``, then
``_compat.name`` (tests/test_layout.py checks that private upstream names are imported nowhere else).
"""

# Upstream private names used as they are, imported here once (re-exporting them through a submodule would hide
# where they live).
# Lightning: process-group helpers shared by its own DDP/FSDP/ModelParallel strategies. There is no public
# equivalent; re-implementing them would fork Lightning's handling of cluster environments and timeouts.
# Lightning: `torch.set_num_threads(cpus // processes)` + OMP_NUM_THREADS unless the user set OMP_NUM_THREADS. Its
# launcher calls it in the launching process only, after starting the other ranks, so they keep one intra-op
# thread per core each: on 2 cores, rank 1's idle OpenMP threads spun for 44 of its 47 CPU seconds in a 2-process
# job (BENCHMARKS.md). The strategy calls it on every rank.
# Lightning: what `move_data_to_device` moves (anything with a `.to`); the strategy moves batches itself so that
# TorchRec's batches and KJTs are copied without blocking (Lightning passes non_blocking to plain tensors only).
from lightning.fabric.utilities.apply_func import _TransferableDataType  # noqa: F401
from lightning.fabric.utilities.distributed import (  # noqa: F401
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,  # noqa: F401
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group  # noqa: F401

# Lightning's fork launcher (`ddp_notebook`'s), what an interactive session can start ranks with, and whether this
# is one (Lightning's own test, which refuses any other launcher there).
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE  # noqa: F401
from lightning.fabric.utilities.seed import reset_seed  # noqa: F401

# Lightning: turns `configure_optimizers()` output into optimizers + LRSchedulerConfigs (all return forms,
# validation included). The strategy must call it itself because the embedding optimizer has to be known
# before the tables are sharded.
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers  # noqa: F401

# Lightning's accelerator connector hands string strategies to this registry.
from lightning.pytorch.strategies import StrategyRegistry  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import (  # noqa: F401
    _MultiProcessingLauncher,
    _WorkerOutput,
)

# Lightning: the `popen` launcher that re-runs the user's script once per local rank (what `ddp` uses).
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher  # noqa: F401

# Lightning: reroutes `training_step` through the wrapper's forward (so DDP sees it); its hooks let a strategy
# stop DDP's reducer during a manual-optimization forward, as Lightning's own DDPStrategy does.
from lightning.pytorch.strategies.strategy import _ForwardRedirection  # noqa: F401

# torch: sharded tables' weights and fused-optimizer state are ShardedTensors, a type torch still keeps under a
# private path (TorchRec imports it from there too); checkpointing has to recognise them.
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401

# torch: the dispatch-mode base class (what sees every aten op, e.g. to count host syncs in
# lightning_rec.testing) lives only under a private module path; torch's own docs import it from there.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

from lightning_rec._compat.lightning import (
    attached_trainer,
    batches_fetched,
    call_batch_hook,
    fit_validation_loop,
    hpc_save_path,
    parse_optimizers,
    route_last_checkpoint,
    subcommand_parser,
    training_batch_idx,
    unwrap_optimizer,
)
from lightning_rec._compat.patches import (
    PATCHED_CLASS_ATTRIBUTES,
    PATCHED_METHODS,
    is_class_attribute_patched,
    is_patched,
    original_method,
    patch_class_attribute,
    patch_method,
    patchable,
    unpatch_class_attribute,
    unpatch_method,
)
from lightning_rec._compat.python import ForkServerContext, ForkServerProcess, interpreter_exit
from lightning_rec._compat.torch import (
    aoti_input_checks,
    aoti_package_loader,
    cpp_compiler,
    default_store,
    inductor_cache_dir,
    parse_to,
    tensor_version,
)
from lightning_rec._compat.torchrec import (
    _TABLE_OPTIMIZER_ATTRS,
    IN_BACKWARD_OPTIMIZER_ATTR,
    collision_output_segments,
    create_topology,
    dmp_inner_module,
    fused_tbes,
    in_backward_optimizer,
    managed_collision_parts,
    optimizer_state_for_planner,
    ordered_enumerator,
    pipeline_rewrite,
    pipeline_set_context,
    pipeline_wait_for_batch,
    planner_batch_size,
    planner_constraints,
    planner_sharding_options,
    planner_topology,
    reduce_scatter_v_backward,
    sharder_fused_params,
    table_fused_params,
    with_sharder_fused_params,
)

__all__ = [
    "IN_BACKWARD_OPTIMIZER_ATTR",
    "IS_INTERACTIVE",
    "PATCHED_CLASS_ATTRIBUTES",
    "PATCHED_METHODS",
    "ForkServerContext",
    "ForkServerProcess",
    "ShardedTensor",
    "StrategyRegistry",
    "TorchDispatchMode",
    "_ForwardRedirection",
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_TABLE_OPTIMIZER_ATTRS",
    "_TransferableDataType",
    "_WorkerOutput",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_group",
    "_init_dist_connection",
    "_init_optimizers_and_lr_schedulers",
    "_set_num_threads_if_needed",
    "_sync_ddp_if_available",
    "attached_trainer",
    "batches_fetched",
    "call_batch_hook",
    "collision_output_segments",
    "aoti_input_checks",
    "aoti_package_loader",
    "cpp_compiler",
    "create_topology",
    "default_store",
    "dmp_inner_module",
    "fit_validation_loop",
    "fused_tbes",
    "hpc_save_path",
    "in_backward_optimizer",
    "inductor_cache_dir",
    "interpreter_exit",
    "is_class_attribute_patched",
    "is_patched",
    "managed_collision_parts",
    "optimizer_state_for_planner",
    "ordered_enumerator",
    "original_method",
    "parse_optimizers",
    "parse_to",
    "patch_class_attribute",
    "patch_method",
    "patchable",
    "pipeline_rewrite",
    "pipeline_set_context",
    "pipeline_wait_for_batch",
    "planner_batch_size",
    "planner_constraints",
    "planner_sharding_options",
    "planner_topology",
    "reduce_scatter_v_backward",
    "reset_seed",
    "route_last_checkpoint",
    "sharder_fused_params",
    "subcommand_parser",
    "table_fused_params",
    "tensor_version",
    "training_batch_idx",
    "unpatch_class_attribute",
    "unpatch_method",
    "unwrap_optimizer",
    "with_sharder_fused_params",
]
