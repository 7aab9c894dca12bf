"""``python -m lightning_rec.bench`` (see :mod:`lightning_rec.bench`)."""

from lightning_rec.bench.runner import main

main()
