"""What several test modules share; a scenario or helper that serves one test module lives in that module.

* ``dist``: the multi-process harness (:mod:`lightning_rec.testing.launch` bound to the tests; one rank runs in
  the test's own process).
* ``scenarios``, ``checkpoint_scenarios``, ``user_scenarios``: what one rank does, for several test modules (and
  ``benchmarks/failure_latency.py``).
* ``models``, ``user_models``, ``data``: small models and batches, the user-written model, MovieLens-100K.
* ``zoo`` and its cases ``zoo_<model>``: a shipped model against plain PyTorch (its model's tests and the serving
  tests).
* ``serving``: running serving artifacts as a serving host would.
* ``user_script``, ``launched_job``: programs started as a user starts them (``python -m tests.helpers.<name>``),
  so they must be importable as a program, not test modules.
"""
