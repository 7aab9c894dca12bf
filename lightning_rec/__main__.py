"""``python -m lightning_rec``: the ``lightning-rec`` command (``fit``, ``validate``, ``plan``, ``export``, ...).

Example::

    python -m lightning_rec fit --config movielens_deepfm

The console script's own entry point, which answers the top-level ``--help`` before importing anything heavy (here
the package is already imported: ``-m`` imports it first).
"""

from _lightning_rec_cli import main

if __name__ == "__main__":
    main()
