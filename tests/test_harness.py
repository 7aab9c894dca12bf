"""The tests' harness (``tests.helpers.dist.run_ranks``): one rank runs in this process as a spawned rank would,
and leaves the process as it found it; ``subprocess=True`` spawns it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import REPO, run_ranks


def test_one_rank_runs_here_as_a_spawned_rank_would_and_leaves_nothing_behind(tmp_path: Path) -> None:
    cwd, threads, env = os.getcwd(), torch.get_num_threads(), dict(os.environ)
    with pytest.warns(UserWarning, match="a warning from the rank"):  # not silenced: it reaches pytest
        (here,) = run_ranks(where_am_i, 1, tmp_path / "here", pair=(1, 2))
    assert here["pid"] == os.getpid() and here["rank"] == 0 and here["world_size"] == 1
    assert here["cwd"] == str(tmp_path / "here") and here["out_dir"] == here["cwd"]
    assert here["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    assert here["threads"] == 1 and here["group_size"] == 1
    assert here["pair"] == [1, 2], "the result goes through JSON, as a spawned rank's does"
    assert (tmp_path / "here" / "tests.test_harness:where_am_i.rank0.json").exists()
    # ... and the process is as it was: no process group, the same environment, directory and threads.
    assert not dist.is_initialized()
    assert (os.getcwd(), torch.get_num_threads(), dict(os.environ)) == (cwd, threads, env)


@pytest.mark.filterwarnings("ignore:a warning from the rank")
def test_a_rank_that_fails_here_raises_its_own_error_and_still_cleans_up(tmp_path: Path) -> None:
    env = dict(os.environ)
    with pytest.raises(ValueError, match="the rank's own error"):
        run_ranks(where_am_i, 1, tmp_path, fail=True)
    assert not dist.is_initialized() and dict(os.environ) == env


@pytest.mark.dist
def test_subprocess_true_spawns_the_rank(tmp_path: Path) -> None:
    (there,) = run_ranks(where_am_i, 1, tmp_path, subprocess=True, pair=(1, 2))
    assert there["pid"] != os.getpid()
    assert there["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    assert there["threads"] == 1 and there["pair"] == [1, 2] and there["cwd"] == str(tmp_path)


# ------------------------------------------------------------------------------------------------------------
# What the rank runs (run_ranks imports it from this module).
# ------------------------------------------------------------------------------------------------------------


def where_am_i(
    rank: int, world_size: int, out_dir: Path, pair: tuple[int, int] = (0, 0), fail: bool = False
) -> dict[str, Any]:
    """Where the rank ran and what it was given; it warns, and leaves its process group behind (as a fit does)."""
    dist.init_process_group("gloo")
    warnings.warn("a warning from the rank", UserWarning, stacklevel=1)
    if fail:
        raise ValueError("the rank's own error")
    return {
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world_size,
        "out_dir": str(out_dir),
        "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")},
        "threads": torch.get_num_threads(),
        "group_size": dist.get_world_size(),
        "pair": pair,
    }


def exits_as_told(rank: int, world_size: int, out_dir: Path, code: int = 0) -> dict[str, Any]:
    """Registers an exit handler (as the strategy does to close its process group), then ends with ``code``."""
    import atexit

    atexit.register(lambda: (out_dir / f"atexit{rank}").write_text("ran"))
    if code:
        raise SystemExit(code)
    return {"pid": os.getpid()}


@pytest.mark.dist
@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_ranks_forked_from_the_zygote_end_as_an_interpreter_does(tmp_path: Path, fresh: bool) -> None:
    """A rank forked from the zygote (the default) and a fresh interpreter end alike: exit handlers run, and the
    scenario's exit code is the process's."""
    from lightning_rec.testing.launch import launch

    ok = launch(exits_as_told, 2, tmp_path / "ok", scenarios=None, pythonpath=[str(REPO)], fresh=fresh)
    assert [p.returncode for p in ok.processes] == [0, 0] and all(r is not None for r in ok.results)
    assert [(tmp_path / "ok" / f"atexit{r}").read_text() for r in range(2)] == ["ran", "ran"]
    bad = launch(exits_as_told, 1, tmp_path / "bad", pythonpath=[str(REPO)], fresh=fresh, code=7)
    assert [p.returncode for p in bad.processes] == [7] and (tmp_path / "bad" / "atexit0").read_text() == "ran"
