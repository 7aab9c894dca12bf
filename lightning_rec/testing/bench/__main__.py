"""``python -m lightning_rec.testing.bench`` (see :mod:`lightning_rec.testing.bench`)."""

from lightning_rec.testing.bench.runner import main

main()
