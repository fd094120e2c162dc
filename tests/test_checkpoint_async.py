"""Asynchronous saves on a 2-rank world: snapshots, the busy policy, a full disk.

The full-disk case runs on a real 2 MB tmpfs (mounting needs root); where mounting is
not permitted it is skipped, and ``test_checkpoint.py`` still covers an injected
ENOSPC at the storage layer.
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint_checks import small_tmpfs
from tests.conftest import run_world


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory):
    """A 2 MB tmpfs, or None with the reason it could not be mounted."""
    where = tmp_path_factory.mktemp("small_fs")
    with small_tmpfs(where, "2M") as why_not:
        yield (None, why_not) if why_not else (where, None)


@pytest.fixture(scope="module")
def world(tmp_path_factory, small_fs):
    out = tmp_path_factory.mktemp("ckpt_async")
    full, _ = small_fs
    run_world(2, "tests.workers.checkpoint_async",
              ["--out", str(out)] + (["--full", str(full)] if full else []), timeout=240)
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(300)
def test_each_async_save_holds_the_state_at_its_call(world):
    for rank in world:
        assert rank["snapshots"]["committed"] == [1, 2, 3]
        assert rank["snapshots"]["exact"] == [True, True, True]


@pytest.mark.timeout(300)
def test_save_due_while_busy_is_skipped(world):
    for rank in world:
        assert rank["skip"] == {"skipped": [False, True], "committed": [1]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_full_disk_fails_the_save_and_keeps_the_previous_step(world, small_fs, on_error):
    if small_fs[0] is None:
        pytest.skip(small_fs[1])
    for rank in world:
        case = rank["full_disk"][on_error]
        assert case["committed"] == [1] and case["previous_loads"]
        assert case["leftovers"] == []
        [message] = case["logged"] if on_error == "continue" else [case["raised"]]
        assert "No space left on device" in message
        assert "the previous checkpoint (step 1) is intact" in message
        assert (case["raised"] is None) == (on_error == "continue")
