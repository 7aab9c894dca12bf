"""The strategy and its mechanics: what turns a LightningModule with TorchRec tables into a sharded model.

* :mod:`~lightning_rec._strategy.recshard`: :class:`RecShardStrategy`, the list of Lightning's hooks; each hook hands
  its work to one module beside it:
* :mod:`~lightning_rec._strategy.lifecycle`: the work of ``setup_environment``, ``setup`` and ``batch_to_device``
  (the process group, sharding with the optimizers, a batch's transfer);
* :mod:`~lightning_rec._strategy.hook_state`: what one hook leaves for another (a backward without a step, ...);
* :mod:`~lightning_rec._strategy.settings`: which Trainer flags and callbacks a sharded run can honour;
* :mod:`~lightning_rec._strategy.sharding_config`: the sharding configuration, built once from the strategy's
  arguments (``strategy.sharding``): check a model, settle the fused optimizer, ask the planner
  (:mod:`lightning_rec._planner`: the plan, its report, device support, topology) and shard;
* :mod:`~lightning_rec._strategy.dmp`: ``DistributedModelParallel``, the unsharded rows copied into the shards;
* :mod:`~lightning_rec._strategy.unsharded`: the sharded outputs put back in the unsharded module's order;
* :mod:`~lightning_rec._strategy.optim`: the fused embedding optimizer and :class:`RecOptimizer`;
* :mod:`~lightning_rec._strategy.pipeline`: the pipelined input distribution inside Lightning's loop;
* :mod:`~lightning_rec._strategy.faults`: one rank's failure told to the others.

Example::

    from lightning_rec import RecShardStrategy
    trainer = L.Trainer(strategy=RecShardStrategy(pipeline=True), accelerator="cpu", devices=2)
"""
