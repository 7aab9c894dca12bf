"""Injected failures for the fault tests (now public in :mod:`lightning_rec.testing.failures`, re-exported here)."""

from lightning_rec.testing.failures import FailAt, failure_time

__all__ = ["FailAt", "failure_time"]
