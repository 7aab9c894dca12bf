"""Independent jobs of one test module run side by side, two at a time, from a module-scoped fixture.

A ``lightning-rec fit`` on 2 ranks spends most of its start importing on one core at a time (Lightning's launcher
starts rank 1 once rank 0 has imported everything), as does a single-process script: on a 2-core machine a second
such job beside it costs little wall time. The fixture queues the jobs of the cases this session runs (not those
``-k`` left out), and each case waits for its own job's result and asserts on it.

Example::

    @pytest.fixture(scope="module")
    def runs(request):
        configs = selected(request, "test_a_config_trains", "config")
        with side_by_side({c: functools.partial(fit, c) for c in configs}) as futures:
            yield futures

    @pytest.mark.parametrize("config", CONFIGS)
    def test_a_config_trains(runs, config):
        assert runs[config].result().returncode == 0
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def selected(request: pytest.FixtureRequest, test: str, param: str | None = None) -> list[Any]:
    """The cases of the requesting module's test function ``test`` that this session runs: each one's value of the
    parameter ``param``, or ``None`` for an unparametrized test (an empty list: not selected)."""
    return [
        item.callspec.params[param] if param else None
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module and item.originalname == test
    ]


@contextlib.contextmanager
def side_by_side(jobs: dict[K, Callable[[], T]], workers: int = 2) -> Iterator[dict[K, Future[T]]]:
    """Run ``jobs`` (callables that start a subprocess and wait for it) ``workers`` at a time, in their order; yield
    each one's future. Leaving waits for every job (each has its own timeout). The jobs must not read state the tests
    change (``os.environ``, the working directory): give them what they need when they are made."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield {key: pool.submit(job) for key, job in jobs.items()}
