"""``RecShardStrategy``: Lightning's hooks for TorchRec's sharded training.

The strategy owns the whole lifecycle of the sharded model, because Lightning's generic one (move the
module to the device, wrap it in DDP, ``.cpu()`` it at teardown) breaks on tables that live on ``meta`` or
are split across ranks:

1. ``connect``: checks the model and the configuration (tables, constraints) before any distributed work.
2. ``setup_environment``: checks what the device can run, then starts the process group (gloo on CPU,
   nccl on CUDA).
3. ``setup``: materialises the dense layers, builds the user's optimizers, derives the fused embedding
   optimizer from them, plans the sharding on rank 0 (TorchRec's planner, broadcast), wraps the module in
   ``DistributedModelParallel`` (tables sharded in place, dense part data-parallel) and combines fused and
   dense optimizers into one :class:`~lightning_rec._strategy.optim.RecOptimizer`; puts the input checks of
   :mod:`lightning_rec._inputs` in front of every sharded module.
4. ``on_exception``: tells the other ranks why this one failed, or explains a failed collective
   (:mod:`lightning_rec._strategy.faults`).
5. ``teardown``: leaves the sharded module where it is, so later ``validate``/``test``/``predict`` calls reuse
   it.

The mechanics live in :mod:`lightning_rec._strategy.lifecycle` (the work of ``setup_environment``, ``setup`` and
``batch_to_device``), :mod:`lightning_rec._strategy.sharding_config` (the sharding configuration, built once from the
arguments: ``strategy.sharding``), :mod:`lightning_rec._strategy.dmp`, :mod:`lightning_rec._strategy.optim`,
:mod:`lightning_rec._planner` (the plan and its report) and :mod:`lightning_rec.checkpoint`; what one hook leaves for another is in
:mod:`lightning_rec._strategy.hook_state`; this file is the list of Lightning hooks.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec._batch import custom_batch_hooks
from lightning_rec._inputs.checks import InputChecks, has_no_samples
from lightning_rec._planner.report import PlanReport, write_for_trainer
from lightning_rec._strategy.batch_counts import BatchCounts
from lightning_rec._strategy.checkpoint_dirs import RunCheckpoints, check_writable, unwritable
from lightning_rec._strategy.dmp import ManualOptimizationRedirection, dense_ddp, sharded_state
from lightning_rec._strategy.faults import FailureBoard, describe_position, note_failure
from lightning_rec._strategy.hook_state import HookState
from lightning_rec._strategy.lifecycle import (
    input_refusals,
    rank_boards,
    shard_with_optimizers,
    start_process_group,
    transfer_batch,
)
from lightning_rec._strategy.notebook import NotebookLauncher
from lightning_rec._strategy.optim import RecOptimizer
from lightning_rec._strategy.pipeline import SparseDistPipeline, check_pipelinable
from lightning_rec._strategy.preemption import Preemption
from lightning_rec._strategy.quiet import print_bar_lines_once, silence_proven_harmless
from lightning_rec._strategy.ray_worker import (
    adopt_ray_environment,
    is_ray_environment,
    ray_device,
    ray_local_world_size,
)
from lightning_rec._strategy.settings import check_fit, check_precision, raised_in, toggle_optimizer_error
from lightning_rec._strategy.sharding_config import ShardingConfig
from lightning_rec.checkpoint._io import load, remove, save
from lightning_rec.checkpoint._optimizer_state import canonical_state
from lightning_rec.config import (
    BoundsCheck,
    EmbeddingOptimizer,
    NonFinitePolicy,
    QuantizedComms,
    TableConstraints,
    TopologyConfig,
)
from lightning_rec.errors import Preempted

# How long a collective waits for a rank that stopped answering (Lightning and torch default to 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=5)


class RecShardStrategy(ParallelStrategy):
    """Train a LightningModule with TorchRec-sharded embedding tables and data-parallel dense layers.

    Args:
        constraints: per-table planner constraints, by table name (allowed sharding types, compute kernels).
            Plain dicts work too (from YAML). Tables without constraints may use any sharding type the device
            can run.
        topology: overrides for the planner's view of the machine (memory per rank, local world size, the
            per-rank batch size it assumes, a device preset such as ``"h100"``).
        sharders: extra TorchRec sharders (e.g. for custom embedding modules); they replace the built-in ones
            for the same module type.
        plan: a precomputed plan to use instead of running the planner: a ``ShardingPlan``, or the path of a
            ``plan.json`` written by ``lightning-rec plan`` (or a ``sharding_plan.json`` written by an earlier
            fit). A file's plan is checked against the run before anything is sharded (world size, ranks per
            host, device type, the model's tables and their shapes, sharding types and kernels this device can
            train with), and a mismatch is refused naming it (see README "Planning for a cluster").
        embedding_optimizer: the fused embedding optimizer when the module does not declare one with
            ``configure_embedding_optimizer()``. ``None`` (default): derive it from ``configure_optimizers``.
        fused_params: extra FBGEMM table-batched-embedding arguments for every table (e.g.
            ``{"stochastic_rounding": False}``).
        bounds_check: what to do with ids outside a table: ``"error"`` (default: an :class:`~lightning_rec.errors.InputError`
            naming the feature, table, id and table size, raised before anything is updated), ``"warn"`` (TorchRec's
            default: warn and read row 0 instead), ``"ignore"`` (silently read row 0) or ``"none"`` (no check at all,
            not even of the features, lengths and dtypes that the other modes check: undefined on bad input; for
            benchmarks). See :mod:`lightning_rec._inputs`.
        nonfinite: NaN or infinity in a dense input or in the loss. ``"error"`` (default): a
            :class:`~lightning_rec.errors.NonFiniteError` naming the step; a dense input is refused before its step
            (checked on the host), a loss is read one step late without making the GPU wait (reported before the
            next update, any checkpoint and the end of fitting; that step's own update has happened).
            ``"strict"``: the loss too is refused before its backward pass, at one host sync per step. ``"warn"``
            (warn and train on) or ``"ignore"``.
        process_group_backend: ``"gloo"``/``"nccl"``; default: nccl on CUDA, gloo on CPU.
        timeout: how long a collective waits for the other ranks before failing (a ``timedelta`` or seconds). When a
            rank dies or raises, the others fail at once; this bounds the wait for one that hangs. Default: 5
            minutes (Lightning's default is 30). Raise it if a rank legitimately works alone for longer (e.g. planning
            thousands of tables, or very large checkpoints on a slow filesystem). See :mod:`lightning_rec._strategy.faults`.
        static_graph: passed to the DDP wrapper of the dense part (TorchRec's default: ``True``); with one rank there is
            no DDP (an all-reduce over one rank changes nothing; see :class:`~lightning_rec._strategy.dmp.DenseDataParallel`).
        find_unused_parameters: passed to the DDP wrapper of the dense part.
        qcomms: quantize what the tables send between ranks (the embedding all-to-alls forward, their gradients
            backward): a :class:`~lightning_rec.config.QuantizedComms`, a precision for both directions (``"fp16"``,
            ``"bf16"``, ``"int8"``, ``"fp8"``), ``{"forward": "fp16", "backward": "bf16"}``, or TorchRec's
            ``QCommsConfig``. Default: full precision. What cannot run on the device is refused before sharding.
        pipeline: overlap the next batch's host-to-device copy and input distribution (all-to-all) with the
            current batch's forward/backward, as TorchRec's ``TrainPipelineSparseDist`` does, inside Lightning's
            loop (see :mod:`lightning_rec._strategy.pipeline`). Training only; same losses as without.
        fast_cpu_lookup: on CPU, run FBGEMM's fused tables (SGD/Adagrad, sum pooling, fp32) through
            :mod:`lightning_rec._strategy.cpu_lookup`: torch's multi-threaded ``embedding_bag`` forward and FBGEMM's
            own backward op split across threads by table; bitwise identical to FBGEMM's path, faster with more than
            one thread per rank on big lookups (BENCHMARKS.md; with one thread it is left out). Small lookups (ids x
            dim of a call) keep FBGEMM's path (``lightning_rec.testing.cpu_lookup_path``); big ones take the split
            only where a trial of both paths, in the first training steps, measures it faster; so the default is
            never slower than FBGEMM's own. ``False`` keeps FBGEMM's forward. No effect on CUDA.
        run_id: the name of this run, recorded in its checkpoints: ``ckpt_path="last"`` (and a requeued SLURM job's
            start) resumes only a checkpoint of the same run. Default: the ``LIGHTNING_REC_RUN_ID`` environment
            variable, else the launcher's job id (``SLURM_JOB_ID``, torchrun's ``TORCHELASTIC_RUN_ID``) with a
            fingerprint of the model's and data's hyperparameters (see :mod:`lightning_rec._strategy.run_identity`).
            Give the same id to continue a run under a new job id or with a changed configuration.
        report_plan: when fitting, rank 0 writes ``sharding_plan.json`` and ``sharding_plan.png`` (tables, shards,
            the planner's memory/cost estimates per rank and their imbalance) into the logger's ``log_dir``; without
            a logger nothing is written (see :mod:`lightning_rec._planner.report`). The plan is logged as a table either
            way. A report that cannot be written only warns.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the
            Trainer, as for any Lightning strategy.

    Attributes:
        sharding: the sharding configuration, built once from ``constraints``, ``topology``, ``sharders``, ``plan``,
            ``embedding_optimizer``, ``fused_params``, ``bounds_check``, ``static_graph``, ``find_unused_parameters``,
            ``qcomms`` and ``fast_cpu_lookup`` (typed: dicts became configs, ``bounds_check`` is in ``fused_params``);
            read them there, e.g. ``strategy.sharding.constraints``
            (:class:`~lightning_rec.ShardingConfig`).

    Example::

        trainer = L.Trainer(strategy="recshard", accelerator="cpu", devices=2)
        trainer = L.Trainer(
            strategy=RecShardStrategy(constraints={"item": TableConstraints(sharding_types=["column_wise"])}),
            devices=2,
        )
    """

    strategy_name = "recshard"

    def __init__(
        self,
        constraints: Mapping[str, TableConstraints | Mapping[str, Any]] | None = None,
        topology: TopologyConfig | Mapping[str, Any] | None = None,
        sharders: Sequence[ModuleSharder[nn.Module]] | None = None,
        plan: str | ShardingPlan | None = None,
        embedding_optimizer: EmbeddingOptimizer | Mapping[str, Any] | None = None,
        fused_params: Mapping[str, Any] | None = None,
        bounds_check: BoundsCheck = "error",
        nonfinite: NonFinitePolicy = "error",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        static_graph: bool = True,
        find_unused_parameters: bool = False,
        report_plan: bool = True,
        pipeline: bool = False,
        fast_cpu_lookup: bool = True,
        qcomms: QuantizedComms | str | Mapping[str, Any] | None = None,
        run_id: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        _refuse_checkpoint_io(checkpoint_io, type(self).__name__)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.sharding = ShardingConfig.from_arguments(
            constraints=constraints,
            topology=topology,
            sharders=sharders,
            plan=plan,
            embedding_optimizer=embedding_optimizer,
            fused_params=fused_params,
            bounds_check=bounds_check,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            qcomms=qcomms,
            fast_cpu_lookup=fast_cpu_lookup,
            owner=type(self).__name__,
        )
        self._input_checks = InputChecks(
            check_ids=bounds_check == "error",
            nonfinite=nonfinite,
            position=self._describe_position,
            check_structure=bounds_check != "none",
        )
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._failures: FailureBoard | None = None
        self._batch_counts: BatchCounts | None = None
        self._steps = HookState()  # what one hook leaves for another
        self.num_nodes = 1
        self._report_plan = report_plan
        self.pipeline = pipeline
        self._sparse_dist: SparseDistPipeline | None = None
        self._rec_optimizer: RecOptimizer | None = None
        self._forward_redirection = ManualOptimizationRedirection()
        self._preemption = Preemption()  # signals stop a fit at a batch boundary, with a checkpoint
        self._checkpoints = RunCheckpoints(run_id)  # this run's name, what "last" is, the folders it holds
        _compat.route_last_checkpoint()  # ckpt_path="last" and SLURM's requeue start -> resolve_checkpoint

    # --- Properties Lightning asks for ---

    @property
    @override
    def root_device(self) -> torch.device:
        if is_ray_environment(self.cluster_environment):  # one process per worker: its device list is not per node
            return ray_device()
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property  # ParallelStrategy's plain attribute, given a setter
    def cluster_environment(self) -> ClusterEnvironment | None:
        """Where the ranks come from (set by the Trainer). Inside a Ray Train worker, Lightning's fallback
        ``LightningEnvironment`` is replaced by Ray's ``RayLightningEnvironment``, so that plain
        ``strategy="recshard"`` with ``devices="auto"`` takes its ranks and device from Ray (see
        :mod:`lightning_rec.integrations.ray`)."""
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment | None) -> None:
        self._cluster_environment = adopt_ray_environment(environment)

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning reads this to decide whether ``self.log(..., sync_dist=True)`` reduces
        across ranks (it only knows its own strategies otherwise)."""
        return True

    @property
    @override
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        # Lightning refuses every DDP-family strategy on MPS at `Trainer(...)`, but only when it is given an instance
        # or a name containing "ddp"; "recshard" (a name) reaches here, when the connector hands over the accelerator.
        if isinstance(accelerator, pl.accelerators.MPSAccelerator):
            raise ValueError(
                "You set `strategy=recshard` but strategies from the DDP family are not supported on the MPS "
                "accelerator. Either explicitly set `accelerator='cpu'` or change the strategy."
            )
        self._accelerator = accelerator

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:  # Trainer(plugins=[SomeCheckpointIO()]) lands here
        _refuse_checkpoint_io(io, type(self).__name__)
        self._checkpoint_io = io

    @property
    def num_processes(self) -> int:
        if is_ray_environment(self.cluster_environment):  # Ray's workers on this node, not one worker's devices
            return ray_local_world_size()
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size, as Lightning's ``ddp`` does.

        Lightning's accelerator connector calls it when the Trainer is built (so ``trainer.global_rank``,
        ``world_size`` and ``is_global_zero`` are right before ``fit``), and the strategy again before starting the
        process group."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Not every environment's setter updates rank_zero_only itself (see Lightning's DDPStrategy).
        # (`rank` is an attribute Lightning sets on the function; its declaration, an overloaded function, lacks it.)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def timeout(self) -> timedelta | None:
        """How long a collective waits for the other ranks (see the ``timeout`` argument)."""
        return self._timeout

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded state can only be loaded into the sharded model.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores the optimizer in place, shard by shard

    @property
    def sharded_model(self) -> DistributedModelParallel:
        """The ``DistributedModelParallel`` wrapper (available after setup)."""
        state = sharded_state(self.lightning_module)
        if state is None:
            raise RuntimeError(f"{type(self).__name__}: the model is not sharded yet; call this after setup.")
        return state.dmp

    @property
    def sharding_plan(self) -> ShardingPlan:
        """The ``ShardingPlan`` the model was sharded with (available after setup)."""
        return self.sharded_model.plan

    @property
    def plan_report(self) -> PlanReport | None:
        """The sharding-plan report (tables, shards, topology, planner estimates; available after setup): a
        :class:`~lightning_rec.PlanReport`."""
        state = sharded_state(self.lightning_module)
        return state.report if state is not None else None

    @property
    def _attached_module(self) -> pl.LightningModule:
        """The LightningModule, for the hooks Lightning calls only while one is attached."""
        module = self.lightning_module
        assert module is not None
        return module

    # --- Lifecycle, in Lightning's order ---

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if _compat.IS_INTERACTIVE:  # a notebook: fork the ranks (`ddp_notebook`), the weights come back whole
            self._launcher = NotebookLauncher(self)
            return
        self._launcher = _compat._SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if sharded_state(model) is not None:
            return
        self.sharding.check_model(model, self.root_device.type)
        if self.pipeline:
            check_pipelinable(model, self.sharding.module_types, type(self).__name__)

    @override
    def setup_environment(self) -> None:
        silence_proven_harmless()
        check_precision(getattr(self.precision_plugin, "precision", "32-true"), type(self).__name__)
        if self.sharding.embedding_optimizer is not None:
            self.sharding.embedding_optimizer.validate_for(self.root_device.type)
        super().setup_environment()
        # As the launching process already did (and torchrun does): one share of the host's cores per local rank.
        _compat._set_num_threads_if_needed(self.num_processes)
        _compat.reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = start_process_group(
            self.cluster_environment, self.root_device, self._process_group_backend, self._timeout
        )
        # A prefix shared by every rank of this run, under which the ranks leave their errors and batch counts.
        token = self.broadcast(uuid.uuid4().hex)
        self._failures, self._batch_counts = rank_boards(
            token, self.global_rank, self.world_size, self._timeout, type(self).__name__
        )
        self._preemption.start(self.world_size, self._timeout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        print_bar_lines_once(trainer)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._steps.fit_started(check_fit(trainer, module, self.sharding.module_types, type(self).__name__))
            check_writable(sorted({p for rank in self._all_gather_objects(unwritable(trainer)) for p in rank}))
            self._checkpoints.hold(trainer, self.global_rank, self._all_gather_objects)  # one writer per folder
        self._preemption.attach(trainer)

        done = shard_with_optimizers(
            module, self.sharding, fitting, self.root_device, self.world_size, self.num_processes, self._layer_sync
        )
        state = done.state
        self.model = state.dmp
        self._input_checks.install(
            state.dmp.module, state.inputs, input_refusals(state, self.root_device.type, self.world_size)
        )
        # (Lightning's data connector sets `Trainer.datamodule`; the Trainer class does not declare it.)
        self._steps.batch_hooks = custom_batch_hooks(module, trainer.datamodule)  # type: ignore[attr-defined]
        self._steps.redirect_steps = dense_ddp(state.dmp) is not None

        if fitting:
            self._rec_optimizer, self.optimizers = done.rec_optimizer, done.optimizers
            self.lr_scheduler_configs = done.lr_scheduler_configs
            if self._report_plan and state.report is not None:
                write_for_trainer(state.report, trainer, self.global_rank)  # every rank: it may broadcast
            self._sparse_dist = (
                SparseDistPipeline(state.dmp, self.root_device, self._input_checks) if self.pipeline else None
            )
        self.setup_precision_plugin()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not self._attached_module.trainer.training:
            return dataloader
        if self._sparse_dist is not None:
            dataloader = self._sparse_dist.wrap(dataloader)  # batches are copied and queued as Lightning fetches them
        if self._batch_counts is not None:  # outermost: a pass ends when Lightning has fetched every batch
            trainer = self._attached_module.trainer
            max_steps = trainer.max_steps if trainer.max_steps != -1 else None
            dataloader = self._batch_counts.wrap(dataloader, trainer.limit_train_batches, max_steps)
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Check the batch on the host, copy it to the device without blocking, run the module's transfer hooks.

        Lightning's own transfer copies a TorchRec ``Batch`` or KJT blocking (it passes ``non_blocking`` to plain
        tensors only); here every tensor, KJT and ``Pipelineable`` is copied with ``non_blocking=True`` (from pinned
        memory, e.g. ``DataLoader(pin_memory=True)``, the copy then overlaps the GPU's work). A
        ``transfer_batch_to_device`` override (module or datamodule) is called instead, as Lightning calls it."""
        self._steps.transferring = True  # Lightning counts the batch only once it is on the device (reset on exception)
        if self._sparse_dist is not None and self._attached_module.trainer.training:
            batch = self._sparse_dist.begin_step()  # already on the device, checked on the host and distributed
        else:
            module, checks, hooks = self._attached_module, self._input_checks, self._steps.batch_hooks
            batch = transfer_batch(module, batch, device or self.root_device, dataloader_idx, checks, hooks)
        self._steps.transferring = False
        return batch

    @override
    def on_validation_start(self) -> None:
        self._input_checks.poll()  # report a non-finite training loss before evaluating its weights
        if self._sparse_dist is not None:
            self._sparse_dist.detach()  # evaluation runs the sharded modules' own forwards

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_train_end(self) -> None:
        if self._sparse_dist is not None:
            self._sparse_dist.reset()
        self._input_checks.poll()  # the last steps' losses (nonfinite="error" reads them one step late)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._steps.optimizer_stepped()
        if self._batch_counts is not None:
            self._batch_counts.check()  # after this rank's last step of an epoch: did every rank run as many?
        return out

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._steps.backward_ran()  # a step must follow before the next batch
        self._input_checks.check_loss(closure_loss)  # the backward pass would write a NaN into the tables
        if self._sparse_dist is not None:
            self._sparse_dist.before_backward()  # the next batch's input all-to-all overlapped this forward
        # Manual optimization calls backward inside training_step, i.e. inside DDP's forward; DDP's reducer was
        # kept out of that forward (see dmp.ManualOptimizationRedirection) and is prepared here instead.
        ddp = dense_ddp(self.model)
        if ddp is not None and not self._attached_module.automatic_optimization:
            prepare_for_backward(ddp, closure_loss)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._input_checks.empty_step = has_no_samples(batch)  # its loss is a mean over nothing: NaN, and harmless
        try:
            if self._steps.redirect_steps:
                return super().training_step(*args, **kwargs)  # through DDP's forward, as Lightning's ddp does
            # One rank: no DDP around the dense part (dmp.DenseDataParallel), and DMP's forward only calls the module.
            with self.precision_plugin.train_step_context():
                return self._attached_module.training_step(*args, **kwargs)
        except RuntimeError as error:
            if raised_in(error, "toggle_optimizer"):  # torch refuses requires_grad on the tables' ShardedTensors
                raise toggle_optimizer_error(type(self).__name__) from error
            raise

    @override
    def model_to_device(self) -> None:
        # Devices are handled in `setup`: dense layers are materialised/moved there, tables by DMP.
        pass

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._steps.check_batch_start(batch_idx, type(self).__name__)
        # An LR scheduler may have moved the dense learning rate since the last step; the tables follow it
        # before this step's backward pass (where their update happens).
        if self._rec_optimizer is not None:
            self._rec_optimizer.sync_lr()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one stops, or, if a collective failed because another rank stopped, say
        which rank and why (see :mod:`lightning_rec._strategy.faults`)."""
        if isinstance(exception, Preempted):
            return  # every rank stopped at the same step, after a checkpoint: nobody failed
        position = self._describe_position(0)
        self._steps.transferring = False
        self._input_checks.forget()
        note_failure()  # this process's exit must not wait for the others
        if self._failures is not None:
            self._failures.handle(exception, position, self.world_size, self._timeout, type(self).__name__)

    @override
    def teardown(self) -> None:
        # Unlike Lightning's default, never `.cpu()` the module: its tables are sharded (and on CUDA, moving
        # them would break the kernels). The sharded module is kept for later validate/test/predict calls.
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._checkpoints.release()

    # --- Collectives ---

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _compat._distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat._distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=_compat._group.WORLD)
        return holder[0]

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduce ``tensor`` over all ranks with ``reduce_op`` (``"mean"``/``"avg"``, ``"sum"``, ``"max"``,
        ``"min"`` or a ``ReduceOp``); non-tensors are returned unchanged."""
        if isinstance(tensor, Tensor):
            return _compat._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def _all_gather_objects(self, obj: Any) -> list[Any]:
        if not _compat._distributed_is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # --- Checkpoints (torch.distributed.checkpoint; see lightning_rec.checkpoint) ---

    def resolve_checkpoint(self, trainer: pl.Trainer, kind: str, quiet: bool = False) -> str | None:
        """What ``ckpt_path="last"`` (``kind="last"``) and a requeued SLURM job's start (``kind="hpc"``) resume
        from under this strategy: the newest complete checkpoint of this run, across its restarts (see
        :mod:`lightning_rec._strategy.checkpoint_dirs`); ``None``: start from scratch."""
        return self._checkpoints.resolve(trainer, kind, quiet)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return canonical_state(optimizer, dict(self.lightning_module.named_parameters()))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` as a sharded checkpoint directory at ``filepath`` (every rank writes its own shards;
        see :mod:`lightning_rec.checkpoint`)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
                f" `{type(self).__name__}` does not use the `CheckpointIO`."
            )
        self._input_checks.poll()  # never write weights that a non-finite loss has reached
        path = Path(self.broadcast(str(filepath)))
        module = self._attached_module
        trainer = _compat.attached_trainer(module)
        run = self._checkpoints.run(trainer) if isinstance(trainer, pl.Trainer) else None
        with self._checkpoints.saving(path, run, self.global_rank, self._all_gather_objects):  # one writer
            save(checkpoint, path, module=module, sharding=sharded_state(module), run=run)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint directory (from any world size or plan) into the sharded model and its optimizers, in
        place; checks everything first (see :func:`lightning_rec.checkpoint._io.load`)."""
        # "last" resolved to this run's newest checkpoint: if it is corrupt, the ones before it, newest first.
        candidates = self.broadcast([str(checkpoint_path), *self._checkpoints.fallbacks(str(checkpoint_path))])
        module = self._attached_module
        return self._checkpoints.load_first_intact(
            candidates,
            lambda path: load(
                path,
                module,
                [_compat.unwrap_optimizer(o) for o in self.optimizers],
                strict=getattr(module, "strict_loading", True),
                weights_only=weights_only,
                owner=type(self).__name__,
            ),
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(Path(filepath))

    # --- Registration ---

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="TorchRec sharded embedding tables (DMP + FBGEMM fused optimizers) with data-parallel dense layers",
            override=True,
        )

    # --- Private helpers ---

    def _describe_position(self, ahead: int, batch: int | None = None) -> str:
        module = self.lightning_module
        trainer = _compat.attached_trainer(module) if module is not None else None
        if trainer is None:
            return ""
        return describe_position(trainer, ahead, transferring=self._steps.transferring, batch=batch)


def _refuse_checkpoint_io(io: CheckpointIO | None, owner: str) -> None:
    """A ``CheckpointIO`` other than Lightning's default is refused, in Lightning's words for its strategies that
    write distributed checkpoints themselves: recshard writes sharded checkpoint directories with
    ``torch.distributed.checkpoint`` (:mod:`lightning_rec.checkpoint`), so a given one would be silently ignored."""
    if io is not None and type(io) is not TorchCheckpointIO:
        raise ValueError(
            f"`{owner}` does not use the `CheckpointIO`: it writes sharded checkpoint directories itself "
            f"(torch.distributed.checkpoint), so `{type(io).__name__}` would be ignored. HINT: leave the "
            "checkpoint_io argument and CheckpointIO plugins out."
        )
