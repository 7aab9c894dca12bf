"""Planning: which table goes where, made by TorchRec's planner from one request, and everything read from or written
about a plan. ``fit`` plans here at ``setup`` (``ShardingConfig.shard`` in :mod:`lightning_rec._strategy`, on rank 0,
broadcast); ``lightning-rec plan`` and :func:`lightning_rec.plan_cluster` plan here for any cluster, on one machine.

The pipeline, one module each (TorchRec's ``distributed/planner`` is the pattern):

* :mod:`~lightning_rec._planner.inventory`: the model's tables, taken once (:class:`TableInventory`);
* :mod:`~lightning_rec._planner.request`: what the planner is asked (:class:`PlanRequest`: tables, ranks, device,
  constraints, sharders, optimizer state);
* :mod:`~lightning_rec._planner.topology`: device presets and TorchRec's ``Topology``;
* :mod:`~lightning_rec._planner.devices`: what each device trains, the default constraints, and the refusals;
* :mod:`~lightning_rec._planner.sharders`: the sharders of every table module (row-wise on CPU too);
* :mod:`~lightning_rec._planner.planner`: a request in, one plan and its report out (:func:`make_plan`);
* :mod:`~lightning_rec._planner.report`: the plan with the planner's estimates (:class:`PlanReport`), as JSON, a
  log table (:mod:`~lightning_rec._planner.table`), per-rank estimates (:mod:`~lightning_rec._planner.estimates`)
  and a picture (:mod:`~lightning_rec._planner.chart`);
* :mod:`~lightning_rec._planner.files`: a plan file read back as TorchRec's plan and checked against the run;
* :mod:`~lightning_rec._planner.cluster`, :mod:`~lightning_rec._planner.offline`,
  :mod:`~lightning_rec._planner.sweep`, :mod:`~lightning_rec._planner.fit`: a cluster planned from one machine, a
  sweep of clusters, and why a model does not fit; :mod:`~lightning_rec._planner.command`: ``lightning-rec plan``;
* :mod:`~lightning_rec._planner.constants`: the planner's numbers, each named once.

Example::

    tables = TableInventory.of(model)                                    # the tables, walked once
    request = strategy.sharding.request(tables, EmbeddingOptimizer("adagrad", lr=0.1), world_size=16,
                                        local_world_size=8, device_type="cuda", preset=DEVICE_PRESETS["h100"])
    plan, report = make_plan(model, request)
"""
