"""``python -m lightning_rec``: the ``lightning-rec`` command (``fit``, ``validate``, ``plan``, ``export``, ...).

Example::

    python -m lightning_rec fit --config examples/configs/movielens_deepfm.yaml
"""

from lightning_rec._cli import main

if __name__ == "__main__":
    main()
