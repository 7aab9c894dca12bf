"""What enters the sharded tables and the loss, checked so that bad data fails loudly, precisely and early.

* :mod:`~lightning_rec._inputs.checks`: :class:`InputChecks`, the policy the strategy runs on every batch (on the
  host before the copy, at every sharded module's door, and the loss);
* :mod:`~lightning_rec._inputs.specs`: what each sharded module expects (:class:`ModuleInputs`,
  :class:`FeatureTables`, :func:`input_specs`);
* :mod:`~lightning_rec._inputs.kjt`: the checks of one ``KeyedJaggedTensor`` (:func:`check_features`,
  :func:`check_on_host`), usable on their own, e.g. to validate a data pipeline offline.

Example::

    specs = input_specs(model)                                  # before sharding
    kjt = check_features(batch.sparse_features, specs["ebc"])   # InputError, or the KJT in the module's order
"""
